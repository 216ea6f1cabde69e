"""A Llama / Qwen2 / Qwen3 decoder, and its mixture-of-experts variants (Qwen3-MoE,
Mixtral), as pure functions of a parameter pytree.

The policy is `forward(params, tokens, positions, kv_mask, config, cache, cache_index)`:
no module objects, no hidden state, so samplers, losses and sharding rules all see the
same plain pytree. Layers are stacked along a leading axis and run under `lax.scan`.

Parameter pytree (L = n_layers, D = d_model, H/K = query/KV heads, E = head_dim,
F = mlp_dim, V = vocab_size):

  embed [V, D]
  layers/attn_norm [L, D]     layers/mlp_norm [L, D]
  layers/q [L, D, H*E]        layers/k, layers/v [L, D, K*E]     layers/o [L, H*E, D]
  layers/q_bias [L, H*E], layers/k_bias, layers/v_bias [L, K*E]     (qkv_bias only)
  layers/q_norm, layers/k_norm [L, E]                               (qk_norm only)
  layers/gate, layers/up [L, D, F]     layers/down [L, F, D]          (dense MLP)
  layers/router [L, D, X]                                             (MoE, X = num_experts)
  layers/expert_gate, layers/expert_up [L, X, D, F]   layers/expert_down [L, X, F, D]
  layers/shared_gate, layers/shared_up [L, D, S]   layers/shared_down [L, S, D]
  layers/shared_scale [L, D, 1]                       (MoE with a shared expert of width S)
  final_norm [D]
  lm_head [D, V]                                                     (untied only)

RoPE uses the "rotate half" layout of Hugging Face checkpoints; GGUF loaders undo
llama.cpp's interleaving permutation before parameters reach this module.

Mixture-of-experts models (`ModelConfig.num_experts` > 0) route each token to k experts
per block (models/moe.py). A cached forward records the experts each token used in the
cache (`cache['experts']` [L, B, S, k], `ModelConfig.expert_id_dtype`), so a sampler's
routing travels with its KV slots; an uncached forward can replay recorded experts
(`experts` [B, T, L, k], R3) and reports its own routing (`hidden_states_with_routing`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from models import moe
from models import quantize
from models.config import ModelConfig

Params = dict[str, Any]
KVCache = dict[str, jax.Array]  # {'k', 'v'}: [L, B, S, K, E]


@functools.partial(jax.jit, static_argnames=("config", "init_std"))
def init_params(config: ModelConfig, rng: jax.Array, init_std: float = 0.02) -> Params:
  """Random parameters: normal(0, init_std) matrices, unit norms, zero biases.

  The output projections (`o`, `down`) are scaled by 1/sqrt(2 * n_layers) (GPT-2 style)
  so the residual stream keeps unit scale at depth. Jitted: one compiled program instead of
  a dispatch (and a compilation) per random draw.
  """
  c = config
  dtype = c.jnp_dtype
  keys = iter(jax.random.split(rng, 14))
  out_std = init_std / (2 * c.n_layers) ** 0.5

  def normal(shape, std):
    return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

  L, D, F = c.n_layers, c.d_model, c.mlp_dim
  q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  layers = {
      "attn_norm": jnp.ones((L, D), dtype),
      "q": normal((L, D, q_width), init_std),
      "k": normal((L, D, kv_width), init_std),
      "v": normal((L, D, kv_width), init_std),
      "o": normal((L, q_width, D), out_std),
      "mlp_norm": jnp.ones((L, D), dtype),
  }
  if c.is_moe:
    X, S = c.num_experts, c.shared_expert_dim
    layers.update(router=normal((L, D, X), init_std),
                  expert_gate=normal((L, X, D, F), init_std),
                  expert_up=normal((L, X, D, F), init_std),
                  expert_down=normal((L, X, F, D), out_std))
    if S:
      layers.update(shared_gate=normal((L, D, S), init_std), shared_up=normal((L, D, S), init_std),
                    shared_down=normal((L, S, D), out_std),
                    shared_scale=normal((L, D, 1), init_std))
  else:
    layers.update(gate=normal((L, D, F), init_std), up=normal((L, D, F), init_std),
                  down=normal((L, F, D), out_std))
  if c.qkv_bias:
    layers.update(q_bias=jnp.zeros((L, q_width), dtype), k_bias=jnp.zeros((L, kv_width), dtype),
                  v_bias=jnp.zeros((L, kv_width), dtype))
  if c.qk_norm:
    layers.update(q_norm=jnp.ones((L, c.head_dim), dtype), k_norm=jnp.ones((L, c.head_dim), dtype))
  params = {"embed": normal((c.vocab_size, D), init_std), "layers": layers,
            "final_norm": jnp.ones((D,), dtype)}
  if not c.tie_embeddings:
    params["lm_head"] = normal((D, c.vocab_size), init_std)
  return params


def init_cache(config: ModelConfig, batch_size: int, max_len: int | None = None) -> KVCache:
  """An empty KV cache of `max_len` slots (default `config.max_seq_len`) per row; an MoE
  model's also holds the routing record 'experts' [L, B, S, k] (the experts each slot's
  token used in each layer)."""
  max_len = config.max_seq_len if max_len is None else max_len
  shape = (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim)
  dtype = config.compute_jnp_dtype
  cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
  if config.is_moe:
    cache["experts"] = jnp.zeros(
        (config.n_layers, batch_size, max_len, config.experts_per_token), config.expert_id_dtype)
  return cache


def compute_params(params: Params, config: ModelConfig, *,
                   keep_quantized: bool = False) -> Params:
  """`params` as a forward computes with them: every weight cast to `config.compute_dtype`
  except the RMSNorm scales (kept in their own dtype; RMSNorm computes in float32, and a
  bfloat16 scale would round away its small deviations from 1). Identity when the compute
  dtype is the parameters' dtype. Under differentiation the cast's transpose casts each
  gradient back to its parameter's dtype (mixed precision: float32 master weights).

  A quantised sampler's weights (`models.quantize.QuantizedTensor`, config.rollout.weights)
  are dequantised to the compute dtype here, or with `keep_quantized` left as they are (the
  decode layout, `unstack_layers`, dequantises them inside each step)."""
  dtype = config.compute_jnp_dtype
  if not keep_quantized:
    params = quantize.dequantize(params, dtype)

  def cast(path, leaf):
    name = str(getattr(path[-1], "key", path[-1]))
    if (quantize.is_quantized(leaf) or name.endswith("norm")
        or not jnp.issubdtype(leaf.dtype, jnp.floating)):
      return leaf
    return leaf.astype(dtype)

  leaves = jax.tree.leaves(params, is_leaf=quantize.is_quantized)
  if not any(map(quantize.is_quantized, leaves)) and all(leaf.dtype == dtype for leaf in leaves):
    return params
  return jax.tree_util.tree_map_with_path(cast, params, is_leaf=quantize.is_quantized)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float):
  """(cos, sin) [B, T, 1, E/2] of the rotary embedding at positions [B, T]."""
  half = head_dim // 2
  inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
  return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, T, N, E] rotated by `rope_angles` (rotate-half layout)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, rotate-half layout. x: [B, T, N, E]; positions: [B, T]."""
  return rotate(x, *rope_angles(positions, x.shape[-1], theta))


