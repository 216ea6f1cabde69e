"""Tests for rl.async_loop: bounded staleness, exact sync equivalence, learning."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from models.config import get_preset
from models.tokenizer import CharTokenizer
from rl.objectives import advantages
from rl import async_loop
from rl import loop
from rl.rollouts import partial as partial_rollout
from rl.rollouts import batches as rollout_lib
from rl.rollouts import producers
from rl.rollouts import statistics
from rl import timing
from rl import train
from rl.tasks import Example
from rl.tasks import make_task
from rl.types import Rollout
from rl.objectives import losses
from sampling.partial import PartialConfig
from sampling.sampler import SamplingConfig
from tests.rl_fixtures import GRPO

TOKENIZER = CharTokenizer()


# Fakes for the staleness tests: the trainer is slow, the producer fast.

def _fake_batch(version, rows=4, width=6):
  completion = np.zeros((rows, width), bool)
  completion[:, 3:] = True
  return Rollout(tokens=jnp.zeros((rows, width), jnp.int32),
                 prompt_mask=jnp.asarray(~completion), completion_mask=jnp.asarray(completion),
                 behavior_logp=jnp.zeros((rows, width)),
                 version=jnp.asarray(np.where(completion, version, -1).astype(np.int32)),
                 group=jnp.zeros((rows,), jnp.int32), reward=jnp.zeros((rows,)),
                 advantages=jnp.zeros((rows, width)))


def _fake_produced(version, state, decoded_tokens=0):
  """produce's return: a batch whose tokens carry `version`, its stats, the next cursor."""
  stats = statistics.BatchStats(
      reward_mean=0.0, exact_match=0.0, informative_groups=0.0, completion_len=0.0,
      decoded_tokens=decoded_tokens, completion_length_counts=np.zeros(1, np.int64),
      reward_timeouts=0, reward_errors=0)
  return _fake_batch(version), stats, state.replace(
      cursor=producers.cursor_array(int(state.cursor) + 1))


def _fake_producer(produce):
  """A Producer over a data cursor alone, making batches with `produce`."""
  return producers.Producer(
      init=lambda start: producers.CursorState(cursor=producers.cursor_array(start)),
      produce=produce)


def _recording_producer(sampled):
  """A fake producer that records (trains_at, version) of each batch in `sampled` and
  checks that the published parameters are the version they claim (w counts train steps)."""
  def produce(state, params, version, rng, trains_at):
    assert float(params["w"]) == version
    sampled.append((trains_at, version))
    return _fake_produced(version, state)
  return _fake_producer(produce)


def _fake_context(train_seconds, updates=1, skipped_on=()):
  """A trainer that takes `updates` optimiser updates per batch (TrainState.step counts the
  applied ones, so w always equals the step); on the batches that train at the steps in
  `skipped_on`, the last update is non-finite and skipped."""
  def train_step(state, batch):
    del batch
    time.sleep(train_seconds)
    skipped = int(int(state.step) in skipped_on)
    applied = updates - skipped
    return state.replace(step=state.step + applied, params={"w": state.params["w"] + applied},
                         nonfinite_updates=state.nonfinite_updates + skipped), {}
  return loop.LoopContext(
      batch=producers.BatchContext(task=None, tokenizer=None, model_config=None,
                                   sampling_config=None, prompt_len=3, prompts_per_step=1,
                                   group_size=4),
      train_step=train_step, stages=advantages.advantage_stage(lambda batch: batch.advantages))


def _fake_state():
  train_state = train.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.zeros(())},
                                 opt_state=(), nonfinite_updates=jnp.zeros((), jnp.int32))
  return loop.LoopState(train=train_state, rng=jax.random.PRNGKey(0),
                        producer=producers.CursorState(cursor=producers.cursor_array(0)))


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_producer_waits_so_max_staleness_is_never_exceeded(max_staleness):
  sampled = []
  state, history = async_loop.run_async(_fake_state(), _fake_context(0.05),
                                        _recording_producer(sampled), 8,
                                        max_staleness=max_staleness)
  assert [h["staleness"] for h in history] == [s - v for s, v in sampled]
  assert max(h["staleness"] for h in history) == max_staleness  # ran ahead up to the bound
  assert all(s - v <= max_staleness for s, v in sampled)
  assert int(state.train.step) == 8 and int(state.producer.cursor) == 8
  assert state.iteration == 8


