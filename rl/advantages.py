"""Advantage estimators: pure functions of rewards and group ids (METHODS.md section 2)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def _same_group(group: jax.Array) -> jax.Array:
  """[B, B] float matrix: 1 where two rows belong to the same group (prompt)."""
  return (group[:, None] == group[None, :]).astype(jnp.float32)


def group_mean(values: jax.Array, group: jax.Array) -> jax.Array:
  """Mean of `values` over each row's group, broadcast back to rows. [B] -> [B]."""
  same = _same_group(group)
  return same @ values / same.sum(axis=1)


def group_std(values: jax.Array, group: jax.Array) -> jax.Array:
  """Population (ddof=0) standard deviation of `values` within each row's group."""
  centred = values - group_mean(values, group)
  return jnp.sqrt(group_mean(centred * centred, group))


def grpo_advantages(reward: jax.Array, group: jax.Array, eps: float = 1e-6) -> jax.Array:
  """GRPO (DeepSeekMath): (r - mean_group(r)) / (std_group(r) + eps).

  The std is the population std (ddof=0); a group whose rewards are all equal gets 0.
  """
  reward = reward.astype(jnp.float32)
  return (reward - group_mean(reward, group)) / (group_std(reward, group) + eps)


def drgrpo_advantages(reward: jax.Array, group: jax.Array) -> jax.Array:
  """Dr.GRPO (Understanding R1-Zero-like training): r - mean_group(r), no std division."""
  reward = reward.astype(jnp.float32)
  return reward - group_mean(reward, group)


def rloo_advantages(reward: jax.Array, group: jax.Array) -> jax.Array:
  """RLOO (REINFORCE leave-one-out): r_i - mean of the other rewards of the group,
  = G / (G - 1) * (r_i - mean_group(r)). A group of one gets 0."""
  reward = reward.astype(jnp.float32)
  same = _same_group(group)
  size = same.sum(axis=1)
  others = (same @ reward - reward) / jnp.maximum(size - 1.0, 1.0)
  return jnp.where(size > 1, reward - others, 0.0)


def median_advantages(reward: jax.Array, group: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Median baseline (MC-GRPO): (r - median_group(r)) / (std_group(r) + eps).

  With an odd group (G + 1 samples) the median sample's advantage is exactly 0, so it is
  excluded from the gradient; with an even group the baseline is the mean of the two
  middle rewards. The std scale (population) is GRPO's, chosen so step sizes match.
  """
  reward = reward.astype(jnp.float32)
  same = _same_group(group) > 0
  median = jnp.nanmedian(jnp.where(same, reward[None, :], jnp.nan), axis=1)
  return (reward - median) / (group_std(reward, group) + eps)


ADVANTAGES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "median": median_advantages,
}


def get_advantage_fn(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The registered estimator `name`, or a ValueError listing the known ones."""
  if name not in ADVANTAGES:
    raise ValueError(f"Unknown advantage estimator {name!r} (config.advantage.name); "
                     f"known: {sorted(ADVANTAGES)}.")
  return ADVANTAGES[name]
