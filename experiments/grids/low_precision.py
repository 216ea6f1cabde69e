"""Low-precision rollouts and their corrections on the testbed: the sampler's weights in
float32 (the reference), bfloat16, int8, fp8 and int4 (the stress setting: 15 levels per
channel), each with no correction, TIS, MIS and score centering; and score centering under
simulated staleness k = 8. 3 seeds, each cell's RL phase from its seed's shared warm start
(experiments/grids/warm_starts.py's `warm` cells).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/low_precision.py \
        --out=docs/results/low_precision
    python -m experiments.grid --spec=experiments/grids/low_precision.py \
        --out=docs/results/low_precision --render --page=docs/low_precision.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, one
optimiser update each, held-out greedy accuracy every 30 steps):
- `f32_none`: float32 rollouts, the trainer's own weights (the reference).
- `<precision>_<correction>`: rollouts with config.rollout.weights = bfloat16 | int8 | fp8
  | int4 (weight-only, per-channel scales; models/quantize.py), corrected by nothing, TIS
  (weights truncated at C = 2), MIS (tokens with a ratio outside [1/2, 2] masked) or score
  centering (standalone, the sampler's whole distribution recorded: sc_top_k = 0; the
  PPO ratio anchored at the proximal policy, recomputed by a forward, so the sampled token
  carries weight 1 like its expectation: rl/objectives/corrections.py `score_centering`).
- `k8_none`, `k8_sc`: float32 rollouts sampled with the parameters of 8 updates before
  (rl.staleness = 8), without and with score centering.
The truncation C = 2 and the band [1/2, 2] are this grid's choice (the library defaults, 5
and [0, 5], never bind at these gaps).
"""

import os

import numpy as np
from scipy import stats

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
PRECISIONS = {"bf16": "bfloat16", "int8": "int8", "fp8": "fp8", "int4": "int4"}
CORRECTIONS = {
    "none": {},
    "tis": {"config.loss.corrections": ("tis",), "config.loss.is_cap": 2.0},
    "mis": {"config.loss.corrections": ("mis",), "config.loss.is_cap": 2.0,
            "config.loss.is_floor": 0.5},
    # prox_estimate is the default: written out because score centering reads it since
    # its ratio is anchored at the proximal policy (cells run before that are stale).
    "sc": {"config.loss.corrections": ("score_centering",), "config.loss.sc_top_k": 0,
           "config.loss.prox_estimate": "recompute"},
}
CORRECTION_NAMES = {"none": "no correction", "tis": "TIS", "mis": "MIS",
                    "sc": "score centering"}
SETTINGS = {"f32_none": {},
            **{f"{short}_{name}": {"config.rollout.weights": weights, **flags}
               for short, weights in PRECISIONS.items() for name, flags in CORRECTIONS.items()},
            "k8_none": {"config.rl.staleness": 8},
            "k8_sc": {"config.rl.staleness": 8, **CORRECTIONS["sc"]}}

