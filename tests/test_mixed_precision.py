"""Mixed precision (model.compute_dtype = 'bfloat16' over float32 parameters) and the
sampler-trainer mismatch metric (`rollout_train_mismatch_kl`)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.decode_cost import kv_bytes_per_token
from models import transformer
from rl import train
from rl.objectives import composite
from rl.types import Rollout
from sampling import sampler
from sampling.sampler import SamplingConfig
from tests.rl_fixtures import GRPO, random_rollout
from tests import tiny

F32 = tiny.MODEL
MIXED = F32.replace(compute_dtype="bfloat16")
BF16 = F32.replace(dtype="bfloat16")  # weights stored in bfloat16 too: the reference
PARAMS = transformer.init_params(F32, jax.random.PRNGKey(0))


def _grad(params, config, batch):
  return jax.grad(lambda p: (composite.policy_logprobs(p, batch, config) * batch.advantages).sum())(
      params)


@pytest.mark.slow
def test_mixed_gradients_are_the_bfloat16_models_in_float32():
  """The gradient of the mixed forward is the gradient of the same model with bfloat16
  weights (exactly for every matrix, whose cast is the only difference), returned in
  float32 for the float32 master weights; and within bfloat16 rounding of the float32
  model's gradient."""
  batch = random_rollout(seed=2, batch=4, length=12)
  mixed = _grad(PARAMS, MIXED, batch)
  reference = _grad(jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS), BF16, batch)
  full = _grad(PARAMS, F32, batch)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(mixed))
  for name in ("q", "k", "v", "o", "gate", "up", "down"):
    np.testing.assert_array_equal(np.asarray(mixed["layers"][name]),
                                  np.asarray(reference["layers"][name], np.float32))
  # The embedding's reference gradient is itself rounded to bfloat16 (relative 2^-8).
  np.testing.assert_allclose(mixed["embed"], np.asarray(reference["embed"], np.float32),
                             rtol=2 ** -7, atol=1e-3)
  for m, f in zip(jax.tree.leaves(mixed), jax.tree.leaves(full)):
    assert np.abs(np.asarray(m) - np.asarray(f)).max() <= 0.03 * np.abs(np.asarray(f)).max()
  assert any(np.abs(np.asarray(m) - np.asarray(f)).max() > 1e-5
             for m, f in zip(jax.tree.leaves(mixed), jax.tree.leaves(full)))  # bf16 did run


def test_compute_params_casts_weights_but_not_norm_scales():
  cast = transformer.compute_params(PARAMS, MIXED)
  assert cast["embed"].dtype == cast["layers"]["q"].dtype == jnp.bfloat16
  assert cast["final_norm"].dtype == cast["layers"]["attn_norm"].dtype == jnp.float32
  assert transformer.compute_params(PARAMS, F32) is PARAMS


@pytest.mark.slow
def test_mixed_step_keeps_float32_masters_and_moments_and_trains():
  optimizer = train.make_optimizer(1e-2)
  step = train.make_train_step(MIXED, optimizer, GRPO)
  batch = random_rollout(seed=1, batch=4, length=12)
  batch = batch.replace(advantages=jnp.abs(batch.advantages))  # A > 0: ratios < 1 not clipped
  state, metrics = step(train.init_train_state(jax.tree.map(jnp.copy, PARAMS), optimizer), batch)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.params))
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.opt_state)
             if jnp.issubdtype(leaf.dtype, jnp.floating))
  assert not np.array_equal(np.asarray(state.params["layers"]["q"]),
                            np.asarray(PARAMS["layers"]["q"]))


def _sampled(config, rows=16, new_tokens=12):
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 51, (rows, 4)), jnp.int32)
  generation = sampler.generate(PARAMS, prompts, jnp.ones_like(prompts, bool),
                                jax.random.PRNGKey(1), config,
                                SamplingConfig(max_new_tokens=new_tokens, temperature=1.0))
  return Rollout(tokens=generation.tokens, prompt_mask=generation.prompt_mask,
                 completion_mask=generation.completion_mask,
                 behavior_logp=generation.behavior_logp, version=generation.version,
                 group=jnp.arange(rows) // 4, reward=jnp.zeros((rows,)),
                 advantages=generation.completion_mask.astype(jnp.float32))


def _largest_gap(batch, config):
  recomputed = composite.policy_logprobs(PARAMS, batch, config)
  return float(jnp.abs((recomputed - batch.behavior_logp) * batch.completion_mask).max())


