"""Tests for rl.rollouts.selection: dynamic sampling, GRESO skipping, adaptive allocation, state.

Most tests drive `selection.collect` with a Bernoulli simulator instead of a policy: train
position p answers correctly with probability probs[p], so which groups are informative is
known in advance and the tests need no model.

A mutant these tests were run against (on a scratch copy, never committed): AR3PO's reused
row keeping the fresh row's behaviour log-probs instead of the stored response's fails
test_ar3po_reuses_a_stored_response_with_its_log_probs_and_version.
"""


import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train as launcher
from experiments.configs import chain_sum_compact
from experiments.configs import default
from rl.objectives import advantages
from rl import checkpoint
from rl.rollouts import producers
from rl.rollouts import selection
from rl.rollouts.batches import ScoredSamples
from rl.samples import ScoredRow
from rl.types import Rollout
from rl.verdicts import Verdict
from rl import wiring
from tests.launcher_config import apply_overrides, rl_steps, tiny_run_config

G = 4  # group size in the simulator tests


def _config(kind, **overrides):
  """config.selection of the default run with `kind` and dotted-path overrides."""
  return selection.SelectionSettings.from_config(
      apply_overrides(default.get_config().selection, {"kind": kind, **overrides}))


def _bernoulli_sampler(probs, calls=None):
  """A SampleFn whose row for position p has reward 1 with probability probs[p], else 0."""
  probs = np.asarray(probs)

  def sample(row_positions, key):
    if calls is not None:
      calls.append(np.array(row_positions))
    draws = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    reward = (draws.random(len(row_positions)) < probs[row_positions]).astype(np.float32)
    rows = len(row_positions)
    tokens = np.zeros((rows, 4), np.int32)
    tokens[:, 0] = row_positions
    tokens[:, 2] = reward
    prompt_mask = np.zeros((rows, 4), bool)
    prompt_mask[:, :2] = True
    zeros = jnp.zeros((rows, 4), jnp.float32)
    rollout = Rollout(tokens=jnp.asarray(tokens), prompt_mask=jnp.asarray(prompt_mask),
                      completion_mask=jnp.asarray(~prompt_mask), behavior_logp=zeros,
                      version=jnp.zeros((rows, 4), jnp.int32), group=jnp.zeros((rows,), jnp.int32),
                      reward=jnp.asarray(reward), advantages=zeros)
    # Each row's ScoredRow names its position, so a test can follow it into the batch.
    scored = [ScoredRow(str(p), "", Verdict("correct" if r else "wrong_value"))
              for p, r in zip(row_positions.tolist(), reward)]
    return ScoredSamples(rollout=rollout, completions=[""] * rows, exact=reward == 1,
                         rows=scored, decode_steps=2)
  return sample


def _run(kind_config, probs, steps, *, prompts=4, pool=None, seed=0, state=None, cursor=0,
         calls=None):
  """`steps` collect() calls; returns the list of Collected and the final (state, cursor)."""
  pool = len(probs) if pool is None else pool
  if state is None:
    state = selection.init_state(pool, kind_config)
  sample = _bernoulli_sampler(probs, calls)
  rng = jax.random.PRNGKey(seed)
  out = []
  for step in range(steps):
    collected = selection.collect(state, cursor, jax.random.fold_in(rng, cursor), sample,
                                  settings=kind_config, prompts_per_step=prompts, group_size=G,
                                  pool_size=pool)
    state, cursor = collected.selection, collected.cursor
    out.append(collected)
  return out, state, cursor


# --- adaptive allocation -------------------------------------------------------------------

def test_allocate_hand_computed():
  # D'Hondt on scores / counts from 2 each, 4 extra: A, A, then A and C tie at 0.125 and C
  # (fewer rollouts) wins, then A. B (score 0) gets nothing.
  counts = selection.allocate(np.array([0.5, 0.0, 0.25]), initial=2, budget=10, max_rollouts=8)
  np.testing.assert_array_equal(counts, [5, 2, 3])
  with pytest.raises(ValueError, match="budget"):
    selection.allocate(np.ones(3), initial=4, budget=10, max_rollouts=8)


