"""Tests for rl.objectives.losses objectives: reduction to GRPO on-policy, decoupled PPO, VCPO, M2PO,
registry and config handling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.objectives import corrections
from rl.objectives import losses
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
  return losses.LossSettings(**dict(dict(name="grpo", norm_len=T), **kw))


def loss_and_grad(name, logp, batch, prox=None, **kw):
  fn = losses.get_loss(name)
  value, grad = jax.value_and_grad(
      lambda lp: fn(lp, batch, prox_logp=prox, settings=cfg(name=name, **kw))[0])(logp)
  return float(value), np.asarray(grad)


def grpo_grad(logp, batch, aggregation):
  return loss_and_grad("grpo", logp, batch, aggregation=aggregation)[1]


# name -> the GRPO aggregation its on-policy gradient must equal.
REDUCTIONS = {
    "grpo": "seq_mean_token_mean", "dapo": "token_mean", "drgrpo": "seq_mean_token_sum_norm",
    "gspo": "seq_mean_token_mean", "gspo_token": "seq_mean_token_mean",
    "decoupled": "seq_mean_token_mean", "m2po": "token_mean", "sat": "seq_mean_token_mean",
    "mu_grpo": "seq_mean_token_mean"}


@pytest.mark.parametrize("name,extra", [(name, ()) for name in sorted(REDUCTIONS)] + [
    ("dapo", extra) for extra in [("tis",), ("mis",), ("m2po",), ("sat",), ("tis", "m2po", "sat")]])
def test_every_objective_and_chained_correction_reduces_to_grpo_gradient_on_policy(name, extra):
  """Each objective, and chained corrections (identities on-policy) after dapo."""
  logp, batch = make_batch(seed=2 if extra else 1)
  on_policy = batch.replace(behavior_logp=logp)
  _, grad = loss_and_grad(name, logp, on_policy, prox=logp, corrections=extra)
  np.testing.assert_allclose(grad, grpo_grad(logp, on_policy, REDUCTIONS[name]), rtol=1e-5,
                             atol=1e-7)
  assert np.abs(grad).sum() > 0


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
  _, metrics = losses.get_loss("vcpo")(logp, on_policy, settings=cfg(name="vcpo"))
  np.testing.assert_allclose(metrics["lr_scale"], 1.0, rtol=1e-6)


def _vcpo_reference_grad(logp, behav, mask, adv, cap, level):
  """VCPO's policy gradient from its definitions, NumPy float64: d loss / d logp for
  loss = seq_mean_token_mean(-sg(w) * A) with w = min(exp(sum_t m (logp - behav)), cap)
  per sequence (verl rollout_is="sequence") or min(exp(logp - behav), cap) per token."""
  logp, behav, mask, adv = (np.asarray(x, np.float64) for x in (logp, behav, mask, adv))
  if level == "sequence":
    w = np.minimum(np.exp(((logp - behav) * mask).sum(1)), cap)[:, None] * np.ones_like(logp)
  else:
    w = np.minimum(np.exp(logp - behav), cap)
  lengths = mask.sum(1, keepdims=True)
  rows = (lengths[:, 0] > 0).sum()
  return -w * adv * mask / np.maximum(lengths, 1) / rows


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_vcpo_truncates_one_weight_per_sequence_as_its_authors_do(level):
  """Stale rows whose sequence weight exceeds the cap 8 (while no single token's ratio
  does) and rows below it: the gradient equals the reference at the chosen level, and the
  two levels differ (the default is the sequence level)."""
  logp, batch = make_batch(seed=5)
  mask = np.asarray(batch.completion_mask, np.float32)
  # Every valid token's ratio is e^0.6 = 1.8 < 8 in rows 0-2; their sequence weights are
  # e^(0.6 n) > 8 for n >= 4 tokens. Rows 3-5: ratio e^-0.3.
  shift = np.where(np.arange(B)[:, None] < 3, 0.6, -0.3) * mask
  batch = batch.replace(behavior_logp=jnp.asarray(np.asarray(logp) - shift, jnp.float32))
  kw = {} if level == "sequence" else {"vcpo_is_level": "token"}
  fn = losses.get_loss("vcpo")
  # The baseline correction (tested on its own) sets the advantages the gradient multiplies.
  terms_adv = _vcpo_advantages(logp, batch)
  got = jax.grad(lambda lp: fn(lp, batch, settings=cfg(name="vcpo", **kw))[0])(logp)
  expected = _vcpo_reference_grad(logp, batch.behavior_logp, mask, terms_adv, 8.0, level)
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-7)
  assert (((shift * mask).sum(1) > np.log(8.0)) | (mask.sum(1) < 4)).any()
  other = _vcpo_reference_grad(logp, batch.behavior_logp, mask, terms_adv, 8.0,
                               "token" if level == "sequence" else "sequence")
  assert not np.allclose(expected, other, rtol=1e-3)


def _vcpo_advantages(logp, batch):
  """The per-token advantages VCPO's baseline correction gives this batch."""
  mask = batch.completion_mask.astype(jnp.float32)
  terms = corrections.TokenTerms(
      logp=logp, behav=batch.behavior_logp, prox=None, advantages=batch.advantages,
      mask=mask, weight=jnp.ones_like(logp), clip_scale=jnp.ones_like(logp),
      reward=batch.reward, group=batch.group)
  out, _ = corrections.vcpo_baseline()(terms)
  return np.asarray(out.advantages)


