"""Hugging Face checkpoints: `config.json` + `*.safetensors` folders in and out.

Supports five of the architectures `models.transformer` implements (not Qwen2-MoE):

  llama      LlamaForCausalLM      (SmolLM2, Llama 2/3 without RoPE scaling)
  qwen2      Qwen2ForCausalLM      (q/k/v biases)
  qwen3      Qwen3ForCausalLM      (per-head RMSNorm of q and k)
  qwen3_moe  Qwen3MoeForCausalLM   (Qwen3 attention, every MLP a mixture of experts:
                                    softmax then top-k, `norm_topk_prob`)
  mixtral    MixtralForCausalLM    (Llama attention, every MLP a mixture of experts:
                                    top-k then softmax)

Weights may sit in one `model.safetensors` or in shards listed by
`model.safetensors.index.json`. RoPE's base is read from the old top-level `rope_theta`
or from transformers-5 `rope_parameters`; only unscaled ("default") RoPE is supported, so a
config with RoPE scaling is rejected rather than loaded with wrong positions.

Loading refuses what Arbor cannot represent rather than loading something else: a tensor
in the files that the config does not use (q/k/v biases or q/k norms under a config that
says `llama`, layers beyond `num_hidden_layers`, experts beyond `num_experts`), an
`lm_head.weight` that disagrees with `tie_word_embeddings`, non-finite weights, settings
Arbor does not model (sliding-window attention, a Qwen3-MoE with dense layers among its
sparse ones), and malformed files (invalid JSON, a missing or mistyped field, a truncated
safetensors file), each with an error naming the file and the field or tensor.

HF stores a linear layer as `weight [out, in]` (y = x W^T); Arbor stores `[in, out]`
(y = x W) with layers stacked on a leading axis, so loading transposes and stacks, and
export does the reverse. HF's q/k weights are already in the rotate-half RoPE layout
Arbor uses: no permutation is needed (unlike GGUF, see models/gguf_checkpoint.py).

Mixture-of-experts weights, layer i, expert j (F = expert width, D = d_model, X = experts):

  Arbor leaf            Qwen3-MoE (Hub)                     Mixtral (Hub)
  router [L, D, X]      mlp.gate.weight [X, D]              block_sparse_moe.gate.weight
  expert_gate [L,X,D,F] mlp.experts.{j}.gate_proj.weight    block_sparse_moe.experts.{j}.w1.weight
  expert_up [L,X,D,F]   mlp.experts.{j}.up_proj.weight      block_sparse_moe.experts.{j}.w3.weight
  expert_down [L,X,F,D] mlp.experts.{j}.down_proj.weight    block_sparse_moe.experts.{j}.w2.weight

(per-expert [F, D], down [D, F]). That is the layout of the Hub's files, of transformers'
`save_pretrained` (5.x converts its fused in-memory experts back to it) and of `save_hf`.
transformers 5 holds the experts fused in memory, and writes them so with
`save_pretrained(save_original_format=False)`: `mlp.experts.gate_up_proj` [X, 2F, D] (gate
rows first, then up) and `mlp.experts.down_proj` [X, D, F], the router (Mixtral's too) as
`mlp.gate.weight`; loading accepts that layout as well, layer by layer.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Tensors some exporters write that are derived from the config, so ignoring them is safe.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)

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
# Per-expert (Hub) names of the MoE families, inside `model.layers.{i}.`: the block, and
# each Arbor expert leaf's projection inside `{block}.experts.{j}.`.
_MOE_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
_MOE_EXPERT = {"qwen3_moe": {"expert_gate": "gate_proj", "expert_up": "up_proj",
                             "expert_down": "down_proj"},
               "mixtral": {"expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"}}
# transformers 5's fused in-memory layout (save_pretrained(save_original_format=False)).
_FUSED_GATE_UP, _FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def rope_theta_from_hf(hf: dict, source: str) -> float:
  """RoPE base from a HF config: top-level `rope_theta` or transformers-5 `rope_parameters`.

  Raises ValueError for RoPE scaling (llama3, yarn, linear, ...), which Arbor does not
  implement.
  """
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  for key, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
    if not isinstance(spec, dict):
      raise ValueError(f"{source}: field {key!r} must be a JSON object, got {spec!r}.")
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind != "default":
      raise ValueError(f"{source}: RoPE type {kind!r} is not supported (Arbor implements "
                       "unscaled RoPE only); use a checkpoint without RoPE scaling.")
  theta = params.get("rope_theta", hf.get("rope_theta"))
  if theta is None:
    raise ValueError(f"{source}: no RoPE base; expected 'rope_theta' or "
                     "'rope_parameters': {'rope_theta': ...}.")
  return _number({"rope_theta": theta}, "rope_theta", source, float)


def _number(hf: dict, key: str, source: str, kind: type, default=...):
  """hf[key] checked to be a positive int (kind=int) or a finite positive number
  (kind=float); `default` when absent (or null) and a default is given."""
  value = hf.get(key)
  if value is None:
    if default is ...:
      raise ValueError(f"{source}: required field {key!r} is missing.")
    return default
  wanted = "a positive integer" if kind is int else "a positive number"
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      kind is int and not isinstance(value, int)):
    raise ValueError(f"{source}: field {key!r} must be {wanted}, got {value!r} "
                     f"({type(value).__name__}).")
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{source}: field {key!r} must be {wanted}, got {value!r}.")
  return kind(value)


def _flag(hf: dict, key: str, source: str, default: bool = False) -> bool:
  value = hf.get(key, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ValueError(f"{source}: field {key!r} must be true or false, got {value!r}.")
  return value


def config_from_hf(hf: dict, dtype: str = "float32", source: str = "config.json") -> ModelConfig:
  """The ModelConfig of a HF `config.json` dict (llama / qwen2 / qwen3 / qwen3_moe / mixtral).

  Every field Arbor reads is type-checked: a missing required field, a string or a
  boolean where a number belongs, or a non-positive size raises a ValueError naming
  `source` and the field. Settings Arbor does not model (sliding-window attention, a
  Qwen3-MoE whose `mlp_only_layers` / `decoder_sparse_step` make some layers dense) are
  refused naming the field and the fix; router-loss options (`output_router_logits`,
  `router_aux_loss_coef`, `router_jitter_noise`) only matter to transformers' training and
  are ignored.
  """
  if not isinstance(hf, dict):
    raise ValueError(f"{source}: expected a JSON object of model settings, got a JSON "
                     f"{type(hf).__name__}.")
  kind = hf.get("model_type")
  if kind not in ARCHITECTURES:
    raise ValueError(f"{source}: model_type {kind!r} is not supported; Arbor loads "
                     f"{sorted(ARCHITECTURES)}.")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r}; Arbor's MLP is SwiGLU (silu).")
  if kind == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
    raise ValueError(f"{source}: Llama attention_bias / mlp_bias are not supported (Arbor's "
                     "Llama has no biases).")
  if kind in ("qwen3", "qwen3_moe") and hf.get("attention_bias"):
    raise ValueError(f"{source}: Qwen3 attention_bias=True is not supported.")
  if kind in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
    raise ValueError(f"{source}: use_sliding_window=True is not supported (Arbor attends to "
                     "the full context); set it to false if the model was trained that way.")
  number = lambda key, kind=int, default=...: _number(hf, key, source, kind, default)
  d_model, n_heads = number("hidden_size"), number("num_attention_heads")
  max_seq_len = number("max_position_embeddings", default=2048)
  moe = _moe_fields_from_hf(hf, kind, max_seq_len, source) if kind in MOE_ARCHITECTURES else {}
  mlp_dim = moe.pop("mlp_dim") if moe else number("intermediate_size")
  try:
    return ModelConfig(
        vocab_size=number("vocab_size"), d_model=d_model, n_layers=number("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=number("num_key_value_heads", default=n_heads),
        head_dim=number("head_dim", default=d_model // n_heads),
        mlp_dim=mlp_dim, rope_theta=rope_theta_from_hf(hf, source),
        norm_eps=number("rms_norm_eps", float, 1e-6), qkv_bias=kind == "qwen2",
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        tie_embeddings=_flag(hf, "tie_word_embeddings", source),
        max_seq_len=max_seq_len, dtype=dtype, **moe)
  except ValueError as error:  # shapes that do not fit together (heads, head_dim, top-k)
    raise ValueError(f"{source}: {error}") from error


def _moe_fields_from_hf(hf: dict, kind: str, max_seq_len: int, source: str) -> dict:
  """The mixture-of-experts ModelConfig fields of a qwen3_moe / mixtral config.json, and
  `mlp_dim` (each expert's width); refuses what Arbor's MoE does not model."""
  number = lambda key, default=...: _number(hf, key, source, int, default)
  if kind == "mixtral":
    window = number("sliding_window", default=None)
    if window is not None and window < max_seq_len:
      raise ValueError(
          f"{source}: sliding_window={window} is below max_position_embeddings="
          f"{max_seq_len}; Arbor attends to the full context. Set sliding_window to null "
          "if the model was trained with full attention, or max_position_embeddings to at "
          f"most {window} (sequences no longer than the window attend the same either way).")
    return dict(mlp_dim=number("intermediate_size"), num_experts=number("num_local_experts"),
                experts_per_token=number("num_experts_per_tok"), routing="topk_softmax")
  # qwen3_moe. transformers 5 writes `num_local_experts`, the Hub's files `num_experts`.
  spellings = {key: number(key) for key in ("num_experts", "num_local_experts") if key in hf}
  if not spellings:
    raise ValueError(f"{source}: required field 'num_experts' (or 'num_local_experts') is "
                     "missing.")
  if len(set(spellings.values())) > 1:
    raise ValueError(f"{source}: num_experts={spellings['num_experts']} and "
                     f"num_local_experts={spellings['num_local_experts']} disagree; keep one.")
  step = number("decoder_sparse_step", default=1)
  if step != 1:
    raise ValueError(f"{source}: decoder_sparse_step={step} makes every layer whose index + 1 "
                     f"is not a multiple of {step} a dense MLP; Arbor's MoE models have experts "
                     "in every layer. Only decoder_sparse_step=1 loads.")
  dense = hf.get("mlp_only_layers") or []
  if not isinstance(dense, list):
    raise ValueError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, "
                     f"got {dense!r}.")
  if dense:
    raise ValueError(f"{source}: mlp_only_layers={dense} makes those layers dense MLPs; "
                     "Arbor's MoE models have experts in every layer. Only an empty "
                     "mlp_only_layers loads.")
  return dict(mlp_dim=number("moe_intermediate_size"),
              num_experts=next(iter(spellings.values())),
              experts_per_token=number("num_experts_per_tok"), routing="softmax_topk",
              normalize_routing=_flag(hf, "norm_topk_prob", source))


def architecture_of(config: ModelConfig) -> str:
  """The HF architecture matching a config: dense qwen3 (qk_norm), qwen2 (qkv_bias) or
  llama; mixture of experts qwen3_moe (qk_norm) or mixtral.

  Routing 'softmax_topk' with normalisation and 'topk_softmax' compute the same weights
  (models/moe.py), so either exports to either family: a qk_norm model as Qwen3-MoE with
  norm_topk_prob=true, one without as Mixtral. Raises ValueError for what no supported HF
  architecture computes (Qwen2-MoE's shared expert and q/k/v biases, unnormalised
  softmax-then-top-k routing without q/k norms).
  """
  if config.qk_norm and config.qkv_bias:
    raise ValueError("ModelConfig with both qk_norm and qkv_bias has no HF architecture "
                     "(Qwen3 has q/k norms without biases, Qwen2 biases without norms).")
  if not config.is_moe:
    return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"
  if config.shared_expert_dim or config.qkv_bias:
    raise ValueError("A mixture-of-experts ModelConfig with a shared expert or q/k/v biases "
                     "(Qwen2-MoE) has no supported HF architecture; Arbor exports Qwen3-MoE "
                     "and Mixtral.")
  if config.qk_norm:
    return "qwen3_moe"
  if config.routing == "softmax_topk" and not config.normalize_routing:
    raise ValueError("A mixture-of-experts ModelConfig without q/k norms and with "
                     "unnormalised softmax_topk routing has no HF architecture: Mixtral "
                     "renormalises its top-k weights (set normalize_routing=True), "
                     "Qwen3-MoE has q/k norms.")
  return "mixtral"


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
  elif kind == "mixtral":
    del hf["attention_bias"]  # Mixtral's attention has no bias option
    hf.update(num_local_experts=config.num_experts,
              num_experts_per_tok=config.experts_per_token, sliding_window=None,
              router_jitter_noise=0.0)
  else:
    hf["use_sliding_window"] = False
  if kind == "qwen3_moe":
    # intermediate_size is the width of dense layers, which this model has none of.
    hf.update(moe_intermediate_size=config.mlp_dim, num_experts=config.num_experts,
              num_experts_per_tok=config.experts_per_token,
              norm_topk_prob=config.normalize_routing or config.routing == "topk_softmax",
              decoder_sparse_step=1, mlp_only_layers=[], sliding_window=None)
  hf.update(extra or {})
  return hf


def read_json(path: str) -> Any:
  """The JSON document in `path`; invalid JSON is a ValueError naming the file and where."""
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as error:
    raise ValueError(f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: "
                     f"{error.msg}.") from error
  except UnicodeDecodeError as error:
    raise ValueError(f"{path}: not UTF-8 text ({error.reason}).") from error


def _weight_files(directory: str) -> list[str]:
  index = os.path.join(directory, _INDEX)
  if os.path.exists(index):
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
      raise ValueError(f"{index}: expected a JSON object with a 'weight_map' of tensor name "
                       "-> shard file name.")
    return [os.path.join(directory, s) for s in sorted(set(weight_map.values()))]
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
    try:
      with safe_open(path, framework="numpy") as f:
        for name in f.keys():
          tensors[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as error:
      raise ValueError(f"{path}: not a readable safetensors file (truncated or damaged?): "
                       f"{error}") from error
  return tensors


def layer_tensor_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]],
                                                      dict[str, tuple[int, ...]]]:
  """Shapes of one layer's tensors in checkpoint layout, by Arbor leaf name: the linear
  weights as torch stores them ([out, in]; Arbor keeps the transpose) and the vectors
  (norms, biases). Shared by the HF and GGUF readers, whose files use this layout. A
  mixture-of-experts config has no dense MLP (gate/up/down): its experts and router are
  read by `params_from_hf_tensors`."""
  c = config
  q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  linear = {"q": (q_width, c.d_model), "k": (kv_width, c.d_model), "v": (kv_width, c.d_model),
            "o": (c.d_model, q_width)}
  if not c.is_moe:
    linear.update(gate=(c.mlp_dim, c.d_model), up=(c.mlp_dim, c.d_model),
                  down=(c.d_model, c.mlp_dim))
  vector = {"attn_norm": (c.d_model,), "mlp_norm": (c.d_model,)}
  if c.qkv_bias:
    vector.update(q_bias=(q_width,), k_bias=(kv_width,), v_bias=(kv_width,))
  if c.qk_norm:
    vector.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
  return linear, vector


def params_from_hf_tensors(tensors: dict[str, np.ndarray], config: ModelConfig,
                           source: str = "checkpoint") -> dict[str, Any]:
  """Arbor's parameter pytree from HF-named tensors (see models/transformer.py).

  Raises ValueError for a tensor that is missing, misshapen or not finite, for tensors the
  config does not use (`check_all_used`), and for an `lm_head.weight` that disagrees with
  the config's tying (present and different from the embedding although tied).
  """
  dtype = config.jnp_dtype
  used = set()

  def take(name, shape):
    if name not in tensors:
      raise ValueError(f"{source}: tensor {name!r} is missing (wrong architecture or a "
                       "truncated checkpoint?).")
    value = tensors[name]
    if tuple(value.shape) != tuple(shape):
      raise ValueError(f"{source}: tensor {name!r} has shape {tuple(value.shape)}, config.json "
                       f"implies {tuple(shape)}.")
    value = np.asarray(value, np.float32)
    check_finite(value, name, source)
    used.add(name)
    return value

  c = config
  linear_shapes, vector_shapes = layer_tensor_shapes(c)
  layers = {}
  for leaf, shape in linear_shapes.items():
    stacked = [take(f"model.layers.{i}.{_LAYER_LINEAR[leaf]}", shape).T for i in range(c.n_layers)]
    layers[leaf] = jnp.asarray(np.stack(stacked), dtype)
  for leaf, shape in vector_shapes.items():
    stacked = [take(f"model.layers.{i}.{_LAYER_VECTOR[leaf]}", shape) for i in range(c.n_layers)]
    layers[leaf] = jnp.asarray(np.stack(stacked), dtype)
  if c.is_moe:
    experts = [_moe_layer(take, tensors, c, i) for i in range(c.n_layers)]
    for leaf in experts[0]:
      layers[leaf] = jnp.asarray(np.stack([layer[leaf] for layer in experts]), dtype)
  embed = take("model.embed_tokens.weight", (c.vocab_size, c.d_model))
  params = {"embed": jnp.asarray(embed, dtype), "layers": layers,
            "final_norm": jnp.asarray(take("model.norm.weight", (c.d_model,)), dtype)}
  if not c.tie_embeddings:
    if "lm_head.weight" not in tensors:
      raise ValueError(f"{source}: config.json says tie_word_embeddings=false but there is no "
                       "'lm_head.weight'; if the model shares its embedding with the output "
                       "layer, set tie_word_embeddings to true.")
    params["lm_head"] = jnp.asarray(take("lm_head.weight", (c.vocab_size, c.d_model)).T, dtype)
  elif "lm_head.weight" in tensors:
    # Some exporters write the tied matrix twice; a different one is an untied model.
    if not np.array_equal(np.asarray(tensors["lm_head.weight"], np.float32), embed):
      raise ValueError(f"{source}: config.json says tie_word_embeddings=true but "
                       "'lm_head.weight' differs from 'model.embed_tokens.weight'; the model "
                       "is untied: set tie_word_embeddings to false.")
    used.add("lm_head.weight")
  check_all_used(set(tensors), used, config, source)
  return params


def _moe_layer(take, tensors: dict[str, np.ndarray], config: ModelConfig, i: int
               ) -> dict[str, np.ndarray]:
  """Layer i's router [D, X] and experts (gate, up [X, D, F], down [X, F, D]) in Arbor's
  layout, through `take(name, shape)`, from the Hub's per-expert tensors or transformers
  5's fused ones (module docstring), whichever layer i holds."""
  c, kind = config, architecture_of(config)
  X, D, F = c.num_experts, c.d_model, c.mlp_dim
  prefix = f"model.layers.{i}."
  block = prefix + _MOE_BLOCK[kind]
  if prefix + _FUSED_GATE_UP in tensors:  # the router of both families is then mlp.gate
    layer = {"router": take(f"{prefix}mlp.gate.weight", (X, D)).T}
    gate_up = take(prefix + _FUSED_GATE_UP, (X, 2 * F, D))
    layer.update(expert_gate=gate_up[:, :F].transpose(0, 2, 1),
                 expert_up=gate_up[:, F:].transpose(0, 2, 1),
                 expert_down=take(prefix + _FUSED_DOWN, (X, D, F)).transpose(0, 2, 1))
    return layer
  layer = {"router": take(f"{block}.gate.weight", (X, D)).T}
  shapes = {"expert_gate": (F, D), "expert_up": (F, D), "expert_down": (D, F)}
  for leaf, name in _MOE_EXPERT[kind].items():
    layer[leaf] = np.stack([take(f"{block}.experts.{j}.{name}.weight", shapes[leaf]).T
                            for j in range(X)])
  return layer


def check_finite(value: np.ndarray, name: str, source: str) -> None:
  """Raises ValueError when `value` holds NaN or infinity (a damaged or diverged model)."""
  if not np.all(np.isfinite(value)):
    bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
    raise ValueError(f"{source}: tensor {name!r} has {bad} non-finite value(s) (NaN or inf); "
                     "refusing to load a damaged or diverged checkpoint.")


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.*)")
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


