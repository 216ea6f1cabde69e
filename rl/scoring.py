"""Scoring completions in a worker process, under a time limit per completion.

A completion is text the policy wrote, and a scorer parses it: a scorer that evaluates it,
loops on it or crashes on it must not stop training or touch the trainer's process. So
every completion is scored in a separate worker process, and

  - a completion whose scoring takes longer than the time limit gets reward 0 and counts
    as a timeout (`Scores.timeouts`, the step metric `reward_timeouts`); the worker is
    killed and a fresh one scores the rest of the batch. So does a completion whose
    scoring uses more CPU time than `Limits.cpu_s` (the kernel ends the worker), and one
    whose scorer raises TimeoutError (a scorer that bounds its own time, as
    rl.tasks.math_answer bounds math-verify's: the worker goes on);
  - a scorer that raises, returns something that is not a finite number, runs out of
    memory (`Limits.memory_mb`), writes a file larger than `Limits.file_mb`, kills its
    process (segfault, `os._exit`) or sends the trainer anything but a well-formed reply
    gives that completion reward 0 and counts as an error (`Scores.errors`,
    `reward_errors`); after a crash, a malformed reply or a MemoryError the worker is
    replaced;
  - a completion that already timed out or crashed in a batch is not scored again when the
    same text answers the same example later in the batch (groups repeat completions): it
    gets the same result straight away.

What the worker is and is not isolated from (docs/add_task.md says it for task authors):
it runs in a fresh scratch directory (removed with it) under resource limits (`Limits`:
address space, CPU time per completion, file size; no core files), and its replies are
fixed binary records read as numbers and bounded UTF-8 text, never unpickled, so nothing a
scorer writes into the reply channel runs in the trainer. It is the same user as the trainer: it can read and write
whatever the user can (outside its directory too, each file up to the size limit), reach
the network, and start processes. It bounds accidents and completions that trip a scorer
up; it is not a sandbox for running policy-written code.

Any task works: an object with a `name` and `reward(completion, example) -> float`, and
optionally `exact_match(completion, example) -> bool` (default: reward >= 1) and
`verdict(completion, example) -> rl.verdicts.Verdict` (why it failed; default: correct or
wrong_value by the exact match); all run in the worker, under the same limit, and one that
raises fails the completion. The time limit is the task's `reward_timeout_s` attribute
when it has one, else `DEFAULT_TIMEOUT_S`; the resource limits are its `reward_limits`
attribute (a `Limits`) when it has one, else `DEFAULT_LIMITS`. The worker rebuilds the task
from a pickle, once per worker, so a task's class and the functions it holds must be
importable (defined at module level in a module, or in a `python -m` main module; not in a
main script or a notebook, not as a lambda); a task that does not pickle is a ValueError
saying so. (Pickles go only from the trainer to the worker, which trusts the trainer.)

Environments (rl.environments, docs/tools.md) run in the same worker on the same terms:
`observe(environment, texts)` runs one `step` per row text under the environment's
`timeout_s` (else DEFAULT_TIMEOUT_S) and its `limits`. A step that hangs, raises, crashes
or answers with something that is neither text nor None is failed (`Observations.failed`,
counted as a timeout or an error); an answer longer than MAX_OBSERVATION_BYTES is cut
there (`Observations.cut`). The answer comes back as a fixed record plus UTF-8 bytes,
never a pickle.

Cost. One persistent worker per trainer process, started on first use as a fresh Python
interpreter (`python -c`, not multiprocessing's fork or spawn: it inherits no JAX threads
or locks, and it does not re-run the trainer's main script); starting it costs an
interpreter and the imports of the task, once, and again only after a timeout or crash.
A batch goes to the worker in one message; the worker scores it in order, sends each result
back before it starts the next completion (so the first unscored completion is always the
one that hung, crashed or wrote a malformed reply), and writes the index it is working on to
a shared page, which starts that completion's clock. So a batch costs one message out, a
small one back per completion (3-60 us on a loaded two-core machine) and the scorer's own
time (docs/add_task.md has the measurement).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import importlib
import math
import mmap
import os
import pickle
import resource
import shutil
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
from typing import Any, Sequence

import numpy as np

from rl import verdicts as verdicts_lib
from rl.verdicts import Verdict

DEFAULT_TIMEOUT_S = 2.0  # a reasoning-gym scorer takes microseconds to milliseconds
LOAD_TIMEOUT_S = 300.0   # starting a worker and importing the task's modules
_POLL_S = 0.01           # how often the parent checks the worker's progress
_EXIT_WAIT_S = 1.0       # how long the parent waits for a worker that closed its socket to exit
_OK, _ERROR, _TIMEOUT, _MEMORY = 0, 1, 2, 3  # _MEMORY: an error, and the worker is replaced
_PROGRESS = struct.Struct("q")  # the shared page: index of the completion being scored
_HEADER = struct.Struct("!Q")   # every message: its length in bytes, then the bytes
# The worker's replies, fixed binary records: b"r", index, reward, exact, status, the
# verdict's category (its index in TASK_CATEGORIES) and its answer's length in bytes, then
# the answer and the target as UTF-8, for one completion; b"l", task token, then a load
# error's traceback as UTF-8 (none: loaded).
_RESULT = struct.Struct("!cqd?BBH")
_MAX_VERDICT_BYTES = 4 * verdicts_lib.MAX_TEXT_CHARS  # UTF-8 of a verdict's answer or target
_LOADED = struct.Struct("!cq")
# An environment's answer (rl.environments): b"o", index, status, what (_NONE: the row
# ends, _TEXT, _CUT: text cut at MAX_OBSERVATION_BYTES), then the text as UTF-8.
_OBSERVED = struct.Struct("!cqBB")
_NONE, _TEXT, _CUT = 0, 1, 2
MAX_OBSERVATION_BYTES = 2**14   # the most of an observation the worker sends back
_MAX_TRACEBACK = 2**16          # bytes of a load error's traceback sent back
_MAX_REPLY_BYTES = max(_LOADED.size + _MAX_TRACEBACK,  # a longer reply is malformed
                       _OBSERVED.size + MAX_OBSERVATION_BYTES,
                       _RESULT.size + 2 * _MAX_VERDICT_BYTES)
_WORKER_CODE = "import sys; sys.path[:0] = {path!r}; from rl import scoring; scoring.serve({fd}, {page})"


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the scoring worker may use, as Linux resource limits set in the worker.

  memory_mb: address space beyond the worker's own at start-up (RLIMIT_AS; the worker
    starts at about 140 MB, an interpreter and NumPy, and the math task's imports take
    another 110 MB of the allowance). Past it, allocation raises MemoryError: reward 0,
    an error, and a fresh worker for the next batch.
  file_mb: the largest file the worker may write (RLIMIT_FSIZE). Writing past it is an
    OSError: reward 0, an error. (Its standard output and error count too when the
    trainer's are files.)
  cpu_s: CPU seconds per completion (RLIMIT_CPU, re-armed before each); None is the time
    limit plus one second. Past it the kernel ends the worker: reward 0, a timeout. It
    holds when the trainer does not watch the clock (stalled, stopped in a debugger).
  """
  memory_mb: int = 4096
  file_mb: int = 1024
  cpu_s: float | None = None


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class Observations:
  """An environment's answers to N rows: texts[i] the observation (None: the row ends, or
  its step failed), cut [N] bool (the observation was longer than MAX_OBSERVATION_BYTES and
  is cut there), failed [N] bool (the step timed out or errored: the row ends with reward
  0), and how many steps timed out or errored."""
  texts: list
  cut: np.ndarray
  failed: np.ndarray
  timeouts: int = 0
  errors: int = 0


