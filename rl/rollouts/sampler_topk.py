"""The sampler's top-K distribution per token, the record score centering reads.

Score centering (`rl.objectives.corrections.score_centering`) subtracts the expected score
under the distribution that drew each token, so it needs that distribution: the sampler's
log-probs of the K tokens it found most likely at every completion slot
(`rl.types.SamplerTopK`). Tunix has vLLM return them with each token; here the producer
that sampled a batch scores the batch once more with the same parameters (the published,
possibly quantised, sampler weights: `LoopContext.publish`) in one teacher-forced forward,
right after sampling, so the record travels with the batch through staleness and
asynchronous training like its behaviour log-probs.

A full forward rounds differently from the decode steps that drew the tokens (1e-7 in
float32); the record's log-prob of a sampled token equals its `behavior_logp` up to that.
The distribution recorded is the one sampled from: softmax(logits / T), restricted to the
top-k / top-p set (`sampling.logits.sampled_weights`), renormalised.

Rows must have been sampled with one parameter version: partial rollouts (tokens of
several versions in one row) and AR3PO's reused responses are refused by the launcher.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import transformer
from models.config import ModelConfig
from rl import stages
from rl.objectives import losses
from rl.types import Rollout, SamplerTopK
from sampling import logits as logits_lib


def topk_of_logits(logits: jax.Array, k: int, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> SamplerTopK:
  """The K most likely tokens of the distribution sampled from `logits` [..., V] and their
  log-probs (tokens outside the top-k / top-p set: -inf). k <= V."""
  weights, shifted = logits_lib.sampled_weights(logits, temperature, top_k, top_p)
  logq = jnp.where(weights > 0, shifted - jnp.log(jnp.sum(weights, axis=-1, keepdims=True)),
                   -jnp.inf)
  values, ids = jax.lax.top_k(logq, k)
  return SamplerTopK(ids=ids.astype(jnp.int32), logp=values)


@functools.partial(jax.jit, static_argnames=("model_config", "k", "temperature", "top_k",
                                             "top_p"))
def sampler_topk(params, tokens: jax.Array, token_mask: jax.Array, model_config: ModelConfig,
                 k: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplerTopK:
  """The record [B, T, K] of rows `tokens` [B, T] (real slots `token_mask`) under `params`:
  at slot t, the distribution the logits of slot t - 1 define (slot 0: that of slot 0,
  never read). K = min(k, V)."""
  positions = transformer.positions_from_mask(token_mask)
  logits, _ = transformer.forward(params, tokens, positions, token_mask, model_config)
  logits = jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)  # slot t <- slot t - 1
  return topk_of_logits(logits, min(k, model_config.vocab_size), temperature, top_k, top_p)


def record_stage(model_config: ModelConfig, loss, rollout) -> stages.Stage | None:
  """The sampler's record as a batch stage (`rl.stages`), run with the parameters that
  sampled the batch, when a correction of `loss` (a LossSettings) reads it: loss.sc_top_k
  tokens (0: the whole vocabulary) of the distribution `rollout` (the RolloutSettings)
  samples. None when no correction reads it. It needs every row to have been sampled by
  those parameters (a partial pool's continued rows and AR3PO's reused responses were
  not)."""
  if not losses.reads_sampler_topk(loss):
    return None
  record = functools.partial(with_sampler_topk, model_config=model_config,
                             k=loss.sc_top_k or model_config.vocab_size,
                             temperature=rollout.temperature, top_k=rollout.top_k,
                             top_p=rollout.top_p)

  def apply(batch, stats, state, *, params, **extras):
    del extras
    return record(params, batch), stats, state

  return stages.Stage(
      init=lambda: None, apply=apply, name="the sampler's top-K record (score centering)",
      declares=stages.Declaration(needs=frozenset({stages.SAMPLED_BY_PRODUCING_PARAMS}),
                                  writes=frozenset({"behavior_topk"})))


def with_sampler_topk(params, rollout: Rollout, model_config: ModelConfig, k: int,
                      temperature: float, top_k: int = 0, top_p: float = 1.0) -> Rollout:
  """`rollout` with its `behavior_topk` record under the sampler's `params`."""
  if temperature <= 0:
    raise ValueError("Score centering needs sampled rollouts (config.rollout.temperature "
                     "> 0): a greedy sampler's distribution is a point mass.")
  record = sampler_topk(params, rollout.tokens, rollout.token_mask, model_config, k,
                        temperature, top_k, top_p)
  return rollout.replace(behavior_topk=record)
