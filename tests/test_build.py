"""BUILD mirrors the tree and runs it: every package and test .py file is listed once, in the
right target, every listed file exists, and every py_test runs its own test file through
pytest (tests/pytest_main.py), so no target can pass without running a test. The header of
BUILD says how to add a file.

Under Bazel the runfiles tree holds only the files BUILD lists, so the tree is read where
this file really is (`resolve()` follows the runfiles symlink back to the source tree).
"""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("models", "sampling", "rl", "sharding", "experiments")
ENTRY_POINT = "tests/pytest_main.py"  # the main of every py_test, and in no other target
_TARGET = re.compile(r'^(py_library|py_test)\(\s*name\s*=\s*"([^"]+)"(.*?)^\)', re.S | re.M)
_PY_PATH = re.compile(r'"([^"\s]+\.py)"')
_ATTRIBUTE = re.compile(r"^    (\w+) = (.*?),?\s*(?=^    \w+ = |\Z)", re.S | re.M)


def _tree_files() -> set[str]:
  """The .py files under the packages and tests/, as repo-relative posix paths."""
  files = set()
  for top in PACKAGES + ("tests",):
    for path in (_REPO / top).rglob("*.py"):
      relative = path.relative_to(_REPO)
      if any(part == "__pycache__" or part.startswith(".") for part in relative.parts):
        continue
      files.add(relative.as_posix())
  return files


def _build_text() -> str:
  """BUILD without its comments."""
  text = (_REPO / "BUILD").read_text()
  return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def _build_targets() -> list[tuple[str, str, list[str]]]:
  """(rule, name, listed .py paths) for each target in BUILD, comments removed."""
  return [(rule, name, _PY_PATH.findall(body))
          for rule, name, body in _TARGET.findall(_build_text())]


def _py_tests() -> dict[str, dict[str, object]]:
  """The attributes of each py_test in BUILD, by target name: literal values (lists,
  strings) evaluated, anything else (a glob, a select) kept as its source text."""
  tests = {}
  for rule, name, body in _TARGET.findall(_build_text()):
    if rule != "py_test":
      continue
    attributes = {}
    for key, value in _ATTRIBUTE.findall(body):
      try:
        attributes[key] = ast.literal_eval(value.strip())
      except (ValueError, SyntaxError):
        attributes[key] = value.strip()
    tests[name] = attributes
  return tests


def _expected_target(path: str) -> tuple[str, str]:
  top, _, rest = path.partition("/")
  if top != "tests":
    return "py_library", top
  if "/" not in rest and rest.startswith("test_"):
    return "py_test", rest[: -len(".py")]
  return "py_library", "test_support"


def test_build_lists_every_file_once_in_its_target():
  targets = _build_targets()
  listed = {}
  problems = []
  for rule, name, paths in targets:
    for path in paths:
      if path == ENTRY_POINT:  # in every py_test: checked by the test after the next one
        if rule != "py_test":
          problems.append(f"{path} is in {rule} {name!r}; it belongs only in the py_test "
                          f"targets, as their main")
        listed.setdefault(path, name)
        continue
      if path in listed:
        problems.append(f"{path} is listed twice in BUILD ({listed[path]} and {name})")
      listed[path] = name
      expected = _expected_target(path)
      if (rule, name) != expected:
        problems.append(f"{path} is in {rule} {name!r}; it belongs in "
                f"{expected[0]} {expected[1]!r}")
  tree = _tree_files()
  for path in sorted(tree - set(listed)):
    rule, name = _expected_target(path)
    if path == ENTRY_POINT:
      rule, name = "py_test", "test_*"
    problems.append(f"{path} is missing from BUILD; add it to {rule} {name!r}")
  for path in sorted(set(listed) - tree):
    problems.append(f"{path} is listed in BUILD (target {listed[path]!r}) but does not "
            f"exist; remove the line")
  assert not problems, "BUILD is out of sync with the tree:\n  " + "\n  ".join(problems)


def test_build_has_one_library_per_package():
  names = {name for rule, name, _ in _build_targets() if rule == "py_library"}
  assert set(PACKAGES) <= names, f"BUILD lacks py_library {sorted(set(PACKAGES) - names)}"


