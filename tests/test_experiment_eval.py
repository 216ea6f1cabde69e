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
from rl import wiring
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

  # A LoRA run leaves its final adapters as a PEFT folder; evaluated on the base policy
  # they reproduce the launcher's final greedy numbers. A full-weight run leaves none.
  adapter = tmp_path / "adapter"
  assert adapter.is_dir() == ("lora.rank" in overrides)
  if adapter.is_dir():
    [row] = eval_launcher.run(config, adapter=str(adapter), num_samples=2, ks=(1,),
                              progress=False)
    assert row["step"] == "adapter"
    assert row["greedy_accuracy"] == evals[5]["eval_accuracy"]
    assert row["greedy_length"] == pytest.approx(evals[5]["eval_length"])
    with pytest.raises(ValueError, match="drop --steps=all"):
      eval_launcher.run(config, adapter=str(adapter), steps="all", progress=False)

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


def test_initial_evaluates_the_untrained_policy_without_a_checkpoint(tmp_path):
  # --steps=initial: the policy the launcher starts from (preset initialised from
  # PRNGKey(seed)), as step 0; no checkpoint is read or needed.
  config = tiny_config(tmp_path)
  rows = eval_launcher.run(config, steps=eval_launcher.INITIAL, num_samples=4, ks=(1, 4),
                           num_examples=8, progress=False)
  assert [r["step"] for r in rows] == [0]
  assert not (tmp_path / "checkpoints").exists()
  # An untrained character-level policy: nothing right, so no group is mixed.
  assert rows[0]["greedy_accuracy"] == 0.0 and rows[0]["pass@4"] == 0.0
  assert rows[0]["mixed"] == 0.0
  # The same weights the launcher builds: another seed gives other greedy completions.
  other = eval_launcher.initial_params(wiring.settings(tiny_config(tmp_path, {"seed": 1})))
  same = eval_launcher.initial_params(wiring.settings(config))
  assert not (other["embed"] == same["embed"]).all()
  assert (eval_launcher.initial_params(wiring.settings(config))["embed"] == same["embed"]).all()


def test_mixed_share_counts_groups_neither_all_right_nor_all_wrong():
  assert eval_launcher.mixed_share([0, 1, 7, 8, 4], 8) == pytest.approx(3 / 5)
  assert eval_launcher.mixed_share([0, 0], 8) == 0.0
  assert eval_launcher.mixed_share([8, 8], 8) == 0.0
  assert eval_launcher.mixed_share([1], 1) == 0.0  # one sample is never mixed


@pytest.mark.slow
def test_trained_prompts_are_the_prompts_the_launcher_trained_on(tmp_path):
  """`trained_prompts` (what an evaluation's overlap check compares its problems with)
  equals the prompts of every RL row the launcher trained on, read from its training
  samples (all rows kept at every step); an evaluation on the run's own train split shares
  exactly those, and one on its held-out split none."""
  config = tiny_config(tmp_path, {"metrics.train_samples_every": 1,
                                  "metrics.train_samples": 8})
  train_launcher.run(config)
  seen = set()
  for path in (tmp_path / "samples").glob("train_*.jsonl"):
    seen |= {json.loads(line)["prompt"] for line in path.read_text().splitlines()}
  run = wiring.settings(config)
  trained = eval_launcher.trained_prompts(run, config.seed)
  assert trained == seen and len(trained) == config.rl.steps * config.rollout.prompts_per_step
  task = eval_launcher.build_policy(run).task
  start = config.warm_start.steps * config.warm_start.batch_size
  on_train = task.examples("train", 6, start - 2)  # 2 warm-start prompts, then 4 trained
  record = eval_launcher.provenance_record(run, on_train, 0, [config.seed])
  assert record["overlap_with_training"] == {str(config.seed): 4}
  held_out = eval_launcher.provenance_record(run, task.examples("eval", 16), 0,
                                             [config.seed])
  assert held_out["overlap_with_training"] == {str(config.seed): 0}
  assert held_out["problems_sha256"] != record["problems_sha256"]
