"""The launcher end to end on tiny settings: outputs on disk, resume, and config errors."""

import json
import os
import subprocess
import sys

import pytest

from experiments import train as train_launcher
from rl import train as rl_train
from tests import rl_fixtures
from tests.launcher_config import tiny_run_config
from tests.metrics_fixtures import FakeWandb, read_events, scalars, texts
from experiments import run_records


def tiny_config(workdir, **rl):
  return tiny_run_config(workdir, {"rl.steps": rl.get("steps", 2)})


@pytest.mark.slow
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
  check_step_metrics(tiny_config(tmp_path), records, summary)
  check_tensorboard(tmp_path, records, config_steps=[0])

  # Asking for more GRPO steps in the same workdir continues from the checkpoint at step 5.
  longer = tiny_config(tmp_path, steps=4)
  longer.resume.allow_changes = "rl.steps"  # a meant change, named on relaunch
  summary = train_launcher.run(longer)
  assert summary["steps"] == 7
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6, 7]
  check_step_metrics(tiny_config(tmp_path, steps=4), records, summary)
  check_tensorboard(tmp_path, records, config_steps=[0, 5])  # one config text per launch


def check_step_metrics(config, records: list[dict], summary: dict) -> None:
  """Each step's learning rate is its phase's schedule at that update; its phase times are
  positive and within the step's wall time; its token rates are its counts over its
  times; summary.json holds the totals (over launches, too)."""
  warm = [r for r in records if r["phase"] == "warm_start" and "loss" in r]
  rl = [r for r in records if r["phase"] == "rl" and "loss" in r]
  evals = [r for r in records if "eval_accuracy" in r]
  w = config.warm_start
  warm_rate = rl_train.learning_rate_schedule(
      w.learning_rate, warmup_steps=w.warmup_steps,
      decay_steps=max(w.steps - w.warmup_steps, 1), end_lr_fraction=0.1)
  rl_rate = rl_train.learning_rate_schedule(config.rl.learning_rate,
                                            warmup_steps=config.rl.warmup_steps)
  for update, record in enumerate(warm):
    assert record["learning_rate"] == pytest.approx(float(warm_rate(update)), rel=1e-5)
    assert 0 < record["time_train_s"] <= record["time_step_s"]
    assert record["trained_tokens_per_s"] == pytest.approx(
        record["trained_tokens"] / record["time_train_s"])
  for update, record in enumerate(rl):
    assert record["learning_rate"] == pytest.approx(float(rl_rate(update)), rel=1e-5)
    parts = [record[f"time_{part}_s"] for part in ("sample", "score", "train")]
    assert min(parts) > 0 and sum(parts) <= record["time_step_s"]
    assert record["sampled_tokens_per_s"] == pytest.approx(
        record["sampled_tokens"] / record["time_sample_s"])
    assert record["trained_tokens_per_s"] == pytest.approx(
        record["trained_tokens"] / record["time_train_s"])
  assert all(r["time_eval_s"] > 0 for r in evals)
  assert summary["tokens"] == {
      "warm_start_trained": sum(r["trained_tokens"] for r in warm),
      "sampled": sum(r["sampled_tokens"] for r in rl),
      "trained": sum(r["trained_tokens"] for r in rl)}
  assert summary["tokens"]["sampled"] > 0 and summary["tokens"]["warm_start_trained"] > 0
  assert list(summary["time_s"]) == ["warm_start", "rollout", "train", "eval"]
  assert summary["rollout_time_s"]["sample"] == pytest.approx(
      sum(r["time_sample_s"] for r in rl))
  assert summary["sampled_tokens_per_s"] == pytest.approx(
      summary["tokens"]["sampled"] / summary["rollout_time_s"]["sample"])
  # Each evaluation carries the RL tokens sampled before it and the RL steps' wall time at
  # it (evaluations and checkpoints excluded), for accuracy against tokens and wall time.
  curve = summary["accuracy_curve"]
  assert [e["step"] for e in curve] == [r["step"] for r in evals]
  assert [e["sampled_tokens"] for e in curve] == [
      sum(r["sampled_tokens"] for r in rl if r["step"] <= e["step"]) for e in curve]
  assert len(summary["time_rl_at_evals_s"]) == len(curve)
  assert summary["time_rl_at_evals_s"] == sorted(summary["time_rl_at_evals_s"])
  assert summary["time_rl_at_evals_s"][0] == 0.0  # the warm start's evaluation
  rl_steps_s = sum(r["time_step_s"] for r in rl)
  assert rl_steps_s <= summary["time_rl_s"] <= rl_steps_s + 5.0
  assert summary["time_rl_at_evals_s"][-1] <= summary["time_rl_s"]


