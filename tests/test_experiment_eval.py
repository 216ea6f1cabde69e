"""experiments/eval.py on a tiny run: it restores the run's checkpoints (both phases), its
greedy numbers equal the launcher's own held-out evaluations, and it writes JSON + markdown.
The run also leaves TensorBoard event files next to metrics.jsonl."""

import json

import pytest

from experiments import eval as eval_launcher
from experiments import train as train_launcher
from tests.launcher_config import tiny_run_config


def tiny_config(workdir):
  return tiny_run_config(workdir, {"checkpoint.max_to_keep": 5})


def test_eval_restores_checkpoints_and_matches_the_launchers_evaluations(tmp_path):
  config = tiny_config(tmp_path)
  train_launcher.run(config)
  assert list(tmp_path.glob("events.out.tfevents.*")), "no TensorBoard file next to metrics.jsonl"
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  evals = {r["step"]: r for r in records if "eval_accuracy" in r}

  rows = eval_launcher.run(config, steps="all", num_samples=4, ks=(1, 2, 4), progress=False)
  assert [r["step"] for r in rows] == [2, 3, 5]  # 2 is a warm-start-phase checkpoint
  for row in rows:
    assert row["pass@1"] <= row["pass@2"] <= row["pass@4"]
    assert row["examples"] == 16 and row["num_samples"] == 4
    assert 1.0 <= row["sampled_length"] <= config.rollout.max_new_tokens
  # Steps 3 (end of the warm start) and 5 (end of GRPO) were evaluated by the launcher with
  # the same greedy decoding: restored parameters must reproduce its numbers exactly.
  for row in rows[1:]:
    assert row["greedy_accuracy"] == evals[row["step"]]["eval_accuracy"]
    assert row["greedy_length"] == pytest.approx(evals[row["step"]]["eval_length"])

  saved = json.loads((tmp_path / "eval" / "eval.json").read_text())
  assert saved == rows
  table = (tmp_path / "eval" / "eval.md").read_text().splitlines()
  assert table[0].startswith("| step | task | examples | greedy_accuracy")
  assert len(table) == 2 + len(rows)

  assert eval_launcher.checkpoint_steps(config, "latest") == [5]
  with pytest.raises(ValueError, match="does not hold"):
    eval_launcher.checkpoint_steps(config, "4")
  with pytest.raises(ValueError, match="pass@8 needs"):
    eval_launcher.run(config, num_samples=4, ks=(8,), progress=False)


def test_eval_without_checkpoints_says_to_train_first(tmp_path):
  with pytest.raises(ValueError, match="train first"):
    eval_launcher.run(tiny_config(tmp_path), progress=False)
