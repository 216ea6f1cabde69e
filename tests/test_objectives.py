"""Tests for rl.losses objectives: reduction to GRPO on-policy, decoupled PPO, VCPO, M2PO,
registry and config handling."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rl import corrections
from rl import losses
from rl.types import Rollout

B, T = 6, 7


def make_batch(seed=0, behav_shift=0.0, group_size=3):
  """Random batch [B, T] with 2-token prompts, ragged completions and group rewards."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T - 2 + 1, size=B)
  completion = np.zeros((B, T), bool)
  for i, n in enumerate(lengths):
    completion[i, 2:2 + n] = True
  prompt = np.zeros((B, T), bool)
  prompt[:, :2] = True
  logp = np.where(completion, -rng.uniform(0.05, 3.0, (B, T)), 0.0).astype(np.float32)
  behav = np.where(completion, logp + behav_shift * rng.normal(size=(B, T)), 0.0).astype(np.float32)
  group = np.repeat(np.arange(B // group_size), group_size).astype(np.int32)
  reward = rng.integers(0, 2, B).astype(np.float32)
  reward[0], reward[1] = 1.0, 0.0  # every test batch has an informative group
  adv = np.zeros(B, np.float32)
  for g in np.unique(group):
    r = reward[group == g]
    adv[group == g] = (r - r.mean()) / (r.std() + 1e-6)
  batch = Rollout(
      tokens=jnp.zeros((B, T), jnp.int32), prompt_mask=jnp.asarray(prompt),
      completion_mask=jnp.asarray(completion), behavior_logp=jnp.asarray(behav),
      version=jnp.where(jnp.asarray(completion), 0, -1), group=jnp.asarray(group),
      reward=jnp.asarray(reward), advantages=jnp.asarray(adv[:, None] * completion))
  return jnp.asarray(logp), batch


def cfg(**kw):
  return ml_collections.FrozenConfigDict(dict(dict(name="grpo", norm_len=T), **kw))


def loss_and_grad(name, logp, batch, prox=None, **kw):
  fn = losses.get_loss(name)
  value, grad = jax.value_and_grad(
      lambda lp: fn(lp, batch, prox_logp=prox, config=cfg(name=name, **kw))[0])(logp)
  return float(value), np.asarray(grad)


def grpo_grad(logp, batch, aggregation):
  return loss_and_grad("grpo", logp, batch, aggregation=aggregation)[1]


# name -> the GRPO aggregation its on-policy gradient must equal.
REDUCTIONS = {
    "grpo": "seq_mean_token_mean", "dapo": "token_mean", "drgrpo": "seq_mean_token_sum_norm",
    "gspo": "seq_mean_token_mean", "gspo_token": "seq_mean_token_mean",
    "decoupled": "seq_mean_token_mean", "m2po": "token_mean", "sat": "seq_mean_token_mean"}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_every_objective_reduces_to_grpo_gradient_on_policy(name):
  logp, batch = make_batch(seed=1)
  on_policy = batch.replace(behavior_logp=logp)
  _, grad = loss_and_grad(name, logp, on_policy, prox=logp)
  np.testing.assert_allclose(grad, grpo_grad(logp, on_policy, REDUCTIONS[name]), rtol=1e-5, atol=1e-7)
  assert np.abs(grad).sum() > 0


@pytest.mark.parametrize("extra", [("tis",), ("mis",), ("m2po",), ("sat",), ("tis", "m2po", "sat")])
def test_chained_corrections_are_identities_on_policy(extra):
  logp, batch = make_batch(seed=2)
  on_policy = batch.replace(behavior_logp=logp)
  _, grad = loss_and_grad("dapo", logp, on_policy, prox=logp, corrections=extra)
  np.testing.assert_allclose(grad, grpo_grad(logp, on_policy, "token_mean"), rtol=1e-5, atol=1e-7)


def test_vcpo_on_policy_is_grpo_with_the_optimal_baseline():
  """On-policy w = 1: VCPO's gradient is GRPO's with advantages (R - b)/std, b = the
  g-weighted group mean of the rewards (g = sum_t (1 - p_t)^2, hand-computed here)."""
  logp, batch = make_batch(seed=3)
  on_policy = batch.replace(behavior_logp=logp)
  lp, m = np.asarray(logp), np.asarray(batch.completion_mask, np.float32)
  g = ((1 - np.exp(lp)) ** 2 * m).sum(1) + 1e-6
  r, grp = np.asarray(batch.reward), np.asarray(batch.group)
  adv = np.zeros(B, np.float32)
  for k in np.unique(grp):
    s = grp == k
    adv[s] = (r[s] - (g[s] * r[s]).sum() / g[s].sum()) / (r[s].std() + 1e-6)
  expected = grpo_grad(logp, on_policy.replace(advantages=jnp.asarray(adv[:, None] * m)),
                       "seq_mean_token_mean")
  _, grad = loss_and_grad("vcpo", logp, on_policy)
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
  _, metrics = losses.get_loss("vcpo")(logp, on_policy, config=cfg(name="vcpo"))
  np.testing.assert_allclose(metrics["lr_scale"], 1.0, rtol=1e-6)


def test_decoupled_with_prox_equal_behav_is_ppo():
  logp, batch = make_batch(seed=4, behav_shift=0.4)
  got = loss_and_grad("decoupled", logp, batch, prox=batch.behavior_logp)
  want = loss_and_grad("grpo", logp, batch)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-8)


def test_decoupled_matches_hand_formula():
  """loss = seq-mean token-mean of -min(r A, clip(r) A) * min(exp(prox - behav), cap)."""
  logp, batch = make_batch(seed=5, behav_shift=1.0)
  rng = np.random.default_rng(0)
  prox = np.asarray(logp) + 0.3 * rng.normal(size=(B, T)).astype(np.float32)
  lp, bh, m = np.asarray(logp), np.asarray(batch.behavior_logp), np.asarray(batch.completion_mask)
  a = np.asarray(batch.advantages)
  r = np.exp(lp - prox)
  per = -np.minimum(r * a, np.clip(r, 0.8, 1.2) * a) * np.minimum(np.exp(prox - bh), 5.0)
  want = np.mean([per[i][m[i]].mean() for i in range(B)])
  got, _ = loss_and_grad("decoupled", logp, batch, prox=jnp.asarray(prox))
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_decoupled_needs_prox_and_train_step_knows():
  logp, batch = make_batch()
  with pytest.raises(ValueError, match="prox_logp"):
    losses.get_loss("decoupled")(logp, batch, config=cfg(name="decoupled"))
  assert losses.needs_prox(cfg(name="decoupled"))
  assert losses.needs_prox(cfg(name="dapo", corrections=("mis",)))
  assert not losses.needs_prox(cfg(name="m2po"))
  assert not losses.needs_prox(cfg(name="grpo"))


def test_m2po_has_no_clipping():
  """With large ratios (and M2 <= tau by a generous tau) the gradient is -(1/N) r A."""
  logp, batch = make_batch(seed=6)
  stale = batch.replace(behavior_logp=jnp.where(batch.completion_mask, logp - 1.0, 0.0))
  _, grad = loss_and_grad("m2po", logp, stale, m2_tau=10.0)
  m = np.asarray(stale.completion_mask)
  want = -np.e * np.asarray(stale.advantages) * m / m.sum()
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_m2po_masked_tokens_get_no_gradient():
  logp, batch = make_batch(seed=7, behav_shift=1.0)
  fn = losses.get_loss("m2po")
  _, metrics = fn(logp, batch, config=cfg(name="m2po"))
  assert 0 < metrics["masked_fraction"] < 1
  _, grad = loss_and_grad("m2po", logp, batch)
  d = np.asarray(corrections.sg(logp - batch.behavior_logp)) * np.asarray(batch.completion_mask)
  keep = np.asarray(corrections.m2_mask(jnp.asarray(d), batch.completion_mask, 0.04))
  assert np.all(grad[(keep == 0)] == 0)


def test_gspo_clips_whole_sequences():
  """A sequence whose mean log-ratio leaves [1 - 3e-4, 1 + 4e-4] on its advantage's side
  gets no gradient; the others do."""
  logp, batch = make_batch(seed=8)
  shift = np.zeros((B, T), np.float32)
  shift[0] = -0.01  # s_0 = exp(0.01) > 1 + 4e-4 with A_0 > 0: clipped
  behav = jnp.where(batch.completion_mask, logp + jnp.asarray(shift), 0.0)
  _, grad = loss_and_grad("gspo", logp, batch.replace(behavior_logp=behav))
  assert np.all(grad[0] == 0)
  assert np.abs(grad[1]).sum() > 0


def test_unknown_names_raise():
  logp, batch = make_batch()
  with pytest.raises(ValueError, match="Unknown loss"):
    losses.get_loss("nope")
  with pytest.raises(ValueError, match="Unknown correction"):
    losses.get_loss("grpo")(logp, batch, config=cfg(corrections=("nope",)))
  with pytest.raises(ValueError, match="prox_estimate"):
    losses.resolve_config(cfg(prox_estimate="guess"))


def test_objective_overrides_define_the_method():
  dapo = losses.resolve_config(cfg(name="dapo"), losses.get_loss("dapo").overrides)
  assert (dapo.eps_low, dapo.eps_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
  assert losses.resolve_config(None).m2_tau == 0.04


def test_registry_has_every_section_1_objective():
  assert {"grpo", "dapo", "drgrpo", "gspo", "gspo_token", "decoupled", "m2po", "sat",
          "vcpo", "sft"} <= set(losses.LOSSES)
  assert {"tis", "mis", "m2po", "sat", "vcpo_ess", "vcpo_baseline"} <= set(corrections.CORRECTIONS)


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "decoupled", "m2po", "sat", "vcpo"])
def test_objectives_jit(name):
  logp, batch = make_batch(seed=9, behav_shift=0.5)
  fn = losses.get_loss(name)
  config = cfg(name=name)
  loss, _ = jax.jit(lambda lp, b, p: fn(lp, b, prox_logp=p, config=config))(logp, batch, logp)
  assert np.isfinite(float(loss))


def test_built_in_objectives_are_typed_records():
  decoupled = losses.get_loss("decoupled")
  assert isinstance(decoupled, losses.Objective)
  assert (decoupled.name, decoupled.corrections, decoupled.uses_prox) == (
      "decoupled", ("tis",), True)
  assert losses.get_loss("dapo").overrides == dict(eps_low=0.2, eps_high=0.28,
                                                   aggregation="token_mean")
  assert losses.needs_prox(cfg(name="decoupled")) and not losses.needs_prox(cfg(name="grpo"))
  assert not isinstance(losses.get_loss("sft"), losses.Objective)  # a plain registered function
  assert losses.correction_chain(losses.get_loss("sft"), cfg(name="sft")) == ()
