"""The decoder against a slow NumPy reference, and cached decoding against a full pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from models.config import ModelConfig, get_preset
from tests import tiny

CONFIGS = {
    "llama_gqa_tied": tiny.MODEL,
    "qwen2_bias_untied": tiny.model(n_heads=4, head_dim=8, qkv_bias=True, tie_embeddings=False,
                                    rope_theta=1e6),
    "qwen3_qk_norm": tiny.model(n_kv_heads=2, qk_norm=True),
}


def random_params(config, seed=0):
  """Large random weights, norms and biases, so errors show in the logits."""
  params = transformer.init_params(config, jax.random.PRNGKey(seed), init_std=0.3)
  rng = np.random.default_rng(seed)
  def perturb(path, x):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      return jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
    if "bias" in name:
      return jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(perturb, params)


def numpy_forward(params, tokens, config):
  """Slow, independent reference: one sequence [T], no padding, float64."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  c = config
  t = len(tokens)
  x = p["embed"][tokens]
  pos = np.arange(t)

  def norm(v, scale):
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + c.norm_eps) * scale

  def rope(v):  # v [T, N, E], rotate-half
    e = v.shape[-1]
    inv = c.rope_theta ** (-np.arange(0, e, 2) / e)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    v1, v2 = v[..., : e // 2], v[..., e // 2:]
    return np.concatenate([v1 * cos - v2 * sin, v2 * cos + v1 * sin], axis=-1)

  for i in range(c.n_layers):
    lp = {k: v[i] for k, v in p["layers"].items()}
    h = norm(x, lp["attn_norm"])
    q, k, v = h @ lp["q"], h @ lp["k"], h @ lp["v"]
    if c.qkv_bias:
      q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
    q = q.reshape(t, c.n_heads, c.head_dim)
    k = k.reshape(t, c.n_kv_heads, c.head_dim)
    v = v.reshape(t, c.n_kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = norm(q, lp["q_norm"]), norm(k, lp["k_norm"])
    q, k = rope(q), rope(k)
    out = np.zeros((t, c.n_heads, c.head_dim))
    group = c.n_heads // c.n_kv_heads
    for head in range(c.n_heads):
      kh, vh = k[:, head // group], v[:, head // group]
      scores = q[:, head] @ kh.T / np.sqrt(c.head_dim)
      scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
      w = np.exp(scores - scores.max(axis=-1, keepdims=True))
      out[:, head] = (w / w.sum(axis=-1, keepdims=True)) @ vh
    x = x + out.reshape(t, -1) @ lp["o"]
    h = norm(x, lp["mlp_norm"])
    gate = h @ lp["gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ lp["up"])) @ lp["down"]
  x = norm(x, p["final_norm"])
  head = p["embed"].T if c.tie_embeddings else p["lm_head"]
  return x @ head


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_matches_numpy_reference(name):
  config = CONFIGS[name]
  params = random_params(config)
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 9))
  mask = jnp.ones(tokens.shape, bool)
  logits, _ = transformer.forward(params, jnp.asarray(tokens), transformer.positions_from_mask(mask),
                                  mask, config)
  for row in range(2):
    expected = numpy_forward(params, tokens[row], config)
    np.testing.assert_allclose(logits[row], expected, atol=2e-4, rtol=2e-4)


def test_left_padding_does_not_change_logits():
  config = CONFIGS["qwen2_bias_untied"]
  params = random_params(config)
  tokens = jnp.asarray(np.random.default_rng(2).integers(3, config.vocab_size, (1, 7)))
  padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), tokens], axis=1)
  pad_mask = jnp.arange(10)[None] >= 3
  full, _ = transformer.forward(params, tokens, transformer.positions_from_mask(jnp.ones((1, 7), bool)),
                                jnp.ones((1, 7), bool), config)
  left, _ = transformer.forward(params, padded, transformer.positions_from_mask(pad_mask), pad_mask, config)
  np.testing.assert_allclose(left[:, 3:], full, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decoding_matches_uncached_forward(name):
  """Prefill 5 tokens, then feed 4 more one at a time through the KV cache."""
  config = CONFIGS[name]
  params = random_params(config, seed=3)
  batch, prefix, total = 3, 5, 9
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, config.vocab_size, (batch, total)))
  mask = jnp.ones((batch, total), bool)
  positions = transformer.positions_from_mask(mask)
  reference, _ = transformer.forward(params, tokens, positions, mask, config)

  cache = transformer.init_cache(config, batch, total)
  kv_mask = jnp.arange(total)[None].repeat(batch, 0) < prefix
  logits, cache = transformer.forward(params, tokens[:, :prefix], positions[:, :prefix], kv_mask,
                                      config, cache=cache, cache_index=0)
  steps = [logits]
  for i in range(prefix, total):
    kv_mask = kv_mask.at[:, i].set(True)
    logits, cache = transformer.forward(params, tokens[:, i:i + 1], positions[:, i:i + 1], kv_mask,
                                        config, cache=cache, cache_index=i)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), reference, atol=1e-4, rtol=1e-4)


def test_token_logprobs_alignment():
  logits = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
  tokens = jnp.array([[0, 1, 0]])
  np.testing.assert_allclose(transformer.token_logprobs(logits, tokens),
                             [[0.0, np.log(0.5), np.log(0.9)]], rtol=1e-6)


def test_inconsistent_config_is_rejected():
  with pytest.raises(ValueError, match="multiple of n_kv_heads"):
    ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=4, mlp_dim=8)
  with pytest.raises(ValueError, match="Unknown model preset"):
    get_preset("gpt5")


def test_swiglu_backward_equals_autodiff():
  """The hand-written SwiGLU backward gives autodiff's gradients (leading dims [2, 3, 5])."""
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  h = jax.random.normal(keys[0], (2, 3, 5, 8))
  gate, up = (0.3 * jax.random.normal(k, (8, 16)) for k in keys[1:3])
  down = 0.3 * jax.random.normal(keys[3], (16, 8))
  weight = jax.random.normal(keys[4], (2, 3, 5, 8))  # a non-uniform cotangent
  plain = lambda h, g, u, d: ((jax.nn.silu(h @ g) * (h @ u)) @ d * weight).sum()
  custom = lambda h, g, u, d: (transformer.swiglu(h, g, u, d) * weight).sum()
  np.testing.assert_allclose(custom(h, gate, up, down), plain(h, gate, up, down), rtol=1e-6)
  expected = jax.grad(plain, argnums=(0, 1, 2, 3))(h, gate, up, down)
  got = jax.grad(custom, argnums=(0, 1, 2, 3))(h, gate, up, down)
  for g, e in zip(got, expected):
    assert g.shape == e.shape
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
