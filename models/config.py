"""Configuration of the Llama / Qwen2 / Qwen3 decoder family and its mixture-of-experts
variants (Qwen3-MoE, Mixtral), with named presets."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and options of a decoder-only transformer.

  Fields:
    vocab_size: number of token ids.
    d_model: residual stream width.
    n_layers: decoder blocks (stacked and run under `lax.scan`).
    n_heads: query heads.
    n_kv_heads: key/value heads (grouped-query attention; divides n_heads).
    head_dim: width of one attention head.
    mlp_dim: hidden width of the SwiGLU MLP; in a mixture-of-experts model, of each expert
      (Qwen3-MoE's `moe_intermediate_size`, Mixtral's `intermediate_size`).
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    qkv_bias: add biases to the q/k/v projections (Qwen2).
    qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3).
    tie_embeddings: the output projection is the transposed input embedding.
    max_seq_len: longest sequence (prompt + completion) the KV cache is sized for.
    dtype: dtype of the parameters, the master weights the optimiser updates (its moments
      follow them): 'float32' or 'bfloat16'.
    compute_dtype: dtype of the matmuls, activations and KV cache ('' = `dtype`). Mixed
      precision is `dtype='float32', compute_dtype='bfloat16'`: each forward casts the
      weights to bfloat16 (the cast's gradient casts back, so gradients, master weights
      and AdamW moments stay float32), while norms, softmaxes, RoPE, logits and
      log-probs are computed in float32 whatever this is.
    remat: what the layer scan keeps for the backward of a training forward (no cache):
      'none' every activation, 'full' each layer's input only (the rest is recomputed),
      'dots' each layer's input and matmul outputs (`models.transformer.REMAT_POLICIES`).
    num_experts: 0 for a dense SwiGLU MLP in every block; otherwise every block's MLP is a
      mixture of this many SwiGLU experts (models/moe.py).
    experts_per_token: experts each token is routed to (top-k; MoE only).
    routing: 'softmax_topk' (Qwen3-MoE, Qwen2-MoE) or 'topk_softmax' (Mixtral).
    normalize_routing: with 'softmax_topk', divide the k weights by their sum (Qwen3-MoE's
      `norm_topk_prob`); False keeps the raw probabilities (Qwen2-MoE).
    shared_expert_dim: width of an always-on shared SwiGLU expert scaled by a sigmoid gate,
      as in Qwen2-MoE (0 = none).
    moe_dispatch: 'ragged' (capacity-free grouped matmul, `jax.lax.ragged_dot`) or 'dense'
      (every expert on every token: the reference, O(num_experts) compute).
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = True
  max_seq_len: int = 2048
  dtype: str = "float32"
  compute_dtype: str = ""
  remat: str = "none"
  num_experts: int = 0
  experts_per_token: int = 0
  routing: str = "softmax_topk"
  normalize_routing: bool = True
  shared_expert_dim: int = 0
  moe_dispatch: str = "ragged"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                 "head_dim", "mlp_dim", "max_seq_len"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}.")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads="
          f"{self.n_kv_heads} (grouped-query attention shares each KV head among "
          "n_heads / n_kv_heads query heads).")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE.")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"ModelConfig.dtype={self.dtype!r}: use 'float32' or 'bfloat16'.")
    if self.compute_dtype not in ("", "float32", "bfloat16"):
      raise ValueError(f"ModelConfig.compute_dtype={self.compute_dtype!r}: use '' (the "
                       "parameters' dtype), 'float32' or 'bfloat16'.")
    if self.remat not in ("none", "full", "dots"):
      raise ValueError(f"ModelConfig.remat={self.remat!r}: use 'none', 'full' or 'dots'.")
    self._check_experts()

  def _check_experts(self):
    if self.num_experts < 0 or self.experts_per_token < 0 or self.shared_expert_dim < 0:
      raise ValueError("ModelConfig.num_experts, experts_per_token and shared_expert_dim must "
                       "be >= 0.")
    if not self.num_experts:
      if self.experts_per_token or self.shared_expert_dim:
        raise ValueError(
            f"ModelConfig.experts_per_token={self.experts_per_token}, shared_expert_dim="
            f"{self.shared_expert_dim} need a mixture-of-experts model: set num_experts.")
      return
    if not 1 <= self.experts_per_token <= self.num_experts:
      raise ValueError(f"ModelConfig.experts_per_token={self.experts_per_token} must be in "
                       f"[1, num_experts={self.num_experts}].")
    if self.num_experts > 32767:
      raise ValueError(f"ModelConfig.num_experts={self.num_experts}: at most 32767 (expert "
                       "ids are recorded as int16).")
    if self.routing not in ("softmax_topk", "topk_softmax"):
      raise ValueError(f"ModelConfig.routing={self.routing!r}: use 'softmax_topk' "
                       "(Qwen3-MoE, Qwen2-MoE) or 'topk_softmax' (Mixtral).")
    if self.moe_dispatch not in ("ragged", "dense"):
      raise ValueError(f"ModelConfig.moe_dispatch={self.moe_dispatch!r}: use 'ragged' or "
                       "'dense'.")

  @property
  def is_moe(self) -> bool:
    """Whether the blocks' MLPs are mixtures of experts."""
    return self.num_experts > 0

  @property
  def expert_id_dtype(self):
    """The dtype expert ids are recorded in (the sampler's routing record): uint8 up to
    256 experts, else int16."""
    return jnp.dtype(jnp.uint8 if self.num_experts <= 256 else jnp.int16)

  @property
  def jnp_dtype(self):
    """The parameters' dtype."""
    return jnp.dtype(self.dtype)

  @property
  def compute_jnp_dtype(self):
    """The dtype of matmul inputs, activations and the KV cache."""
    return jnp.dtype(self.compute_dtype or self.dtype)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


