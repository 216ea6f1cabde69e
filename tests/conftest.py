"""Test-session set-up that must happen before JAX starts, and tests that run alone.

- `HF_HUB_OFFLINE=1`: tests never reach the network.
- `XLA_FLAGS=--xla_force_host_platform_device_count=8`: eight virtual CPU devices for the
 sharding tests (single-device code runs a little slower; that is the price).
- `XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false`: a mesh program that
 XLA:CPU loads back from the persistent cache (below) can deadlock in its collectives
 under the concurrency-optimised thunk scheduler: two collectives over different device
 groups wait on each other until the 40 s rendezvous timeout aborts the worker. Seen with
 jaxlib 0.10 on a 2x4 mesh distillation step: compiled fresh it ran, loaded from the
 cache it hung in 2 of 2 runs; with this flag 3 of 3 runs (2 from the cache) finished.
- XLA flags for fast compilation, since compiling is most of the suite's time and the
 tests' programs are too small for optimised code to pay back what optimising costs
 (measured on two cores, jaxlib 0.10.2, four launcher-heavy test files from an empty
 cache: 123 s with the first flag alone, 82 s with the first two, 74 s with all three):
 `--xla_backend_optimization_level=0` (no LLVM optimisation passes),
 `--xla_cpu_use_fusion_emitters=false` (XLA:CPU's older elemental emitters for fusions,
 which compile in about half the time of the MLIR fusion emitters) and
 `--xla_cpu_parallel_codegen_split_count=1` (one code-generation thread: the test workers
 already keep every core busy). The programs compute the same values up to the order of
 float32 sums (tolerances that compare two programs say so); export a flag with another
 value to test what users run (a flag the caller sets is left alone).
- `JAX_PLATFORMS=cpu`: tests are CPU-only (export another value to override).
- Persistent compilation cache in the user's cache folder (`$XDG_CACHE_HOME/arbor/jax`,
 else `~/.cache/arbor/jax`), shared by every checkout and clone on the machine, so a rerun
 of the suite, or a fresh clone's first run, skips most XLA compilation (about three
 quarters of a cold run's time). Entries are keyed by the computation, the compile options
 and the jax/jaxlib version, so a stale entry is never used; the folder is capped at 2 GiB. Override the place with
 JAX_COMPILATION_CACHE_DIR.
- Both tiers use that cache. Slow-tier workers once crashed while writing or reading it
 (jaxlib 0.10, a segmentation fault in `compilation_cache.put_executable_and_time`); the
 cause was exhausted memory mappings (below), which the release after each test prevents.
 On two cores, the slow tier took 44 min without the cache and 27 min with it (one run
 each, 2026-12).
- A worker that dies of a fatal signal writes its faulthandler dump to a file, and the
 session's summary prints the crashing thread's stack from it (`pytest_terminal_summary`),
 so it reaches the last lines of a CI log instead of being lost in the middle.
- After each test, a process holding more than half the kernel's limit on memory mappings
 drops JAX's compiled programs (`release_compiled_programs`): XLA:CPU crashes when a long
 session's executables exhaust vm.max_map_count.
- Tests marked `serial` run alone: while one runs, no other test of the session does (its
 setup and teardown included). See `pytest_runtest_protocol`.
"""

import contextlib
import faulthandler
import fcntl
import gc
import os
import pathlib
import shutil
import tempfile

import pytest

_CACHE_HOME = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
# Fast compilation (module docstring): flag -> value.
_COMPILE_FLAGS = {"--xla_backend_optimization_level": "0",
                  "--xla_cpu_use_fusion_emitters": "false",
                  "--xla_cpu_parallel_codegen_split_count": "1"}
_CRASH_FOLDER = "ARBOR_TEST_CRASH_FOLDER"  # where xdist workers write their fault dumps
_FAULT_DUMP = pytest.StashKey()  # a worker's open dump file
_FAULT_FOLDER = pytest.StashKey()  # the controller's folder of its workers' dumps

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_xla_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_FLAG not in _xla_flags:  # an explicit device count from the caller wins
  _xla_flags = f"{_xla_flags} {_DEVICE_FLAG}=8"