def check_tensorboard(workdir, records: list[dict], config_steps: list[int]) -> None:
  """Held-out accuracy is one TensorBoard series over both phases, at the evaluations'
  steps; the config is a text at the step each launch started from."""
  events = read_events(workdir)
  accuracy = [(step, value) for step, tag, value in scalars(events) if tag == "eval/accuracy"]
  assert [step for step, _ in accuracy] == [r["step"] for r in records if "eval_accuracy" in r]
  assert not [tag for _, tag, _ in scalars(events) if tag.endswith("/eval_accuracy")]
  configs = [(step, text) for step, tag, text in texts(events) if tag == "config/text_summary"]
  assert [step for step, _ in configs] == config_steps
  assert all('"workdir": ' + json.dumps(str(workdir)) in text for _, text in configs)


def test_wandb_gets_the_run_through_the_launcher(tmp_path, monkeypatch):
  fake = FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  config = tiny_run_config(tmp_path, {"warm_start.steps": 1, "rl.steps": 1,
                                      "metrics.wandb_project": "arbor",
                                      "metrics.tensorboard": False})
  train_launcher.run(config)
  (run,) = fake.runs
  assert run.init["project"] == "arbor" and run.init["config"]["rl"]["steps"] == 1
  assert run.finished and '"wandb_project": "arbor"' in run.summary["config"]
  logged = [(step, tag) for step, scalars_at in run.logged for tag in scalars_at]
  assert (1, "warm_start/learning_rate") in logged and (2, "rl/time_score_s") in logged
  assert [step for step, tag in logged if tag == "eval/accuracy"] == [1, 2]
  # Each evaluation's samples (config.metrics.eval_samples, 16 by default) as a table.
  tables = [(step, data["samples/eval"]) for step, data in run.logged if "samples/eval" in data]
  assert [step for step, _ in tables] == [1, 2]
  assert all(len(table.data) == 16 and table.columns[:2] == ["example", "category"]
             for _, table in tables)
  assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_wandb_without_the_package_is_refused_before_any_work(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
  config = tiny_run_config(tmp_path, {"metrics.wandb_project": "arbor"})
  with pytest.raises(ValueError, match="pip install wandb"):
    train_launcher.run(config)
  assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("field,value,message", [
    ("loss.name", "ppo2", "Unknown loss 'ppo2'"),
    ("task.name", "sudoku9", "Unknown task 'sudoku9'"),
    ("rl.num_microbatches", 3, "not divisible"),
    ("rl.num_minibatches", 3, "num_minibatches \\* num_microbatches = 3"),
    ("rl.ppo_epochs", 0, "ppo_epochs = 0 must be >= 1"),
    ("rollout.group_size", 1, "at least 2 completions"),
    ("rollout.prompt_len", 3, "raise config.rollout.prompt_len"),
    # Settings the objective overrides or never reads (issue: accepted, then ignored).
    ("loss.name=dapo,loss.eps_high", 0.35, "objective 'dapo' fixes eps_high = 0.28"),
    ("loss.name=dapo,loss.aggregation", "seq_mean_token_sum_norm",
     "objective 'dapo' fixes aggregation"),
    # An explicit value equal to the global default is a setting too (GSPO's 3e-4 and
    # DAPO's 0.28 would otherwise silently replace it).
    ("loss.name=gspo,loss.eps_low", 0.2, "objective 'gspo' fixes eps_low = 0.0003"),
    ("loss.name=dapo,loss.eps_high", 0.2, "objective 'dapo' fixes eps_high = 0.28"),
    ("loss.name=m2po,loss.eps_low", 0.1, "objective 'm2po' .* never reads eps_low"),
    ("loss.name=mu_grpo,loss.eps_high", 0.3, "objective 'mu_grpo' .* never reads eps_high"),
    ("loss.name=vcpo,loss.vcpo_is_level", "row", "config.loss.vcpo_is_level = .row.; use one of .sequence., .token."),
    ("loss.name=mu_grpo,loss.corrections", ("m2po",), "Correction 'm2po' after 'mu_veto'"),
])
def test_bad_config_gives_a_clear_error(tmp_path, field, value, message):
  """`field` is a dotted path, optionally after 'path=value,' settings made first."""
  config = tiny_config(tmp_path)
  *settings, field = field.split(",")
  for setting in settings:
    path, setting_value = setting.split("=")
    section, name = path.split(".")
    config[section][name] = setting_value
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ValueError, match=message):
    train_launcher.run(config)