@dataclasses.dataclass(frozen=True)
class Scores:
  """rewards [N] float32 (0 where scoring failed), exact [N] bool, verdicts [N] (the
  scorer's `rl.verdicts.Verdict` of each completion; `scorer_failed` where scoring
  failed), and how many completions timed out or errored (their rewards are 0 and exact
  False)."""
  rewards: np.ndarray
  exact: np.ndarray
  verdicts: tuple
  timeouts: int = 0
  errors: int = 0


_FAILED = Verdict(verdicts_lib.SCORER_FAILED)


def score_one(task, completion: str, example) -> tuple[float, bool, Verdict, int]:
  """(reward, exact, verdict, status) of one completion, in the calling process: the
  worker's unit of work. A raising scorer (reward, exact_match or verdict) or a reward
  that is not a finite number is status _ERROR; a TimeoutError (a scorer's own time bound)
  is _TIMEOUT; a MemoryError is _MEMORY; each with reward 0 and the `scorer_failed`
  verdict."""
  try:
    reward = float(task.reward(completion, example))
    if not math.isfinite(reward):
      return 0.0, False, _FAILED, _ERROR
    exact_match = getattr(task, "exact_match", None)
    exact = bool(exact_match(completion, example)) if exact_match else reward >= 1.0
    verdict = verdicts_lib.task_verdict(task, completion, example, exact)
  except TimeoutError:
    return 0.0, False, _FAILED, _TIMEOUT
  except MemoryError:
    return 0.0, False, _FAILED, _MEMORY
  except (Exception, SystemExit):  # pylint: disable=broad-except  (any failure scores 0)
    return 0.0, False, _FAILED, _ERROR
  return reward, exact, verdict, _OK


