"""Tests for rl.objectives.corrections: SAT, M2PO, VCPO, TIS/MIS, log-linear proximal policy."""

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import corrections
from rl.objectives import losses

EPS_LOW, EPS_HIGH = 0.2, 0.28


def random_tokens(seed, shape=(64,)):
  rng = np.random.default_rng(seed)
  ratio = np.exp(rng.normal(0, 0.5, shape)).astype(np.float32)
  adv = rng.normal(0, 1, shape).astype(np.float32)
  scale = rng.uniform(1e-3, 1.0, shape).astype(np.float32)
  return jnp.asarray(ratio), jnp.asarray(adv), jnp.asarray(scale)


# --- SAT -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_sat_interval_is_inside_ppo_interval_and_its_surrogate_pointwise_pessimistic(seed):
  ratio, adv, k = random_tokens(seed, (4096,))
  lo, hi = losses.clip_interval(adv, EPS_LOW, EPS_HIGH, k)
  assert np.all(lo >= 1 - EPS_LOW) and np.all(hi <= 1 + EPS_HIGH)
  assert np.all(lo <= 1) and np.all(hi >= 1)
  # Only the endpoint the advantage sign selects moves.
  assert np.all(np.where(adv > 0, lo == np.float32(1 - EPS_LOW), hi == np.float32(1 + EPS_HIGH)))
  sat_loss, _ = losses.clip_objective(ratio, adv, EPS_LOW, EPS_HIGH, k)
  ppo_loss, _ = losses.clip_objective(ratio, adv, EPS_LOW, EPS_HIGH)
  assert np.all(np.asarray(sat_loss) >= np.asarray(ppo_loss) - 1e-6)  # surrogate <= PPO's
  assert np.any(np.asarray(sat_loss) > np.asarray(ppo_loss) + 1e-3)   # and sometimes strictly


@pytest.mark.parametrize("seed", range(5))
def test_sat_is_ppo_where_the_kernel_is_one(seed):
  rng = np.random.default_rng(seed)
  d = jnp.asarray(rng.normal(0, 0.3, (8, 16)).astype(np.float32))
  mask = jnp.asarray(rng.uniform(size=(8, 16)) < 0.8, jnp.float32)
  k = np.asarray(corrections.sat_kernel(jnp.abs(d), mask, 0.75, 0.1))
  q = np.quantile(np.abs(np.asarray(d))[np.asarray(mask) > 0], 0.75)
  np.testing.assert_allclose(k, np.exp(-np.maximum(np.abs(d) - q, 0) / 0.1), rtol=1e-5)
  assert np.all((k == 1.0) == (np.abs(np.asarray(d)) <= q))
  ratio, adv, _ = random_tokens(seed, (8, 16))
  sat_loss, _ = losses.clip_objective(ratio, adv, EPS_LOW, EPS_HIGH, jnp.asarray(k))
  ppo_loss, _ = losses.clip_objective(ratio, adv, EPS_LOW, EPS_HIGH)
  ones = k == 1.0
  np.testing.assert_array_equal(np.asarray(sat_loss)[ones], np.asarray(ppo_loss)[ones])


# --- M2PO ----------------------------------------------------------------------------


def brute_force_min_drop(d2, tau):
  """Fewest valid tokens to drop so the kept mean of d^2 <= tau (empty mean = 0)."""
  n = len(d2)
  for drop in range(n + 1):
    for subset in itertools.combinations(range(n), drop):
      kept = [d2[i] for i in range(n) if i not in subset]
      if (np.mean(kept) if kept else 0.0) <= tau + 1e-9:
        return drop
  raise AssertionError


@pytest.mark.parametrize("seed", range(30))
def test_m2po_mask_is_minimal_and_within_tau(seed):
  rng = np.random.default_rng(seed)
  shape = (2, 4)
  d = rng.normal(0, rng.uniform(0.05, 0.6), shape).astype(np.float32)
  mask = (rng.uniform(size=shape) < 0.85).astype(np.float32)
  tau = float(rng.choice([0.01, 0.04, 0.1]))
  keep = np.asarray(corrections.m2_mask(jnp.asarray(d), jnp.asarray(mask), tau))
  valid = mask > 0
  kept = valid & (keep > 0)
  d2 = (d * d)[valid]
  assert ((d * d)[kept].mean() if kept.any() else 0.0) <= tau + 1e-6
  assert (valid & (keep == 0)).sum() == brute_force_min_drop(list(d2), tau)
  # Dropped tokens are the largest: each dropped d^2 >= every kept d^2.
  if (valid & (keep == 0)).any() and kept.any():
    assert (d * d)[valid & (keep == 0)].min() >= (d * d)[kept].max()


