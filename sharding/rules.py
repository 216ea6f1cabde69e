"""Partition rules as data: (path regex, PartitionSpec) tables, first match wins.

A leaf's path is its pytree key path joined by '/', e.g. `params/layers/q` in a TrainState
or `opt_state/1/0/mu/layers/q` for Adam's first moment of the same matrix. The rules match
the path's end, so one table shards parameters and the optimiser state that mirrors them
(optax's mu / nu have the parameters' paths and shapes). The parameter names are those of
`models/transformer.py` (a plain dict: `embed`, `layers/q`, ..., `lm_head`).

Layouts (MaxText-style: the table is the only place that names mesh axes):

| leaf                                | trainer (FSDP + TP)   | sampler (TP, replicated over data/fsdp) |
|-------------------------------------|-----------------------|-----------------------------------------|
| embed [V, D]                        | (tensor+fsdp, -)      | (tensor, -)                             |
| lm_head [D, V]                      | (fsdp, tensor)        | (-, tensor)                             |
| layers/{q,k,v,gate,up} [L, D, N]    | (-, fsdp, tensor)     | (-, -, tensor)                          |
| layers/{o,down} [L, N, D]           | (-, tensor, fsdp)     | (-, tensor, -)                          |
| layers/{q,k,v}_bias [L, N]          | (-, tensor)           | (-, tensor)                             |
| layers/router [L, D, X]             | (-, fsdp, -)          | replicated                              |
| layers/expert_{gate,up} [L, X, D, F]| (-, -, fsdp, tensor)  | (-, -, -, tensor)                       |
| layers/expert_down [L, X, F, D]     | (-, -, tensor, fsdp)  | (-, -, tensor, -)                       |
| layers/shared_{gate,up} [L, D, S]   | (-, fsdp, tensor)     | (-, -, tensor)                          |
| layers/shared_down [L, S, D]        | (-, tensor, fsdp)     | (-, tensor, -)                          |
| layers/shared_scale [L, D, 1]       | (-, fsdp, -)          | replicated                              |
| norms, counters, RNG                | replicated            | replicated                              |
| batch leaves [B, ...]               | (data+fsdp, ...)      | (data+fsdp, ...)                        |
| KV cache [L, B, S, K, E]            | -                     | (-, data+fsdp, -, tensor, -)            |
| cache/experts [L, B, S, k]          | -                     | (-, data+fsdp, -, -)                    |

N is a projection's other width (heads x head width, or the MLP width), X the number of
experts, F each expert's width, S the shared expert's, k the experts per token;
cache/experts is an MoE model's routing record.

Column-parallel matrices (q/k/v/gate/up) split their output units over `tensor`,
row-parallel ones (o/down) their input units, so each block needs one all-reduce
(Megatron-LM, Shoeybi et al. 2019); FSDP splits the other dimension. The embedding is split
by vocabulary rows only (a vocab-parallel lookup: masked local gather + all-reduce):
splitting its model dimension over `fsdp` makes XLA's partitioner replicate the looked-up
activations to re-split them by batch rows ("involuntary full rematerialization").

Mixture-of-experts blocks: each expert is laid out as a dense MLP is, its D over `fsdp`
and its F over `tensor`; the expert axis X itself is not split (there is no `expert` mesh
axis). Every device then holds a 1/(fsdp x tensor) slice of every expert whatever the
number of experts (Mixtral's 8 do not split over an fsdp of 16; its D = 4096 does), and
under tensor parallelism each device does the same share of every expert's work whatever
the routing. The router stays whole along X (top-k needs every logit of a token). The
shared expert is a dense SwiGLU and takes the dense rules. docs/pod.md
("Mixture-of-experts layouts") argues the choice and says what XLA does with the grouped
matmul under it.

A mesh axis that does not divide a dimension is dropped for that leaf (the dimension is
replicated), so models whose sizes do not divide the mesh still run, only less sharded.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.mesh import BATCH_AXES

Rules = Sequence[tuple[str, P]]

_COLUMN = r"(^|/)layers/(q|k|v|gate|up|shared_gate|shared_up)$"
_ROW = r"(^|/)layers/(o|down|shared_down)$"
_BIAS = r"(^|/)layers/(q|k|v)_bias$"
# Mixture of experts: the [L, X, D, F] and [L, X, F, D] stacks of X experts' matrices; the
# router [L, D, X] and the shared expert's gate [L, D, 1].
_EXPERT_IN = r"(^|/)layers/expert_(gate|up)$"
_EXPERT_OUT = r"(^|/)layers/expert_down$"
_BY_MODEL_DIM = r"(^|/)layers/(router|shared_scale)$"

TRAINER_RULES: Rules = (
    (r"(^|/)embed$", P(("tensor", "fsdp"), None)),
    (r"(^|/)lm_head$", P("fsdp", "tensor")),
    (_COLUMN, P(None, "fsdp", "tensor")),
    (_ROW, P(None, "tensor", "fsdp")),
    (_BIAS, P(None, "tensor")),
    (_EXPERT_IN, P(None, None, "fsdp", "tensor")),
    (_EXPERT_OUT, P(None, None, "tensor", "fsdp")),
    (_BY_MODEL_DIM, P(None, "fsdp", None)),
    (r".*", P()),  # norms, step counters, optimiser counts
)

SAMPLER_RULES: Rules = (
    (r"(^|/)embed$", P("tensor", None)),
    (r"(^|/)lm_head$", P(None, "tensor")),
    (_COLUMN, P(None, None, "tensor")),
    (_ROW, P(None, "tensor", None)),
    (_BIAS, P(None, "tensor")),
    (_EXPERT_IN, P(None, None, None, "tensor")),
    (_EXPERT_OUT, P(None, None, "tensor", None)),
    (r".*", P()),  # norms, the router and the shared expert's gate
)

# Every leaf of a batch (Rollout, prompts, Generation) has the batch as its first axis.
BATCH_RULES: Rules = (
    (r"(^|/)decode_steps$", P()),
    (r".*", P(BATCH_AXES)),
)

# SamplerState: rows split like the batch, KV heads over `tensor`; step and RNG replicated.
# An MoE model's routing record (cache/experts [L, B, S, k]) is split by rows like the cache.
SAMPLER_STATE_RULES: Rules = (
    (r"(^|/)cache/(k|v)$", P(None, BATCH_AXES, None, "tensor", None)),
    (r"(^|/)cache/experts$", P(None, BATCH_AXES, None, None)),
    (r"(^|/)(step|rng)$", P()),
    (r".*", P(BATCH_AXES)),
)


def path_name(path: Sequence[Any]) -> str:
  """'a/b/0/c' from a pytree key path (dict keys, attributes, sequence indices)."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def spec_for(name: str, rules: Rules) -> P:
  """The PartitionSpec of the first rule whose regex matches `name` (re.search)."""
  for pattern, spec in rules:
    if re.search(pattern, name):
      return spec
  raise ValueError(f"No partition rule matches {name!r}; add a rule for it (or a final "
                   "('.*', PartitionSpec()) catch-all) to the rules table.")


