"""Mixture-of-experts Hugging Face checkpoints (Qwen3-MoE, Mixtral): logits and routing
parity of models.hf_checkpoint with transformers (torch CPU), import and export, exact
round trips, and what loading and export refuse.

The tiny random models (tests/hf_reference.py) scale every weight up (std 0.25), routers
included, so logits are large and tokens spread over the experts: each test checks that
every layer routes the tokens to at least 3 distinct experts and that Arbor's routers pick
the same experts as transformers' at every token and layer, so a broken router or expert
layout cannot pass on a few experts or a uniform routing.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch
import transformers

from models import hf_checkpoint
from models import transformer
from models.config import PRESETS, ModelConfig
from tests.hf_reference import arbor_logits, hf_logits, random_hf_model, random_tokens
from tests import tiny


_routing = jax.jit(transformer.hidden_states_with_routing, static_argnames=("config",))


def arbor_experts(params, config: ModelConfig, tokens: np.ndarray) -> np.ndarray:
  """The experts [B, T, L, k] Arbor's routers choose, each token's sorted."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  _, stats = _routing(params, jnp.asarray(tokens), positions, jnp.ones((b, t), bool), config)
  return np.sort(np.asarray(stats.experts), axis=-1)


def hf_experts(model, tokens: np.ndarray, k: int) -> np.ndarray:
  """The experts [B, T, L, k] transformers' routers choose (the top-k router logits: the
  top-k probabilities of both families), each token's sorted."""
  with torch.no_grad():
    out = model(torch.as_tensor(tokens, dtype=torch.long), output_router_logits=True)
  per_layer = [torch.topk(logits.float(), k, dim=-1).indices.numpy().reshape(*tokens.shape, k)
               for logits in out.router_logits]
  return np.sort(np.stack(per_layer, axis=2), axis=-1)


def check_routing(params, config: ModelConfig, model, tokens: np.ndarray) -> None:
  """Routing is non-trivial (>= 3 distinct experts in every layer) and the same as
  transformers' at every token and layer."""
  ours = arbor_experts(params, config, tokens)
  theirs = hf_experts(model, tokens, config.experts_per_token)
  distinct = [len(np.unique(ours[:, :, layer])) for layer in range(config.n_layers)]
  print(f"distinct experts per layer: {distinct} of {config.num_experts}")
  assert min(distinct) >= 3, distinct
  np.testing.assert_array_equal(ours, theirs)


def check_logits(params, config: ModelConfig, model, tokens: np.ndarray, label: str) -> float:
  expected = hf_logits(model, tokens)
  got = arbor_logits(params, config, tokens)
  err = float(np.abs(got - expected).max())
  print(f"{label}: max |logit diff| {err:.2e}, max |logit| {np.abs(expected).max():.1f}")
  assert np.abs(expected).max() > 5.0  # large logits, or the test proves little
  assert err <= 1e-4
  np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))
  return err


def tensor_names(folder) -> set[str]:
  names = set()
  for file in os.listdir(folder):
    if file.endswith(".safetensors"):
      with safetensors.safe_open(os.path.join(folder, file), framework="numpy") as f:
        names.update(f.keys())
  return names


