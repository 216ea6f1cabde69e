"""Low-rank adapters (LoRA, Hu et al. 2021) as a pure transform of the parameter pytree.

A target projection W [L, D_in, D_out] of `models/transformer.py` (q, k, v, o, gate, up,
down) gets A [L, D_in, r] (normal, std 1/sqrt(D_in)) and B [L, r, D_out] (zeros); the
adapted policy uses

    W' = W + (alpha / r) * A @ B

merged into a full parameter pytree (`merge`), so the decoder, the sampler and `save_hf`
take it unchanged. B = 0 makes the adapted policy equal the base at initialisation.

Merged, not factored in the forward: the merge costs 2 * L * D_in * D_out * r FLOPs per
target (r / tokens of one forward's projection matmuls) and the sampler needs merged weights
anyway. Its price is in the backward: the gradient of a targeted W' is formed densely
([L, D_in, D_out]) before it is contracted to A and B, as it is for full fine-tuning, so
the step's compute is close to a full-weight step; the saving is in memory (no gradient,
Adam moments or update for base weights) and in the gradients of untargeted weights
(embedding, norms, untargeted projections), which are never computed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig

Params = dict[str, Any]
Adapters = dict[str, Any]  # {'layers': {target: {'a': [L, D_in, r], 'b': [L, r, D_out]}}}

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# The launcher's defaults (config.lora.alpha, config.lora.targets): every projection.
DEFAULT_ALPHA = 16.0


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r (> 0), alpha (the update is scaled by alpha / r), targets (names in TARGETS)."""
  rank: int
  alpha: float
  targets: tuple[str, ...]

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"LoRA rank = {self.rank!r} must be a positive integer "
                       "(config.lora.rank; 0 turns LoRA off).")
    if not self.alpha > 0:
      raise ValueError(f"LoRA alpha = {self.alpha!r} must be > 0 (config.lora.alpha).")
    targets = tuple(self.targets)
    unknown = sorted(set(targets) - set(TARGETS))
    if not targets or unknown or len(set(targets)) != len(targets):
      raise ValueError(f"LoRA targets = {targets!r}: name each projection once, from "
                       f"{TARGETS} (config.lora.targets).")
    object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @classmethod
  def from_settings(cls, settings) -> "LoraConfig | None":
    """The LoRA of a run's config.lora (any object with rank, alpha and target_names, as
    rl.settings' LoraSettings), or None when its rank is 0 (LoRA off)."""
    if not settings.rank:
      return None
    return cls(rank=settings.rank, alpha=float(settings.alpha), targets=settings.target_names)


def projection_shape(config: ModelConfig, target: str) -> tuple[int, int]:
  """(D_in, D_out) of one layer's projection `target`."""
  c = config
  q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  return {"q": (c.d_model, q_width), "k": (c.d_model, kv_width), "v": (c.d_model, kv_width),
          "o": (q_width, c.d_model), "gate": (c.d_model, c.mlp_dim),
          "up": (c.d_model, c.mlp_dim), "down": (c.mlp_dim, c.d_model)}[target]


def adapter_count(config: ModelConfig, lora: LoraConfig) -> int:
  """Trainable parameters: L * r * (D_in + D_out) summed over the targets."""
  return sum(config.n_layers * lora.rank * sum(projection_shape(config, t))
             for t in lora.targets)


def check_rank(config: ModelConfig, lora: LoraConfig) -> None:
  """Raises ValueError when r exceeds a target's smaller side (a full-rank update or more),
  or a mixture-of-experts model is given MLP targets (its experts take no adapters)."""
  mlp = sorted(set(lora.targets) & {"gate", "up", "down"})
  if config.is_moe and mlp:
    raise ValueError(f"LoRA targets {mlp} are dense-MLP projections; this model's MLPs are "
                     "mixtures of experts, which take no adapters: set config.lora.targets "
                     "to attention projections (q, k, v, o).")
  for target in lora.targets:
    d_in, d_out = projection_shape(config, target)
    if lora.rank > min(d_in, d_out):
      raise ValueError(f"LoRA rank {lora.rank} exceeds min(D_in, D_out) = {min(d_in, d_out)} of "
                       f"projection {target!r} [{d_in}, {d_out}]; lower config.lora.rank or "
                       "train full weights (config.lora.rank = 0).")


def init_adapters(config: ModelConfig, lora: LoraConfig, rng: jax.Array) -> Adapters:
  """A ~ normal(0, 1/D_in), B = 0, float32 (the adapters are trained in float32 whatever
  the model dtype: they are the optimiser's master weights)."""
  check_rank(config, lora)
  layers = {}
  for target, key in zip(lora.targets, jax.random.split(rng, len(lora.targets))):
    d_in, d_out = projection_shape(config, target)
    a = jax.random.normal(key, (config.n_layers, d_in, lora.rank), jnp.float32)
    layers[target] = {"a": a / math.sqrt(d_in),
                      "b": jnp.zeros((config.n_layers, lora.rank, d_out), jnp.float32)}
  return {"layers": layers}


def delta(adapter: dict, scale: float) -> jax.Array:
  """(alpha / r) * A @ B of one target, float32 [L, D_in, D_out]."""
  return scale * jnp.einsum("lir,lro->lio", adapter["a"], adapter["b"],
                            preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale",))
def merge(base: Params, adapters: Adapters, scale: float) -> Params:
  """The adapted parameters: each target W + scale * A @ B (summed in float32, stored in
  W's dtype); every other leaf is the base's."""
  layers = dict(base["layers"])
  for target, adapter in adapters["layers"].items():
    w = layers[target]
    layers[target] = (w.astype(jnp.float32) + delta(adapter, scale)).astype(w.dtype)
  return dict(base, layers=layers)
