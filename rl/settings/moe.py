"""config.moe: what a mixture-of-experts policy adds to the GRPO objective.

The model side is models/moe.py and models/transformer.py; the objective side is
rl/objectives/composite.py `RouterTerms.from_settings`. This module imports nothing above
rl/settings/.
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
