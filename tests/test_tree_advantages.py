"""Tree advantages (rl/objectives/advantages.py) on hand-built trees, and their GRPO limit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import advantages

# One prompt's tree (group 0), rows shuffled among a second group and an unused row:
#   leaf a: chain, 4 tokens, reward 1        leaf b: forks from a after 2 tokens, 4 tokens, 0
#   leaf c: forks from b after 3 tokens, 5 tokens, reward 1     leaf d: chain, 3 tokens, 0
# Nodes: A = a[0:2] (leaves a,b,c; V 2/3), B = a[2:4] (a; 1), C = b[2:3] (b,c; 1/2),
# D = b[3:4] (b; 0), E = c[3:5] (c; 1), F = d[0:3] (d; 0). V(root) = 1/2, std 1/2.
# Group 1: two chains with equal rewards (no signal).
#            c   g1  a   unused d   b   g1
GROUP = [0, 1, 0, 0, 0, 0, 1]
NODE = [2, 0, 0, -1, 3, 1, 1]
PARENT = [1, -1, -1, -1, -1, 0, -1]
PREFIX = [3, 0, 0, 0, 0, 2, 0]
LENGTH = [5, 2, 4, 0, 3, 4, 3]
REWARD = [1.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.5]
# TreeRL: (V(n) - V(root)) + (V(n) - V(parent)), over sqrt(#leaves(n)):
# A = (1/6 + 1/6) / sqrt(3), B = (1/2 + 1/3), C = (0 - 1/6) / sqrt(2), D = (-1/2 - 1/2),
# E = (1/2 + 1/2), F = (-1/2 - 1/2). (The normalised variant averages the two terms and
# divides by std 1/2, which here gives the same numbers; test_treerl_scale tells them apart.)
A, B, C, D, E, F = 1 / 3 / np.sqrt(3), 5 / 6, -1 / 6 / np.sqrt(2), -1.0, 1.0, -1.0
TREERL = [[A, A, C, E, E], [0, 0], [A, A, B, B], [], [F, F, F], [A, A, C, D], [0, 0, 0]]
# Siblings: {A: 2/3, F: 0} under the root, {B: 1, C: 1/2} under A, {D: 0, E: 1} under C.
SIBLINGS = [[1, 1, -1, 1, 1], [0, 0], [1, 1, 1, 1], [], [-1, -1, -1], [1, 1, -1, -1], [0, 0, 0]]


def _mask(lengths, width=6):
  return jnp.asarray(np.arange(width)[None, :] < np.asarray(lengths)[:, None])


def _dense(rows, width=6):
  out = np.zeros((len(rows), width), np.float32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def _call(fn, reward=REWARD):
  return np.asarray(fn(jnp.asarray(reward, jnp.float32), jnp.asarray(GROUP), jnp.asarray(NODE),
                       jnp.asarray(PARENT), jnp.asarray(PREFIX), _mask(LENGTH)))


@pytest.mark.slow
def test_node_values_on_hand_built_tree():
  stats = advantages.tree_node_values(jnp.asarray(REWARD), jnp.asarray(GROUP), jnp.asarray(NODE),
                                      jnp.asarray(PARENT), jnp.asarray(PREFIX), _mask(LENGTH))
  value = _dense([[2 / 3, 2 / 3, .5, 1, 1], [.5, .5], [2 / 3, 2 / 3, 1, 1], [], [0, 0, 0],
                  [2 / 3, 2 / 3, .5, 0], [.5, .5, .5]])
  leaves = _dense([[3, 3, 2, 1, 1], [1, 1], [3, 3, 1, 1], [], [1, 1, 1], [3, 3, 2, 1],
                   [1, 1, 1]])
  np.testing.assert_allclose(stats["value"], value, atol=1e-6)
  np.testing.assert_allclose(stats["leaves"], leaves)
  owner = np.asarray(stats["owner"])
  np.testing.assert_array_equal(owner[0, :5], [2, 2, 5, 0, 0])   # c: a, a, b, c, c
  np.testing.assert_array_equal(owner[3], -1)


def test_treerl_advantages_on_hand_built_tree():
  np.testing.assert_allclose(_call(advantages.treerl_advantages), _dense(TREERL), atol=1e-5)


def test_sibling_advantages_on_hand_built_tree():
  np.testing.assert_allclose(_call(advantages.sibling_advantages), _dense(SIBLINGS), atol=1e-4)


def test_treerl_follows_the_spec_scale_and_normalising_is_an_option():
  # Rewards scaled by 0.6 (leaf std 0.3): the spec's advantages scale with the rewards;
  # the normalised variant (two terms averaged, divided by the std) does not. Before, the
  # default was the normalised one.
  scaled = [0.6 * r for r in REWARD]
  np.testing.assert_allclose(_call(advantages.treerl_advantages, scaled),
                             0.6 * _dense(TREERL), atol=1e-5)
  np.testing.assert_allclose(_call(advantages.get_tree_advantage_fn("treerl_normalized"), scaled),
                             _dense(TREERL), atol=1e-4)


def _chains(seed):
  """Five prompts of four chains each (no forks): rewards, group, node, parent, prefix, mask."""
  rng = np.random.default_rng(seed)
  group = np.repeat(np.arange(5), 4)
  reward = rng.integers(0, 3, group.shape[0]).astype(np.float32) / 2
  lengths = rng.integers(1, 7, group.shape[0])
  return (jnp.asarray(reward), jnp.asarray(group), jnp.asarray(np.tile(np.arange(4), 5)),
          jnp.full((20,), -1), jnp.zeros((20,), jnp.int32), _mask(lengths))


@pytest.mark.parametrize("name", ["siblings", "treerl_normalized"])
def test_tree_without_forks_is_grpo(name):
  """Every leaf a chain from its prompt: the normalised estimators give GRPO's advantage on
  every completion token."""
  reward, group, node, parent, prefix, mask = _chains(0)
  got = advantages.get_tree_advantage_fn(name)(reward, group, node, parent, prefix, mask)
  grpo = advantages.grpo_advantages(reward, group)
  np.testing.assert_allclose(got, np.asarray(grpo)[:, None] * np.asarray(mask), atol=1e-4)


def test_treerl_without_forks_is_twice_the_centred_reward():
  # No forks: V(n) = r, V(parent) = V(root) = group mean, one leaf per node.
  reward, group, node, parent, prefix, mask = _chains(1)
  got = advantages.treerl_advantages(reward, group, node, parent, prefix, mask)
  centred = 2 * advantages.drgrpo_advantages(reward, group)
  np.testing.assert_allclose(got, np.asarray(centred)[:, None] * np.asarray(mask), atol=1e-6)


@pytest.mark.parametrize("name", sorted(advantages.TREE_ADVANTAGES))
@pytest.mark.slow
def test_equal_fractional_leaf_rewards_give_exactly_zero(name):
  # One batch holds a tree of each size L = 3..16 whose leaves all score the same fraction:
  # chain 0, then leaf i forks from leaf i - 1 after i tokens (so nodes are shared by 2..L
  # leaves); and the hand-built tree with equal rewards.
  fn = advantages.get_tree_advantage_fn(name)
  sizes = range(3, 17)
  group = np.concatenate([np.full(n, i) for i, n in enumerate(sizes)])
  node = np.concatenate([np.arange(n) for n in sizes])
  for value in (0.7, 0.1, 1 / 3):
    got = fn(jnp.full(group.shape, value, jnp.float32), jnp.asarray(group), jnp.asarray(node),
             jnp.asarray(node - 1), jnp.asarray(node), _mask(np.full(group.shape, 16), width=16))
    np.testing.assert_array_equal(np.asarray(got), 0.0)
    np.testing.assert_array_equal(_call(fn, [value if n >= 0 else 0.0 for n in NODE]), 0.0)


def test_unknown_tree_estimator_raises():
  with pytest.raises(ValueError, match="config.rollout.tree.advantage"):
    advantages.get_tree_advantage_fn("nope")