if _SCHEDULER_FLAG not in _xla_flags:  # so does an explicit scheduler choice
  _xla_flags = f"{_xla_flags} {_SCHEDULER_FLAG}=false"
for _flag, _value in _COMPILE_FLAGS.items():  # and explicit compilation choices
  if _flag not in _xla_flags:
    _xla_flags = f"{_xla_flags} {_flag}={_value}"
os.environ["XLA_FLAGS"] = _xla_flags.strip()

# The cache settings go through the environment (a value already there wins), so that the
# launcher subprocesses some tests start (`python -m experiments.train ...`) share the
# cache on the same terms.
_CACHE_SETTINGS = {
    "jax_compilation_cache_dir": str(_CACHE_HOME / "arbor" / "jax"),
    # Cache compilations that take a tenth of a second or more: eager ops compile in
    # milliseconds, and writing a file for each would cost more than it saves.
    "jax_persistent_cache_min_compile_time_secs": 0.1,
    # -1 removes the size threshold (0 lets JAX pick one per file system).
    "jax_persistent_cache_min_entry_size_bytes": -1,
    # The folder outlives code changes: keep it bounded (least recently used entries go
    # first; one run of the suite writes about 60 MB).
    "jax_compilation_cache_max_size": 2 * 2**30,
}
for _name, _value in _CACHE_SETTINGS.items():
  os.environ.setdefault(_name.upper(), str(_value))

import jax  # pylint: disable=wrong-import-position  (must follow the environment)

for _name, _value in _CACHE_SETTINGS.items():  # in case a plugin imported jax first
  jax.config.update(_name, type(_value)(os.environ[_name.upper()]))


def _map_budget() -> int | None:
  """Half the kernel's per-process limit on memory mappings; None where /proc does not say
  (not Linux)."""
  try:
    return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text()) // 2
  except (OSError, ValueError):
    return None


_MAP_BUDGET = _map_budget()  # see release_compiled_programs


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin has enabled its own
def pytest_configure(config):
  _write_fault_dumps_to_a_file(config)
  config.addinivalue_line(
      "markers", "slow: the slow tier (long launcher runs, killed-run resumes, grids, "
      "benchmark smoke runs, statistical tests over many draws); pytest.ini leaves it out "
      "by default and `python -m pytest -q tests -m slow` runs it")
  config.addinivalue_line(
      "markers", "serial: runs alone; no other test of the session runs meanwhile (for "
      "wall-clock bounds; tests/conftest.py)")


def _write_fault_dumps_to_a_file(config):
  """In the controller of an xdist session, makes the folder for the workers' fault dumps
  (workers inherit its name through the environment, being started later); in a worker,
  sends faulthandler's dump of a fatal signal to `<folder>/<worker id>.txt`."""
  if not hasattr(config, "workerinput"):
    if config.getoption("numprocesses", None):
      config.stash[_FAULT_FOLDER] = tempfile.mkdtemp(prefix="arbor-test-faults-")
      os.environ[_CRASH_FOLDER] = config.stash[_FAULT_FOLDER]
    return
  folder = os.environ.get(_CRASH_FOLDER)
  if folder:
    dump = open(pathlib.Path(folder) / f"{config.workerinput['workerid']}.txt", "w")  # pylint: disable=consider-using-with
    config.stash[_FAULT_DUMP] = dump  # kept open for the worker's life
    faulthandler.enable(file=dump, all_threads=True)


def pytest_terminal_summary(terminalreporter):
  """Prints, for each xdist worker that died of a fatal signal, the error and the stack of
  the thread that took it (the other threads' stacks stay in the file)."""
  folder = terminalreporter.config.stash.get(_FAULT_FOLDER, None)
  if folder is None:  # a worker, or a session without workers
    return
  for dump in sorted(pathlib.Path(folder).glob("*.txt")):
    text = dump.read_text()
    if text.strip():
      terminalreporter.write_sep("=", f"fatal error in worker {dump.stem} (full dump: {dump})")
      terminalreporter.write_line(crashing_thread(text))


def crashing_thread(dump: str) -> str:
  """The fatal-error line and the crashing thread's stack from a faulthandler dump (all of
  it when it names no current thread)."""
  blocks = dump.split("\n\n")
  current = [b for b in blocks if b.lstrip().startswith("Current thread")]
  if not current:
    return dump
  errors = [line for line in dump.splitlines() if line.startswith("Fatal Python error")]
  return "\n".join(errors + [current[0].strip()])


