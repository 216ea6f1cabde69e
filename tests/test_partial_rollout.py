"""Tests for rl.rollouts.partial and rl.rollouts.trajectory_store: conservation, staleness, resume."""

import jax
import numpy as np
import pytest

from models import transformer
from models.config import get_preset
from rl.rollouts import partial as partial_rollout
from rl.rollouts import trajectory_store
from sampling.partial import PartialConfig
from sampling.sampler import SamplingConfig

MODEL = get_preset("tiny", max_seq_len=64)
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


def _run(rollouts, steps, first_step, cursor, rng, record):
  """`steps` batches; each taken group is checked against its own prompt and recorded."""
  for step in range(first_step, first_step + steps):
    rng, key = jax.random.split(rng)
    gen, ids, cursor, stats = rollouts.next_batch(PARAMS, step, key, cursor)
    tokens, prompt_mask = np.asarray(gen.tokens), np.asarray(gen.prompt_mask)
    for row in range(tokens.shape[0]):
      assert _decode_id(tokens[row, :PROMPT], prompt_mask[row, :PROMPT]) == ids[row // 2]
    assert np.asarray(gen.completion_len).min() >= 1
    record["started"] += list(stats.started)
    record["trained"] += list(stats.finished)
    record["discarded"] += list(stats.discarded)
    record["batches"].append(jax.device_get((gen.tokens, gen.behavior_logp, gen.version)))
  return cursor, rng


def _new_record():
  return {"started": [], "trained": [], "discarded": [], "batches": []}


def _check_conservation(record, rollouts):
  started, trained, discarded = record["started"], record["trained"], record["discarded"]
  in_flight = list(rollouts.in_flight_ids())
  assert len(set(started)) == len(started), "a group was started twice"
  assert len(set(trained)) == len(trained), "a group was trained twice"
  everything = trained + discarded + in_flight
  assert len(everything) == len(set(everything)), "a group is in two places"
  assert sorted(everything) == sorted(started), "a started group was lost"
  ledger = rollouts.ledger
  assert (ledger.started, ledger.finished, ledger.discarded) == (
      len(started), len(trained), len(discarded))
  assert ledger.started == ledger.finished + ledger.discarded + len(in_flight)


@pytest.mark.parametrize("resume,max_staleness", [("reprefill", None), ("kept_kv", 1)])
def test_conservation_over_many_steps(resume, max_staleness):
  rollouts = _rollouts(resume, max_staleness)
  record = _new_record()
  _run(rollouts, 15, 0, 0, jax.random.PRNGKey(0), record)
  _check_conservation(record, rollouts)
  if max_staleness is not None:
    assert record["discarded"], "the staleness bound never discarded anything (vacuous)"
  if resume == "reprefill":
    # Finish everything in flight: the pool empties and every group is accounted for.
    gen, ids, stats = rollouts.drain(PARAMS, 99, jax.random.PRNGKey(9))
    assert len(ids) == len(set(record["started"]) - set(record["trained"])
                           - set(record["discarded"]))
    assert bool(np.asarray(gen.completion_len).min() >= 1) and stats.decode_steps > 0
    record["trained"] += list(ids)
  else:
    record["discarded"] += list(rollouts.discard_all())
  assert len(rollouts.in_flight_ids()) == 0
  _check_conservation(record, rollouts)


def test_staleness_bound_discards_old_groups():
  rollouts = _rollouts(max_staleness=1)
  rng, cursor = jax.random.PRNGKey(1), 0
  for step in range(10):
    rng, key = jax.random.split(rng)
    gen, _, cursor, _ = rollouts.next_batch(PARAMS, step, key, cursor)
    version = np.asarray(gen.version)[np.asarray(gen.completion_mask)]
    assert step - version.min() <= 1


def test_checkpoint_and_resume_loses_and_duplicates_nothing(tmp_path):
  rng = jax.random.PRNGKey(3)
  whole = _rollouts()
  before = _new_record()
  cursor, rng_mid = _run(whole, 5, 0, 0, rng, before)
  store = trajectory_store.TrajectoryStore(str(tmp_path))
  store.save_pool(5, whole.arrays())  # what a checkpoint at step 5 keeps
  ledger = whole.ledger.as_dict()
  after_whole = _new_record()
  _run(whole, 6, 5, cursor, rng_mid, after_whole)  # the uninterrupted run goes on

  # A fresh process restores step 5 from the store (no KV cache) and continues.
  resumed = _rollouts()
  resumed.load(store.load_pool(5, partial_rollout.POOL_FIELDS), ledger)
  assert resumed.needs_full_refresh
  after = _new_record()
  _run(resumed, 6, 5, cursor, rng_mid, after)
  # Re-prefill recomputes every prefix each round anyway, so the resumed run is identical.
  for batch_whole, batch_resumed in zip(after_whole["batches"], after["batches"]):
    for x, y in zip(batch_whole, batch_resumed):
      np.testing.assert_array_equal(x, y)
  # Conservation across the restart: before + after the checkpoint, then the pool.
  merged = {k: before[k] + after[k] for k in ("started", "trained", "discarded")}
  assert set(before["started"]) & set(after["started"]) == set()
  _check_conservation(merged, resumed)
  assert resumed.ledger == whole.ledger


def test_store_rejects_a_pool_of_another_shape(tmp_path):
  store = trajectory_store.TrajectoryStore(str(tmp_path))
  small = _rollouts()
  store.save_pool(0, small.arrays())
  other = partial_rollout.PartialRollouts(
      PartialConfig(num_slots=8, group_size=2), MODEL, SAMPLING, PROMPT, target_groups=2,
      prompt_fn=_prompt_fn)
  with pytest.raises(ValueError, match="same\\s+config.rollout"):
    other.load(store.load_pool(0, partial_rollout.POOL_FIELDS), small.ledger.as_dict())


def test_store_prunes_snapshots_of_dropped_checkpoints(tmp_path):
  store = trajectory_store.TrajectoryStore(str(tmp_path))
  for step in (1, 2, 3):
    store.save_pool(step, {"x": np.arange(step)})
  store.prune([3])
  np.testing.assert_array_equal(store.load_pool(3, ["x"])["x"], np.arange(3))
  with pytest.raises(ValueError, match="missing"):
    store.load_pool(1, ["x"])
