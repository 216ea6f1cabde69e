"""Multi-host start-up and per-host data: one JAX process per host (or per GPU).

`initialize` starts `jax.distributed`; afterwards `jax.devices()` lists every process's
devices and a mesh over them spans hosts. Each process loads only the batch rows its own
devices hold (`host_rows`) and assembles the global array with `global_batch`; only the
primary process (index 0) writes logs and metrics (orbax coordinates checkpoint writes
itself, so every process calls its save).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Starts `jax.distributed` when asked to; returns whether it did.

  Safe to call again once started. Arguments left None fall back to the environment: JAX_COORDINATOR_ADDRESS
  ('host:port' of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID. With a coordinator but no
  count/id, JAX detects them on managed clusters (Cloud TPU, SLURM, Open MPI, Kubernetes).
  The coordinator 'auto' leaves everything to that detection. Without a coordinator this
  is a single-process run and nothing happens. Call before anything touches a device.
  """
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not coordinator_address:
    return False
  if jax.distributed.is_initialized():  # a second run() in the same processes
    return True
  if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
  if process_id is None and os.environ.get("JAX_PROCESS_ID"):
    process_id = int(os.environ["JAX_PROCESS_ID"])
  if (num_processes is None) != (process_id is None):
    raise ValueError(f"num_processes={num_processes} and process_id={process_id}: give both "
                     "(flags or JAX_NUM_PROCESSES / JAX_PROCESS_ID) or neither (auto-detect).")
  # CPU devices of different processes talk through gloo (tests, CPU clusters); the
  # setting does not affect GPU or TPU devices. (Querying the backend here would start it,
  # which jax.distributed forbids.)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=None if coordinator_address == "auto" else coordinator_address,
      num_processes=num_processes, process_id=process_id)
  return True


def is_primary() -> bool:
  """True on the process that writes logs, plots and summaries (process 0)."""
  return jax.process_index() == 0


def host_rows(sharding: jax.sharding.Sharding, global_rows: int) -> tuple[int, int]:
  """[start, stop) of the batch rows this process's devices hold under `sharding` (the
  rows it must load). Rows are split over the batch axes; each process's block is contiguous
  because the mesh orders devices by process."""
  index_map = sharding.addressable_devices_indices_map((global_rows,))
  starts = [idx[0].start or 0 for idx in index_map.values()]
  stops = [global_rows if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
  start, stop = min(starts), max(stops)
  held = sum(b - a for a, b in {(a, b) for a, b in zip(starts, stops)})
  if held != stop - start:
    raise ValueError(f"This process's rows under {sharding} are not one contiguous block; "
                     "build the mesh with sharding.make_mesh (devices ordered by process).")
  return start, stop


def global_batch(local: Any, sharding: jax.sharding.Sharding, global_rows: int) -> Any:
  """The global batch from each process's rows `local` (a pytree of [rows, ...] host arrays,
  rows = `host_rows`), split over devices by `sharding`. Single-process: a plain device_put."""
  def one(x):
    x = np.asarray(x)
    return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])
  return jax.tree.map(one, local)


def place_rows(tree: Any, sharding: jax.sharding.Sharding) -> Any:
  """Host arrays holding the whole batch (identical on every process) as global arrays
  split by rows per `sharding`, each process contributing only the rows its devices hold.
  Leaves that already are multi-process arrays pass through. For multi-process runs whose
  host code builds whole batches (the loop scores every row on every host)."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x
    x = np.asarray(x)
    start, stop = host_rows(sharding, x.shape[0])
    return jax.make_array_from_process_local_data(sharding, x[start:stop], x.shape)
  return jax.tree.map(one, tree)


def replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
  """Host values (identical on every process, e.g. a PRNG key) as global arrays replicated
  over `mesh`: what orbax can checkpoint in a multi-process run."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree)


def fetch(tree: Any) -> Any:
  """Host numpy copies of (possibly multi-process) global arrays, on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)
