"""The synchronous rollout -> score -> train loop (supervised warm start, then GRPO).

Every way of making a GRPO batch is a producer (`Producer`): independent samples of the
prompts `rl.rollouts.selection` picks (uniform = plain GRPO), trees (`tree_producer`), or partial
rollouts (rl/rollouts/partial.py). `grpo_iteration` runs any of them with simulated
staleness and sharded publishing around it, and the asynchronous loop (rl/rollouts/async_loop.py)
runs the same producers and `train_on` from two threads.

Each iteration is a plain function of explicit state, so a launcher (experiments/train.py)
can checkpoint between any two of them and resume exactly: the data cursor, RNG,
TrainState, parameter history and prompt-selection history are all the loop carries.
Which prompts a GRPO iteration rolls out, and how many times each, is `rl.rollouts.selection`'s
choice.

Simulated staleness (docs/concepts.md, Staleness): with `LoopContext.staleness = k > 0`, GRPO
iteration t samples with the parameters of iteration max(t - k, 0), kept in a ring buffer
of the last k parameter versions (`ParamHistory`, part of the checkpointed state), and the
tokens record that version. Deterministic: the same seed gives the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from models.config import ModelConfig
from rl.rollouts import batches as rollout_lib
from rl.rollouts import selection as selection_lib
from rl import timing
from rl.tasks import Task
from rl.train import TrainState
from rl.types import Rollout
from sampling.sampler import SamplingConfig
from sampling.tree import ForkPolicy


@flax.struct.dataclass
class ParamHistory:
  """Ring buffer of past parameter versions for simulated staleness.

  params: the parameter pytree with every leaf stacked [k, ...]; slot t % k holds the
  parameters in force at iteration t. version [k] int32: their TrainState.step.
  """
  params: Any
  version: jax.Array


def init_history(params, staleness: int, version: int = 0) -> ParamHistory:
  """A ring of `staleness` slots, every slot holding `params` (the version before step 0)."""
  if staleness <= 0:
    raise ValueError(f"init_history needs staleness > 0 (config.rl.staleness), got {staleness}.")
  stacked = jax.tree.map(lambda p: jnp.broadcast_to(p, (staleness, *p.shape)).copy(), params)
  return ParamHistory(params=stacked, version=jnp.full((staleness,), version, jnp.int32))


@jax.jit
def _read_slot(history: ParamHistory, slot) -> tuple[Any, jax.Array]:
  return jax.tree.map(lambda b: b[slot], history.params), history.version[slot]


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(history: ParamHistory, slot, params, version) -> ParamHistory:
  def put(buf, value):
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), slot, 0)

  return ParamHistory(params=jax.tree.map(put, history.params, params),
                      version=put(history.version, jnp.asarray(version, jnp.int32)))


def stale_params(history: ParamHistory, iteration: int, params,
                 version) -> tuple[Any, jax.Array, ParamHistory]:
  """(sampling params, their version, updated ring) for iteration t with staleness k.

  Samples with the parameters of iteration max(t - k, 0), read before this iteration's
  parameters are written into slot t % k (the slot of iteration t - k, no longer needed).
  """
  k = history.version.shape[0]
  source = max(iteration - k, 0)
  if source == iteration:
    sample_params, sample_version = params, jnp.asarray(version, jnp.int32)
  else:
    sample_params, sample_version = _read_slot(history, source % k)
  return sample_params, sample_version, _write_slot(history, iteration % k, params, version)


@flax.struct.dataclass
class LoopState:
  """What the loop carries between iterations (all of it is checkpointed).

  train: the TrainState; rng: the loop's PRNG key; history: the parameter ring for
  simulated staleness (None when off); selection: per-prompt selection history
  (`rl.rollouts.selection.SelectionState`, None without a finite train pool); data_cursor: next
  data cursor (host int; the train position it reads is `selection.train_position`);
  iteration: iterations done in the current phase (host int).
  """
  train: TrainState
  rng: jax.Array
  history: Optional[ParamHistory] = None
  selection: Optional[selection_lib.SelectionState] = None
  data_cursor: int = flax.struct.field(pytree_node=False, default=0)
  iteration: int = flax.struct.field(pytree_node=False, default=0)


@dataclasses.dataclass(frozen=True)
class LoopContext:
  """The fixed pieces an iteration needs.

  generate_fn: the sampler (`rl.rollouts.batches.make_generate`; None = unsharded `generate`).
  publish: trainer parameters -> sampler parameters, called each time the sampler gets
  new parameters (`sharding.reshard.make_publish`: FSDP -> tensor-parallel on device);
  None = the sampler reads the trainer's parameters as they are.
  """
  task: Task
  tokenizer: rollout_lib.Tokenizer
  model_config: ModelConfig
  sampling_config: SamplingConfig
  prompt_len: int
  prompts_per_step: int
  group_size: int
  train_step: Callable[[TrainState, Rollout], tuple[TrainState, dict]]
  # The advantage stage (rl.objectives.advantages.group_relative / per_tree): the final
  # batch -> its per-token advantages, computed once by `with_advantages`.
  batch_advantages: Callable[[Rollout], jax.Array]
  staleness: int = 0  # simulated staleness k (GRPO samples with parameters k iterations old)
  # config.selection (rl/rollouts/selection.py); None = uniform. train_pool: finite prompt pool the
  # GRPO data cursor cycles over (0 = unbounded train split).
  selection: Any = None
  train_pool: int = 0
  generate_fn: rollout_lib.GenerateFn | None = None
  publish: Callable[[Any], Any] | None = None


_UNIFORM = ml_collections.FrozenConfigDict(dict(kind="uniform", max_attempts=1))


def sft_iteration(state: LoopState, ctx: LoopContext,
                  length_window: int = 1) -> tuple[LoopState, dict]:
  """One supervised step on the task's reference answers (the warm start).

  With length_window = W > 1 the step's batch comes from a length-sorted window
  (`length_grouped_examples`): W consecutive batches' worth of train examples, sorted by
  answer length, so each batch holds answers of similar length and a train step built with
  `length_buckets` runs short batches at a short length.

  Metrics: the train step's, with its time and trained tokens (`train_throughput`), and
  the step's wall time `time_step_s` (batch building included).
  """
  started = time.perf_counter()
  if length_window > 1:
    examples = length_grouped_examples(ctx.task, state.data_cursor, ctx.prompts_per_step,
                                       length_window)
  else:
    examples = ctx.task.examples("train", ctx.prompts_per_step, state.data_cursor)
  batch = rollout_lib.supervised_batch(ctx.tokenizer, examples, ctx.prompt_len,
                                       ctx.sampling_config.max_new_tokens)
  train_started = time.perf_counter()
  train, metrics = ctx.train_step(state.train, batch)
  metrics = jax.device_get(metrics)
  metrics.update(train_throughput(batch, time.perf_counter() - train_started))
  new_state = state.replace(train=train, data_cursor=state.data_cursor + len(examples),
                            iteration=state.iteration + 1)
  metrics["time_step_s"] = time.perf_counter() - started
  return new_state, metrics


def length_grouped_examples(task: Task, cursor: int, batch_size: int, window: int) -> list:
  """The batch at data position `cursor` when train positions are read in windows of
  `window * batch_size`, each window's examples sorted by answer length (stable) and dealt
  out in that order (the "group by length" of sequence-to-sequence trainers).

  A pure function of the cursor (which must be a multiple of batch_size), so a resumed run
  reads the same batches; every position of a window is used exactly once.
  """
  span = window * batch_size
  start = cursor - cursor % span
  order = _length_sorted_window(task, start, span)
  offset = cursor - start
  return [order[i] for i in range(offset, offset + batch_size)]


@functools.lru_cache(maxsize=2)
def _length_sorted_window(task: Task, start: int, span: int) -> tuple:
  examples = task.examples("train", span, start)
  return tuple(sorted(examples, key=lambda e: len(e.answer)))


@dataclasses.dataclass
class Produced:
  """One scored GRPO batch and where the producer left the data stream.

  rollout: the batch to train on; metrics: its statistics (reward_mean, exact_match,
  informative_groups, completion_len, decoded_tokens, completion_length_counts, ... and the
  strategy's own counters); cursor: the next data cursor; selection: the updated
  prompt-selection history (None without a finite train pool).
  """
  rollout: Rollout
  metrics: dict
  cursor: int
  selection: Optional[selection_lib.SelectionState] = None


# A producer makes one scored batch, whatever the rollout strategy:
# produce(params, version, train_step, rng, cursor, selection) -> Produced. `version` is
# recorded on the generated tokens; `train_step` is the trainer step the batch will be
# trained at; `cursor` is the next data cursor and `selection` the selection history. The
# sync loop (`grpo_iteration`) calls it inline, the async loop (rl/rollouts/async_loop.py) from a
# thread; simulated staleness and sharded publishing happen around it, in the loop.
Producer = Callable[..., Produced]


def completion_length_counts(completion_mask) -> np.ndarray:
  """Histogram of completion lengths: counts[n] = rows with n completion tokens."""
  return np.bincount(np.asarray(completion_mask).sum(axis=1))


def group_batch_metrics(samples: rollout_lib.ScoredSamples, group_size: int) -> dict:
  """Statistics of a batch of whole groups of `group_size` rows (partial rollouts; the
  selection producer has `rl.rollouts.selection.collect`'s, over every round it rolled out)."""
  rewards = np.asarray(samples.rollout.reward).reshape(-1, group_size)
  completion_mask = np.asarray(samples.rollout.completion_mask)
  return dict(reward_mean=float(rewards.mean()), exact_match=float(samples.exact.mean()),
              informative_groups=float(np.mean(rewards.std(axis=1) > 0)),
              completion_len=float(completion_mask.sum(axis=1).mean()),
              decoded_tokens=float(completion_mask.sum()), decode_steps=samples.decode_steps,
              completion_length_counts=completion_length_counts(completion_mask),
              reward_timeouts=samples.reward_timeouts, reward_errors=samples.reward_errors)


def selection_producer(ctx: LoopContext) -> Producer:
  """Independent samples of the prompts `ctx.selection` picks (rl/rollouts/selection.py): uniform
  is plain GRPO (G completions for each of the next prompts); dynamic, greso and adaptive
  choose prompts and rollout counts from rewards."""
  config = ctx.selection or _UNIFORM

  def produce(params, version, train_step, rng, cursor, selection):
    del train_step
    examples = {}

    def sample(row_positions, key):
      for p in set(row_positions.tolist()) - set(examples):
        examples[p] = ctx.task.examples("train", 1, p)[0]
      return rollout_lib.sample_and_score(
          params, [examples[p] for p in row_positions.tolist()], task=ctx.task,
          tokenizer=ctx.tokenizer, rng=key, group_size=1, prompt_len=ctx.prompt_len,
          model_config=ctx.model_config, sampling_config=ctx.sampling_config,
          version=version, generate_fn=ctx.generate_fn)

    collected = selection_lib.collect(
        selection, cursor, rng, sample, config=config, prompts_per_step=ctx.prompts_per_step,
        group_size=ctx.group_size, pool_size=ctx.train_pool)
    metrics = dict(collected.metrics,
                   completion_len=collected.metrics["decoded_tokens"] / collected.metrics["rollouts"],
                   completion_length_counts=completion_length_counts(
                       collected.rollout.completion_mask))
    return Produced(collected.rollout, metrics, collected.cursor, collected.selection)
  return produce


def tree_producer(ctx: LoopContext, policy: ForkPolicy) -> Producer:
  """One tree per prompt (`policy`) for each of the next prompts, its leaves scored (each
  shared-prefix token is trained once, in the row that decoded it; ctx.batch_advantages is
  then rl.objectives.advantages.per_tree)."""

  def produce(params, version, train_step, rng, cursor, selection):
    del train_step
    positions = selection_lib.train_position(
        np.arange(cursor, cursor + ctx.prompts_per_step), ctx.train_pool)
    examples = [ctx.task.examples("train", 1, int(p))[0] for p in positions]
    samples = rollout_lib.tree_sample_and_score(
        params, examples, task=ctx.task, tokenizer=ctx.tokenizer, rng=rng,
        prompt_len=ctx.prompt_len, model_config=ctx.model_config,
        sampling_config=ctx.sampling_config, policy=policy, version=version)
    return Produced(samples.rollout, tree_batch_metrics(samples, len(examples), ctx.prompt_len),
                    cursor + len(examples), selection)
  return produce


def tree_batch_metrics(samples: rollout_lib.ScoredTree, prompts: int, prompt_len: int) -> dict:
  """Statistics of a batch of `prompts` trees, over their leaves (a leaf's completion is
  its whole root-to-leaf path, shared prefix included)."""
  leaf = samples.leaf.reshape(prompts, -1)
  rewards = np.asarray(samples.rollout.reward).reshape(leaf.shape)
  count = np.maximum(leaf.sum(axis=1), 1)
  mean = (rewards * leaf).sum(axis=1) / count
  var = (((rewards - mean[:, None]) ** 2) * leaf).sum(axis=1) / count
  prompt_mask = np.asarray(samples.rollout.prompt_mask)
  full_len = (np.asarray(samples.rollout.completion_mask) | prompt_mask)[:, prompt_len:].sum(axis=1)
  return dict(
      reward_mean=float(rewards[leaf].mean()), exact_match=float(samples.exact[samples.leaf].mean()),
      informative_groups=float(np.mean(var > 0)), leaves=float(leaf.sum()),
      completion_len=float(full_len[samples.leaf].mean()),
      decoded_tokens=float(samples.decoded_tokens), refed_tokens=float(samples.refed_tokens),
      pruned_tokens=float(samples.pruned_tokens),
      decoded_tokens_per_leaf=samples.decoded_tokens / max(int(leaf.sum()), 1),
      completion_length_counts=np.bincount(full_len[samples.leaf]),
      reward_timeouts=samples.reward_timeouts, reward_errors=samples.reward_errors)


def staleness(rollout: Rollout, train_step: int) -> int:
  """train_step - the oldest parameter version among the batch's generated tokens."""
  version = np.asarray(rollout.version)
  generated = version[np.asarray(rollout.completion_mask)]
  return int(train_step - generated.min()) if generated.size else 0


def per_second(count: float, seconds: float) -> float:
  """count / seconds (0 for an empty interval)."""
  return float(count) / seconds if seconds > 0 else 0.0


def train_throughput(batch: Rollout, seconds: float) -> dict:
  """time_train_s, trained_tokens (the batch's real completion tokens: no padding, no
  prompt, and a tree's shared prefix once) and trained_tokens_per_s."""
  tokens = int(np.asarray(batch.completion_mask).sum())
  return dict(time_train_s=seconds, trained_tokens=tokens,
              trained_tokens_per_s=per_second(tokens, seconds))


def sampled_tokens(metrics: dict) -> int:
  """Tokens a producer generated for its batch: a partial-rollout pool's decoded this step
  (generated_tokens), else the batch's real completion tokens (decoded_tokens; a tree's
  decoded nodes, every selection round's rows)."""
  return int(metrics.get("generated_tokens", metrics.get("decoded_tokens", 0)))


def with_advantages(produced: Produced, ctx: LoopContext) -> Produced:
  """The advantage stage: the produced batch with its per-token advantages, computed once
  on the final batch by ctx.batch_advantages (whatever rounds, rejections or pool made it)."""
  rollout = produced.rollout
  return dataclasses.replace(produced,
                             rollout=rollout.replace(advantages=ctx.batch_advantages(rollout)))


def produce_timed(produce: Producer, ctx: LoopContext, *args) -> Produced:
  """`produce(*args)` and the advantage stage (`with_advantages`), with their wall time
  split into phases in the batch's metrics: time_rollout_s (all of it) = time_sample_s
  (generation, prompt encoding, advantages) + time_score_s (the task's reward scoring,
  rl.timing's "score" phase); and sampled_tokens_per_s = sampled_tokens / time_sample_s."""
  started = time.perf_counter()
  with timing.phases() as parts:
    produced = with_advantages(produce(*args), ctx)
  total = time.perf_counter() - started
  score_s = parts.get("score", 0.0)
  tokens = sampled_tokens(produced.metrics)
  produced.metrics.update(time_rollout_s=total, time_score_s=score_s,
                          time_sample_s=total - score_s, sampled_tokens=tokens,
                          sampled_tokens_per_s=per_second(tokens, total - score_s))
  return produced


def train_on(train: TrainState, produced: Produced, ctx: LoopContext,
             train_step: int) -> tuple[TrainState, dict]:
  """One train step on a produced batch; the train metrics, its time and trained tokens
  (`train_throughput`), the batch's statistics and its staleness."""
  started = time.perf_counter()
  new_train, metrics = ctx.train_step(train, produced.rollout)
  metrics = jax.device_get(metrics)
  metrics.update(train_throughput(produced.rollout, time.perf_counter() - started))
  metrics.update(produced.metrics, staleness=float(staleness(produced.rollout, train_step)))
  return new_train, metrics


def grpo_iteration(state: LoopState, ctx: LoopContext,
                   produce: Producer | None = None) -> tuple[LoopState, dict]:
  """Produces a scored batch and takes one train step on it.

  `produce` is the sampling strategy (default `selection_producer(ctx)`: uniform or
  selected independent samples; rl.rollouts.kinds builds the others). With ctx.staleness = k > 0 the producer samples with the
  parameters of iteration max(t - k, 0) (state.history) and the tokens carry that version;
  with ctx.publish the parameters are handed over in the sampler's layout. Under LoRA the
  history holds adapters, and the sampler gets them merged into the frozen base.

  Metrics: the batch's (with its phase times, `produce_timed`), the train step's
  (`train_on`) and the iteration's wall time `time_step_s`, which bounds the sum of
  time_rollout_s and time_train_s.
  """
  started = time.perf_counter()
  produce = produce or selection_producer(ctx)
  rng, sample_rng = jax.random.split(state.rng)
  params, version, history = state.train.params, state.train.step, state.history
  if ctx.staleness:
    if history is None or history.version.shape[0] != ctx.staleness:
      raise ValueError(f"LoopContext.staleness={ctx.staleness} needs LoopState.history = "
                       f"init_history(params, {ctx.staleness}).")
    params, version, history = stale_params(history, state.iteration, params, version)
  params = state.train.policy_params(params)  # under LoRA: the adapters merged into the base
  if ctx.publish is not None:
    params = ctx.publish(params)
  train_step = int(state.train.step)
  produced = produce_timed(produce, ctx, params, int(version), train_step, sample_rng,
                           state.data_cursor, state.selection)
  train, metrics = train_on(state.train, produced, ctx, train_step)
  new_state = state.replace(train=train, rng=rng, history=history, selection=produced.selection,
                            data_cursor=produced.cursor, iteration=state.iteration + 1)
  metrics["time_step_s"] = time.perf_counter() - started
  return new_state, metrics
