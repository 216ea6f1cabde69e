"""Crash-safe exact resume: rl.checkpoint and experiments.train.

- A run of N steps equals N/2 steps + SIGKILL during the next checkpoint save + resume,
  bit for bit (final state digest and metrics.jsonl, wall-clock time_* and *_per_s
  fields aside).
- A corrupt, partial or swapped checkpoint falls back to the previous complete step with
  a warning, or raises a clear error; it is never restored silently.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import provenance
from experiments.configs import chain_sum_compact
from experiments import train as launcher
from rl import checkpoint
from tests.launcher_config import KILLED_RUN, tiny_run_config, without_clock

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_config(workdir, overrides=None):
  return tiny_run_config(workdir, {
      "task.eval_size": 8, "eval.batch_size": 8, "rollout.prompts_per_step": 4,
      "rollout.group_size": 2, "warm_start.steps": 2, "rl.steps": 4, "checkpoint.every": 1,
      "checkpoint.max_to_keep": 2, **(overrides or {})})




def _final_meta(workdir):
  manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"))
  step = manager.latest_step()
  with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
    return step, json.load(f)


# LoRA: the kill falls in the RL phase, so the resume restores adapters, their optimiser
# state and the frozen base (a checkpoint structure other than the warm start's). TTRL: the
# reward stage's vote memory (every RL step revisits the pool's 4 prompts, so its flip
# counts in the logs read what the checkpoint restored). A chain of batch stages (rl/stages.py):
# the vote, the sampler's record for score centering, the advantages, the training samples
# and NAT's prefix cut, whose draws come from the restored key.
@pytest.mark.parametrize("overrides", [
    {}, {"lora.rank": 2}, {"reward.kind": "majority_vote", "task.train_pool": 4},
    {"reward.kind": "majority_vote", "task.train_pool": 4,
     "loss.corrections": ("score_centering",), "loss.token_subsample": "rpc",
     "metrics.train_samples_every": 1}],
    ids=["full", "lora", "ttrl", "stage-chain"])
@pytest.mark.slow
def test_killed_during_save_resumes_bit_for_bit(overrides, tmp_path):
  reference = _tiny_config(tmp_path / "reference", overrides)
  launcher.run(reference)
  total = reference.warm_start.steps + reference.rl.steps

  resumed = _tiny_config(tmp_path / "resumed", overrides)
  kill_step = total // 2 + 1  # the run dies saving step N/2 + 1, so resumes from N/2
  env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  child = subprocess.run([sys.executable, "-c", KILLED_RUN, resumed.to_json(), str(kill_step)],
                         cwd=_REPO, env=env, capture_output=True, text=True, timeout=600)
  assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
  ckpt_dir = tmp_path / "resumed" / "checkpoints"
  assert os.path.isdir(ckpt_dir / f"{kill_step}.orbax-checkpoint-tmp")  # killed mid-save
  assert checkpoint.make_manager(str(ckpt_dir)).latest_step() == total // 2
  lines_at_kill = (tmp_path / "resumed" / "metrics.jsonl").read_text().count("\n")

  launcher.run(resumed)
  assert not os.path.exists(ckpt_dir / f"{kill_step}.orbax-checkpoint-tmp")  # cleaned up
  step_a, meta_a = _final_meta(str(tmp_path / "reference"))
  step_b, meta_b = _final_meta(str(tmp_path / "resumed"))
  assert step_a == step_b == total
  assert meta_a["state_digest"] == meta_b["state_digest"]  # params, optimiser, RNG, step
  assert without_clock(meta_a) == without_clock(meta_b)
  log_a = (tmp_path / "reference" / "metrics.jsonl").read_text()
  log_b = (tmp_path / "resumed" / "metrics.jsonl").read_text()
  assert [without_clock(json.loads(line)) for line in log_a.splitlines()] == [
      without_clock(json.loads(line)) for line in log_b.splitlines()]
  assert lines_at_kill > log_a.count("\n") // 3  # the kill left records to cut back
  # The digest can tell states apart: the step before the last has another one.
  with open(tmp_path / "reference" / "checkpoints" / str(total - 1) / "meta" / "metadata") as f:
    assert json.load(f)["state_digest"] != meta_a["state_digest"]

  # A rerun of the finished run restores its last step and changes nothing.
  launcher.run(resumed)
  assert (tmp_path / "resumed" / "metrics.jsonl").read_text() == log_b
  assert _final_meta(str(tmp_path / "resumed")) == (step_b, meta_b)


def _state(seed):
  keys = jax.random.split(jax.random.PRNGKey(seed), 2)
  return {"w": jax.random.normal(keys[0], (64, 32)), "step": jnp.asarray(seed, jnp.int32),
          "rng": keys[1]}


def _saved_steps(directory, steps=(1, 2, 3)):
  manager = checkpoint.make_manager(str(directory), max_to_keep=5)
  for step in steps:
    checkpoint.save(manager, step, _state(step), {"step": step})
  return manager


def _assert_state_is(restored, step):
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(_state(step)["w"]))


def _data_files(step_dir):
  return [os.path.join(root, f) for root, _, files in os.walk(step_dir) for f in files
          if f"{os.sep}d{os.sep}" in os.path.join(root, f) + os.sep]


@pytest.mark.parametrize("damage", ["truncate_data", "drop_commit_marker", "delete_meta",
                                    "swap_state_with_older_step", "garbage_data"])
def test_damaged_latest_checkpoint_falls_back_to_previous(damage, tmp_path):
  _saved_steps(tmp_path)
  step3 = tmp_path / "3"
  if damage == "truncate_data":
    for path in _data_files(step3):
      with open(path, "r+b") as f:
        f.truncate(max(os.path.getsize(path) // 2, 1))
  elif damage == "drop_commit_marker":
    os.remove(step3 / "commit_success.txt")
  elif damage == "delete_meta":
    shutil.rmtree(step3 / "meta")
  elif damage == "swap_state_with_older_step":  # restores without error, wrong values
    shutil.rmtree(step3 / "state")
    shutil.copytree(tmp_path / "1" / "state", step3 / "state")
  else:
    for path in _data_files(step3):
      data = bytearray(open(path, "rb").read())
      data[len(data) // 2:] = os.urandom(len(data) - len(data) // 2)
      open(path, "wb").write(bytes(data))
  manager = checkpoint.make_manager(str(tmp_path), max_to_keep=5)
  step, state, meta = checkpoint.restore_latest(manager, _state(0))
  assert step == 2 and meta["step"] == 2
  _assert_state_is(state, 2)
  assert (tmp_path / "3.corrupt").is_dir() and not step3.exists()
  checkpoint.save(manager, 3, _state(3), {"step": 3})  # the run can save step 3 again
  assert checkpoint.restore_latest(manager, _state(0))[0] == 3


def test_no_intact_checkpoint_raises_and_moves_nothing(tmp_path):
  _saved_steps(tmp_path, steps=(1, 2))
  manager = checkpoint.make_manager(str(tmp_path))
  # A run restarted with another model config: every step restores to the wrong digest.
  like = {"w": jnp.zeros((64, 32), jnp.bfloat16), "step": jnp.zeros((), jnp.int32),
          "rng": jax.random.PRNGKey(0)}
  with pytest.raises(ValueError, match=r"No checkpoint .* restores(.|\n)*step 2(.|\n)*step 1"):
    checkpoint.restore_latest(manager, like)
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_empty_directory_and_leftover_temporary_directory(tmp_path):
  manager = checkpoint.make_manager(str(tmp_path))
  assert checkpoint.restore_latest(manager, _state(0)) is None
  _saved_steps(tmp_path, steps=(1,))
  os.makedirs(tmp_path / "2.orbax-checkpoint-tmp" / "state")  # a save killed mid-write
  reader = checkpoint.make_manager(str(tmp_path))  # a reader (eval) leaves it alone
  assert reader.latest_step() == 1 and (tmp_path / "2.orbax-checkpoint-tmp").exists()
  manager = checkpoint.make_manager(str(tmp_path), remove_unfinished=True)
  step, state, _ = checkpoint.restore_latest(manager, _state(0))
  assert step == 1
  _assert_state_is(state, 1)
  assert not (tmp_path / "2.orbax-checkpoint-tmp").exists()


def test_resume_false_refuses_to_overwrite(tmp_path):
  config = _tiny_config(tmp_path)
  _saved_steps(tmp_path / "checkpoints", steps=(1,))
  config.resume.enabled = False
  with pytest.raises(ValueError, match="resume.enabled=False"):
    launcher.run(config)


def _launch(workdir, *flags):
  """`python -m experiments.train` on the compact chain_sum config, as a user launches it."""
  return subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=experiments/configs/chain_sum_compact.py",
       f"--config.workdir={workdir}", *flags], cwd=_REPO, capture_output=True, text=True,
      timeout=600, env=dict(os.environ, PYTHONPATH=_REPO))


@pytest.mark.slow
def test_resuming_under_another_config_is_refused_unless_allowed(tmp_path):
  """A killed GRPO run (lr 1e-4, seed 0) relaunched in its workdir as DAPO at lr 1e-2 and
  seed 5 is refused before step 1, naming each field with both values; more RL steps are
  refused too unless --config.resume.allow_changes names rl.steps, and then the run
  resumes, with both launches recorded."""
  config = _tiny_config(tmp_path, {"rl.steps": 1, "rl.learning_rate": 1e-4})
  launcher.run(config)
  launches = [json.loads(line) for line in open(tmp_path / "launches.jsonl")]
  assert len(launches) == 1 and launches[0]["config"]["rl"]["learning_rate"] == 1e-4
  records = (tmp_path / "metrics.jsonl").read_text()

  # Probe: another objective, learning rate and seed in the same workdir.
  changed = _tiny_config(tmp_path, {"rl.steps": 1, "rl.learning_rate": 1e-2,
                                    "loss.name": "dapo", "loss.aggregation": "token_mean"})
  changed.seed = 5
  with pytest.raises(ValueError) as refused:
    launcher.run(changed)
  message = str(refused.value)
  for line in ("config.loss.name: 'grpo' -> 'dapo'", "config.rl.learning_rate: 0.0001 -> 0.01",
               "config.seed: 0 -> 5"):
    assert line in message, message
  # Through the launcher: the same refusal, with the fix on the command line.
  more = _tiny_config(tmp_path, {"rl.steps": 2, "rl.learning_rate": 1e-4})
  file_config = provenance.result_fields(chain_sum_compact.get_config())
  flags = [f"--config.{path}={after}" for path, (_, after) in provenance.changed_fields(
      file_config, provenance.result_fields(more)).items()]
  child = _launch(tmp_path, *flags)
  assert child.returncode != 0
  assert "config.rl.steps: 1 -> 2" in child.stderr, child.stderr[-2000:]
  assert "--config.resume.allow_changes=rl.steps\n" in child.stderr  # the only change
  assert (tmp_path / "metrics.jsonl").read_text() == records  # nothing was touched
  assert len(open(tmp_path / "launches.jsonl").readlines()) == 1

  more.resume.allow_changes = "rl.steps"
  summary = launcher.run(more)
  assert summary["steps"] == more.warm_start.steps + 2
  launches = [json.loads(line) for line in open(tmp_path / "launches.jsonl")]
  assert [launch["allowed_changes"] for launch in launches] == [{}, {"rl.steps": [1, 2]}]
  assert launches[0]["fingerprint"] != launches[1]["fingerprint"]
  with pytest.raises(ValueError, match="names 'rl.stepz', which is no field"):
    launcher.run(_tiny_config(tmp_path, {"rl.steps": 2, "rl.learning_rate": 1e-4,
                                         "resume.allow_changes": "rl.stepz"}))


def test_a_checkpoint_of_the_older_layout_is_refused_with_the_way_out(tmp_path):
  """Checkpoints written before the producer state joined the LoopState kept the data
  cursor in their meta; resuming one is refused with a message, and nothing is moved."""
  config = _tiny_config(tmp_path, {"rl.steps": 1})
  launcher.run(config)
  step, meta = _final_meta(tmp_path)
  with open(os.path.join(tmp_path, "checkpoints", str(step), "meta", "metadata"), "w") as f:
    json.dump(dict(meta, data_cursor=12), f)
  config.rl.steps = 2
  config.resume.allow_changes = "rl.steps"
  with pytest.raises(ValueError, match="older Arbor .* start a new config.workdir"):
    launcher.run(config)
  assert not any(name.endswith(".corrupt") for name in os.listdir(tmp_path / "checkpoints"))


def test_a_field_added_since_the_recorded_launch_is_not_compared(tmp_path):
  """Code that gained a config field since a run was launched still resumes it (the new
  field's default is taken to be what the older code did); the new launch lists the field
  as not compared. A field both launches have is still compared."""
  config = _tiny_config(tmp_path)
  older = provenance.launch_record(config, {"commit": "abc", "dirty": False,
                                            "diff_sha256": "", "diff": ""}, {})
  del older["result_fields"]["task.template"]  # launched before the field existed
  assert provenance.check_resume(config, [older]) == {}
  record = provenance.launch_record(config, provenance.source_state(), {}, older)
  assert record["fields_not_compared"] == ["task.template"]
  config.rl.learning_rate = 0.5
  with pytest.raises(ValueError, match="config.rl.learning_rate: .* -> 0.5"):
    provenance.check_resume(config, [older])
