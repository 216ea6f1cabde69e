"""The synchronous rollout -> score -> train loop (supervised warm start, then GRPO).

Each iteration is a plain function of explicit state, so a launcher (experiments/train.py)
can checkpoint between any two of them and resume exactly: the data cursor, RNG and
TrainState are all the loop carries.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import numpy as np

from models.config import ModelConfig
from rl import rollout as rollout_lib
from rl.tasks import Task
from rl.train import TrainState
from rl.types import Rollout
from sampling.sampler import SamplingConfig
from sampling.tree import ForkPolicy


@flax.struct.dataclass
class LoopState:
  """What the loop carries between iterations (all of it is checkpointed).

  train: the TrainState; rng: the loop's PRNG key; data_cursor: next train-split position
  (host int); iteration: iterations done in the current phase (host int).
  """
  train: TrainState
  rng: jax.Array
  data_cursor: int = flax.struct.field(pytree_node=False, default=0)
  iteration: int = flax.struct.field(pytree_node=False, default=0)


@dataclasses.dataclass(frozen=True)
class LoopContext:
  """The fixed pieces an iteration needs."""
  task: Task
  tokenizer: rollout_lib.Tokenizer
  model_config: ModelConfig
  sampling_config: SamplingConfig
  prompt_len: int
  prompts_per_step: int
  group_size: int
  train_step: Callable[[TrainState, Rollout], tuple[TrainState, dict]]
  advantage_fn: Callable
  # Tree rollouts (config.rollout.kind='tree'): the fork policy and a TREE_ADVANTAGES fn.
  tree_policy: ForkPolicy | None = None
  tree_advantage_fn: Callable | None = None


def sft_iteration(state: LoopState, ctx: LoopContext) -> tuple[LoopState, dict]:
  """One supervised step on the task's reference answers (the warm start)."""
  examples = ctx.task.examples("train", ctx.prompts_per_step, state.data_cursor)
  batch = rollout_lib.supervised_batch(ctx.tokenizer, examples, ctx.prompt_len,
                                       ctx.sampling_config.max_new_tokens)
  train, metrics = ctx.train_step(state.train, batch)
  new_state = state.replace(train=train, data_cursor=state.data_cursor + len(examples),
                            iteration=state.iteration + 1)
  return new_state, jax.device_get(metrics)


def grpo_iteration(state: LoopState, ctx: LoopContext) -> tuple[LoopState, dict]:
  """Sample G completions for each of the next prompts, score them, take one train step."""
  rng, sample_rng = jax.random.split(state.rng)
  examples = ctx.task.examples("train", ctx.prompts_per_step, state.data_cursor)
  samples = rollout_lib.sample_and_score(
      state.train.params, examples, task=ctx.task, tokenizer=ctx.tokenizer, rng=sample_rng,
      group_size=ctx.group_size, prompt_len=ctx.prompt_len, model_config=ctx.model_config,
      sampling_config=ctx.sampling_config, advantage_fn=ctx.advantage_fn,
      version=int(state.train.step))
  train, metrics = ctx.train_step(state.train, samples.rollout)
  metrics = jax.device_get(metrics)
  rewards = np.asarray(samples.rollout.reward).reshape(-1, ctx.group_size)
  metrics.update(
      reward_mean=float(rewards.mean()), exact_match=float(samples.exact.mean()),
      informative_groups=float(np.mean(rewards.std(axis=1) > 0)),
      completion_len=float(np.asarray(samples.rollout.completion_mask).sum(axis=1).mean()),
      decode_steps=samples.decode_steps,
      decoded_tokens=float(np.asarray(samples.rollout.completion_mask).sum()))
  new_state = state.replace(train=train, rng=rng,
                            data_cursor=state.data_cursor + len(examples),
                            iteration=state.iteration + 1)
  return new_state, metrics


def tree_iteration(state: LoopState, ctx: LoopContext) -> tuple[LoopState, dict]:
  """Sample one tree per prompt (ctx.tree_policy), score its leaves, take one train step
  with tree advantages (each shared-prefix token trained once)."""
  if ctx.tree_policy is None or ctx.tree_advantage_fn is None:
    raise ValueError("tree_iteration needs LoopContext.tree_policy and tree_advantage_fn "
                     "(set config.rollout.kind='tree').")
  rng, sample_rng = jax.random.split(state.rng)
  examples = ctx.task.examples("train", ctx.prompts_per_step, state.data_cursor)
  samples = rollout_lib.tree_sample_and_score(
      state.train.params, examples, task=ctx.task, tokenizer=ctx.tokenizer, rng=sample_rng,
      prompt_len=ctx.prompt_len, model_config=ctx.model_config,
      sampling_config=ctx.sampling_config, policy=ctx.tree_policy,
      advantage_fn=ctx.tree_advantage_fn, version=int(state.train.step))
  train, metrics = ctx.train_step(state.train, samples.rollout)
  metrics = jax.device_get(metrics)
  leaf = samples.leaf.reshape(len(examples), -1)
  rewards = np.asarray(samples.rollout.reward).reshape(leaf.shape)
  count = np.maximum(leaf.sum(axis=1), 1)
  mean = (rewards * leaf).sum(axis=1) / count
  var = (((rewards - mean[:, None]) ** 2) * leaf).sum(axis=1) / count
  prompt_mask = np.asarray(samples.rollout.prompt_mask)
  full_len = (np.asarray(samples.rollout.completion_mask) | prompt_mask)[:, ctx.prompt_len:].sum(axis=1)
  metrics.update(
      reward_mean=float(rewards[leaf].mean()), exact_match=float(samples.exact[samples.leaf].mean()),
      informative_groups=float(np.mean(var > 0)), leaves=float(leaf.sum()),
      completion_len=float(full_len[samples.leaf].mean()),
      decoded_tokens=float(samples.decoded_tokens), refed_tokens=float(samples.refed_tokens),
      pruned_tokens=float(samples.pruned_tokens),
      decoded_tokens_per_leaf=samples.decoded_tokens / max(int(leaf.sum()), 1))
  new_state = state.replace(train=train, rng=rng,
                            data_cursor=state.data_cursor + len(examples),
                            iteration=state.iteration + 1)
  return new_state, metrics
