"""docs/ stays true: the configuration reference is current and complete, the recipes of
add_objective.md, add_task.md, concepts.md, math.md and tools.md work when their code blocks are run exactly as written,
and a claim about what a test checks names the test (`tests/test_x.py::test_name`), which exists.

Each ```python block of a recipe starts with a `# <file name>` comment; the test writes the
blocks to those files in a temporary folder and uses them as the page says.
"""

import ast
import functools
import importlib
import importlib.util
import pathlib
import re
import runpy
import sys

import numpy as np
import pytest

from experiments import config_reference
from experiments import train as train_launcher
from rl import tasks
from rl import wiring
from rl.objectives import losses
from rl.rollouts import kinds
from tests.launcher_config import apply_overrides, rl_steps

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def write_blocks(page: str, folder: pathlib.Path) -> dict[str, pathlib.Path]:
  """Writes each python block of docs/<page> to the file its first line names."""
  files = {}
  for block in _BLOCK.findall((DOCS / page).read_text()):
    first = block.splitlines()[0]
    assert re.fullmatch(r"# [\w.]+\.py", first), f"{page}: block must start with '# <file>.py'"
    name = first[2:]
    files[name] = folder / name
    files[name].write_text(block)
  return files


@pytest.fixture
def recipe_folder(tmp_path, monkeypatch):
  """A folder on sys.path; modules imported from it are forgotten afterwards."""
  monkeypatch.syspath_prepend(str(tmp_path))
  before = set(sys.modules)
  yield tmp_path
  for name in set(sys.modules) - before:
    if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in sys.modules[name].__file__:
      del sys.modules[name]


