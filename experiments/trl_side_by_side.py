"""TRL's GRPOTrainer on the B9 run's model, task, reward and settings, evaluated by Arbor
(docs/real_model.md).

    nice python -m experiments.trl_side_by_side \\
        --config=experiments/configs/smollm2_basic_arithmetic.py     # seed 0, ~2 h on 2 cores

TRL (`experiments/peers/trl_run_peer.py`, in the torch peer's virtualenv) trains LoRA adapters
on Arbor's exported SmolLM2 weights with the run's settings: the same training prompts in the
same order (`prompts_per_step` per step; the chat-templated text, whose TRL token ids are
checked against Arbor's), group size, temperature, completion budget, LoRA rank / alpha /
projections, learning rate, AdamW and clipping, microbatches (TRL's gradient accumulation
steps), the clipped GRPO loss with its aggregation
(seq_mean_token_mean = TRL's "grpo", token_mean = "bnpo"), no KL, and the same reward
(Arbor's math_answer scorer). Where TRL differs by design it is left as TRL does it:
its advantages divide by the sample std + 1e-4 (Arbor: population std + 1e-6; see
experiments/trl_parity.py) and it samples with transformers' `generate`.

TRL saves its adapters every config.eval.every steps; Arbor then evaluates each, and the
base model as step 0, with its own held-out evaluation (greedy exact match on the run's
config.task.eval_size problems, `experiments.eval.greedy_accuracy`): one evaluation for both
curves. A killed TRL run resumes from its newest checkpoint when the command is run again.
Writes --out (JSON): the curve, TRL's wall time per step and the sampling part of it, TRL's
logged metrics, versions, and the source this ran (`experiments.provenance`).
"""

from __future__ import annotations

import glob
import json
import os
import re

from absl import app
from absl import flags
import jax
import numpy as np

from experiments import config_flag
from experiments import eval as eval_launcher
from experiments import peers
from experiments import provenance
from experiments.measure import load
from models import peft_adapter
from rl import wiring

CONFIG = config_flag.run_config()
_OUT = flags.DEFINE_string("side_by_side_json", None,
                           "Result JSON (default docs/results/b9/trl_s<seed>.json).")
_TRL_DIR = flags.DEFINE_string("trl_dir", "runs/trl_b9", "TRL's output (checkpoints), per seed.")
_PEER_ENVS, _PEER_WEIGHTS = peers.location_flags()

TRL_LOSS_TYPE = {"seq_mean_token_mean": "grpo", "token_mean": "bnpo"}
_MATH_ANSWER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "rl", "tasks", "math_answer.py")


def check_comparable(run) -> None:
  """Refuses a config TRL's run cannot mirror: another objective, KL, no LoRA, a task not
  scored by math_answer, or an aggregation without a TRL loss_type."""
  loss = wiring.rl_loss(run)
  problems = []
  if loss.name != "grpo" or loss.kl_coef:
    problems.append(f"config.loss.name = {loss.name!r}, kl_coef = {loss.kl_coef} (needs "
                    "'grpo' without KL)")
  if loss.aggregation not in TRL_LOSS_TYPE:
    problems.append(f"config.loss.aggregation = {loss.aggregation!r} (TRL matches "
                    f"{sorted(TRL_LOSS_TYPE)})")
  if run.rl.num_minibatches != 1 or run.rl.ppo_epochs != 1:
    problems.append(f"config.rl.num_minibatches = {run.rl.num_minibatches}, ppo_epochs = "
                    f"{run.rl.ppo_epochs} (the side by side takes one update per batch)")
  if not run.lora.rank:
    problems.append("config.lora.rank = 0 (the side by side trains LoRA adapters)")
  if run.task.prompt_style != "reasoned" and run.task.name not in ("gsm_symbolic",
                                                                         "dataset"):
    problems.append(f"task {run.task.name!r} in style {run.task.prompt_style!r} is not "
                    "scored by rl/tasks/math_answer.py")
  if problems:
    raise ValueError("TRL cannot run this config as Arbor does: " + "; ".join(problems) + ".")


