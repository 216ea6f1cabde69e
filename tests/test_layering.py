"""How rl/ is layered: its subpackages (tasks, objectives, rollouts, environments) are the
parts, and the modules that drive them (the loops, the train step, the wiring, evaluation,
checkpoints) sit above; no import runs from a part back up to what drives it."""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVERS = ("rl.loop", "rl.async_loop", "rl.train", "rl.wiring", "rl.evaluation",
           "rl.checkpoint")


def imported_modules(path: str) -> set[str]:
  """The modules a file imports (`from a import b` gives a.b and a)."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return found


def test_no_part_of_rl_imports_what_drives_it():
  upward = []
  for path in sorted(glob.glob(os.path.join(ROOT, "rl", "*", "*.py"))):
    for module in sorted(imported_modules(path) & set(DRIVERS)):
      upward.append(f"{os.path.relpath(path, ROOT)} imports {module}")
  assert upward == []


def test_the_check_sees_an_upward_import(tmp_path):
  path = tmp_path / "part.py"
  path.write_text("from rl import loop\nfrom rl.train import TrainState\nimport numpy\n")
  assert imported_modules(str(path)) & set(DRIVERS) == {"rl.loop", "rl.train"}


RUN_SECTIONS = ("seed", "workdir", "resume", "task", "model", "rollout", "warm_start", "rl",
                "lora", "loss", "advantage", "distill", "selection", "tools", "eval",
                "metrics", "checkpoint", "mesh", "distributed")
CONFIG_NAMES = ("config", "run", "run_config", "cfg", "c")


def run_config_reads(path: str) -> list[str]:
  """`config.<section>` reads of the run config in a file (the names it is passed under)."""
  found = []
  for node in ast.walk(ast.parse(open(path).read())):
    if (isinstance(node, ast.Attribute) and node.attr in RUN_SECTIONS
        and isinstance(node.value, ast.Name) and node.value.id in CONFIG_NAMES):
      found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
  return found


def test_only_the_wiring_reads_the_run_config():
  """The wiring reads the ml_collections config once into typed settings (rl/settings/)
  and builds each piece from them; the library below it never sees the config."""
  readers = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "*", "**", "*.py"), recursive=True)):
    rel = os.path.relpath(path, ROOT)
    library = rel.split(os.sep)[0] in ("rl", "sampling", "models", "sharding")
    if not library or rel == os.path.join("rl", "wiring.py"):
      continue
    reads = run_config_reads(path)
    if reads:
      readers[rel] = reads
  assert readers == {}


def test_the_wiring_reads_the_config_once():
  """In the wiring itself only `settings` (which reads the config into RunSettings) and
  `validate` (which also compares the whole config with a warm start's source) take the
  config; every other function takes the typed settings, and no section is read from it."""
  path = os.path.join(ROOT, "rl", "wiring.py")
  functions = [node for node in ast.parse(open(path).read()).body
               if isinstance(node, ast.FunctionDef)]
  takes_config = sorted(f.name for f in functions if any(a.arg == "config" for a in f.args.args))
  assert takes_config == ["settings", "validate"]
  assert [read for read in run_config_reads(path) if read.startswith("config.")] == []


def test_the_config_check_sees_a_read(tmp_path):
  path = tmp_path / "piece.py"
  path.write_text("def f(config, model_config):\n  return config.rollout.group_size, "
                  "model_config.d_model\n")
  assert run_config_reads(str(path)) == ["config.rollout (line 2)"]


def test_the_wiring_and_the_train_step_stay_small():
  """The wiring builds (its checks are the settings' own, rl/settings/run.py) and the train
  step composes (the objective is rl/objectives/composite.py's): each stays small enough
  to read in one sitting."""
  wiring_lines = len(open(os.path.join(ROOT, "rl", "wiring.py")).read().splitlines())
  train = ast.parse(open(os.path.join(ROOT, "rl", "train.py")).read())
  train_step = next(node for node in ast.walk(train)
                    if isinstance(node, ast.FunctionDef) and node.name == "make_train_step")
  assert wiring_lines <= 350
  assert train_step.end_lineno - train_step.lineno + 1 <= 80


LIBRARY = ("models", "sampling", "rl", "sharding")


def library_module(path: str) -> str:
  """`rl/objectives/losses.py` -> 'rl.objectives.losses' (a package: its __init__'s name)."""
  name = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return name[:-len(".__init__")] if name.endswith(".__init__") else name


def import_graph() -> dict[str, set[str]]:
  """Library module -> the library modules it imports, at any level (inside functions
  too): `from a import b` counts a.b when that is a module, else a."""
  paths = [p for package in LIBRARY
           for p in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True)]
  modules = {library_module(p): p for p in paths}
  graph = {}
  for name, path in modules.items():
    edges = set()
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                   else node.module for alias in node.names]
      else:
        continue
      edges.update(t for t in targets if t in modules and t != name)
    graph[name] = edges
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_settings_import_nothing_above_them():
  """rl/settings/ (read by the launcher before anything is built) imports, at any level,
  no library module outside rl/settings/ and rl/registry.py."""
  above = {name: sorted(t for t in targets if not t.startswith("rl.settings")
                        and t != "rl.registry")
           for name, targets in import_graph().items() if name.startswith("rl.settings")}
  assert {name: targets for name, targets in above.items() if targets} == {}


def test_no_import_cycle_among_library_modules():
  assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