@pytest.mark.parametrize("seed", range(5))
def test_allocate_conserves_budget_exactly(seed):
  gen = np.random.default_rng(seed)
  n = int(gen.integers(2, 20))
  initial = int(gen.integers(1, 4))
  max_rollouts = initial + int(gen.integers(1, 10))
  budget = int(gen.integers(n * initial, n * max_rollouts + 1))
  scores = gen.random(n) * (gen.random(n) < 0.6)  # many exact zeros
  counts = selection.allocate(scores, initial=initial, budget=budget, max_rollouts=max_rollouts)
  assert counts.sum() == budget
  assert counts.min() >= initial and counts.max() <= max_rollouts


def test_allocate_approaches_neyman_proportions():
  # With a large budget and no cap, D'Hondt gives n_i within one rollout of budget * s_i / sum(s).
  scores = np.array([0.5, 0.1, 0.3, 0.1])
  counts = selection.allocate(scores, initial=1, budget=1000, max_rollouts=10_000)
  assert np.all(np.abs(counts - 1000 * scores / scores.sum()) <= 1.0)


# The pilot std is 0 for a deterministic prompt, so extras go almost only to coin flips; the
# Beta posterior std of a certain prompt stays ~2/3 of a coin flip's (prior + decayed
# history), so its allocation is softer. Uniform allocation would give 0.5.
@pytest.mark.parametrize("score,min_share", [("variance", 0.8), ("beta", 0.6)])
def test_adaptive_budget_conserved_and_concentrated_on_uncertain_prompts(score, min_share):
  # 16 prompts: even positions are deterministic (always right or always wrong), odd ones
  # are coin flips. Uniform GRPO gives each half 50% of the rollouts.
  probs = np.where(np.arange(16) % 2, 0.5, np.arange(16) % 4 == 0).astype(float)
  config = _config("adaptive", **{"adaptive.score": score, "adaptive.initial_rollouts": 2,
                                  "adaptive.max_rollouts": 16})
  out, _, cursor = _run(config, probs, steps=8, prompts=8)
  assert cursor == 8 * 8
  budget = 8 * G
  shares = []
  for collected in out:
    assert collected.rollout.tokens.shape[0] == budget == collected.stats.counters["rollouts"]
    # Share of the rollouts beyond the pilots that went to coin-flip prompts.
    positions = np.asarray(collected.rollout.tokens[:, 0])
    sizes = np.bincount(positions, minlength=16)
    extra = np.where(sizes > 0, sizes - 2, 0)
    shares.append(extra[probs == 0.5].sum() / extra.sum())
    # Groups are contiguous and every row of a rejected (all-equal) group is masked out.
    group = np.asarray(collected.rollout.group)
    assert np.all(np.diff(group) >= 0)
    reward = np.asarray(collected.rollout.reward)
    for g in np.unique(group):
      mixed = reward[group == g].std() > 0
      assert np.asarray(collected.rollout.completion_mask)[group == g].any() == mixed
    assert collected.stats.counters["informative_rows"] == np.asarray(
        collected.rollout.completion_mask).any(axis=1).sum()
    check_rows_follow_the_batch(collected)
  # beta needs a little history before deterministic prompts look certain: skip epoch 0.
  assert np.mean(shares[2:]) > min_share


def test_adaptive_scores_hand_computed():
  # variance: the pilot rewards' std.
  pilot = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.5, 0.0, 1.0]])
  scores = selection.allocation_scores(pilot, np.arange(3), None, _config("adaptive"))
  np.testing.assert_allclose(scores, [0.0, np.sqrt(2.0) / 3.0, np.sqrt(1.0 / 6.0)])
  # Beta(1 + 2 + 0.5 * 4, 1 + 0 + 0.5 * 1) = Beta(5, 1.5): std = sqrt(ab / ((a+b)^2 (a+b+1))).
  config = _config("adaptive", **{"adaptive.score": "beta", "adaptive.history_decay": 0.5})
  state = selection.init_state(2, config).replace(reward_sum=jnp.array([0.0, 4.0]),
                                                  failure_sum=jnp.array([0.0, 1.0]))
  scores = selection.allocation_scores(np.array([[1.0, 1.0]]), np.array([1]), state, config)
  a, b = 5.0, 1.5
  np.testing.assert_allclose(scores, [np.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))], rtol=1e-6)


