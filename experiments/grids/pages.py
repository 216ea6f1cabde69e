"""What the benchmark grids' pages are made of: curves, their statistics and figures.

Each spec under experiments/grids/ renders its page (`render_page(results, page_path)`,
called by `python -m experiments.grid --render --page=...`) from the finished cells'
result files: the launcher's summary of each run, with its held-out accuracy curve
(`accuracy_curve`: step, accuracy and the RL tokens sampled before each evaluation), the RL
wall time at each evaluation (`time_rl_at_evals_s`) and the step metrics' means.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

X_AXES = ("updates", "tokens", "seconds")
X_LABELS = {"updates": "optimiser updates", "tokens": "RL tokens sampled",
            "seconds": "RL wall seconds"}


def setting(result: dict) -> str:
  """A cell's setting: its name without the seed suffix (`grpo_k8_s1` -> `grpo_k8`)."""
  return result["name"].rsplit("_s", 1)[0]


def recorded_setting(result: dict) -> tuple:
  """What a result ran: its module and flags as its result file records them."""
  return result["module"], tuple(sorted(result["flags"].items()))


def by_setting(results: list[dict]) -> dict[str, list[dict]]:
  """The results grouped by setting, seeds in order. The seeds of a setting must have run
  the same recorded module and flags: a ValueError names a setting whose results did not
  (an old result kept after its spec changed would otherwise be shown as the new setting)."""
  groups: dict[str, list[dict]] = {}
  for result in sorted(results, key=lambda r: r["seed"]):
    group = groups.setdefault(setting(result), [])
    if group and recorded_setting(group[0]) != recorded_setting(result):
      raise ValueError(
          f"Setting {setting(result)!r}: {group[0]['name']} ran {recorded_setting(group[0])} "
          f"but {result['name']} ran {recorded_setting(result)}; rerun the stale cells "
          "(python -m experiments.grid ... --rerun_changed).")
    group.append(result)
  return groups


def rl_curve(result: dict, x: str = "updates") -> tuple[list[float], list[float]]:
  """(x, held-out accuracy) at a cell's evaluations, the warm start's first; x is the
  optimiser updates since the warm start (rl.num_minibatches per RL step), the RL tokens
  sampled before the evaluation, or the RL wall seconds before it."""
  summary = result["summary"]
  curve = summary["accuracy_curve"]
  accuracy = [e["accuracy"] for e in curve]
  if x == "updates":
    start = curve[0]["step"]
    updates = int(result["flags"].get("config.rl.num_minibatches", 1))
    return [float((e["step"] - start) * updates) for e in curve], accuracy
  if x == "tokens":
    return [float(e["sampled_tokens"]) for e in curve], accuracy
  if x == "seconds":
    return [float(s) for s in summary["time_rl_at_evals_s"]], accuracy
  raise ValueError(f"Unknown x axis {x!r}; use one of {X_AXES}.")


def area_under_curve(x: list[float], accuracy: list[float]) -> float:
  """Mean held-out accuracy over the RL phase: the trapezoid area under accuracy against
  x, divided by x's range (a curve that rises early scores higher)."""
  if x[-1] == x[0]:
    return accuracy[0]
  return float(np.trapezoid(accuracy, x) / (x[-1] - x[0]))


def first_reaching(x: list[float], accuracy: list[float], target: float) -> float | None:
  """x at the first evaluation whose accuracy is at least `target` (None if none is)."""
  return next((xi for xi, a in zip(x, accuracy) if a >= target), None)


def step_mean(result: dict, field: str) -> float | None:
  """A cell's mean of a step metric over its RL steps (None when it never logged it)."""
  return result["summary"]["rl_step_means"].get(field)


def final_accuracy(result: dict) -> float:
  """A cell's final held-out accuracy."""
  return result["summary"]["final_accuracy"]


def mean_std(values: list[float], digits: int = 3) -> str:
  """'mean ± sample std' (one value as is; '-' for none)."""
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.{digits}f}"
  return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def paired_difference(group: list[dict], reference: list[dict],
                      value: Callable[[dict], float]) -> str:
  """`value(cell) - value(reference)` seed by seed over the seeds both have, as
  'mean ± sample std (h up, l down)' with h and l the seeds where the cell is higher and
  lower: a paired comparison, which removes the spread
  between seeds' warm starts that the plain means carry ('-' when no seed is shared)."""
  references = {r["seed"]: value(r) for r in reference}
  differences = [value(r) - references[r["seed"]] for r in group if r["seed"] in references]
  if not differences:
    return "-"
  higher, lower = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
  return f"{mean_std(differences)} ({higher} up, {lower} down)"


def per_seed(values: list[float | None], form: Callable[[float], str]) -> str:
  """Values one per seed, each written by `form` ('-' for None): '12k, -, 40k'."""
  return ", ".join("-" if v is None else form(v) for v in values)


def table_row(name: str, group: list[dict], cells: list[str]) -> str:
  """A markdown table row: the setting, the seeds it has results for, then `cells`."""
  seeds = ",".join(str(r["seed"]) for r in group)
  return "| " + " | ".join([name, seeds, *cells]) + " |"


def table_head(columns: list[str]) -> str:
  """A markdown table's header and rule lines."""
  return "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)


def provenance(results: list[dict], total: int) -> str:
  """How many cells finished, the commits they ran at and the machine's load."""
  commits = sorted({r.get("commit", "unknown") for r in results})
  loads = [r["load_average"][0] for r in results if "load_average" in r]
  machines = sorted({str(r["machine"]) for r in results if "machine" in r})
  text = (f"{len(results)} of {total} cells finished; mean ± sample std over the seeds "
          f"listed. Commits: {', '.join(commits) or '-'}.")
  if loads:
    text += f" Load average (1 min) when cells finished: {min(loads):.1f}-{max(loads):.1f}."
  if machines:
    text += f" Machine: {'; '.join(machines)}."
  return text


def plot_panels(panels: list[tuple[str, str, dict[str, list[dict]]]], path: str) -> None:
  """One panel per (title, x axis, {label: results}): each label's mean accuracy over its
  seeds against x, with a band from the lowest to the highest seed. Seeds are aligned by
  evaluation index (x is their mean), as the cells of a setting evaluate at the same steps."""
  import matplotlib  # pylint: disable=import-outside-toplevel  (only when rendering)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True,
                           squeeze=False)
  for ax, (title, x_axis, series) in zip(axes[0], panels):
    for label, group in series.items():
      curves = [rl_curve(r, x_axis) for r in group]
      if not curves:
        continue
      length = min(len(c[0]) for c in curves)
      xs = np.array([c[0][:length] for c in curves]).mean(0)
      ys = np.array([c[1][:length] for c in curves])
      line, = ax.plot(xs, ys.mean(0), label=label, lw=1.4)
      ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15, lw=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(X_LABELS[x_axis])
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel("held-out greedy accuracy")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
