"""The jitted train step: accumulation, non-finite skipping, lr_scale, and a learning run."""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import transformer
from models.tokenizer import CharTokenizer
from rl.objectives import advantages
from rl import loop
from rl.objectives import losses
from rl.rollouts import producers
from rl import scoring as rl_scoring
from rl import train
from rl.objectives import composite
from sampling.sampler import SamplingConfig
from tests.rl_fixtures import GRPO, DigitTask, random_rollout
from tests import tiny

CONFIG = tiny.model(max_seq_len=16)


def _fresh_state(params, optimizer):
  return train.init_train_state(jax.tree.map(jnp.copy, params), optimizer)


def _rows(batch, start, stop):
  return jax.tree.map(lambda x: x[start:stop], batch)


def _assert_same_params(a, b, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=atol), a.params, b.params)


def _digit_context(train_step, prompts_per_step, group_size):
  """A LoopContext on DigitTask: 2-character prompts, 4 new tokens at temperature 1, GRPO's
  advantages."""
  tokenizer = CharTokenizer()
  sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, stop_tokens=(tokenizer.eos_id,))
  return loop.LoopContext(
      batch=producers.BatchContext(
          task=DigitTask(), tokenizer=tokenizer, model_config=CONFIG, sampling_config=sampling,
          prompt_len=2, prompts_per_step=prompts_per_step, group_size=group_size),
      train_step=train_step,
      stages=advantages.advantage_stage(advantages.group_relative(advantages.grpo_advantages)))


@pytest.mark.parametrize("name", ["dapo", "grpo"])  # token_mean, seq_mean_token_mean
@pytest.mark.slow
def test_microbatched_gradient_is_the_full_batch_gradient_for_uneven_microbatches(name):
  # The case: microbatches of 20 and 4 completion tokens. token_mean was the mean of
  # the two microbatch means (per-token weights 0.6x and 3x the global mean's); now each
  # microbatch is weighted by its share of the tokens. Row 3 has no tokens, so
  # seq_mean_token_mean's microbatches also hold unequal numbers of sequences. Plain SGD,
  # so the parameter change is the gradient itself.
  length = 16
  batch = random_rollout(seed=3, length=length)
  lengths = np.array([10, 10, 4, 0])
  completion = jnp.asarray(np.arange(length)[None] >= length - lengths[:, None])
  advantage = jnp.asarray([[1.0], [-0.5], [2.0], [1.0]])
  batch = batch.replace(completion_mask=completion, prompt_mask=~completion,
                        advantages=advantage * completion,
                        behavior_logp=jnp.where(completion, -3.0, 0.0))
  config = dataclasses.replace(GRPO, name=name)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  optimizer = optax.sgd(1.0)
  deltas, loss = [], []
  for micro in (1, 2):
    step = train.make_train_step(CONFIG, optimizer, config, num_microbatches=micro)
    state, metrics = step(_fresh_state(params, optimizer), batch)
    deltas.append(jax.tree.map(lambda new, old: new - old, state.params, params))
    loss.append(float(metrics["loss"]))
    assert int(state.step) == 1
    assert "learning_rate" not in metrics  # logged only when the step is given the schedule
  np.testing.assert_allclose(loss[1], loss[0], rtol=1e-5)
  assert max(float(jnp.abs(d).max()) for d in jax.tree.leaves(deltas[0])) > 1e-3
  jax.tree.map(lambda full, micro: np.testing.assert_allclose(micro, full, rtol=1e-4, atol=1e-7),
               *deltas)


