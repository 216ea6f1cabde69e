"""Entry point of every py_test in BUILD: runs pytest on the test files named as arguments.

Bazel runs `python3 tests/pytest_main.py tests/test_x.py` in the test's runfiles tree (the
workspace root of that tree is the working directory) and reads the exit status: pytest's
own, so a failing test, an error at collection and a file that collects no test at all
(status 5) all fail the Bazel target.

pytest reads pytest.ini (a data dependency of every test) and tests/conftest.py as it
does for `python -m pytest tests`; on top of pytest.ini's addopts this adds:
- `-m ""`: both test tiers (pytest.ini's addopts leave the `slow` tier out); a target is a
  whole file.
- `-n 0`: one process per target. Bazel runs test targets in parallel itself, and one file
  is one xdist work unit anyway (`--dist loadfile`).
- `-p no:cacheprovider`: no .pytest_cache is written into the runfiles tree.
- `--junitxml=$XML_OUTPUT_FILE`: Bazel's test.xml lists each test case.
- `--basetemp` under $TEST_TMPDIR: tmp_path folders live in the directory Bazel gives the
  test (and cleans), not in the system temporary directory.
"""

import os
import sys


def pytest_args(test_files: list[str], environ) -> list[str]:
  """pytest's command line for `test_files` under Bazel's test environment `environ`."""
  args = [*test_files, "-p", "no:cacheprovider", "-n", "0", "-q", "-m", ""]
  if environ.get("XML_OUTPUT_FILE"):
    args.append(f"--junitxml={environ['XML_OUTPUT_FILE']}")
  if environ.get("TEST_TMPDIR"):
    args.append(f"--basetemp={os.path.join(environ['TEST_TMPDIR'], 'pytest')}")
  return args


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(f"usage: {argv[0]} tests/test_x.py [more test files]", file=sys.stderr)
    return 2
  # Python started sys.path with this file's real folder: tests/ in the source tree, since
  # it resolves the runfiles symlink. Put the workspace root of the runfiles tree there
  # instead, as `python -m pytest` puts its working directory, so that every import
  # resolves in the runfiles tree, among the files BUILD declares.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    import pytest  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(f"pytest is not installed for {sys.executable}: activate the virtualenv Arbor is "
          "installed in before running bazel (docs/testing.md, \"Bazel\").", file=sys.stderr)
    return 2
  return int(pytest.main(pytest_args(argv[1:], os.environ)))


if __name__ == "__main__":
  sys.exit(main(sys.argv))
