"""The running_sum testbed (rl/running_sum.py, docs/testbed.md): long-tailed worked solutions
and a warm-start teacher that forgets most carries, so GRPO has a skill to learn.

    python -m experiments.train --config=experiments/configs/running_sum.py

A two-layer decoder from scratch warm-starts on demonstrations (add 5 to an 8-digit number
k = 1..9 times, writing the state "count:total" after each addition) from a teacher that
forgets 55-90% of the carries, then GRPO learns to carry. Measured on two CPU cores: under
ten minutes; +52 to +77 points of held-out accuracy in seeds 0, 1, 3 and 4, but +9 in
seed 2, whose policy does not learn the first step's carry (+18 with partial credit,
task.difficulty.state_credit=0.5; docs/testbed.md). Not yet the embedded default for that
reason. Every field not set here is the default's
(experiments/configs/default.py).
"""

import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.workdir = "runs/running_sum"
  c.task.name = "running_sum"
  c.task.eval_size = 500
  c.task.difficulty = ml_collections.ConfigDict(dict(
      min_steps=1, max_steps=9, length_tail=1.9, digits=7, step=5,
      teacher_carry_slip=(0.55, 0.9), state_credit=0.0))
  c.model.preset = "tiny2"            # two layers, RoPE base 100: the procedure in fewer seconds
  c.rollout.prompt_len = 16           # BOS + "+5,9:1234567"
  c.rollout.max_new_tokens = 101      # the longest worked solution, EOS included
  c.rollout.prompts_per_step = 8
  c.rollout.train_length_buckets = (24, 48)  # one addition, up to three
  c.warm_start.steps = 900
  c.warm_start.batch_size = 32
  c.warm_start.learning_rate = 3e-3
  c.warm_start.length_window = 8
  c.rl.steps = 120
  c.rl.learning_rate = 2.5e-4
  c.rl.warmup_steps = 20
  c.eval.every = 30
  return c
