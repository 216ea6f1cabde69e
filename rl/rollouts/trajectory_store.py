"""Trajectory store: rollouts kept across steps, on disk as tensorstore zarr3 arrays.

Pool snapshots (`save_pool` / `load_pool`): the unfinished partial rollouts (tokens,
behaviour log-probs, per-token versions, ...) at checkpoint step s, in `pool/<s>/` under one
directory next to the checkpoints. A snapshot is written before the orbax checkpoint of the
same step, so the checkpoint is the commit point: a crash in between leaves an orphan
snapshot that `prune` removes.
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
  """Pool snapshots in `directory` (created if missing)."""

  def __init__(self, directory: str):
    self.directory = directory
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
