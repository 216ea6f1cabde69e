"""Drawing tokens from logits: greedy, temperature, top-k and top-p (nucleus), in one pass.

`sample_tokens` is the one sampling path. Greedy decoding (temperature 0) takes the argmax
and uses no randomness. Otherwise a row's token is drawn by inverting its CDF with one
uniform number (`inverse_cdf`), so a step needs B random numbers rather than the B x V
Gumbel draws of `jax.random.categorical` (5-60x the cost of the rest of the sampling step on
CPU, docs/benchmarks_perf.md), and the behaviour log-prob comes from the same exponentials
that the draw uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = jnp.finfo(jnp.float32).min
_CDF_BLOCK = 128


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
  """Keeps the k largest logits of each row (ties at the threshold are kept); k=0: all."""
  if k <= 0 or k >= logits.shape[-1]:
    return logits
  threshold = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits >= threshold, logits, _NEG)


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
  """Keeps the smallest set of most likely tokens whose probability reaches p; p>=1: all.

  A token is kept when the probability mass strictly before it (in descending order) is
  below p, so the most likely token is always kept.
  """
  if p >= 1.0:
    return logits
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
  sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  kept = jnp.where(mass_before < p, sorted_logits, jnp.inf)
  threshold = jnp.min(kept, axis=-1, keepdims=True)
  return jnp.where(logits >= threshold, logits, _NEG)


def _last_positive(weights: jax.Array) -> jax.Array:
  """Index of the last positive entry along the last axis (0 if there is none)."""
  flipped = jnp.flip(weights > 0, axis=-1)
  return weights.shape[-1] - 1 - jnp.argmax(flipped, axis=-1)


def inverse_cdf(weights: jax.Array, uniform: jax.Array) -> jax.Array:
  """The index i of each row of `weights` [B, V] (>= 0, not normalised) at which the
  cumulative mass first exceeds uniform * total, for uniform [B] in [0, 1): a draw with
  probability weights[i] / total.

  Two levels, so that no [B, V] prefix sum is formed: block masses of 128 entries, their
  prefix sum picks a block, and a prefix sum inside that block picks the entry. A draw
  that f32 rounding pushes past the last entry of positive weight falls back to it, so a
  zero-weight entry (masked by top-k / top-p) is never drawn.
  """
  rows, vocab = weights.shape
  block = min(vocab, _CDF_BLOCK)
  blocks = -(-vocab // block)
  w = jnp.pad(weights, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)
  block_mass = w.sum(axis=-1)
  block_end = jnp.cumsum(block_mass, axis=-1)
  target = uniform * block_end[:, -1]
  chosen = jnp.minimum(jnp.sum(block_end <= target[:, None], axis=-1),
                       _last_positive(block_mass))
  inner = jnp.take_along_axis(w, chosen[:, None, None], axis=1)[:, 0]
  start = jnp.take_along_axis(block_end - block_mass, chosen[:, None], axis=1)
  inner_end = start + jnp.cumsum(inner, axis=-1)
  index = jnp.minimum(jnp.sum(inner_end <= target[:, None], axis=-1), _last_positive(inner))
  return (chosen * block + index).astype(jnp.int32)


def greedy_tokens(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(argmax tokens [B], their temperature-1 log-probs [B]); no randomness.

  Written as plain reductions: the row's maximum, the first index holding it (a NaN counts
  as the maximum, as in `jnp.argmax`), and log softmax at that index = -log sum exp(logits -
  max). `jnp.argmax` lowers to a (value, index) variadic reduce that XLA:CPU does not
  vectorise: argmax + logsumexp took 1.9-2.9x as long at batch 64, vocabularies 1024 and
  49152 (`python -m experiments.bench_logits`, docs/benchmarks_perf.md).
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  peak = jnp.max(logits, axis=-1, keepdims=True)
  is_peak = (logits == peak) | jnp.isnan(logits)
  tokens = jnp.min(jnp.where(is_peak, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
  return tokens, -jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1))


def sample_with_uniform(uniform: jax.Array, logits: jax.Array, temperature: float,
                        top_k: int = 0, top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """One token per row of logits [B, V] from one uniform [B] in [0, 1) each: (tokens [B],
  behaviour log-probs [B]); temperature > 0.

  The exponentials w = exp(logits / T - max), zeroed outside the top-k / top-p set, are
  the sampled distribution up to its total: they feed the draw (`inverse_cdf`), and the
  log-prob is the drawn token's share of their total, log(w_token / sum of kept w), the
  probability it was drawn with (see `sample_tokens`).
  """
  weights, shifted = sampled_weights(logits, temperature, top_k, top_p)
  tokens = inverse_cdf(weights, uniform)
  picked = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0]
  return tokens, picked - jnp.log(jnp.sum(weights, axis=-1))


def sampled_weights(logits: jax.Array, temperature: float, top_k: int = 0,
                    top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """The distribution a row of logits [..., V] is sampled from, unnormalised: (weights
  w = exp(logits / T - max), zero outside the top-k / top-p set; the shifted logits
  logits / T - max, whose value at a kept token minus log(sum w) is its log-prob).
  temperature > 0."""
  scaled = logits.astype(jnp.float32) / temperature
  shifted = scaled - jnp.max(scaled, axis=-1, keepdims=True)
  weights = jnp.exp(shifted)
  if top_k or top_p < 1.0:
    kept = top_p_mask(top_k_mask(scaled, top_k), top_p) > _NEG
    weights = jnp.where(kept, weights, 0.0)
  return weights, shifted


def sample_tokens(rng: jax.Array, logits: jax.Array, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row and returns (tokens [B], behaviour log-probs [B]).

  temperature == 0 is greedy (`rng` unused; evaluation only, RL refuses it) and records
  the temperature-1 log-prob. Otherwise the recorded log-prob (`Rollout.behavior_logp`,
  behav) is that of the distribution the token was drawn from: softmax(logits / T)
  restricted to the top-k tokens, renormalised, restricted to the top-p nucleus of that,
  renormalised (no truncation: softmax(logits / T) itself).

  The train step's log-prob (rl/objectives/composite.py `policy_logprobs`, logp) is the untruncated
  softmax(logits / T): the trained policy. So without truncation exp(logp - behav) is 1 on
  fresh tokens, and with top-k / top-p it is the importance ratio between the trained
  policy and the truncated sampler (on fresh tokens the kept mass, at most 1): the
  mismatch off-policy corrections (TIS, MIS, decoupled PPO) see and correct, as they do
  staleness.
  """
  if temperature == 0.0:
    return greedy_tokens(logits)
  uniform = jax.random.uniform(rng, logits.shape[:1], jnp.float32)
  return sample_with_uniform(uniform, logits, temperature, top_k, top_p)
