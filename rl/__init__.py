"""Arbor's RL library: tasks and scorers, advantages, objectives and corrections, the train
step and the rollout -> score -> train loop.

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
    "get_advantage_fn": "rl.advantages", "get_tree_advantage_fn": "rl.advantages",
    "Objective": "rl.losses", "get_loss": "rl.losses", "register_loss": "rl.losses",
    "make_objective": "rl.losses", "LOSS_DEFAULTS": "rl.losses",
    "TokenTerms": "rl.corrections", "register_correction": "rl.corrections",
    "get_correction": "rl.corrections",
    # The train step.
    "TrainState": "rl.train", "make_optimizer": "rl.train", "init_train_state": "rl.train",
    "make_train_step": "rl.train",
    # The loop: producers, iterations, asynchronous training.
    "LoopState": "rl.loop", "LoopContext": "rl.loop", "Produced": "rl.loop",
    "make_producer": "rl.loop", "grpo_iteration": "rl.loop", "sft_iteration": "rl.loop",
    "run_async": "rl.async_loop",
    # Prompt selection, partial rollouts, evaluation, the trajectory store.
    "SelectionState": "rl.selection", "PartialRollouts": "rl.partial_rollout",
    "evaluate": "rl.evaluation", "evaluate_sampled": "rl.evaluation",
    "TrajectoryStore": "rl.trajectory_store",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(_PUBLIC[name]), name)
  raise AttributeError(f"module 'rl' has no attribute {name!r}; its public names: "
                       f"{', '.join(__all__)}.")


def __dir__():
  return __all__
