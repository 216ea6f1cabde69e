"""Tasks whose scorers misbehave on purpose, for tests/test_scoring.py, and hostile
completions of the math task, for the tests that time its scorer.

They live in a module of their own that imports only the standard library, because the
scoring worker imports a task's module to rebuild it, after every restart.
"""

import dataclasses
import math
import os
import pickle
import stat
import struct
import time

HANG_MARKER = "9**9**9"
HOARD_CHUNK = 2**28       # HOARD allocates this much at a time ...
HOARD_CAP = 256 * 2**28   # ... and stops at 64 GiB when nothing stopped it sooner
BIG_FILE_OFFSET = 2**31   # BIGFILE writes one byte past 2 GiB (a sparse file)

# Completions that attack the math task's answer parser (rl/tasks/gsm.py, rl/tasks/math_answer.py). The
# first MATH_UNFINISHABLE never finish in math-verify: each is ended by rl.tasks.math_answer's
# bound (VERIFY_TIMEOUT_S, about a second) and counted as a timeout.
MATH_HOSTILE = [
    "\\boxed{10^{10^{10}}}", "\\boxed{9^{9^{9}}}", "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "\\boxed{99999999999^{99999999}}", "\\boxed{10!!!!!}",
    "\\boxed{" + "(" * 23 + "1" + ")" * 23 + "}",                 # ANTLR backtracking
    "\\boxed{" + "{" * 40 + "1" + "}" * 40 + "}",
    "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}",     # over MAX_ANSWER_CHARS
    "\\boxed{" * 100_000, "#### " * 100_000, "1" * 1_000_000, "1," * 300_000,
    "-" * 100_000 + "1", "x" * 1_000_000,
    "\\boxed{__import__('os').system('touch PWNED')}",
    "#### __import__('os').system('touch PWNED')",
]
MATH_UNFINISHABLE = 7


def assert_each_hostile_math_completion_is_bounded(clock, bound_s: float = 3.5) -> None:
  """Scores every MATH_HOSTILE completion against the answer 72 (rl.tasks.gsm.score): each
  scores 0 or times out, within `bound_s` seconds of `clock` (time.process_time for CPU time,
  time.perf_counter for wall time)."""
  from rl.tasks import gsm  # pylint: disable=import-outside-toplevel
  for completion in MATH_HOSTILE:
    start = clock()
    try:
      assert gsm.score(completion, "72") == (0.0, False)
    except TimeoutError:
      pass
    assert clock() - start < bound_s, completion[:40]


def power_tower(text: str) -> int:
  """Evaluates 'a**b**c' with Python ints, as a naive scorer would: 9**9**9 never returns."""
  parts = [int(part) for part in text.split("**")]
  value = parts[-1]
  for part in reversed(parts[:-1]):  # ** is right-associative
    value = part ** value
  return value


class _CreatesFile:
  """Unpickling this opens `path` for writing, creating it: the proof that a reply ran."""

  def __init__(self, path: str):
    self.path = path

  def __reduce__(self):
    return open, (self.path, "w")


def crafted_reply(length_format: str, marker: str) -> bytes:
  """A pickle that creates `marker` when loaded, behind a big-endian length in
  `length_format` ("i": multiprocessing's Connection frame, "Q": an 8-byte length)."""
  payload = pickle.dumps(_CreatesFile(marker))
  return struct.pack("!" + length_format, len(payload)) + payload


def write_to_sockets(data: bytes) -> None:
  """Writes `data` into every socket this process holds (the scoring worker's: its reply
  channel to the trainer), as a scorer tricked into running code could."""
  for name in os.listdir("/proc/self/fd"):
    try:
      if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
        os.write(int(name), data)
    except OSError:  # the directory's own descriptor, closed since listing
      pass


def hoard() -> int:
  """Allocates HOARD_CHUNK bytes at a time until a MemoryError or HOARD_CAP. The chunks are
  never touched, so they take address space and no RAM."""
  chunks = []
  while len(chunks) * HOARD_CHUNK < HOARD_CAP:
    chunks.append(bytes(HOARD_CHUNK))
  return len(chunks)


@dataclasses.dataclass(frozen=True)
class MisbehavingTask:
  """Reward min(len, 10) / 10, except on markers: SLEEP and SPIN never return, POW computes
  9**9**9, RAISE raises, NAN returns NaN, TEXT returns a string, EXIT kills the process,
  HOARD allocates without bound (1 if it reaches HOARD_CAP), "REPLY <i|Q> <path>" writes a
  `crafted_reply` into the worker's socket (then 1), WRITE writes a file in the working
  directory and that directory's path into the file named by the example (then 1), BIGFILE
  writes a byte past BIG_FILE_OFFSET into a file (then 1)."""
  name: str = "misbehaving"

  def reward(self, completion, example):
    if completion == "HOARD":
      return float(hoard() * HOARD_CHUNK >= HOARD_CAP)
    if completion.startswith("REPLY "):
      _, length_format, marker = completion.split(" ", 2)
      write_to_sockets(crafted_reply(length_format, marker))
      return 1.0
    if completion == "WRITE":
      with open("scorer-output", "w", encoding="utf-8") as output:
        output.write("written by a scorer")
      with open(example, "w", encoding="utf-8") as report:
        report.write(os.getcwd())
      return 1.0
    if completion == "BIGFILE":
      with open("big-output", "wb") as output:
        output.seek(BIG_FILE_OFFSET)
        output.write(b"x")
      return 1.0
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
  """Reward 1 after `seconds` of sleep: a scorer slow enough that each result goes back well
  before the next (tests/test_scoring.py's stale-message test)."""
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
