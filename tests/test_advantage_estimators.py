"""Tests for rl.objectives.advantages estimators against slow NumPy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import advantages


def grouped(seed, sizes):
  rng = np.random.default_rng(seed)
  group = np.concatenate([np.full(n, g) for g, n in enumerate(sizes)]).astype(np.int32)
  perm = rng.permutation(len(group))  # groups need not be contiguous
  reward = rng.integers(0, 4, len(group)).astype(np.float32) / 3
  return reward[perm], group[perm]


def reference(reward, group, fn):
  out = np.zeros_like(reward)
  for g in np.unique(group):
    s = group == g
    out[s] = fn(reward[s])
  return out


@pytest.mark.parametrize("seed", range(3))
def test_drgrpo_is_mean_centred_without_std(seed):
  reward, group = grouped(seed, [4, 4, 3])
  want = reference(reward, group, lambda r: r - r.mean())
  np.testing.assert_allclose(advantages.drgrpo_advantages(jnp.asarray(reward), jnp.asarray(group)),
                             want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_rloo_is_leave_one_out(seed):
  reward, group = grouped(seed, [4, 5, 1])
  def loo(r):
    if len(r) == 1:
      return np.zeros(1)
    return np.array([r[i] - np.delete(r, i).mean() for i in range(len(r))])
  np.testing.assert_allclose(advantages.rloo_advantages(jnp.asarray(reward), jnp.asarray(group)),
                             reference(reward, group, loo), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_median_baseline(seed):
  reward, group = grouped(seed, [5, 4, 3])
  want = reference(reward, group, lambda r: (r - np.median(r)) / (r.std() + 1e-6))
  got = np.asarray(advantages.median_advantages(jnp.asarray(reward), jnp.asarray(group)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_median_sample_of_an_odd_group_gets_zero():
  reward = jnp.asarray([0.1, 0.9, 0.5, 0.3, 0.7])
  adv = advantages.median_advantages(reward, jnp.zeros(5, jnp.int32))
  assert float(adv[2]) == 0.0 and np.all(np.asarray(adv)[[0, 1, 3, 4]] != 0)


def test_estimators_by_name():
  assert {"grpo", "drgrpo", "rloo", "median"} <= set(advantages.ADVANTAGES)
  with pytest.raises(ValueError, match="Unknown advantage"):
    advantages.get_advantage_fn("mean_of_means")


@pytest.mark.parametrize("name", sorted(advantages.ADVANTAGES))
def test_equal_fractional_rewards_give_exactly_zero(name):
  # The case: grpo_advantages(full((7,), 0.7), zeros(7)) was 0.056 per row (a
  # one-ulp error in the float32 mean, divided by eps = 1e-6). One batch holds a group of
  # each size G = 3..16 with equal rewards, and a group with signal, which keeps its
  # advantages.
  fn = advantages.get_advantage_fn(name)
  sizes = range(3, 17)
  group = np.concatenate([np.full(g, i) for i, g in enumerate(sizes)] + [np.full(3, 99)])
  for value in (0.7, 0.1, 0.3, 1 / 3, 0.05, 0.99):
    reward = np.concatenate([np.full(len(group) - 3, value), [0.0, 1.0, 0.5]]).astype(np.float32)
    adv = np.asarray(fn(jnp.asarray(reward), jnp.asarray(group, jnp.int32)))
    np.testing.assert_array_equal(adv[:-3], 0.0)
    assert np.all(adv[-3:-1] != 0)


def test_rewards_equal_up_to_rounding_standardise_to_zero():
  # 0.1 + 0.2 and 0.3 differ by one float32 ulp: not a signal to blow up to +-1.
  reward = jnp.asarray([np.float32(0.1) + np.float32(0.2), np.float32(0.3)] * 2)
  adv = advantages.grpo_advantages(reward, jnp.zeros(4, jnp.int32))
  np.testing.assert_array_equal(np.asarray(adv), 0.0)