def assert_same_params(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


# --- Import: transformers' save_pretrained -> load_hf ------------------------------------

_HUB_EXPERT = {"qwen3_moe": "model.layers.1.mlp.experts.5.down_proj.weight",
               "mixtral": "model.layers.1.block_sparse_moe.experts.5.w2.weight"}


@pytest.mark.parametrize("kind", ["qwen3_moe",
                                  pytest.param("qwen3_moe_unnormalized", marks=pytest.mark.slow),
                                  pytest.param("mixtral", marks=pytest.mark.slow)])
def test_moe_logits_match_transformers(kind, tmp_path):
  family = "mixtral" if kind == "mixtral" else "qwen3_moe"
  model = random_hf_model(kind)
  hf = model.config
  model.save_pretrained(tmp_path / "hub")
  # transformers 5 writes the Hub's per-expert names by default, its fused in-memory
  # layout with save_original_format=False: both load, to the same parameters.
  model.save_pretrained(tmp_path / "fused", save_original_format=False)
  assert _HUB_EXPERT[family] in tensor_names(tmp_path / "hub")
  assert "model.layers.1.mlp.experts.gate_up_proj" in tensor_names(tmp_path / "fused")
  config, params = hf_checkpoint.load_hf(str(tmp_path / "hub"))
  fused_config, fused_params = hf_checkpoint.load_hf(str(tmp_path / "fused"))
  assert fused_config == config
  assert_same_params(fused_params, params)

  assert config.num_experts == hf.num_local_experts and config.experts_per_token == 2
  assert config.mlp_dim == 48 and config.qk_norm == (family == "qwen3_moe")
  assert config.routing == ("topk_softmax" if family == "mixtral" else "softmax_topk")
  assert config.normalize_routing == (kind != "qwen3_moe_unnormalized")
  assert config.tie_embeddings == hf.tie_word_embeddings
  assert params["layers"]["expert_gate"].shape == (2, config.num_experts, 64, 48)
  assert not {"gate", "up", "down"} & set(params["layers"])
  tokens = random_tokens(config.vocab_size)
  check_routing(params, config, model, tokens)
  check_logits(params, config, model, tokens, f"import {kind}")


# --- Export: save_hf -> transformers' from_pretrained ------------------------------------


def _random_moe(config: ModelConfig, seed: int):
  """Random params of `config`'s shapes, drawn by NumPy (no compilation): matrices at std
  0.25 (routers included; the experts' down projections 0.125), norms 1 + 0.5 N(0, 1)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: transformer.init_params(config, jax.random.PRNGKey(0)))

  def draw(path, leaf):
    name = str(getattr(path[-1], "key", path[-1]))
    value = (1 + 0.5 * rng.standard_normal(leaf.shape) if name.endswith("norm") else
             (0.125 if name == "expert_down" else 0.25) * rng.standard_normal(leaf.shape))
    return jnp.asarray(value, config.jnp_dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _moe_config(qk_norm, routing, normalize, tie, **changes):
  # As test_hf_checkpoint's export: heads x head_dim != d_model, non-default RoPE base and
  # norm epsilon.
  return tiny.model(vocab_size=80, d_model=48, n_heads=4, n_kv_heads=2, mlp_dim=32,
                    rope_theta=5e4, norm_eps=1e-6, qk_norm=qk_norm, tie_embeddings=tie,
                    max_seq_len=64, num_experts=8, experts_per_token=2, routing=routing,
                    normalize_routing=normalize, **changes)


@pytest.mark.parametrize("family,qk_norm,routing,normalize,tie", [
    ("qwen3_moe", True, "softmax_topk", True, False),
    ("qwen3_moe", True, "softmax_topk", False, True),
    ("mixtral", False, "topk_softmax", True, False),
    # tiny2_moe's routing (softmax, top-k, renormalised) computes Mixtral's weights: it
    # exports as Mixtral and reloads as routing='topk_softmax', the same model.
    ("mixtral", False, "softmax_topk", True, True),
])
def test_moe_export_loads_in_transformers(family, qk_norm, routing, normalize, tie, tmp_path):
  config = _moe_config(qk_norm, routing, normalize, tie)
  params = _random_moe(config, seed=3)
  # A small shard limit forces the sharded layout (index + several files).
  hf_checkpoint.save_hf(str(tmp_path), params, config, max_shard_bytes=60_000)
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
  names = tensor_names(tmp_path)
  expert = _HUB_EXPERT[family].replace("experts.5.", "experts.7.")
  assert expert in names and not any("gate_up_proj" in n for n in names)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
  assert type(model).__name__ == hf_checkpoint.ARCHITECTURES[family]
  assert model.config.num_local_experts == 8 and model.config.num_experts_per_tok == 2
  tokens = random_tokens(config.vocab_size)
  check_routing(params, config, model, tokens)
  check_logits(params, config, model, tokens, f"export {family} ({routing}, "
               f"normalize={normalize})")
  # And back: the sharded folder reloads to the same parameters.
  config2, params2 = hf_checkpoint.load_hf(str(tmp_path))
  assert config2 == (config.replace(routing="topk_softmax") if family == "mixtral" else config)
  assert_same_params(params2, params)


@pytest.mark.parametrize("qk_norm,routing,dtype", [
    (True, "softmax_topk", "float32"), (False, "topk_softmax", "bfloat16")])
def test_moe_round_trip_is_exact(qk_norm, routing, dtype):
  config = _moe_config(qk_norm, routing, True, False, dtype=dtype)
  params = _random_moe(config, seed=7)
  tensors = hf_checkpoint.hf_tensors_from_params(params, config)
  assert len(tensors) == 3 + config.n_layers * (4 + 2 + 2 * qk_norm + 1 + 3 * 8)
  back = hf_checkpoint.params_from_hf_tensors(tensors, config)
  assert_same_params(back, params)
  assert hf_checkpoint.config_from_hf(hf_checkpoint.config_to_hf(config), dtype) == config


# --- What loading and export refuse -------------------------------------------------------


def _hf_config(family, **fields):
  config = _moe_config(family == "qwen3_moe", "softmax_topk", True, False)
  return dict(hf_checkpoint.config_to_hf(config), **fields)


@pytest.mark.parametrize("family,fields,message", [
    ("qwen3_moe", dict(mlp_only_layers=[1]),
     r"mlp_only_layers=\[1\] makes those layers dense.*Only an empty mlp_only_layers loads"),
    ("qwen3_moe", dict(decoder_sparse_step=2),
     r"decoder_sparse_step=2 .*Only decoder_sparse_step=1 loads"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16),
     "use_sliding_window=True is not supported"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("qwen3_moe", dict(num_local_experts=6), "num_experts=8 and num_local_experts=6 disagree"),
    ("qwen3_moe", dict(num_experts_per_tok=9),
     r"experts_per_token=9 must be in \[1, num_experts=8\]"),
    ("qwen3_moe", dict(moe_intermediate_size=None),
     "required field 'moe_intermediate_size' is missing"),
    ("qwen3_moe", dict(mlp_only_layers="0"), "'mlp_only_layers' must be a list"),
    ("mixtral", dict(sliding_window=32),
     r"sliding_window=32 is below max_position_embeddings=64.*Set sliding_window to null"),
    ("mixtral", dict(num_local_experts=None), "required field 'num_local_experts' is missing"),
])
def test_moe_config_refusals(family, fields, message):
  with pytest.raises(ValueError, match=message):
    hf_checkpoint.config_from_hf(_hf_config(family, **fields))


def test_moe_config_spellings_and_ignored_options():
  # The Hub's Qwen3-MoE files say num_experts, transformers 5 writes num_local_experts.
  hub = _hf_config("qwen3_moe")
  saved = dict({k: v for k, v in hub.items() if k != "num_experts"}, num_local_experts=8)
  assert hf_checkpoint.config_from_hf(hub) == hf_checkpoint.config_from_hf(saved)
  # Router-loss options are training-only; a Mixtral window as long as the context, or a
  # Qwen3-MoE window that is switched off, changes nothing.
  assert hf_checkpoint.config_from_hf(dict(hub, output_router_logits=True,
                                           router_aux_loss_coef=0.02, sliding_window=4096))
  mixtral = _hf_config("mixtral", sliding_window=64, router_jitter_noise=0.1)
  assert hf_checkpoint.config_from_hf(mixtral).routing == "topk_softmax"


# The published config.json files of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1
# (transformers 4 spellings: top-level rope_theta, Qwen3-MoE's num_experts).
_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
_MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}


def test_published_moe_configs_give_the_presets():
  assert hf_checkpoint.config_from_hf(_QWEN3_30B_A3B) == PRESETS["qwen3_30b_a3b"]
  assert hf_checkpoint.config_from_hf(_MIXTRAL_8X7B) == PRESETS["mixtral_8x7b"]


def _saved_folder(tmp_path, family, tensors_edit=None, config_edit=None):
  config = _moe_config(family == "qwen3_moe", "softmax_topk", True, False)
  hf_checkpoint.save_hf(str(tmp_path), _random_moe(config, seed=0), config)
  if tensors_edit:
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    tensors_edit(tensors)
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"),
                                metadata={"format": "pt"})
  if config_edit:
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config_edit(hf)))
  return str(tmp_path)


def _drop(name):
  return lambda tensors: tensors.pop(name)


def _extra_expert(tensors):
  for name in [n for n in tensors if ".experts.7." in n]:
    tensors[name.replace(".experts.7.", ".experts.8.")] = tensors[name].copy()


@pytest.mark.parametrize("family,tensors_edit,config_edit,message", [
    ("mixtral", _drop("model.layers.1.block_sparse_moe.experts.3.w3.weight"), None,
     r"'model.layers.1.block_sparse_moe.experts.3.w3.weight' is missing"),
    ("qwen3_moe", _extra_expert, None,
     "the weights hold 9 experts per layer but config.json says 8; fix num_experts"),
    ("qwen3_moe", None, lambda hf: dict(hf, moe_intermediate_size=16),
     r"'model.layers.0.mlp.experts.0.gate_proj.weight' has shape \(32, 48\), config.json "
     r"implies \(16, 48\)"),
    # Qwen3-MoE weights under a Mixtral config: the q/k norms are left over.
    ("qwen3_moe", None, lambda hf: dict(hf, model_type="mixtral", num_local_experts=8),
     "'model.layers.0.block_sparse_moe.gate.weight' is missing"),
    # A dense config over MoE weights.
    ("mixtral", None, lambda hf: dict(hf, model_type="llama"),
     "'model.layers.0.mlp.gate_proj.weight' is missing"),
])
def test_moe_loading_refuses_what_it_cannot_represent(tmp_path, family, tensors_edit,
                                                      config_edit, message):
  folder = _saved_folder(tmp_path, family, tensors_edit, config_edit)
  with pytest.raises(ValueError, match=message):
    hf_checkpoint.load_hf(folder)


@pytest.mark.parametrize("changes,message", [
    (dict(shared_expert_dim=16), "shared expert or q/k/v biases"),
    (dict(qkv_bias=True, qk_norm=False), "shared expert or q/k/v biases"),
    (dict(qk_norm=False, normalize_routing=False), "Mixtral renormalises"),
])
def test_moe_export_refuses_what_no_family_computes(tmp_path, changes, message):
  config = _moe_config(True, "softmax_topk", True, False).replace(**changes)
  params = _random_moe(config, seed=0)
  with pytest.raises(ValueError, match=message):
    hf_checkpoint.save_hf(str(tmp_path), params, config)
  assert not os.listdir(tmp_path)