def load_config_file(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def run_tiny(config, workdir):
  """Runs `config` in `workdir` shrunk to seconds (8 held-out items, 2 warm-start steps of 8,
  2 RL steps of 2 prompts x 4 completions); its summary and RL train steps' records."""
  apply_overrides(config, {
      "workdir": str(workdir), "task.eval_size": 8, "warm_start.steps": 2,
      "warm_start.batch_size": 8, "rl.steps": 2, "rollout.prompts_per_step": 2,
      "rollout.group_size": 4, "eval.batch_size": 8})
  return train_launcher.run(config), rl_steps(workdir)


def test_configuration_reference_is_current_and_every_field_has_a_comment():
  assert (DOCS / "configuration.md").read_text() == config_reference.render(), (
      "docs/configuration.md is out of date: run python -m experiments.config_reference")
  assert config_reference.undocumented() == [], "add a comment to these fields in default.py"


def test_config_reference_parses_continuations_and_blocks_above():
  source = '''
import ml_collections
def get_config():
  c = ml_collections.ConfigDict()
  c.a = ml_collections.ConfigDict()  # the a section
  # A block above
  # on two lines.
  c.a.x = dict(
      y=1)                # first part
                          # second part
  c.a.z = 2
  return c
'''
  entries = config_reference.parse_entries(source)
  assert [(e.name, e.is_section, e.description) for e in entries] == [
      ("a", True, "the a section"),
      ("a.x", False, "A block above on two lines. first part second part"),
      ("a.z", False, "")]


@pytest.mark.slow  # the quick tier runs the other recipes through the launcher
def test_add_objective_recipe(recipe_folder):
  files = write_blocks("add_objective.md", recipe_folder)
  assert list(files) == ["my_objectives.py", "test_my_objectives.py", "reinforce_config.py"]
  try:
    test_module = importlib.import_module("test_my_objectives")
    test_module.test_reinforce_matches_hand_computation()
    assert "reinforce" in losses.LOSSES

    config = load_config_file(files["reinforce_config.py"])
    assert config.loss.name == "reinforce"
    summary, steps = run_tiny(config, recipe_folder / "run")
    assert summary["steps"] == 4 and summary["nonfinite_updates"] == 0
    assert all("positive_advantage_fraction" in r for r in steps)
    assert np.isfinite([r["loss"] for r in steps]).all()
  finally:
    losses.LOSSES.unregister("reinforce")


def test_add_rollout_kind_recipe(recipe_folder):
  files = write_blocks("concepts.md", recipe_folder)
  assert list(files) == ["pass_at_group.py", "pass_at_group_config.py"]
  try:
    config = load_config_file(files["pass_at_group_config.py"])
    assert config.rollout.kind == "pass_at_group"
    summary, steps = run_tiny(config, recipe_folder / "run")
    assert summary["steps"] == 4 and summary["nonfinite_updates"] == 0
    assert len(steps) == 2
    for record in steps:  # pass@G is at least the batch's exact-match rate, at most 1
      assert record["exact_match"] <= record["pass_at_group"] <= 1.0
    config.selection.kind = "dynamic"  # the kind declares no selection rule but uniform
    with pytest.raises(ValueError, match="config.selection.kind = 'dynamic'"):
      wiring.validate(config)
  finally:
    kinds.ROLLOUT_KINDS.unregister("pass_at_group")


@pytest.mark.slow
def test_math_page_example(recipe_folder):
  files = write_blocks("math.md", recipe_folder)
  assert list(files) == ["check_gsm.py", "prompt_lengths.py"]
  runpy.run_path(str(files["check_gsm.py"]))  # its asserts are the check
  runpy.run_path(str(files["prompt_lengths.py"]))  # the config's prompt_len fits every prompt


def test_add_task_recipe(recipe_folder):
  files = write_blocks("add_task.md", recipe_folder)
  assert list(files) == ["my_tasks.py", "check_my_tasks.py", "gcd_config.py", "my_own_task.py",
                         "check_my_own_task.py"]
  try:
    runpy.run_path(str(files["check_my_own_task.py"]))  # a task class of one's own
    assert "parity" not in tasks.task_names()  # the check unregisters it
    runpy.run_path(str(files["check_my_tasks.py"]))  # its asserts are the check
    assert "gcd" in tasks.task_names()
    task = tasks.make_task("gcd", max_value=99, eval_size=20)
    example = task.examples("eval", 1)[0]
    numbers = example.entry["metadata"]["numbers"]
    common = [d for d in range(2, 100) if all(n % d == 0 for n in numbers)]
    partial = [d for d in common if d != int(example.answer)]
    if partial:
      assert task.reward(str(partial[0]), example) == 0.2

    config = load_config_file(files["gcd_config.py"])
    wiring.validate(config)
    task = tasks.make_task(config.task.name, config.task.prompt_style,
                           eval_size=50, **config.task.difficulty)
    prompts = [e.prompt for e in task.examples("train", 200)]
    from models.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
    from rl.rollouts.batches import encode_prompts  # pylint: disable=import-outside-toplevel
    encode_prompts(CharTokenizer(), prompts, config.rollout.prompt_len)  # all fit and encode
    with pytest.raises(ValueError, match="already registered"):
      runpy.run_path(str(files["my_tasks.py"]))
  finally:
    tasks.TASKS.unregister("gcd")


def test_write_an_environment_recipe(recipe_folder):
  files = write_blocks("tools.md", recipe_folder)
  assert list(files) == ["my_environments.py", "check_my_environments.py", "subtractor_config.py"]
  from models.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  from rl import environments  # pylint: disable=import-outside-toplevel
  try:
    runpy.run_path(str(files["check_my_environments.py"]))  # its asserts are the check
    config = load_config_file(files["subtractor_config.py"])
    wiring.validate(config)
    turns = wiring.make_turns(wiring.settings(config), CharTokenizer())
    assert turns.environment.name == "subtractor" and turns.config.max_turns == 9
  finally:
    environments.ENVIRONMENTS.unregister("subtractor")


# --- Claims about tests name the tests --------------------------------------------------------

_REPO = DOCS.parent
# tests/test_x.py::name; markdown may break the line after "::".
_TEST_REFERENCE = re.compile(r"tests/(test_\w+\.py)::\s*(\w+)")
_TEST_FILE = re.compile(r"tests/(test_\w+\.py)(?!::)")
_SPLIT_PATH = re.compile(r"tests/\s+test_\w+")
_CLAIM_WORD = re.compile(r"\b(check|test|verif|assert|compar)\w*", re.I)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+\.)\s")
# Records of past measurements (a frozen log; the generated table of test times): the
# tests they name may have been renamed since.
_NOT_CHECKED = ("benchmarks_history.md", "test_durations.md")


def _pages() -> list[pathlib.Path]:
  return [p for p in sorted(DOCS.glob("*.md")) if p.name not in _NOT_CHECKED] + [
      _REPO / "README.md"]


