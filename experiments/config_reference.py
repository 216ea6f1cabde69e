"""Generate docs/configuration.md from experiments/configs/default.py and the settings
classes it takes sections from.

    python -m experiments.config_reference            # rewrite docs/configuration.md
    python -m experiments.config_reference --check    # exit 1 if the doc is out of date

Each `c.<section>.<field> = value  # comment` line of `get_config()` becomes a table row:
the field's dotted name, its default (the value `get_config()` returns) and the comment.
A comment continues on the following comment-only lines indented past the statement; a
comment block just above a statement is put in front of its description. An assignment
of an empty `ConfigDict()` opens a section (its comment, if any, introduces the section).
A section assigned from a settings class (`c.loss = loss.LossSettings.config_section()`,
rl/settings/) is documented from the class: a row per field, with the field's `doc`.
tests/test_docs.py checks that the doc is current and that every field has a comment.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import sys
import tokenize

from experiments.configs import default

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_PATH = os.path.join(_REPO, "experiments", "configs", "default.py")
DOC_PATH = os.path.join(_REPO, "docs", "configuration.md")


@dataclasses.dataclass
class Entry:
  """One assignment in get_config(): `name` without the leading 'c.'; `settings` the
  dotted name of the settings class a section is taken from ("losses.LossSettings")."""
  name: str
  is_section: bool
  description: str
  settings: str = ""


def _target_name(node: ast.expr) -> str | None:
  """'a.b' for the target `c.a.b`; None for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name) or not parts:
    return None
  return ".".join(reversed(parts))


def _settings_class(value: ast.expr) -> str:
  """'losses.LossSettings' for `losses.LossSettings.config_section()`, else ''."""
  if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
      and value.func.attr == "config_section"):
    return ast.unparse(value.func.value)
  return ""


def _is_settings_update(statement: ast.stmt) -> bool:
  """`c.<section>.update(<Settings class>.config_section())`: fields of a settings class
  added to a section that has others."""
  return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
          and isinstance(statement.value.func, ast.Attribute)
          and statement.value.func.attr == "update" and len(statement.value.args) == 1
          and bool(_settings_class(statement.value.args[0])))


def _is_empty_config_dict(value: ast.expr) -> bool:
  if not isinstance(value, ast.Call) or value.args or value.keywords:
    return False
  func = value.func
  return getattr(func, "attr", getattr(func, "id", None)) == "ConfigDict"


def _comments_above(statement: ast.stmt, comments: dict, lines: list[str]) -> list[str]:
  """The comment block directly above a statement, at its indentation."""
  above, line = [], statement.lineno - 1
  while (line in comments and lines[line - 1].strip().startswith("#")
         and comments[line][0] == statement.col_offset):
    above.insert(0, comments[line][1])
    line -= 1
  return above


def parse_entries(source: str) -> list[Entry]:
  """The documented assignments of `get_config` in `source`, in order."""
  comments = {}  # line -> (column, text) of each comment
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      comments[token.start[0]] = (token.start[1], token.string.lstrip("#").strip())
  lines = source.splitlines()
  function = next(n for n in ast.parse(source).body
                  if isinstance(n, ast.FunctionDef) and n.name == "get_config")
  entries = []
  for statement in function.body:
    if _is_settings_update(statement):  # c.task.update(dataset.DatasetSettings.config_section()), rl/settings/dataset.py
      call = statement.value
      entries.append(Entry(name=_target_name(call.func.value), is_section=False,
                           description=" ".join(_comments_above(statement, comments, lines)),
                           settings=_settings_class(call.args[0])))
      continue
    if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
      continue
    name = _target_name(statement.targets[0])
    if name is None:
      continue
    first, last = statement.lineno, statement.end_lineno
    above = _comments_above(statement, comments, lines)
    # Comments on the statement's own lines, then comment-only lines indented past it.
    own = [comments[l][1] for l in range(first, last + 1) if l in comments]
    line = last + 1
    while (line in comments and lines[line - 1].strip().startswith("#")
           and comments[line][0] > statement.col_offset):
      own.append(comments[line][1])
      line += 1
    settings = _settings_class(statement.value)
    entries.append(Entry(name=name, is_section=_is_empty_config_dict(statement.value) or
                         bool(settings), description=" ".join(above + own), settings=settings))
  return entries