PRESETS = {
    # The smallest shape that still takes every branch the model code has (two layers,
    # grouped-query attention: 2 query heads over 1 key/value head, a gated MLP, tied
    # embeddings): smoke runs and the tests' launcher runs, which check what a run does,
    # not what it learns (it learns little).
    "micro": ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                         head_dim=16, mlp_dim=64, max_seq_len=64, tie_embeddings=True),
    # From-scratch runs on the built-in character-level arithmetic tasks (~1M params).
    "tiny": ModelConfig(vocab_size=64, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                        head_dim=32, mlp_dim=512, max_seq_len=64, tie_embeddings=True),
    # Two layers (~0.5M params): the running_sum testbed's policy, which learns that
    # task's procedure in fewer seconds than "tiny" (1.7x faster per step). RoPE base 100,
    # not 10000: over ~120 positions more of each head's frequencies turn, so attending a
    # fixed 11 tokens back (the previous state) is found sooner; with 10000 the warm
    # start stalled on its first plateau in some seeds (docs/testbed.md).
    "tiny2": ModelConfig(vocab_size=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=32, mlp_dim=512, max_seq_len=64, tie_embeddings=True,
                         rope_theta=100.0),
    # Benchmark B1 shape (docs/benchmarks.md).
    "b1": ModelConfig(vocab_size=1024, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                      head_dim=64, mlp_dim=1024, qkv_bias=True, tie_embeddings=False,
                      rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=512),
    # HuggingFaceTB/SmolLM2-135M(-Instruct).
    "smollm2_135m": ModelConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                                n_kv_heads=3, head_dim=64, mlp_dim=1536, rope_theta=100000.0,
                                norm_eps=1e-5, tie_embeddings=True, max_seq_len=2048),
    # Qwen/Qwen2.5-0.5B(-Instruct).
    "qwen2_5_0_5b": ModelConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                                n_kv_heads=2, head_dim=64, mlp_dim=4864, rope_theta=1000000.0,
                                norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                                max_seq_len=32768),
    # Shapes only (the memory planner, experiments/memory.py): Qwen/Qwen2.5-1.5B and 7B,
    # meta-llama/Llama-3.1-8B, from their config.json files.
    "qwen2_5_1_5b": ModelConfig(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                                n_kv_heads=2, head_dim=128, mlp_dim=8960, rope_theta=1000000.0,
                                norm_eps=1e-6, qkv_bias=True, tie_embeddings=True,
                                max_seq_len=32768),
    "qwen2_5_7b": ModelConfig(vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                              n_kv_heads=4, head_dim=128, mlp_dim=18944, rope_theta=1000000.0,
                              norm_eps=1e-6, qkv_bias=True, tie_embeddings=False,
                              max_seq_len=32768),
    "llama3_1_8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                               n_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=500000.0,
                               norm_eps=1e-5, tie_embeddings=False, max_seq_len=131072),
    # Mixture-of-experts presets. tiny2_moe: the testbed's MoE policy, tiny2 with each
    # MLP replaced by 8 experts of width 256, top 2: the same MLP width per token as tiny2.
    "tiny2_moe": ModelConfig(vocab_size=64, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=32, mlp_dim=256, max_seq_len=64, tie_embeddings=True,
                             rope_theta=100.0, num_experts=8, experts_per_token=2),
    # Shapes only (the memory planner): Qwen/Qwen3-30B-A3B and
    # mistralai/Mixtral-8x7B-v0.1, from their config.json files.
    "qwen3_30b_a3b": ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                                 n_kv_heads=4, head_dim=128, mlp_dim=768, rope_theta=1000000.0,
                                 norm_eps=1e-6, qk_norm=True, tie_embeddings=False,
                                 max_seq_len=40960, num_experts=128, experts_per_token=8),
    "mixtral_8x7b": ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                                n_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=1000000.0,
                                norm_eps=1e-5, tie_embeddings=False, max_seq_len=32768,
                                num_experts=8, experts_per_token=2, routing="topk_softmax"),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """Returns the named preset, with fields replaced by `overrides`."""
  if name not in PRESETS:
    raise ValueError(f"Unknown model preset {name!r}; known presets: {sorted(PRESETS)}.")
  return PRESETS[name].replace(**overrides)