def attention_mask(kv_mask: jax.Array, num_queries: int, cache_index: jax.Array | int) -> jax.Array:
  """[B, T, S] boolean: query i (at slot cache_index + i) sees valid slots at or before it."""
  query_slot = cache_index + jnp.arange(num_queries)
  key_slot = jnp.arange(kv_mask.shape[1])
  causal = key_slot[None, :] <= query_slot[:, None]
  return causal[None] & kv_mask[:, None, :]


def _attention(q, k, v, mask):
  """Grouped-query attention. q [B,T,H,E], k/v [B,S,K,E], mask [B,T,S] -> [B,T,H,E]."""
  b, t, h, e = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, h // kv_heads, e)
  scores = jnp.einsum("btkge,bske->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (e ** -0.5)
  # A large finite negative (not -inf) keeps fully masked rows (left padding) finite.
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bske->btkge", probs, v)
  return out.reshape(b, t, h, e)


def _project_qkv(x, layer, positions, config: ModelConfig):
  """Pre-norm q [B,T,H,E] and k, v [B,T,K,E] of one block, RoPE applied."""
  c = config
  b, t, _ = x.shape
  h = rms_norm(x, layer["attn_norm"], c.norm_eps)
  q, k, v = h @ layer["q"], h @ layer["k"], h @ layer["v"]
  if c.qkv_bias:
    q, k, v = q + layer["q_bias"], k + layer["k_bias"], v + layer["v_bias"]
  q = q.reshape(b, t, c.n_heads, c.head_dim)
  k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
  v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
  if c.qk_norm:
    q, k = rms_norm(q, layer["q_norm"], c.norm_eps), rms_norm(k, layer["k_norm"], c.norm_eps)
  q, k = apply_rope(q, positions, c.rope_theta), apply_rope(k, positions, c.rope_theta)
  return q, k, v


@jax.custom_vjp
def swiglu(h: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
  """The SwiGLU MLP `(silu(h @ gate) * (h @ up)) @ down`, h [..., D], with a hand-written
  backward pass.

  Values and gradients are autodiff's (tests/test_transformer.py). Written out, the
  backward materialises the two pre-activation gradients in row-major [N, F] before the
  weight-gradient matmuls; under autodiff XLA:CPU fuses the silu derivative into the
  transposing copies that feed those matmuls, which made the whole model's gradient about
  2x slower (docs/benchmarks_perf.md).
  """
  return _swiglu_forward(h, gate, up, down)[0]


def _swiglu_forward(h, gate, up, down):
  """(MLP output, residuals the backward needs)."""
  pre_gate, pre_up = h @ gate, h @ up
  return (jax.nn.silu(pre_gate) * pre_up) @ down, (h, pre_gate, pre_up, gate, up, down)


def _swiglu_backward(residuals, d_out):
  h, pre_gate, pre_up, gate, up, down = residuals
  sig = jax.nn.sigmoid(pre_gate)
  silu = pre_gate * sig
  d_hidden = d_out @ down.T
  d_up = d_hidden * silu
  d_gate = d_hidden * pre_up * sig * (1 + pre_gate * (1 - sig))  # silu'(g) = s (1 + g (1 - s))
  rows = lambda a: a.reshape(-1, a.shape[-1])
  d_h = d_gate @ gate.T + d_up @ up.T
  return (d_h, rows(h).T @ rows(d_gate), rows(h).T @ rows(d_up),
          rows(silu * pre_up).T @ rows(d_out))


swiglu.defvjp(_swiglu_forward, _swiglu_backward)


class Routed(NamedTuple):
  """One MoE block's routing of tokens [B, T]: `own` [B, T, k] int32 the router's top-k
  experts, `used` [B, T, k] int32 the experts the block ran (the replayed ones under
  replay, else `own`), `logits` [B, T, X] float32 the router logits."""
  own: jax.Array
  used: jax.Array
  logits: jax.Array


class RouterStats(NamedTuple):
  """What an uncached MoE forward reports (`hidden_states_with_routing`): `experts`
  [B, T, L, k] int32 the experts each layer's own router ranks top-k at each token (under
  replay: what it would have chosen, not what it ran); `load_balancing` [L] and `z_loss`
  [L] the auxiliary losses (`moe.load_balancing_loss`, `moe.router_z_loss`) over the real
  tokens (kv_mask)."""
  experts: jax.Array
  load_balancing: jax.Array
  z_loss: jax.Array


def _moe_mlp(h, layer, config: ModelConfig, experts=None):
  """The mixture-of-experts MLP on h [B, T, D]: (output [B, T, D], `Routed`). `experts`
  [B, T, k] replays those experts (R3: `moe.replay_weights`) instead of the router's
  top-k. A shared expert (Qwen2-MoE) adds sigmoid(h @ shared_scale) x its SwiGLU."""
  c = config
  b, t, d = h.shape
  flat = h.reshape(b * t, d)
  logits = (flat @ layer["router"]).astype(jnp.float32)
  weights, own = moe.route(logits, c.experts_per_token, c.routing, c.normalize_routing)
  used = own
  if experts is not None:
    used = experts.reshape(b * t, -1).astype(jnp.int32)
    weights = moe.replay_weights(logits, used, c.routing, c.normalize_routing)
  dispatch = moe.experts_ragged if c.moe_dispatch == "ragged" else moe.experts_dense
  out = dispatch(flat, weights, used, layer["expert_gate"], layer["expert_up"],
                 layer["expert_down"])
  if c.shared_expert_dim:
    scale = jax.nn.sigmoid((flat @ layer["shared_scale"]).astype(jnp.float32))
    shared = swiglu(flat, layer["shared_gate"], layer["shared_up"], layer["shared_down"])
    out = out + (scale * shared.astype(jnp.float32)).astype(out.dtype)
  split = lambda a: a.reshape(b, t, *a.shape[1:])
  return split(out).astype(h.dtype), Routed(split(own), split(used), split(logits))


def _finish_block(x, attn, layer, config: ModelConfig, experts=None):
  """Adds the attention output [B,T,H*E] (projected) and the MLP (SwiGLU, or the MoE with
  optional replayed `experts` [B, T, k]) to the residual: (x, `Routed` or None)."""
  x = x + attn @ layer["o"]
  h = rms_norm(x, layer["mlp_norm"], config.norm_eps)
  if config.is_moe:
    out, routed = _moe_mlp(h, layer, config, experts)
    return x + out, routed
  return x + swiglu(h, layer["gate"], layer["up"], layer["down"]), None


def _block(x, layer, positions, mask, config: ModelConfig, experts=None):
  """One pre-norm decoder block without a cache: (x, `Routed` or None)."""
  b, t, _ = x.shape
  q, k, v = _project_qkv(x, layer, positions, config)
  attn = _attention(q, k, v, mask).reshape(b, t, config.n_heads * config.head_dim)
  return _finish_block(x, attn, layer, config, experts)


def _layer_stats(routed: Routed, token_mask: jax.Array):
  """One layer's part of `RouterStats`: (own experts, load-balancing loss, z-loss)."""
  logits = routed.logits.reshape(-1, routed.logits.shape[-1])
  mask = token_mask.reshape(-1)
  return (routed.own, moe.load_balancing_loss(logits, routed.used.reshape(logits.shape[0], -1), mask),
          moe.router_z_loss(logits, mask))


# Jitted (callers inside a jit inline it): eager callers — tests, notebooks — get one
# compiled program per shape instead of a compilation per operation.
@functools.partial(jax.jit, static_argnames=("config", "residual_hook"))
def forward(params: Params, tokens: jax.Array, positions: jax.Array, kv_mask: jax.Array,
            config: ModelConfig, cache: KVCache | None = None,
            cache_index: jax.Array | int = 0,
            residual_hook: Callable[[jax.Array], jax.Array] | None = None,
            experts: jax.Array | None = None,
            ) -> tuple[jax.Array, KVCache | None]:
  """Logits of every position, and the updated KV cache.

  The weights are used in `config.compute_dtype` (`compute_params`); logits are float32.

  Args:
    tokens: [B, T] token ids.
    positions: [B, T] RoPE positions of the tokens.
    kv_mask: [B, S] which key slots hold real tokens. Without a cache S = T; with a cache
      S is the cache length and the new tokens' own slots must be marked valid.
    cache: optional KV cache; the T new keys/values are written at slots
      [cache_index, cache_index + T), shared by every row.
    cache_index: first cache slot of the new tokens.
    residual_hook: optional function applied to the residual stream [B, T, D] after the
      embedding and after every block. Callers pin the activations' layout with it (a
      sharding constraint keeping rows split over the data axes); this module never
      mentions devices.
    experts: MoE only, without a cache: [B, T, L, k] experts to run at each token and
      layer instead of the router's choice (routing replay, R3; `moe.replay_weights`).

  Returns:
    logits [B, T, V] in float32, and the updated cache (None without one).
  """
  x, new_cache = hidden_states(params, tokens, positions, kv_mask, config, cache, cache_index,
                               residual_hook, experts)
  logits = jnp.einsum("btd,dv->btv", x, output_head(params, config),
                      preferred_element_type=jnp.float32)
  return logits, new_cache


def output_head(params: Params, config: ModelConfig) -> jax.Array:
  """The output projection [D, V] in the compute dtype: the transposed embedding when tied."""
  head = params["embed"].T if config.tie_embeddings else params["lm_head"]
  return head.astype(config.compute_jnp_dtype)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def hidden_states(params: Params, tokens: jax.Array, positions: jax.Array,
                  kv_mask: jax.Array, config: ModelConfig, cache: KVCache | None = None,
                  cache_index: jax.Array | int = 0,
                  residual_hook: Callable[[jax.Array], jax.Array] | None = None,
                  experts: jax.Array | None = None,
                  ) -> tuple[jax.Array, KVCache | None]:
  """`forward` up to the output projection: the final-normed residual stream [B, T, D]
  and the updated cache. Without a cache, `config.remat` rematerialises each layer in the
  backward (`REMAT_POLICIES`: 'none' keeps every activation, 'full' keeps only each
  layer's input, 'dots' also keeps the matmul outputs): the same gradients, less memory
  for more compute."""
  x, new_cache, _ = _decoder(params, tokens, positions, kv_mask, config, cache, cache_index,
                             residual_hook, experts)
  return x, new_cache


def hidden_states_with_routing(params: Params, tokens: jax.Array, positions: jax.Array,
                               kv_mask: jax.Array, config: ModelConfig,
                               residual_hook: Callable[[jax.Array], jax.Array] | None = None,
                               experts: jax.Array | None = None,
                               ) -> tuple[jax.Array, RouterStats]:
  """An MoE model's uncached `hidden_states` [B, T, D] with its `RouterStats` (the
  training forward: routing metrics and auxiliary losses). `experts` as in `forward`."""
  if not config.is_moe:
    raise ValueError("hidden_states_with_routing needs a mixture-of-experts model "
                     "(ModelConfig.num_experts > 0).")
  x, _, stats = _decoder(params, tokens, positions, kv_mask, config, None, 0, residual_hook,
                         experts)
  return x, stats


def _decoder(params, tokens, positions, kv_mask, config: ModelConfig, cache, cache_index,
             residual_hook, experts):
  """hidden_states' work: (x, new cache or None, `RouterStats` of an uncached MoE forward
  or None)."""
  c = config
  if experts is not None and (not c.is_moe or cache is not None):
    raise ValueError("Replayed experts need a mixture-of-experts model and an uncached "
                     "forward (the training forward).")
  params = compute_params(params, c)
  hook = residual_hook or (lambda x: x)
  x = hook(params["embed"][tokens].astype(c.compute_jnp_dtype))
  mask = attention_mask(kv_mask, tokens.shape[1], cache_index)

  if cache is None:
    replay = None if experts is None else jnp.moveaxis(experts, 2, 0)  # [L, B, T, k]

    def body(x, layer_and_replay):
      layer, replayed = layer_and_replay
      x, routed = _block(x, layer, positions, mask, c, replayed)
      return hook(x), (None if routed is None else _layer_stats(routed, kv_mask))
    if c.remat != "none":
      body = jax.checkpoint(body, policy=REMAT_POLICIES[c.remat])
    x, per_layer = jax.lax.scan(body, x, (params["layers"], replay))
    new_cache = None
    stats = None if per_layer is None else RouterStats(
        jnp.moveaxis(per_layer[0], 0, 2), per_layer[1], per_layer[2])
  else:
    def body(carry, layer_and_index):
      # Only the T new slots of layer i are written into the carried [L, B, S, K, E]
      # buffers (in place), rather than the whole layer slab each call.
      x, cache = carry
      layer, i = layer_and_index
      b, t, _ = x.shape
      q, k, v = _project_qkv(x, layer, positions, c)
      start = (i, 0, cache_index, 0, 0)
      cache = dict(cache)
      cache["k"] = jax.lax.dynamic_update_slice(cache["k"], k[None].astype(cache["k"].dtype), start)
      cache["v"] = jax.lax.dynamic_update_slice(cache["v"], v[None].astype(cache["v"].dtype), start)
      attn = _attention(q, cache["k"][i], cache["v"][i], mask).reshape(b, t, c.n_heads * c.head_dim)
      x, routed = _finish_block(x, attn, layer, c)
      if routed is not None:
        record = routed.used[None].astype(cache["experts"].dtype)
        cache["experts"] = jax.lax.dynamic_update_slice(cache["experts"], record,
                                                        (i, 0, cache_index, 0))
      return (hook(x), cache), None
    (x, new_cache), _ = jax.lax.scan(body, (x, dict(cache)),
                                     (params["layers"], jnp.arange(c.n_layers)))
    stats = None
  return rms_norm(x, params["final_norm"], c.norm_eps), new_cache, stats


DecodeCache = tuple  # L tuples (keys [B, K, E, S], values [B, K, S, E][, experts [B, S, k]])


def to_decode_cache(cache: KVCache, slots: int | None = None) -> DecodeCache:
  """The cache as L per-layer (keys, values) buffers in the decode layout, for decode loops.

  Keys are stored transposed, [B, K, E, S], values as [B, K, S, E]: a one-token query
  reads each layer's keys and values once per step, and these are the layouts in which
  XLA:CPU streams them (`q . k` over E with S minor, `p . v` over S with E minor; the
  other orientations measured 4-6x slower at 1k slots, docs/benchmarks_perf.md). Separate
  per-layer buffers are updated in place by `forward_decode`. An MoE model's routing
  record travels as a third buffer per layer, experts [B, S, k]. `slots`: keep only the
  first `slots` slots (a decode phase that cannot have filled more; default all).
  """
  slots = cache["k"].shape[2] if slots is None else slots
  keys = lambda a: jnp.transpose(a[:, :slots], (0, 2, 3, 1))
  values = lambda a: jnp.transpose(a[:, :slots], (0, 2, 1, 3))
  layers = []
  for i in range(cache["k"].shape[0]):
    layer = (keys(cache["k"][i]), values(cache["v"][i]))
    if "experts" in cache:
      layer += (cache["experts"][i][:, :slots],)
    layers.append(layer)
  return tuple(layers)


def from_decode_cache(cache: DecodeCache) -> KVCache:
  """Inverse of `to_decode_cache` (all slots): the stacked {'k', 'v'} [L, B, S, K, E] cache
  (and 'experts' [L, B, S, k] for an MoE model)."""
  stacked = {"k": jnp.stack([jnp.transpose(layer[0], (0, 3, 1, 2)) for layer in cache]),
             "v": jnp.stack([jnp.transpose(layer[1], (0, 2, 1, 3)) for layer in cache])}
  if len(cache[0]) == 3:
    stacked["experts"] = jnp.stack([layer[2] for layer in cache])
  return stacked


def decode_cache_prefix(cache: DecodeCache, slots: int) -> DecodeCache:
  """The first `slots` slots of every buffer of a `DecodeCache`."""
  return tuple((layer[0][..., :slots], layer[1][:, :, :slots]) + tuple(
      e[:, :slots] for e in layer[2:]) for layer in cache)


def decode_cache_put_prefix(full: DecodeCache, prefix: DecodeCache) -> DecodeCache:
  """`full` with its first slots overwritten by `prefix` (a `decode_cache_prefix`)."""
  return tuple(tuple(jax.lax.dynamic_update_slice(f, p, (0,) * f.ndim) for f, p in zip(fl, pl))
               for fl, pl in zip(full, prefix))


def unstack_layers(params: Params, config: ModelConfig, num_positions: int) -> Params:
  """params with 'layers' as a tuple of L per-layer dicts, in the layout `forward_decode`
  reads: the q, k, v projections (and biases) concatenated into one `qkv` matrix and
  gate, up into one `gate_up`, so a decode step runs two wide matmuls where it would run
  five narrow ones (at batch 64 on CPU a [D, 2F] matmul runs ~1.2x faster than two
  [D, F] ones). Adds the RoPE tables `rope_cos`, `rope_sin` [num_positions, E/2] that a
  step gathers from: computed inside the step, XLA fuses the sin and cos into each of the
  2 * L rotations and evaluates them there, per element. Done once per decode loop,
  outside it; `num_positions` must exceed every position the loop decodes at (the
  cache's slot count does: a position never exceeds its slot). The weights are cast to
  `config.compute_dtype` here too (`compute_params`): a bfloat16-compute sampler holds
  bfloat16 copies of the layers, not float32 ones. A quantised sampler's linear weights
  (`models.quantize.QuantizedTensor`) stay quantised, fused along their output channels
  with their per-channel scales, and each step dequantises them (`decode_layer`): the loop
  holds the quantised bytes, not a dequantised copy."""
  params = compute_params(params, config, keep_quantized=True)
  layers = params["layers"]
  fused = dict(layers)
  fused["qkv"] = quantize.concatenate_outputs([fused.pop("q"), fused.pop("k"), fused.pop("v")])
  if not config.is_moe:  # an MoE block's experts stay as they are
    fused["gate_up"] = quantize.concatenate_outputs([fused.pop("gate"), fused.pop("up")])
  if "q_bias" in fused:
    fused["qkv_bias"] = jnp.concatenate(
        [fused.pop("q_bias"), fused.pop("k_bias"), fused.pop("v_bias")], axis=-1)
  count = jax.tree.leaves(layers)[0].shape[0]
  cos, sin = rope_angles(jnp.arange(num_positions)[None], config.head_dim, config.rope_theta)
  return dict(params, rope_cos=cos[0, :, 0], rope_sin=sin[0, :, 0],
              layers=tuple(jax.tree.map(lambda a, i=i: a[i], fused) for i in range(count)))


def decode_layer(layer: Params, config: ModelConfig) -> Params:
  """One layer of the decode layout as a step computes with it: quantised weights
  dequantised to the compute dtype (inside the step, so the loop reads the quantised
  bytes), every other leaf as it is."""
  return quantize.dequantize(layer, config.compute_jnp_dtype)


def _fused_qkv(x, layer, cos, sin, c: ModelConfig):
  """Pre-norm q [B,T,H,E] and k, v [B,T,K,E] from the decode layout's fused `qkv`, RoPE
  applied (the cached decode and verify steps)."""
  b, t, _ = x.shape
  q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  h = rms_norm(x, layer["attn_norm"], c.norm_eps)
  qkv = h @ layer["qkv"]
  if c.qkv_bias:
    qkv = qkv + layer["qkv_bias"]
  q = qkv[..., :q_width].reshape(b, t, c.n_heads, c.head_dim)
  k = qkv[..., q_width:q_width + kv_width].reshape(b, t, c.n_kv_heads, c.head_dim)
  v = qkv[..., q_width + kv_width:].reshape(b, t, c.n_kv_heads, c.head_dim)
  if c.qk_norm:
    q, k = rms_norm(q, layer["q_norm"], c.norm_eps), rms_norm(k, layer["k_norm"], c.norm_eps)
  q, k = rotate(q, cos, sin), rotate(k, cos, sin)
  return q, k, v


def _fused_finish(x, attn, layer, c: ModelConfig):
  """Adds the attention output [B,T,H*E] (projected) and the MLP (the fused-`gate_up`
  SwiGLU, or the MoE): (x, the experts used [B, T, k] or None)."""
  x = x + attn.astype(x.dtype) @ layer["o"]
  h = rms_norm(x, layer["mlp_norm"], c.norm_eps)
  if c.is_moe:
    out, routed = _moe_mlp(h, layer, c)
    return x + out, routed.used
  gate, up = jnp.split(h @ layer["gate_up"], 2, axis=-1)
  return x + (jax.nn.silu(gate) * up) @ layer["down"], None


def _decode_block(x, layer, cos, sin, layer_cache, mask, cache_index, config: ModelConfig):
  """One block of `forward_decode`: x [B, 1, D]; returns (x, layer_cache)."""
  c = config
  layer = decode_layer(layer, c)
  b, t, _ = x.shape
  q_width = c.n_heads * c.head_dim
  cache_k, cache_v = layer_cache[:2]
  q, k, v = _fused_qkv(x, layer, cos, sin, c)
  cache_k = jax.lax.dynamic_update_slice(
      cache_k, jnp.transpose(k, (0, 2, 3, 1)).astype(cache_k.dtype), (0, 0, 0, cache_index))
  cache_v = jax.lax.dynamic_update_slice(
      cache_v, jnp.transpose(v, (0, 2, 1, 3)).astype(cache_v.dtype), (0, 0, cache_index, 0))
  # One query per row: the products are written as broadcast-multiply-and-sum, which XLA:CPU
  # fuses into one streaming pass over the cache; as dot_generals they become B*K tiny
  # matmuls (2-4x slower at 64 rows, docs/benchmarks_perf.md).
  kv_heads, e = c.n_kv_heads, c.head_dim
  qg = q[:, 0].reshape(b, kv_heads, c.n_heads // kv_heads, e).astype(jnp.float32)
  scores = jnp.sum(qg[..., None] * cache_k[:, :, None], axis=3) * (e ** -0.5)  # [B, K, G, S]
  scores = jnp.where(mask[:, None, None, 0], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  attn = jnp.sum(probs[..., None] * cache_v[:, :, None].astype(jnp.float32), axis=3)  # [B,K,G,E]
  x, used = _fused_finish(x, attn.reshape(b, t, q_width), layer, c)
  if used is None:
    return x, (cache_k, cache_v)
  record = jax.lax.dynamic_update_slice(layer_cache[2], used.astype(layer_cache[2].dtype),
                                        (0, cache_index, 0))
  return x, (cache_k, cache_v, record)


def forward_decode(params: Params, tokens: jax.Array, positions: jax.Array, kv_mask: jax.Array,
                   config: ModelConfig, cache: DecodeCache,
                   cache_index: jax.Array | int) -> tuple[jax.Array, DecodeCache]:
  """`forward` for one new token per row, with a `DecodeCache` and the decode layout of
  the layers (`unstack_layers`), unrolled.

  tokens, positions [B, 1]; otherwise the arguments and result of `forward` with a cache,
  except that the cache may hold fewer slots than kv_mask [B, S] covers: attention then
  reads only the cache's slots (the caller guarantees no later slot is filled). The
  layers run as a Python loop so each layer's KV buffers stay separate loop-carried arrays
  that XLA updates in place, and the RoPE angles are looked up once for all layers. The
  decode loop's inner step.
  """
  c = config
  chex.assert_axis_dimension(tokens, 1, 1)
  x = params["embed"][tokens].astype(c.compute_jnp_dtype)
  slots = cache[0][1].shape[2]
  mask = attention_mask(kv_mask[:, :slots], 1, cache_index)
  cos, sin = (params[name][positions][:, :, None, :] for name in ("rope_cos", "rope_sin"))
  new_cache = []
  for layer, layer_cache in zip(params["layers"], cache):
    x, layer_cache = _decode_block(x, layer, cos, sin, layer_cache, mask, cache_index, c)
    new_cache.append(layer_cache)
  x = rms_norm(x, params["final_norm"], c.norm_eps)
  logits = jnp.einsum("btd,dv->btv", x, output_head(params, c),
                      preferred_element_type=jnp.float32)
  return logits, tuple(new_cache)


def _verify_block(x, layer, cos, sin, layer_cache, mask, slots, config: ModelConfig):
  """One block of `forward_verify`: x [B, T, D], each row's T new keys and values (and
  experts used) written at its own slots [slots[b], slots[b] + T); returns (x, layer_cache)."""
  c = config
  layer = decode_layer(layer, c)
  b, t, _ = x.shape
  q_width = c.n_heads * c.head_dim
  cache_k, cache_v = layer_cache[:2]
  q, k, v = _fused_qkv(x, layer, cos, sin, c)
  put = jax.vmap(lambda buf, new, start, axis: jax.lax.dynamic_update_slice_in_dim(
      buf, new, start, axis), in_axes=(0, 0, 0, None))
  cache_k = put(cache_k, jnp.transpose(k, (0, 2, 3, 1)).astype(cache_k.dtype), slots, 2)
  cache_v = put(cache_v, jnp.transpose(v, (0, 2, 1, 3)).astype(cache_v.dtype), slots, 1)
  # As in `_decode_block`: broadcast-multiply-and-sum, one streaming pass over the cache
  # (as dot_generals these become B * K tiny matmuls, ~4x slower at 64 rows on CPU).
  kv_heads, e = c.n_kv_heads, c.head_dim
  qg = jnp.transpose(q.reshape(b, t, kv_heads, c.n_heads // kv_heads, e),
                     (0, 2, 3, 1, 4)).astype(jnp.float32)  # [B, K, G, T, E]
  scores = jnp.sum(qg[..., None] * cache_k[:, :, None, None], axis=4) * (e ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)  # [B,K,G,T,S]
  probs = jax.nn.softmax(scores, axis=-1)
  attn = jnp.sum(probs[..., None] * cache_v[:, :, None, None].astype(jnp.float32), axis=4)
  attn = jnp.transpose(attn, (0, 3, 1, 2, 4))  # [B, T, K, G, E]
  x, used = _fused_finish(x, attn.reshape(b, t, q_width), layer, c)
  if used is None:
    return x, (cache_k, cache_v)
  return x, (cache_k, cache_v, put(layer_cache[2], used.astype(layer_cache[2].dtype), slots, 0))


def forward_verify(params: Params, tokens: jax.Array, positions: jax.Array, kv_mask: jax.Array,
                   config: ModelConfig, cache: DecodeCache,
                   slots: jax.Array) -> tuple[jax.Array, DecodeCache]:
  """`forward_decode` for T new tokens per row, each row at its own cache slots: the
  forward that verifies speculative drafts (sampling/speculative.py).

  tokens, positions [B, T]; slots [B]: row b's tokens go to cache slots [slots[b],
  slots[b] + T) (the cache must have room: its slot count is >= slots + T); kv_mask
  [B, S'] the valid slots of each row, the new ones included. Query t of row b attends to
  the valid slots at or before slots[b] + t. Returns logits [B, T, V] (float32) and the
  cache with the new keys and values written.
  """
  c = config
  t = tokens.shape[1]
  x = params["embed"][tokens].astype(c.compute_jnp_dtype)
  width = cache[0][1].shape[2]
  query_slot = slots[:, None] + jnp.arange(t)[None, :]  # [B, T]
  mask = kv_mask[:, None, :width] & (jnp.arange(width)[None, None, :] <= query_slot[..., None])
  cos, sin = (params[name][positions][:, :, None, :] for name in ("rope_cos", "rope_sin"))
  new_cache = []
  for layer, layer_cache in zip(params["layers"], cache):
    x, layer_cache = _verify_block(x, layer, cos, sin, layer_cache, mask, slots, c)
    new_cache.append(layer_cache)
  x = rms_norm(x, params["final_norm"], c.norm_eps)
  logits = jnp.einsum("btd,dv->btv", x, output_head(params, c),
                      preferred_element_type=jnp.float32)
  return logits, tuple(new_cache)


def _shared_prefix_attention(q, k_prefix, v_prefix, k, v, prefix_mask, suffix_mask):
  """Attention of G continuations over their group's shared prefix plus their own keys.

  q [N,G,C,H,E]; k_prefix/v_prefix [N,P,K,E] (one copy per group, never replicated);
  k/v [N,G,C,K,E]; prefix_mask [N,P]; suffix_mask [N,G,C]. The softmax runs over the
  concatenated [prefix, own] scores, exactly as over the slots of the replicated row.
  Returns [N,G,C,H,E].
  """
  n, g, t, h, e = q.shape
  kv_heads = k.shape[-2]
  q = q.reshape(n, g, t, kv_heads, h // kv_heads, e)
  neg = jnp.finfo(jnp.float32).min
  scores_prefix = jnp.einsum("ngtkhe,nske->ngkhts", q, k_prefix,
                             preferred_element_type=jnp.float32) * (e ** -0.5)
  scores_own = jnp.einsum("ngtkhe,ngske->ngkhts", q, k,
                          preferred_element_type=jnp.float32) * (e ** -0.5)
  scores_prefix = jnp.where(prefix_mask[:, None, None, None, None, :], scores_prefix, neg)
  causal = jnp.tril(jnp.ones((t, t), bool))
  own_mask = causal[None, None] & suffix_mask[:, :, None, :]  # [N, G, C, C]
  scores_own = jnp.where(own_mask[:, :, None, None], scores_own, neg)
  probs = jax.nn.softmax(jnp.concatenate([scores_prefix, scores_own], axis=-1), axis=-1)
  probs = probs.astype(v.dtype)
  prefix_len = k_prefix.shape[1]
  out = (jnp.einsum("ngkhts,nske->ngtkhe", probs[..., :prefix_len], v_prefix)
         + jnp.einsum("ngkhts,ngske->ngtkhe", probs[..., prefix_len:], v))
  return out.reshape(n, g, t, h, e)


@functools.partial(jax.jit, static_argnames=("config",))
def forward_shared_prefix(params: Params, prefix_tokens: jax.Array, prefix_positions: jax.Array,
                          prefix_mask: jax.Array, suffix_tokens: jax.Array,
                          suffix_positions: jax.Array, suffix_mask: jax.Array,
                          config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """Logits of N groups of G sequences that share a prefix, the prefix computed once.

  Row (n, g) is the sequence prefix_tokens[n] ++ suffix_tokens[n, g]. Each layer runs the
  prefix once per group and the G suffixes attend to the shared prefix keys/values plus
  their own (causal) ones, so the result equals `forward` on the N*G replicated rows while
  the prefix costs 1/G of the compute (the prefix-shared forward of GRPO training, where
  a group's completions share one prompt). Gradients flow into the shared prefix from all
  G suffixes, as they sum over the replicated rows.

  One difference from `forward`, on outputs nothing uses: a prefix query with no visible
  key (a left-padding slot) averages uniformly over the prefix slots here, over all slots
  of its row there.

  Args:
    prefix_tokens, prefix_positions, prefix_mask: [N, P] (mask: real prefix tokens).
    suffix_tokens, suffix_positions, suffix_mask: [N, G, C].

  Returns:
    prefix logits [N, P, V] and suffix logits [N, G, C, V], float32.
  """
  c = config
  n, g, t = suffix_tokens.shape
  chex.assert_rank([prefix_tokens, prefix_positions, prefix_mask], 2)
  chex.assert_shape([suffix_positions, suffix_mask], (n, g, t))
  chex.assert_axis_dimension(prefix_tokens, 0, n)
  prefix_len = prefix_tokens.shape[1]
  params = compute_params(params, c)
  x_prefix = params["embed"][prefix_tokens].astype(c.compute_jnp_dtype)
  x_suffix = params["embed"][suffix_tokens.reshape(n * g, t)].astype(c.compute_jnp_dtype)
  prefix_attn_mask = attention_mask(prefix_mask, prefix_len, 0)
  width = c.n_heads * c.head_dim

  def body(carry, layer):
    x_prefix, x_suffix = carry
    q_p, k_p, v_p = _project_qkv(x_prefix, layer, prefix_positions, c)
    q_s, k_s, v_s = _project_qkv(x_suffix, layer, suffix_positions.reshape(n * g, t), c)
    attn_p = _attention(q_p, k_p, v_p, prefix_attn_mask).reshape(n, prefix_len, width)
    split = lambda a: a.reshape(n, g, t, *a.shape[2:])
    attn_s = _shared_prefix_attention(split(q_s), k_p, v_p, split(k_s), split(v_s), prefix_mask,
                                      suffix_mask).reshape(n * g, t, width)
    return (_finish_block(x_prefix, attn_p, layer, c)[0],
            _finish_block(x_suffix, attn_s, layer, c)[0]), None

  (x_prefix, x_suffix), _ = jax.lax.scan(body, (x_prefix, x_suffix), params["layers"])
  head = output_head(params, c)

  def logits(x):
    x = rms_norm(x, params["final_norm"], c.norm_eps)
    return jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)

  return logits(x_prefix), logits(x_suffix).reshape(n, g, t, -1)


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
  """RoPE positions for left- or right-padded rows: the count of real tokens before each."""
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=-1) - 1, 0)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """log p(tokens[:, t] | tokens[:, <t]) from next-token logits, aligned with tokens.

  logits[:, t] predicts tokens[:, t + 1]; the result's column 0 (no prediction) is 0.
  """
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0)))


def chunked_token_logprobs(x: jax.Array, head: jax.Array, tokens: jax.Array, chunk: int,
                           temperature: float = 1.0) -> jax.Array:
  """`token_logprobs(x @ head / temperature, tokens)` without the [B, T, V] logits.

  x [B, T, D] is the final-normed residual stream (`hidden_states`), head [D, V]. The
  sequence is cut into chunks of `chunk` positions (the last one padded); each chunk's
  logits exist only while its log-probs (and in the backward, its gradient) are computed,
  so the largest buffer is [B, chunk, V]. The gradient is exact (a custom VJP: for each
  chunk, d logits = g (onehot - softmax) / temperature, recomputed from x and head).
  """
  b, t, _ = x.shape
  logp = _chunked_logprobs(x[:, :-1], head, tokens[:, 1:], chunk, float(temperature or 1.0))
  return jnp.pad(logp, ((0, 0), (1, 0)))


def chunk_positions(x: jax.Array, chunk: int) -> jax.Array:
  """[B, N, ...] -> [ceil(N / chunk), B, chunk, ...], zero-padded at the end."""
  n = x.shape[1]
  pad = -n % chunk
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)