@pytest.mark.parametrize("max_staleness,known", [(2, False), (3, True), (4, False), (4, True)])
def test_versions_and_staleness_count_optimiser_updates(max_staleness, known):
  # Two updates per batch: the tokens carry TrainState.step of the sampling parameters (w),
  # staleness counts updates, and the producer runs ahead max_staleness // 2 batches, with
  # the update count given or learnt from the first batch (then batch 1 waits for it).
  sampled = []
  state, history = async_loop.run_async(_fake_state(), _fake_context(0.05, updates=2),
                                        _recording_producer(sampled), 8,
                                        max_staleness=max_staleness,
                                        updates_per_batch=2 if known else None)
  lag = max_staleness // 2
  assert [s for s, _ in sampled] == [2 * i for i in range(8)]  # the step each batch trains at
  assert [h["staleness"] for h in history] == [s - v for s, v in sampled]
  assert all(v % 2 == 0 and s - v <= 2 * lag for s, v in sampled)
  assert max(h["staleness"] for h in history) == 2 * lag  # ran ahead as far as allowed
  assert int(state.train.step) == 16 and state.iteration == 8


def test_skipped_updates_shift_versions_not_the_bound():
  # The batch trained at step 2 has one non-finite update (skipped): later parameters are
  # one step behind 2 per batch. Versions stay the parameters' real TrainState.step, and
  # the bound (2 updates, one batch ahead) still holds against the real step.
  sampled = []
  state, history = async_loop.run_async(_fake_state(), _fake_context(0.05, 2, skipped_on=(2,)),
                                        _recording_producer(sampled), 5, max_staleness=2)
  versions = [v for _, v in sampled]
  steps = [0, 2, 3, 5, 7]  # the step each batch is trained at
  assert [h["staleness"] for h in history] == [s - v for s, v in zip(steps, versions)]
  assert set(versions) <= {0, 2, 3, 5, 7} and max(h["staleness"] for h in history) <= 2
  assert int(state.train.step) == 9 and int(state.train.nonfinite_updates) == 1


def test_async_steps_report_the_producers_phase_times_and_token_rates():
  # With max_staleness = 0 the trainer waits while each batch is produced, so the step's
  # wall time holds the producer's sample and score times and the train time.
  def produce(state, params, version, rng, trains_at):
    time.sleep(0.02)
    with timing.phase("score"):
      time.sleep(0.01)
    return _fake_produced(version, state, decoded_tokens=12)

  _, history = async_loop.run_async(_fake_state(), _fake_context(0.05), _fake_producer(produce), 3,
                                    max_staleness=0)
  for m in history:
    assert m["time_score_s"] >= 0.01 and m["time_sample_s"] >= 0.02
    assert m["time_train_s"] >= 0.05
    assert m["time_sample_s"] + m["time_score_s"] + m["time_train_s"] <= m["time_step_s"]
    assert m["sampled_tokens"] == 12 == m["trained_tokens"]  # 4 rows x 3 completion slots
    assert m["sampled_tokens_per_s"] == pytest.approx(12 / m["time_sample_s"])
    assert m["trained_tokens_per_s"] == pytest.approx(12 / m["time_train_s"])


def test_wrong_update_counts_stale_batches_and_producer_errors_stop_the_trainer():
  def produce(state, params, version, rng, trains_at):
    return _fake_produced(version, state)

  with pytest.raises(ValueError, match="updates_per_batch=1.*took 2"):
    async_loop.run_async(_fake_state(), _fake_context(0.0, updates=2), _fake_producer(produce), 3,
                         max_staleness=2, updates_per_batch=1)

  def stale(state, params, version, rng, trains_at):
    return _fake_produced(0, state)  # always labels its tokens version 0

  with pytest.raises(RuntimeError, match="max_staleness=1"):
    async_loop.run_async(_fake_state(), _fake_context(0.0), _fake_producer(stale), 4,
                         max_staleness=1)

  def broken(state, params, version, rng, trains_at):
    raise ValueError("broken producer")

  with pytest.raises(ValueError, match="broken producer"):
    async_loop.run_async(_fake_state(), _fake_context(0.0), _fake_producer(broken), 3,
                         max_staleness=1)


def test_published_parameters_never_alias_the_trainers_buffers():
  params = {"w": jnp.arange(3.0)}
  published = async_loop._detached(params, params)  # pylint: disable=protected-access
  assert published["w"] is not params["w"]
  np.testing.assert_array_equal(published["w"], params["w"])
  resharded = {"w": params["w"] * 2}
  kept = async_loop._detached(resharded, params)  # pylint: disable=protected-access
  assert kept["w"] is resharded["w"]


