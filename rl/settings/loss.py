"""config.loss: the objective, its corrections and every setting they read.

The objectives themselves are in rl/objectives/losses.py, which also checks these settings
against them (`rl.objectives.losses.check`); this module imports nothing above
rl/settings/, so the default config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from rl.settings import Settings, as_tuple, setting

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
PROX_ESTIMATES = ("recompute", "loglinear")

# The fields an objective may fix (`make_objective(..., **overrides)`) and their values where
# it does not. The run config leaves them unset (None) so that a value a user sets, even one
# equal to this default, is seen, and refused where the objective fixes another.
FIXABLE_DEFAULTS = dict(eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean")
OBJECTIVE_FIXABLE = tuple(FIXABLE_DEFAULTS)
VCPO_IS_LEVELS = ("sequence", "token")
TOKEN_SUBSAMPLES = ("none", "urs", "rpc")


def resolve_norm_len(norm_len: float, max_new_tokens: int) -> float:
  """config.loss.norm_len, with 0 meaning the completion budget (rollout.max_new_tokens):
  Dr.GRPO divides every sequence's token sum by one constant, the generation budget."""
  return float(norm_len) if norm_len else float(max_new_tokens)


def _same(a, b) -> bool:
  """Config values equal, tuples and lists alike (a flag gives a tuple as a list)."""
  return as_tuple(a) == as_tuple(b)


