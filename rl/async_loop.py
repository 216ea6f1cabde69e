"""Asynchronous RL (AReaL): a producer thread samples while the trainer trains.

Versions count optimiser updates, as everywhere else (the sync loop, partial rollouts,
`prox_estimate='loglinear'`): a token's version is the TrainState.step of the parameters
that sampled it, and a batch's staleness is the step it is trained at minus its oldest
token's version. One batch takes U = num_minibatches * ppo_epochs updates, so every batch
trained between sampling and training adds up to U to its staleness.

The trainer publishes its parameters after every batch; the producer samples each batch
with the newest published ones. The bound `max_staleness` (in updates) is enforced, not
logged: the producer samples batch i only once batch i - max_staleness // U is trained
(`batch_lag`), and the trainer refuses (RuntimeError) a batch beyond the bound (a
partial-rollout producer discards groups that would exceed it). With max_staleness < U
(0 included) the producer always waits for the newest parameters, and the loop reproduces
the synchronous loop exactly (same RNG and data order). U is given (`updates_per_batch`)
or learnt from the first batch: TrainState.step + nonfinite_updates grows by exactly U per
batch, skipped updates included; until then the producer does not run ahead.

Parameters reach the producer through `publish(params) -> params`, the hook where a sharded
run reshards trainer -> sampler layout (sharding issue); the default is the identity.
Published leaves never alias the trainer's buffers (the train step donates its state), so
a leaf returned unchanged by `publish` is copied.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rl import loop
from rl.loop import LoopContext, LoopState
from rl.rollouts.producers import Producer
from rl.train import TrainState


@dataclasses.dataclass(frozen=True)
class Published:
  """Parameters handed to the producer. version: their TrainState.step; trained: batches
  this run had trained when they were published; updates_per_batch: optimiser updates
  (applied or skipped) one batch takes (given to `run_async`, else None until a batch is
  trained)."""
  params: Any
  version: int
  trained: int
  updates_per_batch: int | None = None


class ParamChannel:
  """The newest `Published` parameters, shared by trainer and producer."""

  def __init__(self):
    self._cond = threading.Condition()
    self._newest, self._closed = None, False

  def publish(self, published: Published) -> None:
    with self._cond:
      self._newest = published
      self._cond.notify_all()

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def wait_for(self, min_trained: int) -> Published:
    """Blocks until parameters trained on >= min_trained batches are published; returns
    the newest."""
    ready = lambda: self._newest is not None and self._newest.trained >= min_trained
    with self._cond:
      self._cond.wait_for(lambda: self._closed or ready())
      if not ready():
        raise RuntimeError("The trainer stopped before publishing the parameters the "
                           f"producer waits for (after {min_trained} batches).")
      return self._newest


def batch_lag(max_staleness: int, updates_per_batch: int) -> int:
  """Batches the producer may sample ahead of the trainer within `max_staleness` updates:
  each batch trained in between adds up to `updates_per_batch` updates of staleness."""
  return max_staleness // updates_per_batch


def updates_taken(train: TrainState) -> int:
  """Optimiser updates a TrainState has taken: applied (step) plus skipped as non-finite."""
  return int(train.step) + int(train.nonfinite_updates)


def expected_step(published: Published, batch: int, updates_per_batch: int | None) -> int:
  """The TrainState.step batch `batch` will be trained at when sampled with `published`:
  its version plus U updates per batch trained in between (fewer if one is skipped, so the
  partial-rollout pool's discards against it stay within the bound)."""
  ahead = batch - published.trained
  return published.version + ahead * updates_per_batch if ahead else published.version


def _detached(published, trainer_state):
  """`published` with every leaf that aliases a leaf of the trainer's state (its parameters,
  or under LoRA the frozen base a merge passes through) replaced by a copy."""
  trainer_ids = {id(x) for x in jax.tree.leaves(trainer_state)}
  copied = jax.tree.map(lambda x: jnp.copy(x) if id(x) in trainer_ids else x, published)
  return jax.block_until_ready(copied)


def run_async(state: LoopState, ctx: LoopContext, producer: Producer, num_steps: int, *,
              max_staleness: int, publish: Callable[[Any], Any] = lambda params: params,
              on_step: Callable[[LoopState, dict], None] | None = None,
              updates_per_batch: int | None = None) -> tuple[LoopState, list[dict]]:
  """Runs `num_steps` train steps with a concurrent producer; returns the state and metrics.

  max_staleness: bound on (train step - oldest token version), in optimiser updates.
  updates_per_batch: optimiser updates one train step takes (config.rl.num_minibatches *
  ppo_epochs); None = learnt from the first batch, so batch 1 is sampled after batch 0 is
  trained. When given, a train step that takes another number is refused (ValueError).

  The producer makes exactly `num_steps` batches, so when this returns nothing is in
  flight: the returned state's RNG and producer state (data cursor, selection history,
  partial pool) are where the producer stopped, and a checkpoint of it resumes exactly. `on_step(state, metrics)` is
  called after each step (logging, progress) from the trainer thread.

  Each step's time_step_s is the trainer thread's time from the previous step's end (just
  before it published its parameters) to this step's end: publishing the previous
  parameters, the previous step's `on_step`, waiting for the batch and training. Steps
  tile the trainer's time with no gap. The batch's time_sample_s / time_score_s were spent
  by the producer thread, overlapping earlier train steps when it runs ahead, so they need
  not sum to less than time_step_s; with max_staleness = 0 they do (the producer samples
  only after the previous step's end).
  """
  if max_staleness < 0:
    raise ValueError(f"max_staleness={max_staleness} must be >= 0 (config.rl.max_staleness).")
  if updates_per_batch is not None and updates_per_batch < 1:
    raise ValueError(f"updates_per_batch={updates_per_batch} must be >= 1.")
  channel = ParamChannel()
  channel.publish(Published(_detached(publish(state.train.policy_params()), state.train),
                            int(state.train.step), 0, updates_per_batch))
  batches: queue.Queue = queue.Queue()

  def produce_batches():
    rng, producer_state, stage_state, first = (state.rng, state.producer, state.stages,
                                               state.iteration)
    updates = updates_per_batch
    try:
      for i in range(num_steps):
        started = time.perf_counter()
        if i and updates is None:  # learnt once the first batch is trained
          updates = channel.wait_for(1).updates_per_batch
        newest = channel.wait_for(i - batch_lag(max_staleness, updates) if i else 0)
        waited = time.perf_counter() - started
        rng, sample_rng = jax.random.split(rng)
        rollout, metrics, producer_state, stage_state = loop.produce_timed(
            producer, ctx, producer_state, stage_state, newest.params, newest.version,
            sample_rng, expected_step(newest, i, updates), iteration=first + i + 1)
        metrics.update(sampled_version=newest.version, time_producer_wait_s=waited)
        batches.put((rollout, metrics))
      batches.put((rng, producer_state, stage_state))
    except BaseException as error:  # handed to the trainer thread, which re-raises it
      batches.put(error)

  thread = threading.Thread(target=produce_batches, name="arbor-producer", daemon=True)
  step_started = time.perf_counter()  # the producer starts after this
  thread.start()
  history = []
  try:
    for i in range(num_steps):
      item = batches.get()
      if isinstance(item, BaseException):
        raise item
      rollout, batch_metrics = item
      step, before = int(state.train.step), updates_taken(state.train)
      stale = loop.staleness(rollout, step)
      if stale > max_staleness:
        raise RuntimeError(f"Batch for trainer step {step} has staleness {stale} > "
                           f"max_staleness={max_staleness}; the producer broke the bound.")
      train, metrics = loop.train_on(state.train, rollout, batch_metrics, ctx, step,
                                     iteration=state.iteration + 1)
      updates = updates_taken(train) - before
      if updates_per_batch is not None and updates != updates_per_batch:
        raise ValueError(f"run_async(updates_per_batch={updates_per_batch}), but the train "
                         f"step took {updates} optimiser updates; pass config.rl."
                         "num_minibatches * ppo_epochs, or None to learn it.")
      # The step ends just before its parameters are published: the producer can use them
      # only after that, so a batch it samples from them falls inside the next step's time.
      step_ended = time.perf_counter()
      channel.publish(Published(_detached(publish(train.policy_params()), train),
                                int(train.step), i + 1, updates))
      state = state.replace(train=train, iteration=state.iteration + 1)
      metrics["time_step_s"] = step_ended - step_started
      history.append(metrics)
      if on_step is not None:
        on_step(state, metrics)
      step_started = step_ended
    item = batches.get()
    if isinstance(item, BaseException):
      raise item
    rng, producer_state, stage_state = item
  finally:
    channel.close()
    thread.join()
  return state.replace(rng=rng, producer=producer_state, stages=stage_state), history
