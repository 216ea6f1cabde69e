"""config.moe: what a mixture-of-experts policy adds to the GRPO objective.

The model side is models/moe.py and models/transformer.py; the objective side is
rl/objectives/composite.py `RouterTerms`. This module imports no JAX.
"""

from __future__ import annotations

import dataclasses

from rl.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class MoeSettings(Settings):
  """config.moe: rollout routing replay (R3) and the router's auxiliary losses, for a
  policy whose MLPs are mixtures of experts (config.model.preset 'tiny2_moe' or a
  Qwen3-MoE / Mixtral checkpoint). A dense policy refuses any non-default field.

  >>> MoeSettings(load_balancing_coef=-1.0).check()
  Traceback (most recent call last):
  ...
  ValueError: config.moe.load_balancing_coef = -1.0 must be >= 0.
  """
  SECTION = "moe"
  routing_replay: bool = setting(False, "R3 (arXiv 2510.11370): the trainer's forward runs "
                                 "each token through the experts the sampler chose for it in "
                                 "each layer, weighted by the trainer's own router "
                                 "renormalised over them")
  load_balancing_coef: float = setting(0.0, "weight of the Switch / Mixtral load-balancing "
                                       "loss (mean over layers) added to the objective; "
                                       "off in RL, as peers run it", low=0)
  router_z_coef: float = setting(0.0, "weight of ST-MoE's router z-loss (mean over layers) "
                                 "added to the objective", low=0)

  @property
  def active(self) -> bool:
    """Whether any field differs from its default (a dense policy refuses that)."""
    return self != MoeSettings()

  def router_terms(self, model_config, rl_phase: bool, source: str):
    """config.moe as the RL train step reads it (`rl.objectives.composite.RouterTerms`):
    None for a dense policy, which refuses an active config.moe (`source` names the
    preset or checkpoint), and for the warm start (teacher-forced rows: no routing record,
    and no router losses in supervised training)."""
    if not model_config.is_moe:
      if self.active:
        raise ValueError(f"config.moe = {self} needs a mixture-of-experts policy; {source} "
                         "is dense (use preset 'tiny2_moe' or a Qwen3-MoE / Mixtral "
                         "checkpoint).")
      return None
    if not rl_phase:
      return None
    from rl.objectives import composite  # pylint: disable=import-outside-toplevel
    return composite.RouterTerms(routing_replay=self.routing_replay,
                                 load_balancing_coef=self.load_balancing_coef,
                                 router_z_coef=self.router_z_coef)