def _lookup(config, name: str):
  for part in name.split("."):
    config = config[part]
  return config


def _settings_rows(entry: Entry) -> list[tuple[str, str]]:
  """(field name, doc) of the settings class a section is taken from."""
  cls = default
  for part in entry.settings.split("."):
    cls = getattr(cls, part)
  return [(f"{entry.name}.{field}", doc) for field, _, doc in cls.docs()]


def _format_value(value) -> str:
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  return "`" + repr(value).replace("|", "\\|") + "`"


def render(source: str | None = None) -> str:
  """The markdown reference for default.py (its source text may be passed in)."""
  if source is None:
    with open(CONFIG_PATH) as f:
      source = f.read()
  config = default.get_config()
  out = ["# Configuration reference", "",
         "<!-- Generated by `python -m experiments.config_reference` from the comments in",
         "     experiments/configs/default.py. Do not edit: change the comments and regenerate. -->",
         "",
         "Every field of the default run's config (`experiments/configs/default.py`). Override",
         "any of them on the command line, e.g. `python -m experiments.train "
         "--config.rl.steps=50`,",
         "or write a config file that starts from `default.get_config()` and pass it with",
         "`--config=path/to/file.py`.", "",
         "The launcher validates the whole config up front, before it loads a model or takes",
         "a step (`rl/wiring.py` `validate`, which runs `RunSettings.check` of",
         "`rl/settings/run.py` and `rl/composition.py`'s check): every size must be positive and every",
         "rate or bound in its range, and every name (task, model preset, objective,",
         "aggregation, corrections, proximal estimate, advantage estimator, tree policy and",
         "advantage, selection kind) must be one its registry knows; a bad value is a",
         "ValueError naming the field and the fix. A command-line override of a field that",
         "does not exist (`--config.rl.stepz=5`) is a flag error listing the valid fields.",
         ""]
  in_table = False
  for entry in parse_entries(source):
    description = entry.description.replace("|", "\\|")
    if entry.is_section:
      out += ["", f"## `{entry.name}`", ""]
      if description:
        out += [description[0].upper() + description[1:] + ("" if description.endswith(".") else "."), ""]
      in_table = bool(entry.settings)  # fields assigned after a class's stay in its table
      if entry.settings:
        out += ["| field | default | meaning |", "|---|---|---|"]
        out += [f"| `{name}` | {_format_value(_lookup(config, name))} | {doc.replace('|', chr(92) + '|')} |"
                for name, doc in _settings_rows(entry)]
      continue
    if not in_table:
      out += ["| field | default | meaning |", "|---|---|---|"]
      in_table = True
    if entry.settings:  # a settings class's fields, in the section's table
      rows = _settings_rows(entry)
      out += [f"| `{name}` | {_format_value(_lookup(config, name))} | "
              + (f"{description} " if i == 0 and description else "")
              + doc.replace("|", "\\|") + " |" for i, (name, doc) in enumerate(rows)]
      continue
    out.append(f"| `{entry.name}` | {_format_value(_lookup(config, entry.name))} | {description} |")
  return "\n".join(out + composition_table()) + "\n"


# (column title, config overrides) of the composition table, after rollout and selection.
_COMPOSITION_COLUMNS = (
    ("sync", {}), ("sync, `rl.staleness=2`", {"rl.staleness": 2}),
    ("`rl.async_`", {"rl.async_": True}),
    ("`rl.async_`, `rl.staleness=2`", {"rl.async_": True, "rl.staleness": 2}),
    ("`mesh.data=2`", {"mesh.data": 2}))


