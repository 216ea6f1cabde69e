"""The testbed's shared warm starts: one per seed, the default run with no RL steps.

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm

Each cell trains the default config's supervised warm start (900 steps, about three
minutes on two CPU cores) and stops at the start of the RL phase; the benchmark grids
(experiments/grids/b*.py) start their RL phase from these workdirs with
`--config.warm_start.init_from=runs/warm/runs/warm_s<seed>`, so a grid cell costs the RL
phase alone and every cell of a seed starts from the same parameters. The `teacher` cell
is the on-policy distillation teacher: the seed-0 warm start trained on demonstrations
without carry slips (held-out accuracy 0.96 against the students' 0.27-0.33). The
`warm_tools` cells are the tool grid's (experiments/grids/tools.py): the same warm start
with running_sum's adder, demonstrated at a share of the additions. The `warm_hard` cells
are the budget grid's hard setting: 300 supervised steps on problems of 5 to 9 additions.
The `warm_moe` cells are the MoE grid's (experiments/grids/moe.py): the same warm start
with the mixture-of-experts policy `tiny2_moe`.
"""

from experiments.grids import budget
from experiments.grids import tools

SEEDS = (0, 1, 2)

SPEC = {"cells": [{"name": "warm", "module": "experiments.train", "seeds": list(SEEDS),
                   "flags": {"config.rl.steps": 0}},
                  # The distillation teacher (experiments/grids/opd.py): the same warm start
                  # on a demonstrator that never slips, for seed 0.
                  {"name": "teacher", "module": "experiments.train", "seed": 0,
                   "flags": {"config.rl.steps": 0,
                             "config.task.difficulty.teacher_carry_slip": "(0.0, 0.0)"}},
                  {"name": "warm_tools", "module": "experiments.train", "seeds": list(SEEDS),
                   "flags": {"config.rl.steps": 0, **tools.TOOL_FLAGS}},
                  # The budget grid's hard setting (experiments/grids/budget.py).
                  {"name": "warm_hard", "module": "experiments.train", "seeds": list(SEEDS),
                   "flags": {"config.rl.steps": 0, **budget.HARD_FLAGS}},
                  # The MoE grid's policy (experiments/grids/moe.py).
                  {"name": "warm_moe", "module": "experiments.train", "seeds": list(SEEDS),
                   "flags": {"config.rl.steps": 0, "config.model.preset": "tiny2_moe"}}]}
