"""Decode cost that follows the generated tokens: phased attention and live-row compaction
give exactly what one full-width, full-length loop gives; the inverse-CDF draw samples the
softmax; greedy decoding uses no randomness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from sampling import logits as logits_lib
from sampling import sampler
from tests import tiny

CONFIG = tiny.model(vocab_size=29, qkv_bias=True, tie_embeddings=False, max_seq_len=1024)
ONE_LOOP = dict(phase_tokens=0, compact_min_rows=0)


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.4)


def left_padded_prompts(batch: int, length: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(3, CONFIG.vocab_size, (batch, length)), jnp.int32)
  pads = rng.integers(0, length, batch)
  mask = jnp.asarray(np.arange(length)[None] >= pads[:, None])
  return jnp.where(mask, tokens, 0), mask


def run_decode(params, prompt, mask, sampling_config, position_limit=None, seed=5):
  state = sampler.prefill(params, prompt, mask, jax.random.PRNGKey(seed), CONFIG, sampling_config)
  decode = jax.jit(lambda p, s, lim: sampler.decode(p, s, jnp.int32(3), CONFIG, sampling_config,
                                                      position_limit=lim))
  return decode(params, state, position_limit)


def assert_same_states(got, want, atol=1e-5):
  """Equal sequences, flags and positions; next-token logits of running rows; the KV of
  every real token. (A stopped row's later slots are padding that a full-width loop keeps
  computing and a compacted one skips: masked out of attention, never read.)"""
  for field in ("tokens", "token_mask", "version", "done", "step", "next_position"):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=atol)
  running = ~np.asarray(want.done)
  np.testing.assert_allclose(np.asarray(got.next_logits)[running],
                             np.asarray(want.next_logits)[running], atol=1e-4)
  real = np.asarray(want.token_mask)[None, :, :, None, None]
  for key in ("k", "v"):
    np.testing.assert_allclose(np.where(real, got.cache[key], 0), np.where(real, want.cache[key], 0),
                               atol=atol)


def test_phase_ends_and_widths():
  assert sampler.phase_ends(12, 0) == [12]
  assert sampler.phase_ends(12, 16) == [12]
  assert sampler.phase_ends(12, 2) == [2, 4, 8, 12]
  assert sampler.phase_ends(1024, 32) == [32, 64, 128, 256, 512, 1024]
  assert sampler.phase_ends(64, 32) == [32, 64]
  assert sampler.compaction_widths(64, 8) == [64, 32, 16]
  assert sampler.compaction_widths(16, 8) == [16, 8]
  assert sampler.compaction_widths(12, 8) == [12]
  assert sampler.compaction_widths(4, 8) == [4]
  assert sampler.compaction_widths(64, 0) == [64]
  assert sampler.compaction_widths(5, 1) == [5, 2, 1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow
def test_phased_compacted_decode_equals_one_full_width_loop(params, temperature):
  """Rows stop at very different steps (stop tokens and per-row length budgets), so later
  phases run narrowed; every token, log-prob, flag and cache slot is the one-loop result."""
  prompt, mask = left_padded_prompts(8, 5)
  stops = dict(stop_tokens=(4, 5), max_new_tokens=13, temperature=temperature)
  budget = mask.sum(axis=1) + jnp.asarray([1, 2, 3, 13, 13, 2, 1, 6])  # RoPE positions
  want = run_decode(params, prompt, mask, sampler.SamplingConfig(**stops, **ONE_LOOP), budget)
  lengths = np.asarray(want.token_mask[:, 5:].sum(axis=1))
  assert len(set(lengths.tolist())) >= 3, lengths  # a long-tailed batch
  configs = [dict(phase_tokens=2, compact_min_rows=1)]
  if temperature:
    configs.append(dict(phase_tokens=3, compact_min_rows=0))  # phases without narrowing
  for phased in configs:
    got = run_decode(params, prompt, mask, sampler.SamplingConfig(**stops, **phased), budget)
    assert_same_states(got, want)


@pytest.mark.slow
def test_phased_decode_equals_repeated_decode_step(params):
  """The loop with phases and compaction == `decode_step` (stacked cache, full width) N times."""
  prompt, mask = left_padded_prompts(4, 4, seed=2)
  config = sampler.SamplingConfig(max_new_tokens=9, temperature=1.0, stop_tokens=(4,),
                                  phase_tokens=2, compact_min_rows=1)
  state = sampler.prefill(params, prompt, mask, jax.random.PRNGKey(9), CONFIG, config)
  looped = jax.jit(lambda p, s: sampler.decode(p, s, jnp.int32(1), CONFIG, config))(params, state)
  step = jax.jit(lambda p, s: sampler.decode_step(p, s, jnp.int32(1), CONFIG, config))
  stepped = state
  for _ in range(int(looped.step)):
    stepped = step(params, stepped)
  assert_same_states(looped, stepped)


@pytest.mark.slow
def test_resume_mid_loop_and_max_steps(params):
  """A loop stopped by max_steps in the middle of a phase and resumed gives the one-pass
  result (phases already passed run no step)."""
  prompt, mask = left_padded_prompts(8, 5, seed=3)
  config = sampler.SamplingConfig(max_new_tokens=12, temperature=1.0, stop_tokens=(4, 7),
                                  phase_tokens=2, compact_min_rows=2)
  state = sampler.prefill(params, prompt, mask, jax.random.PRNGKey(4), CONFIG, config)
  decode = jax.jit(lambda p, s, n: sampler.decode(p, s, jnp.int32(0), CONFIG, config, max_steps=n))
  whole = decode(params, state, 12)
  first = decode(params, state, 5)
  assert int(first.step) == 5
  resumed = decode(params, first, 12)
  assert_same_states(resumed, whole)


@pytest.mark.slow
def test_long_completions_phased_equal_one_loop(params):
  """Hundreds of tokens, four phases, narrowed to a quarter of the batch."""
  prompt, mask = left_padded_prompts(8, 6, seed=4)
  budget = mask.sum(axis=1) + jnp.asarray([520, 30, 9, 200, 1, 64, 130, 300])
  common = dict(max_new_tokens=520, temperature=1.0)
  want = run_decode(params, prompt, mask, sampler.SamplingConfig(**common, **ONE_LOOP), budget)
  got = run_decode(params, prompt, mask,
                   sampler.SamplingConfig(**common, phase_tokens=64, compact_min_rows=2), budget)
  assert_same_states(got, want, atol=5e-5)  # attention sums over 526 slots in another order
  np.testing.assert_array_equal(want.token_mask[:, 6:].sum(axis=1),
                                [520, 30, 9, 200, 1, 64, 130, 300])


@pytest.mark.slow
def test_greedy_decode_uses_no_randomness(params):
  prompt, mask = left_padded_prompts(4, 5)
  config = sampler.SamplingConfig(max_new_tokens=6, temperature=0.0)
  state = sampler.prefill(params, prompt, mask, jax.random.PRNGKey(1), CONFIG, config)
  out = sampler.decode(params, state, jnp.int32(0), CONFIG, config)
  np.testing.assert_array_equal(out.rng, jax.random.PRNGKey(1))  # never split
  tokens, logp = logits_lib.greedy_tokens(state.next_logits)
  np.testing.assert_array_equal(tokens, jnp.argmax(state.next_logits, axis=-1))
  np.testing.assert_allclose(
      logp, jnp.max(jax.nn.log_softmax(state.next_logits, axis=-1), axis=-1), atol=1e-6)


def test_inverse_cdf_frequencies_match_weights_across_blocks():
  """A 300-entry distribution (three CDF blocks) with zeros: chi-square against the
  normalised weights, and no zero-weight entry is ever drawn."""
  rng = np.random.default_rng(0)
  weights = rng.gamma(0.5, size=300)
  weights[rng.choice(300, 60, replace=False)] = 0.0
  weights[250:] = 0.0  # the last block partly empty, the tail all zero
  n = 60000
  uniform = jax.random.uniform(jax.random.PRNGKey(3), (n,))
  drawn = np.asarray(logits_lib.inverse_cdf(jnp.tile(jnp.asarray(weights, jnp.float32), (n, 1)),
                                            uniform))
  probs = weights / weights.sum()
  counts = np.bincount(drawn, minlength=300)
  assert counts[weights == 0].sum() == 0
  big = n * probs > 5
  chi2 = ((counts[big] - n * probs[big]) ** 2 / (n * probs[big])).sum()
  dof = big.sum() - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def test_inverse_cdf_edges():
  weights = jnp.asarray([[0.0, 1.0, 0.0, 3.0, 0.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
  for u, want in ((0.0, [1, 0]), (0.2499, [1, 0]), (0.25, [3, 0]), (np.nextafter(1, 0), [3, 0])):
    np.testing.assert_array_equal(
        logits_lib.inverse_cdf(weights, jnp.full((2,), u, jnp.float32)), want)
  # Rounding past the total falls back to the last positive entry, never a zero one.
  np.testing.assert_array_equal(logits_lib.inverse_cdf(weights, jnp.full((2,), 1.0)), [3, 0])


def test_extreme_logits_stay_finite():
  """Huge logit gaps and a vocabulary of 50k: the draw follows the mass, log-probs finite."""
  logits = jnp.full((3, 50000), -1e4).at[:, 12345].set(1e4).at[1, 49999].set(1e4)
  tokens, logp = logits_lib.sample_tokens(jax.random.PRNGKey(0), logits, 1.0)
  assert tokens[0] == 12345 and tokens[2] == 12345 and int(tokens[1]) in (12345, 49999)
  assert np.isfinite(np.asarray(logp)).all()
  np.testing.assert_allclose(logp[0], 0.0, atol=1e-6)


def test_bad_phase_settings_are_rejected():
  with pytest.raises(ValueError, match="phase_tokens"):
    sampler.SamplingConfig(max_new_tokens=4, phase_tokens=-1)
  with pytest.raises(ValueError, match="compact_min_rows"):
    sampler.SamplingConfig(max_new_tokens=4, compact_min_rows=-2)
