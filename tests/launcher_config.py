"""The launcher config of the end-to-end tests: the compact chain_sum run, shrunk to seconds."""

from experiments.configs import chain_sum_compact


def tiny_run_config(workdir, overrides: dict | None = None):
  """`experiments/configs/chain_sum_compact.py` (answers of a few tokens) with tiny sizes:
  3 warm-start steps of 8, 2 GRPO steps of 2 prompts x 4 completions, 16 held-out items
  evaluated and checkpoints saved every 2 steps. `overrides` maps dotted field paths
  ("rl.steps", "rollout.tree.rounds") to values.
  """
  c = chain_sum_compact.get_config()
  c.workdir = str(workdir)
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
