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
"""

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
