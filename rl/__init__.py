"""Arbor's RL library, laid out by role:

- `rl.tasks`: tasks (prompts, reference answers, scorers) and their registry;
  `rl.scoring` runs any task's scorer in an isolated, time-bounded worker process.
- `rl.rollouts`: how a batch is made: producers (independent sampling under a selection
  rule, trees, partial rollouts) with their state explicit, and what they report.
- `rl.objectives`: what a batch is trained toward: advantages, objectives, corrections,
  and their composition into the train step's loss (`composite`).
- `rl.train` (the jitted train step), `rl.loop` (the rollout -> score -> train iteration)
  and `rl.async_loop` (the same, producer and trainer in two threads),
  `rl.evaluation`, `rl.checkpoint`, and `rl.types.Rollout`, the batch that flows between them.
- `rl.verdicts` (why a completion failed: the failure categories a scorer reports) and
  `rl.samples` (sample records of what the policy wrote, and their tables).

Import what you use from its module (`from rl.tasks import make_task`,
`from rl.objectives import losses`). This package itself imports nothing, so a process that
needs one module (the scoring worker's `rl.scoring`) does not load reasoning-gym, orbax or
tensorstore (orbax's storage) with the rest.
"""
