"""The device mesh: three named axes, `data`, `fsdp` and `tensor`.

- `data`: pure data parallelism; parameters are replicated across it.
- `fsdp`: data parallelism whose replicas also split the parameters and optimiser state
  (ZeRO-3 / FSDP: each device stores 1/fsdp of every large matrix and XLA all-gathers it
  for the matmul). The batch is split over `data` and `fsdp` together.
- `tensor`: Megatron tensor parallelism; attention heads and MLP hidden units are split.

Axes are `AxisType.Auto` (GSPMD propagation inside `jax.jit`): in jax 0.10 `jax.make_mesh`
defaults to Explicit axes, which would require every op to state its output sharding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the axes a batch of sequences is split over


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; one size may be -1 (take every device the others leave).

  The default (all 1) is a single device: the unsharded code path.
  """
  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = self.sizes()
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
      raise ValueError(f"Mesh axis sizes {dict(zip(AXES, sizes))}: each must be positive, "
                       "and at most one may be -1 (fill with the remaining devices).")

  def sizes(self) -> tuple[int, int, int]:
    return (self.data, self.fsdp, self.tensor)

  @property
  def is_single_device(self) -> bool:
    return self.sizes() == (1, 1, 1)

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    """The concrete (data, fsdp, tensor) sizes for `num_devices` devices."""
    sizes = list(self.sizes())
    if -1 in sizes:
      known = math.prod(s for s in sizes if s != -1)
      if num_devices % known:
        raise ValueError(f"Mesh {dict(zip(AXES, sizes))}: the fixed axes ({known} devices) do not "
                         f"divide the {num_devices} devices; choose sizes that divide it.")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ValueError(f"Mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices but "
                       f"{num_devices} are available; make data * fsdp * tensor = {num_devices} "
                       "(or set one axis to -1).")
    return tuple(sizes)


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh with Auto axis types over `devices` (default: all devices
  of all processes). `jax.make_mesh` orders devices for the physical topology (TPU ICI
  rings, NVLink), with `tensor` the fastest-varying axis so tensor-parallel collectives stay
  within a host."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = config.resolve(len(devices))
  return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def batch_size_multiple(mesh: Mesh) -> int:
  """Batch sizes must be multiples of this (the number of batch shards)."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)
