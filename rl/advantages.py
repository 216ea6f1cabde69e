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


ADVANTAGES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "grpo": grpo_advantages,
}


def get_advantage_fn(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """The registered estimator `name`, or a ValueError listing the known ones."""
  if name not in ADVANTAGES:
    raise ValueError(f"Unknown advantage estimator {name!r} (config.advantage.name); "
                     f"known: {sorted(ADVANTAGES)}.")
  return ADVANTAGES[name]
