"""Producers: how the RL phase makes a batch, as a pair of pure functions (optax-style).

    producer = independent(ctx, selection_settings)      # or tree(...), partial.producer(...)
    state = producer.init(start)                          # at data position `start`
    rollout, stats, state = producer.produce(state, params, version, rng, trains_at)

`init(start)` is the producer's state at data cursor `start` (where the warm start left
the data stream). `produce` makes one scored batch with the sampler parameters `params`,
recording `version` on the tokens it generates, for the trainer step `trains_at` (what a
staleness bound is measured against), and returns the batch (advantages not yet set: the
loop's advantage stage computes them once on the final batch), its `BatchStats`
(rl/rollouts/statistics.py) and the new state. Everything a producer carries from one
batch to the next is in that state: the data cursor, the selection history, a partial
pool's unfinished rows. It lives in `rl.loop.LoopState.producer`, so a checkpoint of the
LoopState is all a run needs to resume. `for_checkpoint(state)` drops what need not be
saved (a partial pool's KV cache, rebuilt on the next round); `produce` accepts either.

The loop decides which parameters a producer gets (simulated staleness, LoRA merging,
resharding for the sampler) and when it runs (inline, or from a thread in the async loop),
so every producer composes with those. Rollout kinds (rl/rollouts/kinds.py) build the
producer a config names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import flax.struct
import jax
import numpy as np

from models.config import ModelConfig
from rl.rollouts import batches
from rl.rollouts import selection as selection_lib
from rl.rollouts import statistics
from rl.rollouts.statistics import BatchStats
from rl.tasks import Task
from rl.types import Rollout
from sampling.sampler import SamplingConfig
from sampling.tree import ForkPolicy


@dataclasses.dataclass(frozen=True)
class BatchContext:
  """The fixed pieces a producer needs to make batches.

  generate_fn: the sampler (`rl.rollouts.batches.make_generate`; None = unsharded
  `generate`). train_pool: finite prompt pool the data cursor cycles over (0 = the
  unbounded train split). keep_completions: keep each pool prompt's latest completion and
  hand it to the sampler as its 'history' draft source (speculative decoding, SPEC-RL);
  needs a finite train_pool. turns: the environment that answers tool calls mid-rollout
  (`rl.environments.turns.Turns`; generate_fn then runs turns; the warm start keeps its answers
  in demonstrations as context); None: no environment.
  """
  task: Task
  tokenizer: batches.Tokenizer
  model_config: ModelConfig
  sampling_config: SamplingConfig
  prompt_len: int
  prompts_per_step: int
  group_size: int
  train_pool: int = 0
  generate_fn: batches.GenerateFn | None = None
  keep_completions: bool = False
  turns: Any = None

  def example(self, cursor: int):
    """The train example at data cursor `cursor` (cycling over a finite pool)."""
    position = selection_lib.train_position(int(cursor), self.train_pool)
    return self.task.examples("train", 1, position)[0]


def _identity(state):
  return state


class Producer(NamedTuple):
  """A way of making batches: `init(start) -> state`; `produce(state, params, version, rng,
  trains_at) -> (Rollout, BatchStats, state)`; `for_checkpoint(state) -> state` (the state
  as a checkpoint keeps it; identity unless the state holds a rebuildable buffer). A state
  answers `summary() -> dict`: what the run's summary.json reports of it."""
  init: Callable[[int], Any]
  produce: Callable[..., tuple[Rollout, BatchStats, Any]]
  for_checkpoint: Callable[[Any], Any] = _identity


def cursor_array(cursor: int) -> np.ndarray:
  """A data cursor as a checkpointable leaf (int64: cursors outgrow int32 on long runs)."""
  return np.asarray(cursor, np.int64)


@flax.struct.dataclass
class CursorState:
  """A producer state that is only the next data cursor (the warm start's, a tree's)."""
  cursor: np.ndarray

  def summary(self) -> dict:
    """What the run's summary.json reports of this state (every producer state answers):
    nothing."""
    return {}


@flax.struct.dataclass
class PreviousCompletions:
  """Each pool prompt's latest completion (tokens, mask [pool, N]; an empty mask until the
  prompt is first sampled): the 'history' draft source of speculative decoding."""
  tokens: np.ndarray
  mask: np.ndarray


@flax.struct.dataclass
class SelectionProducerState:
  """The independent producer's state: the next data cursor, the per-prompt selection
  history (`rl.rollouts.selection.SelectionState`; None without a finite train pool) and
  the prompts' previous completions (None unless BatchContext.keep_completions)."""
  cursor: np.ndarray
  history: Optional[selection_lib.SelectionState] = None
  previous: Optional[PreviousCompletions] = None

  def summary(self) -> dict:
    """What the run's summary.json reports of this state: nothing."""
    return {}


