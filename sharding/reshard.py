"""Resharding between layouts on device, e.g. trainer (FSDP) -> sampler (tensor-parallel).

The loop calls the function `make_reshard` returns each time it publishes parameters to the
sampler. It is a jitted identity with `out_shardings`: XLA moves the shards with
collectives (all-gathers over `fsdp` here), never through host memory, and it works
unchanged when the mesh spans several processes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh

from sharding import rules as rules_lib


def make_reshard(shardings: Any) -> Callable[[Any], Any]:
  """Returns `reshard(tree)`: a copy of `tree` laid out as `shardings` (a matching pytree of
  NamedShardings). The input is not donated: the trainer keeps its copy."""
  return jax.jit(lambda tree: tree, out_shardings=shardings)


def make_publish(mesh: Mesh, params: Any,
                 rules: rules_lib.Rules = rules_lib.SAMPLER_RULES) -> Callable[[Any], Any]:
  """The trainer -> sampler publisher for parameters shaped like `params` (arrays or
  ShapeDtypeStructs): their sampler layout is `rules` on `mesh`."""
  return make_reshard(rules_lib.tree_shardings(params, mesh, rules))
