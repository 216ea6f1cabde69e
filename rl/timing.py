"""Wall time of named parts of a computation, measured where they run.

A loop wraps a call in `phases()` and reads back how long the parts marked with `phase`
took inside it, whichever code path ran them: the reward scoring of every producer
(independent samples, selection rounds, trees, partial rollouts) is one
`phase("score")` in rl/rollouts/batches.py, not a timer threaded through each producer. Totals
are per thread, so the asynchronous loop's producer thread times its own batches.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Iterator

_local = threading.local()


@contextlib.contextmanager
def phases() -> Iterator[dict[str, float]]:
  """Yields {name: seconds} of the `phase(name)` blocks this thread runs inside it (nested
  `phases` blocks each see their own)."""
  totals: dict[str, float] = collections.defaultdict(float)
  stack = _stack()
  stack.append(totals)
  try:
    yield totals
  finally:
    stack.pop()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
  """Adds the block's wall time to `name` in every enclosing `phases()` of this thread."""
  started = time.perf_counter()
  try:
    yield
  finally:
    elapsed = time.perf_counter() - started
    for totals in _stack():
      totals[name] += elapsed


def _stack() -> list[dict[str, float]]:
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack
