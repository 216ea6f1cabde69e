"""Evaluate a run's checkpoints on its task's held-out split: greedy accuracy and pass@k.

    python -m experiments.eval --config.workdir=runs/default                 # newest checkpoint
    python -m experiments.eval --config.workdir=runs/short --steps=all --num_samples=16 --k=1,4,16
    python -m experiments.eval --config=experiments/configs/smollm2_basic_arithmetic.py --steps=initial \
        --num_samples=8 --k=1,8 --temperature=1      # the untrained policy: a task's headroom

Takes the same `--config` (file and overrides) as experiments/train.py, so the task,
model and prompt settings are the run's: the policy is resolved as the launcher resolves it
(`load_policy`: a preset with the character tokenizer, or `config.model.checkpoint` with its
tokenizer and chat template), and the run's checkpoints, read from
`<config.workdir>/checkpoints` (written by experiments/train.py through rl/checkpoint.py), are
restored on top. With no checkpoint there it prints a usage line and exits with status 1.
`--adapter=<folder>` evaluates a PEFT LoRA folder (what a LoRA run leaves in <workdir>/adapter,
models/peft_adapter.py) merged into the config's base policy, as step "adapter", with no
checkpoint: committed adapters can be re-evaluated on held-out problems of another seed
(`--config.seed`). `--steps=initial` evaluates the policy before any training instead (the preset initialised
from config.seed as the launcher does, or the pretrained checkpoint), as step 0, and needs
no checkpoint: how much a task leaves to learn, before a run is started.
For each checkpoint it reports greedy exact match (the launcher's held-out accuracy),
and from `num_samples` completions per example at `--temperature` the unbiased pass@k
(Chen et al. 2021), mean reward, mean completion length, and `mixed`: the share of examples
whose samples are neither all correct nor all wrong. With a right-or-wrong reward those
are the groups of `num_samples` completions that give GRPO a gradient (the others have
advantage 0 everywhere). Results go to
`<workdir>/eval/eval.json` and `eval.md` (a markdown table), and the table is printed.

What the policy wrote: each checkpoint's greedy answers are counted by failure category
(`greedy_categories` in eval.json: correct, no_answer, malformed, wrong_value, truncated,
tool_error, scorer_failed; rl/verdicts.py), and the greedy completions of a fixed spread
of held-out problems (config.metrics.eval_samples of them, the run's own sample problems)
go to `<workdir>/eval/samples_<step>.jsonl`. `--show=8` prints the first 8 of them as a
table (prompt, completion, the answer read, the target, reward, category):

    python -m experiments.eval --config=experiments/configs/smollm2_basic_arithmetic.py \
        --steps=initial --show=8
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Any, NoReturn, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections
import numpy as np

from experiments import config_flag
from experiments import provenance
from models import lora as lora_lib
from models import peft_adapter
from models.config import ModelConfig
from models.hf_tokenizer import HFTokenizer
from models.tokenizer import CharTokenizer
from rl import checkpoint
from rl import evaluation
from rl import samples as samples_lib
from rl import wiring
from rl.rollouts import selection as selection_lib
from rl.settings import run as run_lib
from rl.tasks import Task
from sampling.sampler import SamplingConfig

CONFIG = config_flag.run_config()
_STEPS = flags.DEFINE_string("steps", "latest",
                             "Checkpoint steps: 'latest', 'all', a comma list such as 300,350, "
                             "or 'initial' (the untrained policy, as step 0).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 16, "Sampled completions per example (n).")
_K = flags.DEFINE_list("k", ["1", "4", "16"], "k values of pass@k; each at most num_samples.")
_TEMPERATURE = flags.DEFINE_float("temperature", None,
                                  "Sampling temperature (default: config.rollout.temperature).")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None,
                                     "Held-out examples (default: all config.task.eval_size).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_ADAPTER = flags.DEFINE_string("adapter", None, "A PEFT LoRA folder to evaluate on the "
                               "config's base policy instead of the run's checkpoints.")
_SHOW = flags.DEFINE_integer("show", 0, "Print this many greedy samples of each checkpoint "
                             "(prompt, completion, answer, target, reward, category).")
_TRAINED_SEEDS = flags.DEFINE_list(
    "trained_seeds", [], "Seeds of the runs the evaluated policies were trained by (the "
    "config's run otherwise): the held-out problems are checked against the prompts each "
    "trained on, and the number shared is recorded (`overlap_with_training`).")


USAGE = ("usage: python -m experiments.eval --config.workdir=<the run's workdir> "
         "[--config=<the run's config file>] [--steps=latest|all|300,350|initial] [--num_samples=16] "
         "[--k=1,4,16] [--adapter=<PEFT folder>] [--show=8]")


INITIAL = "initial"  # --steps value: the policy before training, reported as step 0


class NoCheckpointsError(ValueError):
  """The workdir holds no checkpoint: there is nothing to evaluate."""


@dataclasses.dataclass(frozen=True)
class Policy:
  """What a run's config fixes about its policy: its typed settings (`run`, read once),
  task, tokenizer, model shapes, and the parameters' shapes and dtypes (`params_like`, the
  template checkpoints restore into)."""
  run: run_lib.RunSettings
  task: Task
  tokenizer: CharTokenizer | HFTokenizer
  model_config: ModelConfig
  params_like: Any


def build_policy(run: run_lib.RunSettings) -> Policy:
  """The task and policy of the run with settings `run` (`rl.wiring.settings` of its config),
  resolved by the launcher's own `load_policy` (preset or pretrained checkpoint, tokenizer,
  chat template); the initial weights give only shapes."""
  tokenizer, model_config, params = wiring.load_policy(run, jax.random.PRNGKey(0))
  return Policy(run=run, task=wiring.build_task(run), tokenizer=tokenizer,
                model_config=model_config, params_like=jax.eval_shape(lambda: params))


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
  ctx, optimizer = wiring.make_context(policy.run, policy.task, policy.tokenizer,
                                       policy.model_config, phase)
  producer = wiring.make_rl_producer(policy.run, ctx) if phase == wiring.RL else None
  like = wiring.loop_state_like(policy.run, policy.model_config, policy.params_like, phase,
                                optimizer, producer, ctx.stages)
  state, _ = checkpoint.restore(manager, step, like)
  return state.train.policy_params()


def initial_params(run: run_lib.RunSettings):
  """The policy parameters before any training of the run with settings `run`: those
  experiments/job.py starts from (the preset initialised from the first half of
  PRNGKey(config.seed), or the checkpoint's)."""
  init_rng, _ = jax.random.split(jax.random.PRNGKey(run.seed))
  return wiring.load_policy(run, init_rng)[2]


def adapter_params(policy: Policy, folder: str):
  """The run's initial policy with the PEFT LoRA adapters in `folder` merged in."""
  adapters, lora = peft_adapter.load(folder, policy.model_config)
  return lora_lib.merge(initial_params(policy.run), adapters, lora.scale)


def evaluation_settings(policy: Policy, progress: bool = True) -> dict:
  """The keyword arguments rl.evaluation's evaluators take for the run's held-out split."""
  run = policy.run
  return dict(task=policy.task, tokenizer=policy.tokenizer,
              prompt_len=run.rollout.prompt_len, model_config=policy.model_config,
              batch_size=run.eval.batch_size, progress=progress,
              turns=wiring.make_turns(run, policy.tokenizer))


def greedy_accuracy(policy: Policy, params, progress: bool = True) -> evaluation.EvalResult:
  """The launcher's held-out evaluation of `params`: greedy exact match on all eval_size
  problems."""
  run = policy.run
  return evaluation.evaluate(params, policy.task.examples("eval", run.task.eval_size),
                             max_new_tokens=run.rollout.max_new_tokens,
                             **evaluation_settings(policy, progress))


def evaluate_checkpoint(config: ml_collections.ConfigDict, policy: Policy, step: int | str, *,
                        num_samples: int, ks: Sequence[int], temperature: float,
                        num_examples: int, seed: int = 0, progress: bool = True,
                        params=None, samples: int = 0) -> tuple[dict, list[dict], list]:
  """(one table row, greedy samples, the problems): greedy and sampled metrics of
  checkpoint `step` (or of `params`, when given) on the held-out split, with the greedy
  answers' failure categories, the greedy completions of `samples` held-out problems
  (`rl.samples.eval_samples`), and the held-out examples scored."""
  params = load_params(config, policy, step) if params is None else params
  examples = policy.task.examples("eval", num_examples)
  common = evaluation_settings(policy, progress)
  rollout = policy.run.rollout
  greedy = evaluation.evaluate(params, examples, max_new_tokens=rollout.max_new_tokens,
                               samples=samples, **common)
  sampling_config = SamplingConfig(
      max_new_tokens=rollout.max_new_tokens, temperature=temperature,
      top_k=rollout.top_k, top_p=rollout.top_p,
      stop_tokens=(policy.tokenizer.eos_id,), pad_id=policy.tokenizer.pad_id)
  sampled = evaluation.evaluate_sampled(params, examples, sampling_config=sampling_config,
                                        num_samples=num_samples, ks=ks,
                                        rng=jax.random.PRNGKey(seed), **common)
  row = {"step": step, "task": policy.run.task.name, "examples": num_examples,
         "greedy_accuracy": greedy.accuracy, "greedy_length": greedy.mean_length,
         "num_samples": num_samples, "temperature": temperature,
         **{f"pass@{k}": v for k, v in sampled.pass_at_k.items()},
         "mixed": mixed_share(sampled.num_correct, num_samples),
         "sampled_reward": sampled.mean_reward, "sampled_length": sampled.mean_length,
         "greedy_categories": greedy.categories}
  return row, greedy.samples, examples


def problems_sha256(examples: Sequence) -> str:
  """A hash of the evaluated problems (each prompt and answer, in order): two evaluations
  with the same hash scored the same problems."""
  text = "\x1e".join(f"{e.prompt}\x1f{e.answer}" for e in examples)
  return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def trained_prompts(run: run_lib.RunSettings, seed: int) -> set[str]:
  """The prompts the run with settings `run` and seed `seed` trains on: its task's train
  split from where the warm start leaves the data cursor (warm_start.steps x batch_size) for
  rl.steps x prompts_per_step prompts, cycling over task.train_pool when it is finite.
  Other selection rules draw more prompts than they train: refused."""
  if run.selection.kind != "uniform":
    raise ValueError(f"--trained_seeds reads the prompts of uniform selection; "
                     f"config.selection.kind = {run.selection.kind!r} draws others.")
  task = wiring.build_task(dataclasses.replace(run, seed=seed))
  start = run.warm_start.steps * run.warm_start.batch_size
  count = run.rl.steps * run.rollout.prompts_per_step
  pool = run.task.train_pool
  return {task.examples("train", 1, selection_lib.train_position(start + i, pool))[0].prompt
          for i in range(count)}


def provenance_record(run: run_lib.RunSettings, examples: Sequence, sampling_seed: int,
                      trained_seeds: Sequence[int]) -> dict:
  """What an evaluation's result must say of itself: the source commit it ran
  (`provenance.commit_label`), the problems' seed (config.seed) and hash, the sampling
  seed, and, for `trained_seeds`, how many of the problems each of those runs trained on
  (checked against `trained_prompts`, not assumed); None when no run was named."""
  prompts = {e.prompt for e in examples}
  overlap = None
  if trained_seeds:
    overlap = {str(s): len(prompts & trained_prompts(run, int(s))) for s in trained_seeds}
  return {"commit": provenance.commit_label(provenance.source_state(os.getcwd())),
          "problem_seed": int(run.seed), "problems": len(examples),
          "problems_sha256": problems_sha256(examples), "sampling_seed": int(sampling_seed),
          "overlap_with_training": overlap}


def mixed_share(num_correct, num_samples: int) -> float:
  """The share of examples with 0 < correct < num_samples among their samples."""
  c = np.asarray(num_correct)
  return float(np.mean((c > 0) & (c < num_samples)))


def markdown_table(rows: Sequence[dict]) -> str:
  """The rows as a GitHub markdown table (floats to 3 decimals; tables within a row, such
  as greedy_categories, stay in eval.json)."""
  columns = [c for c in rows[0] if not isinstance(rows[0][c], dict)]
  fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(fmt(row[c]) for c in columns) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def shown_samples(step, samples: Sequence[dict], show: int, categories: dict) -> str:
  """The first `show` samples of checkpoint `step` as a plain-text table
  (`rl.samples.text_table`), under a line counting the greedy answers by category."""
  counted = ", ".join(f"{name} {count}" for name, count in categories.items() if count)
  return (f"step {step}: greedy answers by category: {counted}\n"
          + samples_lib.text_table(samples[:show]) + "\n")


def _prepare(config: ml_collections.ConfigDict, steps: str, temperature: float | None,
             num_examples: int | None, adapter: str | None):
  """What `run` evaluates, checked before any decoding: (policy, the steps, the parameters
  given directly or None, the sampling temperature, the number of problems)."""
  run = wiring.settings(config)
  temperature = run.rollout.temperature if temperature is None else temperature
  if temperature <= 0:
    raise ValueError(f"--temperature={temperature}: pass@k needs sampling (> 0); the greedy "
                     "accuracy is reported anyway.")
  num_examples = run.task.eval_size if num_examples is None else num_examples
  if not 1 <= num_examples <= run.task.eval_size:
    raise ValueError(f"--num_examples={num_examples} must be in [1, config.task.eval_size="
                     f"{run.task.eval_size}].")
  if adapter is not None and steps not in ("latest", INITIAL):
    raise ValueError(f"--adapter evaluates one adapter folder; drop --steps={steps}.")
  initial = steps == INITIAL
  chosen = (["adapter"] if adapter is not None else [0] if initial
            else checkpoint_steps(config, steps))  # before loading any weights
  policy = build_policy(run)
  params = (adapter_params(policy, adapter) if adapter is not None
            else initial_params(policy.run) if initial else None)
  return policy, chosen, params, temperature, num_examples


def run(config: ml_collections.ConfigDict, *, steps: str = "latest", num_samples: int = 16,
        ks: Sequence[int] = (1, 4, 16), temperature: float | None = None,
        num_examples: int | None = None, seed: int = 0, progress: bool = True,
        adapter: str | None = None, show: int = 0,
        trained_seeds: Sequence[int] = ()) -> list[dict]:
  """Evaluates the named checkpoints (or `adapter`, a PEFT folder), writes
  <workdir>/eval/eval.{json,md} and each checkpoint's greedy samples
  (samples_<step>.jsonl: max(show, config.metrics.eval_samples) of them), prints the first
  `show` samples of each, returns the rows; each row's "provenance" is
  `provenance_record` (with `trained_seeds`, the runs whose training prompts the problems
  are checked against)."""
  try:
    policy, chosen, params, temperature, num_examples = _prepare(
        config, steps, temperature, num_examples, adapter)
  except NoCheckpointsError:
    raise
  except ValueError as error:
    raise config_flag.InputError(str(error)) from error
  out = os.path.join(config.workdir, "eval")
  os.makedirs(out, exist_ok=True)
  rows = []
  for step in chosen:
    row, samples, examples = evaluate_checkpoint(
        config, policy, step, num_samples=num_samples, ks=ks, temperature=temperature,
        num_examples=num_examples, seed=seed, progress=progress, params=params,
        samples=max(show, policy.run.metrics.eval_samples))
    row["provenance"] = provenance_record(policy.run, examples, seed, trained_seeds)
    rows.append(row)
    with open(os.path.join(out, f"samples_{step}.jsonl"), "w") as f:
      f.write(samples_lib.jsonl(step, samples))
    if show:
      print(shown_samples(step, samples, show, row["greedy_categories"]))
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
  config = config_flag.resolved(CONFIG)  # the run's --config
  try:
    rows = run(config, steps=_STEPS.value, num_samples=_NUM_SAMPLES.value,
               ks=[int(k) for k in _K.value], temperature=_TEMPERATURE.value,
               num_examples=_NUM_EXAMPLES.value, seed=_SEED.value, adapter=_ADAPTER.value,
               show=_SHOW.value, trained_seeds=[int(s) for s in _TRAINED_SEEDS.value])
  except NoCheckpointsError as error:
    exit_with_usage(f"Nothing to evaluate. {error}")
  except config_flag.InputError as error:
    config_flag.exit_on_input_error(error)
  print(markdown_table(rows), end="")
  print(f"Written to {os.path.join(config.workdir, 'eval')}/eval.json and eval.md")


if __name__ == "__main__":
  app.run(main, flags_parser=config_flag.parse_flags)
