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
- `<objective>_U4_k32` (a follow-up, after the grid's first seed): grpo and decoupled at
  k = 32 with 4 updates per batch (30 steps of 32 prompts, rl.num_minibatches = 4): decoupled
  PPO clips against the policy at the start of a batch's updates, which with one update
  per batch is the current policy, so only U > 1 lets its clip act.

Cells run seed by seed (all of seed 0 first), so a grid stopped midway has whole seeds.
`render_page` writes the page's tables and figure from the committed results:

    python -m experiments.grid --spec=experiments/grids/b5_staleness.py --out=docs/results/b5 \
        --render --page=docs/benchmarks_staleness.md
"""

import os

from experiments.grids import pages

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


def _stale_stage_cells(seed: int) -> list[dict]:
  """Decoupled PPO clips against the policy at the start of the batch's updates, so with
  one update per batch its clip never acts; these cells give it (and GRPO, for reference)
  U = 4 updates per batch at k = 32, the setting where it collapsed with U = 1."""
  return [_entry(f"{objective}_U4_k32", seed, {
      "config.loss.name": objective, "config.rl.num_minibatches": 4,
      "config.rollout.prompts_per_step": 32, "config.rl.steps": 30, "config.rl.staleness": 32,
      "config.eval.every": EVAL_EVERY_UPDATES // 4}) for objective in ("grpo", "decoupled")]


# The main grid seed by seed, then the follow-up on decoupled PPO's clip (added after the
# first seed showed decoupled PPO collapsing at k >= 32 with one update per batch).
SPEC = {"cells": [cell for seed in SEEDS for cell in _cells(seed)]
                 + [cell for seed in SEEDS for cell in _stale_stage_cells(seed)]}


# --- The page (python -m experiments.grid ... --render --page=docs/benchmarks_staleness.md) ---

# RL step metrics reported per cell (means over the run's steps; a correction's own
# fractions exist only where it runs).
STEP_METRICS = (("clip_fraction", "clip"), ("masked_fraction", "mask"),
                ("vetoed_fraction", "veto"), ("sat_contracted_fraction", "SAT contracted"),
                ("is_truncated_fraction", "IS truncated"), ("lr_scale", "lr scale"),
                ("grad_norm", "grad norm"))


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _row(name: str, group: list[dict], reference: list[dict]) -> str:
  """A cell's row; `reference` (GRPO's cell in the same setting) gives the paired column."""
  finals = [_final(r) for r in group]
  areas = [pages.area_under_curve(*pages.rl_curve(r)) for r in group]
  gains = [r["summary"]["final_accuracy"] - r["summary"]["warm_start_accuracy"] for r in group]
  means = [r["summary"]["rl_step_means"] for r in group]
  steps = [pages.mean_std([m[key] for m in means if key in m]) for key, _ in STEP_METRICS]
  return pages.table_row(name, group, [
      pages.per_seed(finals, lambda v: f"{v:.3f}"),
      pages.paired_difference(group, reference, _final) if group is not reference else "-",
      pages.mean_std(finals), pages.mean_std(gains), pages.mean_std(areas), *steps])


def _plot(groups: dict[str, list[dict]], path: str) -> None:
  """Accuracy against updates: one panel per staleness k (the objectives' mean over seeds,
  a band from the lowest to the highest seed) and one for the stage schedules."""
  panels = [(f"k = {k}", "updates", {o: groups.get(f"{o}_k{k}", []) for o in OBJECTIVES})
            for k in STALENESS]
  stage_names = ["grpo_k0"] + [f"stages_{o}_S{s}" for s in STAGES for o in ("grpo", "mu_grpo")]
  panels.append(("stages", "updates", {n: groups.get(n, []) for n in stage_names}))
  pages.plot_panels(panels, path)


def render_page(results: list[dict], page_path: str) -> str:
  """B5's tables and figure from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  header = pages.table_head(["cell", "seeds", "final accuracy per seed",
                             "final minus GRPO's, paired", "final accuracy",
                             "gain over warm start",
                             "area under curve", *(label for _, label in STEP_METRICS)])
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           "Final accuracy: held-out greedy exact match (500 problems) after the RL phase; "
           "area under curve: mean accuracy over the RL phase (trapezoid against optimiser "
           "updates, warm start included); paired: the final accuracy minus GRPO's in the same "
           "setting (same k, stage size or updates per batch), seed by seed; step columns: "
           "means over the RL steps.", "",
           "### Staleness k x objective", "", header]
  for k in STALENESS:
    for objective in OBJECTIVES:
      name = f"{objective}_k{k}"
      if name in groups:
        lines.append(_row(name, groups[name], groups.get(f"grpo_k{k}", [])))
  lines += ["", "### Stages (mu-GRPO's schedule: S updates per rollout batch)", "", header]
  if "grpo_k0" in groups:
    lines.append(_row("grpo_k0", groups["grpo_k0"], groups["grpo_k0"]))
  for stage in STAGES:
    for objective in ("grpo", "mu_grpo"):
      name = f"stages_{objective}_S{stage}"
      if name in groups:
        lines.append(_row(name, groups[name], groups.get(f"stages_grpo_S{stage}", [])))
  follow_up = [f"{o}_U4_k32" for o in ("grpo", "decoupled")]
  if any(name in groups for name in follow_up):
    lines += ["", "### Four updates per batch at k = 32 (decoupled PPO's clip acting)", "",
              header]
    references = {"grpo_k32": "grpo_k32", "decoupled_k32": "grpo_k32",
                  "grpo_U4_k32": "grpo_U4_k32", "decoupled_U4_k32": "grpo_U4_k32"}
    lines += [_row(name, groups[name], groups.get(references[name], []))
              for name in references if name in groups]
  figure = os.path.splitext(page_path)[0] + ".png"
  if results:
    _plot(groups, figure)
    lines += ["", f"![accuracy against updates]({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
