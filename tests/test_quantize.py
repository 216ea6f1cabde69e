"""Weight-only quantisation (models/quantize.py) against NumPy, and quantised rollouts
(config.rollout.weights) through the launcher with every rollout kind they compose with."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from experiments import train as launcher
from models import quantize
from models import transformer
from sampling import sampler
from tests.launcher_config import rl_steps, tiny_run_config
from tests import tiny

CONFIG = tiny.MODEL
MOE = tiny.model(mlp_dim=16, num_experts=4, experts_per_token=2, shared_expert_dim=8)


def numpy_quantize(w: np.ndarray, name: str) -> np.ndarray:
  """The dequantised weight, slowly: per output column j, s_j = max_i |w_ij| / q_max
  (1 for a zero column), values round(w / s) (an integer grid, or fp8's nearest value),
  returned as values * s."""
  w = w.astype(np.float64)
  if name == "bfloat16":
    return w.astype(ml_dtypes.bfloat16).astype(np.float64)
  q_max = {"int8": 127, "int4": 7, "fp8": 448}[name]
  out = np.zeros_like(w)
  for index in np.ndindex(*w.shape[:-2]):
    for j in range(w.shape[-1]):
      column = w[index + (slice(None), j)]
      peak = np.abs(column).max()
      scale = np.float32(peak / q_max) if peak > 0 else 1.0
      x = np.clip(column.astype(np.float32) / np.float32(scale), -q_max, q_max)
      values = (x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) if name == "fp8"
                else np.round(x))
      out[index + (slice(None), j)] = values * scale
  return out


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "bfloat16"])
def test_quantize_tensor_equals_a_numpy_reference(name):
  rng = np.random.default_rng(0)
  w = rng.normal(0.0, 0.05, (2, 6, 5)).astype(np.float32)
  w[1, :, 3] = 0.0  # a zero channel: scale 1, values 0
  w[0, 2, 1] = 3.0  # an outlier sets its channel's scale alone
  quantized = quantize.quantize_tensor(jnp.asarray(w), quantize.get_format(name))
  restored = quantized.dequantize(jnp.float32)
  np.testing.assert_allclose(np.asarray(restored), numpy_quantize(w, name), rtol=1e-6,
                             atol=1e-9)
  assert np.all(np.asarray(restored)[1, :, 3] == 0.0)
  if name in ("int8", "int4"):  # round-to-nearest: within half a step of the weight
    step = np.abs(w).max(axis=-2, keepdims=True) / {"int8": 127, "int4": 7}[name]
    assert np.all(np.abs(np.asarray(restored) - w) <= step / 2 + 1e-7)
    assert quantized.values.dtype == quantize.get_format(name).dtype
    assert quantized.scale.shape == (2, 1, 5)


def test_unknown_format_is_refused():
  with pytest.raises(ValueError, match="Unknown weight format 'int3'.*rollout.weights"):
    quantize.get_format("int3")


@pytest.mark.parametrize("config,name", [
    (CONFIG, "int8"), pytest.param(CONFIG, "fp8", marks=pytest.mark.slow),
    pytest.param(MOE, "int8", marks=pytest.mark.slow),
    pytest.param(MOE, "fp8", marks=pytest.mark.slow)],
    ids=["dense-int8", "dense-fp8", "moe-int8", "moe-fp8"])
def test_quantized_params_run_the_forward_of_their_dequantised_weights(config, name):
  """Exactly the linear layers are stored quantised (a quarter of float32's bytes and the
  scales); the
  forward on them equals the forward on the dequantised float weights, and differs from the
  float policy's by the quantisation's gap, not by nothing."""
  params = transformer.init_params(config, jax.random.PRNGKey(1))
  quantized = quantize.quantize_params(params, name)
  stored = {key for key, value in quantized["layers"].items() if quantize.is_quantized(value)}
  assert stored == quantize.QUANTIZED_WEIGHTS & set(params["layers"])
  assert quantized["embed"] is params["embed"]
  assert quantized["layers"].get("router") is params["layers"].get("router")
  linear = {key: params["layers"][key] for key in stored}
  # A quarter of float32's bytes, plus one float32 scale (4 bytes) per output column of n
  # inputs (4 n bytes in float32): at most 1 / n more, n = 16 for the experts' down
  # projection here.
  ratio = (quantize.weight_bytes({key: quantized["layers"][key] for key in stored})
           / quantize.weight_bytes(linear))
  assert 0.25 < ratio <= 0.25 + 1 / min(config.d_model, config.mlp_dim)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 10), 0, config.vocab_size)
  mask = jnp.ones((3, 10), bool)
  positions = transformer.positions_from_mask(mask)
  logits = lambda p: transformer.forward(p, tokens, positions, mask, config)[0]
  dequantised = quantize.dequantize(quantized, jnp.float32)
  np.testing.assert_array_equal(np.asarray(logits(quantized)), np.asarray(logits(dequantised)))
  gap = np.abs(np.asarray(logits(quantized)) - np.asarray(logits(params))).max()
  assert 1e-6 < gap < 0.05


@pytest.mark.parametrize("config,name", [
    (CONFIG, "int8"), pytest.param(CONFIG, "bfloat16", marks=pytest.mark.slow),
    pytest.param(MOE, "int8", marks=pytest.mark.slow),
    pytest.param(MOE, "bfloat16", marks=pytest.mark.slow)],
    ids=["dense-int8", "dense-bfloat16", "moe-int8", "moe-bfloat16"])
def test_the_decode_loop_holds_quantised_weights_and_samples_as_their_dequantised_copy(
    config, name):
  """The decode layout keeps the linear weights quantised (each step dequantises them), and
  the sampled tokens, behaviour log-probs and routing record equal those of the
  dequantised float weights."""
  params = quantize.quantize_params(transformer.init_params(config, jax.random.PRNGKey(3)),
                                    name)
  layers = transformer.unstack_layers(params, config, 24)["layers"]
  assert quantize.is_quantized(layers[0]["qkv"]) and quantize.is_quantized(layers[1]["o"])
  assert layers[0]["qkv"].values.dtype == quantize.get_format(name).dtype
  if name == "int8":  # q, k and v keep their own channels' scales
    assert layers[0]["qkv"].scale.shape[-1] == (
        (config.n_heads + 2 * config.n_kv_heads) * config.head_dim)
  prompts = jax.random.randint(jax.random.PRNGKey(4), (4, 6), 0, config.vocab_size)
  mask = jnp.ones((4, 6), bool)
  sampling = sampler.SamplingConfig(max_new_tokens=8, temperature=1.0)
  run = lambda p: sampler.generate(p, prompts, mask, jax.random.PRNGKey(5), config, sampling)
  quantized, dequantised = run(params), run(quantize.dequantize(params, jnp.float32))
  np.testing.assert_array_equal(np.asarray(quantized.tokens), np.asarray(dequantised.tokens))
  np.testing.assert_allclose(np.asarray(quantized.behavior_logp),
                             np.asarray(dequantised.behavior_logp), rtol=1e-6, atol=1e-6)
  if config.is_moe:
    np.testing.assert_array_equal(np.asarray(quantized.experts),
                                  np.asarray(dequantised.experts))


# --- Through the launcher --------------------------------------------------------------



def _gaps(tmp_path, overrides):
  """The fresh-token mismatch of each RL step, float sampler then int4 sampler."""
  gaps = {}
  for weights in ("", "int4"):
    workdir = tmp_path / (weights or "float")
    launcher.run(tiny_run_config(workdir, {"rollout.weights": weights, **overrides}))
    records = rl_steps(workdir)
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    assert json.loads((workdir / "config.json").read_text())["rollout"]["weights"] == weights
    gaps[weights] = records
  return gaps["int4"], gaps[""]


KINDS = {
    "independent": {},
    "tree": {"rollout.kind": "tree"},
    "partial": {"rollout.kind": "partial"},
    "pruned": {"rollout.kind": "pruned"},
    "speculative": {"rollout.speculative.tokens": 3},
    "async": {"rl.async_": True, "rl.max_staleness": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_quantized_rollouts_through_the_launcher_record_the_quantised_samplers_logprobs(
    tmp_path, kind):
  """--config.rollout.weights=int4: the behaviour log-probs are the quantised sampler's, so
  the fresh tokens' log-ratio to the float32 trainer is far larger than a float sampler's
  (float32 rounding), with every rollout kind. (The quick tier's launcher run of
  rollout.weights is tests/test_score_centering.py's.)"""
  quantized, plain = _gaps(tmp_path, KINDS[kind])
  first = quantized[0]  # fresh tokens exist at the first step of every kind
  assert first["rollout_train_mismatch_kl"] > 1e-7
  assert first["rollout_train_mismatch_kl"] > 100 * max(plain[0]["rollout_train_mismatch_kl"],
                                                        1e-12)
  assert first["rollout_train_log_ratio_max"] > plain[0]["rollout_train_log_ratio_max"]


@pytest.mark.slow
def test_quantized_rollouts_with_tools(tmp_path):
  """The adder environment's multi-turn rollouts sample with the quantised weights too."""
  overrides = {"task.difficulty.max_steps": 3, "task.difficulty.tool_share": 1.0,
               "tools.name": "adder", "rollout.max_new_tokens": 80,
               "rollout.train_length_buckets": ()}
  from experiments.configs import default  # pylint: disable=import-outside-toplevel
  launcher.run(tiny_run_config(tmp_path, {"rollout.weights": "int4", **overrides},
                               base=default))
  records = rl_steps(tmp_path)
  assert len(records) == 2 and records[0]["rollout_train_mismatch_kl"] > 1e-7  # float: 1e-14


@pytest.mark.slow
def test_quantized_moe_rollouts_record_the_quantised_routing_and_replay_it(tmp_path):
  """tiny2_moe with int4 rollouts and routing replay: at the first step (on-policy, where
  float32 rollouts route exactly as the trainer) the quantised sampler's routing differs
  from the trainer's for some token-layers, and replaying it brings the trainer closer to
  the sampler than its own routing."""
  from experiments.configs import default  # pylint: disable=import-outside-toplevel
  launcher.run(tiny_run_config(tmp_path, {
      "model.preset": "tiny2_moe", "rollout.weights": "int4", "moe.routing_replay": True,
      "task.difficulty.max_steps": 3}, base=default))
  first = rl_steps(tmp_path)[0]
  assert first["moe_routing_mismatch"] > 0
  assert first["behavior_train_kl"] < first["moe_unreplayed_kl"]


def test_quantized_rollouts_on_a_mesh_are_refused(tmp_path):
  with pytest.raises(ValueError, match=r"rollout.weights='int8' runs on one device"):
    launcher.run(tiny_run_config(tmp_path, {"rollout.weights": "int8", "mesh.data": 8}))


def test_an_unknown_weight_format_is_refused_by_the_launcher(tmp_path):
  with pytest.raises(ValueError, match="rollout.weights"):
    launcher.run(tiny_run_config(tmp_path, {"rollout.weights": "int3"}))