def test_replay_is_not_offered(tmp_path):
  """Nothing trained on a replay buffer, so there is no rollout.replay_size to set (it was
  accepted, wrote every batch to disk, and changed nothing): the launcher refuses it."""
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config.rollout.replay_size=3",
       f"--config.workdir={tmp_path}"], capture_output=True, text=True, check=False,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode != 0
  assert "config.rollout has no field 'replay_size'" in result.stderr
  assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.fixture
def digit_task():
  """reasoning-gym products questions rewarded by the share of digits in the answer: an
  untrained policy gets reward variance in every group (tests/rl_fixtures.py)."""
  unregister = rl_fixtures.register_digit_task()
  yield rl_fixtures.DIGIT_TASK
  unregister()


@pytest.mark.slow
def test_mu_grpo_trains_in_large_stages_and_its_veto_fires(tmp_path, digit_task):
  """docs/concepts.md's stage recipe at tiny size: --config.loss.name=mu_grpo, stages of
  2 minibatches x 2 epochs = 4 updates on one rollout batch of 4 prompts. Every update after
  a stage's first trains on data older than its parameters, so its ratios leave 1 and, in
  a band as narrow as [1 - 1e-3, 1 + 1e-3], the negative-advantage veto must drop tokens;
  the digit-share reward gives every group reward variance, so negative advantages exist."""
  config = tiny_run_config(tmp_path, {
      "task.name": digit_task, "task.difficulty": {}, "rollout.prompt_len": 16,
      "loss.name": "mu_grpo", "loss.mu_eps_low": 1e-3, "loss.mu_eps_high": 1e-3,
      "rl.learning_rate": 1e-3, "rl.warmup_steps": 0, "rollout.prompts_per_step": 4,
      "rl.num_minibatches": 2, "rl.ppo_epochs": 2, "warm_start.steps": 0,
      "task.eval_size": 8, "eval.batch_size": 8})
  summary = train_launcher.run(config)
  assert summary["steps"] == 2 and summary["nonfinite_updates"] == 0
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  stages = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert len(stages) == 2
  for stage in stages:
    assert stage["informative_groups"] > 0  # the construction: groups with mixed rewards
    # Averaged over the stage's 4 updates: the last 3 train on older data.
    assert abs(stage["ratio_mean"] - 1.0) > 1e-4 and stage["approx_kl_behavior"] > 0
    assert stage["vetoed_fraction"] > 0 and stage["vetoed_response_fraction"] > 0


def test_step_means_between_evaluations_and_checkpoints_that_predate_them():
  """Each evaluation's window is the mean over the RL steps since the previous one; a
  checkpoint written before these records gets the known warm-start entries and None for
  RL evaluations (never a window that silently spans the unknown steps)."""
  meta = run_records.new_meta()
  meta["evals"] = [{"phase": "warm_start"}, {"phase": "rl"}, {"phase": "rl"}]
  meta["eval_step_sums"] = [{"steps": 0, "sums": {}},
                            {"steps": 2, "sums": {"clip_fraction": 0.5, "reward_mean": 1.0}},
                            {"steps": 5, "sums": {"clip_fraction": 0.8, "reward_mean": 4.0}}]
  assert run_records.step_means_between_evals(meta) == [
      {}, {"clip_fraction": 0.25, "reward_mean": 0.5},
      {"clip_fraction": pytest.approx(0.1), "reward_mean": 1.0}]

  old = run_records.new_meta()
  old["evals"] = [{"phase": "warm_start"}, {"phase": "rl"}, {"phase": "rl"}]
  for name in ("time_rl_at_evals_s", "eval_step_sums", "time_rl_s"):
    del old[name]
  old = run_records.upgrade_meta(old)
  assert old["time_rl_at_evals_s"] == [0.0, None, None]
  old["evals"].append({"phase": "rl"})  # one evaluation after the resume
  old["eval_step_sums"].append({"steps": 7, "sums": {"reward_mean": 3.5}})
  assert run_records.step_means_between_evals(old) == [{}, None, None, None]
