"""B5, staleness robustness on the testbed: every objective at simulated staleness k, and
Mu-GRPO's large stages, 3 seeds, each cell's RL phase from its seed's shared warm start.

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/b5_staleness.py --out=docs/results/b5

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, one
optimiser update each; held-out greedy accuracy every 10 steps):
- `<objective>_k<k>`: objectives grpo, decoupled, m2po, sat, vcpo, mu_grpo x simulated
  staleness k in {0, 8, 32, 128} optimiser updates (rl.staleness: step t samples with the
  parameters of step max(t - k, 0)). k = 128 exceeds the run's 120 updates: every batch is
  sampled by the warm-start policy.
- `stages_<objective>_S<S>`: grpo and mu_grpo in stages of S in {4, 16} updates per
  rollout batch (rl.num_minibatches = S, rollout.prompts_per_step = 8 S): 30 stages of 4
  (120 updates, 960 prompts as in the per-step run) and 8 stages of 16 (128 updates, 1024
  prompts: 120 is not a multiple of 16). Mu-GRPO's claim is about equal updates: compare
  each against the other objective at the same S and against k = 0.

Cells run seed by seed (all of seed 0 first), so a grid stopped midway has whole seeds.
`render_page` writes the page's tables and figure from the committed results:

    python -m experiments.grid --spec=experiments/grids/b5_staleness.py --out=docs/results/b5 \
        --render --page=docs/benchmarks_staleness.md
"""

import os

import numpy as np

SEEDS = (0, 1, 2)
OBJECTIVES = ("grpo", "m2po", "sat", "decoupled", "mu_grpo", "vcpo")
STALENESS = (0, 8, 32, 128)
STAGES = (4, 16)
EVAL_EVERY_UPDATES = 10  # held-out evaluations every this many optimiser updates (about)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells


def _entry(name: str, seed: int, flags: dict) -> dict:
  return {"name": f"{name}_s{seed}", "module": "experiments.train", "seed": seed,
          "flags": {"config.warm_start.init_from": WARM_START, **flags}}


