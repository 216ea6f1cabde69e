"""Asynchronous RL (AReaL): a producer thread samples while the trainer trains.

The trainer publishes its parameters after every step (version = trainer step); the
producer samples each batch with the newest published version. Batch i is trained at
trainer step `base + i`, so its staleness is `base + i - (oldest version among its
tokens)`. The bound `max_staleness` is enforced, not logged: before sampling batch i the
producer waits until version `base + i - max_staleness` is published, and the trainer
refuses (RuntimeError) a batch beyond the bound (a partial-rollout producer discards groups
that would exceed it). With `max_staleness = 0` the producer always waits for the newest
parameters, and the loop reproduces the synchronous loop exactly (same RNG and data order).

Parameters reach the producer through `publish(params) -> params`, the hook where a sharded
run reshards trainer -> sampler layout (sharding issue); the default is the identity.
Published leaves never alias the trainer's buffers (the train step donates its state), so
a leaf returned unchanged by `publish` is copied.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rl import loop
from rl.loop import LoopContext, LoopState, Producer


class ParamChannel:
  """The newest published parameters and their version, shared by trainer and producer."""

  def __init__(self):
    self._cond = threading.Condition()
    self._params, self._version, self._closed = None, -1, False

  def publish(self, params, version: int) -> None:
    with self._cond:
      self._params, self._version = params, version
      self._cond.notify_all()

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def wait_for(self, min_version: int) -> tuple[Any, int]:
    """Blocks until a version >= min_version is published; returns the newest one."""
    with self._cond:
      self._cond.wait_for(lambda: self._closed or self._version >= min_version)
      if self._version < min_version:
        raise RuntimeError("The trainer stopped before publishing the parameters the "
                           f"producer waits for (version {min_version}).")
      return self._params, self._version


def _detached(published, trainer_state):
  """`published` with every leaf that aliases a leaf of the trainer's state (its parameters,
  or under LoRA the frozen base a merge passes through) replaced by a copy."""
  trainer_ids = {id(x) for x in jax.tree.leaves(trainer_state)}
  copied = jax.tree.map(lambda x: jnp.copy(x) if id(x) in trainer_ids else x, published)
  return jax.block_until_ready(copied)


def run_async(state: LoopState, ctx: LoopContext, produce: Producer, num_steps: int, *,
              max_staleness: int, publish: Callable[[Any], Any] = lambda params: params,
              on_step: Callable[[LoopState, dict], None] | None = None
              ) -> tuple[LoopState, list[dict]]:
  """Runs `num_steps` train steps with a concurrent producer; returns the state and metrics.

  The producer makes exactly `num_steps` batches, so when this returns nothing is in
  flight: the returned state's RNG, data cursor and selection history are where the
  producer stopped, and a checkpoint of it resumes exactly. `on_step(state, metrics)` is
  called after each step (logging, progress) from the trainer thread.

  Each step's time_step_s is the trainer thread's time since the previous step ended
  (waiting for the batch, training, publishing; `on_step` excluded). The batch's
  time_sample_s / time_score_s were spent by the producer thread, overlapping earlier
  train steps, so here they need not sum to less than time_step_s.
  """
  if max_staleness < 0:
    raise ValueError(f"max_staleness={max_staleness} must be >= 0 (config.rl.max_staleness).")
  base = int(state.train.step)
  channel = ParamChannel()
  channel.publish(_detached(publish(state.train.policy_params()), state.train), base)
  batches: queue.Queue = queue.Queue()

  def producer():
    rng, cursor, selection = state.rng, state.data_cursor, state.selection
    try:
      for i in range(num_steps):
        started = time.perf_counter()
        params, version = channel.wait_for(base + i - max_staleness)
        waited = time.perf_counter() - started
        rng, sample_rng = jax.random.split(rng)
        produced = loop.produce_timed(produce, params, version, base + i, sample_rng, cursor,
                                      selection)
        cursor, selection = produced.cursor, produced.selection
        produced.metrics.update(sampled_version=version, producer_wait_s=waited)
        batches.put(produced)
      batches.put((rng, cursor, selection))
    except BaseException as error:  # handed to the trainer thread, which re-raises it
      batches.put(error)

  thread = threading.Thread(target=producer, name="arbor-producer", daemon=True)
  step_started = time.perf_counter()
  thread.start()
  history = []
  try:
    for i in range(num_steps):
      item = batches.get()
      if isinstance(item, BaseException):
        raise item
      step = base + i
      stale = loop.staleness(item.rollout, step)
      if stale > max_staleness:
        raise RuntimeError(f"Batch for trainer step {step} has staleness {stale} > "
                           f"max_staleness={max_staleness}; the producer broke the bound.")
      train, metrics = loop.train_on(state.train, item, ctx, step)
      channel.publish(_detached(publish(train.policy_params()), train), step + 1)
      state = state.replace(train=train, iteration=state.iteration + 1)
      metrics["time_step_s"] = time.perf_counter() - step_started
      history.append(metrics)
      if on_step is not None:
        on_step(state, metrics)
      step_started = time.perf_counter()
    item = batches.get()
    if isinstance(item, BaseException):
      raise item
    rng, cursor, selection = item
  finally:
    channel.close()
    thread.join()
  return state.replace(rng=rng, data_cursor=cursor, selection=selection), history
