"""GRPO advantages and the PPO-clip objective against hand-computed cases and the PG formula."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import transformer
from rl.objectives import advantages
from rl.objectives import losses
from rl.settings import loss as loss_settings
from rl.types import Rollout
from rl import wiring
from tests import tiny

LOSS_CONFIG = losses.LossSettings(
    name="grpo", eps_low=0.2, eps_high=0.28, aggregation="token_mean", norm_len=4.0, kl_coef=0.0)


def make_batch(advantage, behavior_logp, mask, **extra):
  b, t = mask.shape
  return Rollout(tokens=jnp.zeros((b, t), jnp.int32), prompt_mask=jnp.zeros((b, t), bool),
                 completion_mask=jnp.asarray(mask, bool), behavior_logp=jnp.asarray(behavior_logp),
                 version=jnp.zeros((b, t), jnp.int32), group=jnp.zeros((b,), jnp.int32),
                 reward=jnp.zeros((b,)), advantages=jnp.asarray(advantage, jnp.float32), **extra)


def test_grpo_advantages_hand_computed():
  reward = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5])
  group = jnp.array([0, 0, 0, 0, 1, 1, 1])
  # group 0: mean 0.5, population std 0.5 -> +-1; group 1: all equal -> 0.
  np.testing.assert_allclose(advantages.grpo_advantages(reward, group),
                             [1, -1, -1, 1, 0, 0, 0], atol=1e-5)


def test_grpo_advantages_match_numpy_on_shuffled_groups():
  rng = np.random.default_rng(0)
  reward = rng.normal(size=24)
  group = rng.permutation(np.repeat(np.arange(4), 6))
  expected = np.empty(24)
  for g in range(4):
    r = reward[group == g]
    expected[group == g] = (r - r.mean()) / (r.std() + 1e-6)
  np.testing.assert_allclose(advantages.grpo_advantages(jnp.asarray(reward), jnp.asarray(group)),
                             expected, rtol=1e-5, atol=1e-5)


def test_unknown_names_raise_clear_errors():
  with pytest.raises(ValueError, match="Unknown loss 'ppo2'.*known"):
    losses.get_loss("ppo2")
  with pytest.raises(ValueError, match="Unknown advantage estimator"):
    advantages.get_advantage_fn("gae")
  with pytest.raises(ValueError, match="Unknown aggregation"):
    losses.aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "sum_all")


def test_ppo_clip_hand_computed():
  # Ratios e^{log r}: 1.5 (A=+1, clipped at 1.28), 0.5 (A=+1, unclipped min), 0.5 (A=-1, clipped at 0.8), 1.1 (A=-1).
  log_ratio = jnp.log(jnp.array([[1.5, 0.5], [0.5, 1.1]]))
  adv = jnp.array([[1.0, 1.0], [-1.0, -1.0]])
  batch = make_batch(adv, jnp.zeros((2, 2)), np.ones((2, 2)))
  loss, metrics = losses.ppo_clip_loss(log_ratio, batch, settings=LOSS_CONFIG)
  expected = -(1.28 + 0.5 - 0.8 - 1.1) / 4
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(metrics["clip_fraction"], 0.5)


@pytest.mark.parametrize("mode,expected", [
    ("token_mean", (1 + 2 + 3 + 10) / 4),
    ("seq_mean_token_mean", ((1 + 2 + 3) / 3 + 10) / 2),
    ("seq_mean_token_sum_norm", ((1 + 2 + 3) / 4 + 10 / 4) / 2),
])
def test_aggregations_hand_computed(mode, expected):
  per_token = jnp.array([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
  np.testing.assert_allclose(losses.aggregate(per_token, mask, mode, norm_len=4.0), expected, rtol=1e-6)


def test_ppo_gradient_equals_policy_gradient_at_ratio_one():
  """At logp == behaviour, grad of the PPO objective is -mean_tokens(A * grad logp)."""
  config = tiny.model(vocab_size=13)
  params = transformer.init_params(config, jax.random.PRNGKey(0), init_std=0.3)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 13, (3, 6)), jnp.int32)
  mask = jnp.asarray(np.arange(6)[None] >= np.array([[2], [3], [2]]))
  token_mask = jnp.ones((3, 6), bool)
  adv = jnp.asarray(rng.normal(size=(3, 1)) * mask, jnp.float32)
  logp_fn = lambda p: transformer.sequence_logprobs(p, tokens, token_mask, config)
  behaviour = logp_fn(params)
  batch = make_batch(adv, behaviour, mask)

  grad_ppo = jax.jit(jax.grad(
      lambda p: losses.ppo_clip_loss(logp_fn(p), batch, settings=LOSS_CONFIG)[0]))(params)
  # REINFORCE form: -(1/N) sum_t m A grad logp.
  n = mask.sum()
  grad_pg = jax.jit(jax.grad(lambda p: -(adv * mask * logp_fn(p)).sum() / n))(params)
  for a, b in zip(jax.tree.leaves(grad_ppo), jax.tree.leaves(grad_pg)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_kl_penalty_requires_reference_logprobs():
  batch = make_batch(jnp.zeros((1, 2)), jnp.zeros((1, 2)), np.ones((1, 2)))
  config = dataclasses.replace(LOSS_CONFIG, kl_coef=0.1)
  with pytest.raises(ValueError, match="ref_logp"):
    losses.ppo_clip_loss(jnp.zeros((1, 2)), batch, settings=config)
  with_ref = batch.replace(ref_logp=jnp.log(jnp.array([[0.5, 0.25]])))
  logp = jnp.log(jnp.array([[0.25, 0.25]]))
  loss, metrics = losses.ppo_clip_loss(logp, with_ref, settings=config)
  k3 = np.mean([2 - np.log(2) - 1, 0.0])
  np.testing.assert_allclose(metrics["kl_ref"], k3, rtol=1e-5)
  np.testing.assert_allclose(loss, 0.1 * k3, rtol=1e-5)


def test_sum_norm_refuses_a_zero_normaliser():
  per_token, mask = jnp.ones((2, 3)), jnp.ones((2, 3))
  with pytest.raises(ValueError, match="norm_len > 0"):
    losses.aggregate(per_token, mask, "seq_mean_token_sum_norm", norm_len=0.0)


def test_config_loss_fields_have_one_default():
  """experiments/configs/default.py's loss section is LossSettings' defaults, the fields an
  objective may fix left unset (None), so a field means the same whether it comes from the
  launcher or the library; the launcher turns norm_len 0 into the generation budget
  (Dr.GRPO's constant)."""
  from experiments.configs import default  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  assert config.loss.to_dict() == losses.LossSettings.defaults()
  assert all(config.loss[k] is None for k in loss_settings.OBJECTIVE_FIXABLE)
  resolved = losses.resolve(losses.LossSettings.from_config(config.loss))
  assert {k: getattr(resolved, k) for k in loss_settings.FIXABLE_DEFAULTS} == loss_settings.FIXABLE_DEFAULTS
  assert wiring.rl_loss(wiring.settings(config)).norm_len == config.rollout.max_new_tokens
  config.loss.norm_len = 24.0
  assert wiring.rl_loss(wiring.settings(config)).norm_len == 24.0
