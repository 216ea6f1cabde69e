"""On-policy distillation on the running_sum testbed (docs/distillation.md): the default
student learns from a teacher that never forgets a carry, by the exact per-token reverse
KL alone (pure OPD: no reward in the loss).

The two warm starts it reads, each one launcher command (about three minutes each):

    python -m experiments.train --config.rl.steps=0 --config.workdir=runs/warm/runs/warm_s0
    python -m experiments.train --config.rl.steps=0 --config.workdir=runs/warm/runs/teacher \\
        "--config.task.difficulty.teacher_carry_slip=(0.0, 0.0)"

(or `python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm`,
which trains both, and the other seeds' students). Then:

    python -m experiments.train --config=experiments/configs/opd_running_sum.py
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.workdir = "runs/opd_running_sum"
  c.warm_start.init_from = "runs/warm/runs/warm_s0"  # the default run's warm start (seed 0)
  c.distill.teacher = "runs/warm/runs/teacher"        # the same, on slip-free demonstrations
  c.distill.objective = "reverse_kl"
  c.distill.coef = 1.0
  c.distill.with_reward = False
  c.eval.every = 10
  return c