@pytest.mark.slow
def test_the_sampler_runs_and_records_in_the_compute_dtype():
  """A bfloat16-compute sampler keeps a bfloat16 KV cache and bfloat16 layer copies, and
  its behaviour log-probs are what it computed: a bfloat16 forward's (to bfloat16
  rounding), not a float32 recomputation, which they miss by more than float32 rounding."""
  state = sampler.prefill(PARAMS, jnp.ones((2, 4), jnp.int32), jnp.ones((2, 4), bool),
                          jax.random.PRNGKey(0), MIXED, SamplingConfig(max_new_tokens=4))
  assert state.cache["k"].dtype == jnp.bfloat16
  decode_params = transformer.unstack_layers(PARAMS, MIXED, 8)
  assert decode_params["layers"][0]["qkv"].dtype == jnp.bfloat16
  assert kv_bytes_per_token(MIXED) * 2 == kv_bytes_per_token(F32)
  mixed, full = _sampled(MIXED), _sampled(F32)
  assert _largest_gap(full, F32) < 1e-5
  assert _largest_gap(mixed, MIXED) < 1e-2
  assert _largest_gap(mixed, F32) > 10 * _largest_gap(full, F32)


def test_mismatch_terms_count_only_fresh_tokens_at_the_first_update():
  """By hand: the k3 estimator exp(d) - 1 - d on completion tokens of the trained version,
  none from a stale version, none at a later update of the same batch."""
  d = np.array([[0.0, 0.05, -0.2, 0.3], [0.0, 0.5, 0.5, -1.0]], np.float32)
  completion = np.array([[0, 1, 1, 1], [0, 1, 1, 0]], bool)
  version = np.array([[-1, 3, 3, 2], [-1, 3, 3, -1]], np.int32)  # one stale token (v2)
  behav = np.full(d.shape, -2.0, np.float32) * completion
  batch = Rollout(tokens=jnp.zeros(d.shape, jnp.int32), prompt_mask=jnp.asarray(~completion),
                  completion_mask=jnp.asarray(completion), behavior_logp=jnp.asarray(behav),
                  version=jnp.asarray(version), group=jnp.zeros((2,), jnp.int32),
                  reward=jnp.zeros((2,)))
  logp = jnp.asarray(behav + d)
  fresh_d = np.array([0.05, -0.2, 0.5, 0.5])
  expected = np.mean(np.exp(fresh_d) - 1 - fresh_d)
  terms = composite.with_mismatch_kl(composite.mismatch_terms(logp, batch, version=3,
                                                              prox_version=3))
  np.testing.assert_allclose(float(terms["rollout_train_mismatch_kl"]), expected, rtol=1e-5)
  # k1 = mean(-d); |d| > 0.1: -0.2, 0.5, 0.5 (not 0.05); |d| > 1: none
  # (the -1.0 is a prompt slot's); the largest |d| of a fresh token: 0.5 (not the stale 0.3).
  np.testing.assert_allclose(float(terms["rollout_train_mismatch_k1"]), -np.mean(fresh_d),
                             rtol=1e-5)
  np.testing.assert_allclose(float(terms["rollout_train_log_ratio_over_0p1"]), 0.75)
  assert float(terms["rollout_train_log_ratio_over_1"]) == 0.0
  np.testing.assert_allclose(float(terms["rollout_train_log_ratio_max"]), 0.5, rtol=1e-6)
  later = composite.with_mismatch_kl(composite.mismatch_terms(logp, batch, version=4, prox_version=3))
  assert float(later["rollout_train_mismatch_kl"]) == 0.0
  assert float(later["rollout_train_log_ratio_max"]) == 0.0


def test_step_metrics_reduce_maxima_by_their_maximum():
  """Over microbatches and updates the log-ratio maximum is the largest, other metrics the
  mean (a later update of the same batch has no fresh token and reports 0)."""
  stacked = {"rollout_train_log_ratio_max": jnp.array([0.7, 0.0, 0.2]),
             "loss": jnp.array([1.0, 2.0, 6.0])}
  reduced = composite.reduce_metrics(stacked)
  assert float(reduced["rollout_train_log_ratio_max"]) == pytest.approx(0.7)
  assert float(reduced["loss"]) == pytest.approx(3.0)


@pytest.mark.slow
def test_the_step_reports_the_precision_gap():
  """On-policy batches from each sampler, trained by the matching step: float32 throughout
  leaves a gap of float32 rounding, bfloat16 compute a gap orders of magnitude larger."""
  gap = {}
  for name, config in (("f32", F32), ("mixed", MIXED)):
    optimizer = train.make_optimizer(1e-3)
    step = train.make_train_step(config, optimizer, GRPO)
    _, metrics = step(train.init_train_state(jax.tree.map(jnp.copy, PARAMS), optimizer),
                      _sampled(config))
    gap[name] = float(metrics["rollout_train_mismatch_kl"])
  assert 0 <= gap["f32"] < 1e-10
  assert gap["mixed"] > 1e-9 and gap["mixed"] > 100 * max(gap["f32"], 1e-14)


