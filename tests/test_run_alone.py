"""Tests that must run alone, and the mechanism that runs them alone.

A wall-clock bound means something only when nothing else in the session runs beside the
test: such a test is marked `serial`, and tests/conftest.py holds the session's other tests
off while it runs (under Bazel this file's target is "exclusive"). Other processes on the
machine are not held off, so the bounds keep a margin.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from rl.tasks import gsm
from tests import scoring_tasks

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.serial
@pytest.mark.slow
def test_each_hostile_math_completion_takes_at_most_a_few_seconds_of_wall_time():
  # tests/test_math_task.py bounds the CPU time of the same calls, which no other process's
  # load inflates but which cannot see a blocking hang; wall time can. rl.tasks.math_answer's
  # alarm ends math-verify after VERIFY_TIMEOUT_S (1 s) of wall time. Slow tier: while it
  # runs (7 s), the quick tier's other worker would wait.
  gsm.score.cache_clear()
  gsm.score("\\boxed{2 \\cdot 36}", "72")  # imports and the parser's first use: not timed
  scoring_tasks.assert_each_hostile_math_completion_is_bounded(time.perf_counter)


_PROBE_CONFTEST = """
from tests.conftest import pytest_configure, pytest_runtest_protocol, pytest_unconfigure
"""

_PROBE_TESTS = """
import json, os, time

import pytest


def _record(name):
  start = time.monotonic()
  time.sleep(0.2)
  with open(os.environ["RUN_ALONE_LOG"], "a", encoding="utf-8") as log:
    log.write(json.dumps([name, start, time.monotonic()]) + "\\n")

{tests}
"""


def _probe_tests(prefix: str, count: int, serial_at: int | None = None) -> str:
  """`count` tests that each sleep 0.2 s and log their interval; the one at `serial_at` is
  marked serial."""
  tests = []
  for i in range(count):
    mark = "@pytest.mark.serial\n" if i == serial_at else ""
    name = "serial" if i == serial_at else f"{prefix}{i}"
    tests.append(f"{mark}def test_{name}():\n  _record({name!r})\n")
  return _PROBE_TESTS.format(tests="\n\n".join(tests))


def _overlap(a, b) -> bool:
  return a[1] < b[2] and b[1] < a[2]


@pytest.mark.slow
def test_a_serial_test_runs_while_no_other_test_does(tmp_path):
  # Two xdist workers, one file each: the files' ordinary tests overlap (two workers at work),
  # the serial one overlaps none of them.
  (tmp_path / "conftest.py").write_text(_PROBE_CONFTEST)
  (tmp_path / "test_a.py").write_text(_probe_tests("a", 7, serial_at=3))
  (tmp_path / "test_b.py").write_text(_probe_tests("b", 12))
  log = tmp_path / "log.jsonl"
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env.update(PYTHONPATH=_REPO, RUN_ALONE_LOG=str(log))
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
       "no:cacheprovider", f"--basetemp={tmp_path / 'basetemp'}", "test_a.py", "test_b.py"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  runs = [json.loads(line) for line in log.read_text().splitlines()]
  assert len(runs) == 19
  (serial,) = [run for run in runs if run[0] == "serial"]
  others = [run for run in runs if run[0] != "serial"]
  beside = [run[0] for run in others if _overlap(run, serial)]
  assert not beside, f"ran beside the serial test: {beside}"
  assert any(_overlap(a, b) for a in others if a[0].startswith("a")
             for b in others if b[0].startswith("b"))
