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
- `JAX_PLATFORMS=cpu`: tests are CPU-only (export another value to override).
- Persistent compilation cache in the user's cache folder (`$XDG_CACHE_HOME/arbor/jax`,
 else `~/.cache/arbor/jax`), shared by every checkout and clone on the machine, so a rerun
 of the suite, or a fresh clone's first run, skips most XLA compilation (about three
 quarters of a cold run's time). Entries are keyed by the computation, the compile options
 and the jax/jaxlib version, so a stale entry is never used; the folder is capped at 2 GiB. Override the place with
 JAX_COMPILATION_CACHE_DIR.
- The slow tier reads that cache but does not write it: a session whose `-m` is not the
 quick tier's `not slow` compiles what it does not find and keeps it in memory only. In
 jaxlib 0.10 a worker that had loaded the quick tier's programs from the cache and then
 wrote new ones crashed in both slow-tier runs after a cold quick tier (one with a
 segmentation fault inside XLA's executable serialisation,
 `compilation_cache.put_executable_and_time`; the other's stack was not kept); neither
 tier alone (cold quick tiers, a slow tier that found everything in the cache, any one test
 file) crashed, and the slow tier after a cold quick tier, reading only, passed.
- Tests marked `serial` run alone: while one runs, no other test of the session does (its
 setup and teardown included). See `pytest_runtest_protocol`.
"""

import contextlib
import fcntl
import os
import pathlib

import pytest

_CACHE_HOME = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_xla_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_FLAG not in _xla_flags:  # an explicit device count from the caller wins
  _xla_flags = f"{_xla_flags} {_DEVICE_FLAG}=8"
if _SCHEDULER_FLAG not in _xla_flags:  # so does an explicit scheduler choice
  _xla_flags = f"{_xla_flags} {_SCHEDULER_FLAG}=false"
os.environ["XLA_FLAGS"] = _xla_flags.strip()

# The cache settings go through the environment (a value already there wins), so that the
# launcher subprocesses some tests start (`python -m experiments.train ...`) share the
# cache on the same terms.
_MIN_COMPILE_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_MIN_COMPILE_TIME_GIVEN = _MIN_COMPILE_TIME in os.environ  # the caller's value wins
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


def pytest_configure(config):
  if config.getoption("markexpr") != "not slow" and not _MIN_COMPILE_TIME_GIVEN:
    # Not the quick tier: read the compilation cache, never write it (module docstring).
    os.environ[_MIN_COMPILE_TIME] = "inf"
    jax.config.update(_MIN_COMPILE_TIME.lower(), float("inf"))
  config.addinivalue_line(
      "markers", "slow: the slow tier (long launcher runs, killed-run resumes, grids, "
      "benchmark smoke runs, statistical tests over many draws); pytest.ini leaves it out "
      "by default and `python -m pytest -q tests -m slow` runs it")
  config.addinivalue_line(
      "markers", "serial: runs alone; no other test of the session runs meanwhile (for "
      "wall-clock bounds; tests/conftest.py)")


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
  """
  with _run_alone_lock(item.config, item.get_closest_marker("serial") is not None):
    return (yield)


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
