"""Reference models for checkpoint tests: tiny random transformers models and logits.

Weights are scaled up (std 0.25) and norms and biases randomised, so logits are large and
any layout mistake (transposes, RoPE halves, GQA head order, q/k norms) shows.
"""

import jax.numpy as jnp
import numpy as np
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
}


def random_hf_model(kind: str, seed: int = 0):
  """A random transformers model of `kind` (llama / qwen2 / qwen3), in eval mode."""
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
