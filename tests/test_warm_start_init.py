"""Shared warm starts (config.warm_start.init_from): a run's RL phase starts from another
run's finished warm start exactly as if it had trained that warm start itself."""

import json
import os
import shutil

import numpy as np
import pytest

from experiments import train as launcher
from tests.launcher_config import records, tiny_run_config, without_clock
from rl import wiring


def _config(workdir, **overrides):
  return tiny_run_config(workdir, {"task.eval_size": 8, "eval.batch_size": 8,
                                   "rollout.prompts_per_step": 2, "rollout.group_size": 4,
                                   "warm_start.steps": 3, "rl.steps": 3, "eval.every": 2,
                                   "checkpoint.every": 2, **overrides})


def _records(workdir) -> list[dict]:
  """metrics.jsonl without its wall-clock fields (time_*, *_per_s)."""
  return [without_clock(record) for record in records(workdir)]


@pytest.fixture(scope="module")
def warm_start_dir(tmp_path_factory):
  """A warm start alone: the tiny run with no RL steps (as experiments/grids/warm_starts.py
  makes them)."""
  workdir = tmp_path_factory.mktemp("warm")
  launcher.run(_config(workdir, **{"rl.steps": 0}))
  return str(workdir)


@pytest.mark.parametrize("overrides", [{}, {"rl.staleness": 2}, {"lora.rank": 2},
                                       {"task.train_pool": 8, "selection.kind": "greso"}],
                         ids=["plain", "staleness", "lora", "finite_pool"])
@pytest.mark.slow
def test_run_from_a_shared_warm_start_equals_one_that_trained_its_own(
    warm_start_dir, tmp_path, overrides):
  own = launcher.run(_config(tmp_path / "own", **overrides))
  shared = launcher.run(_config(tmp_path / "shared", **overrides,
                                **{"warm_start.init_from": warm_start_dir}))
  assert _records(tmp_path / "shared") == _records(tmp_path / "own")
  clock_free = lambda s: {k: v for k, v in s.items()
                          if k not in ("wall_time_s", "time_s", "rollout_time_s", "time_rl_s",
                                       "time_rl_at_evals_s", "time_sample_median_s",
                                       "warm_start_from")
                          and not k.endswith("_per_s")}
  assert clock_free(shared) == clock_free(own)
  assert shared["warm_start_from"] == os.path.abspath(warm_start_dir)
  assert len(shared["accuracy_curve"]) == 3  # warm start end, RL steps 2 and 3
  # The RL phase trained here, from the warm start's step on (steps 4..6).
  rl_steps = [r["step"] for r in _records(tmp_path / "shared")
              if r["phase"] == "rl" and "loss" in r]
  assert rl_steps == [4, 5, 6]


@pytest.mark.slow
def test_a_stopped_run_from_a_shared_warm_start_resumes_from_its_own_checkpoint(
    warm_start_dir, tmp_path):
  whole = launcher.run(_config(tmp_path / "whole", **{"warm_start.init_from": warm_start_dir}))
  launcher.run(_config(tmp_path / "parts", **{"warm_start.init_from": warm_start_dir,
                                              "rl.steps": 1}))
  parts = launcher.run(_config(tmp_path / "parts", **{"warm_start.init_from": warm_start_dir,
                                                      "resume.allow_changes": "rl.steps"}))
  # The first launch ended with an evaluation at its last step; the training records match.
  steps = lambda workdir: [r for r in _records(workdir) if "loss" in r]
  assert steps(tmp_path / "parts") == steps(tmp_path / "whole")
  assert parts["final_accuracy"] == whole["final_accuracy"]


@pytest.mark.slow
def test_a_run_on_a_mesh_starts_from_a_single_device_warm_start(warm_start_dir, tmp_path):
  """The restored warm-start weights are placed in the mesh's sharding (data 2 x fsdp 4 on
  8 devices) and train as the single-device run from the same warm start does."""
  single = launcher.run(_config(tmp_path / "one", **{"warm_start.init_from": warm_start_dir}))
  sharded = launcher.run(_config(tmp_path / "mesh", **{"warm_start.init_from": warm_start_dir,
                                                       "mesh.data": 2, "mesh.fsdp": -1}))
  assert sharded["warm_start_accuracy"] == single["warm_start_accuracy"]  # copied records
  losses = lambda workdir: [r["loss"] for r in _records(workdir)
                            if r["phase"] == "rl" and "loss" in r]
  np.testing.assert_allclose(losses(tmp_path / "mesh"), losses(tmp_path / "one"),
                             rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("field, value", [
    ("seed", 1), ("task.eval_size", 16), ("warm_start.learning_rate", 1e-3),
    ("rollout.max_new_tokens", 8), ("model.preset", "tiny2"),
    ("model.compute_dtype", "bfloat16")])
def test_a_warm_start_trained_otherwise_is_refused_naming_the_field(
    warm_start_dir, tmp_path, field, value):
  config = _config(tmp_path, **{"warm_start.init_from": warm_start_dir, field: value})
  with pytest.raises(ValueError, match=rf"config\.{field} = .*this run has"):
    wiring.validate(config)


def test_a_memory_switch_does_not_make_the_warm_start_another(warm_start_dir, tmp_path):
  """model.remat trades memory for compute: a run with it starts from a warm start trained
  without (and from one whose config.json predates it and model.compute_dtype, read as
  their defaults)."""
  wiring.validate(_config(tmp_path, **{"warm_start.init_from": warm_start_dir,
                                       "model.remat": "full", "rl.logprob_chunk": 4}))
  older = tmp_path / "older"
  shutil.copytree(warm_start_dir, older)
  saved = json.loads((older / "config.json").read_text())
  del saved["model"]["remat"], saved["model"]["compute_dtype"]
  (older / "config.json").write_text(json.dumps(saved))
  wiring.validate(_config(tmp_path, **{"warm_start.init_from": str(older)}))


def test_init_from_a_folder_that_is_no_run_or_without_warm_start_is_refused(tmp_path):
  with pytest.raises(ValueError, match="holds no config.json"):
    wiring.validate(_config(tmp_path, **{"warm_start.init_from": str(tmp_path / "none")}))
  with pytest.raises(ValueError, match="no warm start to take"):
    wiring.validate(_config(tmp_path, **{"warm_start.init_from": str(tmp_path),
                                           "warm_start.steps": 0}))


def test_a_source_without_its_warm_start_checkpoint_is_refused(tmp_path):
  # A run that went on into RL with checkpoints every step keeps only the newest two.
  source = tmp_path / "source"
  launcher.run(_config(source, **{"checkpoint.every": 1, "checkpoint.max_to_keep": 1}))
  with pytest.raises(ValueError, match="no checkpoint at the end of its warm start"):
    launcher.run(_config(tmp_path / "run", **{"warm_start.init_from": str(source)}))
