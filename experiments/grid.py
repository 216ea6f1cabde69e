"""Run a grid of experiment cells, N subprocesses at a time, resumably; tabulate what finished.

    python -m experiments.grid --spec=grid.json --workers=4 --out=runs/grid
    python -m experiments.grid --spec=grid.json --out=runs/grid --render --plot
    python -m experiments.grid --spec=grid.json --out=runs/grid --list   # for a job array
    python -m experiments.grid --spec=grid.json --out=runs/grid --cell=grpo_s1

The spec is a JSON file (or a Python file that defines the same dict as `SPEC`):

    {"cells": [
       {"name": "grpo", "module": "experiments.train", "seeds": [0, 1, 2],
        "flags": {"config.loss.name": "grpo", "config.rl.steps": 100}},
       {"name": "mu_grpo_s0", "module": "experiments.train", "seed": 0,
        "flags": {"config.loss.name": "mu_grpo", "config.rl.steps": 100}}]}

A cell is `python -m <module> --<flag>=<value>... --config.seed=<seed>
--config.workdir=<out>/runs/<name>` (the spec's optional "seed_flag" and "workdir_flag" rename
the last two); "seeds" makes one cell per seed, named <name>_s<seed>, and "{seed}" in a flag
value becomes the cell's seed. Its output goes to <out>/logs/<name>.log. When it exits 0
having written <workdir>/summary.json, its result goes to <out>/<name>.json: that summary,
the command and flags, the return code, the wall time of the attempt that finished, the
source it ran (`experiments.provenance.source_state`, read when the attempt *started*: the
commit, and whether code differed from it with the hash of that difference), its machine
(CPU model and cores) and the load average when it finished, written to a temporary file
and renamed, so a result file is whole or absent.

Provenance rules. A cell whose code differs from its commit stores that difference beside
its result (<out>/<name>.diff), so commit + diff reproduce it; and into a results folder
that git tracks (docs/results/...), a cell starts from a dirty tree only with
`--allow_dirty` (commit first). A finished result is reused only while its recorded module,
flags and seed are the spec's: a spec edited after a cell finished makes the grid refuse to
run or render, naming the cells and the flags that changed, until `--rerun_changed` removes
those results (and their workdirs and logs) and runs the cells again.

Rerunning the grid skips the cells that have a result. A cell killed midway reruns in the
same workdir, where experiments.train resumes from its newest checkpoint (config.resume is
True by default); its summary.json is removed first, so a result is always the finished
run's. A failed cell (non-zero exit, or no summary) gets no result: the grid names it,
exits 1, and a rerun tries it again.

`--render` (also done after every grid run) writes <out>/results.md: one row per setting
(a cell's module and flags: everything but its name and seed), each metric's mean +- sample
standard deviation over the seeds that finished. `--metrics` picks summary fields (dotted
paths, e.g. time_s.train); by default, the numeric top-level fields every finished cell has.
`--plot` adds <out>/results.png. `--page=<page.md>` puts a Python spec's own report,
`render_page(results, page_path)`, into the generated part of that page (between the
PAGE_BEGIN / PAGE_END markers), keeping the page's hand-written text.

On a cluster, hand the cells to a job array instead of the local pool: `--list` prints one
shell line per cell still without a result, each running `--cell=<name>` (that cell
alone, at once done if its result exists). With SLURM, and <out> on a shared file system:

    python -m experiments.grid --spec=grid.json --out=runs/grid --list > cells.txt
    sbatch --array=1-$(wc -l < cells.txt) --wrap='sed -n "${SLURM_ARRAY_TASK_ID}p" cells.txt | bash'
    python -m experiments.grid --spec=grid.json --out=runs/grid --render   # when they finish

Run each cell in one task at a time: two tasks on one workdir would share its checkpoints.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import platform
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from experiments import provenance

_SPEC = flags.DEFINE_string("spec", None, "The grid: a JSON file, or a Python file defining SPEC.")
_OUT = flags.DEFINE_string("out", "runs/grid", "Results, logs and the cells' workdirs go here.")
_WORKERS = flags.DEFINE_integer("workers", 1, "Cells run at once.")
_CELL = flags.DEFINE_string("cell", "", "Run only this cell (one task of a job array).")
_LIST = flags.DEFINE_bool("list", False, "Print a shell line per cell without a result; exit.")
_RENDER = flags.DEFINE_bool("render", False, "Tabulate the finished cells only; run nothing.")
_PLOT = flags.DEFINE_bool("plot", False, "Also plot each metric per setting (results.png).")
_METRICS = flags.DEFINE_list("metrics", [], "Summary fields to tabulate (dotted paths); "
                             "default: the numeric top-level fields of every finished cell.")
_RERUN_CHANGED = flags.DEFINE_bool(
    "rerun_changed", False, "Remove the results (workdirs, logs) of cells whose spec "
    "changed since they ran, and run them again; without it the grid refuses to use them.")
_ALLOW_DIRTY = flags.DEFINE_bool(
    "allow_dirty", False, "Let cells start from a tree whose code differs from its commit "
    "although --out is a folder git tracks (the diff is stored beside each result).")
_PAGE = flags.DEFINE_string("page", "", "A markdown page whose generated part, between "
                            "the PAGE_BEGIN and PAGE_END markers, becomes the Python spec's "
                            "render_page(results, page_path); the rest of the page is kept.")

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run: `python -m module --flag=value...` with its seed. flags: (flag, value) pairs."""
  name: str
  module: str
  flags: tuple[tuple[str, str], ...]
  seed: int


