"""Tasks whose scorers misbehave on purpose, for tests/test_scoring.py.

They live in a module of their own that imports only the standard library, because the
scoring worker imports a task's module to rebuild it, after every restart.
"""

import dataclasses
import math
import os
import time

HANG_MARKER = "9**9**9"


def power_tower(text: str) -> int:
  """Evaluates 'a**b**c' with Python ints, as a naive scorer would: 9**9**9 never returns."""
  parts = [int(part) for part in text.split("**")]
  value = parts[-1]
  for part in reversed(parts[:-1]):  # ** is right-associative
    value = part ** value
  return value


@dataclasses.dataclass(frozen=True)
class MisbehavingTask:
  """Reward min(len, 10) / 10, except on markers: SLEEP and SPIN never return, POW computes
  9**9**9, RAISE raises, NAN returns NaN, TEXT returns a string, EXIT kills the process."""
  name: str = "misbehaving"

  def reward(self, completion, example):
    del example
    if completion == "SLEEP":
      time.sleep(3600)
    if completion == "SPIN":
      while True:
        pass
    if completion == "POW":
      return float(power_tower(HANG_MARKER) > 0)
    if completion == "RAISE":
      raise ZeroDivisionError("scorer bug")
    if completion == "NAN":
      return math.nan
    if completion == "TEXT":
      return "abc"
    if completion == "EXIT":
      os._exit(3)  # pylint: disable=protected-access
    return min(len(completion), 10) / 10


@dataclasses.dataclass(frozen=True)
class SlowTask:
  """Reward 1 after `seconds` of sleep: slower than the worker's flush interval, so each
  result goes back in a message of its own."""
  name: str = "slow"
  seconds: float = 0.02

  def reward(self, completion, example):
    del completion, example
    time.sleep(self.seconds)
    return 1.0


@dataclasses.dataclass(frozen=True)
class DigitsUnlessTower:
  """Reward = fraction of digit characters, but a completion containing HANG_MARKER is
  evaluated as a power tower first (and so never scores): the loop test's task. Its
  scorer's time limit is its own `reward_timeout_s` (rl.scoring reads it)."""
  name: str = "digits_unless_tower"
  reward_timeout_s: float = 0.5

  def examples(self, split, n, start=0):
    from rl.tasks import Example  # pylint: disable=import-outside-toplevel
    del split
    return [Example(prompt=f"{(start + i) % 10}=", answer="1", entry={}) for i in range(n)]

  def reward(self, completion, example):
    del example
    if HANG_MARKER in completion:
      return float(power_tower(HANG_MARKER) > 0)
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
