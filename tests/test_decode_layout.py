"""The decode-loop layout (per-layer KV buffers, keys [B, K, E, S], unrolled layers) computes what
the stacked, scanned forward computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from sampling import sampler
from tests import tiny

CONFIGS = {
    "qwen2": tiny.model(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, qkv_bias=True,
                        tie_embeddings=False),
    "qwen3": tiny.model(n_kv_heads=2, qk_norm=True),
}


def test_decode_cache_round_trips():
  cache = transformer.init_cache(CONFIGS["qwen2"], 2, 7)
  cache = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(0), a.shape), cache)
  decode_cache = transformer.to_decode_cache(cache)
  assert len(decode_cache) == 3
  assert decode_cache[0][0].shape == (2, 2, 8, 7)  # keys [B, K, E, S]
  assert decode_cache[0][1].shape == (2, 2, 7, 8)  # values [B, K, S, E]
  back = transformer.from_decode_cache(decode_cache)
  for name in ("k", "v"):
    np.testing.assert_array_equal(back[name], cache[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.slow
def test_forward_decode_equals_stacked_cached_forward(name):
  """Prefill 4 left-padded tokens, then decode 3 one at a time both ways."""
  config = CONFIGS[name]
  params = transformer.init_params(config, jax.random.PRNGKey(1), init_std=0.3)
  batch, prefix, total = 3, 4, 7
  tokens = jnp.asarray(np.random.default_rng(2).integers(3, config.vocab_size, (batch, total)))
  mask = jnp.asarray(np.arange(total)[None] >= np.array([[0], [1], [3]]))  # left padding
  positions = transformer.positions_from_mask(mask)
  kv_mask = mask & (jnp.arange(total) < prefix)
  cache = transformer.init_cache(config, batch, total)
  _, cache = transformer.forward(params, tokens[:, :prefix], positions[:, :prefix], kv_mask,
                                 config, cache=cache, cache_index=0)
  layers = transformer.unstack_layers(params, config, total)
  decode_cache = transformer.to_decode_cache(cache)
  for i in range(prefix, total):
    kv_mask = kv_mask.at[:, i].set(True)
    args = (tokens[:, i:i + 1], positions[:, i:i + 1], kv_mask, config)
    expected, cache = transformer.forward(params, *args, cache=cache, cache_index=i)
    got, decode_cache = transformer.forward_decode(layers, *args, decode_cache, i)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
  back = transformer.from_decode_cache(decode_cache)
  for key in ("k", "v"):
    np.testing.assert_allclose(back[key], cache[key], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_decode_loop_equals_repeated_decode_step():
  """`sampler.decode` (decode layout inside a while loop) == `decode_step` applied N times
  (stacked cache): the same tokens, behaviour log-probs, stop flags and final cache."""
  config = CONFIGS["qwen2"]
  params = transformer.init_params(config, jax.random.PRNGKey(3), init_std=0.3)
  sampling_config = sampler.SamplingConfig(max_new_tokens=5, temperature=1.0, stop_tokens=(4,))
  prompt = jnp.asarray(np.random.default_rng(4).integers(3, config.vocab_size, (3, 4)))
  prompt_mask = jnp.asarray(np.arange(4)[None] >= np.array([[0], [1], [2]]))
  state = sampler.prefill(params, prompt, prompt_mask, jax.random.PRNGKey(5), config,
                          sampling_config)
  version = jnp.int32(7)
  looped = sampler.decode(params, state, version, config, sampling_config, max_steps=3)
  stepped = state
  for _ in range(3):
    stepped = sampler.decode_step(params, stepped, version, config, sampling_config)
  for field in ("tokens", "token_mask", "version", "done", "step", "next_position"):
    np.testing.assert_array_equal(getattr(looped, field), getattr(stepped, field), err_msg=field)
  np.testing.assert_allclose(looped.behavior_logp, stepped.behavior_logp, atol=1e-5)
  for key in ("k", "v"):
    np.testing.assert_allclose(looped.cache[key], stepped.cache[key], atol=1e-5)
  generated = np.asarray(looped.token_mask)[:, 4:]
  assert int(looped.step) == 3 and generated.any()
  assert (np.asarray(looped.version)[:, 4:][generated] == 7).all()
