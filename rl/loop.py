"""The synchronous rollout -> score -> stages -> train loop (supervised warm start, then
GRPO).

Every way of making a GRPO batch is a producer (rl/rollouts/producers.py: `init` and
`produce`, its state explicit): independent samples of the prompts a selection rule picks
(uniform = plain GRPO), trees, or partial rollouts (rl/rollouts/partial.py). The batch then
passes through the run's batch stages (rl/stages.py: the reward stage, the sampler's
record, the advantages, training samples, token subsampling), and the train step trains on
it. `grpo_iteration` runs a producer with simulated staleness and sharded publishing around
it, its stages and one train step; the asynchronous loop (rl/async_loop.py) runs the same
producers, stages and `train_on` from two threads.

Each iteration is a plain function of explicit state (`LoopState`: the TrainState, RNG,
parameter history, the producer's state, which holds the data cursor, selection history
or partial pool, and the stages' state), so a launcher (experiments/train.py) can
checkpoint the LoopState between any two iterations and resume exactly.

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
import numpy as np

from rl import stages as stages_lib
from rl import timing
from rl.rollouts import batches as rollout_lib
from rl.rollouts import producers
from rl.rollouts.producers import BatchContext, Producer
from rl.tasks import Task
from rl.train import TrainState
from rl.types import Rollout


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
  """What the loop carries between iterations (the pytree a checkpoint saves).

  train: the TrainState; rng: the loop's PRNG key; history: the parameter ring for
  simulated staleness (None when off); producer: the state of the phase's batch producer
  (`rl.rollouts.producers`: the warm start's `CursorState`, the RL producer's own state,
  each holding the next data cursor); stages: the state of the phase's batch stages
  (`LoopContext.stages.init()`: TTRL's vote memory, else Nones); iteration: iterations
  done in the current phase (host int, static: the launcher keeps it with the
  checkpoint's step).
  """
  train: TrainState
  rng: jax.Array
  history: Optional[ParamHistory] = None
  producer: Any = None
  stages: Any = None
  iteration: int = flax.struct.field(pytree_node=False, default=0)


@dataclasses.dataclass(frozen=True)
class PeriodicCheck:
  """A diagnostic of the train step run every `every` iterations (0 = never):
  `check(trainer parameters, batch) -> metrics`, before the step, with the parameters it
  starts from (`rl.train.make_batch_size_check`)."""
  check: Callable[[Any, Rollout], dict]
  every: int

  def due(self, iteration: int) -> bool:
    """Whether the batch of (1-based) `iteration` is checked."""
    return bool(self.every and iteration % self.every == 0)


@dataclasses.dataclass(frozen=True)
class LoopContext:
  """The fixed pieces an iteration needs beyond its batch's (`batch`, what a producer and
  the warm start's supervised batches read).

  train_step: (TrainState, Rollout) -> (TrainState, metrics), jitted by rl.train.
  stages: the batch stages (`rl.stages.Stage`, a chain), from the produced batch to the
    one the step trains on; its state lives in `LoopState.stages`.
  staleness: simulated staleness k (GRPO samples with parameters k iterations old).
  publish: trainer parameters -> sampler parameters, called each time the sampler gets
    new parameters (`sharding.reshard.make_publish`: FSDP -> tensor-parallel on device;
    a quantiser for low-precision rollouts); None = the sampler reads the trainer's
    parameters as they are.
  logprob_check: `PeriodicCheck` of the trainer's log-probs of one batch scored all at once
    and one row at a time, adding its metrics to the step's; None = never. (Not a stage:
    it reads the parameters the train step starts from, which the asynchronous loop's
    producer thread does not have.)
  """
  batch: BatchContext
  train_step: Callable[[TrainState, Rollout], tuple[TrainState, dict]]
  stages: stages_lib.Stage = stages_lib.chain()
  staleness: int = 0
  publish: Callable[[Any], Any] | None = None
  logprob_check: PeriodicCheck | None = None


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
  b, cursor = ctx.batch, int(state.producer.cursor)
  if length_window > 1:
    examples = length_grouped_examples(b.task, cursor, b.prompts_per_step, length_window)
  else:
    examples = b.task.examples("train", b.prompts_per_step, cursor)
  batch = rollout_lib.supervised_batch(
      b.tokenizer, examples, b.prompt_len, b.sampling_config.max_new_tokens,
      environment=None if b.turns is None else b.turns.environment)
  train_started = time.perf_counter()
  train, metrics = ctx.train_step(state.train, batch)
  metrics = jax.device_get(metrics)
  metrics.update(train_throughput(batch, time.perf_counter() - train_started))
  new_state = state.replace(train=train, iteration=state.iteration + 1,
                            producer=state.producer.replace(
                                cursor=producers.cursor_array(cursor + len(examples))))
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


def staleness(rollout: Rollout, step: int) -> int:
  """`step` (the TrainState.step it is trained at) - the oldest parameter version among the
  batch's generated tokens."""
  version = np.asarray(rollout.version)
  generated = version[np.asarray(rollout.completion_mask)]
  return int(step - generated.min()) if generated.size else 0


def per_second(count: float, seconds: float) -> float:
  """count / seconds (0 for an empty interval)."""
  return float(count) / seconds if seconds > 0 else 0.0


def train_throughput(batch: Rollout, seconds: float) -> dict:
  """time_train_s, trained_tokens (the batch's real completion tokens: no padding, no
  prompt, and a tree's shared prefix once) and trained_tokens_per_s."""
  tokens = int(np.asarray(batch.completion_mask).sum())
  return dict(time_train_s=seconds, trained_tokens=tokens,
              trained_tokens_per_s=per_second(tokens, seconds))


def produce_timed(producer: Producer, ctx: LoopContext, state, stage_state, params,
                  version: int, rng: jax.Array, trains_at: int, *, iteration: int
                  ) -> tuple[Rollout, dict, Any, Any]:
  """`producer.produce(state, params, version, rng, trains_at)` and the batch stages
  (`LoopContext.stages`, given `params`, `rng` and the phase's 1-based `iteration`):
  (batch, its metrics, the producer's new state, the stages' new state). The metrics are
  the batch's `BatchStats` with the stages' counters and the wall time split into phases:
  time_rollout_s (all of it) = time_sample_s (generation, prompt encoding, the stages) +
  time_score_s (the task's reward scoring, rl.timing's "score" phase); and
  sampled_tokens_per_s = sampled_tokens / time_sample_s. Training samples, when a stage
  takes them, ride along as `samples`, a list of records (not a number: whoever logs the
  metrics takes it out)."""
  started = time.perf_counter()
  if stage_state is None:  # a LoopState made without its stages' state: theirs at the start
    stage_state = ctx.stages.init()
  with timing.phases() as parts:
    rollout, stats, state = producer.produce(state, params, version, rng, trains_at)
    rollout, stats, stage_state = ctx.stages.apply(rollout, stats, stage_state, params=params,
                                                   rng=rng, iteration=iteration)
  total = time.perf_counter() - started
  score_s = parts.get("score", 0.0)
  metrics = stats.metrics()
  metrics.update(time_rollout_s=total, time_score_s=score_s, time_sample_s=total - score_s,
                 sampled_tokens=stats.sampled_tokens,
                 sampled_tokens_per_s=per_second(stats.sampled_tokens, total - score_s))
  return rollout, metrics, state, stage_state


def train_on(train: TrainState, rollout: Rollout, batch_metrics: dict, ctx: LoopContext,
             step: int, iteration: int = 0) -> tuple[TrainState, dict]:
  """One train step on a produced batch (trained at TrainState.step `step`, the phase's
  1-based `iteration`); the train metrics, its time and trained tokens
  (`train_throughput`), the batch's metrics and its staleness, and when due the
  log-prob batch-size check's (`LoopContext.logprob_check`, before the step and outside
  its time: the step donates the parameters it starts from)."""
  checked = {}
  if ctx.logprob_check is not None and ctx.logprob_check.due(iteration):
    checked = jax.device_get(ctx.logprob_check.check(train.policy_params(), rollout))
  started = time.perf_counter()
  new_train, metrics = ctx.train_step(train, rollout)
  metrics = dict(jax.device_get(metrics), **checked)
  metrics.update(train_throughput(rollout, time.perf_counter() - started))
  metrics.update(batch_metrics, staleness=float(staleness(rollout, step)))
  return new_train, metrics


def grpo_iteration(state: LoopState, ctx: LoopContext,
                   producer: Producer) -> tuple[LoopState, dict]:
  """Produces a scored batch with `producer` (its state: state.producer), passes it
  through the batch stages (their state: state.stages) and takes one train step on it.

  With ctx.staleness = k > 0 the producer samples with the
  parameters of iteration max(t - k, 0) (state.history) and the tokens carry that version;
  with ctx.publish the parameters are handed over in the sampler's layout. Under LoRA the
  history holds adapters, and the sampler gets them merged into the frozen base.

  Metrics: the batch's (with its phase times, `produce_timed`), the train step's
  (`train_on`) and the iteration's wall time `time_step_s`, which bounds the sum of
  time_rollout_s and time_train_s.
  """
  started = time.perf_counter()
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
  step = int(state.train.step)
  rollout, batch_metrics, producer_state, stage_state = produce_timed(
      producer, ctx, state.producer, state.stages, params, int(version), sample_rng, step,
      iteration=state.iteration + 1)
  train, metrics = train_on(state.train, rollout, batch_metrics, ctx, step,
                            iteration=state.iteration + 1)
  new_state = state.replace(train=train, rng=rng, history=history, producer=producer_state,
                            stages=stage_state, iteration=state.iteration + 1)
  metrics["time_step_s"] = time.perf_counter() - started
  return new_state, metrics