@pytest.mark.slow
def test_minibatches_and_epochs_equal_single_updates_in_order():
  """num_minibatches=2, ppo_epochs=2 is four one-update steps: halves 1, 2, 1, 2."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  optimizer = train.make_optimizer(1e-2)
  batch = random_rollout(batch=8)
  step = train.make_train_step(CONFIG, optimizer, GRPO, num_minibatches=2, ppo_epochs=2)
  state, metrics = step(_fresh_state(params, optimizer), batch)
  single = train.make_train_step(CONFIG, optimizer, GRPO)
  reference, losses_seen = _fresh_state(params, optimizer), []
  for start in (0, 4, 0, 4):
    reference, m = single(reference, _rows(batch, start, start + 4))
    losses_seen.append(float(m["loss"]))
  _assert_same_params(state, reference)
  assert int(state.step) == 4 == int(reference.step)
  np.testing.assert_allclose(metrics["loss"], np.mean(losses_seen), rtol=1e-5)
  assert metrics["update_skipped"] == 0.0


@pytest.mark.slow
def test_recomputed_prox_is_the_policy_before_the_batch_first_update():
  """Decoupled PPO over two minibatches clips both against pi_prox = the parameters the
  batch started from, not the parameters after the first minibatch."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(1))
  optimizer = train.make_optimizer(5e-2)
  batch = random_rollout(seed=3, batch=8)
  decoupled = dataclasses.replace(GRPO, name="decoupled", prox_estimate="recompute")
  step = train.make_train_step(CONFIG, optimizer, decoupled, num_minibatches=2)
  state, _ = step(_fresh_state(params, optimizer), batch)
  prox = transformer.sequence_logprobs(params, batch.tokens,
                                       batch.prompt_mask | batch.completion_mask, CONFIG)
  with_prox = batch.replace(prox_logp=prox)
  single = train.make_train_step(CONFIG, optimizer, decoupled)
  reference = _fresh_state(params, optimizer)
  for start in (0, 4):
    reference, _ = single(reference, _rows(with_prox, start, start + 4))
  _assert_same_params(state, reference, atol=1e-4)  # Adam at lr 5e-2 amplifies reassociation
  # Recomputing prox per update (the other reading) gives a different result.
  per_update = _fresh_state(params, optimizer)
  for start in (0, 4):
    per_update, _ = single(per_update, _rows(batch, start, start + 4))
  assert max(float(jnp.abs(x - y).max()) for x, y in zip(
      jax.tree.leaves(per_update.params), jax.tree.leaves(reference.params))) > 1e-3


@pytest.mark.slow
def test_loglinear_prox_over_minibatches_keeps_fresh_tokens_at_behav():
  """On a fresh batch (version = step) the log-linear proximal policy is behav at every
  update of the batch, so the step equals one-update steps with prox_logp = behav."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(2))
  optimizer = train.make_optimizer(5e-2)
  batch = random_rollout(seed=4, batch=8)
  batch = batch.replace(behavior_logp=transformer.sequence_logprobs(
      params, batch.tokens, batch.prompt_mask | batch.completion_mask, CONFIG) * batch.completion_mask)
  decoupled = dataclasses.replace(GRPO, name="decoupled", prox_estimate="loglinear")
  step = train.make_train_step(CONFIG, optimizer, decoupled, num_minibatches=2)
  state, _ = step(_fresh_state(params, optimizer), batch)
  single = train.make_train_step(CONFIG, optimizer, decoupled)
  reference = _fresh_state(params, optimizer)
  for start in (0, 4):
    reference, _ = single(reference, _rows(batch.replace(prox_logp=batch.behavior_logp),
                                           start, start + 4))
  _assert_same_params(state, reference, atol=1e-4)  # Adam at lr 5e-2 amplifies reassociation


@pytest.mark.slow
def test_decoupled_equals_grpo_on_policy_over_minibatches():
  """On-policy (behav = the starting policy) decoupled PPO's proximal policy is behav, so
  over several updates per batch it is still PPO."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(5))
  optimizer = train.make_optimizer(5e-2)
  batch = random_rollout(seed=6, batch=8)
  batch = batch.replace(behavior_logp=transformer.sequence_logprobs(
      params, batch.tokens, batch.prompt_mask | batch.completion_mask, CONFIG) * batch.completion_mask)
  states = []
  for name in ("grpo", "decoupled"):
    step = train.make_train_step(CONFIG, optimizer, dataclasses.replace(GRPO, name=name),
                                 num_minibatches=2)
    states.append(step(_fresh_state(params, optimizer), batch)[0])
  # Adam moves every weight by ~lr = 5e-2 per update; recomputed prox equals behav only
  # to float reassociation, which Adam's normalisation can amplify on tiny gradients.
  moved = max(float(jnp.abs(x - y).max()) for x, y in zip(
      jax.tree.leaves(states[0].params), jax.tree.leaves(params)))
  assert moved > 1e-2
  _assert_same_params(*states, atol=2e-4)


