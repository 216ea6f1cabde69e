"""Logits parity of models.hf_checkpoint with transformers (torch CPU), import and export.

Tiny random Llama / Qwen2 / Qwen3 models are written by transformers' `save_pretrained`
with weights scaled up (std 0.25), randomised norms and biases, so logits are large and
any layout mistake (transposes, RoPE halves, GQA head order, q/k norms) shows.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import models
from models import hf_checkpoint
from models import transformer
from tests.hf_reference import arbor_logits, hf_logits, random_hf_model, random_tokens
from tests import tiny

@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(kind, tmp_path):
  model = random_hf_model(kind)
  model.save_pretrained(tmp_path)
  saved = json.loads((tmp_path / "config.json").read_text())
  config, params = hf_checkpoint.load_hf(str(tmp_path))
  assert config.qkv_bias == (kind == "qwen2") and config.qk_norm == (kind == "qwen3")
  assert config.tie_embeddings == saved["tie_word_embeddings"]
  assert ("lm_head" in params) != config.tie_embeddings
  tokens = random_tokens(config.vocab_size)
  expected = hf_logits(model, tokens)
  got = arbor_logits(params, config, tokens)
  err = np.abs(got - expected).max()
  print(f"{kind}: max |logit diff| {err:.2e}, max |logit| {np.abs(expected).max():.1f}")
  assert np.abs(expected).max() > 5.0  # large logits, or the test proves little
  assert err <= 1e-4
  np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


def test_rope_theta_spellings_and_scaling():
  base = dict(model_type="llama", vocab_size=8, hidden_size=8, num_hidden_layers=1,
              num_attention_heads=2, intermediate_size=8)
  old = hf_checkpoint.config_from_hf(dict(base, rope_theta=5e5))
  new = hf_checkpoint.config_from_hf(
      dict(base, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
  assert old.rope_theta == new.rope_theta == 5e5
  with pytest.raises(ValueError, match="llama3"):
    hf_checkpoint.config_from_hf(dict(base, rope_parameters={"rope_type": "llama3",
                                                             "rope_theta": 5e5}))
  with pytest.raises(ValueError, match="model_type 'gpt2'"):
    hf_checkpoint.config_from_hf(dict(base, model_type="gpt2", rope_theta=1.0))


def test_bfloat16_checkpoint_loads_exactly(tmp_path):
  model = random_hf_model("qwen2").to(torch.bfloat16)
  model.save_pretrained(tmp_path)
  config, params = hf_checkpoint.load_hf(str(tmp_path), dtype="bfloat16")
  assert params["embed"].dtype == jnp.bfloat16
  q0 = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
  np.testing.assert_array_equal(np.asarray(params["layers"]["q"][1], np.float32), q0)
  tokens = random_tokens(config.vocab_size)
  expected = hf_logits(model, tokens)
  got = arbor_logits(params, config, tokens)
  # Same bf16 weights, different bf16 rounding of activations: a loose bound only.
  assert np.abs(got - expected).max() < 0.1 * np.abs(expected).max()


@pytest.mark.parametrize("kind,tie", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_export_loads_in_transformers(kind, tie, tmp_path):
  # 4 heads of 16 over a width of 48 (heads x head_dim != d_model, as in Qwen3), and
  # non-default RoPE base and norm epsilon, so each reaches transformers' config.
  config = tiny.model(vocab_size=80, d_model=48, n_heads=4, n_kv_heads=2, rope_theta=5e4,
                      norm_eps=1e-6, qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
                      tie_embeddings=tie, max_seq_len=64)
  params = transformer.init_params(config, jax.random.PRNGKey(3), init_std=0.25)
  keys = iter(jax.random.split(jax.random.PRNGKey(4), 8))
  params["final_norm"] = 1 + 0.5 * jax.random.normal(next(keys), params["final_norm"].shape)
  for leaf in ("attn_norm", "mlp_norm", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm"):
    if leaf in params["layers"]:
      shape = params["layers"][leaf].shape
      params["layers"][leaf] = 1 + 0.5 * jax.random.normal(next(keys), shape)
  # A tiny shard limit forces the sharded layout (index + several files).
  hf_checkpoint.save_hf(str(tmp_path), params, config, max_shard_bytes=40_000)
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
  model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
  assert type(model).__name__ == hf_checkpoint.ARCHITECTURES[kind]
  tokens = random_tokens(config.vocab_size)
  expected = hf_logits(model, tokens)
  got = arbor_logits(params, config, tokens)
  assert np.abs(expected).max() > 5.0
  assert np.abs(got - expected).max() <= 1e-4
  # And back: the sharded folder reloads to the same parameters.
  config2, params2 = hf_checkpoint.load_hf(str(tmp_path))
  assert config2 == config
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_missing_tensor_and_folder_errors(tmp_path):
  with pytest.raises(ValueError, match="no config.json"):
    hf_checkpoint.load_hf(str(tmp_path))
  model = random_hf_model("llama")
  model.save_pretrained(tmp_path)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match="model.safetensors"):
    hf_checkpoint.load_hf(str(tmp_path))


# --- What loading refuses -------------------------------------------------------------


def _tiny(kind="llama", tie=False, n_layers=2):
  return tiny.model(n_layers=n_layers, qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
                    tie_embeddings=tie)


def _folder(tmp_path, kind="llama", tie=False, config_edit=None, tensors_edit=None):
  """A HF folder of a tiny random `kind` model written by save_hf, then tampered with:
  config_edit(config.json dict) and tensors_edit(tensors dict) edit the files in place."""
  config = _tiny(kind, tie)
  params = transformer.init_params(config, jax.random.PRNGKey(0), init_std=0.25)
  hf_checkpoint.save_hf(str(tmp_path), params, config)
  if tensors_edit is not None:
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    tensors_edit(tensors)
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"),
                                metadata={"format": "pt"})
  if config_edit is not None:
    hf = json.loads((tmp_path / "config.json").read_text())
    hf = config_edit(hf)
    (tmp_path / "config.json").write_text(hf if isinstance(hf, str) else json.dumps(hf))
  return str(tmp_path)


def _set(**fields):
  return lambda hf: dict(hf, **fields)


def _without(field):
  return lambda hf: {k: v for k, v in hf.items() if k != field}


def _with_nan(tensors):
  tensors["model.layers.1.mlp.up_proj.weight"][3, 2] = np.nan


@pytest.mark.parametrize("kind,tie,config_edit,tensors_edit,message", [
    # The silent-wrong loads: each loaded before, with different logits.
    ("llama", False, _set(tie_word_embeddings=True), None,
     "tie_word_embeddings=true but 'lm_head.weight' differs"),
    ("qwen2", True, _set(model_type="llama"), None, "q/k/v biases are Qwen2's"),
    ("qwen3", True, _set(model_type="llama"), None, "q/k norms are Qwen3's"),
    ("llama", True, _set(num_hidden_layers=1), None,
     "weights hold 2 layers but config.json says num_hidden_layers=1"),
    ("llama", True, None, _with_nan, "'model.layers.1.mlp.up_proj.weight' has 1 non-finite"),
    ("llama", True, None, lambda t: t.update(extra=np.zeros(3, np.float32)),
     r"not used by a llama model.*'extra'"),
    # Tying the other way: untied config, no lm_head in the file.
    ("llama", True, _set(tie_word_embeddings=False), None,
     "tie_word_embeddings=false but there is no 'lm_head.weight'"),
    # Malformed config.json: the file and the field are named.
    ("llama", True, lambda hf: json.dumps(hf)[:-10], None, r"config.json: invalid JSON at line 1"),
    ("llama", True, _without("hidden_size"), None,
     r"config.json: required field 'hidden_size' is missing"),
    ("llama", True, _set(hidden_size="16"), None,
     r"config.json: field 'hidden_size' must be a positive integer, got '16' \(str\)"),
    ("llama", True, _set(num_attention_heads=2.0), None,
     r"config.json: field 'num_attention_heads' must be a positive integer"),
    ("llama", True, _set(rms_norm_eps="1e-6"), None,
     r"config.json: field 'rms_norm_eps' must be a positive number"),
    ("llama", True, _set(tie_word_embeddings="yes"), None,
     r"config.json: field 'tie_word_embeddings' must be true or false"),
    ("llama", True, _set(intermediate_size=0), None, r"field 'intermediate_size' must be a positive"),
    ("llama", True, lambda hf: list(hf), None, r"config.json: expected a JSON object.*list"),
])
def test_loading_refuses_what_it_cannot_represent(tmp_path, kind, tie, config_edit, tensors_edit,
                                                  message):
  folder = _folder(tmp_path, kind, tie, config_edit, tensors_edit)
  with pytest.raises(ValueError, match=message):
    hf_checkpoint.load_hf(folder)


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
  def duplicate(tensors):
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  config, params = hf_checkpoint.load_hf(_folder(tmp_path, "llama", True, tensors_edit=duplicate))
  assert config.tie_embeddings and "lm_head" not in params


def test_truncated_safetensors_names_the_file(tmp_path):
  folder = _folder(tmp_path)
  path = tmp_path / "model.safetensors"
  path.write_bytes(path.read_bytes()[:300])
  with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
    hf_checkpoint.load_hf(folder)
  (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
  with pytest.raises(ValueError, match=r"index.json: expected a JSON object with a 'weight_map'"):
    hf_checkpoint.load_hf(folder)


def test_load_pretrained_refuses_through_the_launcher_entry(tmp_path):
  folder = _folder(tmp_path, "qwen2", True, _set(model_type="llama"))
  with pytest.raises(ValueError, match="q/k/v biases are Qwen2's"):
    models.load_pretrained(folder)