def test_m2po_masks_nothing_when_m2_within_tau():
  rng = np.random.default_rng(0)
  d = rng.normal(0, 0.1, (4, 8)).astype(np.float32)
  mask = np.ones((4, 8), np.float32)
  tau = float((d * d).mean()) + 1e-4
  keep = corrections.m2_mask(jnp.asarray(d), jnp.asarray(mask), tau)
  assert np.all(np.asarray(keep) == 1.0)
  keep = corrections.m2_mask(jnp.asarray(d), jnp.asarray(mask), float((d * d).mean()) * 0.5)
  assert np.any(np.asarray(keep) == 0.0)


def test_m2po_drops_every_token_when_none_is_within_tau():
  # The case: 21 tokens with d = 0.3 and one with d = 3.0 (every d^2 > tau = 0.04).
  # The old "total - dropped prefix" left a float residue at "drop all", so no count
  # satisfied the bound, argmax returned 0 and every token was kept.
  d = jnp.asarray([[0.3] * 21 + [3.0]], jnp.float32)
  keep = corrections.m2_mask(d, jnp.ones_like(d), 0.04)
  assert np.asarray(keep).sum() == 0.0
  # A padding token stays 1 (left to the aggregation mask); valid ones all go.
  keep = corrections.m2_mask(jnp.pad(d, ((0, 0), (0, 1))), jnp.asarray([[1.0] * 22 + [0.0]]), 0.04)
  np.testing.assert_array_equal(np.asarray(keep), [[0.0] * 22 + [1.0]])


def _minimal_drop_float64(d2: np.ndarray, tau: float) -> int:
  """Fewest largest-first drops with kept mean <= tau, in float64 (the reference)."""
  d2 = np.sort(d2.astype(np.float64))[::-1]
  kept_sum = np.concatenate([np.cumsum(d2[::-1])[::-1], [0.0]])
  return int(np.argmax(kept_sum <= tau * (len(d2) - np.arange(len(d2) + 1))))


@pytest.mark.parametrize("small_fraction", [0.0, 0.01, 0.1])
def test_m2po_large_batches_keep_mean_within_tau(small_fraction):
  # 4,096 tokens mostly far from the behaviour policy (|d| in [0.25, 3], d^2 > tau), a few
  # (small_fraction) close to it. Before the fix, "nothing fits" batches kept every token
  # in ~40% of trials, and batches with 1% close tokens kept too many in some.
  rng = np.random.default_rng(17)
  tau = 0.04
  mask_fn = jax.jit(corrections.m2_mask, static_argnums=2)
  for _ in range(20):
    d = rng.uniform(0.25, 3.0, 4096) * rng.choice([-1.0, 1.0], 4096)
    d = np.where(rng.random(4096) < small_fraction, rng.normal(0, 0.05, 4096), d)
    d = d.astype(np.float32).reshape(8, 512)
    keep = np.asarray(mask_fn(jnp.asarray(d), jnp.ones_like(jnp.asarray(d)), tau)) > 0
    d2 = d.astype(np.float64) ** 2
    assert (d2[keep].mean() if keep.any() else 0.0) <= tau
    assert (~keep).sum() == _minimal_drop_float64(d2.reshape(-1), tau)
    if small_fraction == 0.0:
      assert not keep.any()


# --- VCPO ----------------------------------------------------------------------------


def test_ess_ratio_and_lr_scale_match_the_formula():
  rng = np.random.default_rng(0)
  log_w = rng.normal(0, 1.0, 16)
  w = np.exp(log_w)
  rho = w.sum() ** 2 / (16 * (w * w).sum())
  np.testing.assert_allclose(corrections.effective_sample_size_ratio(jnp.asarray(log_w, jnp.float32)),
                             rho, rtol=1e-5)
  terms = _terms(log_ratio=np.zeros((16, 3)))
  terms = terms.replace(behav=terms.logp - jnp.asarray(np.repeat(log_w[:, None] / 3, 3, 1), jnp.float32))
  # The authors' reference: lr_scale = min(1.0, ess_ratio / base_ess_ratio), then sqrt.
  for rho_ref in (0.2, 0.5, 1.0):
    _, metrics = corrections.vcpo_step_scale(rho_ref=rho_ref)(terms)
    np.testing.assert_allclose(metrics["lr_scale"], min(1.0, rho / rho_ref) ** 0.5, rtol=1e-5)
  # Huge log-weights do not overflow (log-space computation).
  assert np.isfinite(float(corrections.effective_sample_size_ratio(jnp.asarray([500.0, 0.0]))))


@pytest.mark.parametrize("rho_ref", [1.0, 0.5, 0.1])
def test_lr_scale_is_one_on_policy_and_never_above_one(rho_ref):
  """rho = 1 on-policy: the base rate, also with rho_ref < 1 (unclamped, sqrt(1 / rho_ref)
  would raise the learning rate on every fresh batch)."""
  terms = _terms(log_ratio=np.zeros((8, 5)))
  _, metrics = corrections.vcpo_step_scale(rho_ref=rho_ref)(terms)
  np.testing.assert_allclose(metrics["lr_scale"], 1.0, rtol=1e-6)


