"""Orbax checkpoints of the loop state: everything needed to resume a run exactly.

A checkpoint is a Composite of `state` (the LoopState pytree: params, optimiser state,
step counters, RNG) and `meta` (JSON: phase, data cursor, iteration, anything the launcher
adds, and `state_digest`).

Crash safety. Orbax writes each step into a temporary directory and renames it when
complete, so a run killed mid-save (even by SIGKILL) leaves the previous complete step as
the newest; the launcher's manager deletes leftover temporary directories at start-up.

Never a silent wrong restore. `save` records a BLAKE2b digest of every state leaf (path,
dtype, shape, bytes) in `meta`; `restore_latest` recomputes it after restoring. A step
that fails to restore, lacks orbax's commit marker, or restores to a different digest
(a truncated or edited file, a run directory reused with another model config) is moved
aside to `<step>.corrupt` with a warning, and the next older step is tried. If no step
restores, a ValueError lists every step's error and how to start afresh.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any, Callable

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

_COMMIT_MARKER = "commit_success.txt"  # written by orbax just before the final rename
_TMP_SUFFIX = ".orbax-checkpoint-tmp"    # orbax's name for a step still being written


def make_manager(directory: str, max_to_keep: int = 3,
                 remove_unfinished: bool = False) -> ocp.CheckpointManager:
  """A CheckpointManager over `directory` (created if missing), keeping the newest steps.

  Saves are synchronous. `remove_unfinished` (for the run that writes the directory, never
  for a reader such as eval, which could otherwise delete a live run's save in progress)
  first deletes the temporary directories a killed save left behind. It is done here,
  synchronously, rather than with orbax's `cleanup_tmp_directories`, whose background
  deletion races with any other manager over the same directory.
  """
  if remove_unfinished and os.path.isdir(directory):
    for name in os.listdir(directory):
      if _TMP_SUFFIX in name:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def state_digest(state: Any) -> str:
  """BLAKE2b hex digest of a pytree's leaves: key paths, dtypes, shapes and bytes."""
  digest = hashlib.blake2b(digest_size=16)
  for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]:
    leaf = np.ascontiguousarray(leaf)
    digest.update(f"{jax.tree_util.keystr(path)}|{leaf.dtype}|{leaf.shape}|".encode())
    digest.update(leaf.tobytes())
  return digest.hexdigest()


def save(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
  """Saves `state` (a pytree) and `meta` (JSON-serialisable) as checkpoint `step`."""
  meta = dict(meta, state_digest=state_digest(state))
  manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)), force=True)
  manager.wait_until_finished()


def _restore_step(manager: ocp.CheckpointManager, step: int, abstract: Any) -> tuple[Any, dict]:
  step_dir = os.path.join(str(manager.directory), str(step))
  if not os.path.exists(os.path.join(step_dir, _COMMIT_MARKER)):
    raise ValueError(f"{step_dir} has no {_COMMIT_MARKER}: an incomplete copy or write.")
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
  state, meta = restored["state"], restored["meta"]
  if not isinstance(meta, dict) or "state_digest" not in meta:
    raise ValueError(f"{step_dir}: meta has no state_digest (not written by rl.checkpoint.save).")
  digest = state_digest(state)
  if digest != meta["state_digest"]:
    raise ValueError(f"{step_dir}: restored state digest {digest} differs from the saved "
                     f"{meta['state_digest']} (corrupt files, or a different model/optimiser "
                     "config than the run that wrote it).")
  return state, meta


def restore_latest(manager: ocp.CheckpointManager,
                   like: Any | Callable[[dict], Any]) -> tuple[int, Any, dict] | None:
  """(step, state, meta) of the newest checkpoint that restores intact, or None when the
  directory holds no checkpoint.

  `like` is a pytree of the expected structure (values ignored, shapes and dtypes used), or
  a function of a step's meta returning one (when the structure depends on the step, e.g.
  its phase).
  Steps that fail are moved aside to `<step>.corrupt` (so the run can save those step
  numbers again) after a warning; if every step fails, raises ValueError.
  """
  manager.reload()
  steps = sorted(manager.all_steps(), reverse=True)
  if not steps:
    return None
  failures = []
  for step in steps:
    try:
      state_like = like(read_meta(manager, step)) if callable(like) else like
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
      state, meta = _restore_step(manager, step, abstract)
    except Exception as error:  # pylint: disable=broad-except  (any failure: try an older step)
      logging.warning("Checkpoint step %d in %s does not restore (%s); trying an older step.",
                      step, manager.directory, error)
      failures.append((step, error))
      continue
    for bad, _ in failures:
      bad_dir = os.path.join(str(manager.directory), str(bad))
      os.replace(bad_dir, _unused(bad_dir + ".corrupt"))
      logging.warning("Moved unusable checkpoint %s aside; resuming from step %d.", bad_dir, step)
    if failures:
      manager.reload()
    return step, state, meta
  listing = "\n".join(f"  step {step}: {type(error).__name__}: {error}" for step, error in failures)
  raise ValueError(
      f"No checkpoint in {manager.directory} restores:\n{listing}\nIf the run's config "
      "changed, use a new workdir; otherwise move the checkpoints directory away (or set "
      "config.resume.enabled=False with a new workdir) to start afresh.")


def _unused(path: str) -> str:
  candidate, n = path, 1
  while os.path.exists(candidate):
    candidate, n = f"{path}{n}", n + 1
  return candidate


def restore(manager: ocp.CheckpointManager, step: int, like: Any) -> tuple[Any, dict]:
  """(state, meta) of checkpoint `step`, digest-checked; `like` as in `restore_latest`."""
  if step not in manager.all_steps():
    raise ValueError(f"No checkpoint step {step} in {manager.directory}; it holds steps "
                     f"{sorted(manager.all_steps())}.")
  return _restore_step(manager, step, jax.tree.map(ocp.utils.to_shape_dtype_struct, like))


def restore_tree(manager: ocp.CheckpointManager, step: int) -> tuple[Any, dict]:
  """(state, meta) of checkpoint `step` in the structure it was saved in, as nested dicts
  of arrays, when the reader cannot build that structure (another run's checkpoint: its
  staleness ring, LoRA adapters or selection state may differ from the reader's). No
  digest check (the saved digest is over the saved pytree's own key paths); the commit
  marker is checked."""
  if step not in manager.all_steps():
    raise ValueError(f"No checkpoint step {step} in {manager.directory}; it holds steps "
                     f"{sorted(manager.all_steps())}.")
  step_dir = os.path.join(str(manager.directory), str(step))
  if not os.path.exists(os.path.join(step_dir, _COMMIT_MARKER)):
    raise ValueError(f"{step_dir} has no {_COMMIT_MARKER}: an incomplete copy or write.")
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
  return restored["state"], restored["meta"]


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  """The JSON meta of checkpoint `step` alone (e.g. its phase, to build a `like` state)."""
  if step not in manager.all_steps():
    raise ValueError(f"No checkpoint step {step} in {manager.directory}; it holds steps "
                     f"{sorted(manager.all_steps())}.")
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
