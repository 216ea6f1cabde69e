"""Scoring completions in a worker process, under a time limit per completion.

A completion is text the policy wrote, and a scorer parses it: a scorer that evaluates it,
loops on it or crashes on it must not stop training or touch the trainer's process. So
every completion is scored in a separate worker process, and

  - a completion whose scoring takes longer than the time limit gets reward 0 and counts
    as a timeout (`Scores.timeouts`, the step metric `reward_timeouts`); the worker is
    killed and a fresh one scores the rest of the batch;
  - a scorer that raises, returns something that is not a finite number, or kills its
    process (segfault, `os._exit`, out of memory) gives that completion reward 0 and counts
    as an error (`Scores.errors`, `reward_errors`);
  - a completion that already timed out or crashed in a batch is not scored again when the
    same text answers the same example later in the batch (groups repeat completions): it
    gets the same result straight away.

Any task works: an object with a `name` and `reward(completion, example) -> float`, and
optionally `exact_match(completion, example) -> bool` (default: reward >= 1); both run in
the worker, under the same limit. The time limit is the task's `reward_timeout_s` attribute
when it has one, else `DEFAULT_TIMEOUT_S`. The worker rebuilds the task from a pickle, once
per worker, so a task's class and the functions it holds must be importable (defined at
module level in a module, or in a `python -m` main module; not in a main script or a
notebook, not as a lambda); a task that does not pickle is a ValueError saying so.

Cost. One persistent worker per trainer process, started on first use as a fresh Python
interpreter (`python -c`, not multiprocessing's fork or spawn: it inherits no JAX threads
or locks, and it does not re-run the trainer's main script); starting it costs an
interpreter and the imports of the task, once, and again only after a timeout or crash.
A batch goes to the worker in one message; the worker scores it in order and sends results
back in chunks (at most every `_FLUSH_S`), and writes the index it is working on to a
shared page, which is how the parent knows which completion hung. So a batch costs one
round trip plus the scorer's own time (docs/add_task.md has the measurement).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import importlib
import math
import mmap
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from multiprocessing.connection import Connection
from typing import Any, Sequence

import numpy as np

DEFAULT_TIMEOUT_S = 2.0  # a reasoning-gym scorer takes microseconds to milliseconds
LOAD_TIMEOUT_S = 300.0   # starting a worker and importing the task's modules
_FLUSH_S = 0.01          # the worker sends finished results at least this often
_POLL_S = 0.01           # how often the parent checks the worker's progress
_OK, _ERROR, _TIMEOUT = 0, 1, 2
_PROGRESS = struct.Struct("q")  # the shared page: index of the completion being scored
_WORKER_CODE = "import sys; sys.path[:0] = {path!r}; from rl import scoring; scoring.serve({fd}, {page})"


@dataclasses.dataclass(frozen=True)
class Scores:
  """rewards [N] float32 (0 where scoring failed), exact [N] bool, and how many completions
  timed out or errored (their rewards are 0 and exact False)."""
  rewards: np.ndarray
  exact: np.ndarray
  timeouts: int = 0
  errors: int = 0


def score_one(task, completion: str, example) -> tuple[float, bool, int]:
  """(reward, exact, status) of one completion, in the calling process: the worker's unit
  of work. A raising scorer or a reward that is not a finite number is status _ERROR."""
  try:
    reward = float(task.reward(completion, example))
    if not math.isfinite(reward):
      return 0.0, False, _ERROR
    exact_match = getattr(task, "exact_match", None)
    exact = bool(exact_match(completion, example)) if exact_match else reward >= 1.0
  except (Exception, SystemExit):  # pylint: disable=broad-except  (any failure scores 0)
    return 0.0, False, _ERROR
  return reward, exact, _OK


def serve(fd: int, page_fd: int) -> None:
  """The worker process's main loop: loads tasks and scores batches until its socket closes.

  Messages in: ("load", token, sys.path, pickled task) and ("score", token, [(index,
  completion, example)]). Out: ("loaded", token, None or a traceback) and ("results",
  [(index, reward, exact, status)]), in chunks.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
  _die_with_parent()
  conn = Connection(fd)
  page = mmap.mmap(page_fd, _PROGRESS.size)
  tasks = {}
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message[0] == "load":
      _, token, path, blob = message
      sys.path[:] = path  # modules the task needs may sit on a path added after start-up
      try:
        tasks[token] = pickle.loads(blob)
        conn.send(("loaded", token, None))
      except BaseException:  # pylint: disable=broad-except
        conn.send(("loaded", token, traceback.format_exc()))
      continue
    _, token, items = message
    task, done, last = tasks[token], [], time.monotonic()
    for index, completion, example in items:
      _PROGRESS.pack_into(page, 0, index)
      done.append((index, *score_one(task, completion, example)))
      if time.monotonic() - last > _FLUSH_S:
        conn.send(("results", done))
        done, last = [], time.monotonic()
    if done:  # an empty message would outlive the batch and answer the next request
      conn.send(("results", done))


