"""Score centering (rl.objectives.corrections.score_centering) against a slow NumPy
reference over the whole vocabulary, its sampler record (rl.rollouts.sampler_topk), and
the correction through the launcher."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train as launcher
from models import transformer
from rl.objectives import corrections
from rl.rollouts import sampler_topk
from sampling import sampler
from tests.launcher_config import rl_steps, tiny_run_config
from tests import tiny


def _softmax(z):
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def numpy_expected_score(z, q, head, tis_cap, eps):
  """Per token [B, T, V]: the expected score E_{v ~ q^}[w^(v) grad_z log p(v)] over the
  whole vocabulary, term by term from the definition (no head-only identity): q^(v) = q(v)
  on the head, rho p(v) off it; w^(v) = f(p(v) / q^(v)), f = 1 or min(., tis_cap)."""
  z = z.astype(np.float64)
  p = _softmax(z)
  out = np.zeros_like(p)
  vocab = p.shape[-1]
  for index in np.ndindex(*p.shape[:-1]):
    pt, qt, h = p[index], q[index].astype(np.float64), head[index]
    in_head = np.zeros(vocab, bool)
    in_head[h] = True
    rho = np.clip(1 - qt[in_head].sum(), 0, 1) / max(1 - pt[in_head].sum(), eps)
    q_hat = np.where(in_head, qt, rho * pt)
    f = (lambda r: 1.0) if tis_cap is None else (lambda r: min(r, tis_cap))
    for v in range(vocab):
      if q_hat[v] == 0:
        continue
      score = -pt.copy()
      score[v] += 1.0  # grad_z log p(v) = e_v - p
      out[index] += q_hat[v] * f(pt[v] / q_hat[v]) * score
  return out


def _terms(z, q_logp, head, adv, mask, tis_cap):
  logp_all = jax.nn.log_softmax(z, axis=-1)
  head_logp = jnp.take_along_axis(logp_all, head, axis=-1)
  behav_head = jnp.take_along_axis(q_logp, head, axis=-1)
  ones = jnp.ones(adv.shape)
  return corrections.TokenTerms(
      logp=ones, behav=ones, prox=None, advantages=adv, mask=mask, weight=ones,
      clip_scale=ones, reward=jnp.zeros(adv.shape[0]), group=jnp.zeros(adv.shape[0], jnp.int32),
      head_logp=head_logp, behav_head=behav_head, tis_cap=tis_cap)


def _case(shape, vocab, k, seed, spread=1.0):
  rng = np.random.default_rng(seed)
  z = rng.normal(0, 1.5, shape + (vocab,)).astype(np.float32)
  sampler_logits = z + spread * rng.normal(0, 1, z.shape).astype(np.float32)
  q_logp = np.asarray(jax.nn.log_softmax(jnp.asarray(sampler_logits), axis=-1))
  head = np.argsort(-q_logp, axis=-1)[..., :k].astype(np.int32)
  adv = rng.normal(0, 1, shape).astype(np.float32)
  mask = np.ones(shape, np.float32)
  mask[0, shape[1] // 2:] = 0  # a padded tail
  if shape[0] > 2:
    mask[-1] = 0  # a row with no token at all
  return z, q_logp, head, adv, mask


@pytest.mark.parametrize("tis_cap", [None, 2.0], ids=["standalone", "tis"])
@pytest.mark.parametrize("shape,vocab,k", [
    ((3, 5), 11, 4), pytest.param((3, 5), 11, 11, marks=pytest.mark.slow),
    pytest.param((2, 1024), 64, 16, marks=pytest.mark.slow)],
    ids=["head", "whole-vocabulary", "thousands-of-tokens"])
def test_score_centering_gradient_equals_the_full_vocabulary_reference(tis_cap, shape, vocab,
                                                                       k):
  """The head-only surrogate's gradient with respect to the logits equals, token by token,
  A times the full-vocabulary expected score of the reference (the loss adds the term, so
  the update, the negated loss gradient, subtracts it); padded tokens and an empty row get
  exactly zero."""
  z, q_logp, head, adv, mask = _case(shape, vocab, k, seed=k + vocab)
  apply = corrections.score_centering(eps=1e-6)

  def extra_sum(logits):
    terms, _ = apply(_terms(logits, jnp.asarray(q_logp), jnp.asarray(head), jnp.asarray(adv),
                            jnp.asarray(mask), tis_cap))
    return terms.extra.sum()

  grad = np.asarray(jax.grad(extra_sum)(jnp.asarray(z)))
  expected = (adv * mask)[..., None] * numpy_expected_score(z, np.exp(q_logp), head, tis_cap,
                                                            1e-6)
  np.testing.assert_allclose(grad, expected, atol=2e-5, rtol=1e-4)
  assert np.all(grad[mask == 0] == 0.0)


def test_score_centering_values_equal_a_hand_computation():
  """One token, vocabulary 3, head {0, 1}: p = (0.5, 0.3, 0.2), q = (0.6, 0.1, 0.3).
  Standalone: rho = (1 - 0.7) / (1 - 0.8) = 1.5, c = q - rho p = (-0.15, -0.35); with TIS
  cap 2: q w = min(p, 2q) = (0.5, 0.2), alpha = min(1, 2 rho) = 1, c = (0, -0.1). The
  term is A sum c_v log p_v."""
  p, q = np.array([0.5, 0.3, 0.2]), np.array([0.6, 0.1, 0.3])
  head = jnp.array([[[0, 1]]], jnp.int32)
  adv = jnp.array([[2.0]])
  for tis_cap, coef in ((None, [-0.15, -0.35]), (2.0, [0.0, -0.1])):
    terms = _terms(jnp.log(jnp.asarray(p))[None, None], jnp.log(jnp.asarray(q))[None, None],
                   head, adv, jnp.ones((1, 1)), tis_cap)
    out, metrics = corrections.score_centering()(terms)
    expected = 2.0 * (coef[0] * np.log(0.5) + coef[1] * np.log(0.3))
    np.testing.assert_allclose(float(out.extra[0, 0]), expected, rtol=1e-5)
    # The expected score's L1 norm over the logits: sum_H |c_v - C p_v| + |C| (1 - 0.8).
    total = sum(coef)
    shift = abs(coef[0] - total * 0.5) + abs(coef[1] - total * 0.3) + abs(total) * 0.2
    np.testing.assert_allclose(float(metrics["sc_score_shift"]), shift, rtol=1e-5)


@pytest.mark.parametrize("k", [4, 11])
def test_on_policy_the_correction_changes_nothing(k):
  """q = p: the expected score is E_p[grad log p] = 0, so the gradient of the term and its
  reported shift vanish whether the head is part of the vocabulary or all of it."""
  z, _, _, adv, mask = _case((3, 6), 11, k, seed=3)
  q_logp = np.asarray(jax.nn.log_softmax(jnp.asarray(z), axis=-1))
  head = np.argsort(-q_logp, axis=-1)[..., :k].astype(np.int32)
  apply = corrections.score_centering()
  run = lambda logits: apply(_terms(logits, jnp.asarray(q_logp), jnp.asarray(head),
                                    jnp.asarray(adv), jnp.asarray(mask), None))
  grad = jax.grad(lambda logits: run(logits)[0].extra.sum())(jnp.asarray(z))
  assert np.abs(np.asarray(grad)).max() < 1e-5
  assert float(run(jnp.asarray(z))[1]["sc_score_shift"]) < 1e-5


def test_extreme_log_ratios_and_truncated_tokens_stay_finite():
  """A sampler 30 nats away from the trainer, head tokens the sampler's truncation removed
  (log q = -inf) and a trainer tail below eps: finite values and gradients."""
  z, q_logp, head, adv, mask = _case((2, 8), 11, 5, seed=5, spread=30.0)
  q_logp = q_logp.copy()
  q_logp[..., head[0, 0, -1]] = -np.inf
  z[1, 3] = 0.0
  z[1, 3, head[1, 3, 0]] = 60.0  # the trainer's tail mass underflows to 0
  for tis_cap in (None, 5.0):
    grad_fn = jax.value_and_grad(lambda logits: corrections.score_centering()(_terms(
        logits, jnp.asarray(q_logp), jnp.asarray(head), jnp.asarray(adv), jnp.asarray(mask),
        tis_cap))[0].extra.sum())
    value, grad = grad_fn(jnp.asarray(z))
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))


def test_chains_that_do_not_compose_are_refused():
  """Corrections that take tokens out of the update, 'tis' after it, and objectives whose
  sampled token carries another weight (a sequence ratio, an IS ratio to the sampler)."""
  from rl.objectives import losses  # pylint: disable=import-outside-toplevel
  for masking in ("mis", "m2po", "mu_veto"):
    with pytest.raises(ValueError, match=f"{masking!r} .* takes some tokens out of the update"):
      corrections.check_chain((masking, "score_centering"))
  with pytest.raises(ValueError, match="put 'tis' before 'score_centering'"):
    corrections.check_chain(("score_centering", "tis"))
  for name, weight in (("gspo", "a sequence's ratio"), ("vcpo", "a sequence's ratio"),
                       ("m2po", "its IS ratio to the sampler")):
    with pytest.raises(ValueError, match=f"'{name}' weights the sampled token by {weight}"):
      corrections.check_chain(("score_centering",), losses.get_loss(name))
  for name in ("grpo", "dapo", "drgrpo", "decoupled", "sat"):
    objective = losses.get_loss(name)
    with_tis = ("tis",) if "tis" not in objective.corrections else ()
    corrections.check_chain(objective.corrections + with_tis + ("score_centering",), objective)
    corrections.check_chain(objective.corrections + ("score_centering",), objective)


def test_the_correction_needs_the_record():
  z, q_logp, head, adv, mask = _case((2, 4), 11, 3, seed=1)
  terms = _terms(jnp.asarray(z), jnp.asarray(q_logp), jnp.asarray(head), jnp.asarray(adv),
                 jnp.asarray(mask), None).replace(behav_head=None)
  with pytest.raises(ValueError, match="Rollout.behavior_topk"):
    corrections.score_centering()(terms)


# --- The sampler's record --------------------------------------------------------------

CONFIG = tiny.MODEL


@pytest.mark.parametrize("top_p", [pytest.param(1.0, marks=pytest.mark.slow), 0.8])
def test_the_record_holds_the_distribution_that_drew_each_token(top_p):
  """At every completion slot the record's log-prob of the drawn token equals the
  sampler's behaviour log-prob (decode steps against one forward: float32 rounding), its
  K entries are the K largest in descending order, and with top-p the tokens the nucleus
  removed have -inf."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  prompts = jax.random.randint(jax.random.PRNGKey(1), (4, 5), 0, CONFIG.vocab_size)
  sampling = sampler.SamplingConfig(max_new_tokens=6, temperature=0.7, top_p=top_p)
  gen = sampler.generate(params, prompts, jnp.ones((4, 5), bool), jax.random.PRNGKey(2),
                         CONFIG, sampling)
  record = sampler_topk.sampler_topk(params, gen.tokens, gen.prompt_mask | gen.completion_mask,
                                     CONFIG, CONFIG.vocab_size, 0.7, 0, top_p)
  completion = np.asarray(gen.completion_mask)
  ids, logp = np.asarray(record.ids), np.asarray(record.logp)
  drawn = np.asarray(gen.tokens)
  at_drawn = np.take_along_axis(logp, np.argsort(ids, axis=-1), axis=-1)  # by token id
  picked = np.take_along_axis(at_drawn, drawn[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(picked[completion], np.asarray(gen.behavior_logp)[completion],
                             atol=2e-5)
  assert np.all(logp[completion][:, :-1] >= logp[completion][:, 1:])  # -inf last
  kept = np.isfinite(logp[completion])
  np.testing.assert_allclose(np.exp(np.where(kept, logp[completion], -np.inf)).sum(axis=-1),
                             1.0, rtol=1e-5)
  assert kept.all() if top_p == 1.0 else not kept.all()


# --- Through the launcher ---------------------------------------------------------------



def test_quantized_rollouts_and_score_centering_through_the_launcher(tmp_path):
  """--config.rollout.weights=int4 --config.loss.corrections="('score_centering',)" in one
  run: the fresh tokens' mismatch and the expected score subtracted are far above float32
  rounding (a float32 run of this config: mismatch 1e-14, shift 1e-7; the comparisons with
  a float32 run are the slow tier's)."""
  launcher.run(tiny_run_config(tmp_path, {"rollout.weights": "int4",
                                          "loss.corrections": ("score_centering",)}))
  records = rl_steps(tmp_path)
  assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
  assert records[0]["rollout_train_mismatch_kl"] > 1e-7
  assert records[0]["sc_score_shift"] > 1e-5
  assert json.loads((tmp_path / "config.json").read_text())["rollout"]["weights"] == "int4"


@pytest.mark.slow
def test_score_centering_through_the_launcher_sees_the_quantised_samplers_drift(tmp_path):
  """--config.loss.corrections="('score_centering',)": with float32 rollouts the expected
  score it subtracts is ~0 (on-policy), with int4 rollouts it is not. (After 'tis' it
  would be ~0 here too: E_q[(p / q) grad log p] = E_p[grad log p] = 0 wherever the
  truncation does not bind.)"""
  shifts = {}
  for weights in ("", "int4"):
    workdir = tmp_path / (weights or "float")
    launcher.run(tiny_run_config(workdir, {"rollout.weights": weights,
                                           "loss.corrections": ("score_centering",)}))
    records = rl_steps(workdir)
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    shifts[weights] = records[0]["sc_score_shift"]
  assert shifts[""] < 1e-4 and shifts["int4"] > 10 * max(shifts[""], 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"rollout.kind": "tree"}, {"rollout.kind": "pruned"}, {"rollout.speculative.tokens": 3},
    {"rl.async_": True, "rl.max_staleness": 1}, {"rl.staleness": 1},
    {"model.preset": "tiny2_moe", "moe.routing_replay": True}],
    ids=["tree", "pruned", "speculative", "async", "staleness", "moe-replay"])
def test_score_centering_with_every_rollout_kind_it_composes_with(tmp_path, overrides):
  """Each rollout kind's batches carry the record of the parameters that sampled them:
  int4 rollouts leave a drift for the correction to remove at the first step."""
  launcher.run(tiny_run_config(tmp_path, {"rollout.weights": "int4",
                                          "loss.corrections": ("score_centering",),
                                          **overrides}))
  records = rl_steps(tmp_path)
  assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
  assert records[0]["sc_score_shift"] > 1e-5


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.kind": "partial"}, "rollout.kind = 'partial'"),
    ({"rl.logprob_chunk": 4}, "logprob_chunk"),
    ({"selection.kind": "ar3po", "task.train_pool": 64},
     "needs that every row was sampled by the parameters that produced the batch, and "
     "config.selection.kind = 'ar3po' does not keep that"),
    ({"loss.corrections": ("mis", "score_centering")}, "'mis'"),
    ({"loss.sc_top_k": 8, "loss.corrections": ("tis",)}, "never reads sc_top_k"),
])
def test_the_launcher_refuses_what_does_not_compose(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    launcher.run(tiny_run_config(tmp_path, {"loss.corrections": ("score_centering",),
                                            **overrides}))