def pytest_unconfigure(config):
  """Removes the controller's fault-dump folder when no worker wrote to it. (The folder
  comes from the session's own stash, not the environment, which a nested session started
  by a test inherits.)"""
  folder = config.stash.get(_FAULT_FOLDER, None)
  if folder is not None:
    dumps = list(pathlib.Path(folder).glob("*.txt"))
    if not any(dump.stat().st_size for dump in dumps):
      shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  """Runs each test (setup, call and teardown) holding the session's run-alone lock: shared
  for an ordinary test, exclusive for a `serial` one, which so waits for the tests running
  in the other xdist workers to finish and keeps new ones from starting until it is done.

  Why a lock: `--dist loadgroup` and `xdist_group` only put tests in the same worker, and
  the other workers go on running theirs; a second pytest invocation for serial tests would
  split the README's one test command. The lock is two files in the session's base
  temporary folder, which every worker of the session shares (pytest removes it with old
  sessions). The serial test takes the gate first and holds it, so it cannot be starved by
  ordinary tests that keep taking the shared lock. The locks are POSIX record locks
  (`fcntl.lockf`): they belong to the process, so a child a test forks does not hold them,
  and they go with it, so a crashed worker never leaves the session locked. Outside an xdist worker (`-n 0`, Bazel's
  one process per target) there is nothing to wait for; Bazel runs a target that holds a
  serial test alone through the target's "exclusive" tag (BUILD). Processes outside the
  session, on the same machine, are not held off: a wall-clock bound still needs a margin.

  After the test, a process over its memory-mapping budget drops its compiled programs
  (`release_compiled_programs`).
  """
  with _run_alone_lock(item.config, item.get_closest_marker("serial") is not None):
    result = yield
  if _MAP_BUDGET is not None:
    release_compiled_programs(_MAP_BUDGET)
  return result


def memory_map_count() -> int:
  """How many memory mappings this process has (Linux's /proc/self/maps, a line each)."""
  with open("/proc/self/maps", "rb") as maps:
    return maps.read().count(b"\n")


def release_compiled_programs(budget: int) -> bool:
  """Drops JAX's compiled programs (`jax.clear_caches()`) when this process holds more than
  `budget` memory mappings; returns whether it did.

  Every XLA:CPU executable keeps 7-20 mappings (its JIT-compiled code and data) while a
  jit cache holds it, and a test worker compiles thousands over a session: two slow-tier
  files' launcher tests took one process from 0.5k to 14k. At the kernel's
  vm.max_map_count (65530 by default) LLVM's next allocation fails ("LLVM compilation
  error: Cannot allocate memory") and XLA then dies of a segmentation fault inside
  `backend_compile_and_load`, which is how slow-tier workers crashed. Clearing the caches
  releases the mappings; later tests recompile what they use (or load it from the
  persistent cache)."""
  if memory_map_count() <= budget:
    return False
  jax.clear_caches()
  gc.collect()
  return True


@contextlib.contextmanager
def _run_alone_lock(config, alone: bool):
  """Holds the session's run-alone lock: exclusive when `alone`, else shared."""
  folder = _lock_folder(config)
  if folder is None:
    yield
    return
  gate, lock = (os.open(folder / f"run-alone-{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                for name in ("gate", "tests"))
  try:
    fcntl.lockf(gate, fcntl.LOCK_EX)  # one test at a time through the gate ...
    fcntl.lockf(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    if not alone:
      fcntl.lockf(gate, fcntl.LOCK_UN)  # ... which a serial test keeps shut until it is done
    yield
  finally:
    os.close(lock)  # closing a file releases its locks
    os.close(gate)


def _lock_folder(config) -> pathlib.Path | None:
  """The folder every xdist worker of this session shares: the parent of the worker's base
  temporary folder (xdist gives each local worker <session basetemp>/popen-gwN). None
  outside a local worker."""
  if not hasattr(config, "workerinput") or not config.option.basetemp:
    return None
  return pathlib.Path(config.option.basetemp).parent