def training_prompts(run, task, tokenizer) -> tuple[list[str], list[list[int]], list[str]]:
  """The run's training prompts in order, as (text after the chat template, Arbor's ids,
  reference answers)."""
  if tokenizer.add_bos:
    raise ValueError("The tokenizer adds BOS to prompts, which TRL's text prompts would not.")
  count = run.rl.steps * run.rollout.prompts_per_step
  examples = task.examples("train", count)
  texts = [tokenizer.apply_chat_template([{"role": "user", "content": e.prompt}])
           if tokenizer.chat else e.prompt for e in examples]
  return (texts, [tokenizer.encode(e.prompt, add_bos=True) for e in examples],
          [str(e.entry["answer"]) for e in examples])


def evaluate_adapters(run, folder: str) -> list[dict]:
  """Arbor's held-out greedy accuracy of the base (step 0) and of every TRL checkpoint."""
  policy = eval_launcher.build_policy(run)
  result = eval_launcher.greedy_accuracy(policy, eval_launcher.initial_params(run))
  curve = [{"step": 0, "accuracy": result.accuracy, "stderr": result.accuracy_stderr}]
  found = sorted(glob.glob(os.path.join(folder, "checkpoint-*")),
                 key=lambda p: int(re.search(r"(\d+)$", p).group(1)))
  for path in found:
    params = eval_launcher.adapter_params(policy, path)
    result = eval_launcher.greedy_accuracy(policy, params)
    curve.append({"step": int(re.search(r"(\d+)$", path).group(1)),
                  "accuracy": result.accuracy, "stderr": result.accuracy_stderr})
    print(f"TRL step {curve[-1]['step']}: held-out accuracy {result.accuracy:.3f}", flush=True)
  return curve


def main(argv):
  del argv
  if not peers.peers_enabled(["torch"]):
    raise SystemExit("The side by side runs TRL in the torch peer's virtualenv, which is off "
                     "when CI is set; unset CI to run it.")
  run = wiring.settings(CONFIG.value)
  check_comparable(run)
  source = provenance.source_state(os.getcwd())
  out = _OUT.value or f"docs/results/b9/trl_s{run.seed}.json"
  init_rng, _ = jax.random.split(jax.random.PRNGKey(run.seed))
  tokenizer, model_config, params = wiring.load_policy(run, init_rng)
  task = wiring.build_task(run)
  texts, ids, answers = training_prompts(run, task, tokenizer)
  folder = peers.export_weights(peers.weights_folder(_PEER_WEIGHTS.value, run.model.checkpoint),
                                jax.device_get(params), model_config, tokenizer,
                                run.model.checkpoint)
  del params
  loss = wiring.rl_loss(run)
  lora = wiring.lora_config(run)
  trl_dir = os.path.join(_TRL_DIR.value, f"s{run.seed}")
  settings = dict(
      steps=run.rl.steps, prompts_per_step=run.rollout.prompts_per_step,
      microbatches=run.rl.num_microbatches,
      group_size=run.rollout.group_size, max_new_tokens=run.rollout.max_new_tokens,
      temperature=run.rollout.temperature, loss_type=TRL_LOSS_TYPE[loss.aggregation],
      epsilon_low=float(loss.eps_low), epsilon_high=float(loss.eps_high),
      learning_rate=run.rl.learning_rate, weight_decay=run.rl.weight_decay,
      max_grad_norm=run.rl.max_grad_norm, save_every=run.eval.every, seed=run.seed,
      lora_rank=lora.rank, lora_alpha=lora.alpha,
      lora_modules=sorted(peft_adapter.module_name(t).split(".")[1] for t in lora.targets))
  spec = dict(weights=folder, prompts=texts, prompt_ids=ids, answers=answers, out=trl_dir,
              settings=settings, math_answer=_MATH_ANSWER)
  load_before = load()
  trl = peers.run_peer("torch", spec, _PEER_ENVS.value, timeout_s=12 * 3600,
                       script="trl_run_peer")
  load_after = load()
  curve = evaluate_adapters(run, trl_dir)
  steps = [s["step_s"] for s in trl["steps"]]
  generate = [s["generate_s"] for s in trl["steps"]]
  result = {"seed": run.seed, "settings": settings, "curve": curve,
            "step_s": steps, "step_s_median": float(np.median(steps)),
            "generate_s_median": float(np.median(generate)),
            "logs": trl["logs"], "resumed": trl["resumed"],
            "versions": {k: trl[k] for k in ("torch", "transformers", "trl")},
            "load_before": load_before, "load_after": load_after,
            "commit": provenance.commit_label(source),
            "source": {k: v for k, v in source.items() if k != "diff"}}
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"Written to {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=config_flag.parse_flags)