@pytest.mark.parametrize("name, field, value, message", [
    ("dapo", "eps_high", 0.35, "objective 'dapo' fixes eps_high = 0.28"),
    ("dapo", "aggregation", "seq_mean_token_sum_norm", "objective 'dapo' fixes aggregation"),
    ("m2po", "eps_high", 0.3, "objective 'm2po' .* never reads eps_high"),
    ("vcpo", "eps_low", 0.1, "objective 'vcpo' .* never reads eps_low"),
    ("mu_grpo", "eps_high", 0.3, "objective 'mu_grpo' .* never reads eps_high"),
    ("grpo", "m2_tau", 0.1, "objective 'grpo' .* never reads m2_tau"),
    ("grpo", "norm_len", 50.0, "never reads norm_len"),
    ("grpo", "prox_estimate", "loglinear", "never reads prox_estimate"),
    ("gspo", "eps_low", 0.2 + 1e-3, "objective 'gspo' fixes eps_low"),
    ("vcpo", "corrections", ("mu_veto",), "sequence-level ratios")])
def test_a_setting_the_objective_overrides_or_never_reads_is_refused(name, field, value, message):
  with pytest.raises(ValueError, match=message):
    losses.check(losses.LossSettings(name=name, **{field: value}))


@pytest.mark.parametrize("settings", [
    dict(name="grpo", eps_high=0.28, aggregation="token_mean"),
    dict(name="dapo", eps_high=0.28, aggregation="token_mean"),  # the values it fixes
    dict(name="grpo", corrections=("m2po",), m2_tau=0.1),
    dict(name="decoupled", prox_estimate="loglinear", is_cap=2.0),
    dict(name="drgrpo", norm_len=50.0),
    dict(name="vcpo", vcpo_is_cap=4.0, vcpo_rho_ref=0.5, vcpo_is_level="token"),
    dict(name="mu_grpo", mu_eps_low=0.3)])
def test_settings_the_objective_reads_are_accepted(settings):
  losses.check(losses.LossSettings(**settings))


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
    losses.get_loss("decoupled")(logp, batch, settings=cfg(name="decoupled"))
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
  _, metrics = fn(logp, batch, settings=cfg(name="m2po"))
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
    losses.get_loss("grpo")(logp, batch, settings=cfg(corrections=("nope",)))
  with pytest.raises(ValueError, match="prox_estimate"):
    cfg(prox_estimate="guess").check()


def test_registry_holds_typed_objectives_whose_overrides_define_the_method():
  assert {"grpo", "dapo", "drgrpo", "gspo", "gspo_token", "decoupled", "m2po", "sat",
          "vcpo", "mu_grpo", "sft"} <= set(losses.LOSSES)
  assert {"tis", "mis", "m2po", "sat", "vcpo_ess", "vcpo_baseline",
          "mu_veto"} <= set(corrections.CORRECTIONS)
  dapo = losses.resolve(cfg(name="dapo"))
  assert (dapo.eps_low, dapo.eps_high, dapo.aggregation) == (0.2, 0.28, "token_mean")
  grpo = losses.resolve(cfg(name="grpo"))
  assert (grpo.eps_low, grpo.eps_high, grpo.aggregation) == (0.2, 0.2, "seq_mean_token_mean")
  assert losses.LossSettings().m2_tau == 0.04
  decoupled = losses.get_loss("decoupled")
  assert isinstance(decoupled, losses.Objective)
  assert (decoupled.name, decoupled.corrections, decoupled.uses_prox) == (
      "decoupled", ("tis",), True)
  assert losses.get_loss("dapo").overrides == dict(eps_low=0.2, eps_high=0.28,
                                                   aggregation="token_mean")
  assert not isinstance(losses.get_loss("sft"), losses.Objective)  # a plain registered function
  assert losses.chain_of(cfg(name="sft")) == ()


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "decoupled", "m2po", "sat", "vcpo",
                                  "mu_grpo"])
