"""Tree rollouts (sampling/tree.py): fork correctness against uncached plain decoding,
decoded-token accounting, entropy branch points, and the tree batch given to the loss."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from rl.objectives import advantages
from rl.rollouts import batches as rollout_lib
from sampling import tree
from sampling.logits import sample_tokens
from sampling.sampler import SamplingConfig
from tests import tiny

MODEL = tiny.model(vocab_size=16)
SAMPLING = SamplingConfig(max_new_tokens=7, temperature=1.0, stop_tokens=(2,), pad_id=0)
ENTROPY = tree.EntropyFork(init_chains=2, fork_points=2, branches=2, rounds=2)
SEGMENTS = tree.FixedSegments(init_chains=1, segment_len=2, branches=2, max_depth=2)
LOOKAHEAD = tree.Lookahead(init_chains=2, leaves=8, top_k=3, min_entropy=1.5,
                           lookahead_steps=2, prune_similarity=0.5)


@functools.lru_cache(maxsize=None)
def _setup():
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0), init_std=0.5)
  prompt_tokens = np.array([[0, 1, 5, 6], [1, 7, 8, 9]], np.int32)  # left-padded
  prompt_mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]], bool)
  return params, prompt_tokens, prompt_mask


@functools.lru_cache(maxsize=None)
def _generate(policy):
  params, prompt_tokens, prompt_mask = _setup()
  gen = tree.tree_generate(params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask),
                           jax.random.PRNGKey(1), MODEL, SAMPLING, policy, version=3)
  return jax.device_get(gen)


@functools.partial(jax.jit, static_argnums=(3,))
def _logits_at(params, tokens, length, config):
  """Uncached forward over one right-padded unpadded sequence; next-token logits [V]."""
  mask = jnp.arange(tokens.shape[0]) < length
  logits, _ = transformer.forward(params, tokens[None], jnp.arange(tokens.shape[0])[None],
                                  mask[None], config)
  return logits[0, length - 1]


def _reference(params, prompt, prefix, key, forced=None):
  """Plain decoding without a KV cache: feed prompt + prefix, draw completion position j
  with fold_in(key, j) (a forced token, if given, at the first position). Returns the
  completion tokens, their log-probs and the sampling entropies from the prefix on."""
  width = len(prompt) + SAMPLING.max_new_tokens
  seq = list(prompt) + list(prefix)
  tokens, logps, entropies = [], [], []
  for j in range(len(prefix), SAMPLING.max_new_tokens):
    padded = jnp.asarray(seq + [0] * (width - len(seq)), jnp.int32)
    logits = _logits_at(params, padded, len(seq), MODEL)
    logp_all = jax.nn.log_softmax(logits)
    entropies.append(float(-(jnp.exp(logp_all) * logp_all).sum()))
    if forced is not None and j == len(prefix):
      token, logp = forced, float(logp_all[forced])
    else:
      t, lp = sample_tokens(jax.random.fold_in(key, j), logits[None], SAMPLING.temperature)
      token, logp = int(t[0]), float(lp[0])
    tokens.append(token)
    logps.append(logp)
    seq.append(token)
    if token in SAMPLING.stop_tokens:
      break
  return tokens, logps, entropies


def _rows(gen):
  return np.flatnonzero(gen.tree.leaf)


def _global_parent(gen, row, leaves):
  return (row // leaves) * leaves + gen.tree.parent[row]


@pytest.mark.parametrize("policy", [ENTROPY, SEGMENTS, LOOKAHEAD], ids=lambda p: type(p).__name__)
@pytest.mark.slow
def test_fork_continuation_equals_plain_decoding(policy):
  """Every row: shared prefix = parent's tokens; own tokens = uncached plain decoding of
  (prompt + prefix) with the row's key (lookahead children: forced first token)."""
  params, prompt_tokens, prompt_mask = _setup()
  gen = _generate(policy)
  prompt_len = prompt_tokens.shape[1]
  forks = 0
  for row in _rows(gen):
    prompt = prompt_tokens[row // policy.leaves][prompt_mask[row // policy.leaves]]
    completion = gen.tokens[row, prompt_len:][:gen.completion_len[row]]
    logp = gen.behavior_logp[row, prompt_len:][:gen.completion_len[row]]
    start = gen.tree.prefix_len[row]
    forced = None
    if gen.tree.parent[row] >= 0:
      forks += 1
      parent = _global_parent(gen, row, policy.leaves)
      np.testing.assert_array_equal(completion[:start], gen.tokens[parent, prompt_len:][:start])
      np.testing.assert_allclose(logp[:start], gen.behavior_logp[parent, prompt_len:][:start])
      if isinstance(policy, tree.Lookahead):
        forced = int(completion[start])
        assert forced != gen.tokens[parent, prompt_len + start]
    want, want_logp, want_entropy = _reference(params, prompt, completion[:start],
                                               gen.tree.row_key[row], forced)
    np.testing.assert_array_equal(completion[start:], want)
    np.testing.assert_allclose(logp[start:], want_logp, atol=2e-5)
    np.testing.assert_allclose(gen.tree.entropy[row, start:len(completion)], want_entropy, atol=2e-5)
    assert np.all(gen.version[row, prompt_len:][:len(completion)] == 3)
  assert forks > 0


def _owners(gen, leaves):
  """Slow reference: (owner row, position) of each leaf's completion tokens."""
  def owner(row, j):
    while j < gen.tree.prefix_len[row]:
      row = _global_parent(gen, row, leaves)
    return row
  return {(owner(row, j), j) for row in _rows(gen) for j in range(gen.completion_len[row])}


@pytest.mark.parametrize("policy", [
    pytest.param(ENTROPY, marks=pytest.mark.slow), SEGMENTS,
    pytest.param(LOOKAHEAD, marks=pytest.mark.slow)], ids=lambda p: type(p).__name__)
def test_decoded_tokens_equal_distinct_tree_tokens(policy):
  gen = _generate(policy)
  distinct = len(_owners(gen, policy.leaves))
  assert int(gen.tree.decoded_tokens) == distinct + int(gen.tree.pruned_tokens)
  assert distinct == int((gen.completion_len - gen.tree.prefix_len)[gen.tree.leaf].sum())
  assert distinct < int(gen.completion_len.sum())  # prefixes really are shared
  if isinstance(policy, tree.EntropyFork):
    assert int(gen.tree.refed_tokens) == int((gen.tree.parent >= 0).sum())
  else:
    assert int(gen.tree.refed_tokens) == 0


def test_lookahead_prunes_within_budget():
  gen = _generate(LOOKAHEAD)
  assert int(gen.tree.pruned_tokens) > 0
  assert gen.tree.leaf.reshape(-1, LOOKAHEAD.leaves).sum(axis=1).max() <= LOOKAHEAD.leaves


def test_segments_branch_every_segment_len_tokens():
  gen = _generate(SEGMENTS)
  children = gen.tree.parent >= 0
  assert set(gen.tree.prefix_len[children]) <= {2, 4}
  rows = np.flatnonzero(children)
  parents = np.array([_global_parent(gen, r, SEGMENTS.leaves) for r in rows])
  np.testing.assert_array_equal(gen.tree.depth[rows], gen.tree.depth[parents] + 1)
  assert np.all(gen.tree.depth[gen.tree.leaf & ~children] == 0)


def test_entropy_branch_points_are_highest_entropy_tokens():
  """Round by round, the fork points are the N highest-entropy tree tokens not already
  used as branch points (NumPy re-derivation from the recorded entropies)."""
  gen = _generate(ENTROPY)
  m, n, b, k = ENTROPY.init_chains, ENTROPY.fork_points, ENTROPY.branches, ENTROPY.leaves
  for prompt in range(gen.tokens.shape[0] // k):
    rows = np.arange(prompt * k, (prompt + 1) * k)
    used = set()
    for round_index in range(ENTROPY.rounds):
      grown = m + round_index * n * b
      candidates = {}
      for local in range(grown):
        row = rows[local]
        for j in range(gen.tree.prefix_len[row], gen.completion_len[row]):
          if (local, j) not in used:
            candidates[(local, j)] = gen.tree.entropy[row, j]
      best = sorted(candidates, key=candidates.get, reverse=True)[:n]
      children = rows[grown:grown + n * b]
      chosen = {(int(gen.tree.parent[c]), int(gen.tree.prefix_len[c])) for c in children}
      assert chosen == set(best)
      used |= set(best) | {(grown + i, int(gen.tree.prefix_len[c])) for i, c in enumerate(children)}


def _slow_tree_advantages(gen, reward, leaves):
  """NumPy TreeRL (spec scale, and normalised) / sibling advantages from explicit leaf
  sets, for every (row, j)."""
  rows = _rows(gen)
  def owner(row, j):
    while j < gen.tree.prefix_len[row]:
      row = _global_parent(gen, row, leaves)
    return row
  def leafset(row, j):
    o = owner(row, j)
    return frozenset(s for s in rows if s // leaves == row // leaves
                     and j < gen.completion_len[s] and owner(s, j) == o)
  treerl, normalized, siblings = {}, {}, {}
  for row in rows:
    group = [s for s in rows if s // leaves == row // leaves]
    root, std = np.mean(reward[group]), np.std(reward[group])
    sets = [leafset(row, j) for j in range(gen.completion_len[row])]
    value = lambda ls: np.mean(reward[list(ls)])
    for j, ls in enumerate(sets):
      start = min(i for i in range(j + 1) if sets[i] == ls)
      parent_set = sets[start - 1] if start else None
      v_parent = value(parent_set) if start else root
      treerl[row, j] = (2 * value(ls) - root - v_parent) / np.sqrt(len(ls))
      normalized[row, j] = 0.5 * treerl[row, j] / (std + 1e-6)
      # Siblings: node sets (children of the same parent node) seen from any leaf.
      sibs = set()
      for s in group:
        s_sets = [leafset(s, i) for i in range(gen.completion_len[s])]
        for i, other in enumerate(s_sets):
          s_start = min(q for q in range(i + 1) if s_sets[q] == other)
          s_parent = s_sets[s_start - 1] if s_start else None
          if s_parent == parent_set and (not start or s_start == start):
            sibs.add(other)
      vals = np.array([value(x) for x in sibs])
      siblings[row, j] = (value(ls) - vals.mean()) / (vals.std() + 1e-6)
  return treerl, normalized, siblings


@pytest.mark.slow
def test_tree_advantages_match_slow_reference_on_sampled_tree():
  gen = _generate(ENTROPY)
  k = ENTROPY.leaves
  reward = np.random.default_rng(0).integers(0, 3, gen.tree.leaf.shape[0]).astype(np.float32) / 2
  group = np.arange(gen.tree.leaf.shape[0]) // k
  prompt_len = gen.tokens.shape[1] - gen.tree.entropy.shape[1]
  mask = gen.completion_mask[:, prompt_len:]
  want_treerl, want_normalized, want_siblings = _slow_tree_advantages(gen, reward, k)
  for fn, want in ((advantages.treerl_advantages, want_treerl),
                   (advantages.treerl_normalized_advantages, want_normalized),
                   (advantages.sibling_advantages, want_siblings)):
    got = np.asarray(fn(jnp.asarray(reward), jnp.asarray(group), jnp.asarray(gen.tree.node),
                        jnp.asarray(gen.tree.parent), jnp.asarray(gen.tree.prefix_len), jnp.asarray(mask)))
    for (row, j), value in want.items():
      np.testing.assert_allclose(got[row, j], value, rtol=1e-4, atol=1e-4)
    assert np.all(got[~mask] == 0)


def test_tree_rollout_trains_each_tree_token_once():
  """Shared prefixes move to the context: completion_mask covers every tree token exactly
  once (in the row that decoded it) and carries that token's node advantage."""
  gen = jax.tree.map(jnp.asarray, _generate(ENTROPY))
  k = ENTROPY.leaves
  reward = jnp.asarray(np.random.default_rng(1).integers(0, 2, gen.tree.leaf.shape[0]), jnp.float32)
  group = jnp.arange(gen.tree.leaf.shape[0]) // k
  batch = rollout_lib.tree_rollout(gen, reward, group)
  prompt_len = gen.tokens.shape[1] - gen.tree.entropy.shape[1]
  batch = batch.replace(advantages=advantages.per_tree(advantages.treerl_advantages,
                                                       prompt_len)(batch))
  assert int(batch.completion_mask.sum()) == int(gen.tree.decoded_tokens)
  np.testing.assert_array_equal(batch.token_mask, gen.prompt_mask | gen.completion_mask)
  want = advantages.treerl_advantages(reward, group, gen.tree.node, gen.tree.parent, gen.tree.prefix_len,
                                      gen.completion_mask[:, prompt_len:])
  own = batch.completion_mask[:, prompt_len:]
  np.testing.assert_allclose(batch.advantages[:, prompt_len:], jnp.where(own, want, 0.0))
  np.testing.assert_array_equal(batch.tree.prefix_len, gen.tree.prefix_len)


def test_bad_policy_settings_raise():
  with pytest.raises(ValueError, match="branches"):
    tree.FixedSegments(branches=1)
  with pytest.raises(ValueError, match="top_k"):
    tree.Lookahead(top_k=1)
  with pytest.raises(ValueError, match="fork_points"):
    tree.EntropyFork(fork_points=0)
