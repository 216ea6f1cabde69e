"""Launch an Arbor RL run: supervised warm start, then GRPO, with held-out evaluation.

    python -m experiments.train                                   # the embedded default
    python -m experiments.train --config=experiments/configs/default.py --config.rl.steps=50

Writes to config.workdir: metrics.jsonl (one line per iteration and per evaluation),
TensorBoard event files of the same scalars (`tensorboard --logdir runs`), plot.png (train
reward and held-out accuracy against step), checkpoints/ (orbax), and summary.json.
A rerun with the same workdir resumes from the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections
from ml_collections import config_flags
import tqdm

from experiments import metrics
from models import transformer
from models.config import get_preset
from models.tokenizer import CharTokenizer
from rl import advantages
from rl import checkpoint
from rl import evaluation
from rl import loop
from rl import train
from rl.tasks import make_task
from sampling import tree as tree_lib
from sampling.sampler import SamplingConfig

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Run configuration file.")

WARM_START, RL = "warm_start", "rl"


def build_fork_policy(tree_config) -> tree_lib.ForkPolicy:
  """The sampling.tree fork policy named by config.rollout.tree.policy."""
  t = tree_config
  if t.policy == "entropy":
    return tree_lib.EntropyFork(init_chains=t.init_chains, fork_points=t.fork_points,
                                branches=t.branches, rounds=t.rounds)
  if t.policy == "segments":
    return tree_lib.FixedSegments(init_chains=t.init_chains, segment_len=t.segment_len,
                                  branches=t.branches, max_depth=t.max_depth)
  if t.policy == "lookahead":
    return tree_lib.Lookahead(init_chains=t.init_chains, leaves=t.leaves, top_k=t.top_k,
                              min_entropy=t.min_entropy, lookahead_steps=t.lookahead_steps,
                              prune_similarity=t.prune_similarity)
  raise ValueError(f"Unknown config.rollout.tree.policy {t.policy!r}; use 'entropy', "
                   "'segments' or 'lookahead'.")


def rows_per_prompt(config) -> int:
  """Sequences per prompt in an RL batch: group_size, or the tree's leaf budget."""
  if config.rollout.kind == "tree":
    return build_fork_policy(config.rollout.tree).leaves
  return config.rollout.group_size


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the inconsistent fields and how to fix them."""
  r = config.rollout
  if r.kind not in ("independent", "tree"):
    raise ValueError(f"config.rollout.kind = {r.kind!r}; use 'independent' or 'tree'.")
  rows = r.prompts_per_step * rows_per_prompt(config)
  if rows % config.rl.num_microbatches:
    raise ValueError(f"config.rollout.prompts_per_step * group_size = {rows} is not divisible "
                     f"by config.rl.num_microbatches = {config.rl.num_microbatches} (with "
                     "kind='tree', group_size is the tree's leaf budget).")
  if config.warm_start.batch_size % config.rl.num_microbatches:
    raise ValueError(f"config.warm_start.batch_size = {config.warm_start.batch_size} is not "
                     f"divisible by config.rl.num_microbatches = {config.rl.num_microbatches}.")
  if config.rl.get("prefix_shared_forward", False) and r.kind != "independent":
    raise ValueError(f"config.rl.prefix_shared_forward needs groups of G independent samples of "
                     f"one prompt (config.rollout.kind='independent'), got {r.kind!r}.")
  if config.rl.get("prefix_shared_forward", False) and r.prompts_per_step % config.rl.num_microbatches:
    raise ValueError(f"config.rl.prefix_shared_forward needs whole groups per microbatch: "
                     f"config.rollout.prompts_per_step = {r.prompts_per_step} must be divisible "
                     f"by config.rl.num_microbatches = {config.rl.num_microbatches}.")
  if r.kind == "independent" and r.group_size < 2:
    raise ValueError(f"config.rollout.group_size = {r.group_size}: group-relative advantages "
                     "need at least 2 completions per prompt.")
  if config.rl.staleness < 0:
    raise ValueError(f"config.rl.staleness = {config.rl.staleness} must be >= 0 (0 = on-policy).")
  if config.warm_start.steps < 0 or config.rl.steps < 0:
    raise ValueError("config.warm_start.steps and config.rl.steps must be >= 0.")
  if config.eval.every <= 0 or config.checkpoint.every <= 0:
    raise ValueError("config.eval.every and config.checkpoint.every must be positive.")


def build_model_config(config, tokenizer):
  """The preset's shapes, with the tokenizer's vocabulary (the policy is trained from
  scratch) and room for prompt + completion."""
  needed = config.rollout.prompt_len + config.rollout.max_new_tokens
  model_config = get_preset(config.model.preset, dtype=config.model.dtype,
                            vocab_size=tokenizer.vocab_size)
  return model_config.replace(max_seq_len=max(model_config.max_seq_len, needed))


def make_context(config, task, tokenizer, model_config, phase):
  """The LoopContext (and optimizer) of one phase of the run."""
  if phase == WARM_START:
    optimizer = train.make_optimizer(
        config.warm_start.learning_rate, warmup_steps=config.warm_start.warmup_steps,
        decay_steps=max(config.warm_start.steps - config.warm_start.warmup_steps, 1),
        end_lr_fraction=0.1, max_grad_norm=config.rl.max_grad_norm)
    loss_config = ml_collections.FrozenConfigDict(dict(
        name="sft", aggregation="token_mean", norm_len=1.0))
    prompts = config.warm_start.batch_size
  else:
    optimizer = train.make_optimizer(config.rl.learning_rate, weight_decay=config.rl.weight_decay,
                                      max_grad_norm=config.rl.max_grad_norm)
    loss_config = ml_collections.FrozenConfigDict(config.loss)
    prompts = config.rollout.prompts_per_step
  sampling_config = SamplingConfig(
      max_new_tokens=config.rollout.max_new_tokens, temperature=config.rollout.temperature,
      top_k=config.rollout.top_k, top_p=config.rollout.top_p,
      stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  # Prefix sharing needs groups of one prompt: GRPO batches, not the warm start's.
  shared_prefix = ((config.rollout.group_size, config.rollout.prompt_len)
                   if phase == RL and config.rl.get("prefix_shared_forward", False) else None)
  step = train.make_train_step(model_config, optimizer, loss_config,
                               num_microbatches=config.rl.num_microbatches,
                               temperature=config.rollout.temperature if phase == RL else 1.0,
                               shared_prefix=shared_prefix)
  ctx = loop.LoopContext(
      task=task, tokenizer=tokenizer, model_config=model_config,
      sampling_config=sampling_config, prompt_len=config.rollout.prompt_len,
      prompts_per_step=prompts, group_size=config.rollout.group_size, train_step=step,
      advantage_fn=advantages.get_advantage_fn(config.advantage.name),
      staleness=config.rl.staleness if phase == RL else 0)
  if config.rollout.kind == "tree":
    ctx = dataclasses.replace(
        ctx, tree_policy=build_fork_policy(config.rollout.tree),
        tree_advantage_fn=advantages.get_tree_advantage_fn(config.rollout.tree.advantage))
  return ctx, optimizer


def run(config: ml_collections.ConfigDict) -> dict:
  """Runs (or resumes) the configured job and returns its summary."""
  validate(config)
  started = time.time()
  os.makedirs(config.workdir, exist_ok=True)
  tokenizer = CharTokenizer()
  task = make_task(config.task.name, config.task.prompt_style, seed=config.seed,
                   eval_size=config.task.eval_size, **config.task.difficulty)
  model_config = build_model_config(config, tokenizer)
  eval_examples = task.examples("eval", config.task.eval_size)

  def held_out(params):
    return evaluation.evaluate(params, eval_examples, task=task, tokenizer=tokenizer,
                               prompt_len=config.rollout.prompt_len,
                               max_new_tokens=config.rollout.max_new_tokens,
                               model_config=model_config, batch_size=config.eval.batch_size)

  contexts = {phase: make_context(config, task, tokenizer, model_config, phase)
              for phase in (WARM_START, RL)}
  init_rng, loop_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  params = transformer.init_params(model_config, init_rng)
  history = lambda p: loop.init_history(p, config.rl.staleness) if config.rl.staleness else None
  state = loop.LoopState(train=train.init_train_state(params, contexts[WARM_START][1]),
                         rng=loop_rng, history=history(params))
  meta = {"phase": WARM_START, "data_cursor": 0, "iteration": 0, "evals": []}

  manager = checkpoint.make_manager(os.path.join(config.workdir, "checkpoints"),
                                    config.checkpoint.max_to_keep)
  log = metrics.MetricsLog(os.path.join(config.workdir, "metrics.jsonl"))
  restored = checkpoint.restore_latest(manager, state) if config.resume else None
  if restored is not None:
    step, state, meta = restored
    state = state.replace(data_cursor=meta["data_cursor"], iteration=meta["iteration"])
    log.truncate_after(step)
    logging.info("Resumed from checkpoint step %d (%s).", step, meta["phase"])
  else:
    log.truncate_after(-1)

  phase_steps = {WARM_START: config.warm_start.steps, RL: config.rl.steps}
  done = (0 if meta["phase"] == WARM_START else phase_steps[WARM_START]) + state.iteration
  bar = tqdm.tqdm(total=sum(phase_steps.values()), initial=done, desc=meta["phase"],
                  dynamic_ncols=True)

  def save():
    checkpoint.save(manager, done, state, dict(meta, data_cursor=state.data_cursor,
                                               iteration=state.iteration))
    log.close()  # TensorBoard events up to the checkpoint reach disk with it

  def evaluate_now(label):
    result = held_out(state.train.params)
    record = {"step": done, "phase": meta["phase"], "event": label,
              "eval_accuracy": result.accuracy, "eval_reward": result.mean_reward,
              "eval_length": result.mean_length}
    meta["evals"].append(record)
    log.write(record)
    bar.write(f"[step {done}] {label}: held-out accuracy {result.accuracy:.3f}, "
              f"mean reward {result.mean_reward:.3f}")
    return result

  for phase in (WARM_START, RL):
    if meta["phase"] != phase:
      continue
    ctx, _ = contexts[phase]
    iterate = loop.sft_iteration if phase == WARM_START else loop.grpo_iteration
    if phase == RL and config.rollout.kind == "tree":
      iterate = loop.tree_iteration
    bar.set_description(phase)
    while state.iteration < phase_steps[phase]:
      state, step_metrics = iterate(state, ctx)
      done += 1
      record = {"step": done, "phase": phase, **{k: float(v) for k, v in step_metrics.items()}}
      log.write(record)
      bar.update(1)
      bar.set_postfix({k: f"{record[k]:.3f}" for k in ("loss", "reward_mean") if k in record})
      if phase == RL and state.iteration % config.eval.every == 0:
        evaluate_now("eval")
      if state.iteration % config.checkpoint.every == 0 and state.iteration < phase_steps[phase]:
        save()  # the phase's last step is saved below
    if phase == WARM_START:
      evaluate_now("warm_start_end")
      # The RL phase starts from the warm-started parameters with a fresh optimiser.
      meta["phase"] = RL
      state = loop.LoopState(
          train=train.init_train_state(state.train.params, contexts[RL][1]),
          rng=state.rng, history=history(state.train.params), data_cursor=state.data_cursor,
          iteration=0)
      save()
  bar.close()
  last = meta["evals"][-1]
  if config.rl.steps and (last["step"] != done or last["event"] != "eval"):
    evaluate_now("eval")
  if manager.latest_step() != done:
    save()

  warm = next(e for e in meta["evals"] if e["event"] == "warm_start_end")
  final = meta["evals"][-1]
  summary = {"warm_start_accuracy": warm["eval_accuracy"], "final_accuracy": final["eval_accuracy"],
             "warm_start_reward": warm["eval_reward"], "final_reward": final["eval_reward"],
             "steps": done, "wall_time_s": time.time() - started,
             "nonfinite_updates": int(state.train.nonfinite_updates)}
  with open(os.path.join(config.workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  log.close()
  metrics.plot_run(log.read(), os.path.join(config.workdir, "plot.png"))
  return summary


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  summary = run(_CONFIG.value)
  print(f"Warm-start held-out accuracy: {summary['warm_start_accuracy']:.3f}")
  print(f"Final held-out accuracy:      {summary['final_accuracy']:.3f}  "
        f"({100 * (summary['final_accuracy'] - summary['warm_start_accuracy']):+.1f} points)")
  print(f"Wall time: {summary['wall_time_s']:.0f} s; outputs in {_CONFIG.value.workdir}")


if __name__ == "__main__":
  app.run(main)