@pytest.mark.slow
def test_mixed_precision_through_the_launcher(tmp_path):
  """--config.model.compute_dtype=bfloat16 reaches the run: its config.json, a larger
  sampler-trainer gap than the float32 run's, float32 checkpointed weights; a bad value is
  refused before anything runs."""
  from experiments import train as launcher  # pylint: disable=import-outside-toplevel
  from rl import checkpoint  # pylint: disable=import-outside-toplevel
  from tests.launcher_config import tiny_run_config  # pylint: disable=import-outside-toplevel
  gaps = {}
  for name, dtype in (("f32", ""), ("mixed", "bfloat16")):
    launcher.run(tiny_run_config(tmp_path / name, {"model.compute_dtype": dtype}))
    with open(tmp_path / name / "metrics.jsonl") as f:
      records = [json.loads(line) for line in f]
    gaps[name] = [r["rollout_train_mismatch_kl"] for r in records if r.get("phase") == "rl"
                  and "rollout_train_mismatch_kl" in r]
    assert json.load(open(tmp_path / name / "config.json"))["model"]["compute_dtype"] == dtype
  assert len(gaps["mixed"]) == 2 and min(gaps["mixed"]) > 100 * max(max(gaps["f32"]), 1e-14)
  manager = checkpoint.make_manager(str(tmp_path / "mixed" / "checkpoints"))
  tree, _ = checkpoint.restore_tree(manager, manager.latest_step())
  assert all(np.asarray(leaf).dtype == np.float32 for leaf in jax.tree.leaves(tree["train"]["params"]))
  with pytest.raises(ValueError, match=r"config.model.compute_dtype = 'float16'"):
    launcher.run(tiny_run_config(tmp_path / "bad", {"model.compute_dtype": "float16"}))


@pytest.mark.slow
@pytest.mark.parametrize("config", [F32, MIXED], ids=["float32", "bfloat16"])
def test_the_batch_size_check_equals_scoring_each_row_by_itself(config):
  """The check's gap is |log-probs of the whole batch in one forward - each row's own
  forward| over completion tokens, mean and maximum: against separate per-row calls
  (compiled apart, so equal within float32 rounding, 1e-6), and exactly 0 for a batch
  without completion tokens."""
  batch = _sampled(config, rows=4)
  check = train.make_batch_size_check(config)
  metrics = check(PARAMS, batch)
  whole = np.asarray(composite.policy_logprobs(PARAMS, batch, config))
  rows = np.concatenate([np.asarray(composite.policy_logprobs(
      PARAMS, jax.tree.map(lambda x, i=i: x[i:i + 1], batch), config)) for i in range(4)])
  mask = np.asarray(batch.completion_mask)
  gap = np.abs(whole - rows)[mask]
  np.testing.assert_allclose(float(metrics["trainer_logp_batch_gap"]), gap.mean(), atol=1e-6)
  np.testing.assert_allclose(float(metrics["trainer_logp_batch_gap_max"]), gap.max(), atol=1e-6)
  empty = check(PARAMS, batch.replace(completion_mask=jnp.zeros_like(batch.completion_mask)))
  assert float(empty["trainer_logp_batch_gap"]) == float(empty["trainer_logp_batch_gap_max"]) == 0


@pytest.mark.parametrize("overrides", [
    {}, pytest.param({"rl.async_": True}, marks=pytest.mark.slow),
    pytest.param({"mesh.data": 2, "mesh.fsdp": 4}, marks=pytest.mark.slow)],
    ids=["sync", "async", "mesh"])
def test_the_batch_size_check_runs_every_n_steps_through_the_launcher(tmp_path, overrides):
  """--config.metrics.logprob_check_every=2 over 4 RL steps: the check's metrics are in the
  records of RL steps 2 and 4 only, float32 gaps within rounding; in the synchronous and
  asynchronous loops and on a mesh of the 8 virtual devices."""
  from experiments import train as launcher  # pylint: disable=import-outside-toplevel
  from tests.launcher_config import tiny_run_config  # pylint: disable=import-outside-toplevel
  overrides = {"rl.steps": 4, "metrics.logprob_check_every": 2, "eval.every": 4,
               "checkpoint.every": 4, **overrides}
  launcher.run(tiny_run_config(tmp_path, overrides))
  with open(tmp_path / "metrics.jsonl") as f:
    rl = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "loss" in r]
  assert len(rl) == 4
  checked = ["trainer_logp_batch_gap" in r for r in rl]
  assert checked == [False, True, False, True]
  assert all(0 <= r["trainer_logp_batch_gap"] <= r["trainer_logp_batch_gap_max"] < 1e-4
             for r in rl if "trainer_logp_batch_gap" in r)
