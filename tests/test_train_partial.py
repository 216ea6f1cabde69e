"""End-to-end tests of experiments.train with partial rollouts and async training: a
killed-and-resumed run (the pool checkpointed in the LoopState) equals an uninterrupted
one, and nothing is lost."""

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import train as launcher
from tests.launcher_config import rl_steps, tiny_run_config


def _config(workdir, rl_steps, **rollout):
  c = tiny_run_config(workdir, {
      "rl.steps": rl_steps, "rollout.group_size": 2, "rollout.kind": "partial",
      "rollout.num_slots": 8, "rollout.resume": "reprefill", "eval.every": 100,
      "checkpoint.every": 100})
  c.rollout.update(rollout)
  return c


def _final_params(workdir):
  manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")))
  restored = manager.restore(manager.latest_step())
  return restored["state"]["train"]["params"], restored["meta"]


def _final_producer(workdir):
  """The partial producer's state in the newest checkpoint (cursor, pool, ledger)."""
  manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")))
  return manager.restore(manager.latest_step())["state"]["producer"]



@pytest.mark.slow
def test_partial_run_resumed_from_checkpoint_equals_uninterrupted_run(tmp_path):
  whole = launcher.run(_config(tmp_path / "whole", 4))
  launcher.run(_config(tmp_path / "split", 2))
  longer = _config(tmp_path / "split", 4)
  longer.resume.allow_changes = "rl.steps"
  split = launcher.run(longer)  # resumes the pool from the checkpoint
  params_whole, meta_whole = _final_params(tmp_path / "whole")
  params_split, meta_split = _final_params(tmp_path / "split")
  for key in ("embed", "final_norm"):
    np.testing.assert_array_equal(np.asarray(params_whole[key]), np.asarray(params_split[key]))
  producer_whole, producer_split = _final_producer(tmp_path / "whole"), _final_producer(
      tmp_path / "split")
  assert producer_whole["ledger"] == producer_split["ledger"]
  assert producer_whole["cursor"] == producer_split["cursor"]
  assert producer_split["pool"]["sampler"]["cache"] is None  # a checkpoint keeps no KV cache
  assert not os.path.exists(tmp_path / "split" / "trajectories")  # no side files
  ledger = split["partial_ledger"]
  assert ledger == whole["partial_ledger"]
  assert ledger["finished"] == 4 * 2  # prompts_per_step groups per RL step
  # Groups in flight are in the stored pool: started = finished + discarded + in flight.
  in_flight = ledger["started"] - ledger["finished"] - ledger["discarded"]
  assert 0 < in_flight <= 8 // 2
  rl_records = rl_steps(tmp_path / "split")
  assert [r["step"] for r in rl_records] == [4, 5, 6, 7]
  assert rl_records[-1]["groups_in_flight"] == in_flight


@pytest.mark.slow
def test_async_partial_run_keeps_the_bound(tmp_path):
  config = _config(tmp_path, 4, resume="kept_kv")
  config.rl.async_ = True
  config.rl.max_staleness = 1
  config.checkpoint.every = 2
  summary = launcher.run(config)
  steps = rl_steps(tmp_path)
  assert len(steps) == 4
  assert max(r["staleness"] for r in steps) <= 1
  ledger = summary["partial_ledger"]
  assert ledger["finished"] == 8
  assert ledger["started"] >= ledger["finished"] + ledger["discarded"]