def test_batches_the_step_cannot_take_are_refused():
  optimizer = train.make_optimizer(1e-2)
  step = train.make_train_step(CONFIG, optimizer, GRPO, num_minibatches=3)
  state = _fresh_state(transformer.init_params(CONFIG, jax.random.PRNGKey(0)), optimizer)
  with pytest.raises(ValueError, match="num_minibatches x config.rl.num_microbatches"):
    step(state, random_rollout(batch=8))
  with pytest.raises(ValueError, match="ppo_epochs"):
    train.make_train_step(CONFIG, optimizer, GRPO, ppo_epochs=0)
  # Producers leave advantages to the loop's stage; a batch that skipped it is an error,
  # not a silent zero-advantage update.
  with pytest.raises(ValueError, match="no advantages.*advantage_stage"):
    train.make_train_step(CONFIG, optimizer, GRPO)(state, random_rollout().replace(
        advantages=None))


def test_non_finite_loss_skips_the_update_and_is_counted():
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  optimizer = train.make_optimizer(1e-2)
  step = train.make_train_step(CONFIG, optimizer, GRPO,
                               learning_rate=train.learning_rate_schedule(1e-2))
  state = _fresh_state(params, optimizer)
  batch = random_rollout()
  bad = batch.replace(advantages=batch.advantages.at[0, 4].set(jnp.nan))
  new_state, metrics = step(state, bad)
  assert int(new_state.step) == 0 and int(new_state.nonfinite_updates) == 1
  assert metrics["update_skipped"] == 1.0
  assert metrics["learning_rate"] == 0.0  # nothing was applied
  jax.tree.map(np.testing.assert_array_equal, new_state.params, params)


@pytest.mark.slow
def test_lr_scale_from_the_objective_scales_the_update():
  @losses.register_loss("test_half_lr")
  def half_lr(logp, batch, *, prox_logp=None, settings):
    loss, metrics = losses.ppo_clip_loss(logp, batch, prox_logp=prox_logp, settings=settings)
    return loss, dict(metrics, lr_scale=jnp.asarray(0.5))
  try:
    params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
    optimizer = train.make_optimizer(1e-2, max_grad_norm=0.0)
    batch = random_rollout()
    deltas = []
    for name in ("grpo", "test_half_lr"):
      step = train.make_train_step(CONFIG, optimizer, dataclasses.replace(GRPO, name=name))
      state, _ = step(_fresh_state(params, optimizer), batch)
      deltas.append(state.params["embed"] - params["embed"])
    np.testing.assert_allclose(deltas[1], 0.5 * deltas[0], atol=1e-7)
  finally:
    losses.LOSSES.unregister("test_half_lr")


@pytest.mark.slow
def test_short_grpo_run_improves_reward():
  optimizer = train.make_optimizer(3e-3)
  ctx = _digit_context(train.make_train_step(CONFIG, optimizer, GRPO), 8, 8)
  producer = producers.independent(ctx.batch)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(1))
  state = loop.LoopState(train=train.init_train_state(params, optimizer), rng=jax.random.PRNGKey(2),
                         producer=producer.init(0))
  rewards = []
  for _ in range(25):
    state, metrics = loop.grpo_iteration(state, ctx, producer)
    rewards.append(metrics["reward_mean"])
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  assert last > first + 0.25, rewards
  assert int(state.producer.cursor) == 25 * 8 and int(state.train.step) == 25


@pytest.mark.parametrize("loss_name, aggregation", [("grpo", "seq_mean_token_mean"),
                                                    ("grpo", "token_mean"), ("m2po", "token_mean")])
@pytest.mark.slow
def test_length_buckets_cut_batches_without_changing_the_step(loss_name, aggregation):
  """A batch whose rows end early runs at the smallest bucket that holds them, with the
  same loss, metrics and updated parameters as the full-length step."""
  length, used = 16, 9
  batch = random_rollout(seed=3, batch=4, length=length)
  mask = jnp.asarray(np.arange(length)[None] < used)
  batch = batch.replace(completion_mask=batch.completion_mask & mask,
                        advantages=batch.advantages * mask,
                        behavior_logp=batch.behavior_logp * mask - 0.1 * mask)
  assert train.trim_to_bucket(batch, (6, 12)).tokens.shape == (4, 12)
  assert train.trim_to_bucket(batch, (6, 8)).tokens.shape == (4, length)  # none fits: full
  assert train.trim_to_bucket(batch, ()).tokens.shape == (4, length)
  config = dataclasses.replace(GRPO, name=loss_name, aggregation=aggregation, m2_tau=0.04)
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(1))
  optimizer = train.make_optimizer(1e-2)
  results = []
  for buckets in ((), (12,)):
    step = train.make_train_step(CONFIG, optimizer, config, length_buckets=buckets)
    results.append(step(_fresh_state(params, optimizer), batch))
  (full, full_metrics), (cut, cut_metrics) = results
  for key in full_metrics:
    np.testing.assert_allclose(cut_metrics[key], full_metrics[key], rtol=1e-5, atol=1e-6,
                               err_msg=key)
  _assert_same_params(cut, full, atol=1e-5)  # float reassociation, amplified by Adam
  assert float(full_metrics["grad_norm"]) > 0


