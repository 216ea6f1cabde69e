"""Mixture-of-experts MLP: top-k routing, grouped-matmul dispatch, auxiliary losses, and the
routing-replay rule (the MoE block of Qwen3-MoE / Mixtral decoders).

A token's router logits z [E] choose k experts and their weights:

* `softmax_topk` (Qwen3-MoE, Qwen2-MoE): p = softmax(z), the k largest p; with
  `normalize=True` (Qwen3-MoE's `norm_topk_prob`) the k weights are divided by their sum,
  else they are the probabilities themselves (Qwen2-MoE).
* `topk_softmax` (Mixtral): the k largest logits, weights softmax over those k. This equals
  `softmax_topk` with normalize=True (softmax then renormalising over a subset is the
  softmax over that subset); both are kept because the families' configs name them.

The expert MLPs are SwiGLU, experts' weights stacked: gate, up [E, D, F], down [E, F, D].
`experts_ragged` dispatches capacity-free: every (token, expert) pair, sorted by expert,
through `jax.lax.ragged_dot` (a grouped matmul: no token is dropped, no capacity padding),
then combined back with the routing weights; `experts_dense` computes every expert for
every token and combines with one-hot weights, the O(E) reference it is tested against.

Routing replay (R3, arXiv 2510.11370; `replay_weights`): the trainer's forward takes the
experts the sampler chose for each token and layer, and weighs them by its own router's
probabilities renormalised over those experts (softmax of its logits restricted to them), so
gradients still reach the router through the weights while the expert choice is the
sampler's. R3 states the rule for renormalising families (Qwen3-MoE, Mixtral); for
`softmax_topk` without normalisation (Qwen2-MoE) we replay the family's own weighting, the
full softmax's probabilities at the replayed experts (our choice: replaying the router's
own top-k then reproduces its own forward exactly, as it does for the other families).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROUTINGS = ("softmax_topk", "topk_softmax")


def route(logits: jax.Array, k: int, routing: str, normalize: bool = True
          ) -> tuple[jax.Array, jax.Array]:
  """The experts [N, k] int32 each token chooses (descending weight) and their weights
  [N, k] float32, from router logits [N, E] (module docstring). Ties go to the lower
  expert index (`jax.lax.top_k`)."""
  if routing not in ROUTINGS:
    raise ValueError(f"MoE routing {routing!r}: use one of {ROUTINGS}.")
  logits = logits.astype(jnp.float32)
  if routing == "topk_softmax":
    top, experts = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), experts
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / weights.sum(axis=-1, keepdims=True)
  return weights, experts


def replay_weights(logits: jax.Array, experts: jax.Array, routing: str = "softmax_topk",
                   normalize: bool = True) -> jax.Array:
  """R3's weights [N, k] for the given (replayed) experts [N, k] from router logits [N, E]:
  the router's probabilities renormalised over those experts (softmax of the logits
  gathered there); for `softmax_topk` without normalisation, the full softmax's
  probabilities there (module docstring)."""
  logits = logits.astype(jnp.float32)
  experts = experts.astype(jnp.int32)
  if routing == "softmax_topk" and not normalize:
    return jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), experts, axis=-1)
  return jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1)


def _swiglu(x, gate, up, down):
  return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def experts_dense(h: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
                  up: jax.Array, down: jax.Array) -> jax.Array:
  """Every expert on every token [N, D], combined with the routing weights (zero for the
  experts a token did not choose): the reference dispatch."""
  num_experts = gate.shape[0]
  combine = (jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)
             * weights[..., None]).sum(axis=1)  # [N, E]
  outputs = jax.vmap(lambda g, u, d: _swiglu(h, g, u, d), out_axes=1)(gate, up, down)
  return jnp.einsum("ne,ned->nd", combine.astype(outputs.dtype), outputs)


def experts_ragged(h: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
                   up: jax.Array, down: jax.Array) -> jax.Array:
  """The chosen experts only [N, D]: the N * k (token, expert) pairs sorted by expert, each
  expert's run through its weights by `jax.lax.ragged_dot`, the outputs weighted and summed
  back per token. Capacity-free: no pair is dropped."""
  num_tokens, k = experts.shape
  num_experts = gate.shape[0]
  flat_experts = experts.reshape(-1)
  order = jnp.argsort(flat_experts, stable=True)
  token = order // k
  sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
  x = h[token]
  hidden = (jax.nn.silu(jax.lax.ragged_dot(x, gate, sizes))
            * jax.lax.ragged_dot(x, up, sizes))
  out = jax.lax.ragged_dot(hidden.astype(down.dtype), down, sizes)
  weight = weights.reshape(-1)[order].astype(out.dtype)
  return jnp.zeros((num_tokens, out.shape[-1]), out.dtype).at[token].add(out * weight[:, None])


def load_balancing_loss(logits: jax.Array, experts: jax.Array, mask: jax.Array | None = None
                        ) -> jax.Array:
  """The Switch / Mixtral auxiliary loss E * sum_e f_e * P_e over the tokens in `mask`
  [N] (all when None): f_e the share of (token, choice) pairs routed to expert e, P_e the
  mean router probability of e. 1.0 for perfectly uniform routing."""
  num_experts = logits.shape[-1]
  mask = jnp.ones(logits.shape[0], bool) if mask is None else mask
  m = mask.astype(jnp.float32)
  count = jnp.maximum(m.sum(), 1.0)
  chosen = (jax.nn.one_hot(experts, num_experts) * m[:, None, None]).sum(axis=(0, 1))
  share = chosen / (count * experts.shape[-1])
  probs = (jax.nn.softmax(logits.astype(jnp.float32), axis=-1) * m[:, None]).sum(0) / count
  return num_experts * jnp.sum(share * probs)


def router_z_loss(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """ST-MoE's router z-loss: the mean over tokens in `mask` of logsumexp(z)^2."""
  mask = jnp.ones(logits.shape[0], bool) if mask is None else mask
  z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2
  return jnp.sum(jnp.where(mask, z, 0.0)) / jnp.maximum(mask.sum(), 1)