@functools.cache
def _module_functions(path: pathlib.Path) -> frozenset[str]:
  """The functions a Python file defines at module level (parsed, not imported)."""
  tree = ast.parse(path.read_text(), str(path))
  return frozenset(node.name for node in tree.body
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _blocks(text: str) -> list[str]:
  """The paragraphs and list items of a markdown text, code blocks left out."""
  blocks, current = [], []
  for line in _FENCE.sub("", text).splitlines():
    if not line.strip() or _LIST_ITEM.match(line):
      if current:
        blocks.append("\n".join(current))
      current = [line] if line.strip() else []
    else:
      current.append(line)
  return blocks + (["\n".join(current)] if current else [])


def named_test_problems(doc: str, text: str, tests: pathlib.Path) -> list[str]:
  """What is wrong with the tests a doc names: `tests/test_x.py::name` must be a test
  function defined at the top level of tests/test_x.py."""
  problems = []
  for match in _SPLIT_PATH.finditer(text):
    problems.append(f"{doc}: '{match.group()}' splits a test's path across lines; write "
                    "tests/test_x.py::name on one line")
  for file_name, name in _TEST_REFERENCE.findall(text):
    reference = f"tests/{file_name}::{name}"
    path = tests / file_name
    if not path.exists():
      problems.append(f"{doc}: {reference}: there is no {path.relative_to(tests.parent)}; "
                      "name an existing test file")
    elif not name.startswith("test") or name not in _module_functions(path):
      problems.append(f"{doc}: {reference}: {file_name} defines no test function {name!r} at "
                      "module level; name the test that checks the claim (a parametrised "
                      "test by its function name, without [id]), or drop the claim")
  return problems


def unnamed_test_problems(doc: str, text: str) -> list[str]:
  """A paragraph or list item that mentions a test file with a word of checking (check,
  test, verify, assert, compare) names a test function of that file."""
  problems = []
  for block in _blocks(text):
    bare = set(_TEST_FILE.findall(block))
    named = {file_name for file_name, _ in _TEST_REFERENCE.findall(block)}
    words = _TEST_FILE.sub("", _TEST_REFERENCE.sub("", block))
    if bare - named and _CLAIM_WORD.search(words):
      first = " ".join(block.split())[:120]
      for file_name in sorted(bare - named):
        problems.append(f"{doc}: '{first}...' claims what tests/{file_name} checks but names "
                        f"none of its tests; write tests/{file_name}::<test function>")
  return problems


def test_every_test_a_doc_names_exists():
  tests = _REPO / "tests"
  problems = [problem for page in _pages()
              for problem in named_test_problems(page.name, page.read_text(), tests)]
  assert not problems, "\n".join(problems)
  # The check can fail: a made-up test, a made-up file, a helper, a split path.
  bad = ("Checked (`tests/test_docs.py::test_no_such_test`, tests/test_nowhere.py::test_a,\n"
         "tests/test_docs.py::_blocks, tests/test_docs.py::\ntest_also_missing); tests/\n"
         "test_docs.py::test_every_test_a_doc_names_exists is fine.")
  found = named_test_problems("scratch", bad, tests)
  assert len(found) == 5, "\n".join(found)
  assert all(p.startswith("scratch: ") for p in found)
  assert any("test_no_such_test" in p for p in found) and any("test_nowhere" in p for p in found)
  assert any("_blocks" in p for p in found) and any("test_also_missing" in p for p in found)


def test_a_doc_that_claims_what_a_test_file_checks_names_its_tests():
  problems = [problem for page in _pages()
              for problem in unnamed_test_problems(page.name, page.read_text())]
  assert not problems, "\n".join(problems)
  # The check can fail; a file that is only mentioned, or named with a test, passes.
  bad = ("Intro.\n\n- `tests/test_lora.py` tests all three.\n- The sharded step\n  equals "
         "(tests/test_sharding.py::test_x, tests/test_train_sharded.py) check.\n\n"
         "`tests/test_docs.py::test_add_task_recipe` runs it; tests/test_docs.py is long.\n\n"
         "```\npython -m pytest tests/test_losses.py  # checks\n```\n\n"
         "See tests/test_grid.py.\n")
  found = unnamed_test_problems("scratch", bad)
  assert len(found) == 2, "\n".join(found)
  assert "claims what tests/test_lora.py checks" in found[0]
  assert "claims what tests/test_train_sharded.py checks" in found[1]


def test_the_readme_own_data_command_is_a_valid_run():
  """The README's own-model-and-data command, as the launcher resolves it (the default
  config with its overrides, the dataset task's own defaults: `config_flag.resolved`),
  passes the launcher's whole check, and its files are the committed examples."""
  import shlex  # pylint: disable=import-outside-toplevel
  from experiments import config_flag  # pylint: disable=import-outside-toplevel
  from experiments.configs import default  # pylint: disable=import-outside-toplevel
  readme = (_REPO / "README.md").read_text()
  section = readme[readme.index("## Your own model and data"):]
  block = _FENCE.search(section).group()
  command = shlex.split(" ".join(line.rstrip("\\") for line in block.splitlines()[1:-1]))
  assert command[:3] == ["python", "-m", "experiments.train"]
  overrides = dict(arg[len("--config."):].split("=", 1) for arg in command[3:])
  parse = lambda value: {"True": True, "False": False}.get(value, value)
  values = {}
  for path, value in overrides.items():
    try:
      values[path] = int(value)
    except ValueError:
      values[path] = parse(value)
  config = config_flag.task_defaults(apply_overrides(default.get_config(), values),
                                     list(overrides), "running_sum")
  assert (_REPO / config.task.path).is_file() and (_REPO / config.task.eval_path).is_file()
  assert config.task.prompt_style == "full" and not config.task.difficulty
  wiring.validate(config)