@dataclasses.dataclass(frozen=True)
class Spec:
  """The grid's cells and the flags through which a cell gets its seed and workdir."""
  cells: tuple[Cell, ...]
  seed_flag: str = "config.seed"
  workdir_flag: str = "config.workdir"


def expand(entry: dict) -> list[Cell]:
  """The cells of one spec entry: itself (with "seed"), or one per seed (with "seeds")."""
  if ("seed" in entry) == ("seeds" in entry):
    raise ValueError(f"Grid cell {entry.get('name')!r}: give exactly one of 'seed' or 'seeds'.")

  cell_flags = tuple((key, str(value)) for key, value in entry.get("flags", {}).items())
  if "seed" in entry:
    return [Cell(entry["name"], entry["module"], cell_flags, int(entry["seed"]))]
  return [Cell(f"{entry['name']}_s{seed}", entry["module"], cell_flags, int(seed))
          for seed in entry["seeds"]]


def parse_spec(data: dict) -> Spec:
  """A Spec from the spec file's dict; names must be unique and safe as file names."""
  cells = [cell for entry in data["cells"] for cell in expand(entry)]
  names = [cell.name for cell in cells]
  for name in names:
    if not _NAME.fullmatch(name):
      raise ValueError(f"Grid cell name {name!r}: use letters, digits, '_', '.' and '-'.")
    if names.count(name) > 1:
      raise ValueError(f"Grid cell name {name!r} appears {names.count(name)} times.")
  return Spec(tuple(cells), data.get("seed_flag", "config.seed"),
              data.get("workdir_flag", "config.workdir"))


def load_spec(path: str) -> Spec:
  """The grid in a JSON file, or in the SPEC dict of a Python file."""
  if path.endswith(".py"):
    return parse_spec(runpy.run_path(path)["SPEC"])
  with open(path) as f:
    return parse_spec(json.load(f))


def result_path(out: str, name: str) -> str:
  return os.path.join(out, f"{name}.json")


def workdir(out: str, cell: Cell) -> str:
  """The cell's own folder, the same on every rerun, so that the command resumes there."""
  return os.path.join(out, "runs", cell.name)


def command(cell: Cell, spec: Spec, out: str) -> list[str]:
  """The cell's argv: its module and flags ("{seed}" in a value becomes the cell's seed,
  e.g. a per-seed warm start's folder), then its seed and workdir. The flags as written
  (before the seed goes in) are the cell's setting: seeds of one setting share them."""
  return [sys.executable, "-m", cell.module,
          *(f"--{k}={v.replace('{seed}', str(cell.seed))}" for k, v in cell.flags),
          f"--{spec.seed_flag}={cell.seed}", f"--{spec.workdir_flag}={workdir(out, cell)}"]


def write_json_atomic(path: str, value) -> None:
  """Writes `value` as JSON through a temporary file in the same folder and a rename, so
  that a reader, or a rerun after a kill, finds the whole file or none."""
  handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".",
                                       suffix=".tmp")
  try:
    with os.fdopen(handle, "w") as f:
      json.dump(value, f, indent=2)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  finally:
    if os.path.exists(temporary):
      os.remove(temporary)


def read_json(path: str):
  with open(path) as f:
    return json.load(f)


