"""Hugging Face checkpoints: `config.json` + `*.safetensors` folders in and out.

Supports the three architectures `models.transformer` implements:

  llama  LlamaForCausalLM   (SmolLM2, Llama 2/3 without RoPE scaling)
  qwen2  Qwen2ForCausalLM   (q/k/v biases)
  qwen3  Qwen3ForCausalLM   (per-head RMSNorm of q and k)

Weights may sit in one `model.safetensors` or in shards listed by
`model.safetensors.index.json`. RoPE's base is read from the old top-level `rope_theta`
or from transformers-5 `rope_parameters`; only unscaled ("default") RoPE is supported, so a
config with RoPE scaling is rejected rather than loaded with wrong positions.

HF stores a linear layer as `weight [out, in]` (y = x W^T); Arbor stores `[in, out]`
(y = x W) with layers stacked on a leading axis, so loading transposes and stacks, and
export does the reverse. HF's q/k weights are already in the rotate-half RoPE layout
Arbor uses: no permutation is needed (unlike GGUF, see models/gguf_checkpoint.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"

# Arbor layer leaf -> HF name inside `model.layers.{i}.`; "linear" leaves are transposed.
_LAYER_LINEAR = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
                 "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
                 "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
                 "down": "mlp.down_proj.weight"}
_LAYER_VECTOR = {"attn_norm": "input_layernorm.weight",
                 "mlp_norm": "post_attention_layernorm.weight",
                 "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
                 "v_bias": "self_attn.v_proj.bias",
                 "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


def rope_theta_from_hf(hf: dict, source: str) -> float:
  """RoPE base from a HF config: top-level `rope_theta` or transformers-5 `rope_parameters`.

  Raises ValueError for RoPE scaling (llama3, yarn, linear, ...), which Arbor does not
  implement.
  """
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  for spec in (params, scaling):
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind != "default":
      raise ValueError(f"{source}: RoPE type {kind!r} is not supported (Arbor implements "
                       "unscaled RoPE only); use a checkpoint without RoPE scaling.")
  theta = params.get("rope_theta", hf.get("rope_theta"))
  if theta is None:
    raise ValueError(f"{source}: no RoPE base; expected 'rope_theta' or "
                     "'rope_parameters': {'rope_theta': ...}.")
  return float(theta)


def config_from_hf(hf: dict, dtype: str = "float32", source: str = "config.json") -> ModelConfig:
  """The ModelConfig of a HF `config.json` dict (llama / qwen2 / qwen3)."""
  kind = hf.get("model_type")
  if kind not in ARCHITECTURES:
    raise ValueError(f"{source}: model_type {kind!r} is not supported; Arbor loads "
                     f"{sorted(ARCHITECTURES)}.")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r}; Arbor's MLP is SwiGLU (silu).")
  if kind == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
    raise ValueError(f"{source}: Llama attention_bias / mlp_bias are not supported (Arbor's "
                     "Llama has no biases).")
  if kind == "qwen3" and hf.get("attention_bias"):
    raise ValueError(f"{source}: Qwen3 attention_bias=True is not supported.")
  if kind in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
    raise ValueError(f"{source}: use_sliding_window=True is not supported (Arbor attends to "
                     "the full context); set it to false if the model was trained that way.")
  n_heads = hf["num_attention_heads"]
  return ModelConfig(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
      mlp_dim=hf["intermediate_size"], rope_theta=rope_theta_from_hf(hf, source),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=kind == "qwen2",
      qk_norm=kind == "qwen3", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=int(hf.get("max_position_embeddings", 2048)), dtype=dtype)


def architecture_of(config: ModelConfig) -> str:
  """The HF architecture matching a config: qwen3 (qk_norm), qwen2 (qkv_bias) or llama."""
  if config.qk_norm and config.qkv_bias:
    raise ValueError("ModelConfig with both qk_norm and qkv_bias has no HF architecture "
                     "(Qwen3 has q/k norms without biases, Qwen2 biases without norms).")
  return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"


def config_to_hf(config: ModelConfig, extra: dict | None = None) -> dict:
  """A HF `config.json` dict for `config` (both RoPE spellings, so transformers 4 and 5 read
  it); `extra` adds fields such as token ids."""
  kind = architecture_of(config)
  hf = {
      "architectures": [ARCHITECTURES[kind]], "model_type": kind,
      "vocab_size": config.vocab_size, "hidden_size": config.d_model,
      "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads, "head_dim": config.head_dim,
      "intermediate_size": config.mlp_dim, "hidden_act": "silu",
      "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
      "max_position_embeddings": config.max_seq_len, "rope_theta": config.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
      "attention_bias": False, "dtype": config.dtype,
  }
  if kind == "llama":
    hf["mlp_bias"] = False
  else:
    hf["use_sliding_window"] = False
  hf.update(extra or {})
  return hf


def _weight_files(directory: str) -> list[str]:
  index = os.path.join(directory, _INDEX)
  if os.path.exists(index):
    with open(index) as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(directory, s) for s in shards]
  single = os.path.join(directory, _SINGLE)
  if os.path.exists(single):
    return [single]
  raise ValueError(f"{directory}: no {_SINGLE} or {_INDEX}; expected a Hugging Face "
                   "checkpoint folder written by save_pretrained.")


def read_safetensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of a HF folder (single file or sharded), by name, as NumPy arrays."""
  tensors = {}
  for path in _weight_files(directory):
    if not os.path.exists(path):
      raise ValueError(f"{path}: shard listed in {_INDEX} is missing.")
    with safe_open(path, framework="numpy") as f:
      for name in f.keys():
        tensors[name] = f.get_tensor(name)
  return tensors


