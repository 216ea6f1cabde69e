"""experiments/eval.py on a tiny run: it restores the run's checkpoints (both phases), its
greedy numbers equal the launcher's own held-out evaluations, and it writes JSON + markdown.
The run also leaves TensorBoard event files next to metrics.jsonl. With nothing to evaluate
the command prints its usage. (A run from a pretrained checkpoint: tests/test_pretrained.py.)"""

import json
import os
import subprocess
import sys

import pytest

from experiments import eval as eval_launcher
from experiments import train as train_launcher
from tests.launcher_config import tiny_run_config

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(workdir, overrides=None):
  return tiny_run_config(workdir, {"checkpoint.max_to_keep": 5, **(overrides or {})})


# LoRA: the RL checkpoint holds adapters over a frozen base; eval merges them.
@pytest.mark.parametrize("overrides", [{}, {"lora.rank": 2}], ids=["full", "lora"])
@pytest.mark.slow
def test_eval_restores_checkpoints_and_matches_the_launchers_evaluations(overrides, tmp_path):
  config = tiny_config(tmp_path, overrides)
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
  # main() turns this error into the usage message (the subprocess test below).
  with pytest.raises(eval_launcher.NoCheckpointsError, match="train first"):
    eval_launcher.run(tiny_config(tmp_path), progress=False)
  assert not (tmp_path / "checkpoints").exists()  # a reader creates nothing
  (tmp_path / "checkpoints").mkdir()  # a workdir whose checkpoints are all gone
  with pytest.raises(eval_launcher.NoCheckpointsError, match="train first"):
    eval_launcher.run(tiny_config(tmp_path), progress=False)


def test_no_flags_and_no_checkpoints_print_usage_without_a_traceback(tmp_path):
  # The default workdir (runs/default, relative to the working directory) holds nothing.
  result = subprocess.run([sys.executable, "-m", "experiments.eval"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=_REPO, JAX_PLATFORMS="cpu"))
  assert result.returncode == 1
  assert "Traceback" not in result.stdout + result.stderr
  assert "Nothing to evaluate. No checkpoints in runs/default/checkpoints" in result.stderr
  assert "usage: python -m experiments.eval --config.workdir=" in result.stderr
  assert not (tmp_path / "runs").exists()  # a reader creates nothing


def test_positional_arguments_print_usage(capsys):
  with pytest.raises(SystemExit) as exited:
    eval_launcher.main(["eval", "runs/short"])
  assert exited.value.code == 1
  err = capsys.readouterr().err
  assert "Unexpected arguments ['runs/short']: name the run with --config.workdir" in err
  assert eval_launcher.USAGE in err