def diff_path(out: str, name: str) -> str:
  return os.path.join(out, f"{name}.diff")


def log_path(out: str, name: str) -> str:
  return os.path.join(out, "logs", f"{name}.log")


def tracked_by_git(out: str) -> bool:
  """Whether git tracks files under `out` (a committed results folder)."""
  try:
    listed = subprocess.run(["git", "ls-files", "--", out], capture_output=True, text=True,
                            check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return False
  return bool(listed.strip())


def refuse_dirty(source: dict, out: str, allow_dirty: bool) -> None:
  """Raises RuntimeError when cells would start from code that differs from its commit and
  write their results into a folder git tracks, unless `allow_dirty`."""
  if source["dirty"] and not allow_dirty and tracked_by_git(out):
    raise RuntimeError(
        f"{out} is a results folder git tracks, and the code differs from commit "
        f"{source['commit'][:12]} (diff {source['diff_sha256'][:12]}): commit first, so that "
        "a result names the code it ran, or pass --allow_dirty (each result's diff is then "
        "stored beside it as <name>.diff).")


def run_cell(cell: Cell, spec: Spec, out: str, allow_dirty: bool = False) -> dict | None:
  """Runs one cell unless it has a result; its result, or None if it failed. The source
  is read when the cell starts (the code it runs), and a dirty one is refused into a
  tracked folder (`refuse_dirty`) or stored beside the result."""
  path = result_path(out, cell.name)
  if os.path.exists(path):
    return read_json(path)
  os.makedirs(os.path.join(out, "logs"), exist_ok=True)
  source = provenance.source_state()
  try:
    refuse_dirty(source, out, allow_dirty)
  except RuntimeError as error:
    with open(log_path(out, cell.name), "a") as log:
      log.write(f"Not started: {error}\n")
    print(f"{cell.name}: {error}", file=sys.stderr, flush=True)
    return None
  summary_path = os.path.join(workdir(out, cell), "summary.json")
  if os.path.exists(summary_path):
    os.remove(summary_path)  # a killed attempt's leftover would pass for this run's
  argv = command(cell, spec, out)
  started = time.time()
  with open(log_path(out, cell.name), "a") as log:
    returncode = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                check=False).returncode
  if returncode != 0 or not os.path.exists(summary_path):
    return None
  result = {"name": cell.name, "module": cell.module, "flags": dict(cell.flags),
            "seed": cell.seed, "command": argv, "returncode": returncode,
            "wall_s": time.time() - started, "commit": provenance.commit_label(source),
            "source": {key: source[key] for key in ("commit", "dirty", "diff_sha256")},
            "machine": machine(), "load_average": os.getloadavg(),
            "summary": read_json(summary_path)}
  if source["dirty"]:
    with open(diff_path(out, cell.name), "w") as f:
      f.write(source["diff"])
  write_json_atomic(path, result)
  return result


def changed_cells(spec: Spec, out: str) -> dict[str, list[str]]:
  """{cell name: what changed} for each finished cell whose recorded module, flags or seed
  differ from the spec's now."""
  changed = {}
  for cell in spec.cells:
    path = result_path(out, cell.name)
    if not os.path.exists(path):
      continue
    result = read_json(path)
    recorded = {"module": result["module"], "seed": result["seed"],
                **{f"--{k}": v for k, v in result["flags"].items()}}
    wanted = {"module": cell.module, "seed": cell.seed,
              **{f"--{k}": v for k, v in cell.flags}}
    differences = [f"{key}: {recorded.get(key, '<absent>')!r} -> {wanted.get(key, '<absent>')!r}"
                   for key in sorted(set(recorded) | set(wanted))
                   if recorded.get(key) != wanted.get(key)]
    if differences:
      changed[cell.name] = differences
  return changed


def settle_changed(spec: Spec, out: str, rerun_changed: bool) -> list[str]:
  """Refuses (ValueError naming each cell and change) finished cells whose spec changed,
  or with `rerun_changed` removes their results, stored diffs, workdirs and logs so that
  they run afresh; returns the names removed."""
  changed = changed_cells(spec, out)
  if changed and not rerun_changed:
    listing = "\n".join(f"  {name}: " + "; ".join(diffs) for name, diffs in changed.items())
    raise ValueError(f"These cells finished under another spec than {out}'s now "
                     f"(recorded -> spec):\n{listing}\nRestore the spec, or pass "
                     "--rerun_changed to remove their results and run them again.")
  for name in changed:
    for path in (result_path(out, name), diff_path(out, name), log_path(out, name)):
      if os.path.exists(path):
        os.remove(path)
    cell = next(c for c in spec.cells if c.name == name)
    shutil.rmtree(workdir(out, cell), ignore_errors=True)
  return sorted(changed)


