"""Rollout routing replay (R3) end to end: every rollout kind's batch carries the sampler's
routing record (the experts each token ran through, per layer) equal to what the trainer's
router picks on the same parameters; the train step replays exactly that record; the
routing metrics against hand computations; the launcher trains an MoE policy with replay
on and off, and refuses what does not compose."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train as launcher
from models import transformer
from rl import loop
from rl import wiring
from rl.objectives import composite
from rl.types import Rollout
from tests.launcher_config import tiny_running_sum_config

KIND_FLAGS = {
    "independent": {},
    "partial": {"rollout.kind": "partial"},
    "tree": {"rollout.kind": "tree"},
    "pruned": {"rollout.kind": "pruned"},
    "speculative": {"rollout.speculative.tokens": 3},
    "tools": {"tools.name": "adder", "task.difficulty.tool_share": 0.5},
}


def _decisive_router(params, scale=40.0):
  """`params` with the router scaled up: a from-scratch router's logits are nearly equal,
  and routing decided by float rounding is not what the record is about."""
  layers = dict(params["layers"], router=params["layers"]["router"] * scale)
  return dict(params, layers=layers)


def _first_batch(tmp_path, overrides):
  config = tiny_running_sum_config(tmp_path, {"model.preset": "tiny2_moe", **overrides})
  run = wiring.validate(config)
  task = wiring.build_task(run)
  tokenizer, model_config, params = wiring.load_policy(run, jax.random.PRNGKey(0))
  params = _decisive_router(params)
  ctx, _ = wiring.make_context(run, task, tokenizer, model_config, wiring.RL)
  producer = wiring.make_rl_producer(run, ctx)
  rollout, _, _, _ = loop.produce_timed(producer, ctx, producer.init(0), None, params, 0,
                                        jax.random.PRNGKey(1), 0, iteration=1)
  return rollout, params, model_config


def _trainer_routing(params, rollout: Rollout, model_config):
  _, stats = transformer.hidden_states_with_routing(
      params, rollout.tokens, transformer.positions_from_mask(rollout.token_mask),
      rollout.token_mask, model_config)
  return np.sort(np.asarray(stats.experts), axis=-1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KIND_FLAGS))
def test_every_rollout_kind_records_the_experts_its_tokens_ran_through(tmp_path, kind):
  rollout, params, model_config = _first_batch(tmp_path, KIND_FLAGS[kind])
  record = np.asarray(rollout.experts)
  mask = np.asarray(rollout.token_mask)
  assert record.dtype == np.uint8
  assert record.shape == rollout.tokens.shape + (model_config.n_layers, 2)
  completion = np.asarray(rollout.completion_mask)
  assert completion.sum(axis=1).min() >= 2  # every row sampled tokens past the first step
  # On the sampler's own parameters (float32), the record is the trainer's routing at
  # every layer of every real token followed by one (the tokens whose routing reaches a
  # log-prob; a speculative row's final token is never run): prompt slots (prefill),
  # sampled tokens (decode steps, speculative verification, tree forks, resumed partial
  # rows) and tool answers.
  predicting = mask & np.pad(mask[:, 1:], ((0, 0), (0, 1)))
  want = _trainer_routing(params, rollout, model_config)
  same = (np.sort(record, axis=-1) == want).all(axis=-1)  # [B, T, L]
  assert same[predicting].all(), (
      f"{(~same[predicting]).sum()} of {same[predicting].size} token-layers differ")
  assert len(np.unique(record[mask])) == model_config.num_experts  # routing is not degenerate


def _sampled_batch(tmp_path):
  rollout, params, model_config = _first_batch(tmp_path, {})
  rollout = rollout.replace(advantages=jnp.where(rollout.completion_mask, 1.0, 0.0))
  return rollout, params, model_config


@pytest.mark.slow
def test_the_train_step_replays_the_record_and_only_with_replay_on(tmp_path):
  rollout, params, model_config = _sampled_batch(tmp_path)
  positions = transformer.positions_from_mask(rollout.token_mask)
  # Another record: every token's first expert moved to the next free one.
  record = rollout.experts.astype(jnp.int32)
  moved = (record[..., 0] + 1) % 8
  moved = jnp.where(moved == record[..., 1], (moved + 1) % 8, moved)
  other = record.at[..., 0].set(moved).astype(jnp.uint8)
  batch = rollout.replace(experts=other)

  def logp(replay):
    return composite.policy_logprobs(params, batch, model_config, replay=replay)

  logits, _ = transformer.forward(params, batch.tokens, positions, batch.token_mask,
                                  model_config, experts=other)
  want = transformer.token_logprobs(logits, batch.tokens)
  mask = np.asarray(batch.completion_mask)
  np.testing.assert_allclose(np.asarray(logp(True))[mask], np.asarray(want)[mask], atol=1e-5)
  plain = composite.policy_logprobs(params, rollout, model_config)
  assert np.abs(np.asarray(logp(True) - plain)[mask]).max() > 1e-2  # the record is used
  np.testing.assert_array_equal(logp(False), plain)  # replay off ignores it
  # And the metrics see it: every token-layer of `other` differs from the trainer's choice.
  objective = composite.StepObjective(
      model_config, wiring.rl_loss(wiring.settings(tiny_running_sum_config(tmp_path))),
      router=composite.RouterTerms(routing_replay=True))
  _, metrics = objective(params, batch, jnp.int32(0), jnp.int32(0))
  metrics = composite.with_mismatch_kl(metrics)
  assert float(metrics["moe_routing_mismatch"]) == pytest.approx(1.0)
  assert float(metrics["moe_unreplayed_kl"]) < 1e-6  # the router's own routing: on-policy
  assert float(metrics["behavior_train_kl"]) > 1e-3  # the moved experts: off the sampler


def _micro(record):
  tokens = jnp.zeros((1, 4), jnp.int32)
  return Rollout(tokens=tokens, prompt_mask=jnp.array([[True, False, False, False]]),
                 completion_mask=jnp.array([[False, True, True, False]]),
                 behavior_logp=jnp.zeros((1, 4)), version=jnp.zeros((1, 4), jnp.int32),
                 group=jnp.zeros(1, jnp.int32), reward=jnp.zeros(1),
                 experts=jnp.asarray(record, jnp.uint8))


def test_routing_metrics_equal_hand_computations():
  # 4 slots (the last is padding) x 2 layers x top 2 of 4 experts.
  own = jnp.array([[[[0, 1], [2, 3]], [[1, 2], [0, 1]], [[3, 2], [3, 2]], [[0, 1], [0, 1]]]])
  # Token 0: the same sets (in another order); token 1: both layers differ; token 2, the
  # row's last, differs too but predicts nothing and is not counted; slot 3: padding.
  record = [[[[1, 0], [2, 3]], [[1, 3], [0, 3]], [[0, 1], [0, 1]], [[2, 3], [2, 3]]]]
  stats = transformer.RouterStats(experts=own, load_balancing=jnp.array([1.0, 3.0]),
                                  z_loss=jnp.array([2.0, 4.0]))
  metrics = composite.RouterTerms.metrics(stats, _micro(record), jnp.array(True), 4)
  ratio = composite.with_mismatch_kl(dict(metrics, _mismatch_k3_sum=0.0, _mismatch_tokens=1.0))
  assert float(ratio["moe_routing_mismatch"]) == pytest.approx(2 / 4)  # of 2 tokens x 2 layers
  assert float(ratio["moe_load_balancing"]) == 2.0 and float(ratio["moe_router_z"]) == 3.0
  # The load counts all 3 real tokens. Layer 0 routes (0, 1), (1, 2), (3, 2): experts 1
  # and 2 have 2 of 6 choices each, x 4 experts = 4/3.
  assert float(ratio["moe_expert_load_max_l0"]) == pytest.approx(4 / 3)
  # Layer 1 routes (2, 3), (0, 1), (3, 2): experts 2 and 3 have 2 of 6 each.
  assert float(ratio["moe_expert_load_max_l1"]) == pytest.approx(4 / 3)
  # Later updates of the batch do not count the mismatch.
  later = composite.RouterTerms.metrics(stats, _micro(record), jnp.array(False), 4)
  assert float(later["_routing_slots"]) == 0.0


@pytest.mark.slow
def test_auxiliary_losses_enter_the_objective_with_their_coefficients(tmp_path):
  run = wiring.settings(tiny_running_sum_config(tmp_path, {"model.preset": "tiny2_moe"}))
  _, model_config, params = wiring.load_policy(run, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 10), 0, model_config.vocab_size)
  mask = jnp.ones((2, 10), bool)
  batch = Rollout(tokens=tokens, prompt_mask=mask.at[:, 4:].set(False),
                  completion_mask=mask.at[:, :4].set(False), behavior_logp=jnp.zeros((2, 10)),
                  version=jnp.zeros((2, 10), jnp.int32), group=jnp.zeros(2, jnp.int32),
                  reward=jnp.zeros(2), advantages=jnp.ones((2, 10)))
  loss = wiring.rl_loss(run)

  def total(router):
    objective = composite.StepObjective(model_config, loss, router=router)
    return objective(params, batch, jnp.int32(0), jnp.int32(0))

  base, metrics = total(composite.RouterTerms())
  weighted, _ = total(composite.RouterTerms(load_balancing_coef=0.5, router_z_coef=0.25))
  assert float(weighted - base) == pytest.approx(
      0.5 * float(metrics["moe_load_balancing"]) + 0.25 * float(metrics["moe_router_z"]),
      rel=1e-5)


def _launch(tmp_path, overrides):
  config = tiny_running_sum_config(tmp_path, {"model.preset": "tiny2_moe", **overrides})
  launcher.run(config)
  return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("replay", [False, True])
def test_the_launcher_trains_an_moe_policy_with_replay_on_and_off_under_staleness(tmp_path,
                                                                                   replay):
  records = _launch(tmp_path, {"moe.routing_replay": replay, "rl.staleness": 1, "rl.steps": 3,
                               "moe.load_balancing_coef": 0.01})
  rl = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert len(rl) == 3 and all(np.isfinite(r["loss"]) for r in rl)
  # The last batch was sampled before the second update (the first runs at warmup's
  # learning rate 0), so the routers moved between its sampler and its trainer.
  last = rl[-1]
  assert last["staleness"] > 0 and last["moe_routing_mismatch"] > 0
  if replay:  # replaying the record brings the trainer closer to the sampler
    assert last["behavior_train_kl"] < last["moe_unreplayed_kl"]
  else:
    assert all("moe_unreplayed_kl" not in r for r in rl)


@pytest.mark.parametrize("overrides,message", [
    ({"model.preset": "tiny2", "moe.routing_replay": True}, "is dense"),
    ({"moe.routing_replay": True, "rl.prefix_shared_forward": True}, "prefix_shared_forward"),
    ({"moe.routing_replay": True, "selection.kind": "ar3po", "task.train_pool": 64},
     "config.moe.routing_replay needs that every row carries the sampler's routing record"),
    ({"lora.rank": 4}, "mixtures of experts"),
])
def test_the_launcher_refuses_what_does_not_compose(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    _launch(tmp_path, {"model.preset": "tiny2_moe", **overrides})
