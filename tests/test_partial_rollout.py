"""Tests for rl.rollouts.partial: conservation, staleness, and resuming a checkpointed pool."""

import jax
import numpy as np
import pytest

from models import transformer
from rl import checkpoint
from rl.rollouts import partial as partial_rollout
from sampling.partial import PartialConfig
from sampling.sampler import SamplingConfig
from tests import tiny

MODEL = tiny.model(vocab_size=64, max_seq_len=64)
PROMPT = 5
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=1.0, stop_tokens=tuple(range(2, 12)))
PARAMS = transformer.init_params(MODEL, jax.random.PRNGKey(0), init_std=0.1)


def _prompt_fn(ids):
  """Prompt of group `i`: BOS then the digits of i (token 20 + digit), left-padded."""
  tokens = np.zeros((len(ids), PROMPT), np.int32)
  mask = np.zeros((len(ids), PROMPT), bool)
  for row, i in enumerate(ids):
    digits = [20 + int(d) for d in str(int(i))]
    ids_ = [1] + digits
    tokens[row, PROMPT - len(ids_):] = ids_
    mask[row, PROMPT - len(ids_):] = True
  return tokens, mask


def _decode_id(prompt_tokens, prompt_mask):
  return int("".join(str(t - 20) for t in prompt_tokens[prompt_mask][1:]))


def _rollouts(resume="reprefill", max_staleness=None):
  return partial_rollout.PartialRollouts(
      PartialConfig(num_slots=12, group_size=2, resume=resume), MODEL, SAMPLING, PROMPT,
      target_groups=2, prompt_fn=_prompt_fn, max_staleness=max_staleness)


def _run(rollouts, state, steps, first_step, rng, record):
  """`steps` batches; each taken group is checked against its own prompt and recorded.
  Returns (state, rng)."""
  for step in range(first_step, first_step + steps):
    rng, key = jax.random.split(rng)
    gen, ids, stats, state = rollouts.next_batch(state, PARAMS, step, key)
    tokens, prompt_mask = np.asarray(gen.tokens), np.asarray(gen.prompt_mask)
    for row in range(tokens.shape[0]):
      assert _decode_id(tokens[row, :PROMPT], prompt_mask[row, :PROMPT]) == ids[row // 2]
    assert np.asarray(gen.completion_len).min() >= 1
    record["started"] += list(stats.started)
    record["trained"] += list(stats.finished)
    record["discarded"] += list(stats.discarded)
    record["batches"].append(jax.device_get((gen.tokens, gen.behavior_logp, gen.version)))
  return state, rng


def _new_record():
  return {"started": [], "trained": [], "discarded": [], "batches": []}


def _check_conservation(record, state):
  started, trained, discarded = record["started"], record["trained"], record["discarded"]
  in_flight = list(partial_rollout.PartialRollouts.in_flight_ids(state))
  assert len(set(started)) == len(started), "a group was started twice"
  assert len(set(trained)) == len(trained), "a group was trained twice"
  everything = trained + discarded + in_flight
  assert len(everything) == len(set(everything)), "a group is in two places"
  assert sorted(everything) == sorted(started), "a started group was lost"
  ledger = state.ledger.as_dict()
  assert (ledger["started"], ledger["finished"], ledger["discarded"]) == (
      len(started), len(trained), len(discarded))
  assert ledger["started"] == ledger["finished"] + ledger["discarded"] + len(in_flight)


@pytest.mark.parametrize("resume,max_staleness", [("reprefill", None), ("kept_kv", 1)])
@pytest.mark.slow
def test_conservation_over_many_steps(resume, max_staleness):
  rollouts = _rollouts(resume, max_staleness)
  record = _new_record()
  state, _ = _run(rollouts, rollouts.init(), 15, 0, jax.random.PRNGKey(0), record)
  _check_conservation(record, state)
  if max_staleness is not None:
    assert record["discarded"], "the staleness bound never discarded anything (vacuous)"
  if resume == "reprefill":
    # Finish everything in flight: the pool empties and every group is accounted for.
    gen, ids, stats, state = rollouts.drain(state, PARAMS, 99, jax.random.PRNGKey(9))
    assert len(ids) == len(set(record["started"]) - set(record["trained"])
                           - set(record["discarded"]))
    assert bool(np.asarray(gen.completion_len).min() >= 1) and stats.decode_steps > 0
    record["trained"] += list(ids)
  else:
    discarded, state = rollouts.discard_all(state)
    record["discarded"] += list(discarded)
  assert len(rollouts.in_flight_ids(state)) == 0
  _check_conservation(record, state)


def test_staleness_bound_discards_old_groups():
  rollouts = _rollouts(max_staleness=1)
  rng, state = jax.random.PRNGKey(1), rollouts.init()
  for step in range(10):
    rng, key = jax.random.split(rng)
    gen, _, _, state = rollouts.next_batch(state, PARAMS, step, key)
    version = np.asarray(gen.version)[np.asarray(gen.completion_mask)]
    assert step - version.min() <= 1


@pytest.mark.slow
def test_checkpoint_and_resume_loses_and_duplicates_nothing(tmp_path):
  rng = jax.random.PRNGKey(3)
  rollouts = _rollouts()
  before = _new_record()
  state, rng_mid = _run(rollouts, rollouts.init(), 5, 0, rng, before)
  manager = checkpoint.make_manager(str(tmp_path))
  saved = rollouts.for_checkpoint(state)  # what a checkpoint at step 5 keeps: no KV cache
  assert saved.pool.sampler.cache is None
  checkpoint.save(manager, 5, saved, {})
  after_whole = _new_record()
  _run(rollouts, state, 6, 5, rng_mid, after_whole)  # the uninterrupted run goes on

  # A fresh process restores step 5 (no KV cache: its next round re-prefills) and continues.
  resumed = _rollouts()
  _, restored, _ = checkpoint.restore_latest(manager, resumed.for_checkpoint(resumed.init()))
  assert int(restored.cursor) == int(state.cursor) > 0
  after = _new_record()
  restored, _ = _run(resumed, restored, 6, 5, rng_mid, after)
  # Re-prefill recomputes every prefix each round anyway, so the resumed run is identical.
  for batch_whole, batch_resumed in zip(after_whole["batches"], after["batches"]):
    for x, y in zip(batch_whole, batch_resumed):
      np.testing.assert_array_equal(x, y)
  # Conservation across the restart: before + after the checkpoint, then the pool.
  merged = {k: before[k] + after[k] for k in ("started", "trained", "discarded")}
  assert set(before["started"]) & set(after["started"]) == set()
  _check_conservation(merged, restored)


def test_a_pool_of_another_shape_does_not_restore(tmp_path):
  small = _rollouts()
  manager = checkpoint.make_manager(str(tmp_path))
  checkpoint.save(manager, 0, small.for_checkpoint(small.init()), {})
  other = partial_rollout.PartialRollouts(
      PartialConfig(num_slots=8, group_size=2, resume="reprefill"), MODEL, SAMPLING, PROMPT, target_groups=2,
      prompt_fn=_prompt_fn)
  with pytest.raises(ValueError, match="No checkpoint .* restores"):
    checkpoint.restore_latest(manager, other.for_checkpoint(other.init()))