def _cells(seed: int) -> list[dict]:
  cells = [_entry(f"{objective}_k{k}", seed,
                  {"config.loss.name": objective, "config.rl.staleness": k,
                   "config.eval.every": EVAL_EVERY_UPDATES})
           for objective in OBJECTIVES for k in STALENESS]
  for stage in STAGES:
    for objective in ("grpo", "mu_grpo"):
      cells.append(_entry(f"stages_{objective}_S{stage}", seed, {
          "config.loss.name": objective, "config.rl.num_minibatches": stage,
          "config.rollout.prompts_per_step": 8 * stage,
          "config.rl.steps": -(-120 // stage),
          "config.eval.every": max(1, EVAL_EVERY_UPDATES // stage)}))
  return cells


SPEC = {"cells": [cell for seed in SEEDS for cell in _cells(seed)]}


# --- The page (python -m experiments.grid ... --render --page=docs/benchmarks_staleness.md) ---

# RL step metrics reported per cell (means over the run's steps; a correction's own
# fractions exist only where it runs).
STEP_METRICS = (("clip_fraction", "clip"), ("masked_fraction", "mask"),
                ("vetoed_fraction", "veto"), ("sat_contracted_fraction", "SAT contracted"),
                ("is_truncated_fraction", "IS truncated"), ("lr_scale", "lr scale"),
                ("grad_norm", "grad norm"))


def rl_curve(result: dict) -> tuple[list[int], list[float]]:
  """(optimiser updates since the warm start, held-out accuracy) of a cell's evaluations,
  the warm start's first. Stage cells take rl.num_minibatches updates per RL step."""
  curve = result["summary"]["accuracy_curve"]
  start = curve[0]["step"]
  updates = int(result["flags"].get("config.rl.num_minibatches", 1))
  return [(e["step"] - start) * updates for e in curve], [e["accuracy"] for e in curve]


def area_under_curve(updates: list[int], accuracy: list[float]) -> float:
  """Mean held-out accuracy over the RL phase: the trapezoid area under accuracy against
  optimiser updates, divided by the updates (a curve that rises early scores higher)."""
  if updates[-1] == 0:
    return accuracy[0]
  return float(np.trapezoid(accuracy, updates) / updates[-1])


def _setting(result: dict) -> str:
  return result["name"].rsplit("_s", 1)[0]


def _stats(values: list[float]) -> str:
  if not values:
    return "-"
  if len(values) == 1:
    return f"{values[0]:.3f}"
  return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def _row(name: str, group: list[dict]) -> str:
  finals = [r["summary"]["final_accuracy"] for r in group]
  areas = [area_under_curve(*rl_curve(r)) for r in group]
  gains = [r["summary"]["final_accuracy"] - r["summary"]["warm_start_accuracy"] for r in group]
  means = [r["summary"]["rl_step_means"] for r in group]
  steps = [_stats([m[key] for m in means if key in m]) for key, _ in STEP_METRICS]
  seeds = ",".join(str(r["seed"]) for r in group)
  return (f"| {name} | {seeds} | {_stats(finals)} | {_stats(gains)} | {_stats(areas)} | "
          + " | ".join(steps) + " |")


def _plot(groups: dict[str, list[dict]], path: str) -> None:
  """Accuracy against updates: one panel per staleness k (the objectives' mean over seeds,
  a band from the lowest to the highest seed) and one for the stage schedules."""
  import matplotlib  # pylint: disable=import-outside-toplevel  (only when rendering)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  panels = [(f"k = {k}", [f"{o}_k{k}" for o in OBJECTIVES]) for k in STALENESS]
  panels.append(("stages", ["grpo_k0"] + [f"stages_{o}_S{s}" for s in STAGES
                                          for o in ("grpo", "mu_grpo")]))
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True)
  for ax, (title, names) in zip(axes, panels):
    for name in names:
      curves = [rl_curve(r) for r in groups.get(name, [])]
      if not curves:
        continue
      length = min(len(u) for u, _ in curves)
      x = curves[0][0][:length]
      ys = np.array([a[:length] for _, a in curves])
      label = name.rsplit("_k", 1)[0] if title.startswith("k") else name
      line, = ax.plot(x, ys.mean(0), label=label, lw=1.4)
      ax.fill_between(x, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15, lw=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimiser updates")
    ax.legend(fontsize=7)
  axes[0].set_ylabel("held-out greedy accuracy")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def render_page(results: list[dict], page_path: str) -> str:
  """B5's tables and figure from the finished cells' results (experiments.grid)."""
  groups: dict[str, list[dict]] = {}
  for result in results:
    groups.setdefault(_setting(result), []).append(result)
  total = len(SPEC["cells"])
  commits = sorted({r.get("commit", "unknown") for r in results})
  loads = [r["load_average"][0] for r in results if "load_average" in r]
  header = ("| cell | seeds | final accuracy | gain over warm start | area under curve | "
            + " | ".join(label for _, label in STEP_METRICS) + " |\n|"
            + "---|" * (5 + len(STEP_METRICS)))
  lines = [f"{len(results)} of {total} cells finished; mean ± sample std over the seeds "
           "listed. Final accuracy: held-out greedy exact match (500 problems) after the RL "
           "phase; area under curve: mean accuracy over the RL phase (trapezoid against "
           "optimiser updates, warm start included); step columns: means over the RL steps.",
           "", f"Commits: {', '.join(commits) or '-'}. Load average (1 min) when cells "
           f"finished: {min(loads):.1f}-{max(loads):.1f}." if loads else "", "",
           "### Staleness k x objective", "", header]
  for k in STALENESS:
    for objective in OBJECTIVES:
      name = f"{objective}_k{k}"
      if name in groups:
        lines.append(_row(name, groups[name]))
  lines += ["", "### Stages (mu-GRPO's schedule: S updates per rollout batch)", "", header]
  for name in ["grpo_k0"] + [f"stages_{o}_S{s}" for s in STAGES for o in ("grpo", "mu_grpo")]:
    if name in groups:
      lines.append(_row(name, groups[name]))
  figure = os.path.splitext(page_path)[0] + ".png"
  if results:
    _plot(groups, figure)
    lines += ["", f"![accuracy against updates]({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
