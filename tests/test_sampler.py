"""The jitted sampler: determinism, sampling distribution, recorded log-probs, stopping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from models.config import ModelConfig
from sampling import logits as logits_lib
from sampling.sampler import SamplingConfig, generate

CONFIG = ModelConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                     mlp_dim=32, qkv_bias=True, max_seq_len=32)


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.5)


def prompts():
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, CONFIG.vocab_size, (4, 5)), jnp.int32)
  mask = jnp.asarray([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 1]], bool)
  return jnp.where(mask, tokens, 0), mask


def test_greedy_is_deterministic_and_matches_argmax_of_full_forward(params):
  tokens, mask = prompts()
  config = SamplingConfig(max_new_tokens=6, temperature=0.0)
  a = generate(params, tokens, mask, jax.random.PRNGKey(1), CONFIG, config)
  b = generate(params, tokens, mask, jax.random.PRNGKey(2), CONFIG, config)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  # Each generated token is the argmax of an uncached forward over everything before it.
  full_mask = a.prompt_mask | a.completion_mask
  logits, _ = transformer.forward(params, a.tokens, transformer.positions_from_mask(full_mask),
                                  full_mask, CONFIG)
  predicted = jnp.argmax(logits[:, 4:-1], axis=-1)
  np.testing.assert_array_equal(predicted, a.tokens[:, 5:])


def test_recorded_behaviour_logprobs_equal_recomputed_forward(params):
  tokens, mask = prompts()
  for temperature in (1.0, 0.7):
    config = SamplingConfig(max_new_tokens=7, temperature=temperature, stop_tokens=(2,))
    gen = generate(params, tokens, mask, jax.random.PRNGKey(3), CONFIG, config, 5)
    full_mask = gen.prompt_mask | gen.completion_mask
    logits, _ = transformer.forward(params, gen.tokens, transformer.positions_from_mask(full_mask),
                                    full_mask, CONFIG)
    logp = transformer.token_logprobs(logits / temperature, gen.tokens)
    np.testing.assert_allclose(jnp.where(gen.completion_mask, logp, 0.0), gen.behavior_logp,
                               atol=1e-5)
    np.testing.assert_array_equal(gen.version, jnp.where(gen.completion_mask, 5, -1))


def test_temperature_sampling_frequencies_match_softmax():
  """First-token frequencies over many rows match softmax(logits / T) (chi-square bound)."""
  logits = jnp.array([2.0, 1.0, 0.0, -1.0, 0.5])
  n = 40000
  draws, logp = logits_lib.sample_tokens(jax.random.PRNGKey(0), jnp.tile(logits, (n, 1)), 0.8)
  probs = np.asarray(jax.nn.softmax(logits / 0.8))
  counts = np.bincount(np.asarray(draws), minlength=5)
  chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum()
  assert chi2 < 20.5, (counts / n, probs)  # p = 0.0004 for 4 degrees of freedom
  np.testing.assert_allclose(np.exp(logp), probs[np.asarray(draws)], rtol=1e-5)


def test_sampler_frequencies_match_model_softmax(params):
  """End to end through the jitted loop: first generated token ~ softmax of the prompt logits."""
  tokens, mask = prompts()
  rows = 4000
  t = jnp.tile(tokens[:1], (rows, 1))
  m = jnp.tile(mask[:1], (rows, 1))
  gen = generate(params, t, m, jax.random.PRNGKey(7), CONFIG, SamplingConfig(max_new_tokens=1))
  logits, _ = transformer.forward(params, tokens[:1], transformer.positions_from_mask(mask[:1]),
                                  mask[:1], CONFIG)
  probs = np.asarray(jax.nn.softmax(logits[0, -1]))
  counts = np.bincount(np.asarray(gen.tokens[:, 5]), minlength=CONFIG.vocab_size)
  expected = rows * probs
  big = expected > 5
  chi2 = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
  assert chi2 < 35.0, (counts / rows, probs)  # generous bound for <= 10 degrees of freedom


def test_greedy_tokens_match_numpy_argmax_and_log_softmax():
  """First index of the maximum (ties, NaN as in np.argmax), log softmax there; large vocab."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 49152)).astype(np.float32) * 4
  logits[1, [7, 300, 9000]] = 50.0  # a three-way tie: the first index wins
  logits[2, [11, 4000]] = np.nan  # NaN is the maximum, as in np.argmax
  logits[3] = -np.inf  # fully masked row: token 0, log-prob NaN, as log_softmax gives
  logits[4, -1] = 1e30  # one huge logit: log-prob 0
  logits[5] = 0.0  # all equal: token 0, log-prob -log V
  tokens, logp = logits_lib.greedy_tokens(jnp.asarray(logits))
  np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
  np.testing.assert_array_equal(tokens, [np.argmax(logits[0]), 7, 11, 0, 49151, 0])
  rows = [0, 1, 4, 5]
  finite = logits[rows].astype(np.float64)
  peak = finite.max(axis=-1)
  log_total = peak + np.log(np.exp(finite - peak[:, None]).sum(axis=-1))
  expected = finite[np.arange(4), np.asarray(tokens)[rows]] - log_total
  np.testing.assert_allclose(np.asarray(logp)[rows], expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(logp[5], -np.log(49152), rtol=1e-6)
  assert np.isnan(logp[2]) and np.isnan(logp[3])


def test_top_k_and_top_p_masks_match_numpy():
  logits = jnp.array([[3.0, 1.0, 2.0, 0.0, -1.0]])
  np.testing.assert_array_equal(logits_lib.top_k_mask(logits, 2)[0] > -1e30,
                                [True, False, True, False, False])
  probs = np.exp(np.array([3.0, 1.0, 2.0, 0.0, -1.0]))
  probs /= probs.sum()  # sorted: 0.665 (3.0), 0.245 (2.0), 0.090 (1.0), ...
  kept = logits_lib.top_p_mask(logits, 0.8)[0] > -1e30
  np.testing.assert_array_equal(kept, [True, False, True, False, False])
  kept = logits_lib.top_p_mask(logits, 0.5)[0] > -1e30
  np.testing.assert_array_equal(kept, [True, False, False, False, False])


def test_stop_tokens_end_rows_and_pad_after(params):
  tokens, mask = prompts()
  config = SamplingConfig(max_new_tokens=12, temperature=1.5, stop_tokens=(2, 3, 4), pad_id=0)
  gen = generate(params, tokens, mask, jax.random.PRNGKey(11), CONFIG, config)
  completion = np.asarray(gen.tokens[:, 5:])
  cmask = np.asarray(gen.completion_mask[:, 5:])
  for row, m, stopped, length in zip(completion, cmask, np.asarray(gen.stopped),
                                     np.asarray(gen.completion_len)):
    assert m[:length].all() and not m[length:].any()
    assert (row[length:] == 0).all()
    hits = np.flatnonzero(np.isin(row[:length], [2, 3, 4]))
    if stopped:
      assert list(hits) == [length - 1]
    else:
      assert len(hits) == 0 and length == 12


def test_bad_sampling_config_is_rejected():
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(max_new_tokens=4, top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    SamplingConfig(max_new_tokens=0)
