"""Arbor's RL library, laid out by role:

- `rl.tasks`: tasks (prompts, reference answers, scorers) and their registry;
  `rl.scoring` runs any task's scorer in an isolated, time-bounded worker process.
- `rl.rollouts`: how a batch is made: generations turned into scored batches, prompt
  selection, partial rollouts and their pool, the asynchronous producer.
- `rl.objectives`: what a batch is trained toward: advantages, objectives, corrections.
- `rl.train` (the jitted train step), `rl.loop` (the rollout -> score -> train iteration),
  `rl.evaluation`, `rl.checkpoint`, and `rl.types.Rollout`, the batch that flows between them.

The names below are the public surface, importable as `from rl import make_task` or from
their modules. They load lazily (PEP 562), so importing one module (e.g. the scoring worker's
`rl.scoring`) does not import reasoning-gym, orbax or tensorstore with the rest.
"""

import importlib

_PUBLIC = {
    # The batch that flows from the sampler to the loss.
    "Rollout": "rl.types",
    # Tasks and scoring.
    "make_task": "rl.tasks", "register_task": "rl.tasks", "task_names": "rl.tasks",
    "score": "rl.scoring", "Scorer": "rl.scoring", "Scores": "rl.scoring",
    # Advantages, objectives, corrections.
    "get_advantage_fn": "rl.objectives.advantages", "get_tree_advantage_fn": "rl.objectives.advantages",
    "Objective": "rl.objectives.losses", "get_loss": "rl.objectives.losses", "register_loss": "rl.objectives.losses",
    "make_objective": "rl.objectives.losses", "LOSS_DEFAULTS": "rl.objectives.losses",
    "TokenTerms": "rl.objectives.corrections", "register_correction": "rl.objectives.corrections",
    "get_correction": "rl.objectives.corrections",
    # The train step.
    "TrainState": "rl.train", "make_optimizer": "rl.train", "init_train_state": "rl.train",
    "make_train_step": "rl.train",
    # The loop: producers, iterations, asynchronous training.
    "LoopState": "rl.loop", "LoopContext": "rl.loop", "Produced": "rl.loop",
    "selection_producer": "rl.loop", "tree_producer": "rl.loop",
    "grpo_iteration": "rl.loop", "sft_iteration": "rl.loop", "run_async": "rl.rollouts.async_loop",
    # Rollout kinds (config.rollout.kind) and the registry every pluggable piece uses.
    "ROLLOUT_KINDS": "rl.rollouts.kinds", "RolloutKind": "rl.rollouts.kinds",
    "Registry": "rl.registry", "TASKS": "rl.tasks",
    # Prompt selection, partial rollouts, evaluation, the trajectory store.
    "SelectionState": "rl.rollouts.selection", "PartialRollouts": "rl.rollouts.partial",
    "evaluate": "rl.evaluation", "evaluate_sampled": "rl.evaluation",
    "TrajectoryStore": "rl.rollouts.trajectory_store",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(_PUBLIC[name]), name)
  raise AttributeError(f"module 'rl' has no attribute {name!r}; its public names: "
                       f"{', '.join(__all__)}.")


def __dir__():
  return __all__
