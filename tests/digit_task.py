"""A trivially learnable task for short learning tests (tests/test_train.py, tests/test_lora.py).

A module of its own so that tests can share it and the scoring worker can import it.
"""

from rl.tasks import Example


class DigitTask:
  """Reward = fraction of completion characters that are digits; every prompt is "a"."""
  name = "digits"

  def examples(self, split, n, start=0):
    return [Example(prompt="a", answer="1", entry={}) for _ in range(n)]

  def reward(self, completion, example):
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1) if completion else 0.0

  def exact_match(self, completion, example):
    return bool(completion) and completion.isdigit()
