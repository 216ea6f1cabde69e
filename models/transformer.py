"""A Llama / Qwen2 / Qwen3 decoder as pure functions of a parameter pytree.

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
  layers/gate, layers/up [L, D, F]     layers/down [L, F, D]
  final_norm [D]
  lm_head [D, V]                                                     (untied only)

RoPE uses the "rotate half" layout of Hugging Face checkpoints; GGUF loaders undo
llama.cpp's interleaving permutation before parameters reach this module.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.config import ModelConfig

Params = dict[str, Any]
KVCache = dict[str, jax.Array]  # {'k', 'v'}: [L, B, S, K, E]


def init_params(config: ModelConfig, rng: jax.Array, init_std: float = 0.02) -> Params:
  """Random parameters: normal(0, init_std) matrices, unit norms, zero biases.

  The output projections (`o`, `down`) are scaled by 1/sqrt(2 * n_layers) (GPT-2 style)
  so the residual stream keeps unit scale at depth.
  """
  c = config
  dtype = c.jnp_dtype
  keys = iter(jax.random.split(rng, 9))
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
      "gate": normal((L, D, F), init_std),
      "up": normal((L, D, F), init_std),
      "down": normal((L, F, D), out_std),
  }
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
  """An empty KV cache of `max_len` slots (default `config.max_seq_len`) per row."""
  max_len = config.max_seq_len if max_len is None else max_len
  shape = (config.n_layers, batch_size, max_len, config.n_kv_heads, config.head_dim)
  return {"k": jnp.zeros(shape, config.jnp_dtype), "v": jnp.zeros(shape, config.jnp_dtype)}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding, rotate-half layout. x: [B, T, N, E]; positions: [B, T]."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


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


def _block(x, layer, positions, mask, config: ModelConfig, cache_kv, cache_index):
  """One pre-norm decoder block. Returns the new residual and this layer's (k, v) slots."""
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
  if cache_kv is not None:
    cache_k, cache_v = cache_kv
    k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), cache_index, axis=1)
    v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), cache_index, axis=1)
  attn = _attention(q, k, v, mask).reshape(b, t, c.n_heads * c.head_dim)
  x = x + attn @ layer["o"]
  h = rms_norm(x, layer["mlp_norm"], c.norm_eps)
  x = x + (jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]
  return x, (k, v)


def forward(params: Params, tokens: jax.Array, positions: jax.Array, kv_mask: jax.Array,
            config: ModelConfig, cache: KVCache | None = None,
            cache_index: jax.Array | int = 0,
            residual_hook: Callable[[jax.Array], jax.Array] | None = None,
            ) -> tuple[jax.Array, KVCache | None]:
  """Logits of every position, and the updated KV cache.

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

  Returns:
    logits [B, T, V] in float32, and the updated cache (None without one).
  """
  c = config
  hook = residual_hook or (lambda x: x)
  x = hook(params["embed"][tokens].astype(c.jnp_dtype))
  mask = attention_mask(kv_mask, tokens.shape[1], cache_index)

  if cache is None:
    def body(x, layer):
      x, _ = _block(x, layer, positions, mask, c, None, 0)
      return hook(x), None
    x, _ = jax.lax.scan(body, x, params["layers"])
    new_cache = None
  else:
    def body(carry, layer_and_index):
      x, cache_k, cache_v = carry
      layer, i = layer_and_index
      kv = (cache_k[i], cache_v[i])
      x, (k, v) = _block(x, layer, positions, mask, c, kv, cache_index)
      x = hook(x)
      cache_k = jax.lax.dynamic_update_index_in_dim(cache_k, k, i, axis=0)
      cache_v = jax.lax.dynamic_update_index_in_dim(cache_v, v, i, axis=0)
      return (x, cache_k, cache_v), None
    (x, new_k, new_v), _ = jax.lax.scan(
        body, (x, cache["k"], cache["v"]), (params["layers"], jnp.arange(c.n_layers)))
    new_cache = {"k": new_k, "v": new_v}

  x = rms_norm(x, params["final_norm"], c.norm_eps)
  head = params["embed"].T if c.tie_embeddings else params["lm_head"]
  logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
  return logits, new_cache


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


def sequence_logprobs(params: Params, tokens: jax.Array, token_mask: jax.Array,
                      config: ModelConfig) -> jax.Array:
  """Per-token log-probs [B, T] of padded sequences (one uncached forward pass)."""
  logits, _ = forward(params, tokens, positions_from_mask(token_mask), token_mask, config)
  return token_logprobs(logits, tokens)
