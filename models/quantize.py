"""Weight-only quantisation of a policy's linear layers, for low-precision rollouts.

A sampler that reads int8 or fp8 weights moves a quarter of float32's bytes per decode
step; the behaviour log-probs it records are the quantised policy's, so the trainer's
ratio exp(logp - behav) sees the gap (config.rollout.weights; TIS, MIS and score centering
correct it).

Formats (`FORMATS`), each symmetric with one scale per output channel, s = max|w| / q_max
over the contraction axis (-2 of every linear weight here: x @ w), and values round(w / s):

  bfloat16  the weights rounded to bfloat16 (no scale)
  int8      int8 values in [-127, 127]
  fp8       float8_e4m3fn values in [-448, 448] (the cast rounds to nearest even)
  int4      int4 values in [-7, 7]: a coarse stress setting, 16x fewer levels than int8

What is quantised: the decoder layers' linear weights (`QUANTIZED_WEIGHTS`: attention q,
k, v, o; the MLP's gate, up, down; an MoE block's experts and shared expert). What is not:
embeddings and the output head, RMSNorm scales, biases and the MoE router, as in the
weight-only schemes of vLLM, FlashRL and QuRL (the router's few bytes decide the routing;
the head decides every log-prob). Activations and the KV cache stay in the model's compute
dtype: a forward dequantises each weight to that dtype (`dequantize`), so this is the
numerics of a weight-only kernel (w_q * s in the compute dtype, then the matmul).

A channel of zeros gets scale 1 (its values are 0), never a division by zero.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

QUANTIZED_WEIGHTS = frozenset({
    "q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down",
    "shared_gate", "shared_up", "shared_down"})


@dataclasses.dataclass(frozen=True)
class Format:
  """A weight format: the stored dtype and the largest magnitude a value takes (0: a plain
  cast, no scale)."""
  dtype: Any
  q_max: float = 0.0

  @property
  def scaled(self) -> bool:
    return self.q_max > 0


FORMATS = {
    "bfloat16": Format(jnp.bfloat16),
    "int8": Format(jnp.int8, 127.0),
    "fp8": Format(jnp.float8_e4m3fn, 448.0),
    "int4": Format(jnp.int4, 7.0),
}


@flax.struct.dataclass
class QuantizedTensor:
  """A weight stored as `values` (the format's dtype, the weight's shape) times `scale`
  (float32, the weight's shape with the contraction axis -2 reduced to 1; None for an
  unscaled format: bfloat16 values are the weight)."""
  values: jax.Array
  scale: jax.Array | None = None

  @property
  def shape(self):
    return self.values.shape

  def dequantize(self, dtype) -> jax.Array:
    """values * scale, computed in float32 and cast to `dtype`."""
    if self.scale is None:
      return self.values.astype(dtype)
    return (self.values.astype(jnp.float32) * self.scale).astype(dtype)


def get_format(name: str) -> Format:
  """The `Format` called `name`, or a ValueError naming the choices."""
  if name not in FORMATS:
    raise ValueError(f"Unknown weight format {name!r} (config.rollout.weights): choose one of "
                     f"{sorted(FORMATS)} or '' (the trainer's weights as they are).")
  return FORMATS[name]


def quantize_tensor(w: jax.Array, fmt: Format) -> QuantizedTensor:
  """w [..., in, out] in `fmt`: per-output-channel symmetric quantisation (module
  docstring), or a plain cast for an unscaled format (scale None)."""
  if not fmt.scaled:
    return QuantizedTensor(values=w.astype(fmt.dtype))
  w32 = w.astype(jnp.float32)
  peak = jnp.max(jnp.abs(w32), axis=-2, keepdims=True)
  scale = jnp.where(peak > 0, peak / fmt.q_max, 1.0)
  scaled = jnp.clip(w32 / scale, -fmt.q_max, fmt.q_max)
  if jnp.issubdtype(fmt.dtype, jnp.integer):
    scaled = jnp.round(scaled)
  return QuantizedTensor(values=scaled.astype(fmt.dtype), scale=scale)


def quantize_params(params: dict, name: str) -> dict:
  """`params` with the decoder layers' linear weights (`QUANTIZED_WEIGHTS`) in format
  `name`; everything else unchanged. Pure and jittable: the launcher runs it once per
  parameter publish (rl.loop.LoopContext.publish)."""
  fmt = get_format(name)
  layers = {key: quantize_tensor(value, fmt) if key in QUANTIZED_WEIGHTS else value
            for key, value in params["layers"].items()}
  return dict(params, layers=layers)


def is_quantized(leaf) -> bool:
  return isinstance(leaf, QuantizedTensor)


def dequantize(params: Any, dtype) -> Any:
  """Every `QuantizedTensor` in `params` as a `dtype` array; other leaves unchanged (and
  `params` itself when it holds none)."""
  if not any(map(is_quantized, jax.tree.leaves(params, is_leaf=is_quantized))):
    return params
  return jax.tree.map(lambda leaf: leaf.dequantize(dtype) if is_quantized(leaf) else leaf,
                      params, is_leaf=is_quantized)


def concatenate_outputs(weights: list) -> Any:
  """Weights [..., in, out_i] concatenated along their output channels: arrays as arrays,
  `QuantizedTensor`s with their per-channel scales (a channel keeps its own scale)."""
  if all(map(is_quantized, weights)):
    scales = [w.scale for w in weights]
    return QuantizedTensor(
        values=jnp.concatenate([w.values for w in weights], axis=-1),
        scale=None if scales[0] is None else jnp.concatenate(scales, axis=-1))
  return jnp.concatenate(weights, axis=-1)


def weight_bytes(params: Any) -> int:
  """Bytes the leaves of `params` occupy (int4 counted as half a byte per value)."""
  total = 0
  for leaf in jax.tree.leaves(params):
    bits = 4 if leaf.dtype == jnp.int4 else 8 * leaf.dtype.itemsize
    total += leaf.size * bits // 8
  return total
