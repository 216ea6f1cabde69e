"""config.tools: the environment that answers the policy mid-rollout, and its budgets.

The multi-turn rollout is rl/environments/turns.py; this module imports no JAX, so the
default config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses

from rl.environments import ENVIRONMENTS
from rl.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class ToolSettings(Settings):
  """config.tools: the environment that answers the policy mid-rollout, and its budgets.

  A row pauses when it writes the environment's call (e.g. "?+5="), the environment's
  answer ("1234572") is appended as context that nothing trains on, and decoding resumes.
  Budgets changed from their defaults without an environment are refused (they would be
  ignored)."""
  SECTION = "tools"
  name: str = setting("", "the environment: \"\" = off; adder (running_sum's \"?a+b=\") | "
                      "calculator (GSM8K's \"<<48/2=\" -> \"24>>\"); rl/environments/")
  max_turns: int = setting(16, "environment answers per rollout; a row's next call past "
                           "them ends it", low=1)
  max_observation_tokens: int = setting(32, "an answer is cut to this many tokens (and to "
                                        "the row's remaining budget)", low=1)
  timeout_s: float = setting(0.0, "time limit of one environment step in the scoring worker "
                             "(0 = the environment's own, 1 s for built-ins)", low=0)

  def check(self) -> None:
    super().check()
    if self.name:
      ENVIRONMENTS.get(self.name)
      return
    defaults = self.defaults()
    changed = [k for k in ("max_turns", "max_observation_tokens", "timeout_s")
               if getattr(self, k) != defaults[k]]
    if changed:
      raise ValueError(f"config.tools.{changed[0]} = {getattr(self, changed[0])!r} has no "
                       "effect without an environment: set config.tools.name (e.g. 'adder'), "
                       f"or leave it at its default {defaults[changed[0]]!r}.")