def _die_with_parent() -> None:
  """On Linux, asks the kernel to kill this worker when the trainer dies (even by SIGKILL),
  so a scorer stuck in a loop does not outlive it. (The kernel watches the thread that
  started the worker: `_SPAWNER`, which lives as long as the trainer.)"""
  if sys.platform.startswith("linux"):
    try:
      import ctypes  # pylint: disable=import-outside-toplevel
      ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
      pass


def _import_attribute(module: str, qualname: str):
  value = importlib.import_module(module)
  for part in qualname.split("."):
    value = getattr(value, part)
  return value


class _Pickler(pickle.Pickler):
  """Pickles the classes and functions of a main module run as `python -m package.module`
  by that module's name: in the worker, `__main__` is the worker itself. Those of a main
  script (`python script.py`, a notebook) have no importable name: a PicklingError."""

  def reducer_override(self, obj):
    if (not isinstance(obj, (type, types.FunctionType))
        or getattr(obj, "__module__", None) != "__main__"):
      return NotImplemented
    name = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    if name is None:
      raise pickle.PicklingError(
          f"{obj.__qualname__} is defined in the main script, which the worker cannot "
          "import; move it into a module (or run the script as python -m package.module)")
    return _import_attribute, (name, obj.__qualname__)


def _dumps(obj) -> bytes:
  buffer = _Buffer()
  _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
  return buffer.getvalue()


class _Buffer(list):
  def write(self, data) -> None:
    self.append(bytes(data))

  def getvalue(self) -> bytes:
    return b"".join(self)