def check_all_used(names: set[str], used: set[str], config: ModelConfig, source: str) -> None:
  """Raises ValueError naming the tensors in the file that `config` leaves unused: Arbor
  would silently compute a different model (biases or norms dropped, layers cut off)."""
  unused = sorted(n for n in names - used if not n.endswith(_DERIVED_SUFFIXES))
  if not unused:
    return
  layers = {int(m.group(1)) for m in map(_LAYER_NAME.fullmatch, unused) if m}
  if layers and min(layers) >= config.n_layers:
    raise ValueError(f"{source}: the weights hold {max(layers) + 1} layers but config.json "
                     f"says num_hidden_layers={config.n_layers}; fix num_hidden_layers.")
  experts = {int(m.group(1)) for m in map(_EXPERT_NAME.search, unused) if m}
  if config.is_moe and experts and min(experts) >= config.num_experts:
    raise ValueError(f"{source}: the weights hold {max(experts) + 1} experts per layer but "
                     f"config.json says {config.num_experts}; fix num_experts "
                     "(num_local_experts).")
  hints = {"self_attn.q_proj.bias": "q/k/v biases are Qwen2's (model_type 'qwen2')",
           "q_norm.weight": "q/k norms are Qwen3's (model_type 'qwen3')",
           "k_norm.weight": "q/k norms are Qwen3's (model_type 'qwen3')"}
  if config.is_moe:
    hints["q_norm.weight"] = hints["k_norm.weight"] = (
        "q/k norms are Qwen3-MoE's (model_type 'qwen3_moe')")
  hint = next((h for key, h in hints.items() if any(n.endswith(key) for n in unused)), None)
  raise ValueError(
      f"{source}: {len(unused)} tensor(s) in the weights are not used by a "
      f"{architecture_of(config)} model with this config, e.g. {unused[:3]}"
      + (f"; {hint}: check config.json's model_type." if hint else
         "; the config does not describe these weights.")
      + " Loading would compute a different model, so Arbor refuses.")