def independent(ctx: BatchContext,
                selection: selection_lib.SelectionSettings = selection_lib.SelectionSettings(),
                ) -> Producer:
  """Independent samples of the prompts the selection rule picks (rl/rollouts/selection.py;
  the default is uniform): uniform is plain GRPO (group_size completions for each of the
  next prompts); dynamic, greso and adaptive choose prompts and rollout counts from
  rewards."""

  if ctx.keep_completions and not ctx.train_pool:
    raise ValueError("Keeping previous completions (the 'history' draft source) needs a "
                     "finite prompt pool: set config.task.train_pool.")
  new_tokens = ctx.sampling_config.max_new_tokens

  def init(start: int) -> SelectionProducerState:
    previous = None if not ctx.keep_completions else PreviousCompletions(
        tokens=np.zeros((ctx.train_pool, new_tokens), np.int32),
        mask=np.zeros((ctx.train_pool, new_tokens), bool))
    return SelectionProducerState(cursor=cursor_array(start),
                                  history=selection_lib.init_state(
                                      ctx.train_pool, selection,
                                      ctx.prompt_len + ctx.sampling_config.max_new_tokens),
                                  previous=previous)

  def produce(state: SelectionProducerState, params, version, rng, trains_at=None):
    del trains_at
    examples = {}
    previous = state.previous
    if previous is not None:  # this batch's completions replace the ones it drafts from
      previous = PreviousCompletions(tokens=np.array(previous.tokens),
                                     mask=np.array(previous.mask))

    def sample(row_positions, key):
      for p in set(row_positions.tolist()) - set(examples):
        examples[p] = ctx.task.examples("train", 1, p)[0]
      history = None if previous is None else (previous.tokens[row_positions],
                                                previous.mask[row_positions])
      samples = batches.sample_and_score(
          params, [examples[p] for p in row_positions.tolist()], task=ctx.task,
          tokenizer=ctx.tokenizer, rng=key, group_size=1, prompt_len=ctx.prompt_len,
          model_config=ctx.model_config, sampling_config=ctx.sampling_config,
          version=version, generate_fn=ctx.generate_fn, history=history)
      if previous is not None:  # a prompt's later rows overwrite its earlier ones
        tokens, mask = jax.device_get((samples.rollout.tokens, samples.rollout.completion_mask))
        previous.tokens[row_positions] = tokens[:, ctx.prompt_len:]
        previous.mask[row_positions] = mask[:, ctx.prompt_len:]
      return samples

    collected = selection_lib.collect(
        state.history, int(state.cursor), rng, sample, settings=selection,
        prompts_per_step=ctx.prompts_per_step, group_size=ctx.group_size,
        pool_size=ctx.train_pool)
    return collected.rollout, collected.stats, SelectionProducerState(
        cursor=cursor_array(collected.cursor), history=collected.selection, previous=previous)

  return Producer(init, produce)


def tree(ctx: BatchContext, policy: ForkPolicy) -> Producer:
  """One tree per prompt (`policy`) for each of the next prompts, its leaves scored (each
  shared-prefix token is trained once, in the row that decoded it; the loop's advantage
  stage is then rl.objectives.advantages.per_tree)."""

  def init(start: int) -> CursorState:
    return CursorState(cursor=cursor_array(start))

  def produce(state: CursorState, params, version, rng, trains_at=None):
    del trains_at
    cursor = int(state.cursor)
    examples = [ctx.example(c) for c in range(cursor, cursor + ctx.prompts_per_step)]
    samples = batches.tree_sample_and_score(
        params, examples, task=ctx.task, tokenizer=ctx.tokenizer, rng=rng,
        prompt_len=ctx.prompt_len, model_config=ctx.model_config,
        sampling_config=ctx.sampling_config, policy=policy, version=version)
    return (samples.rollout, tree_stats(samples, len(examples), ctx.prompt_len),
            CursorState(cursor=cursor_array(cursor + len(examples))))

  return Producer(init, produce)


def tree_stats(samples: batches.ScoredTree, prompts: int, prompt_len: int) -> BatchStats:
  """A batch of `prompts` trees, over their leaves (a leaf's completion is its whole
  root-to-leaf path, shared prefix included)."""
  leaf = samples.leaf.reshape(prompts, -1)
  rewards = np.asarray(samples.rollout.reward).reshape(leaf.shape)
  prompt_mask = np.asarray(samples.rollout.prompt_mask)
  full_len = (np.asarray(samples.rollout.completion_mask) | prompt_mask)[:, prompt_len:].sum(axis=1)
  leaves = int(leaf.sum())
  return statistics.batch_stats(
      [rewards[i][leaf[i]] for i in range(prompts)], samples.exact[samples.leaf],
      full_len[samples.leaf], full_len[samples.leaf], decoded_tokens=samples.decoded_tokens,
      scored=[samples], rows=samples.rows, leaves=float(leaves), refed_tokens=float(samples.refed_tokens),
      pruned_tokens=float(samples.pruned_tokens),
      decoded_tokens_per_leaf=samples.decoded_tokens / max(leaves, 1))