def test_length_grouped_examples_deal_each_window_sorted_by_length():
  from rl.tasks import make_task  # pylint: disable=import-outside-toplevel
  task = make_task("running_sum", eval_size=10)
  batches = [loop.length_grouped_examples(task, cursor, 4, 3) for cursor in range(0, 24, 4)]
  for window in (batches[:3], batches[3:]):
    lengths = [len(e.answer) for batch in window for e in batch]
    assert lengths == sorted(lengths)
  assert {e.prompt for batch in batches[:3] for e in batch} == {
      e.prompt for e in task.examples("train", 12)}
  assert {e.prompt for batch in batches[3:] for e in batch} == {
      e.prompt for e in task.examples("train", 12, 12)}
  assert loop.length_grouped_examples(task, 8, 4, 3) == batches[2]  # a pure function


@pytest.mark.slow
def test_learning_rate_metric_is_the_schedule_at_each_update():
  # Warmup over 3 updates, then linear decay over 4; two updates (minibatches) per step,
  # so each step's metric is the mean of the schedule at its two update counts.
  rate = dict(learning_rate=1e-2, warmup_steps=3, decay_steps=4, end_lr_fraction=0.25)
  schedule = train.learning_rate_schedule(**rate)
  optimizer = train.make_optimizer(**rate)
  step = train.make_train_step(CONFIG, optimizer, GRPO, num_minibatches=2,
                               learning_rate=schedule)
  state = train.init_train_state(transformer.init_params(CONFIG, jax.random.PRNGKey(0)),
                                 optimizer)
  expected = [1e-2 * np.mean([min(c / 3, 1.0) if c < 3 else 1 - 0.75 * min((c - 3) / 4, 1)
                              for c in (2 * i, 2 * i + 1)]) for i in range(5)]
  applied = []
  for i in range(5):
    state, metrics = step(state, random_rollout(seed=i))
    applied.append(float(metrics["learning_rate"]))
  np.testing.assert_allclose(applied, expected, rtol=1e-5)
  np.testing.assert_allclose(applied, [(schedule(2 * i) + schedule(2 * i + 1)) / 2
                                       for i in range(5)], rtol=1e-6)


@pytest.mark.slow
def test_grpo_iteration_splits_its_time_and_counts_real_tokens(monkeypatch):
  # Scoring is made to take at least 50 ms, so its phase is measured where it runs.
  real_score = rl_scoring.score

  def slow_score(*args, **kwargs):
    time.sleep(0.05)
    return real_score(*args, **kwargs)

  monkeypatch.setattr(rl_scoring, "score", slow_score)
  schedule = train.learning_rate_schedule(3e-3, warmup_steps=4)
  optimizer = train.make_optimizer(3e-3, warmup_steps=4)
  ctx = _digit_context(train.make_train_step(CONFIG, optimizer, GRPO, learning_rate=schedule),
                       4, 4)
  producer = producers.independent(ctx.batch)
  state = loop.LoopState(train=train.init_train_state(
      transformer.init_params(CONFIG, jax.random.PRNGKey(1)), optimizer), rng=jax.random.PRNGKey(2),
      producer=producer.init(0))
  for i in range(2):
    state, m = loop.grpo_iteration(state, ctx, producer)
    assert m["learning_rate"] == pytest.approx(float(schedule(i)))
    assert m["time_score_s"] >= 0.05 and m["time_sample_s"] > 0 and m["time_train_s"] > 0
    assert m["time_sample_s"] + m["time_score_s"] == pytest.approx(m["time_rollout_s"])
    assert m["time_rollout_s"] + m["time_train_s"] <= m["time_step_s"]
    # Independent samples: every generated token is a completion token of the train batch.
    assert 0 < m["sampled_tokens"] == m["decoded_tokens"] == m["trained_tokens"] <= 4 * 4 * 4
    assert m["sampled_tokens_per_s"] == pytest.approx(m["sampled_tokens"] / m["time_sample_s"])
    assert m["trained_tokens_per_s"] == pytest.approx(m["trained_tokens"] / m["time_train_s"])