SPEC = {"cells": [{"name": f"{name}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START, **flags}}
                  for seed in SEEDS for name, flags in SETTINGS.items()]}


# --- The page ---

def _reference(name: str) -> str:
  """The cell a setting is compared with: float32 rollouts, or k8_none for k8_sc."""
  return "k8_none" if name.startswith("k8") else "f32_none"


def _correction_share(group: list[dict]) -> str:
  """The share of tokens the setting's correction acted on: truncated (TIS), masked (MIS),
  or the expected score subtracted (score centering's sc_score_shift)."""
  for field, digits in (("is_truncated_fraction", 4), ("masked_fraction", 4),
                        ("sc_score_shift", 5)):
    values = [pages.step_mean(r, field) for r in group]
    if all(v is not None for v in values):
      return f"{field}: {pages.mean_std(values, digits)}"
  return "-"


def recovery(group: list[dict], reference: list[dict]) -> str:
  """Whether a setting keeps its reference's final held-out accuracy, paired seed by seed.

  With d_s = final accuracy(cell, seed s) - final accuracy(reference, seed s) over the seeds
  both have: 'below' / 'above' when a paired t-test rejects a zero mean at the 5% level
  (two-sided, seeds - 1 degrees of freedom); otherwise 'level' when |mean d| is within one
  evaluation's standard error (the held-out set's binomial stderr, mean over the cells'
  final evaluations), and 'unresolved' when it is larger: a difference the seeds are too
  few to confirm or rule out. Fewer than two paired seeds is 'too few seeds'. Written
  'verdict (mean d ± its standard error, seeds lower of seeds)'."""
  references = {r["seed"]: r for r in reference}
  pairs = [(r, references[r["seed"]]) for r in group if r["seed"] in references]
  if len(pairs) < 2:
    return f"too few seeds ({len(pairs)})"
  differences = np.array([pages.final_accuracy(a) - pages.final_accuracy(b) for a, b in pairs])
  mean = float(np.mean(differences))
  stderr = float(np.std(differences, ddof=1) / np.sqrt(len(differences)))
  critical = stats.t.ppf(0.975, df=len(differences) - 1)
  significant = abs(mean) > critical * stderr if stderr > 0 else mean != 0
  evaluation_stderr = np.mean([r["summary"]["final_accuracy_stderr"]
                               for pair in pairs for r in pair])
  if significant:
    verdict = "below" if mean < 0 else "above"
  else:
    verdict = "level" if abs(mean) <= evaluation_stderr else "unresolved"
  lower = int(np.sum(differences < 0))
  return f"{verdict} ({mean:+.3f} ± {stderr:.3f}, {lower} of {len(pairs)} lower)"


def _recovery_table(groups: dict[str, list[dict]]) -> list[str]:
  """Per precision, each correction's final accuracy against float32 rollouts' (`recovery`);
  and score centering against none at staleness 8."""
  reference = groups.get("f32_none", [])
  lines = [pages.table_head(["rollout weights", *CORRECTION_NAMES.values()])]
  for short in PRECISIONS:
    cells = [recovery(groups.get(f"{short}_{name}", []), reference) for name in CORRECTIONS]
    lines.append("| " + " | ".join([short, *cells]) + " |")
  staleness = {"none": "(the reference)",
               "sc": recovery(groups.get("k8_sc", []), groups.get("k8_none", []))}
  cells = [staleness.get(name, "-") for name in CORRECTIONS]
  lines.append("| " + " | ".join(["float32, staleness 8", *cells]) + " |")
  return lines


def _row(name: str, group: list[dict], groups: dict[str, list[dict]]) -> str:
  s = [r["summary"] for r in group]
  mean = lambda field, digits=4: pages.mean_std([pages.step_mean(r, field) for r in group], digits)
  reference = _reference(name)
  cells = [pages.mean_std([x["final_accuracy"] for x in s]),
           pages.paired_difference(group, groups.get(reference, []), pages.final_accuracy)
           if name != reference else "-",
           mean("rollout_train_mismatch_kl", 8), mean("rollout_train_mismatch_k1", 8),
           mean("rollout_train_log_ratio_over_0p1", 4),
           mean("rollout_train_log_ratio_max", 3), _correction_share(group),
           pages.mean_std([x["time_s"]["rollout"] for x in s], 0)]
  return pages.table_row(name, group, cells)


def render_page(results: list[dict], page_path: str) -> str:
  """The grid's table and figure from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           "Means over the 120 RL steps (the mismatch at each batch's fresh tokens), then "
           "over the seeds. Paired: the cell's final held-out accuracy minus float32 "
           "rollouts' (k8_sc: minus k8_none's), seed by seed.", "",
           pages.table_head(["cell", "seeds", "final accuracy", "minus reference, paired",
                             "mismatch KL (k3)", "k1", "share of log-ratios beyond ±0.1",
                             "largest absolute log-ratio", "correction acted on", "rollout s"])]
  lines += [_row(name, groups[name], groups) for name in SETTINGS if name in groups]
  lines += ["", "Does each setting keep float32 rollouts' final accuracy (staleness 8: "
            "k8_none's)? Paired over seeds: 'below' / 'above' when a paired t-test at 5% "
            "says so; else 'level' when the mean difference is within one evaluation's "
            "standard error, 'unresolved' when it is larger (`recovery` in "
            "experiments/grids/low_precision.py). In parentheses: the mean difference ± its "
            "standard error, and the seeds where the setting is lower.", "",
            *_recovery_table(groups)]
  if results:
    stem = os.path.splitext(page_path)[0]
    reference = {"f32 (reference)": groups.get("f32_none", [])}
    panels = [(precision, "updates",
               {**reference, **{name: groups.get(f"{precision}_{name}", [])
                                for name in CORRECTIONS}})
              for precision in PRECISIONS]
    panels.append(("staleness 8", "updates", {"none": groups.get("k8_none", []),
                                              "sc": groups.get("k8_sc", [])}))
    pages.plot_panels(panels, stem + ".png")
    lines += ["", f"![held-out accuracy per update by rollout precision and correction]"
              f"({os.path.basename(stem)}.png)"]
  return "\n".join(lines) + "\n"
