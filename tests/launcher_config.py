"""The launcher config of the end-to-end tests: the default run, shrunk to seconds."""

from experiments.configs import default


def tiny_run_config(workdir, overrides: dict | None = None):
  """`experiments/configs/default.py` with tiny sizes: running_sum problems of 1-3 steps
  from two-digit starts (prompts of at most 8 tokens, completions of at most 12), 3
  warm-start steps of 8, 2 GRPO steps of 2 prompts x 4 completions, 16 held-out items
  evaluated and checkpoints saved every 2 steps. `overrides` maps dotted field paths
  ("rl.steps", "rollout.tree.rounds") to values.
  """
  c = default.get_config()
  c.workdir = str(workdir)
  c.task.difficulty.min_steps = 1
  c.task.difficulty.max_steps = 3
  c.task.difficulty.max_start = 99
  c.rollout.prompt_len = 8
  c.rollout.max_new_tokens = 12
  c.task.eval_size = 16
  c.warm_start.steps = 3
  c.warm_start.batch_size = 8
  c.rl.steps = 2
  c.rollout.prompts_per_step = 2
  c.rollout.group_size = 4
  c.eval.every = 2
  c.eval.batch_size = 16
  c.checkpoint.every = 2
  for path, value in (overrides or {}).items():
    *parents, leaf = path.split(".")
    node = c
    for name in parents:
      node = node[name]
    if leaf not in node:
      raise KeyError(f"tiny_run_config: no config field {path!r}.")
    node[leaf] = value
  return c
