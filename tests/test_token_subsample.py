"""Tests for rl.objectives.token_subsample (NAT): inclusion probabilities against draws, the
Horvitz-Thompson estimate against a hand-written one, the shorter batch of a prefix cut, and
the launcher. That every objective's expected gradient under each scheme is the full-token
gradient, exactly (every subset urs can keep, every cut rpc can make), is
tests/test_combinations.py's check."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train as launcher
from rl import train
from rl.objectives import losses
from rl.objectives import token_subsample as ts
from rl.types import Rollout
from tests.launcher_config import rl_steps, tiny_run_config
from tests import tiny

PROMPT = 3


def _mask(lengths, slots=40):
  """Completion mask of rows with these completion lengths after PROMPT prompt slots."""
  mask = np.zeros((len(lengths), slots), bool)
  for row, n in enumerate(lengths):
    mask[row, PROMPT:PROMPT + n] = True
  return mask


def _batch(mask, seed=0):
  """A rollout on `mask` with random tokens, behaviour log-probs and per-row advantages of
  both signs (fractional), groups of two rows."""
  rng = np.random.default_rng(seed)
  rows, slots = mask.shape
  prompt = np.zeros_like(mask)
  prompt[:, :PROMPT] = True
  adv = rng.normal(size=(rows, 1)) * mask
  return Rollout(tokens=jnp.asarray(rng.integers(3, 50, mask.shape), jnp.int32),
                 prompt_mask=jnp.asarray(prompt), completion_mask=jnp.asarray(mask),
                 behavior_logp=jnp.asarray(-rng.uniform(0.5, 3.0, mask.shape) * mask,
                                           jnp.float32),
                 version=jnp.zeros(mask.shape, jnp.int32),
                 group=jnp.asarray(np.arange(rows) // 2, jnp.int32),
                 reward=jnp.asarray(rng.random(rows), jnp.float32),
                 advantages=jnp.asarray(adv, jnp.float32))


@pytest.mark.parametrize("scheme,keep", [("urs", 0.25), ("urs", 0.5), ("rpc", 0.25),
                                         ("rpc", 0.5), ("rpc", 1.0)])
def test_inclusion_probabilities_are_the_draws_frequencies(scheme, keep):
  mask = _mask([1, 5, 17, 30])
  pi = ts.inclusion_probabilities(mask, scheme, keep)
  rng = np.random.default_rng(0)
  draws = 20000
  shape = mask.shape if scheme == "urs" else (1,)
  frequency = sum(ts.draw_kept(mask, scheme, keep, 1.0 - rng.random(shape))
                  for _ in range(draws)) / draws
  # Binomial standard error <= 0.5 / sqrt(20000) = 0.0035: 5 sigma.
  np.testing.assert_allclose(frequency, pi, atol=0.018)
  assert not pi[~mask].any()
  if scheme == "rpc":  # the first token is always kept, later ones ever less often
    assert (pi[mask.any(axis=1), PROMPT] == 1.0).all()
    row = pi[3, PROMPT:PROMPT + 30]
    assert (np.diff(row) <= 0).all() and (row > 0).all()
    # The kept share is `keep` on long rows (the integral), more on short ones.
    assert abs(row.mean() - keep) < 0.05


def test_rpc_keeps_a_prefix_and_one_cut_shortens_every_row():
  mask = _mask([4, 10, 20])
  kept = ts.draw_kept(mask, "rpc", 0.5, np.array([0.5]))  # u^1 = 0.5: ceil(n / 2)
  assert kept.sum(axis=1).tolist() == [2, 5, 10]
  assert (kept == (mask & (ts.completion_positions(mask) <= [[2], [5], [10]]))).all()


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean",
                                         "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("scheme", ["urs", "rpc"])
def test_weighted_loss_on_the_kept_tokens_is_the_horvitz_thompson_estimate(scheme, aggregation):
  """aggregate(w l, kept) equals sum over kept tokens of l / pi under the full mask's
  denominators, written out per aggregation, in each of two minibatches; rows may lose
  every token (urs at keep 0.2)."""
  mask = _mask([1, 2, 7, 12, 0, 30])
  rng = np.random.default_rng(1)
  per_token = rng.normal(size=mask.shape)
  pi = ts.inclusion_probabilities(mask, scheme, 0.2)
  for trial in range(20):
    shape = mask.shape if scheme == "urs" else (1,)
    kept = ts.draw_kept(mask, scheme, 0.2, 1.0 - rng.random(shape))
    w = ts.horvitz_thompson_weights(mask, kept, pi, aggregation, num_minibatches=2)
    for block in (slice(0, 3), slice(3, 6)):
      m, s, l, p = mask[block], kept[block], per_token[block], pi[block]
      ht = np.where(s, l / np.where(s, p, 1.0), 0.0)
      if aggregation == "token_mean":
        expected = ht.sum() / m.sum()
      elif aggregation == "seq_mean_token_mean":
        full_rows = m.any(axis=1)
        expected = (ht.sum(axis=1)[full_rows] / m.sum(axis=1)[full_rows]).mean()
      else:
        expected = (ht.sum(axis=1) / 7.0).mean()
      got = losses.aggregate(jnp.asarray(w[block] * l, jnp.float32), jnp.asarray(s),
                             aggregation, 7.0)
      np.testing.assert_allclose(float(got), expected, rtol=1e-5, atol=1e-6,
                                 err_msg=f"trial {trial}")


@pytest.mark.parametrize("scheme", ["urs", "rpc"])
def test_kept_tokens_have_the_full_batchs_log_probs(scheme):
  """Subsampling changes which tokens train, never what a kept token is conditioned on:
  under urs the dropped tokens stay context (prompt mask), under rpc only tokens after
  every kept one leave; the policy's log-probs at the kept tokens equal the full batch's."""
  from models import transformer  # pylint: disable=import-outside-toplevel
  from rl.objectives import composite  # pylint: disable=import-outside-toplevel
  config = tiny.model(vocab_size=50, max_seq_len=64)
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  batch = _batch(_mask([3, 12, 20, 30]))
  sub, _ = ts.TokenSubsample(scheme, 0.5, "token_mean")(batch, jax.random.PRNGKey(4))
  kept = np.asarray(sub.completion_mask)
  assert 0 < kept.sum() < np.asarray(batch.completion_mask).sum()
  full_logp = np.asarray(composite.policy_logprobs(params, batch, config))
  sub_logp = np.asarray(composite.policy_logprobs(params, sub, config))
  np.testing.assert_allclose(sub_logp[kept], full_logp[kept], rtol=1e-5, atol=1e-5)
  if scheme == "urs":
    np.testing.assert_array_equal(np.asarray(sub.token_mask), np.asarray(batch.token_mask))


def test_rpc_masks_the_slots_after_the_cut_and_the_batch_gets_shorter():
  mask = _mask([10, 20, 30], slots=40)
  batch = _batch(mask)
  stage = ts.TokenSubsample("rpc", 0.25, "seq_mean_token_mean")
  lengths = []
  for i in range(40):
    sub, metrics = stage(batch, jax.random.PRNGKey(i))
    token_mask = np.asarray(sub.token_mask)
    last = np.where(token_mask, np.arange(40), -1).max(axis=1)
    kept = np.asarray(sub.completion_mask)
    assert (last == np.where(kept, np.arange(40), -1).max(axis=1)).all()
    assert metrics["token_subsample_kept_fraction"] == kept.sum() / mask.sum()
    trimmed = train.trim_to_bucket(sub, [8, 16, 24, 32, 40])
    lengths.append(trimmed.tokens.shape[1])
  assert np.mean(lengths) < 0.6 * 40 and max(lengths) <= 40



@pytest.mark.parametrize("kind,scheme", [
    ("independent", "urs"), ("independent", "rpc"),
    pytest.param("tree", "rpc", marks=pytest.mark.slow),
    pytest.param("partial", "rpc", marks=pytest.mark.slow)])
def test_token_subsample_through_the_launcher_trains_on_fewer_tokens(tmp_path, kind, scheme):
  """The same run with and without NAT: the first batch is the same (NAT draws from its own
  key stream), fewer of its tokens are trained, and the kept share is reported."""
  launcher.run(tiny_run_config(tmp_path / "full", {"rollout.kind": kind}))
  launcher.run(tiny_run_config(tmp_path / scheme, {
      "rollout.kind": kind, "loss.token_subsample": scheme, "loss.token_keep": 0.25}))
  full, nat = rl_steps(tmp_path / "full"), rl_steps(tmp_path / scheme)
  assert "token_subsample_kept_fraction" not in full[0]
  assert full[0]["sampled_tokens"] == nat[0]["sampled_tokens"]
  assert nat[0]["token_subsample_kept_fraction"] == pytest.approx(
      nat[0]["trained_tokens"] / full[0]["trained_tokens"])
  assert all(0 < s["token_subsample_kept_fraction"] <= 1 for s in nat)
  if scheme == "urs":  # every one of the ~30 tokens kept has probability 0.25**30
    assert nat[0]["trained_tokens"] < full[0]["trained_tokens"]
  # (A prefix cut of these 3-5 token answers keeps whole rows with probability ~0.1 per
  # step: u^3 > (n - 1) / n; the cut itself is tested above.)


@pytest.mark.parametrize("overrides,message", [
    ({"loss.token_keep": 0.3}, r"config.loss.token_keep = 0.3: objective 'grpo'.*never reads"),
    ({"loss.token_subsample": "rpc", "loss.token_keep": 0.0},
     r"config.loss.token_keep = 0.0 must be > 0"),
    ({"loss.token_subsample": "first_half"}, r"config.loss.token_subsample = 'first_half'"),
    ({"loss.token_subsample": "urs", "loss.name": "gspo"},
     r"token_subsample = 'urs' with config.loss.name = 'gspo'"),
    ({"loss.token_subsample": "rpc", "distill.teacher": "somewhere", "distill.coef": 1.0},
     r"config.distill.teacher needs that every sampled completion token is trained, and "
     r"config.loss.token_subsample = 'rpc' does not keep that"),
    ({"loss.token_subsample": "urs", "rl.prefix_shared_forward": True},
     r"config.rl.prefix_shared_forward needs that a row's context before its completion is its "
     r"prompt alone, and config.loss.token_subsample = 'urs' does not keep that"),
])
def test_token_subsample_refusals(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    launcher.run(tiny_run_config(tmp_path / "run", overrides))
  assert not (tmp_path / "run").exists()