def test_objectives_jit(name):
  logp, batch = make_batch(seed=9, behav_shift=0.5)
  fn = losses.get_loss(name)
  config = cfg(name=name)
  loss, _ = jax.jit(lambda lp, b, p: fn(lp, b, prox_logp=p, settings=config))(logp, batch, logp)
  assert np.isfinite(float(loss))


# --- Mu-GRPO: relaxed clipping and the negative-advantage veto -----------------------

MU_BAND = dict(eps_low=0.5, eps_high=1.0)  # LossSettings' mu_eps_low / mu_eps_high


def ratio_batch(ratios, adv, mask):
  """(logp, batch) whose token ratios exp(logp - behav) are `ratios` (behav = 0) [B, T]."""
  mask = np.asarray(mask, bool)
  b, t = mask.shape
  batch = Rollout(
      tokens=jnp.zeros((b, t), jnp.int32), prompt_mask=jnp.zeros((b, t), bool),
      completion_mask=jnp.asarray(mask), behavior_logp=jnp.zeros((b, t)),
      version=jnp.zeros((b, t), jnp.int32), group=jnp.zeros((b,), jnp.int32),
      reward=jnp.zeros((b,)), advantages=jnp.asarray(np.asarray(adv) * mask, jnp.float32))
  return jnp.log(jnp.asarray(ratios, jnp.float32)), batch


def mu_grpo_reference(logp, batch, eps_low, eps_high) -> float:
  """Slow NumPy Mu-GRPO: walk each row; from the first A < 0 token outside the band on,
  A < 0 tokens are skipped; the rest take PPO-clip; seq_mean_token_mean."""
  r = np.exp(np.asarray(logp, np.float64) - np.asarray(batch.behavior_logp, np.float64))
  adv, mask = np.asarray(batch.advantages), np.asarray(batch.completion_mask)
  row_losses = []
  for i in range(mask.shape[0]):
    total, triggered = 0.0, False
    for t in np.flatnonzero(mask[i]):
      a = adv[i, t]
      triggered |= a < 0 and not 1 - eps_low <= r[i, t] <= 1 + eps_high
      if not (triggered and a < 0):
        total -= min(r[i, t] * a, np.clip(r[i, t], 1 - eps_low, 1 + eps_high) * a)
    if mask[i].any():
      row_losses.append(total / mask[i].sum())
  return float(np.mean(row_losses))


