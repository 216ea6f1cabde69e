"""config.reward: what the trainer is rewarded with, when it is not the task's exact score.

The stage itself is rl/rewards.py; this module imports no JAX.
"""

from __future__ import annotations

import dataclasses

from rl.settings import Settings, setting

REWARD_KINDS = ("verifier", "majority_vote")


@dataclasses.dataclass(frozen=True)
class RewardSettings(Settings):
  """config.reward: a noisy verifier and its second opinion, or TTRL's label-free majority
  vote, in place of the task's exact reward (rl/rewards.py). At the defaults the trainer
  sees the task's reward unchanged.

  >>> RewardSettings(kind="majority_vote", false_negative=0.2).check()
  Traceback (most recent call last):
  ...
  ValueError: config.reward.false_negative = 0.2 injects verifier errors, and config.reward.kind = 'majority_vote' rewards agreement with the group's majority answer without a verifier; set reward.false_negative = reward.false_positive = 0 or reward.kind = 'verifier'.
  """
  SECTION = "reward"
  kind: str = setting("verifier", "verifier: the task's scorer (with the noise below) | "
                      "majority_vote: TTRL (arXiv 2504.16084), reward 1 for a completion whose "
                      "answer is its group's most common one, no labels read",
                      choices=REWARD_KINDS)
  false_negative: float = setting(0.0, "share of correct completions the verifier fails "
                                  "(reward 0), drawn per distinct (prompt, completion) from "
                                  "the run's seed", low=0, high=1.0)
  false_positive: float = setting(0.0, "share of wrong completions the verifier passes "
                                  "(reward 1), drawn likewise", low=0, high=1.0)
  second_opinion: bool = setting(False, "re-check every completion the verifier failed with "
                                 "the task's second scorer (running_sum: the exact check; "
                                 "gsm_symbolic: math-verify's own extraction; TinyV, arXiv "
                                 "2505.14625), counting its calls and time")

  @property
  def noisy(self) -> bool:
    return bool(self.false_negative or self.false_positive)

  @property
  def active(self) -> bool:
    """Whether the stage changes anything (else the trainer sees the task's reward)."""
    return self.kind != "verifier" or self.noisy or self.second_opinion

  def check(self) -> None:
    super().check()
    if self.kind == "majority_vote":
      for name in ("false_negative", "false_positive"):
        if getattr(self, name):
          raise ValueError(
              f"config.reward.{name} = {getattr(self, name)} injects verifier errors, and "
              "config.reward.kind = 'majority_vote' rewards agreement with the group's "
              "majority answer without a verifier; set reward.false_negative = "
              "reward.false_positive = 0 or reward.kind = 'verifier'.")
      if self.second_opinion:
        raise ValueError("config.reward.second_opinion re-checks the verifier's failures, and "
                         "config.reward.kind = 'majority_vote' has no verifier; set one of "
                         "them back.")
