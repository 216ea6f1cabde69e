"""Evaluate a run's checkpoints on its task's held-out split: greedy accuracy and pass@k.

    python -m experiments.eval --config.workdir=runs/default                 # newest checkpoint
    python -m experiments.eval --config.workdir=runs/short --steps=all --num_samples=16 --k=1,4,16

Takes the same `--config` (file and overrides) as experiments/train.py, so the task,
model and prompt settings are the run's: the policy is resolved as the launcher resolves it
(`load_policy`: a preset with the character tokenizer, or `config.model.checkpoint` with its
tokenizer and chat template), and the run's checkpoints, read from
`<config.workdir>/checkpoints` (written by experiments/train.py through rl/checkpoint.py), are
restored on top. With no checkpoint there it prints a usage line and exits with status 1.
For each checkpoint it reports greedy exact match (the launcher's held-out accuracy),
and from `num_samples` completions per example at `--temperature` the unbiased pass@k
(Chen et al. 2021), mean reward and mean completion length. Results go to
`<workdir>/eval/eval.json` and `eval.md` (a markdown table), and the table is printed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, NoReturn, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections

from experiments import config_flag
from models.config import ModelConfig
from models.hf_tokenizer import HFTokenizer
from models.tokenizer import CharTokenizer
from rl import checkpoint
from rl import evaluation
from rl import wiring
from rl.tasks import Task
from sampling.sampler import SamplingConfig

CONFIG = config_flag.run_config()
_STEPS = flags.DEFINE_string("steps", "latest",
                             "Checkpoint steps: 'latest', 'all', or a comma list such as 300,350.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 16, "Sampled completions per example (n).")
_K = flags.DEFINE_list("k", ["1", "4", "16"], "k values of pass@k; each at most num_samples.")
_TEMPERATURE = flags.DEFINE_float("temperature", None,
                                  "Sampling temperature (default: config.rollout.temperature).")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None,
                                     "Held-out examples (default: all config.task.eval_size).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


USAGE = ("usage: python -m experiments.eval --config.workdir=<the run's workdir> "
         "[--config=<the run's config file>] [--steps=latest|all|300,350] [--num_samples=16] "
         "[--k=1,4,16]")


class NoCheckpointsError(ValueError):
  """The workdir holds no checkpoint: there is nothing to evaluate."""


@dataclasses.dataclass(frozen=True)
class Policy:
  """What a run's config fixes about its policy: task, tokenizer, model shapes, and the
  parameters' shapes and dtypes (`params_like`, the template checkpoints restore into)."""
  task: Task
  tokenizer: CharTokenizer | HFTokenizer
  model_config: ModelConfig
  params_like: Any


def build_policy(config: ml_collections.ConfigDict) -> Policy:
  """The task and policy of a run, resolved by the launcher's own `load_policy` (preset or
  pretrained checkpoint, tokenizer, chat template); the initial weights give only shapes."""
  tokenizer, model_config, params = wiring.load_policy(config, jax.random.PRNGKey(0))
  task = wiring.build_task(config)
  return Policy(task=task, tokenizer=tokenizer, model_config=model_config,
                params_like=jax.eval_shape(lambda: params))


def checkpoint_steps(config: ml_collections.ConfigDict, which: str = "latest") -> list[int]:
  """Steps named by `which` ('latest', 'all', or '300,350') among the run's checkpoints.

  Raises NoCheckpointsError when there is none (without creating the directory)."""
  directory = os.path.join(config.workdir, "checkpoints")
  available = (sorted(checkpoint.make_manager(directory).all_steps())
               if os.path.isdir(directory) else [])
  if not available:
    raise NoCheckpointsError(f"No checkpoints in {directory}: train first (python -m "
                             "experiments.train) or pass the run's --config.workdir.")
  if which == "latest":
    return available[-1:]
  if which == "all":
    return available
  steps = [int(s) for s in which.split(",")]
  missing = sorted(set(steps) - set(available))
  if missing:
    raise ValueError(f"--steps names {missing}, which {config.workdir}/checkpoints does not "
                     f"hold; it holds {available}.")
  return steps


def load_params(config: ml_collections.ConfigDict, policy: Policy, step: int):
  """The policy parameters of checkpoint `step` of the run in config.workdir.

  The checkpoint holds the whole LoopState; its optimiser state and producer state have
  the structure of the phase that saved it (warm start or RL), so the expected state is
  built for that phase.
  Under LoRA (an RL checkpoint of a run with config.lora.rank > 0) the adapters are merged
  into the frozen base.
  """
  manager = checkpoint.make_manager(os.path.join(config.workdir, "checkpoints"))
  phase = checkpoint.read_meta(manager, step)["phase"]
  ctx, optimizer = wiring.make_context(config, policy.task, policy.tokenizer,
                                       policy.model_config, phase)
  producer = wiring.make_rl_producer(config, ctx) if phase == wiring.RL else None
  like = wiring.loop_state_like(config, policy.model_config, policy.params_like, phase,
                                optimizer, producer)
  state, _ = checkpoint.restore(manager, step, like)
  return state.train.policy_params()


