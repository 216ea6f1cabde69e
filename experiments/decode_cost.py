"""The arithmetic behind the benchmarks: matmul FLOPs per generated token (B1,
experiments/bench_sampler.py) and per trained token (B2, B10), KV-cache bytes per
generated token, and the flat-cost ratio next to the ceiling that the
machine's memory bandwidth allows. Kept apart from the benchmark so that it imports no
flags (tests check it against hand-computed cases)."""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig
from sampling import sampler
from sampling.sampler import SamplingConfig


def mlp_weights_per_token(config: ModelConfig) -> int:
  """Weights one token multiplies by in one block's MLP: the SwiGLU's 3 * D * F; in a
  mixture of experts, only its k routed experts' (3 * D * F each), the router's D * X and a
  shared expert's 3 * D * S + D (its sigmoid gate)."""
  c = config
  if not c.is_moe:
    return 3 * c.d_model * c.mlp_dim
  shared = 3 * c.d_model * c.shared_expert_dim + c.d_model if c.shared_expert_dim else 0
  return (c.experts_per_token * 3 * c.d_model * c.mlp_dim + c.d_model * c.num_experts
          + shared)


def decode_flops_per_token(config: ModelConfig, context: float) -> float:
  """Matmul FLOPs to generate one token with `context` tokens already in the cache."""
  c = config
  attn_proj = c.d_model * (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim
  mlp = mlp_weights_per_token(c)
  attention = 2 * c.n_heads * c.head_dim * context
  return 2 * (c.n_layers * (attn_proj + mlp + attention) + c.d_model * c.vocab_size)


def train_flops_per_token(config: ModelConfig, context: float) -> float:
  """Matmul FLOPs of forward + backward (3x forward) per token at mean `context`."""
  c = config
  attn_proj = c.d_model * (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim
  mlp = mlp_weights_per_token(c)
  attention = 2 * c.n_heads * c.head_dim * context
  return 3 * 2 * (c.n_layers * (attn_proj + mlp + attention) + c.d_model * c.vocab_size)


def kv_bytes_per_token(config: ModelConfig) -> int:
  """KV-cache bytes one token occupies: keys and values of every layer and KV head."""
  itemsize = config.compute_jnp_dtype.itemsize  # the cache holds activations
  return 2 * config.n_layers * config.n_kv_heads * config.head_dim * itemsize


def kv_read_per_token(config: ModelConfig, prompt_len: int, new_tokens: int) -> float:
  """KV-cache bytes one generated token's decode step reads, averaged over the completion:
  step s attends over prompt_len + the end of its phase (`sampler.phase_ends`) slots."""
  ends = sampler.phase_ends(new_tokens, SamplingConfig.phase_tokens)
  slots = [prompt_len + next(end for end in ends if step < end) for step in range(new_tokens)]
  return kv_bytes_per_token(config) * float(np.mean(slots))


def flat_cost(result: dict, batch: int) -> dict | None:
  """Arbor's greedy tokens/s at the longest completion over the shortest, at `batch`, next
  to the ratio a memory-bandwidth floor allows: each token costing the shortest case's
  time plus reading its extra KV cache once at the measured stream bandwidth."""
  rows = sorted((c for c in result["cases"] if c["batch"] == batch and c["temperature"] == 0),
                key=lambda c: c["new_tokens"])
  if len(rows) < 2:
    return None
  short, long = rows[0], rows[-1]
  seconds = 1 / short["arbor"]["tokens_per_s"]
  extra = (long["kv_read_per_token"] - short["kv_read_per_token"]) / result["stream_bandwidth"]
  return dict(batch=batch, short=short["new_tokens"], long=long["new_tokens"],
              measured=long["arbor"]["tokens_per_s"] / short["arbor"]["tokens_per_s"],
              bandwidth_floor=seconds / (seconds + extra))