# --- GRESO ---------------------------------------------------------------------------------

def test_greso_keep_probability_as_specified_and_matched_by_the_skip_frequency():
  config = _config("greso", **{"greso.min_keep_prob": 0.05, "greso.max_skips": 10})
  state = selection.init_state(6, config).replace(
      uninformative_run=jnp.array([0, 1, 3, 10, 2, 2]),
      uninformative_easy=jnp.array([True, True, True, True, True, False]),
      skip_run=jnp.array([0, 0, 0, 0, 10, 0]),
      explore_prob=jnp.array([0.5, 0.8]))
  keep = selection.keep_probability(state, np.arange(6), config)
  # z=0 -> 1; p_e**z; floor 0.05 (0.5**10 < 0.05); 10 skips in a row -> 1; hard class uses 0.8.
  np.testing.assert_allclose(keep, [1.0, 0.5, 0.125, 0.05, 1.0, 0.64], rtol=1e-6)
  # The skip frequency matches the keep probability.
  config = _config("greso", **{"greso.max_skips": 1000})
  pool = 50
  state = selection.init_state(pool, config).replace(
      uninformative_run=jnp.full((pool,), 2), explore_prob=jnp.array([0.5, 0.5]))
  kept = drawn = 0
  for i in range(40):  # skip runs reset per trial, so each candidate keeps with prob 0.25
    _, cursor, skipped, _ = selection.choose_prompts(state, 0, 10, jax.random.PRNGKey(i),
                                                     config, pool)
    kept, drawn = kept + 10, drawn + cursor
  assert abs(kept / drawn - 0.25) < 0.03


def test_greso_observe_updates_runs_counts_and_explore_prob():
  config = _config("greso", **{"greso.adapt_step": 0.1, "greso.target_zero_variance": 0.25,
                               "greso.explore_prob": 0.5, "adaptive.history_decay": 0.5})
  state = selection.init_state(4, config).replace(
      uninformative_run=jnp.array([2, 2, 0, 0]), reward_sum=jnp.array([2.0, 0, 0, 0]))
  state = selection.observe(state, np.array([0, 1, 2, 3]),
                            [np.array([1.0, 1.0]), np.array([0.0, 1.0]), np.array([1.0, 1.0]),
                             np.array([0.0, 0.0])], config)
  np.testing.assert_array_equal(state.uninformative_run, [3, 0, 1, 1])
  np.testing.assert_array_equal(state.uninformative_easy, [True, False, True, False])
  np.testing.assert_allclose(state.reward_sum, [3.0, 1.0, 2.0, 0.0])
  np.testing.assert_allclose(state.failure_sum, [0.0, 1.0, 0.0, 2.0])
  # Easy share 2/4 > 0.25 -> p_e down; hard share 1/4 is not above 0.25 -> p_e up.
  np.testing.assert_allclose(state.explore_prob, [0.4, 0.6], rtol=1e-6)