def unchunk_positions(y: jax.Array, n: int) -> jax.Array:
  """Inverse of `chunk_positions` for [C, B, chunk, ...] -> [B, n, ...]."""
  y = jnp.moveaxis(y, 0, 1)
  return y.reshape(y.shape[0], -1, *y.shape[3:])[:, :n]


def _chunk_logits(x_chunk, head, temperature):
  return jnp.einsum("btd,dv->btv", x_chunk, head, preferred_element_type=jnp.float32) / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_logprobs(x, head, targets, chunk, temperature):
  return _chunked_forward(x, head, targets, chunk, temperature)[0]


def _chunked_forward(x, head, targets, chunk, temperature):
  def one(_, pieces):
    x_c, t_c = pieces
    logits = _chunk_logits(x_c, head, temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
    return None, (picked - lse, lse)

  _, (logp, lse) = jax.lax.scan(one, None, (chunk_positions(x, chunk), chunk_positions(targets, chunk)))
  n = x.shape[1]
  return unchunk_positions(logp, n), (x, head, targets, unchunk_positions(lse, n))


def _chunked_fwd(x, head, targets, chunk, temperature):
  return _chunked_forward(x, head, targets, chunk, temperature)


def _chunked_bwd(chunk, temperature, residuals, g):
  x, head, targets, lse = residuals
  vocab = head.shape[1]

  def one(d_head, pieces):
    x_c, t_c, lse_c, g_c = pieces
    probs = jnp.exp(_chunk_logits(x_c, head, temperature) - lse_c[..., None])
    d_logits = (jax.nn.one_hot(t_c, vocab, dtype=probs.dtype) - probs) * (
        g_c[..., None] / temperature)
    d_x = jnp.einsum("btv,dv->btd", d_logits, head.astype(jnp.float32))
    d_head = d_head + jnp.einsum("btd,btv->dv", x_c.astype(jnp.float32), d_logits)
    return d_head, d_x

  d_head, d_x = jax.lax.scan(
      one, jnp.zeros(head.shape, jnp.float32),
      (chunk_positions(x, chunk), chunk_positions(targets, chunk), chunk_positions(lse, chunk), chunk_positions(g, chunk)))
  return (unchunk_positions(d_x, x.shape[1]).astype(x.dtype), d_head.astype(head.dtype),
          None)


_chunked_logprobs.defvjp(_chunked_fwd, _chunked_bwd)


@functools.partial(jax.jit, static_argnames=("config",))
def sequence_logprobs(params: Params, tokens: jax.Array, token_mask: jax.Array,
                      config: ModelConfig) -> jax.Array:
  """Per-token log-probs [B, T] of padded sequences (one uncached forward pass)."""
  logits, _ = forward(params, tokens, positions_from_mask(token_mask), token_mask, config)
  return token_logprobs(logits, tokens)
