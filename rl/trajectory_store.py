"""Trajectory store: rollouts kept across steps, on disk as tensorstore zarr3 arrays.

Two things live here, both under one directory next to the checkpoints:

- Pool snapshots (`save_pool` / `load_pool`): the unfinished partial rollouts (tokens,
  behaviour log-probs, per-token versions, ...) at checkpoint step s, in `pool/<s>/`. A
  snapshot is written before the orbax checkpoint of the same step, so the checkpoint is the
  commit point: a crash in between leaves an orphan snapshot that `prune` removes.
- Replay (`append_replay` / `recent`): a ring of the last `replay_capacity` trained batches
  (one zarr3 array per field, [capacity, ...]), plus `replay/step` [capacity] saying which
  step each slot holds (-1: empty). A batch's data is written before its index entry. After
  a resume from step s, `truncate_after(s)` forgets batches trained after s, so the replay of
  a killed and resumed run equals that of an uninterrupted one.
"""

from __future__ import annotations

import os
import shutil
from typing import Iterable

import numpy as np
import tensorstore as ts


def _spec(path: str) -> dict:
  return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.abspath(path)}}


def write_array(path: str, array: np.ndarray) -> None:
  """Writes `array` as a new zarr3 array at `path` (replacing any previous one)."""
  array = np.asarray(array)
  store = ts.open(_spec(path), create=True, delete_existing=True,
                  dtype=ts.dtype(array.dtype.name), shape=array.shape).result()
  store.write(array).result()


def read_array(path: str) -> np.ndarray:
  if not os.path.isdir(path):
    raise ValueError(f"Trajectory store array {path!r} is missing; the store does not match "
                     "the checkpoint (start a new workdir, or restore the store directory).")
  return np.asarray(ts.open(_spec(path)).result().read().result())


class TrajectoryStore:
  """Pool snapshots and a replay ring in `directory` (created if missing)."""

  def __init__(self, directory: str, replay_capacity: int = 0):
    if replay_capacity < 0:
      raise ValueError(f"replay_capacity={replay_capacity} must be >= 0 (0 = no replay).")
    self.directory = directory
    self.replay_capacity = replay_capacity
    os.makedirs(directory, exist_ok=True)

  def _pool_dir(self, step: int) -> str:
    return os.path.join(self.directory, "pool", str(int(step)))

  def save_pool(self, step: int, arrays: dict[str, np.ndarray]) -> None:
    """Snapshots the pool's arrays for checkpoint `step`."""
    for name, array in arrays.items():
      write_array(os.path.join(self._pool_dir(step), name), array)

  def load_pool(self, step: int, names: Iterable[str]) -> dict[str, np.ndarray]:
    return {name: read_array(os.path.join(self._pool_dir(step), name)) for name in names}

  def prune(self, keep_steps: Iterable[int]) -> None:
    """Deletes pool snapshots of steps not in `keep_steps` (the checkpoints kept)."""
    keep = {str(int(s)) for s in keep_steps}
    root = os.path.join(self.directory, "pool")
    for name in os.listdir(root) if os.path.isdir(root) else ():
      if name not in keep:
        shutil.rmtree(os.path.join(root, name))

  # Replay ring.

  def _replay_path(self, name: str) -> str:
    return os.path.join(self.directory, "replay", name)

  def _index(self) -> np.ndarray:
    path = self._replay_path("step")
    if not os.path.isdir(path):
      return np.full((self.replay_capacity,), -1, np.int64)
    return read_array(path)

  def append_replay(self, step: int, batch: dict[str, np.ndarray]) -> None:
    """Keeps `batch` (field -> array, fixed shapes) as the replay entry of `step`."""
    if not self.replay_capacity:
      return
    slot = int(step) % self.replay_capacity
    index = self._index()
    index[slot] = -1  # invalidate first: a crash mid-write leaves the slot empty
    write_array(self._replay_path("step"), index)
    for name, array in batch.items():
      array = np.asarray(array)
      path = self._replay_path(name)
      if os.path.isdir(path):
        store = ts.open(_spec(path)).result()
        if tuple(store.shape[1:]) != array.shape or store.dtype != ts.dtype(array.dtype.name):
          raise ValueError(f"Replay field {name!r} was {store.shape[1:]} {store.dtype}, now "
                           f"{array.shape} {array.dtype}; batch shapes must stay fixed.")
      else:
        store = ts.open(_spec(path), create=True, dtype=ts.dtype(array.dtype.name),
                        shape=(self.replay_capacity,) + array.shape).result()
      store[slot].write(array).result()
    index[slot] = int(step)
    write_array(self._replay_path("step"), index)

  def recent(self, n: int, names: Iterable[str]) -> list[tuple[int, dict[str, np.ndarray]]]:
    """The newest `n` replay entries as (step, {field: array}), newest first."""
    index = self._index()
    slots = [int(s) for s in np.argsort(-index, kind="stable") if index[s] >= 0][:n]
    names = list(names)
    stores = {name: ts.open(_spec(self._replay_path(name))).result() for name in names}
    return [(int(index[s]), {name: np.asarray(stores[name][s].read().result()) for name in names})
            for s in slots]

  def truncate_after(self, step: int) -> None:
    """Forgets replay entries of steps after `step` (after a resume from that checkpoint)."""
    index = self._index()
    if (index > step).any():
      index[index > step] = -1
      write_array(self._replay_path("step"), index)