def evaluate_checkpoint(config: ml_collections.ConfigDict, policy: Policy, step: int, *,
                        num_samples: int, ks: Sequence[int], temperature: float,
                        num_examples: int, seed: int = 0, progress: bool = True) -> dict:
  """One table row: greedy and sampled metrics of checkpoint `step` on the held-out split."""
  params = load_params(config, policy, step)
  examples = policy.task.examples("eval", num_examples)
  common = dict(task=policy.task, tokenizer=policy.tokenizer, prompt_len=config.rollout.prompt_len,
                model_config=policy.model_config, batch_size=config.eval.batch_size,
                progress=progress, turns=wiring.make_turns(config, policy.tokenizer))
  greedy = evaluation.evaluate(params, examples, max_new_tokens=config.rollout.max_new_tokens,
                               **common)
  sampling_config = SamplingConfig(
      max_new_tokens=config.rollout.max_new_tokens, temperature=temperature,
      top_k=config.rollout.top_k, top_p=config.rollout.top_p,
      stop_tokens=(policy.tokenizer.eos_id,), pad_id=policy.tokenizer.pad_id)
  sampled = evaluation.evaluate_sampled(params, examples, sampling_config=sampling_config,
                                        num_samples=num_samples, ks=ks,
                                        rng=jax.random.PRNGKey(seed), **common)
  return {"step": step, "task": config.task.name, "examples": num_examples,
          "greedy_accuracy": greedy.accuracy, "greedy_length": greedy.mean_length,
          "num_samples": num_samples, "temperature": temperature,
          **{f"pass@{k}": v for k, v in sampled.pass_at_k.items()},
          "sampled_reward": sampled.mean_reward, "sampled_length": sampled.mean_length}


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows as a GitHub markdown table (floats to 3 decimals)."""
  columns = list(rows[0])
  fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(fmt(row[c]) for c in columns) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def run(config: ml_collections.ConfigDict, *, steps: str = "latest", num_samples: int = 16,
        ks: Sequence[int] = (1, 4, 16), temperature: float | None = None,
        num_examples: int | None = None, seed: int = 0, progress: bool = True) -> list[dict]:
  """Evaluates the named checkpoints, writes <workdir>/eval/eval.{json,md}, returns the rows."""
  temperature = config.rollout.temperature if temperature is None else temperature
  if temperature <= 0:
    raise ValueError(f"--temperature={temperature}: pass@k needs sampling (> 0); the greedy "
                     "accuracy is reported anyway.")
  num_examples = config.task.eval_size if num_examples is None else num_examples
  if not 1 <= num_examples <= config.task.eval_size:
    raise ValueError(f"--num_examples={num_examples} must be in [1, config.task.eval_size="
                     f"{config.task.eval_size}].")
  chosen = checkpoint_steps(config, steps)  # before loading any weights
  policy = build_policy(config)
  rows = [evaluate_checkpoint(config, policy, step, num_samples=num_samples, ks=ks,
                              temperature=temperature, num_examples=num_examples, seed=seed,
                              progress=progress)
          for step in chosen]
  out = os.path.join(config.workdir, "eval")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "eval.json"), "w") as f:
    json.dump(rows, f, indent=2)
  with open(os.path.join(out, "eval.md"), "w") as f:
    f.write(markdown_table(rows))
  return rows


def exit_with_usage(message: str) -> NoReturn:
  """Prints `message` and the usage line on stderr and exits with status 1 (no traceback)."""
  sys.stderr.write(f"{message}\n{USAGE}\n")
  sys.exit(1)


def main(argv):
  if len(argv) > 1:
    exit_with_usage(f"Unexpected arguments {argv[1:]}: name the run with --config.workdir.")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  config = CONFIG.value  # the run's --config
  try:
    rows = run(config, steps=_STEPS.value, num_samples=_NUM_SAMPLES.value,
               ks=[int(k) for k in _K.value], temperature=_TEMPERATURE.value,
               num_examples=_NUM_EXAMPLES.value, seed=_SEED.value)
  except NoCheckpointsError as error:
    exit_with_usage(f"Nothing to evaluate. {error}")
  print(markdown_table(rows), end="")
  print(f"Written to {os.path.join(config.workdir, 'eval')}/eval.json and eval.md")


if __name__ == "__main__":
  app.run(main, flags_parser=config_flag.parse_flags)
