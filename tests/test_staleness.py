"""Tests for simulated staleness (rl.loop ring buffer) and cross-stage importance sampling."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train as launcher
from models import transformer
from models.tokenizer import CharTokenizer
from rl.objectives import advantages
from rl.objectives import corrections
from rl import loop
from rl.objectives import losses
from rl import train
from rl.rollouts import producers
from rl.tasks import make_task
from rl.types import Rollout
from sampling import sampler
from tests.launcher_config import tiny_run_config
from tests import tiny

TINY = tiny.model(vocab_size=CharTokenizer().vocab_size)


def test_ring_buffer_serves_parameters_k_iterations_old():
  k = 3
  params = {"w": jnp.zeros((2,)), "b": jnp.zeros(())}
  history = loop.init_history(params, k)
  for t in range(10):
    current = jax.tree.map(lambda p: p + t, params)
    sampled, version, history = loop.stale_params(history, t, current, t)
    source = max(t - k, 0)
    assert int(version) == source
    np.testing.assert_array_equal(sampled["w"], np.full(2, float(source)))
    np.testing.assert_array_equal(sampled["b"], float(source))


def test_init_history_rejects_zero():
  with pytest.raises(ValueError, match="staleness"):
    loop.init_history({"w": jnp.zeros(())}, 0)


def _context(staleness, loss_name="grpo", prox_estimate="recompute"):
  tokenizer = CharTokenizer()
  task = make_task("chain_sum", "compact", seed=0, eval_size=4, min_terms=2, max_terms=2,
                   min_digits=1, max_digits=1)
  loss_config = losses.LossSettings(
      name=loss_name, eps_low=0.2, eps_high=0.2, aggregation="token_mean", norm_len=4.0,
      kl_coef=0.0, prox_estimate=prox_estimate)
  optimizer = train.make_optimizer(1e-2)
  step = train.make_train_step(TINY, optimizer, loss_config)
  ctx = loop.LoopContext(
      batch=producers.BatchContext(
          task=task, tokenizer=tokenizer, model_config=TINY,
          sampling_config=sampler.SamplingConfig(
              max_new_tokens=4, stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id),
          prompt_len=8, prompts_per_step=2, group_size=2),
      train_step=step,
      stages=advantages.advantage_stage(advantages.group_relative(advantages.grpo_advantages)),
      staleness=staleness)
  return ctx, optimizer


def _run(staleness, iterations, loss_name="grpo", prox_estimate="recompute"):
  ctx, optimizer = _context(staleness, loss_name, prox_estimate)
  params = transformer.init_params(TINY, jax.random.PRNGKey(0))
  producer = producers.independent(ctx.batch)
  state = loop.LoopState(train=train.init_train_state(params, optimizer), rng=jax.random.PRNGKey(1),
                         history=loop.init_history(params, staleness) if staleness else None,
                         producer=producer.init(0))
  behind = []
  for _ in range(iterations):
    state, metrics = loop.grpo_iteration(state, ctx, producer)
    behind.append(metrics["staleness"])
  return state, behind


@pytest.mark.slow
def test_grpo_loop_samples_stale_versions_deterministically():
  state_a, behind = _run(staleness=2, iterations=5, loss_name="decoupled")
  assert behind == [0, 1, 2, 2, 2]
  state_b, _ = _run(staleness=2, iterations=5, loss_name="decoupled")
  for a, b in zip(jax.tree.leaves(state_a.train.params), jax.tree.leaves(state_b.train.params)):
    np.testing.assert_array_equal(a, b)
  assert int(state_a.train.step) == 5
  _, on_policy = _run(staleness=0, iterations=2)
  assert on_policy == [0, 0]
  # With one update per batch the proximal policy is the current one, so the log-linear
  # estimate (no forward) gives the same training as the recomputed one.
  state_c, _ = _run(staleness=2, iterations=5, loss_name="decoupled", prox_estimate="loglinear")
  for a, c in zip(jax.tree.leaves(state_a.train.params), jax.tree.leaves(state_c.train.params)):
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)


def test_loop_without_history_fails_clearly():
  ctx, optimizer = _context(staleness=2)
  params = transformer.init_params(TINY, jax.random.PRNGKey(0))
  producer = producers.independent(ctx.batch)
  state = loop.LoopState(train=train.init_train_state(params, optimizer), rng=jax.random.PRNGKey(1),
                         producer=producer.init(0))
  with pytest.raises(ValueError, match="init_history"):
    loop.grpo_iteration(state, ctx, producer)


@pytest.mark.slow
def test_cross_stage_sequence_uses_concatenated_behaviour_logps():
  """Two segments of one sequence sampled under versions 0 and 1 (a partial rollout resumed
  under new parameters by re-prefilling its prefix): the batch's behav is the per-segment
  sampler log-probs, concatenated, and the IS ratios are against that concatenation."""
  params_a = transformer.init_params(TINY, jax.random.PRNGKey(0), init_std=0.5)
  params_b = transformer.init_params(TINY, jax.random.PRNGKey(1), init_std=0.5)
  params_c = transformer.init_params(TINY, jax.random.PRNGKey(2), init_std=0.5)
  prompt = jnp.asarray([[0, 1, 5, 6], [1, 7, 8, 9]], jnp.int32)
  config = sampler.SamplingConfig(max_new_tokens=2)
  state = sampler.prefill(params_a, prompt, prompt > 0, jax.random.PRNGKey(3), TINY, config)
  seg1 = sampler.to_generation(sampler.decode(params_a, state, jnp.int32(0), TINY, config))
  prefix_mask = seg1.prompt_mask | seg1.completion_mask
  config = sampler.SamplingConfig(max_new_tokens=4)
  state = sampler.prefill(params_b, seg1.tokens, prefix_mask, jax.random.PRNGKey(4), TINY, config)
  seg2 = sampler.to_generation(sampler.decode(params_b, state, jnp.int32(1), TINY, config))
  behav = jnp.concatenate([seg1.behavior_logp, seg2.behavior_logp[:, 6:]], axis=1)
  version = jnp.concatenate([seg1.version, seg2.version[:, 6:]], axis=1)
  completion_mask = jnp.concatenate([seg1.completion_mask, seg2.completion_mask[:, 6:]], axis=1)
  gen = seg2.replace(behavior_logp=behav, version=version, completion_mask=completion_mask,
                     prompt_mask=seg2.prompt_mask & ~completion_mask)
  mask = gen.prompt_mask | gen.completion_mask
  positions = transformer.positions_from_mask(mask)

  def logps(params):
    logits, _ = transformer.forward(params, gen.tokens, positions, mask, TINY)
    return np.asarray(transformer.token_logprobs(logits, gen.tokens))

  first = slice(4, 6)
  second = slice(6, 10)
  expected = np.concatenate([logps(params_a)[:, first], logps(params_b)[:, second]], axis=1)
  np.testing.assert_allclose(np.asarray(gen.behavior_logp)[:, 4:], expected, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(gen.version)[:, 4:], [[0, 0, 1, 1, 1, 1]] * 2)
  # The two segments' policies differ, so neither single version explains the sequence.
  assert np.abs(logps(params_a)[:, second] - expected[:, 2:]).max() > 1e-2

  logp = jnp.asarray(logps(params_c))
  m = np.asarray(gen.completion_mask, np.float32)
  ones = jnp.ones_like(logp)
  terms = corrections.TokenTerms(
      logp=logp, behav=gen.behavior_logp, prox=None, advantages=ones, mask=jnp.asarray(m),
      weight=ones, clip_scale=ones, reward=jnp.zeros(2), group=jnp.zeros(2, jnp.int32))
  want = ((np.asarray(logp)[:, 4:] - expected) * m[:, 4:]).sum(axis=1)
  np.testing.assert_allclose(corrections.sequence_log_weights(terms), want, rtol=1e-4, atol=1e-4)
  # And the token ratio every objective uses is against the concatenation too.
  batch_kw = dict(tokens=gen.tokens, prompt_mask=gen.prompt_mask,
                  completion_mask=gen.completion_mask, behavior_logp=gen.behavior_logp,
                  version=gen.version, group=jnp.zeros(2, jnp.int32), reward=jnp.zeros(2),
                  advantages=jnp.asarray(m))
  _, metrics = losses.get_loss("m2po")(logp, Rollout(**batch_kw), settings=losses.LossSettings(name="m2po"))
  np.testing.assert_allclose(metrics["m2"], ((np.asarray(logp)[:, 4:] - expected) ** 2 * m[:, 4:]).sum() / m.sum(),
                             rtol=1e-4)


@pytest.mark.slow
def test_launcher_runs_and_resumes_with_simulated_staleness(tmp_path):
  """config.rl.staleness reaches the loop, and the parameter ring is checkpointed with the
  rest of the state, so a resumed stale run continues."""
  def config(steps):
    return tiny_run_config(tmp_path, {
        "task.eval_size": 8, "eval.batch_size": 8, "warm_start.steps": 2,
        "warm_start.batch_size": 4, "rollout.group_size": 2, "rl.steps": steps,
        "rl.staleness": 2, "loss.name": "m2po", "resume.allow_changes": "rl.steps"})

  launcher.run(config(3))
  summary = launcher.run(config(4))
  assert summary["steps"] == 6
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["staleness"] for r in records if "staleness" in r] == [0, 1, 2, 2]
  bad = config(1)
  bad.rl.staleness = -1
  with pytest.raises(ValueError, match="staleness"):
    launcher.run(bad)