def _axis_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh, name: str = "") -> P:
  """`spec` with each mesh axis that does not divide its dimension dropped (replicated)."""
  if len(spec) > len(shape):
    raise ValueError(f"Partition rule {spec} for {name!r} has {len(spec)} entries but the leaf "
                     f"has shape {tuple(shape)}; fix the rule's rank.")
  return P(*(axes if dim % _axis_size(mesh, axes) == 0 else None
             for axes, dim in zip(spec, shape)))


def tree_specs(tree: Any, rules: Rules, mesh: Mesh | None = None) -> Any:
  """A PartitionSpec for every leaf of `tree` (arrays or ShapeDtypeStructs). With `mesh`,
  specs are fitted to the leaf shapes (`fit_spec`)."""
  def one(path, leaf):
    name = path_name(path)
    spec = spec_for(name, rules)
    shape = getattr(leaf, "shape", None)
    return spec if mesh is None or shape is None else fit_spec(spec, shape, mesh, name)
  return jax.tree_util.tree_map_with_path(one, tree)


def tree_shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """A NamedSharding on `mesh` for every leaf of `tree`, from `rules`."""
  specs = tree_specs(tree, rules, mesh)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over data x fsdp; usable as a jit in/out_shardings prefix for a whole batch."""
  return NamedSharding(mesh, P(BATCH_AXES))
