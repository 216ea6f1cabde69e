"""The test session's own machinery in tests/conftest.py: the report of an xdist worker
killed by a fatal signal; and tests/durations.py's table of test times.

Each test runs a small pytest session in a subprocess, over probe files whose conftest
imports the hooks under test.
"""

import json
import os
import subprocess
import sys

import pytest

from tests import durations

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE_CONFTEST = """
from tests.conftest import pytest_configure, pytest_terminal_summary, pytest_unconfigure
"""


def _run_pytest(folder, *args, extra_env=None):
  """Runs pytest in `folder` with the environment a user's shell would give it (no pytest
  worker variables), plus `extra_env`."""
  (folder / "conftest.py").write_text(_PROBE_CONFTEST)
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("PYTEST_") and k != "ARBOR_TEST_CRASH_FOLDER"}
  env.update(PYTHONPATH=_REPO, TMPDIR=str(folder))  # the session's temporary folders too
  env.update(extra_env or {})
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
      cwd=folder, env=env, capture_output=True, text=True, timeout=600)


_CRASH_PROBE = """
import ctypes, threading, time


def test_a_thread_dereferences_null():
  threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # an idle thread
  crasher = threading.Thread(target=read_address_zero)
  crasher.start()
  crasher.join()


def read_address_zero():
  ctypes.string_at(0)
"""


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_ends_the_log_with_the_crashing_threads_stack(tmp_path):
  (tmp_path / "test_crash.py").write_text(_CRASH_PROBE)
  (tmp_path / "test_fine.py").write_text("def test_fine():\n  pass\n")
  result = _run_pytest(tmp_path, "-n", "2", "--dist", "loadfile", "--max-worker-restart=0",
                       "test_crash.py", "test_fine.py")
  assert result.returncode == 1, result.stdout + result.stderr
  report = result.stdout[result.stdout.index("fatal error in worker"):]
  assert "Fatal Python error: Segmentation fault" in report
  # The crashing thread's frames, and not the idle thread's.
  assert "in read_address_zero" in report and "in sleep" not in report
  assert "1 failed, 1 passed" in result.stdout


@pytest.mark.slow
def test_a_nested_session_leaves_the_outer_sessions_fault_dumps_alone(tmp_path):
  # A test that starts pytest itself hands it the outer session's folder in the environment.
  outer = tmp_path / "outer-faults"
  outer.mkdir()
  (outer / "gw0.txt").write_text("")
  (tmp_path / "test_fine.py").write_text("def test_fine():\n  pass\n")
  result = _run_pytest(tmp_path, "-n", "0", "test_fine.py",
                       extra_env={"ARBOR_TEST_CRASH_FOLDER": str(outer)})
  assert result.returncode == 0, result.stdout + result.stderr
  assert (outer / "gw0.txt").exists()


def test_the_crash_report_keeps_the_error_and_the_current_threads_stack():
  from tests import conftest  # pylint: disable=import-outside-toplevel
  dump = ("Fatal Python error: Aborted\n\n"
          "Thread 0x01 (most recent call first):\n  File \"a.py\", line 1 in idle\n\n"
          "Current thread 0x02 (most recent call first):\n  File \"b.py\", line 2 in crash\n"
          "  File \"b.py\", line 9 in run\n\nExtension modules: numpy (total: 1)\n")
  assert conftest.crashing_thread(dump) == (
      "Fatal Python error: Aborted\nCurrent thread 0x02 (most recent call first):\n"
      "  File \"b.py\", line 2 in crash\n  File \"b.py\", line 9 in run")
  # A dump that names no current thread (a fault outside Python code) is shown whole.
  assert conftest.crashing_thread("Fatal Python error: Aborted\n\n") == (
      "Fatal Python error: Aborted\n\n")


_MAPS_PROBE = """
import json

import jax
import jax.numpy as jnp

from tests import conftest

before = conftest.memory_map_count()
programs = [jax.jit(lambda x, i=i: jnp.sin(x @ x.T) * i) for i in range(60)]
for i, program in enumerate(programs):  # 60 executables, each with its own mappings
  program(jnp.ones((8 + i, 4))).block_until_ready()
compiled = conftest.memory_map_count()
kept = conftest.release_compiled_programs(budget=compiled + 1000)
after_kept = conftest.memory_map_count()
released = conftest.release_compiled_programs(budget=compiled - 1)
after_released = conftest.memory_map_count()
print(json.dumps([before, compiled, kept, after_kept, released, after_released]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux's mappings")
def test_compiled_programs_are_released_over_the_memory_map_budget(tmp_path):
  script = tmp_path / "probe.py"
  script.write_text(_MAPS_PROBE)
  env = {**os.environ, "PYTHONPATH": _REPO, "JAX_ENABLE_COMPILATION_CACHE": "false"}
  result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=True)
  before, compiled, kept, after_kept, released, after_released = json.loads(
      result.stdout.splitlines()[-1])
  assert compiled - before > 60 * 5  # each executable holds several mappings
  assert not kept and after_kept >= compiled - 50  # under the budget nothing is dropped
  # Over it, the caches go and the executables' mappings with them.
  assert released and after_released - before < (compiled - before) / 4


def test_durations_sum_a_files_tests_and_list_every_test_slowest_first(tmp_path):
  (tmp_path / "tier.xml").write_text(
      '<testsuites><testsuite name="pytest">'
      '<testcase classname="tests.test_a" name="test_x[1]" time="2.5"/>'
      '<testcase classname="tests.test_a" name="test_y" time="0.5"/>'
      '<testcase classname="tests.test_b" name="test_z" time="4.0"><skipped/></testcase>'
      '</testsuite></testsuites>')
  times = durations.read_times(str(tmp_path / "tier.xml"))
  assert times == {"tests/test_a.py::test_x[1]": 2.5, "tests/test_a.py::test_y": 0.5,
                   "tests/test_b.py::test_z": 4.0}
  assert durations.by_file(times) == [("tests/test_b.py", 1, 4.0), ("tests/test_a.py", 2, 3.0)]
  lines = durations.tier_section("Quick", times, "measured: 1 s")
  assert lines.index("| tests/test_b.py::test_z | 4.00 |") < lines.index(
      "| tests/test_a.py::test_x[1] | 2.50 |") < lines.index("| tests/test_a.py::test_y | 0.50 |")
  assert "3 tests, 7 s in all (both workers' time)." in lines