def machine() -> str:
  """The CPU the cell ran on: its model name (Linux /proc/cpuinfo) and core count. XLA's CPU
  kernels differ between processors (e.g. with and without AVX-512), and so do float
  results and whole training trajectories: cells to compare should share a machine."""
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      info = f.read()
    model = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name"))
    if " avx512f " in f" {info} ":
      model += ", AVX-512"
  except (OSError, StopIteration):
    pass
  return f"{model}, {os.cpu_count()} cores"


def pending(spec: Spec, out: str) -> list[Cell]:
  """The cells without a result, in spec order."""
  return [cell for cell in spec.cells if not os.path.exists(result_path(out, cell.name))]


def run_grid(spec: Spec, out: str, workers: int, allow_dirty: bool = False) -> list[str]:
  """Runs the pending cells, `workers` at a time; the names of those that failed."""
  todo = pending(spec, out)
  if todo:
    refuse_dirty(provenance.source_state(), out, allow_dirty)
  failed = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    futures = {pool.submit(run_cell, cell, spec, out, allow_dirty): cell for cell in todo}
    for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
      cell = futures[future]
      status = "failed" if future.result() is None else "done"
      if status == "failed":
        failed.append(cell.name)
      print(f"[{done}/{len(todo)}] {cell.name} {status}", flush=True)
  return sorted(failed)


def list_commands(spec_path: str, spec: Spec, out: str) -> list[str]:
  """One self-contained shell line per pending cell, running it alone (`--cell`)."""
  head = (f"cd {shlex.quote(os.getcwd())} && {shlex.quote(sys.executable)} -m experiments.grid "
          f"--spec={shlex.quote(os.path.abspath(spec_path))} "
          f"--out={shlex.quote(os.path.abspath(out))}")
  return [f"{head} --cell={cell.name}" for cell in pending(spec, out)]


def load_results(spec: Spec, out: str) -> list[dict]:
  """The results of the spec's finished cells, in spec order."""
  return [read_json(result_path(out, c.name)) for c in spec.cells
          if os.path.exists(result_path(out, c.name))]


def metric_value(summary: dict, path: str) -> float | None:
  """The number at dotted `path` in a summary, or None (missing, or not a number)."""
  value = summary
  for key in path.split("."):
    if not isinstance(value, dict) or key not in value:
      return None
    value = value[key]
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value)


def metric_values(group: list[dict], metric: str) -> list[float]:
  """The values of `metric` in the summaries of `group` that have it."""
  values = [metric_value(result["summary"], metric) for result in group]
  return [v for v in values if v is not None]


def default_metrics(results: list[dict]) -> list[str]:
  """The top-level summary fields that are numbers in every result, in summary order."""
  if not results:
    return []
  return [key for key in results[0]["summary"]
          if all(metric_value(r["summary"], key) is not None for r in results)]


def setting_labels(settings: list[dict[str, str]]) -> list[str]:
  """A short label per setting: the fields whose values differ between settings, or the
  module when there is one setting."""
  keys = list(dict.fromkeys(key for setting in settings for key in setting))
  varying = [k for k in keys if len({setting.get(k) for setting in settings}) > 1]
  return [", ".join(f"{k}={s[k]}" for k in varying if k in s) or s["module"]
          for s in settings]


def group_by_setting(results: list[dict]) -> tuple[list[str], list[list[dict]]]:
  """(labels, results per setting): the seeds of one setting together, in first-seen order."""
  groups: dict[tuple, list[dict]] = {}
  for result in results:
    key = (result["module"], tuple(sorted(result["flags"].items())))
    groups.setdefault(key, []).append(result)
  settings = [{"module": module, **dict(flag_items)} for module, flag_items in groups]
  return setting_labels(settings), list(groups.values())


def mean_std(values: list[float]) -> tuple[float, float | None]:
  """Mean and sample standard deviation (None for a single value)."""
  return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def format_cell(values: list[float]) -> str:
  if not values:
    return "-"
  mean, std = mean_std(values)
  return f"{mean:.4g}" if std is None else f"{mean:.4g} ± {std:.2g}"


