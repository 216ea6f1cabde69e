"""The embedded default until the running_sum testbed: tiny policy, reasoning-gym chain_sum.

`python -m experiments.train --config=experiments/configs/chain_sum_compact.py` reproduces
the earlier default run (2-3 terms of 1-2 digits in a compact prompt such as "23-60=",
answered directly in at most 6 tokens; 500 warm-start and 400 GRPO steps) and the earlier
benchmark numbers measured on it (docs/benchmarks_*.md). Every field not set here is the
current default (experiments/configs/default.py).
"""

import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.workdir = "runs/chain_sum_compact"
  c.task.name = "chain_sum"
  c.task.eval_size = 1000
  c.task.difficulty = ml_collections.ConfigDict(dict(
      min_terms=2, max_terms=3, min_digits=1, max_digits=2))
  c.rollout.prompt_len = 12
  c.rollout.max_new_tokens = 6
  c.rollout.prompts_per_step = 32
  c.warm_start.steps = 500
  c.warm_start.batch_size = 64
  c.warm_start.learning_rate = 2e-3
  c.warm_start.warmup_steps = 20
  c.warm_start.length_window = 1
  c.rollout.train_length_buckets = ()
  c.rl.steps = 400
  c.rl.learning_rate = 5e-5
  c.loss.norm_len = 6.0
  c.eval.every = 50
  c.eval.batch_size = 250
  return c
