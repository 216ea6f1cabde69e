"""Fewer tokens for the same learning, on the testbed: uniform GRPO against PODS
max-variance down-sampling, NAT token subsampling (random prefix cut and uniform random
tokens) and AR3PO's adaptive rollout with response reuse, 3 seeds, each cell's RL phase from its seed's shared warm start
(experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/budget.py --out=docs/results/budget
    python -m experiments.grid --spec=experiments/grids/budget.py --out=docs/results/budget \
        --render --page=docs/benchmarks_budget.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, GRPO,
held-out greedy accuracy every 30 steps), all on the same finite pool of 256 train
prompts (as the selection grid, B6) and with fine train length buckets, so that a batch
whose rows are cut is trained at its cut length in every cell alike (trimming changes no
number, only the time):
- `uniform`: plain GRPO, 8 rollouts of each of the next 8 prompts.
- `pods`: 16 rollouts of each prompt, trained on the 8 with the largest reward variance
  (PODS, arXiv 2504.13818): twice the sampling, the same update.
- `nat_rpc`: NAT's random prefix cut (arXiv 2603.06619), half the completion tokens in
  expectation, one cut per batch, Horvitz-Thompson reweighted: the same sampling, a shorter
  update.
- `nat_urs`: NAT's uniform random tokens, half in expectation: the estimator without the
  shorter update.
- `ar3po`: AR3PO (arXiv 2509.25808): 4 rollouts of each prompt, 4 more only for the
  prompts with no exact answer yet, and a prompt's earlier exact response reused in a group
  left all wrong (the pool makes prompts recur about 3.75 times, so there is something to
  reuse).
"""

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
TRAIN_POOL = 256
LENGTH_BUCKETS = (8, 16, 24, 32, 48, 64, 80)

METHOD_FLAGS = {
    "uniform": {},
    "pods": {"config.selection.kind": "pods", "config.selection.pods.rollouts": 16},
    "nat_rpc": {"config.loss.token_subsample": "rpc", "config.loss.token_keep": 0.5},
    "nat_urs": {"config.loss.token_subsample": "urs", "config.loss.token_keep": 0.5},
    "ar3po": {"config.selection.kind": "ar3po", "config.selection.ar3po.stages": 2},
}
METHODS = tuple(METHOD_FLAGS)

SPEC = {"cells": [{"name": f"{method}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START,
                             "config.task.train_pool": TRAIN_POOL,
                             "config.rollout.train_length_buckets": str(LENGTH_BUCKETS),
                             **flags}}
                  for seed in SEEDS for method, flags in METHOD_FLAGS.items()]}
