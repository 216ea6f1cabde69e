"""config.selection: which prompts a GRPO step rolls out (uniform, DAPO dynamic sampling,
GRESO's skip rule, adaptive allocation, PODS, AR3PO), with the rules' subsections.

The rules are in rl/rollouts/selection.py; this module imports nothing above rl/settings/,
so the default config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses

from rl.settings import Settings, nested, setting, used_when

SCORES = ("variance", "beta")  # adaptive allocation's per-prompt scores


@dataclasses.dataclass(frozen=True)
class GresoSettings(Settings):
  """GRESO's skip rule (config.selection.greso; module docstring)."""
  SECTION = "selection.greso"
  explore_prob: float = setting(0.5, "initial p_e: keep prob after z all-equal groups is "
                                "p_e**z", low=0, low_open=True, high=1.0)
  min_keep_prob: float = setting(0.05, "exploration floor on the keep probability (<= "
                                 "explore_prob)", low=0, low_open=True, high=1.0)
  max_skips: int = setting(10, "a prompt skipped this many epochs in a row is rolled out",
                           low=0)
  target_zero_variance: float = setting(0.25, "p_e adapts to keep each class's share near "
                                        "this", low=0, high=1.0)
  adapt_step: float = setting(0.01, "p_e change per rollout round (0 = fixed p_e)", low=0)
  refill: bool = setting(True, "then DAPO dynamic sampling (False: train on all rolled out)")

  def check(self) -> None:
    super().check()
    if self.min_keep_prob > self.explore_prob:
      raise ValueError(f"config.selection.greso needs min_keep_prob ({self.min_keep_prob}) "
                       f"<= explore_prob ({self.explore_prob}).")


@dataclasses.dataclass(frozen=True)
class AdaptiveSettings(Settings):
  """Adaptive allocation of the rollout budget (config.selection.adaptive)."""
  SECTION = "selection.adaptive"
  prompts: int = setting(0, "prompts per step given pilot rollouts (0 = prompts_per_step)",
                         low=0)
  initial_rollouts: int = setting(4, "pilot rollouts per prompt", low=2)
  max_rollouts: int = setting(0, "cap per prompt (0 = 2 * group_size)", low=0)
  score: str = setting("variance", "variance (pilot reward std) | beta (posterior std)",
                       choices=SCORES)
  history_decay: float = setting(0.5, "weight of a prompt's past rollouts per epoch (pool)",
                                 low=0, high=1.0)


@dataclasses.dataclass(frozen=True)
class PodsSettings(Settings):
  """PODS max-variance down-sampling (config.selection.pods)."""
  SECTION = "selection.pods"
  rollouts: int = setting(0, "completions sampled per prompt (n) before keeping the "
                          "group_size with the largest reward variance (0 = 2 * group_size)",
                          low=0)


@dataclasses.dataclass(frozen=True)
class Ar3poSettings(Settings):
  """AR3PO's adaptive rollout and response reuse (config.selection.ar3po)."""
  SECTION = "selection.ar3po"
  stages: int = setting(2, "rollout stages: each gives group_size / stages completions to "
                        "every prompt with no exact answer yet", low=1)
  reuse: bool = setting(True, "put a prompt's stored exact response into its all-wrong group")


@dataclasses.dataclass(frozen=True)
class SelectionSettings(Settings):
  """config.selection: which prompts a GRPO step rolls out, and how often (the rules are
  rl/rollouts/selection.py's SELECTION_RULES; `rl.composition.check` checks the name and
  the rule's own constraints).

  >>> SelectionSettings(kind="pods", pods=PodsSettings(rollouts=16)).check()
  >>> SelectionSettings(pods=PodsSettings(rollouts=16)).check()
  Traceback (most recent call last):
  ...
  ValueError: config.selection.pods.rollouts = 16 has no effect with config.selection.kind = 'uniform': it is read only when config.selection.kind = 'pods'. Set that, or leave config.selection.pods.rollouts at its default 0.
  """
  SECTION = "selection"
  kind: str = setting("uniform", "uniform | dynamic (DAPO) | greso | adaptive | pods | "
                      "ar3po (SELECTION_RULES)")
  # Read only by a rule that refills its batch: rl.composition refuses it changed otherwise.
  max_attempts: int = setting(8, "dynamic / greso: rollout rounds to fill a batch, then error",
                              low=1)
  greso: GresoSettings = nested(GresoSettings, "GRESO's skip rule",
                                used_when=used_when("kind", "greso"))
  adaptive: AdaptiveSettings = nested(AdaptiveSettings, "adaptive allocation",
                                      used_when=used_when("kind", "adaptive"))
  pods: PodsSettings = nested(PodsSettings, "PODS max-variance down-sampling",
                              used_when=used_when("kind", "pods"))
  ar3po: Ar3poSettings = nested(Ar3poSettings, "AR3PO adaptive rollout and response reuse",
                                used_when=used_when("kind", "ar3po"))
