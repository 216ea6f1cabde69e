"""Policy objectives under one signature, in one registry (METHODS.md section 1).

Every objective is

    loss_fn(logp, batch, *, prox_logp=None, config) -> (scalar loss, metrics dict)

where `logp` [B, T] are the log-probs of `batch.tokens` under the parameters being trained,
`batch` is an `rl.types.Rollout`, and `config` is the (frozen) `config.loss` ConfigDict.
Metrics may carry 'lr_scale', which the train step applies to the update.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from rl.types import Rollout

LossFn = Callable[..., tuple[jax.Array, dict]]
LOSSES: dict[str, LossFn] = {}

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
  """Decorator adding an objective to the registry under `name` (config.loss.name)."""
  def wrap(fn: LossFn) -> LossFn:
    if name in LOSSES:
      raise ValueError(f"Loss {name!r} is already registered.")
    LOSSES[name] = fn
    return fn
  return wrap


def get_loss(name: str) -> LossFn:
  """The registered objective `name`, or a ValueError listing the known ones."""
  if name not in LOSSES:
    raise ValueError(f"Unknown loss {name!r} (config.loss.name); known: {sorted(LOSSES)}.")
  return LOSSES[name]


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, norm_len: float = 1.0) -> jax.Array:
  """Reduces a per-token loss [B, T] over valid tokens to a scalar.

  token_mean: sum over all tokens / number of tokens (DAPO).
  seq_mean_token_mean: mean over sequences of each sequence's token mean (original GRPO);
    sequences with no valid token are left out.
  seq_mean_token_sum_norm: mean over sequences of token sum / norm_len (Dr.GRPO).
  """
  mask = mask.astype(jnp.float32)
  per_token = per_token * mask
  if mode == "token_mean":
    return per_token.sum() / jnp.maximum(mask.sum(), 1.0)
  if mode == "seq_mean_token_mean":
    lengths = mask.sum(axis=1)
    has_tokens = (lengths > 0).astype(jnp.float32)
    seq_means = per_token.sum(axis=1) / jnp.maximum(lengths, 1.0)
    return (seq_means * has_tokens).sum() / jnp.maximum(has_tokens.sum(), 1.0)
  if mode == "seq_mean_token_sum_norm":
    return (per_token.sum(axis=1) / norm_len).mean()
  raise ValueError(f"Unknown aggregation {mode!r} (config.loss.aggregation); known: {AGGREGATIONS}.")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of x over mask (0 when the mask is empty)."""
  mask = mask.astype(jnp.float32)
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
  delta = ref_logp - logp
  return jnp.exp(delta) - delta - 1.0


@register_loss("grpo")
def ppo_clip_loss(logp: jax.Array, batch: Rollout, *, prox_logp=None, config) -> tuple[jax.Array, dict]:
  """PPO-clip / GRPO (DeepSeekMath): -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

  The ratio is taken against `prox_logp` when given, else the behaviour log-probs. An
  optional k3 KL penalty to `batch.ref_logp` is added with weight config.kl_coef.
  """
  mask = batch.completion_mask
  old = batch.behavior_logp if prox_logp is None else prox_logp
  log_ratio = logp - old
  ratio = jnp.exp(log_ratio)
  adv = batch.advantages
  clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)
  metrics = {
      "clip_fraction": masked_mean((ratio * adv > clipped * adv).astype(jnp.float32), mask),
      "ratio_mean": masked_mean(ratio, mask),
      "approx_kl_behavior": masked_mean(k3_kl(logp, jax.lax.stop_gradient(old)), mask),
  }
  if config.kl_coef:
    if batch.ref_logp is None:
      raise ValueError("config.loss.kl_coef > 0 needs reference log-probs (batch.ref_logp); "
                       "set config.loss.kl_coef=0 or provide a reference policy.")
    kl = k3_kl(logp, batch.ref_logp)
    per_token = per_token + config.kl_coef * kl
    metrics["kl_ref"] = masked_mean(kl, mask)
  loss = aggregate(per_token, mask, config.aggregation, config.norm_len)
  return loss, metrics


@register_loss("sft")
def sft_loss(logp: jax.Array, batch: Rollout, *, prox_logp=None, config) -> tuple[jax.Array, dict]:
  """Supervised warm start: negative log-likelihood of the completion tokens."""
  del prox_logp
  nll = aggregate(-logp, batch.completion_mask, config.aggregation, config.norm_len)
  return nll, {"nll": nll}