@pytest.mark.slow
def test_sft_iteration_counts_the_answer_tokens_it_trains_on():
  optimizer = train.make_optimizer(1e-3)
  ctx = _digit_context(train.make_train_step(CONFIG, optimizer, losses.LossSettings(
      name="sft", aggregation="token_mean", norm_len=1.0)), 8, 1)
  state = loop.LoopState(train=train.init_train_state(
      transformer.init_params(CONFIG, jax.random.PRNGKey(1)), optimizer), rng=jax.random.PRNGKey(2),
      producer=producers.CursorState(cursor=producers.cursor_array(0)))
  new_state, m = loop.sft_iteration(state, ctx)
  assert int(new_state.producer.cursor) == 8
  assert m["trained_tokens"] == 8 * 2  # answer "1" and EOS per example
  assert 0 < m["time_train_s"] <= m["time_step_s"]
  assert m["trained_tokens_per_s"] == pytest.approx(16 / m["time_train_s"])


@pytest.mark.slow
def test_chunked_logprobs_equal_the_dense_path_at_a_large_vocabulary():
  """V = 49152 (SmolLM2's), 9 predicted positions in chunks of 4 (the last one padded): the
  values and both gradients equal the dense log_softmax path's."""
  rng = np.random.default_rng(0)
  b, t, d, v = 2, 10, 16, 49152
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(d, v)) * 0.3, jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

  def dense(x, head):
    logits = jnp.einsum("btd,dv->btv", x, head) / 0.8
    return transformer.token_logprobs(logits, tokens)

  chunked = lambda x, head: transformer.chunked_token_logprobs(x, head, tokens, 4, 0.8)
  np.testing.assert_allclose(chunked(x, head), dense(x, head), rtol=1e-5, atol=1e-5)
  grads = [jax.grad(lambda x, h, f=f: (f(x, h) * weights).sum(), (0, 1))(x, head)
           for f in (dense, chunked)]
  for a, c in zip(*grads):
    np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("remat", ["full", "dots"])
@pytest.mark.slow
def test_remat_gives_the_same_loss_gradients(remat):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  batch = random_rollout(seed=2, batch=4, length=12)

  def loss(params, config):
    return (composite.policy_logprobs(params, batch, config) * batch.advantages).sum()

  base = jax.grad(loss)(params, CONFIG)
  rematerialised = jax.grad(loss)(params, CONFIG.replace(remat=remat))
  jax.tree.map(lambda a, r: np.testing.assert_allclose(r, a, rtol=1e-5, atol=1e-7), base,
               rematerialised)


@pytest.mark.slow
def test_memory_switches_train_the_same_run_through_the_launcher(tmp_path):
  """--config.rl.logprob_chunk and --config.model.remat change what the step keeps, not
  what it computes: the same run's losses agree to float rounding, and the switches reach
  the compiled step (its log-probs path and the model config)."""
  from experiments import train as launcher  # pylint: disable=import-outside-toplevel
  from tests.launcher_config import records  # pylint: disable=import-outside-toplevel
  from tests.launcher_config import tiny_run_config  # pylint: disable=import-outside-toplevel
  losses_of = {}
  for name, overrides in (("plain", {}), ("chunked", {"rl.logprob_chunk": 3,
                                                      "model.remat": "dots"})):
    launcher.run(tiny_run_config(tmp_path / name, overrides))
    losses_of[name] = [r["loss"] for r in records(tmp_path / name) if "loss" in r]
    assert json.load(open(tmp_path / name / "config.json"))["model"]["remat"] == (
        overrides.get("model.remat", "none"))
  np.testing.assert_allclose(losses_of["chunked"], losses_of["plain"], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_bfloat16_policy_trains():
  """Weights, activations and moments in bfloat16: the step compiles (its gradient
  accumulator keeps the parameters' dtype) and moves the parameters."""
  config = CONFIG.replace(dtype="bfloat16")
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                        transformer.init_params(CONFIG, jax.random.PRNGKey(0)))
  optimizer = train.make_optimizer(1e-2)
  step = train.make_train_step(config, optimizer, GRPO)
  batch = random_rollout(seed=1, batch=4, length=12)
  batch = batch.replace(advantages=jnp.abs(batch.advantages))  # A > 0: ratios < 1 not clipped
  state, metrics = step(_fresh_state(params, optimizer), batch)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  assert state.params["embed"].dtype == jnp.bfloat16
  assert not np.array_equal(np.asarray(state.params["embed"], np.float32),
                            np.asarray(params["embed"], np.float32))