def composition_table() -> list[str]:
  """The section saying which combinations of the RL phase's switches run, each cell
  computed by the launcher's own check (`rl.composition.check_switches`)."""
  from rl import composition  # pylint: disable=import-outside-toplevel  (imports JAX)
  from rl import wiring  # pylint: disable=import-outside-toplevel
  from rl.rollouts import kinds  # pylint: disable=import-outside-toplevel
  from rl.rollouts import selection as selection_lib  # pylint: disable=import-outside-toplevel
  out = ["", "## Which switches compose", "",
         "Every combination of `rollout.kind`, `selection.kind`, `rl.async_`, `rl.staleness`",
         "and the mesh either runs, with each switch doing what it says, or is refused by",
         "`validate` before any training, with an error naming the fields",
         "(`tests/test_feature_matrix.py::test_switches_compose_or_are_refused` runs every",
         "combination through the launcher, checks each effect in metrics.jsonl and each",
         "refusal). Cells: `runs`, or the field the refusal names.", "",
         "| `rollout.kind` | `selection.kind` | " + " | ".join(t for t, _ in _COMPOSITION_COLUMNS)
         + " |", "|---|---|" + "---|" * len(_COMPOSITION_COLUMNS)]
  for kind in kinds.ROLLOUT_KINDS.names():
    for selection in selection_lib.SELECTION_RULES.names():
      cells = []
      for _, overrides in _COMPOSITION_COLUMNS:
        config = default.get_config()
        config.rollout.kind, config.selection.kind = kind, selection
        for path, value in overrides.items():
          section, field = path.split(".")
          config[section][field] = value
        try:
          composition.check_switches(wiring.settings(config))
          cells.append("runs")
        except ValueError as error:
          cells.append("refused: `" + str(error).split(" ")[0] + "`")
      out.append(f"| `{kind}` | `{selection}` | " + " | ".join(cells) + " |")
  return out + [
      "", "Several optimiser updates per batch (`rl.num_minibatches * rl.ppo_epochs = U > 1`)",
      "compose with every cell that runs: versions, `staleness`, `rl.staleness` and",
      "`rl.max_staleness` count optimiser updates everywhere. `rl.staleness` must be a",
      "multiple of U (parameters change once per batch). With `rl.async_`, U > 1 needs",
      "`rl.max_staleness = 0` (synchronous) or `>= U` (the producer runs `max_staleness // U`",
      "batches ahead); `0 < max_staleness < U` is refused naming `config.rl.max_staleness`.",
      "Both are tested through the launcher: async with `rl.num_minibatches = 2` and",
      "`max_staleness = 2` samples only even versions and trains on tokens at most 2 updates",
      "old (`tests/test_feature_matrix.py::"
      "test_async_with_minibatches_counts_versions_in_optimiser_updates`);",
      "simulated `rl.staleness = 4` with 2 updates per batch gives tokens 0, 2, 4, 4 updates",
      "old (`tests/test_feature_matrix.py::"
      "test_simulated_staleness_counts_optimiser_updates_with_minibatches`)."]


def undocumented(source: str | None = None) -> list[str]:
  """Fields of default.py without a comment (every field is documented)."""
  if source is None:
    with open(CONFIG_PATH) as f:
      source = f.read()
  return [e.name for e in parse_entries(source)
          if not e.is_section and not e.settings and not e.description]


def main(argv: list[str]) -> int:
  text = render()
  if "--check" in argv[1:]:
    with open(DOC_PATH) as f:
      if f.read() != text:
        print(f"{DOC_PATH} is out of date: run python -m experiments.config_reference")
        return 1
    return 0
  os.makedirs(os.path.dirname(DOC_PATH), exist_ok=True)
  with open(DOC_PATH, "w") as f:
    f.write(text)
  print(f"Wrote {DOC_PATH}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