# Real tiny GRPO runs.

@dataclasses.dataclass(frozen=True)
class _LengthTask:
  """Reward = fraction of the 6 completion characters that are the digit '7' (learnable
  from a random policy, unlike arithmetic): gives non-zero advantages from step 0."""
  name: str = "sevens"

  def examples(self, split, n, start=0):
    del split
    return [Example(prompt=f"{(start + i) % 97}=", answer="7", entry={}) for i in range(n)]

  def reward(self, completion, example):
    del example
    return completion.count("7") / 6.0

  def exact_match(self, completion, example):
    return completion == example.answer


def _context(task, prompts=4, group=4, lr=1e-2, prompt_len=6):
  # The launcher's "tiny" preset, not tests/tiny.py's model: the untrained policy's reward
  # must leave room to improve (0.05-0.95), which this one's does.
  model_config = get_preset("tiny", vocab_size=TOKENIZER.vocab_size, max_seq_len=32)
  optimizer = train.make_optimizer(lr)
  sampling_config = SamplingConfig(max_new_tokens=6, temperature=1.0,
                                   stop_tokens=(TOKENIZER.eos_id,), pad_id=TOKENIZER.pad_id)
  ctx = loop.LoopContext(
      batch=producers.BatchContext(task=task, tokenizer=TOKENIZER, model_config=model_config,
                                   sampling_config=sampling_config, prompt_len=prompt_len,
                                   prompts_per_step=prompts, group_size=group),
      train_step=train.make_train_step(model_config, optimizer, GRPO),
      stages=advantages.advantage_stage(advantages.group_relative(advantages.grpo_advantages)))
  params = transformer.init_params(model_config, jax.random.PRNGKey(0))
  state = loop.LoopState(train=train.init_train_state(params, optimizer),
                         rng=jax.random.PRNGKey(1),
                         producer=producers.CursorState(cursor=producers.cursor_array(0)))
  return ctx, state


def _copy(state):
  return jax.tree.map(jnp.copy, state)  # the train step donates its input


@pytest.mark.parametrize("kind", ["independent", "partial"])
@pytest.mark.slow
def test_async_with_zero_staleness_reproduces_the_sync_loop_exactly(kind):
  ctx, start = _context(_LengthTask())

  if kind == "independent":
    producer = producers.independent(ctx.batch)
  else:
    producer = partial_rollout.producer(ctx.batch, partial_rollout.for_task(
        ctx.batch, PartialConfig(num_slots=32, group_size=4, resume="reprefill"), max_staleness=0))
  start = start.replace(producer=producer.init(0))
  sync_state, sync_metrics = _copy(start), []
  for _ in range(3):
    sync_state, metrics = loop.grpo_iteration(sync_state, ctx, producer)
    sync_metrics.append(metrics)
  async_state, async_metrics = async_loop.run_async(_copy(start), ctx, producer, 3,
                                                    max_staleness=0)
  jax.tree.map(np.testing.assert_array_equal, sync_state.train, async_state.train)
  np.testing.assert_array_equal(jax.random.key_data(sync_state.rng)
                                if jnp.issubdtype(sync_state.rng.dtype, jax.dtypes.prng_key)
                                else sync_state.rng, async_state.rng)
  jax.tree.map(np.testing.assert_array_equal, sync_state.producer, async_state.producer)
  for a, b in zip(sync_metrics, async_metrics):
    assert a["reward_mean"] == b["reward_mean"] and a["loss"] == b["loss"]
  # The parameters did change, so the equality above is not vacuous.
  assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0 for a, b in
             zip(jax.tree.leaves(start.train.params), jax.tree.leaves(sync_state.train.params)))