def test_every_py_test_runs_its_own_file_through_pytest():
  """A py_test without the entry point would run its test module as a script, which defines
  tests and exits 0: Bazel would report a pass without running one."""
  tests = _py_tests()
  assert tests, "BUILD has no py_test"
  problems = []
  for name, attributes in sorted(tests.items()):
    own = f"tests/{name}.py"
    expected = {"srcs": [own, ENTRY_POINT], "main": ENTRY_POINT,
                "args": [f"$(rootpath {own})"]}
    for key, value in expected.items():
      if attributes.get(key) != value:
        problems.append(f"py_test {name!r}: {key} is {attributes.get(key)!r}, expected "
                        f"{value!r}")
    if ":test_support" not in attributes.get("deps", []):
      problems.append(f"py_test {name!r} lacks deps ':test_support' (tests/conftest.py and "
                      f"pytest.ini)")
    if attributes.get("size") not in ("small", "medium", "large", "enormous"):
      problems.append(f"py_test {name!r} needs an explicit size (BUILD's header says how to "
                      f"choose it)")
  assert not problems, "py_test targets that would not run their tests:\n  " + (
      "\n  ".join(problems))


def test_no_test_module_imports_another():
  """A py_test's runfiles hold its own test file and test_support, not the other test
  files: a test importing `tests.test_x` passes under pytest and fails to collect under
  Bazel. Shared helpers go in a support module (tests/*.py not named test_*)."""
  importers = sorted(
      path.name for path in (_REPO / "tests").glob("test_*.py")
      if re.search(r"^\s*(from tests\.test_\w+ import|import tests\.test_)",
                   path.read_text(), re.M))
  assert not importers, (f"{importers} import another test module; move what they share "
                         "to a support module listed in test_support")


def test_no_test_rule_other_than_py_test():
  """Every test target is one of the py_test targets checked above."""
  rules = set(re.findall(r"^(\w+_test)\(", _build_text(), re.M))
  assert rules <= {"py_test"}, f"BUILD has test rules the checks here do not cover: {rules}"


@pytest.mark.parametrize("body, status", [
    ("def test_ok():\n  assert 1 + 1 == 2\n", 0),
    ("def test_broken():\n  assert 1 + 1 == 3\n", 1),
    ("def helper():\n  return 1\n", 5),  # no test collected: a failure for Bazel too
], ids=["passes", "fails", "collects_nothing"])
def test_entry_point_exits_with_pytests_status(tmp_path, body, status):
  test_file = tmp_path / "test_probe.py"
  test_file.write_text(body)
  # Under Bazel the child must not write this test's test.xml nor clear its --basetemp.
  env = {k: v for k, v in os.environ.items() if k not in ("XML_OUTPUT_FILE", "TEST_TMPDIR")}
  result = subprocess.run([sys.executable, str(_REPO / ENTRY_POINT), str(test_file)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == status, result.stdout + result.stderr


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_are_imported_from_this_tree(package):
  """The tests test the tree they sit in (the runfiles tree under Bazel), not another
  checkout that an editable install of the environment points at."""
  module = __import__(package)
  here = pathlib.Path(__file__).absolute().parent.parent
  assert pathlib.Path(module.__file__).absolute().parent.parent == here, (
      f"{package} comes from {module.__file__}, not from {here}")


def test_the_experiment_modules_tests_import_load_together():
  """Every experiments module a test imports defines flags no other one defines (pytest
  runs several test files in one process; a flag defined twice fails the collection)."""
  import glob  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  modules = set()
  for path in glob.glob(os.path.join(root, "tests", "*.py")):
    text = open(path).read()
    modules.update(f"experiments.{m}" for m in re.findall(
        r"^from experiments import (\w+)", text, re.M))
  modules = sorted(m for m in modules
                   if os.path.exists(os.path.join(root, *m.split(".")) + ".py"))
  assert "experiments.grid" in modules and "experiments.trl_parity" in modules
  done = subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)], cwd=root,
                        capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
