"""Logit processing for sampling: temperature, top-k and top-p (nucleus) truncation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = jnp.finfo(jnp.float32).min


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


def sample_tokens(rng: jax.Array, logits: jax.Array, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row and returns (tokens [B], behaviour log-probs [B]).

  temperature == 0 is greedy. The recorded log-prob is log softmax(logits / temperature)
  at the drawn token, before top-k/top-p truncation: it is the probability the trained
  policy assigns at the same temperature, so importance ratios against it are exact
  whenever no truncation is used (the RL default). For greedy decoding it is the
  temperature-1 log-prob.
  """
  logits = logits.astype(jnp.float32)
  if temperature == 0.0:
    tokens = jnp.argmax(logits, axis=-1)
    scaled = logits
  else:
    scaled = logits / temperature
    truncated = top_p_mask(top_k_mask(scaled, top_k), top_p)
    tokens = jax.random.categorical(rng, truncated, axis=-1)
  logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)[:, 0]
  return tokens.astype(jnp.int32), logp
