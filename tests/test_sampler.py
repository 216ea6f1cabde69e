"""The jitted sampler: determinism, sampling distribution, recorded log-probs, stopping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from sampling import logits as logits_lib
from sampling.sampler import SamplingConfig, generate
from tests import tiny

CONFIG = tiny.model(vocab_size=11, qkv_bias=True)  # a small vocabulary: sampled counts per token


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


@pytest.mark.slow
def test_recorded_behaviour_logprobs_equal_recomputed_forward(params):
  tokens, mask = prompts()
  for temperature in (1.0, 0.7):
    config = SamplingConfig(max_new_tokens=7, temperature=temperature, stop_tokens=(2,))
    gen = generate(params, tokens, mask, jax.random.PRNGKey(3), CONFIG, config, 5)
    full_mask = gen.prompt_mask | gen.completion_mask
    logits, _ = transformer.forward(params, gen.tokens, transformer.positions_from_mask(full_mask),
                                    full_mask, CONFIG)
    logp = transformer.token_logprobs(logits / temperature, gen.tokens)
    # float32 summed in another order (the cached decode against one forward): 1.5e-5 apart
    # here; a wrong temperature or truncation is 1e-2 or more away.
    np.testing.assert_allclose(jnp.where(gen.completion_mask, logp, 0.0), gen.behavior_logp,
                               atol=5e-5)
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


def truncated_logp_reference(logits, temperature, top_k=0, top_p=1.0):
  """Slow NumPy (float64) log-probs [V] of the distribution a row is drawn from, -inf off
  it: softmax(logits / T); keep the top_k largest (every token tied with the k-th kept);
  renormalise; keep the nucleus, the shortest prefix in descending order whose mass reaches
  top_p (every token tied with its last one kept); renormalise."""
  z = np.asarray(logits, np.float64) / temperature
  keep = np.ones(z.shape, bool)
  if 0 < top_k < z.size:
    keep &= z >= np.sort(z)[::-1][top_k - 1]
  if top_p < 1.0:
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    order = np.argsort(-z, kind="stable")
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep &= z >= z[order][mass_before < top_p].min()
  weights = np.where(keep, np.exp(z - z.max()), 0.0)
  with np.errstate(divide="ignore"):
    return np.log(weights) - np.log(weights.sum())


# (logits, temperature, top_k, top_p), each away from a float32 rounding boundary of p.
TRUNCATION_CASES = [
    ([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], 0.7, 2, 1.0),  # top-k at a temperature
    ([2.0, 2.0, 1.0, 0.0, -1.0, 0.5], 1.0, 1, 1.0),  # top_k = 1 keeps both tied maxima
    ([3.0, 1.0, 2.0, 0.0, -1.0, 0.2], 1.0, 1, 1.0),  # top_k = 1: one token, log-prob 0
    ([3.0, 1.0, 2.0, 0.0, -1.0, 0.2], 1.3, 6, 1.0),  # top_k >= V: the full softmax
    ([3.0, 1.0, 2.0, 0.0, -1.0, 0.2], 1.3, 9, 1.0),
    ([3.0, 1.0, 2.0, 0.0, -1.0, 0.2], 1.0, 0, 0.05),  # top_p keeps one token
    ([3.0, 1.0, 1.0, 0.0, -2.0, -1.0], 1.0, 0, 0.8),  # the nucleus ends in a tie: both kept
    ([1.0, 0.9, 0.8, 0.7, 0.0, -0.5], 0.5, 0, 0.9),  # nucleus at a temperature
    ([2.0, 1.5, 1.0, 0.5, 0.0, -0.5], 0.8, 4, 0.7),  # top-k, then the nucleus of what is left
]


@pytest.mark.parametrize("logits,temperature,top_k,top_p", TRUNCATION_CASES)
def test_truncated_sampling_records_the_logprob_it_draws_with(logits, temperature, top_k, top_p):
  """With top-k / top-p the behaviour log-prob is log of the truncated, renormalised
  distribution at T (the probability the token was drawn with), tokens off it are never
  drawn, and the draws follow it (chi-square)."""
  n = 20000
  reference = truncated_logp_reference(logits, temperature, top_k, top_p)
  tokens, logp = logits_lib.sample_tokens(jax.random.PRNGKey(5), jnp.tile(jnp.asarray(
      logits, jnp.float32), (n, 1)), temperature, top_k, top_p)
  tokens = np.asarray(tokens)
  kept = np.isfinite(reference)
  assert kept[tokens].all(), (np.unique(tokens), np.flatnonzero(kept))
  np.testing.assert_allclose(np.asarray(logp), reference[tokens], rtol=0, atol=2e-6)
  probs = np.exp(reference)
  counts = np.bincount(tokens, minlength=len(logits))
  if kept.sum() > 1:
    chi2 = ((counts[kept] - n * probs[kept]) ** 2 / (n * probs[kept])).sum()
    assert chi2 < 25.0, (counts / n, probs)  # p < 1e-4 for <= 5 degrees of freedom


def test_sampler_records_truncated_behaviour_logprobs(params):
  """End to end through the jitted decode loop with top-k and top-p: every recorded
  log-prob is the NumPy truncated log-prob of an uncached forward's logits at that slot."""
  tokens, mask = prompts()
  config = SamplingConfig(max_new_tokens=7, temperature=0.8, top_k=4, top_p=0.85)
  gen = generate(params, tokens, mask, jax.random.PRNGKey(3), CONFIG, config)
  full_mask = gen.prompt_mask | gen.completion_mask
  logits, _ = transformer.forward(params, gen.tokens, transformer.positions_from_mask(full_mask),
                                  full_mask, CONFIG)
  logits, completion = np.asarray(logits), np.asarray(gen.completion_mask)
  checked = 0
  for row, slot in zip(*np.nonzero(completion)):
    reference = truncated_logp_reference(logits[row, slot - 1], 0.8, 4, 0.85)
    token = int(gen.tokens[row, slot])
    assert np.isfinite(reference[token]), (row, slot)
    # float32, the cached decode against an uncached forward: sums in another order
    # (1.9e-5 apart at most here; a wrong temperature or truncation is 1e-2 or more).
    np.testing.assert_allclose(float(gen.behavior_logp[row, slot]), reference[token], atol=5e-5)
    checked += reference[token] != 0.0  # a row with one kept token says nothing
  assert checked > 4


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
