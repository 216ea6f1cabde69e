"""B6, choosing what to roll out, on the testbed: uniform GRPO vs DAPO dynamic sampling vs
GRESO pre-rollout skipping vs adaptive rollout allocation, 3 seeds, each cell's RL phase
from its seed's shared warm start (experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/b6_selection.py --out=docs/results/b6
    python -m experiments.grid --spec=experiments/grids/b6_selection.py --out=docs/results/b6 \
        --render --page=docs/benchmarks_selection.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, GRPO,
held-out greedy accuracy every 30 steps, the default), all on a finite pool of 256 train
prompts, so that each prompt recurs about 3.75 times (960 prompt visits) and GRESO's
per-prompt history means something:
- `uniform`: the next 8 prompts of the pool, every group trained (all-equal groups have
  zero advantage).
- `dynamic` (DAPO): roll out, drop the all-equal groups, roll out more prompts until 8
  informative groups fill the batch.
- `greso` (GRESO): skip, before rolling out, prompts whose groups were all-equal on their
  recent visits (with an exploration probability), then fill as dynamic sampling does.
- `adaptive`: 4 pilot rollouts per prompt, then the rest of the budget to the prompts whose
  pilots disagree most.
"""

import os

import numpy as np

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
TRAIN_POOL = 256
METHODS = ("uniform", "dynamic", "greso", "adaptive")
TARGET_SHARE = 0.5  # target = warm start + this share of uniform's final gain (same seed)

SPEC = {"cells": [{"name": f"{method}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START,
                             "config.task.train_pool": TRAIN_POOL,
                             "config.selection.kind": method}}
                  for seed in SEEDS for method in METHODS]}


# --- The page ---

def target(uniform: dict) -> float:
  """Warm start + TARGET_SHARE of uniform GRPO's final gain, in uniform's seed."""
  s = uniform["summary"]
  return s["warm_start_accuracy"] + TARGET_SHARE * (s["final_accuracy"]
                                                    - s["warm_start_accuracy"])


def zero_variance_share(result: dict) -> tuple[list[int], list[float | None]]:
  """(RL steps at each evaluation after the warm start's, the share of rolled-out groups
  whose rewards were all equal over the steps since the previous evaluation)."""
  summary = result["summary"]
  curve = summary["accuracy_curve"]
  steps = [e["step"] - curve[0]["step"] for e in curve[1:]]
  return steps, [None if not w else 1.0 - w["informative_groups"]
                 for w in summary["rl_step_means_between_evals"][1:]]


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _row(name: str, group: list[dict], uniform: dict[int, dict]) -> str:
  s = [r["summary"] for r in group]
  tokens = [pages.first_reaching(*pages.rl_curve(r, "tokens"), target(uniform[r["seed"]]))
            if r["seed"] in uniform else None for r in group]
  base = [pages.first_reaching(*pages.rl_curve(uniform[r["seed"]], "tokens"),
                               target(uniform[r["seed"]])) if r["seed"] in uniform else None
          for r in group]
  speedup = [b / t for b, t in zip(base, tokens) if b and t]
  updates = [pages.first_reaching(*pages.rl_curve(r, "updates"), target(uniform[r["seed"]]))
             if r["seed"] in uniform else None for r in group]
  shares = [zero_variance_share(r)[1] for r in group]
  first = [x[0] for x in shares if x and x[0] is not None]
  last = [x[-1] for x in shares if x and x[-1] is not None]
  return pages.table_row(name, group, [
      f"{sum(t is not None for t in tokens)}/{len(group)}",
      pages.per_seed(tokens, lambda t: f"{t / 1e3:.1f}k"),
      pages.per_seed(speedup, lambda x: f"{x:.2f}x") or "-",
      pages.mean_std([x["final_accuracy"] for x in s]),
      pages.mean_std([x["tokens"]["sampled"] / 1e3 for x in s], 0) + "k",
      f"{pages.mean_std(first, 2)} -> {pages.mean_std(last, 2)}",
      pages.mean_std([x["prompts_skipped"] for x in s], 0),
      pages.mean_std([x["time_rl_s"] for x in s], 0),
      pages.per_seed(updates, lambda u: f"{u:.0f}"),
      pages.paired_difference(group, list(uniform.values()), _final)
      if name != "uniform" else "-"])


def _plot_zero_variance(groups: dict[str, list[dict]], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel  (only when rendering)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(4.6, 3.4))
  for name in METHODS:
    curves = [zero_variance_share(r) for r in groups.get(name, [])]
    curves = [c for c in curves if c[1] and None not in c[1]]
    if curves:
      length = min(len(shares) for _, shares in curves)
      ax.plot(curves[0][0][:length], np.mean([shares[:length] for _, shares in curves], 0),
              label=name)
  ax.set_xlabel("RL steps")
  ax.set_ylabel("share of rolled-out groups all-equal")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def render_page(results: list[dict], page_path: str) -> str:
  """B6's table and figures from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  uniform = {r["seed"]: r for r in groups.get("uniform", [])}
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           f"Target: warm start + {TARGET_SHARE:.0%} of uniform GRPO's final gain in the "
           "same seed. Tokens to target: RL tokens sampled (every rollout round's) before "
           "the first evaluation at or above it (per seed; - = never); speed-up: uniform's "
           "tokens to target over the method's, per seed where both reached it; all-equal "
           "share: rolled-out groups with equal rewards, over the steps before the first "
           "evaluation and before the last; "
           "prompts skipped: per run (GRESO's pre-rollout skips); updates to target: optimiser "
           "updates before that evaluation; paired: final accuracy minus uniform's, seed by "
           "seed.", "",
           pages.table_head(["method", "seeds", "reached", "tokens to target (per seed)",
                             "speed-up", "final accuracy", "RL tokens sampled",
                             "all-equal share (first -> last)", "prompts skipped", "RL s",
                             "updates to target (per seed)", "final minus uniform's, paired"])]
  lines += [_row(name, groups[name], uniform) for name in METHODS if name in groups]
  stem = os.path.splitext(page_path)[0]
  if results:
    series = {name: groups.get(name, []) for name in METHODS}
    pages.plot_panels([("accuracy per RL token", "tokens", series),
                       ("accuracy per RL second", "seconds", series)], stem + ".png")
    _plot_zero_variance(groups, stem + "_zero_variance.png")
    lines += ["", f"![accuracy against tokens and seconds]({os.path.basename(stem)}.png)",
              "", f"![all-equal groups over training]({os.path.basename(stem)}"
              "_zero_variance.png)"]
  return "\n".join(lines) + "\n"