def render_table(spec: Spec, results: list[dict], metrics: list[str]) -> str:
  """The markdown table of the finished cells: per setting, its seeds and each metric's
  mean +- sample std over them."""
  labels, groups = group_by_setting(results)
  lines = [f"{len(results)} of {len(spec.cells)} cells finished; mean ± sample std over "
           "the finished seeds.", "",
           "| setting | seeds | " + " | ".join(metrics) + " |",
           "|---|---|" + "---|" * len(metrics)]
  for label, group in zip(labels, groups):
    seeds = ", ".join(str(r["seed"]) for r in group)
    cells = [format_cell(metric_values(group, metric)) for metric in metrics]
    lines.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot_results(results: list[dict], metrics: list[str], path: str) -> None:
  """One panel per metric: each setting's mean, with the sample std as an error bar."""
  import matplotlib  # pylint: disable=import-outside-toplevel  (only when plotting)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  labels, groups = group_by_setting(results)
  fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(4 * max(len(metrics), 1), 3.5),
                           squeeze=False)
  for ax, metric in zip(axes[0], metrics):
    stats = [mean_std(metric_values(group, metric) or [np.nan]) for group in groups]
    ax.bar(range(len(groups)), [m for m, _ in stats], yerr=[s or 0.0 for _, s in stats],
           capsize=3)
    ax.set_xticks(range(len(groups)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_title(metric, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_report(spec: Spec, out: str, metrics: list[str], plot: bool) -> str:
  """Writes <out>/results.md (and results.png with `plot`) from the finished cells."""
  results = load_results(spec, out)
  metrics = metrics or default_metrics(results)
  table = render_table(spec, results, metrics)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(table)
  if plot and results:
    plot_results(results, metrics, os.path.join(out, "results.png"))
  return table


PAGE_BEGIN = "<!-- generated by experiments.grid --page: edits below are overwritten -->"
PAGE_END = "<!-- end of generated part -->"


def write_page(spec_path: str, spec: Spec, out: str, page: str) -> None:
  """Puts the spec's `render_page(results, page)` (a function of a Python spec; it may
  write figures beside `page`) between PAGE_BEGIN and PAGE_END in `page`, keeping the
  hand-written text around them; a page without the markers gets them appended."""
  render = runpy.run_path(spec_path).get("render_page") if spec_path.endswith(".py") else None
  if render is None:
    raise app.UsageError(f"--page needs a Python spec that defines render_page(results, "
                         f"page_path); {spec_path} does not.")
  generated = f"{PAGE_BEGIN}\n{render(load_results(spec, out), page).rstrip()}\n{PAGE_END}\n"
  text = open(page).read() if os.path.exists(page) else ""
  if PAGE_BEGIN in text and PAGE_END in text:
    head, rest = text.split(PAGE_BEGIN, 1)
    text = head + generated + rest.split(PAGE_END, 1)[1].lstrip("\n")
  else:
    text = text + ("\n" if text else "") + generated
  with open(page, "w") as f:
    f.write(text)


def main(argv):
  del argv
  spec, out = load_spec(_SPEC.value), _OUT.value
  try:
    removed = settle_changed(spec, out, _RERUN_CHANGED.value)
  except ValueError as error:
    raise app.UsageError(str(error)) from None
  if removed:
    print(f"Removed the results of changed cells: {', '.join(removed)}", flush=True)
  if _LIST.value:
    for line in list_commands(_SPEC.value, spec, out):
      print(line)
    return 0
  if _CELL.value:
    cells = {cell.name: cell for cell in spec.cells}
    if _CELL.value not in cells:
      raise app.UsageError(f"--cell={_CELL.value}: no such cell; the spec has {sorted(cells)}.")
    return 0 if run_cell(cells[_CELL.value], spec, out, _ALLOW_DIRTY.value) is not None else 1
  try:
    failed = [] if _RENDER.value else run_grid(spec, out, _WORKERS.value, _ALLOW_DIRTY.value)
  except RuntimeError as error:
    raise app.UsageError(str(error)) from None
  print(write_report(spec, out, _METRICS.value, _PLOT.value))
  if _PAGE.value:
    write_page(_SPEC.value, spec, out, _PAGE.value)
  if failed:
    print(f"Failed (see {os.path.join(out, 'logs')}): {', '.join(failed)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  flags.mark_flag_as_required("spec")
  app.run(main)
