"""config.tools: the environment that answers the policy mid-rollout, and its budgets.

The multi-turn rollout is rl/environments/turns.py; this module imports no JAX, so the
default config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses

from rl.settings import Settings, setting, used_when


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
                           "them ends it", low=1, used_when=used_when("name"))
  max_observation_tokens: int = setting(32, "an answer is cut to this many tokens (and to "
                                        "the row's remaining budget)", low=1,
                                        used_when=used_when("name"))
  timeout_s: float = setting(0.0, "time limit of one environment step in the scoring worker "
                             "(0 = the environment's own, 1 s for built-ins)", low=0,
                             used_when=used_when("name"))