def test_mu_grpo_hand_computed():
  """Interval [1/2, 2]. Row 0 (A = 1): 3 clips to 2, 1.5 and 0.4 count as they are (A > 0
  never clips below). Row 1 (A = -1): 2.5 > 2 triggers at t = 1; only t = 0 counts (1.5).
  Row 2 (A = -1): 0.3 < 1/2 triggers at t = 0, the whole row goes. Row 3: A = 0. The veto
  leaves the normalisers alone: (-(2 + 1.5 + 0.4) / 3 + 1.5 / 3 + 0 + 0) / 4 = -0.2."""
  logp, batch = ratio_batch([[3.0, 1.5, 0.4], [1.5, 2.5, 1.2], [0.3, 1.0, 1.0], [5.0, 0.1, 1.0]],
                            [[1.0], [-1.0], [-1.0], [0.0]],
                            [[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
  loss, metrics = losses.get_loss("mu_grpo")(logp, batch, settings=cfg(name="mu_grpo"))
  np.testing.assert_allclose(loss, -0.2, rtol=1e-6)
  np.testing.assert_allclose(metrics["vetoed_fraction"], 4 / 11, rtol=1e-6)
  np.testing.assert_allclose(metrics["vetoed_response_fraction"], 2 / 4, rtol=1e-6)
  _, grad = loss_and_grad("mu_grpo", logp, batch)
  np.testing.assert_allclose(grad, [[0.0, -1.5 / 12, -0.4 / 12], [1.5 / 12, 0, 0], [0, 0, 0],
                                    [0, 0, 0]], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("seed", range(3))
def test_mu_grpo_matches_slow_numpy_on_stale_batches(seed):
  logp, batch = make_batch(seed=20 + seed, behav_shift=0.8)
  loss, metrics = losses.get_loss("mu_grpo")(logp, batch, settings=cfg(name="mu_grpo"))
  assert 0 < metrics["vetoed_fraction"] < 1
  np.testing.assert_allclose(loss, mu_grpo_reference(logp, batch, **MU_BAND), rtol=1e-5)
  narrow = dict(mu_eps_low=0.1, mu_eps_high=0.15)  # the band is config.loss.mu_eps_*
  loss, _ = losses.get_loss("mu_grpo")(logp, batch, settings=cfg(name="mu_grpo", **narrow))
  np.testing.assert_allclose(loss, mu_grpo_reference(logp, batch, 0.1, 0.15), rtol=1e-5)


def test_mu_grpo_leaves_rows_with_nonnegative_advantage_alone():
  """Rows with A >= 0 get grpo's gradient with the relaxed eps, however stale."""
  logp, batch = make_batch(seed=23, behav_shift=1.5)
  _, grad = loss_and_grad("mu_grpo", logp, batch)
  _, want = loss_and_grad("grpo", logp, batch, **MU_BAND)
  rows = np.asarray(batch.advantages).min(axis=1) >= 0
  assert rows.any() and np.abs(grad[rows]).sum() > 0
  np.testing.assert_array_equal(grad[rows], want[rows])
  assert np.any(grad[~rows] != want[~rows])  # the veto acted on the others


def test_mu_grpo_vetoed_suffix_gets_exactly_zero_gradient():
  logp, batch = make_batch(seed=20, behav_shift=0.8)
  _, grad = loss_and_grad("mu_grpo", logp, batch)
  d = np.asarray(logp - batch.behavior_logp) * np.asarray(batch.completion_mask)
  keep = np.asarray(corrections.veto_keep(jnp.asarray(d), batch.advantages,
                                          batch.completion_mask, **MU_BAND))
  assert (keep == 0).any()
  assert np.all(grad[keep == 0] == 0)
  # One row: the prefix before the trigger (ratio 3 at t = 2) keeps its gradient.
  logp, batch = ratio_batch([[1.1, 0.9, 3.0, 1.0, 1.2]], [[-1.0]], np.ones((1, 5)))
  _, grad = loss_and_grad("mu_grpo", logp, batch)
  np.testing.assert_allclose(grad, [[1.1 / 5, 0.9 / 5, 0, 0, 0]], rtol=1e-6)


@pytest.mark.parametrize("behav_shift", [0.0, 0.05])  # on-policy; stale inside the interval
def test_mu_grpo_is_grpo_when_nothing_triggers(behav_shift):
  logp, batch = make_batch(seed=25, behav_shift=behav_shift)
  eps = dict(eps_low=0.2, eps_high=0.28)
  got = loss_and_grad("mu_grpo", logp, batch, mu_eps_low=0.2, mu_eps_high=0.28)
  want = loss_and_grad("grpo", logp, batch, **eps)
  _, metrics = losses.get_loss("mu_grpo")(logp, batch, settings=cfg(
      name="mu_grpo", mu_eps_low=0.2, mu_eps_high=0.28))
  assert metrics["vetoed_fraction"] == 0
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-9)
  assert np.abs(got[1]).sum() > 0


def test_mu_grpo_with_empty_masks():
  logp, batch = make_batch(seed=26, behav_shift=0.8)
  empty = batch.replace(completion_mask=jnp.zeros_like(batch.completion_mask),
                        advantages=jnp.zeros_like(batch.advantages))
  loss, metrics = losses.get_loss("mu_grpo")(logp, empty, settings=cfg(name="mu_grpo"))
  assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in metrics.values())
  _, grad = loss_and_grad("mu_grpo", logp, empty)
  assert np.all(grad == 0)


def test_mu_grpo_is_finite_at_extreme_log_ratios():
  """Rows with A < 0 at log-ratios +-1e4 (exp overflows): vetoed, so loss and gradient stay
  finite where grpo's loss is inf. Rows with A > 0 at +-60: clipped or ~0. (At a log-ratio
  past float32's exp range, 88, a clipped A > 0 token's gradient is 0 * inf = NaN in grpo
  and here alike; the train step skips such an update.)"""
  logp, batch = ratio_batch(np.ones((4, 3)), [[-1.0], [-1.0], [1.0], [1.0]], np.ones((4, 3)))
  logp = jnp.asarray([[0.1, 1e4, -1e4], [-1e4, 0.0, 1e4], [60.0, -60.0, 0.0], [-60.0, 60.0, 0.2]])
  loss, metrics = losses.get_loss("mu_grpo")(logp, batch, settings=cfg(name="mu_grpo"))
  _, grad = loss_and_grad("mu_grpo", logp, batch)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
  # approx_kl_behavior measures the batch as sampled: inf here, as the data is.
  assert all(np.isfinite(float(v)) for k, v in metrics.items() if k != "approx_kl_behavior")
  np.testing.assert_allclose(metrics["vetoed_fraction"], 5 / 12, rtol=1e-6)
  assert not np.isfinite(loss_and_grad("grpo", logp, batch)[0])
