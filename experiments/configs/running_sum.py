"""The running_sum testbed (rl/running_sum.py): long-tailed worked solutions, a slipping teacher.

    python -m experiments.train --config=experiments/configs/running_sum.py

A tiny from-scratch policy warm-starts on demonstrations from a teacher that forgets the
carry at 60% of the steps where the units wrap, then GRPO has to learn to carry. Rollouts
have a long tail of lengths (median ~17 tokens, a few over 100). Work in progress: it is
not yet the embedded default, because GRPO does not yet raise held-out accuracy by the
25 points that would make it one (docs/testbed.md has the measured runs). Every field not
set here is the default (experiments/configs/default.py).
"""

import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.workdir = "runs/running_sum"
  c.task.name = "running_sum"
  c.task.eval_size = 500
  c.task.difficulty = ml_collections.ConfigDict(dict(
      min_steps=2, max_steps=26, length_tail=1.4, min_start=10, max_start=899, max_digit=1,
      teacher_carry_slip=0.6))
  c.rollout.prompt_len = 12          # BOS + "899+1*z="
  c.rollout.max_new_tokens = 112     # the longest worked solution is 105 tokens with EOS
  c.rollout.prompts_per_step = 8
  c.rollout.train_length_buckets = (16, 32, 64)
  c.warm_start.steps = 400
  c.warm_start.batch_size = 32
  c.warm_start.learning_rate = 3e-3
  c.warm_start.length_window = 8
  c.rl.steps = 160
  c.rl.learning_rate = 3e-4
  c.eval.every = 20
  return c