@pytest.mark.slow
def test_async_minibatch_tokens_carry_the_step_of_their_sampling_parameters():
  # num_minibatches = 2: each batch is 2 optimiser updates. Every published copy of the
  # parameters is kept with the TrainState.step it was published at, and every batch's
  # tokens must carry the step of the copy the producer sampled it with.
  ctx, state = _context(_LengthTask())
  ctx = dataclasses.replace(ctx, train_step=train.make_train_step(
      ctx.batch.model_config, train.make_optimizer(1e-2), GRPO, num_minibatches=2))
  published, steps, used, batches = [], [int(state.train.step)], [], []

  def publish(params):
    copy = jax.tree.map(jnp.copy, params)
    published.append(jax.tree.leaves(copy)[0])
    return copy

  inner = producers.independent(ctx.batch)

  def produce(producer_state, params, version, rng, trains_at):
    leaf = jax.tree.leaves(params)[0]
    used.append(next(k for k, p in enumerate(published) if p is leaf))
    rollout, stats, producer_state = inner.produce(producer_state, params, version, rng,
                                                   trains_at)
    batches.append(rollout)
    return rollout, stats, producer_state

  state, history = async_loop.run_async(
      state.replace(producer=inner.init(0)), ctx, inner._replace(produce=produce), 4,
      max_staleness=2, publish=publish,
      on_step=lambda s, _: steps.append(int(s.train.step)))
  assert steps == [0, 2, 4, 6, 8]  # two updates per batch, none skipped
  for k, batch, metrics, trained_at in zip(used, batches, history, steps):
    versions = np.asarray(batch.version)[np.asarray(batch.completion_mask)]
    assert versions.size and (versions == steps[k]).all(), (k, np.unique(versions))
    assert metrics["sampled_version"] == steps[k]
    assert metrics["staleness"] == trained_at - steps[k] <= 2


class _FixedPrompts:
  """The chain_sum task (chain_sum_compact's difficulty) restricted to its first `n` train
  prompts, cycled, so a few RL steps measurably raise the expected reward on them."""

  def __init__(self, n):
    self.base = make_task("chain_sum", "compact", seed=0, eval_size=16, min_terms=2,
                          max_terms=3, min_digits=1, max_digits=2)
    self.name, self.n = self.base.name, n

  def examples(self, split, n, start=0):
    del split
    return [self.base.examples("train", 1, (start + i) % self.n)[0] for i in range(n)]

  def reward(self, completion, example):
    return self.base.reward(completion, example)

  def exact_match(self, completion, example):
    return self.base.exact_match(completion, example)


@pytest.mark.slow
def test_async_training_with_stale_batches_improves_the_default_tasks_reward():
  # Warm start briefly (supervised), then 12 async GRPO steps with max_staleness=2: the
  # objective is PPO-clip against the behaviour log-probs, i.e. clipped importance ratios
  # correct for the stale sampler. Expected reward: 8 prompts x 32 samples, fixed key.
  task = _FixedPrompts(8)
  sft_ctx, state = _context(task, prompts=8, group=1, lr=1e-3, prompt_len=12)
  sft_ctx = dataclasses.replace(sft_ctx, train_step=train.make_train_step(
      sft_ctx.batch.model_config, train.make_optimizer(1e-3),
      losses.LossSettings(name="sft", aggregation="token_mean", norm_len=1.0)))
  for _ in range(25):
    state, _ = loop.sft_iteration(state, sft_ctx)
  ctx, _ = _context(task, prompts=8, group=8, lr=3e-4, prompt_len=12)
  producer = producers.independent(ctx.batch)
  state = loop.LoopState(train=train.init_train_state(state.train.params,
                                                      train.make_optimizer(3e-4)),
                         rng=state.rng, producer=producer.init(int(state.producer.cursor)))

  def expected_reward(params):
    samples = rollout_lib.sample_and_score(
        params, task.examples("train", 8), task=task, tokenizer=TOKENIZER,
        rng=jax.random.PRNGKey(42), group_size=32, prompt_len=ctx.batch.prompt_len,
        model_config=ctx.batch.model_config, sampling_config=ctx.batch.sampling_config)
    return float(np.asarray(samples.rollout.reward).mean())

  before = expected_reward(state.train.params)
  state, history = async_loop.run_async(state, ctx, producer, 12,
                                        max_staleness=2)
  after = expected_reward(state.train.params)
  assert max(h["staleness"] for h in history) <= 2
  # Some batch was stale, by construction rather than thread timing: the producer reads the
  # newest parameters for batch i + 1 right after queueing batch i (max_staleness=2 lets it
  # run 2 batches ahead once it has learnt from batch 0 that a batch is one update),
  # microseconds later, while the trainer publishes new ones only after training batch i.
  # So from batch 2 on each batch is sampled at least one update before it is trained.
  assert max(h["staleness"] for h in history) >= 1, [h["staleness"] for h in history]
  assert 0.05 < before < 0.95, before  # room to improve either way
  assert after > before + 0.04, (before, after)
