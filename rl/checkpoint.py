"""Orbax checkpoints of the loop state: everything needed to resume a run exactly.

A checkpoint is a Composite of `state` (the LoopState pytree: params, optimiser state,
step counters, RNG) and `meta` (JSON: phase, data cursor, iteration, anything the launcher
adds). Orbax writes each step to a temporary directory and renames it when complete, so a
run killed mid-save leaves the previous complete step as the latest.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def make_manager(directory: str, max_to_keep: int = 3) -> ocp.CheckpointManager:
  """A CheckpointManager over `directory` (created if missing), keeping the newest steps."""
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
  """Saves `state` (a pytree) and `meta` (JSON-serialisable) as checkpoint `step`."""
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)), force=True)
  manager.wait_until_finished()


def restore_latest(manager: ocp.CheckpointManager, like: Any) -> tuple[int, Any, dict] | None:
  """(step, state, meta) of the newest complete checkpoint, or None when there is none.

  `like` is a pytree of the expected structure (values ignored, shapes and dtypes used).
  """
  step = manager.latest_step()
  if step is None:
    return None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
  return step, restored["state"], restored["meta"]


def restore(manager: ocp.CheckpointManager, step: int, like: Any) -> tuple[Any, dict]:
  """(state, meta) of checkpoint `step`; `like` as in `restore_latest`."""
  if step not in manager.all_steps():
    raise ValueError(f"No checkpoint step {step} in {manager.directory}; it holds steps "
                     f"{sorted(manager.all_steps())}.")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
  return restored["state"], restored["meta"]


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The JSON meta of checkpoint `step` alone (e.g. its phase, to build a `like` state)."""
  if step not in manager.all_steps():
    raise ValueError(f"No checkpoint step {step} in {manager.directory}; it holds steps "
                     f"{sorted(manager.all_steps())}.")
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