def test_greso_never_starves_a_prompt():
  # Every group is all-equal (p in {0, 1}), so GRESO would skip everything without its floor.
  probs = (np.arange(16) % 2).astype(float)
  config = _config("greso", **{"greso.refill": False, "greso.explore_prob": 0.3,
                               "greso.min_keep_prob": 0.05, "greso.max_skips": 6,
                               "greso.adapt_step": 0.0})
  calls = []
  out, _, cursor = _run(config, probs, steps=150, prompts=4, calls=calls)
  rolled = np.concatenate([c[::G] for c in calls])
  assert np.sum([c.stats.counters["prompts_skipped"] for c in out]) > 0.5 * cursor  # it does skip
  # A prompt skipped max_skips epochs in a row is rolled out next, so each prompt is rolled
  # out at least once in every max_skips + 1 = 7 of its epochs.
  per_prompt = np.bincount(rolled, minlength=16)
  assert per_prompt.min() >= (cursor // 16) // 7 > 0


@pytest.mark.parametrize("overrides", [{"greso.explore_prob": 1.0}, {"greso.max_skips": 0}])
def test_greso_with_skipping_disabled_equals_uniform(overrides):
  probs = np.random.default_rng(0).random(12) * (np.arange(12) % 3 > 0)
  greso = _config("greso", **{"greso.refill": False, "greso.adapt_step": 0.0, **overrides})
  uniform = _config("uniform")
  a, _, cursor_a = _run(greso, probs, steps=10)
  b, _, cursor_b = _run(uniform, probs, steps=10)
  assert cursor_a == cursor_b == 40
  for x, y in zip(a, b):
    jax.tree.map(np.testing.assert_array_equal, x.rollout, y.rollout)
    assert x.stats.counters["prompts_skipped"] == 0


def test_uniform_is_plain_grpo_batch():
  probs = np.full(8, 0.5)
  calls = []
  (collected,), _, cursor = _run(_config("uniform"), probs, steps=1, prompts=3, pool=0, calls=calls)
  assert cursor == 3
  np.testing.assert_array_equal(calls[0], np.repeat([0, 1, 2], G))
  reward = collected.rollout.reward
  group = jnp.repeat(jnp.arange(3), G)
  np.testing.assert_array_equal(collected.rollout.group, group)
  batch_advantages = advantages.group_relative(advantages.grpo_advantages)(collected.rollout)
  np.testing.assert_allclose(batch_advantages[:, 2], advantages.grpo_advantages(reward, group),
                             rtol=1e-6)


# --- PODS max-variance down-sampling -------------------------------------------------------

def _brute_force_max_variance(rewards, m):
  return max(np.var(np.asarray(rewards)[list(subset)])
             for subset in itertools.combinations(range(len(rewards)), m))


@pytest.mark.parametrize("seed", range(6))
def test_max_variance_subset_equals_brute_force(seed):
  draws = np.random.default_rng(seed)
  n, m = 10, int(draws.integers(1, 10))
  rewards = [draws.integers(0, 2, n).astype(float),  # binary, many ties
             draws.random(n),  # fractional partial credit
             np.round(draws.random(n) * 3) / 3,  # few levels
             np.full(n, 0.7)][seed % 4]  # all equal: any subset, variance 0
  chosen = selection.max_variance_subset(rewards, m)
  assert len(chosen) == m == len(set(chosen.tolist()))
  np.testing.assert_allclose(np.var(rewards[chosen]), _brute_force_max_variance(rewards, m),
                             atol=1e-12)


def test_max_variance_subset_hand_computed_and_refuses_bad_sizes():
  # 1 and 0 are the extremes: two of each give variance 0.25, the most four rows can have.
  assert selection.max_variance_subset(np.array([0.5, 1.0, 0.0, 0.5, 1.0, 0.0]),
                                       4).tolist() == [1, 2, 4, 5]
  with pytest.raises(ValueError, match="m = 7 must be in 1..6"):
    selection.max_variance_subset(np.zeros(6), 7)


def test_pods_trains_on_the_max_variance_rows_of_n_rollouts():
  calls = []
  (collected,), _, cursor = _run(_config("pods", **{"pods.rollouts": 3 * G}),
                                 np.full(6, 0.5), steps=1, prompts=2, pool=0, calls=calls)
  np.testing.assert_array_equal(calls[0], np.repeat([0, 1], 3 * G))  # n = 12 per prompt
  assert cursor == 2 and collected.stats.counters["rollouts"] == 2 * 3 * G
  reward = np.asarray(collected.rollout.reward).reshape(2, G)
  sampled = _bernoulli_sampler(np.full(6, 0.5))(np.repeat([0, 1], 3 * G), jax.random.fold_in(
      jax.random.PRNGKey(0), 0))
  sampled = np.asarray(sampled.rollout.reward).reshape(2, 3 * G)
  for kept, all_rows in zip(reward, sampled):
    np.testing.assert_allclose(np.var(kept), _brute_force_max_variance(all_rows, G))
  np.testing.assert_array_equal(collected.rollout.group, np.repeat([0, 1], G))


# --- AR3PO ---------------------------------------------------------------------------------

def _versioned_sampler(probs, calls):
  """The Bernoulli sampler whose rows record the call that sampled them: version = the
  call's index, behavior_logp = -(call + 1) / 10 on the completion slots (so a reused row
  is recognisable by both)."""
  sample = _bernoulli_sampler(probs, calls)

  def versioned(row_positions, key):
    samples = sample(row_positions, key)
    call = len(calls) - 1
    r = samples.rollout
    return dataclasses.replace(samples, rollout=r.replace(
        version=jnp.where(r.completion_mask, call, -1).astype(jnp.int32),
        behavior_logp=jnp.where(r.completion_mask, -(call + 1) / 10, 0.0)))
  return versioned


def _collect_ar3po(state, probs, cursor, calls, prompts=4, pool=4):
  return selection.collect(state, cursor, jax.random.PRNGKey(cursor),
                           _versioned_sampler(probs, calls), settings=_config("ar3po"),
                           prompts_per_step=prompts, group_size=G, pool_size=pool)


def test_ar3po_stops_sampling_a_prompt_once_it_has_an_exact_answer():
  """Two stages of G / 2 = 2: prompt 0, answered exactly in stage 1, gets no stage 2; the
  other three do, sampled as four prompts (a power of two: the copy of prompt 3 is decoded
  and dropped). The batch keeps 4 x G rows, the unused ones padding rows of their own
  groups."""
  calls = []
  state = selection.init_state(4, _config("ar3po"), sequence_length=4)
  collected = _collect_ar3po(state, np.array([1.0, 0.0, 0.0, 0.0]), 0, calls)
  np.testing.assert_array_equal(calls[0], np.repeat([0, 1, 2, 3], 2))
  np.testing.assert_array_equal(calls[1], np.repeat([1, 2, 3, 3], 2))
  group = np.asarray(collected.rollout.group)
  np.testing.assert_array_equal(group, [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 5])
  mask = np.asarray(collected.rollout.completion_mask)
  assert mask[:14].any(axis=1).all() and not mask[14:].any()
  counters = collected.stats.counters
  assert counters["rollouts"] == 16 and counters["stage_padding_rows"] == 2
  assert counters["padding_rows"] == 2 and counters["reused_responses"] == 0
  assert collected.stats.decoded_tokens == 16 * 2  # every decoded row, the dropped copy too
  # Only prompt 0 is stored (its last exact row).
  memory = collected.selection.memory
  np.testing.assert_array_equal(memory.stored, [True, False, False, False])
  np.testing.assert_array_equal(memory.version[0], [-1, -1, 0, 0])


def test_ar3po_reuses_a_stored_response_with_its_log_probs_and_version():
  """Visit 1 solves every prompt (stored from call 0); visit 2 fails them all: after both
  stages each group's last row is the stored response, with call 0's version and
  log-probs, so every group has a non-zero advantage."""
  calls = []
  state = selection.init_state(4, _config("ar3po"), sequence_length=4)
  first = _collect_ar3po(state, np.ones(4), 0, calls)
  second = _collect_ar3po(first.selection, np.zeros(4), 4, calls)
  assert len(calls) == 3  # visit 2: both stages
  r = second.rollout
  group, reward = np.asarray(r.group), np.asarray(r.reward)
  version, logp = np.asarray(r.version), np.asarray(r.behavior_logp)
  assert second.stats.counters["reused_responses"] == 4
  for i in range(4):
    rows = np.flatnonzero(group == i)
    assert len(rows) == G
    np.testing.assert_array_equal(reward[rows], [0, 0, 0, 1])
    np.testing.assert_array_equal(version[rows[-1]], [-1, -1, 0, 0])
    np.testing.assert_allclose(logp[rows[-1]], [0, 0, -0.1, -0.1])
    assert (version[rows[:-1]][:, 2:] > 0).all()  # the fresh rows: calls 1 and 2
  adv = advantages.group_relative(advantages.grpo_advantages)(r)
  assert (np.abs(np.asarray(adv)[np.asarray(r.completion_mask)]) > 0).all()
  assert [row is None for row in second.stats.rows[:G]] == [False, False, False, True]


def test_ar3po_without_reuse_keeps_no_memory_and_trains_all_wrong_groups_as_they_are():
  calls = []
  config = _config("ar3po", **{"ar3po.reuse": False})
  state = selection.init_state(4, config)
  assert state.memory is None
  collected = selection.collect(state, 0, jax.random.PRNGKey(0),
                                _versioned_sampler(np.zeros(4), calls), settings=config,
                                prompts_per_step=4, group_size=G, pool_size=4)
  assert collected.stats.counters["reused_responses"] == 0
  assert not np.asarray(collected.rollout.reward).any()


def test_ar3po_memory_checkpoint_round_trip_resumes_exactly(tmp_path):
  """Two steps that solve part of the pool, a checkpoint, two steps that solve nothing (so
  the stored responses are reused): the restored memory equals the saved one and the
  resumed steps' batches equal the uninterrupted run's."""
  config = _config("ar3po")
  solve = lambda step: np.array([1.0, 0.0, 0.5, 0.8, 1.0, 0.0]) if step < 2 else np.zeros(6)

  def steps(state, cursor, first, count):
    out = []
    for step in range(first, first + count):
      collected = _collect_ar3po(state, solve(step), cursor, [], pool=6)
      state, cursor = collected.selection, collected.cursor
      out.append(collected)
    return out, state, cursor

  full, _, _ = steps(selection.init_state(6, config, sequence_length=4), 0, 0, 4)
  _, saved, saved_cursor = steps(selection.init_state(6, config, sequence_length=4), 0, 0, 2)
  manager = checkpoint.make_manager(str(tmp_path))
  checkpoint.save(manager, 2, {"selection": saved}, {"data_cursor": saved_cursor})
  _, restored, meta = checkpoint.restore_latest(
      manager, {"selection": selection.init_state(6, config, sequence_length=4)})
  jax.tree.map(np.testing.assert_array_equal, restored["selection"], saved)
  resumed, _, _ = steps(restored["selection"], meta["data_cursor"], 2, 2)
  for expected, got in zip(full[2:], resumed):
    jax.tree.map(np.testing.assert_array_equal, got.rollout, expected.rollout)
  assert sum(c.stats.counters["reused_responses"] for c in resumed) >= 2  # prompts 0 and 4


# --- dynamic sampling ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dynamic", "greso"])
def test_dynamic_sampling_never_yields_zero_variance_group(kind):
  gen = np.random.default_rng(1)
  probs = np.where(gen.random(32) < 0.6, gen.random(32) < 0.5, 0.5).astype(float)
  out, _, cursor = _run(_config(kind), probs, steps=20, prompts=4)
  refilled = 0
  for collected in out:
    reward = np.asarray(collected.rollout.reward).reshape(4, G)
    assert reward.shape == (4, G)
    assert np.all(reward.std(axis=1) > 0)
    assert collected.stats.counters["batch_informative_groups"] == 1.0
    assert collected.stats.counters["informative_rows"] == 4 * G
    check_rows_follow_the_batch(collected)
    refilled += collected.stats.counters["rollout_rounds"] > 1
  assert refilled > 0  # the data did force refills


def check_rows_follow_the_batch(collected):
  """The batch's scored rows (what training samples show) are its own rows, in its order,
  whichever rounds and reordering made it: each names the position the row answers."""
  positions = np.asarray(collected.rollout.tokens[:, 0]).tolist()
  assert [int(row.prompt) for row in collected.stats.rows] == positions
  correct = [row.verdict.category == "correct" for row in collected.stats.rows]
  np.testing.assert_array_equal(correct, np.asarray(collected.rollout.reward) == 1)


def test_dynamic_sampling_errors_when_data_cannot_fill_a_batch():
  probs = (np.arange(8) % 2).astype(float)  # every group all-equal
  with pytest.raises(ValueError, match="max_attempts"):
    _run(_config("dynamic", max_attempts=3), probs, steps=1)


# --- checkpointing -------------------------------------------------------------------------

def test_selection_state_checkpoint_round_trip_resumes_exactly(tmp_path):
  probs = np.random.default_rng(2).random(10) * (np.arange(10) % 2)
  config = _config("greso", **{"greso.adapt_step": 0.05})
  full, _, _ = _run(config, probs, steps=6)
  _, state, cursor = _run(config, probs, steps=3)

  manager = checkpoint.make_manager(str(tmp_path))
  checkpoint.save(manager, 3, {"selection": state}, {"data_cursor": cursor})
  like = {"selection": selection.init_state(10, config)}
  step, restored, meta = checkpoint.restore_latest(manager, like)
  assert step == 3
  jax.tree.map(np.testing.assert_array_equal, restored["selection"], state)
  rest, _, _ = _run(config, probs, steps=3, state=restored["selection"], cursor=meta["data_cursor"])
  for x, y in zip(full[3:], rest):
    jax.tree.map(np.testing.assert_array_equal, x.rollout, y.rollout)
    assert x.cursor == y.cursor


@pytest.mark.parametrize("kind,overrides,prompts,pool,message", [
    ("greso", {}, 4, 0, "train_pool"), ("best", {}, 4, 0, "kind"),
    ("adaptive", {"adaptive.initial_rollouts": 8}, 4, 0, "initial_rollouts"),
    ("pods", {"pods.rollouts": G}, 2, 0, "config.selection.pods.rollouts = 4: PODS rolls out"),
    ("ar3po", {"ar3po.stages": 3}, 2, 4, "ar3po.stages = 3 must divide"),
    ("ar3po", {}, 2, 0, "needs recurring prompts")])
def test_check_errors_name_the_field(kind, overrides, prompts, pool, message):
  with pytest.raises(ValueError, match=message):
    selection.check(_config(kind, **overrides), prompts_per_step=prompts, group_size=G,
                    pool_size=pool)


# --- the loop with a real (tiny) policy ----------------------------------------------------

def _tiny_loop(kind, pool, **overrides):
  """A fresh LoopState, GRPO LoopContext and producer for the tiny model, 2 prompts x 2
  rollouts."""
  from models import transformer  # pylint: disable=import-outside-toplevel
  from models.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  from rl import loop  # pylint: disable=import-outside-toplevel
  from rl import tasks  # pylint: disable=import-outside-toplevel
  from rl import train  # pylint: disable=import-outside-toplevel

  config = chain_sum_compact.get_config()
  config.rollout.prompts_per_step, config.rollout.group_size = 2, 2
  config.task.train_pool = pool
  config.selection.kind = kind
  apply_overrides(config.selection, overrides)
  tokenizer = CharTokenizer()
  task = tasks.make_task("chain_sum", seed=0, eval_size=10, **config.task.difficulty)
  run = wiring.settings(config)
  _, model_config, _ = wiring.load_policy(run, jax.random.PRNGKey(0))
  ctx, optimizer = wiring.make_context(run, task, tokenizer, model_config, wiring.RL)
  producer = wiring.make_rl_producer(run, ctx)
  params = transformer.init_params(model_config, jax.random.PRNGKey(0))
  state = loop.LoopState(train=train.init_train_state(params, optimizer), rng=jax.random.PRNGKey(1),
                         producer=producer.init(0), stages=ctx.stages.init())
  return state, ctx, producer


@pytest.mark.slow
def test_loop_uniform_is_unchanged_and_greso_without_skipping_equals_it(tmp_path):
  from rl import loop  # pylint: disable=import-outside-toplevel
  from rl.rollouts import batches as rollout_lib  # pylint: disable=import-outside-toplevel

  state, ctx, producer = _tiny_loop("uniform", pool=0)
  b = ctx.batch
  # The GRPO iteration before rl.rollouts.selection existed: sample G per prompt, one train step.
  _, sample_rng = jax.random.split(state.rng)
  examples = b.task.examples("train", 2, 0)
  samples = rollout_lib.sample_and_score(
      state.train.params, examples, task=b.task, tokenizer=b.tokenizer, rng=sample_rng,
      group_size=2, prompt_len=b.prompt_len, model_config=b.model_config,
      sampling_config=b.sampling_config, version=0)
  grpo = advantages.group_relative(advantages.grpo_advantages)
  batch = samples.rollout.replace(advantages=grpo(samples.rollout))
  reference, _ = ctx.train_step(jax.tree.map(jnp.copy, state.train), batch)

  uniform, _ = loop.grpo_iteration(state, ctx, producer)
  jax.tree.map(np.testing.assert_array_equal, uniform.train.params, reference.params)
  assert int(uniform.producer.cursor) == 2

  greso_state, greso_ctx, greso = _tiny_loop("greso", pool=3, **{"greso.explore_prob": 1.0,
                                                                 "greso.refill": False})
  for _ in range(2):  # the pool of 3 wraps around in the second step
    greso_state, metrics = loop.grpo_iteration(greso_state, greso_ctx, greso)
  uniform_producer = producers.independent(greso_ctx.batch, _config("uniform"))
  uniform_state = greso_state.replace(train=_tiny_loop("uniform", pool=3)[0].train,
                                      rng=jax.random.PRNGKey(1), producer=uniform_producer.init(0))
  for _ in range(2):  # the same jitted step, the same pool
    uniform_state, _ = loop.grpo_iteration(uniform_state, greso_ctx, uniform_producer)
  jax.tree.map(np.testing.assert_array_equal, greso_state.train.params, uniform_state.train.params)
  assert metrics["prompts_skipped"] == 0 and int(greso_state.producer.cursor) == 4


@pytest.mark.slow
def test_loop_resumes_selection_state_exactly_from_a_checkpoint(tmp_path):
  from rl import loop  # pylint: disable=import-outside-toplevel

  state, ctx, producer = _tiny_loop("adaptive", pool=4, **{"adaptive.initial_rollouts": 2,
                                                           "adaptive.score": "beta"})
  like = state
  state, _ = loop.grpo_iteration(state, ctx, producer)
  manager = checkpoint.make_manager(str(tmp_path))
  checkpoint.save(manager, 1, state, {})  # the LoopState is all a resume needs
  uninterrupted, _ = loop.grpo_iteration(state, ctx, producer)

  _, restored, _ = checkpoint.restore_latest(manager, like)
  assert int(restored.producer.cursor) == 2  # adaptive reads 2 prompts a step
  jax.tree.map(np.testing.assert_array_equal, restored.producer.history, state.producer.history)
  resumed, _ = loop.grpo_iteration(restored, ctx, producer)
  jax.tree.map(np.testing.assert_array_equal, resumed.producer.history,
               uninterrupted.producer.history)
  jax.tree.map(np.testing.assert_array_equal, resumed.train.params, uninterrupted.train.params)


def test_greso_through_the_launcher_skips_prompts_on_the_chain_sum_task(tmp_path):
  """`--config.selection.kind=greso --config.task.train_pool=...` on chain_sum: the
  barely warm-started policy fails every prompt (all-equal groups), so the second pass over
  the pool of 2 skips them, counted in metrics.jsonl and summary.json."""
  config = tiny_run_config(tmp_path, {"selection.kind": "greso", "task.train_pool": 2})
  config.selection.greso.update(explore_prob=0.05, adapt_step=0.0, refill=False)
  summary = launcher.run(config)
  steps = rl_steps(tmp_path)
  assert [s["prompts_skipped"] > 0 for s in steps] == [False, True]
  assert summary["prompts_skipped"] == sum(s["prompts_skipped"] for s in steps) > 0


def test_tree_and_partial_rollouts_cycle_over_the_train_pool(monkeypatch):
  """task.train_pool reaches every producer: the tree and partial producers read train
  position cursor mod pool, like selection does."""
  from rl.rollouts import batches as rollout_lib  # pylint: disable=import-outside-toplevel
  from rl import tasks  # pylint: disable=import-outside-toplevel

  task = tasks.make_task("chain_sum", seed=0, eval_size=10)
  pool = [task.examples("train", 1, p)[0] for p in range(3)]
  read = []

  class Stop(Exception):
    pass

  def fake_tree_sample_and_score(params, examples, **kwargs):
    del params, kwargs
    read.extend(examples)
    raise Stop

  monkeypatch.setattr(rollout_lib, "tree_sample_and_score", fake_tree_sample_and_score)
  ctx = producers.BatchContext(task=task, tokenizer=None, model_config=None,
                               sampling_config=None, prompt_len=8, prompts_per_step=4,
                               group_size=2, train_pool=3)
  tree = producers.tree(ctx, object())
  with pytest.raises(Stop):
    tree.produce(tree.init(2), None, 0, jax.random.PRNGKey(0), 0)
  assert read == [pool[2], pool[0], pool[1], pool[2]]
  # The partial pool's groups read their prompts the same way (rl.rollouts.partial.for_task).
  assert [ctx.example(i) for i in (3, 7)] == [pool[0], pool[1]]