def layer_tensor_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                      dict[str, tuple[int, ...]]]:
  """Shapes of one layer's tensors in checkpoint layout, by Arbor leaf name: the linear
  weights as torch stores them ([out, in]; Arbor keeps the transpose) and the vectors
  (norms, biases). Shared by the HF and GGUF readers, whose files use this layout."""
  c = config
  q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  linear = {"q": (q_width, c.d_model), "k": (kv_width, c.d_model), "v": (kv_width, c.d_model),
            "o": (c.d_model, q_width), "gate": (c.mlp_dim, c.d_model),
            "up": (c.mlp_dim, c.d_model), "down": (c.d_model, c.mlp_dim)}
  vector = {"attn_norm": (c.d_model,), "mlp_norm": (c.d_model,)}
  if c.qkv_bias:
    vector.update(q_bias=(q_width,), k_bias=(kv_width,), v_bias=(kv_width,))
  if c.qk_norm:
    vector.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
  return linear, vector


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: ModelConfig,
                           source: str = "checkpoint") -> dict[str, Any]:
  """Arbor's parameter pytree from HF-named tensors (see models/transformer.py)."""
  dtype = config.jnp_dtype

  def take(name, shape):
    if name not in tensors:
      raise ValueError(f"{source}: tensor {name!r} is missing (wrong architecture or a "
                       "truncated checkpoint?).")
    value = tensors[name]
    if tuple(value.shape) != tuple(shape):
      raise ValueError(f"{source}: tensor {name!r} has shape {tuple(value.shape)}, config.json "
                       f"implies {tuple(shape)}.")
    return np.asarray(value, np.float32)

  c = config
  linear_shapes, vector_shapes = layer_tensor_shapes(c)
  layers = {}
  for leaf, shape in linear_shapes.items():
    stacked = [take(f"model.layers.{i}.{_LAYER_LINEAR[leaf]}", shape).T for i in range(c.n_layers)]
    layers[leaf] = jnp.asarray(np.stack(stacked), dtype)
  for leaf, shape in vector_shapes.items():
    stacked = [take(f"model.layers.{i}.{_LAYER_VECTOR[leaf]}", shape) for i in range(c.n_layers)]
    layers[leaf] = jnp.asarray(np.stack(stacked), dtype)
  params = {"embed": jnp.asarray(take("model.embed_tokens.weight", (c.vocab_size, c.d_model)), dtype),
            "layers": layers,
            "final_norm": jnp.asarray(take("model.norm.weight", (c.d_model,)), dtype)}
  if not c.tie_embeddings:
    params["lm_head"] = jnp.asarray(take("lm_head.weight", (c.vocab_size, c.d_model)).T, dtype)
  return params


def load_hf(directory: str, dtype: str = "float32") -> tuple[ModelConfig, dict[str, Any]]:
  """(ModelConfig, params) of a HF checkpoint folder, with parameters in `dtype`."""
  config_path = os.path.join(directory, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{directory}: no config.json; expected a Hugging Face checkpoint folder.")
  with open(config_path) as f:
    config = config_from_hf(json.load(f), dtype=dtype, source=config_path)
  return config, params_from_hf_tensors(read_safetensors(directory), config, source=directory)


def hf_tensors_from_params(params: dict[str, Any], config: ModelConfig) -> dict[str, np.ndarray]:
  """HF-named tensors ([out, in] linears, one tensor per layer) from Arbor's pytree."""
  dtype = ml_dtypes.bfloat16 if config.dtype == "bfloat16" else np.float32
  as_np = lambda x: np.ascontiguousarray(np.asarray(x, np.float32).astype(dtype))
  tensors = {"model.embed_tokens.weight": as_np(params["embed"]),
             "model.norm.weight": as_np(params["final_norm"])}
  if not config.tie_embeddings:
    tensors["lm_head.weight"] = as_np(np.asarray(params["lm_head"]).T)
  for leaf, stacked in params["layers"].items():
    stacked = np.asarray(stacked)
    for i in range(config.n_layers):
      if leaf in _LAYER_LINEAR:
        tensors[f"model.layers.{i}.{_LAYER_LINEAR[leaf]}"] = as_np(stacked[i].T)
      else:
        tensors[f"model.layers.{i}.{_LAYER_VECTOR[leaf]}"] = as_np(stacked[i])
  return tensors


def save_hf(directory: str, params: dict[str, Any], config: ModelConfig, *,
            extra_config: dict | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `params` as a HF checkpoint folder loadable by `from_pretrained`.

  Tensors go to `model.safetensors`, or, past `max_shard_bytes`, to
  `model-0000i-of-0000n.safetensors` shards with a `model.safetensors.index.json`. Tensors
  are stored in `config.dtype`. `extra_config` adds fields to config.json (token ids).
  """
  os.makedirs(directory, exist_ok=True)
  tensors = hf_tensors_from_params(params, config)
  shards, size = [[]], 0
  for name, value in tensors.items():
    if shards[-1] and size + value.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += value.nbytes
  metadata = {"format": "pt"}
  if len(shards) == 1:
    save_file(tensors, os.path.join(directory, _SINGLE), metadata=metadata)
  else:
    weight_map = {}
    for i, names in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file({n: tensors[n] for n in names}, os.path.join(directory, file), metadata=metadata)
      weight_map.update({n: file for n in names})
    with open(os.path.join(directory, _INDEX), "w") as f:
      json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config_to_hf(config, extra_config), f, indent=2)
