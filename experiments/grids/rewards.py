"""Denser and noisier rewards on the testbed: PURE's process-reward credit (min-form against
sum-form), a verifier with false negatives with and without a second opinion, and TTRL's
label-free majority vote, 3 seeds, each cell's RL phase from its seed's shared warm start
(experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/rewards.py --out=docs/results/rewards
    python -m experiments.grid --spec=experiments/grids/rewards.py --out=docs/results/rewards \
        --render --page=docs/benchmarks_rewards.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, held-out
greedy accuracy every 30 steps), all on the same finite pool of 256 train prompts (so a
prompt recurs about every 32 steps, and a majority vote can flip between visits):
- `grpo`: GRPO on the exact outcome reward (the labelled reference of every comparison).
- `rloo`: the outcome reward with RLOO's leave-one-out baseline (PURE's estimator family).
- `pure_min`, `pure_sum`: PURE's credit over running_sum's exact per-step rewards (+1 a
  right step, -1 a wrong one, judged from the state it reads), with the verifier's outcome
  reward beside them (PRM+VR, weight 1): the min-form value (the worst step ahead) and the
  sum-form (the mean step reward summed ahead).
- `fn20`, `fn40`: GRPO whose verifier fails 20% / 40% of the correct completions.
- `fn20_second`, `fn40_second`: the same verifier, every failure re-checked by the second
  opinion (running_sum's exact check), which finds every false negative: what it costs is
  its calls.
- `ttrl`: TTRL's majority vote over each group as the reward, no label read.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
TRAIN_POOL = 256

METHOD_FLAGS = {
    "grpo": {},
    "rloo": {"config.advantage.name": "rloo"},
    "pure_min": {"config.advantage.name": "pure_min"},
    "pure_sum": {"config.advantage.name": "pure_sum"},
    "fn20": {"config.reward.false_negative": 0.2},
    "fn40": {"config.reward.false_negative": 0.4},
    "fn20_second": {"config.reward.false_negative": 0.2, "config.reward.second_opinion": True},
    "fn40_second": {"config.reward.false_negative": 0.4, "config.reward.second_opinion": True},
    "ttrl": {"config.reward.kind": "majority_vote"},
}
METHODS = tuple(METHOD_FLAGS)

SPEC = {"cells": [{"name": f"{method}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START,
                             "config.task.train_pool": TRAIN_POOL,
                             **flags}}
                  for seed in SEEDS for method, flags in METHOD_FLAGS.items()]}
