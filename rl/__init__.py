"""Arbor's RL library, laid out by role:

- `rl.tasks`: tasks (prompts, reference answers, scorers) and their registry;
  `rl.scoring` runs any task's scorer in an isolated, time-bounded worker process.
- `rl.rollouts`: how a batch is made: producers (independent sampling under a selection
  rule, trees, partial rollouts) with their state explicit, what they report, the
  asynchronous producer.
- `rl.objectives`: what a batch is trained toward: advantages, objectives, corrections.
- `rl.train` (the jitted train step), `rl.loop` (the rollout -> score -> train iteration),
  `rl.evaluation`, `rl.checkpoint`, and `rl.types.Rollout`, the batch that flows between them.

Import what you use from its module (`from rl.tasks import make_task`,
`from rl.objectives import losses`). This package itself imports nothing, so a process that
needs one module (the scoring worker's `rl.scoring`) does not load reasoning-gym, orbax or
tensorstore (orbax's storage) with the rest.
"""
