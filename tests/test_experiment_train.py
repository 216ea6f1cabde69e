"""The launcher end to end on tiny settings: outputs on disk, resume, and config errors."""

import json
import os

import pytest

from experiments import train as train_launcher
from tests.launcher_config import tiny_run_config


def tiny_config(workdir, **rl):
  return tiny_run_config(workdir, {"rl.steps": rl.get("steps", 2)})


def test_default_run_writes_metrics_plot_checkpoint_and_resumes(tmp_path):
  summary = train_launcher.run(tiny_config(tmp_path))
  for name in ("metrics.jsonl", "plot.png", "summary.json", "checkpoints", "config.json"):
    assert os.path.exists(tmp_path / name), name
  saved = json.load(open(tmp_path / "config.json"))
  assert saved["rl"]["steps"] == tiny_config(tmp_path).rl.steps
  assert saved["task"]["name"] == tiny_config(tmp_path).task.name
  assert summary["steps"] == 5
  assert 0.0 <= summary["warm_start_accuracy"] <= 1.0
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]

  # Asking for more GRPO steps in the same workdir continues from the checkpoint at step 5.
  summary = train_launcher.run(tiny_config(tmp_path, steps=4))
  assert summary["steps"] == 7
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("field,value,message", [
    ("loss.name", "ppo2", "Unknown loss 'ppo2'"),
    ("task.name", "sudoku9", "Unknown task 'sudoku9'"),
    ("rl.num_microbatches", 3, "not divisible"),
    ("rl.num_minibatches", 3, "num_minibatches \\* num_microbatches = 3"),
    ("rl.ppo_epochs", 0, "ppo_epochs = 0 must be >= 1"),
    ("rollout.group_size", 1, "at least 2 completions"),
    ("rollout.prompt_len", 3, "raise config.rollout.prompt_len"),
])
def test_bad_config_gives_a_clear_error(tmp_path, field, value, message):
  config = tiny_config(tmp_path)
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ValueError, match=message):
    train_launcher.run(config)


def test_mu_grpo_trains_in_large_stages(tmp_path):
  """docs/concepts.md's stage recipe at tiny size: --config.loss.name=mu_grpo, stages of
  2 minibatches x 2 epochs = 4 updates on one rollout batch of 4 prompts. Every update after
  a stage's first trains on older data, so the stage's mean ratio is not 1 (it is exactly 1,
  with approx_kl_behavior 0, when each rollout batch takes one update)."""
  config = tiny_run_config(tmp_path, {
      "loss.name": "mu_grpo", "rollout.prompts_per_step": 4, "rl.num_minibatches": 2,
      "rl.ppo_epochs": 2, "warm_start.steps": 0, "task.eval_size": 8, "eval.batch_size": 8})
  summary = train_launcher.run(config)
  assert summary["steps"] == 2 and summary["nonfinite_updates"] == 0
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  stages = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert len(stages) == 2
  for stage in stages:
    assert 0.0 <= stage["vetoed_fraction"] <= 1.0 and "vetoed_response_fraction" in stage
    assert stage["ratio_mean"] != 1.0 and stage["approx_kl_behavior"] > 0
