"""BUILD mirrors the tree: every package and test .py file is listed once, in the right
target, and every listed file exists. The header of BUILD says how to add a file."""

import pathlib
import re

_REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("models", "sampling", "rl", "sharding", "experiments")
_TARGET = re.compile(r'^(py_library|py_test)\(\s*name\s*=\s*"([^"]+)"(.*?)^\)', re.S | re.M)
_PY_PATH = re.compile(r'"([^"\s]+\.py)"')


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


def _build_targets() -> list[tuple[str, str, list[str]]]:
  """(rule, name, listed .py paths) for each target in BUILD, comments removed."""
  text = (_REPO / "BUILD").read_text()
  text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
  return [(rule, name, _PY_PATH.findall(body)) for rule, name, body in _TARGET.findall(text)]


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
    problems.append(f"{path} is missing from BUILD; add it to {rule} {name!r}")
  for path in sorted(set(listed) - tree):
    problems.append(f"{path} is listed in BUILD (target {listed[path]!r}) but does not "
            f"exist; remove the line")
  assert not problems, "BUILD is out of sync with the tree:\n  " + "\n  ".join(problems)


def test_build_has_one_library_per_package():
  names = {name for rule, name, _ in _build_targets() if rule == "py_library"}
  assert set(PACKAGES) <= names, f"BUILD lacks py_library {sorted(set(PACKAGES) - names)}"