def load_hf(directory: str, dtype: str = "float32") -> tuple[ModelConfig, dict[str, Any]]:
  """(ModelConfig, params) of a HF checkpoint folder, with parameters in `dtype`."""
  config_path = os.path.join(directory, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{directory}: no config.json; expected a Hugging Face checkpoint folder.")
  config = config_from_hf(read_json(config_path), dtype=dtype, source=config_path)
  return config, params_from_hf_tensors(read_safetensors(directory), config, source=directory)


def hf_tensors_from_params(params: dict[str, Any], config: ModelConfig) -> dict[str, np.ndarray]:
  """HF-named tensors ([out, in] linears, one tensor per layer, and per expert: the Hub's
  names, module docstring) from Arbor's pytree."""
  dtype = ml_dtypes.bfloat16 if config.dtype == "bfloat16" else np.float32
  as_np = lambda x: np.ascontiguousarray(np.asarray(x, np.float32).astype(dtype))
  tensors = {"model.embed_tokens.weight": as_np(params["embed"]),
             "model.norm.weight": as_np(params["final_norm"])}
  if not config.tie_embeddings:
    tensors["lm_head.weight"] = as_np(np.asarray(params["lm_head"]).T)
  kind = architecture_of(config)
  for leaf, stacked in params["layers"].items():
    stacked = np.asarray(stacked)
    for i in range(config.n_layers):
      if leaf == "router":
        tensors[f"model.layers.{i}.{_MOE_BLOCK[kind]}.gate.weight"] = as_np(stacked[i].T)
      elif leaf in ("expert_gate", "expert_up", "expert_down"):
        for j in range(config.num_experts):
          name = f"model.layers.{i}.{_MOE_BLOCK[kind]}.experts.{j}.{_MOE_EXPERT[kind][leaf]}"
          tensors[f"{name}.weight"] = as_np(stacked[i, j].T)
      elif leaf in _LAYER_LINEAR:
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
