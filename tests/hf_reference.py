"""Reference models for checkpoint tests: tiny random transformers models and logits.

Weights are scaled up (std 0.25) and norms and biases randomised, so logits are large and
any layout mistake (transposes, RoPE halves, GQA head order, q/k norms) shows.
"""

import jax.numpy as jnp
import numpy as np
import tokenizers
from tokenizers import decoders, models as tok_models, pre_tokenizers, processors, trainers
import torch
import transformers

from models import transformer
from models.config import ModelConfig

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rms_norm_eps=1e-5)
_HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, rope_theta=10000.0,
                                              tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, rope_theta=1e6,
                                              tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=24, rope_theta=1e6,
                                              tie_word_embeddings=False),
    # Mixtures of experts: 8 (Qwen3-MoE) or 6 (Mixtral) experts of width 48, top 2; the
    # router weights get the same std-0.25 draw as the rest, so routing is far from uniform.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, head_dim=24, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3_moe_unnormalized": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, rope_theta=1e6, tie_word_embeddings=True),
    "mixtral": lambda: transformers.MixtralConfig(
        **dict(_COMMON, intermediate_size=48), num_local_experts=6, num_experts_per_tok=2,
        rope_theta=1e6, tie_word_embeddings=False),
}


def random_hf_model(kind: str, seed: int = 0):
  """A random transformers model of `kind` (llama / qwen2 / qwen3, or the mixtures of
  experts qwen3_moe / qwen3_moe_unnormalized / mixtral), in eval mode."""
  torch.manual_seed(seed)
  config = _HF_CONFIGS[kind]()
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1.0 + 0.5 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.5 * torch.randn_like(p))
      else:
        p.copy_(0.25 * torch.randn_like(p))
  return model.eval()


def random_tokens(vocab: int, batch: int = 2, length: int = 11, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def arbor_logits(params, config: ModelConfig, tokens: np.ndarray) -> np.ndarray:
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  logits, _ = transformer.forward(params, jnp.asarray(tokens), positions,
                                  jnp.ones((b, t), bool), config)
  return np.asarray(logits)


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|sys|>' + message['content'] + eos_token }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def save_bpe_tokenizer(path, add_bos: bool) -> transformers.PreTrainedTokenizerFast:
  """Saves a small byte-level BPE tokenizer (300 ids; <s> 0, </s> 1, <pad> 2) with a chat
  template to `path` through transformers, and returns transformers' reload of it."""
  tok = tokenizers.Tokenizer(tok_models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|sys|>"]
  tok.train_from_iterator(
      ["What is 4 + 17? It is 21.", "hello world again and again"] * 4,
      trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if add_bos:
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                              eos_token="</s>", pad_token="<pad>")
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(path)
  return transformers.PreTrainedTokenizerFast.from_pretrained(path)


def save_tiny_hf_model(path, family: str, add_bos: bool, max_position_embeddings: int = 256):
  """A tiny random `family` ("llama" or "qwen2") causal LM (one layer, width 32) with the
  `save_bpe_tokenizer` tokenizer, saved to `path` as Hugging Face saves it; returns `path`.
  The weights come from a fixed torch seed, so a test sees the same model here and in CI."""
  tokenizer = save_bpe_tokenizer(path, add_bos=add_bos)
  config_class, model_class = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
  config = config_class(
      vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=2, num_key_value_heads=1,
      max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
      bos_token_id=0, eos_token_id=1, pad_token_id=2)
  with torch.random.fork_rng():
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
  return path