@dataclasses.dataclass(frozen=True)
class LossSettings(Settings):
  """config.loss: the objective, its corrections and every setting they read.

  A correction factory's defaults (rl.objectives.corrections) are these fields' (a test
  checks). `rl.objectives.losses.check` refuses, before any training, an unknown objective,
  aggregation or correction, a correction chain that cannot work, and a field that is set
  and that the objective would override (DAPO fixes eps_high = 0.28) or never read (M2PO
  has no clip widths): a setting accepted and then ignored would silently change what a
  run means. A field of OBJECTIVE_FIXABLE counts as set when it is not None, any other
  when it differs from its default (`changed_fields`). `resolved(overrides=...)` is what
  the objective runs with.

  >>> dapo = LossSettings(name="dapo").resolved(overrides=dict(eps_high=0.28))
  >>> dapo.eps_low, dapo.eps_high, dapo.aggregation
  (0.2, 0.28, 'seq_mean_token_mean')
  >>> LossSettings(name="m2po", eps_high=0.3).changed_fields()
  ['name', 'eps_high']
  """
  SECTION = "loss"
  name: str = setting("grpo", "the objective: a name in rl/objectives/losses.py's LOSSES "
                      "registry (docs/add_objective.md adds one)")
  eps_low: Optional[float] = setting(
      None, "PPO clip: ratio >= 1 - eps_low where A < 0 (unset: the objective's own value "
      "where it fixes one, else 0.2; a value set is refused where the objective fixes "
      "another or never reads it)", low=0, optional=True)
  eps_high: Optional[float] = setting(
      None, "PPO clip: ratio <= 1 + eps_high where A > 0 (unset: the objective's, else 0.2)",
      low=0, optional=True)
  aggregation: Optional[str] = setting(
      None, "token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (unset: the "
      "objective's, else seq_mean_token_mean)", choices=AGGREGATIONS, optional=True)
  norm_len: float = setting(0.0, "constant normaliser of seq_mean_token_sum_norm (Dr.GRPO; "
                            "0 = rollout.max_new_tokens, the generation budget)", low=0)
  kl_coef: float = setting(0.0, "k3 KL to a reference policy: the launcher wires none and "
                           "refuses > 0 (rl.train's step takes batch.ref_logp)", low=0)
  corrections: tuple[str, ...] = setting(
      (), "off-policy corrections (rl/objectives/corrections.py) appended to the objective's "
      "own, in order: tis | mis | m2po | sat | vcpo_baseline | vcpo_ess | mu_veto | "
      "score_centering")
  prox_estimate: str = setting("recompute", "proximal log-probs: recompute (a forward) | "
                               "loglinear", choices=PROX_ESTIMATES)
  is_cap: float = setting(5.0, "TIS truncation / MIS upper bound (decoupled PPO's cap)",
                          low=0, low_open=True)
  is_floor: float = setting(0.0, "MIS lower bound", low=0)
  sc_top_k: int = setting(64, "score centering: tokens of the sampler's distribution "
                          "recorded per slot (its top K; 0 = the whole vocabulary, exact)",
                          low=0)
  sc_eps: float = setting(1e-6, "score centering: floor of the trainer's tail mass 1 - "
                          "sum_H p in the tail scale rho", low=0, low_open=True)
  # M2PO bound on the kept tokens' mean d^2: 0.04 = (0.2)^2, a typical |log-ratio| of 0.2,
  # about PPO's eps = 0.2 trust region in log space (log 1.2 = 0.18); the M2PO paper's value.
  m2_tau: float = setting(0.04, "M2PO: kept tokens' mean squared log-ratio <= tau", low=0,
                          low_open=True)
  sat_quantile: float = setting(0.9, "SAT: tail quantile of |logp - behav| in the batch",
                                low=0, low_open=True, high=1.0)
  sat_bandwidth: float = setting(0.1, "SAT: kernel exp(-(|d| - q) / bandwidth)", low=0,
                                 low_open=True)
  vcpo_rho_ref: float = setting(1.0, "VCPO: lr scale sqrt(min(1, ESS ratio / rho_ref))",
                                low=0, low_open=True)
  vcpo_is_cap: float = setting(8.0, "VCPO: truncation of the IS weight", low=0,
                               low_open=True)
  vcpo_is_level: str = setting("sequence", "VCPO: one weight per sequence (the authors') | "
                               "token", choices=VCPO_IS_LEVELS)
  # Mu-GRPO's relaxed band [1/2, 2] (|log r| <= log 2, symmetric in log space): its clip
  # interval and its veto's trigger (chosen; the paper's values were not available).
  mu_eps_low: float = setting(0.5, "mu_grpo relaxed clip: ratio >= 1 - mu_eps_low where "
                              "A < 0; a response with A < 0 is vetoed from its first token "
                              "outside [1 - mu_eps_low, 1 + mu_eps_high]", low=0)
  mu_eps_high: float = setting(1.0, "mu_grpo relaxed clip: ratio <= 1 + mu_eps_high where "
                               "A > 0 (default interval [1/2, 2])", low=0)

  token_subsample: str = setting(
      "none", "NAT (arXiv 2603.06619): train on a random subset of the completion tokens, "
      "Horvitz-Thompson reweighted (rl/objectives/token_subsample.py): none | urs (each "
      "token kept with probability token_keep) | rpc (a random prefix of every row, one cut "
      "draw per batch: the batch gets shorter, and with rollout.train_length_buckets the step "
      "cheaper)",
      choices=TOKEN_SUBSAMPLES)
  token_keep: float = setting(0.5, "NAT: the expected fraction of completion tokens trained "
                              "(the paper's headline: 0.5)", low=0, low_open=True, high=1.0)

  def resolved(self, max_new_tokens: int | None = None, *,
               overrides: Mapping[str, object]) -> "LossSettings":
    """What the objective runs with: the fields it fixes (`overrides`: the objective's,
    `rl.objectives.losses.resolve` passes them), the other unset fields at
    FIXABLE_DEFAULTS, and with `max_new_tokens` norm_len 0 as the generation budget
    (`resolve_norm_len`)."""
    values = {f: v for f, v in FIXABLE_DEFAULTS.items() if getattr(self, f) is None}
    values.update(overrides, corrections=tuple(self.corrections))
    if max_new_tokens is not None:
      values["norm_len"] = resolve_norm_len(self.norm_len, max_new_tokens)
    return dataclasses.replace(self, **values)

  def changed_fields(self) -> list[str]:
    """The fields set by the config: an objective-fixable field when not None, any other
    when it differs from its default (`rl.objectives.losses.check` refuses one that the
    objective overrides or never reads)."""
    defaults = self.defaults()
    return [field for field in defaults
            if getattr(self, field) is not None
            and (field in OBJECTIVE_FIXABLE or not _same(getattr(self, field), defaults[field]))]
