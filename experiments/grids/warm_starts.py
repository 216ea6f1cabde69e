"""The testbed's shared warm starts: one per seed, the default run with no RL steps.

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm

Each cell trains the default config's supervised warm start (900 steps, about three
minutes on two CPU cores) and stops at the start of the RL phase; the benchmark grids
(experiments/grids/b*.py) start their RL phase from these workdirs with
`--config.warm_start.init_from=runs/warm/runs/warm_s<seed>`, so a grid cell costs the RL
phase alone and every cell of a seed starts from the same parameters.
"""

SEEDS = (0, 1, 2)

SPEC = {"cells": [{"name": "warm", "module": "experiments.train", "seeds": list(SEEDS),
                   "flags": {"config.rl.steps": 0}}]}