@pytest.mark.parametrize("chain, refused", [
    (("mu_veto", "m2po"), "m2po"), (("mu_veto", "sat"), "sat"),
    (("mu_veto", "vcpo_ess"), "vcpo_ess"), (("tis", "mu_veto", "vcpo_baseline"), "vcpo_baseline"),
    (("m2po", "mu_veto"), None), (("mu_veto", "tis"), None)])
def test_corrections_reading_the_log_ratio_after_the_veto_are_refused(chain, refused):
  """After 'mu_veto' a dropped token's logp is its anchor's (d = 0): a later m2po / sat /
  VCPO statistic would count it as on-policy, so that order is refused; before the veto,
  or a correction that reads prox - behav (tis), is fine."""
  terms = _terms(log_ratio=np.zeros((4, 3)), prox_shift=np.zeros((4, 3)))
  config = losses.LossSettings()
  if refused is None:
    corrections.chain(chain, terms, config)
    return
  with pytest.raises(ValueError, match=f"Correction '{refused}' after 'mu_veto'"):
    corrections.chain(chain, terms, config)


def test_optimal_baseline_reduces_gradient_variance_in_a_bandit():
  """Monte-Carlo softmax bandit: samples from a behaviour policy mu, IS weights to the
  target pi, estimator mean_i w_i (R_i - b) grad log pi(a_i). The off-policy optimal baseline
  (with exact g = ||grad log pi(a)||^2) has lower total variance than the group mean."""
  rng = np.random.default_rng(0)
  n_arms, group, trials = 5, 8, 4000
  logits_pi = rng.normal(0, 1, n_arms)
  pi = np.exp(logits_pi) / np.exp(logits_pi).sum()
  mu = np.exp(logits_pi + rng.normal(0, 1.0, n_arms))
  mu /= mu.sum()
  mean_reward = rng.uniform(0, 1, n_arms) + 3.0  # an offset makes the baseline matter
  score = np.eye(n_arms) - pi[None, :]               # grad_logits log pi(a), rows a
  g_exact = (score ** 2).sum(1)
  a = rng.choice(n_arms, size=(trials, group), p=mu)
  reward = mean_reward[a] + rng.normal(0, 0.5, (trials, group))
  log_w = np.log(pi[a]) - np.log(mu[a])
  w = np.exp(log_w)
  baselines = {  # each trial is one group
      "mean": reward.mean(1, keepdims=True),
      "optimal": np.asarray(jax.vmap(corrections.optimal_baseline)(
          jnp.asarray(log_w, jnp.float32), jnp.asarray(g_exact[a], jnp.float32),
          jnp.asarray(reward, jnp.float32), jnp.zeros((trials, group), jnp.int32)))}
  estimates = {name: ((w * (reward - b))[..., None] * score[a]).mean(1)
               for name, b in baselines.items()}
  var = {k: np.var(v, axis=0).sum() for k, v in estimates.items()}
  assert var["optimal"] < 0.8 * var["mean"], var


def test_optimal_baseline_matches_numpy_per_group():
  rng = np.random.default_rng(1)
  log_w, g, r = rng.normal(size=6), rng.uniform(0.1, 2, 6), rng.normal(size=6)
  group = np.array([0, 0, 0, 1, 1, 1])
  c = np.exp(2 * log_w) * g
  want = np.concatenate([np.full(3, (c[s] * r[s]).sum() / c[s].sum()) for s in (slice(0, 3), slice(3, 6))])
  got = corrections.optimal_baseline(*(jnp.asarray(x, jnp.float32) for x in (log_w, g, r)),
                                     jnp.asarray(group))
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("size", [3, 7, 16])
def test_vcpo_baseline_gives_zero_advantage_to_equal_fractional_rewards(size):
  rng = np.random.default_rng(size)
  logp = jnp.asarray(rng.normal(-1, 0.3, (size, 5)), jnp.float32)
  mask = jnp.ones((size, 5))
  terms = corrections.TokenTerms(
      logp=logp, behav=logp + jnp.asarray(rng.normal(0, 0.2, (size, 5)), jnp.float32),
      prox=None, advantages=jnp.zeros((size, 5)), mask=mask, weight=jnp.ones((size, 5)),
      clip_scale=jnp.ones((size, 5)), reward=jnp.full((size,), 0.7), group=jnp.zeros(size, jnp.int32))
  out, _ = corrections.vcpo_baseline()(terms)
  np.testing.assert_array_equal(np.asarray(out.advantages), 0.0)


# --- TIS / MIS and the log-linear proximal policy -------------------------------------


