"""The previous embedded default: a tiny from-scratch policy learns chain_sum, then GRPO.

    python -m experiments.train --config=experiments/configs/chain_sum_compact.py

reasoning-gym's chain_sum with 2-3 terms of 1-2 digits in the compact prompt style ("4-1="):
answers are ~3 tokens, so it is fast and every code path runs on it, but GRPO gains only
~+9 points over its warm start. The end-to-end tests run on it (shrunk), and the earlier
B3, B5 and B6 measurements in docs/benchmarks_history.md ran on it. Every field not set
here is the default's (experiments/configs/default.py).
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
  c.model.preset = "tiny"
  c.rollout.prompt_len = 12
  c.rollout.max_new_tokens = 6
  c.rollout.prompts_per_step = 32
  c.rollout.train_length_buckets = ()
  c.warm_start.steps = 500
  c.warm_start.batch_size = 64
  c.warm_start.learning_rate = 2e-3
  c.warm_start.length_window = 1
  c.rl.steps = 400
  c.rl.learning_rate = 5e-5
  c.rl.warmup_steps = 0
  c.eval.every = 50
  return c
