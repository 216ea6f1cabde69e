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
      decode_steps=samples.decode_steps)
  new_state = state.replace(train=train, rng=rng,
                            data_cursor=state.data_cursor + len(examples),
                            iteration=state.iteration + 1)
  return new_state, metrics