def _terms(log_ratio, prox_shift=None, seed=0):
  rng = np.random.default_rng(seed)
  shape = log_ratio.shape
  logp = jnp.asarray(-rng.uniform(0.1, 2.0, shape), jnp.float32)
  behav = logp - jnp.asarray(log_ratio, jnp.float32)
  prox = None if prox_shift is None else behav + jnp.asarray(prox_shift, jnp.float32)
  ones = jnp.ones(shape, jnp.float32)
  return corrections.TokenTerms(
      logp=logp, behav=behav, prox=prox, advantages=ones, mask=ones, weight=ones,
      clip_scale=ones, reward=jnp.zeros(shape[0]), group=jnp.zeros(shape[0], jnp.int32))


def test_tis_and_mis_weights_and_a_factory_binds_its_hyperparameters():
  shift = np.array([[-3.0, -0.5, 0.0, 1.0, 1.6, 2.5]], np.float32)
  terms = _terms(np.zeros((1, 6)), prox_shift=shift)
  out, _ = corrections.truncated_is(is_cap=5.0)(terms)
  np.testing.assert_allclose(out.weight, np.minimum(np.exp(shift), 5.0), rtol=1e-6)
  out, metrics = corrections.masked_is(is_cap=5.0, is_floor=0.2)(terms)
  w = np.exp(shift)
  np.testing.assert_allclose(out.weight, np.where((w >= 0.2) & (w <= 5.0), w, 0.0), rtol=1e-6)
  np.testing.assert_allclose(metrics["masked_fraction"], 2 / 6, rtol=1e-6)
  with pytest.raises(ValueError, match="proximal"):
    corrections.truncated_is()(_terms(np.zeros((1, 6))))
  # A factory binds its hyperparameters.
  shift = np.array([[-1.0, 0.0, 0.5, 1.0, 2.0]], np.float32)
  terms = _terms(np.zeros((1, 5)), prox_shift=shift)
  out, metrics = corrections.truncated_is(is_cap=2.0)(terms)
  np.testing.assert_allclose(out.weight, np.minimum(np.exp(shift), 2.0), rtol=1e-6)
  np.testing.assert_allclose(metrics["is_truncated_fraction"], 2 / 5)
  # The registry path reads the same hyperparameter from config.loss.is_cap.
  via_config, config_metrics = corrections.chain(
      ("tis",), terms, losses.LossSettings(is_cap=2.0))
  np.testing.assert_array_equal(via_config.weight, out.weight)
  assert config_metrics.keys() == metrics.keys()
  for key in metrics:
    np.testing.assert_array_equal(config_metrics[key], metrics[key])
  # Each built correction keeps its own value; the default is LossSettings' 5.
  np.testing.assert_allclose(corrections.truncated_is()(terms)[0].weight,
                             np.minimum(np.exp(shift), 5.0), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(corrections.CORRECTIONS))
def test_factory_defaults_are_the_loss_defaults(name):
  spec = corrections.get_correction(name)
  params = inspect.signature(spec.factory).parameters
  assert set(spec.fields) == set(params)  # every hyperparameter is fed from config.loss
  for arg, field in spec.fields.items():
    assert params[arg].default == losses.LossSettings.defaults()[field], (name, arg)


def test_register_correction_checks_its_fields():
  with pytest.raises(ValueError, match="not arguments"):
    corrections.register_correction("bad", fields=dict(cap="is_cap"))(corrections.truncated_is)
  assert "bad" not in corrections.CORRECTIONS


def test_loglinear_prox():
  logp = jnp.asarray([[-1.0, -2.0, -0.5, -3.0]])
  behav = jnp.asarray([[-1.5, -1.0, -0.5, -2.0]])
  version = jnp.asarray([[10, 6, 10, 2]])
  # Fresh tokens (generated by the proximal version) keep behav.
  prox = corrections.loglinear_prox(logp, behav, jnp.full((1, 4), 10), 10, 12)
  np.testing.assert_allclose(prox, behav)
  # Proximal = current (alpha = 1): the current log-probs.
  prox = corrections.loglinear_prox(logp, behav, jnp.asarray([[3, 6, 9, 2]]), 12, 12)
  np.testing.assert_allclose(prox, logp)
  # In between: alpha = (v_prox - v_behav) / (v_theta - v_behav), clipped to [0, 1].
  prox = corrections.loglinear_prox(logp, behav, version, 10, 12)
  alpha = np.array([0.0, 4 / 6, 0.0, 8 / 10])
  np.testing.assert_allclose(prox[0], behav[0] + alpha * (logp[0] - behav[0]), rtol=1e-6)
  # The approximation carries no gradient.
  grad = jax.grad(lambda lp: corrections.loglinear_prox(lp, behav, version, 10, 12).sum())(logp)
  assert np.all(np.asarray(grad) == 0)