class Scorer:
  """One worker process that scores batches for any number of tasks (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._process = self._conn = self._page = None
    self._loaded: set[int] = set()  # task tokens the current worker holds
    self._tokens: dict[int, tuple[Any, int, bytes]] = {}  # id(task) -> (task, token, pickle)
    self._next_token = 0

  def score(self, task, completions: Sequence[str], examples: Sequence,
            timeout_s: float | None = None) -> Scores:
    """Scores completions[i] against examples[i]; see the module docstring."""
    if len(completions) != len(examples):
      raise ValueError(f"{len(completions)} completions for {len(examples)} examples.")
    if timeout_s is None:
      timeout_s = float(getattr(task, "reward_timeout_s", DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
      raise ValueError(f"Task {getattr(task, 'name', task)!r}: reward_timeout_s={timeout_s} "
                       "must be > 0.")
    results: list[tuple[float, bool, int] | None] = [None] * len(completions)
    with self._lock:
      token, blob = self._pickled(task)
      while any(r is None for r in results):
        self._start()
        self._load(task, token, blob)
        self._run(token, completions, examples, results, timeout_s)
    status = np.array([r[2] for r in results], np.int32)
    return Scores(rewards=np.array([r[0] for r in results], np.float32),
                  exact=np.array([r[1] for r in results], bool),
                  timeouts=int(np.sum(status == _TIMEOUT)), errors=int(np.sum(status == _ERROR)))

  def close(self) -> None:
    """Stops the worker (a later `score` starts a new one)."""
    with self._lock:
      self._stop()

  def _pickled(self, task) -> tuple[int, bytes]:
    """(token, pickle) of `task`, pickled once per task object; the token names it in the
    worker, which unpickles each token once."""
    cached = self._tokens.get(id(task))
    if cached is not None and cached[0] is task:
      return cached[1], cached[2]
    try:
      blob = _dumps(task)
    except Exception as error:  # pylint: disable=broad-except
      raise ValueError(
          f"Task {getattr(task, 'name', task)!r} ({type(task).__qualname__}) cannot be sent "
          f"to the scoring worker: {error}. Define the task's class, and any function it "
          "holds, at module level so they pickle by reference (docs/add_task.md).") from error
    if len(self._tokens) >= 64:  # many short-lived tasks (tests): forget the old ones
      self._tokens.clear()
    self._next_token += 1
    self._tokens[id(task)] = (task, self._next_token, blob)
    return self._next_token, blob

  def _start(self) -> None:
    if self._process is not None and self._process.poll() is None:
      return
    self._stop()
    ours, theirs = socket.socketpair()
    with tempfile.TemporaryFile() as page_file:
      page_file.truncate(_PROGRESS.size)
      self._page = mmap.mmap(page_file.fileno(), _PROGRESS.size)
      code = _WORKER_CODE.format(path=list(sys.path), fd=theirs.fileno(),
                                 page=page_file.fileno())
      # Started from one long-lived thread: Linux's parent-death signal (`_die_with_parent`)
      # follows the thread that started the worker, and a producer thread that scored first
      # may end long before the trainer does.
      self._process = _SPAWNER.submit(
          subprocess.Popen, [sys.executable, "-c", code], stdin=subprocess.DEVNULL,
          pass_fds=(theirs.fileno(), page_file.fileno())).result()
    theirs.close()
    self._conn = Connection(ours.detach())

  def _stop(self) -> None:
    if self._process is not None:
      self._process.kill()
      self._process.wait()
      self._conn.close()
      self._page.close()
    self._process = self._conn = self._page = None
    self._loaded = set()

  def _load(self, task, token: int, blob: bytes) -> None:
    if token in self._loaded:
      return
    self._conn.send(("load", token, list(sys.path), blob))
    reply = self._conn.poll(LOAD_TIMEOUT_S) and self._receive()
    if not reply:
      self._stop()
      raise RuntimeError(f"The scoring worker did not load task {task.name!r} within "
                         f"{LOAD_TIMEOUT_S:.0f} s (it hung or died while importing it).")
    if reply[2] is not None:
      raise ValueError(f"The scoring worker could not rebuild task {task.name!r} from its "
                       f"pickle; its class and functions must be importable in a fresh "
                       f"process (docs/add_task.md):\n{reply[2]}")
    self._loaded.add(token)

  def _receive(self):
    try:
      return self._conn.recv()
    except (EOFError, OSError):
      return None

  def _run(self, token: int, completions, examples, results, timeout_s: float) -> None:
    """Sends the unscored items to the worker and collects results until all are in, or
    until one times out or the worker dies (then the worker is stopped and the caller
    starts another for what is left). The clock of an item starts when the worker starts
    it: receiving the batch (which may import the examples' modules) is not its time."""
    items = [(i, completions[i], examples[i]) for i, r in enumerate(results) if r is None]
    _PROGRESS.pack_into(self._page, 0, -1)
    self._conn.send(("score", token, items))
    pending, watched, since = len(items), -1, time.monotonic()
    while pending:
      if self._conn.poll(_POLL_S):
        reply = self._receive()
        if reply is None:  # the worker died on the completion it was scoring
          self._fail(max(self._current(), items[0][0]), _ERROR, completions, examples, results)
          return
        for index, *result in reply[1]:
          results[index] = tuple(result)
        pending -= len(reply[1])
        continue
      current, now = self._current(), time.monotonic()
      if current != watched:
        watched, since = current, now
      elif current >= 0 and now - since > timeout_s:
        self._fail(current, _TIMEOUT, completions, examples, results)
        return
      elif current < 0 and now - since > LOAD_TIMEOUT_S:
        self._stop()
        raise RuntimeError(f"The scoring worker did not start a batch within "
                           f"{LOAD_TIMEOUT_S:.0f} s (it hung importing the examples' modules).")

  def _current(self) -> int:
    """The index of the completion the worker is scoring; -1 before it starts the batch."""
    return _PROGRESS.unpack_from(self._page, 0)[0]

  def _fail(self, index: int, status: int, completions, examples, results) -> None:
    """Stops the worker and gives reward 0 with `status` to `index` and to every unscored
    row with the same completion of the same example."""
    self._stop()
    for i, result in enumerate(results):
      if result is None and (i == index or (completions[i] == completions[index]
                                            and examples[i] is examples[index])):
        results[i] = (0.0, False, status)


_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="scorer-spawn")
_DEFAULT = Scorer()
atexit.register(_DEFAULT.close)


def score(task, completions: Sequence[str], examples: Sequence,
          timeout_s: float | None = None) -> Scores:
  """Scores completions[i] against examples[i] with the process-wide worker (`Scorer`)."""
  return _DEFAULT.score(task, completions, examples, timeout_s)