def result_record(index: int, reward: float, exact: bool, verdict: Verdict, status: int) -> bytes:
  """The worker's `_RESULT` record of one scored completion (a failed one's verdict is not
  sent: the trainer knows it from the status). `task_verdict` bounds the texts to
  MAX_TEXT_CHARS characters, so each fits in _MAX_VERDICT_BYTES."""
  answer, target = ((text or "").encode("utf-8", "replace")
                    for text in (verdict.answer, verdict.target))
  category = verdicts_lib.TASK_CATEGORIES.index(verdict.category) if status == _OK else 0
  return _RESULT.pack(b"r", index, reward, exact, status, category, len(answer)) + answer + target


def observe_one(environment, text: str) -> tuple[int, int, bytes]:
  """(status, what, UTF-8 bytes) of one environment step, in the calling process: the
  worker's unit of work for environments. An answer that is neither text nor None is
  status _ERROR; a longer one than MAX_OBSERVATION_BYTES is cut there (what = _CUT)."""
  try:
    observation = environment.step(text)
    if observation is None:
      return _OK, _NONE, b""
    if not isinstance(observation, str):
      return _ERROR, _NONE, b""
    data = observation[:MAX_OBSERVATION_BYTES].encode("utf-8", "replace")
  except TimeoutError:
    return _TIMEOUT, _NONE, b""
  except MemoryError:
    return _MEMORY, _NONE, b""
  except (Exception, SystemExit):  # pylint: disable=broad-except  (any failure ends the row)
    return _ERROR, _NONE, b""
  if len(data) > MAX_OBSERVATION_BYTES or len(observation) > MAX_OBSERVATION_BYTES:
    data = data[:MAX_OBSERVATION_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return _OK, _CUT, data
  return _OK, _TEXT, data


def serve(fd: int, page_fd: int) -> None:
  """The worker process's main loop: loads tasks and scores batches until its socket closes.

  Messages in (pickles, from the trainer): ("load", token, sys.path, limits, pickled task)
  ("score", token, limits, [(index, completion, example)]) and ("observe", token, limits,
  [(index, text, None)]) (an environment's steps), where limits is (address space bytes,
  file bytes, CPU seconds per item). Out: a `_LOADED` record per load and a `_RESULT`
  (`_OBSERVED`) record per completion (step), sent before the next one starts, so that a
  reply a scorer forges in the socket comes before its own result and after every earlier
  one: the trainer then knows whose it is.
  """
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
  _die_with_parent()
  _set_soft_limit(resource.RLIMIT_CORE, 0)  # a worker the kernel ends leaves no core file
  channel = socket.socket(fileno=fd)
  stream = channel.makefile("rb")
  page = mmap.mmap(page_fd, _PROGRESS.size)
  base = _address_space()
  cpu, tasks = _CpuLimit(), {}
  while True:
    cpu.allow(LOAD_TIMEOUT_S)  # reading a message, loading a task
    try:
      message = _read_message(stream)
    except (EOFError, OSError):
      return
    if message[0] == "load":
      _, token, path, limits, blob = message
      _apply_limits(limits, base)
      sys.path[:] = path  # modules the task needs may sit on a path added after start-up
      try:
        tasks[token] = pickle.loads(blob)
        error = b""
      except BaseException:  # pylint: disable=broad-except
        error = traceback.format_exc().encode("utf-8", "replace")[-_MAX_TRACEBACK:]
      channel.sendall(_frame(_LOADED.pack(b"l", token) + error))
      continue
    kind, token, limits, items = message
    _apply_limits(limits, base)
    task = tasks[token]
    for index, completion, example in items:
      _PROGRESS.pack_into(page, 0, index)
      cpu.allow(limits[2])
      if kind == "observe":
        status, what, data = observe_one(task, completion)
        reply = _OBSERVED.pack(b"o", index, status, what) + data
      else:
        reply = result_record(index, *score_one(task, completion, example))
      channel.sendall(_frame(reply))


def _read_message(stream):
  """The trainer's next message (a length, then a pickle); EOFError when the socket closed."""
  header = stream.read(_HEADER.size)
  if len(header) < _HEADER.size:
    raise EOFError
  (size,) = _HEADER.unpack(header)
  payload = stream.read(size)
  if len(payload) < size:
    raise EOFError
  return pickle.loads(payload)


def _frame(payload: bytes) -> bytes:
  return _HEADER.pack(len(payload)) + payload


def _address_space() -> int | None:
  """The worker's address space in bytes (Linux /proc), or None where it cannot be read
  (then no address-space limit is set)."""
  try:
    with open("/proc/self/statm", encoding="ascii") as statm:
      return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


def _apply_limits(limits: tuple[int, int, float], base: int | None) -> None:
  """Sets the worker's address-space limit to `base` plus limits[0] bytes and its file-size
  limit to limits[1] bytes (soft limits: the next task may set others)."""
  if base is not None:
    _set_soft_limit(resource.RLIMIT_AS, base + limits[0])
  _set_soft_limit(resource.RLIMIT_FSIZE, limits[1])


class _CpuLimit:
  """The worker's CPU-time limit (RLIMIT_CPU counts the whole process's CPU time, so it is
  moved forward before each completion)."""

  def __init__(self):
    self._armed = None

  def allow(self, seconds: float) -> None:
    """Lets the worker use `seconds` more CPU time (at least; the limit is whole seconds)
    before the kernel ends it with SIGXCPU. Sets the limit only when it changes: about once
    per CPU second for fast scorers, so a completion costs a clock read, not two syscalls."""
    limit = math.ceil(time.process_time() + seconds)
    if limit != self._armed:
      _set_soft_limit(resource.RLIMIT_CPU, limit)
      self._armed = limit


def _set_soft_limit(kind: int, value: int) -> None:
  """Sets the soft limit `kind` to `value`, capped by the hard limit, which stays as it was;
  a platform that refuses the limit leaves it as it was."""
  _, hard = resource.getrlimit(kind)
  if hard != resource.RLIM_INFINITY:
    value = min(value, hard)
  try:
    resource.setrlimit(kind, (value, hard))
  except (ValueError, OSError):
    pass


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


def _result(frame: bytes, pending: set[int]) -> tuple[int, float, bool, Verdict, int] | None:
  """(index, reward, exact, verdict, status) from a result record, or None unless the frame
  is exactly one (`_RESULT`, then the verdict's texts) for an unscored index, with a finite
  reward, a known status and category, and texts of valid UTF-8 within their bound.
  Replies are read as numbers and text, never unpickled: whoever wrote them, they are data."""
  if not _RESULT.size <= len(frame) <= _RESULT.size + 2 * _MAX_VERDICT_BYTES:
    return None
  kind, index, reward, exact, status, category, answer_bytes = _RESULT.unpack_from(frame)
  texts = frame[_RESULT.size:]
  if (kind != b"r" or index not in pending or not math.isfinite(reward)
      or status not in (_OK, _ERROR, _TIMEOUT, _MEMORY)
      or category >= len(verdicts_lib.TASK_CATEGORIES)
      or answer_bytes > min(len(texts), _MAX_VERDICT_BYTES)
      or len(texts) - answer_bytes > _MAX_VERDICT_BYTES):
    return None
  try:
    answer, target = (part.decode("utf-8") or None
                      for part in (texts[:answer_bytes], texts[answer_bytes:]))
  except UnicodeDecodeError:
    return None
  verdict = (Verdict(verdicts_lib.TASK_CATEGORIES[category], answer, target)
             if status == _OK else _FAILED)
  return index, reward, exact, verdict, status


def _observation(frame: bytes, pending: set[int]) -> tuple[int, tuple] | None:
  """(index, (text or None, cut, status)) from an observation record, or None unless the
  frame is one (`_OBSERVED`) for an unanswered index, with a known status and kind and
  valid UTF-8 of at most MAX_OBSERVATION_BYTES."""
  if not _OBSERVED.size <= len(frame) <= _OBSERVED.size + MAX_OBSERVATION_BYTES:
    return None
  tag, index, status, what = _OBSERVED.unpack_from(frame)
  data = frame[_OBSERVED.size:]
  if (tag != b"o" or index not in pending or status not in (_OK, _ERROR, _TIMEOUT, _MEMORY)
      or what not in (_NONE, _TEXT, _CUT) or (what == _NONE and data)):
    return None
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError:
    return None
  return index, (None if what == _NONE else text, what == _CUT, status)


def _scored(frame: bytes, pending: set[int]) -> tuple[int, tuple] | None:
  """`_result` as (index, (reward, exact, verdict, status))."""
  result = _result(frame, pending)
  return None if result is None else (result[0], result[1:])


def _load_error(frame: bytes | None, token: int) -> tuple[bool, str | None]:
  """(well formed, traceback or None) of the worker's answer to loading task `token`."""
  if frame is None or len(frame) < _LOADED.size:
    return False, None
  kind, loaded = _LOADED.unpack_from(frame)
  if kind != b"l" or loaded != token:
    return False, None
  return True, frame[_LOADED.size:].decode("utf-8", "replace") or None


class _Channel:
  """The trainer's end of the worker's socket: pickled messages out (the worker trusts the
  trainer), length-prefixed binary records in. Replies are assembled from whatever bytes have
  arrived, so a partial or garbled one (a scorer can write into the socket) never blocks
  the trainer, which keeps watching the clock."""

  def __init__(self, sock: socket.socket):
    self._sock = sock
    self._buffer = bytearray()

  def send(self, message) -> None:
    self._sock.settimeout(None)
    self._sock.sendall(_frame(_dumps(message)))

  def receive(self, wait_s: float) -> bytes | None:
    """The next whole reply, or None when none arrived within `wait_s`. EOFError when the
    worker's end is closed; ValueError for a reply longer than `_MAX_REPLY_BYTES`."""
    deadline = time.monotonic() + wait_s
    while (frame := self._take()) is None:
      left = deadline - time.monotonic()
      if left <= 0:
        return None
      self._sock.settimeout(left)
      try:
        data = self._sock.recv(2**20)
      except TimeoutError:
        return None
      except OSError:
        data = b""
      if not data:
        raise EOFError
      self._buffer += data
    return frame

  def _take(self) -> bytes | None:
    if len(self._buffer) < _HEADER.size:
      return None
    (size,) = _HEADER.unpack_from(self._buffer)
    if size > _MAX_REPLY_BYTES:
      raise ValueError(f"a {size}-byte reply")
    end = _HEADER.size + size
    if len(self._buffer) < end:
      return None
    frame = bytes(self._buffer[_HEADER.size:end])
    del self._buffer[:end]
    return frame

  def close(self) -> None:
    self._sock.close()


def _worker_path() -> list[str]:
  """sys.path for the worker, whose working directory is its own: relative entries ('' is
  the working directory) made absolute."""
  return [os.path.abspath(entry) for entry in sys.path]


class Scorer:
  """One worker process that scores batches for any number of tasks (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._process = self._channel = self._page = self._scratch = None
    self._exhausted = False  # a scorer ran out of memory: the next batch gets a fresh worker
    self._loaded: set[int] = set()  # task tokens the current worker holds
    self._tokens: dict[int, tuple[Any, int, bytes]] = {}  # id(task) -> (task, token, pickle)
    self._next_token = 0

  def score(self, task, completions: Sequence[str], examples: Sequence,
            timeout_s: float | None = None, limits: Limits | None = None) -> Scores:
    """Scores completions[i] against examples[i]; see the module docstring."""
    if len(completions) != len(examples):
      raise ValueError(f"{len(completions)} completions for {len(examples)} examples.")
    if timeout_s is None:
      timeout_s = float(getattr(task, "reward_timeout_s", DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
      raise ValueError(f"Task {getattr(task, 'name', task)!r}: reward_timeout_s={timeout_s} "
                       "must be > 0.")
    results = self._serve("score", task, completions, examples, timeout_s, limits,
                          _scored, lambda status: (0.0, False, _FAILED, status))
    status = np.array([r[3] for r in results], np.int32)
    return Scores(rewards=np.array([r[0] for r in results], np.float32),
                  exact=np.array([r[1] for r in results], bool),
                  verdicts=tuple(r[2] for r in results),
                  timeouts=int(np.sum(status == _TIMEOUT)), errors=int(np.sum(status == _ERROR)))

  def observe(self, environment, texts: Sequence[str], timeout_s: float | None = None,
              limits: Limits | None = None) -> Observations:
    """One step of `environment` (rl.environments) for each of `texts`, in the worker, on
    the same terms as scoring: a step that hangs past the time limit (the environment's
    `timeout_s`, else DEFAULT_TIMEOUT_S), raises, crashes or answers with something that is
    not text is failed (and counted), and a fresh worker answers the rest."""
    if timeout_s is None:
      timeout_s = float(getattr(environment, "timeout_s", DEFAULT_TIMEOUT_S))
    if not timeout_s > 0:
      raise ValueError(f"Environment {getattr(environment, 'name', environment)!r}: "
                       f"timeout_s={timeout_s} must be > 0.")
    results = self._serve("observe", environment, texts, [None] * len(texts), timeout_s,
                          limits, _observation, lambda status: (None, False, status))
    status = np.array([r[2] for r in results], np.int32)
    return Observations(texts=[r[0] for r in results], cut=np.array([r[1] for r in results], bool),
                        failed=status != _OK, timeouts=int(np.sum(status == _TIMEOUT)),
                        errors=int(np.sum(status == _ERROR)))

  def _serve(self, kind: str, task, texts, examples, timeout_s: float, limits, parse, failure):
    """The results of one batch of `kind` ('score' or 'observe'), restarting the worker
    after each item that fails it; parse(frame, pending) reads a reply, failure(status) is
    a failed item's result."""
    limits = _worker_limits(task, limits, timeout_s)
    results: list[tuple | None] = [None] * len(texts)
    with self._lock:
      token, blob = self._pickled(task)
      while any(r is None for r in results):
        self._start()
        self._load(task, token, blob, limits)
        self._run(kind, token, texts, examples, results, timeout_s, limits, parse, failure)
      if self._exhausted:
        self._stop()
    return results

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
    """Starts a worker, unless one is running, in a fresh scratch directory."""
    if self._process is not None and self._process.poll() is None:
      return
    self._stop()
    ours, theirs = socket.socketpair()
    self._scratch = tempfile.mkdtemp(prefix="arbor-scoring-")
    with tempfile.TemporaryFile() as page_file:
      page_file.truncate(_PROGRESS.size)
      self._page = mmap.mmap(page_file.fileno(), _PROGRESS.size)
      code = _WORKER_CODE.format(path=_worker_path(), fd=theirs.fileno(),
                                 page=page_file.fileno())
      # Started from one long-lived thread: Linux's parent-death signal (`_die_with_parent`)
      # follows the thread that started the worker, and a producer thread that scored first
      # may end long before the trainer does.
      self._process = _SPAWNER.submit(
          subprocess.Popen, [sys.executable, "-c", code], stdin=subprocess.DEVNULL,
          cwd=self._scratch, pass_fds=(theirs.fileno(), page_file.fileno())).result()
    theirs.close()
    self._channel = _Channel(ours)

  def _stop(self) -> None:
    """Kills the worker and removes its scratch directory."""
    if self._process is not None:
      self._process.kill()
      self._process.wait()
    for held in (self._channel, self._page):
      if held is not None:
        held.close()
    if self._scratch is not None:
      shutil.rmtree(self._scratch, ignore_errors=True)
    self._process = self._channel = self._page = self._scratch = None
    self._loaded = set()
    self._exhausted = False

  def _load(self, task, token: int, blob: bytes, limits: tuple[int, int, float]) -> None:
    if token in self._loaded:
      return
    try:
      self._channel.send(("load", token, _worker_path(), limits, blob))
      frame = self._channel.receive(LOAD_TIMEOUT_S)
    except (EOFError, OSError, ValueError):
      frame = None
    well_formed, error = _load_error(frame, token)
    if not well_formed:
      self._stop()
      raise RuntimeError(f"The scoring worker did not load task {task.name!r} within "
                         f"{LOAD_TIMEOUT_S:.0f} s (it hung, died or sent a malformed reply "
                         "while importing it).")
    if error is not None:
      raise ValueError(f"The scoring worker could not rebuild task {task.name!r} from its "
                       f"pickle; its class and functions must be importable in a fresh "
                       f"process (docs/add_task.md):\n{error}")
    self._loaded.add(token)

  def _run(self, kind: str, token: int, completions, examples, results, timeout_s: float,
           limits: tuple[int, int, float], parse, failure) -> None:
    """Sends the unscored items to the worker and collects results until all are in, or
    until one times out, the worker dies or a reply is malformed (then the worker is
    stopped, the first unscored item, whose result is the one missing, gets the failure,
    and the caller starts another worker for what is left). The clock of an item starts
    when the worker starts it (the shared page): receiving the batch (which may import the
    examples' modules) is not its time. It restarts only for an index not seen before, so
    a page written back and forth cannot hold it off."""
    pending = {i for i, r in enumerate(results) if r is None}
    _PROGRESS.pack_into(self._page, 0, -1)
    try:
      self._channel.send((kind, token, limits,
                          [(i, completions[i], examples[i]) for i in sorted(pending)]))
    except OSError:  # the worker is gone already
      self._fail(min(pending), failure(_ERROR), completions, examples, results)
      return
    seen, since = set(), time.monotonic()
    while pending:
      try:
        frame = self._channel.receive(_POLL_S)
      except EOFError:  # the worker died on the completion it was scoring
        self._fail(min(pending), failure(self._exit_status()), completions, examples, results)
        return
      except ValueError:
        frame = b""  # an oversized reply: malformed
      if frame is not None:
        result = parse(frame, pending)
        if result is None:  # not what `serve` writes: a scorer wrote into the socket
          self._fail(min(pending), failure(_ERROR), completions, examples, results)
          return
        index, (*value, status) = result
        results[index] = (*value, _ERROR if status == _MEMORY else status)
        self._exhausted |= status == _MEMORY
        pending.discard(index)
        continue
      current, now = self._current(), time.monotonic()
      if current not in seen:
        seen.add(current)
        since = now
      elif current >= 0 and now - since > timeout_s:
        self._fail(min(pending), failure(_TIMEOUT), completions, examples, results)
        return
      elif current < 0 and now - since > LOAD_TIMEOUT_S:
        self._stop()
        raise RuntimeError(f"The scoring worker did not start a batch within "
                           f"{LOAD_TIMEOUT_S:.0f} s (it hung importing the examples' modules).")

  def _current(self) -> int:
    """The index of the completion the worker is scoring; -1 before it starts the batch."""
    return _PROGRESS.unpack_from(self._page, 0)[0]

  def _exit_status(self) -> int:
    """_TIMEOUT for a worker the kernel ended for its CPU time (SIGXCPU), else _ERROR."""
    try:
      code = self._process.wait(timeout=_EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
      return _ERROR
    return _TIMEOUT if code == -signal.SIGXCPU else _ERROR

  def _fail(self, index: int, failed: tuple, completions, examples, results) -> None:
    """Stops the worker and gives the failed result (reward 0, or no observation, with its
    status) to `index` and to every unanswered row with the same text of the same example."""
    self._stop()
    for i, result in enumerate(results):
      if result is None and (i == index or (completions[i] == completions[index]
                                            and examples[i] is examples[index])):
        results[i] = failed


def _worker_limits(task, limits: Limits | None, timeout_s: float) -> tuple[int, int, float]:
  """(address space bytes, file bytes, CPU seconds per completion) for the worker: `limits`,
  else the task's `reward_limits`, else DEFAULT_LIMITS; a ValueError for a bad one."""
  if limits is None:
    limits = getattr(task, "reward_limits", DEFAULT_LIMITS)
  cpu_s = getattr(limits, "cpu_s", None)
  cpu_s = timeout_s + 1.0 if cpu_s is None else cpu_s
  if not (isinstance(limits, Limits) and limits.memory_mb > 0 and limits.file_mb > 0
          and cpu_s > 0):
    raise ValueError(f"Task {getattr(task, 'name', task)!r}: reward_limits={limits!r} must "
                     "be an rl.scoring.Limits with positive memory_mb, file_mb and cpu_s.")
  return int(limits.memory_mb * 2**20), int(limits.file_mb * 2**20), float(cpu_s)


_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="scorer-spawn")
_DEFAULT = Scorer()
atexit.register(_DEFAULT.close)


def score(task, completions: Sequence[str], examples: Sequence,
          timeout_s: float | None = None, limits: Limits | None = None) -> Scores:
  """Scores completions[i] against examples[i] with the process-wide worker (`Scorer`)."""
  return _DEFAULT.score(task, completions, examples, timeout_s, limits)


def observe(environment, texts: Sequence[str], timeout_s: float | None = None,
            limits: Limits | None = None) -> Observations:
  """One step of `environment` per text with the process-wide worker (`Scorer.observe`)."""
  return _DEFAULT.observe(environment, texts, timeout_s, limits)
