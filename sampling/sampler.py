"""Prefill + decode as one jitted loop over an explicit sampler state.

Layout: every row holds a left-padded prompt in slots [0, P) and its completion in slots
[P, P + N). All rows write the same slot at each decode step, so the KV cache index is a
scalar; per-row RoPE positions count real tokens, so left padding does not shift them.

The state is a pytree (`SamplerState`): a loop can stop mid-sequence and resume later
(partial rollouts), and rows can be gathered/copied (tree rollouts fork KV rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import chex
import flax.struct
import jax
import jax.numpy as jnp

from models import transformer
from models.config import ModelConfig
from sampling.logits import sample_tokens


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to decode.

  Fields:
    max_new_tokens: completion slots N per row.
    temperature: softmax temperature; 0 is greedy.
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus mass (1.0 = off).
    stop_tokens: ids that end a row (the stop token is part of the completion).
    pad_id: id written into slots after a row has stopped.
  """
  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"SamplingConfig.max_new_tokens must be positive, got {self.max_new_tokens}.")
    if self.temperature < 0:
      raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}.")


@flax.struct.dataclass
class SamplerState:
  """Everything a decode loop needs to continue. S = P + N slots per row.

  tokens [B, S] ids; token_mask [B, S] real tokens (prompt or generated);
  prompt_len: P (static); behavior_logp [B, S] sampler log-prob of each generated token
  (0 elsewhere); version [B, S] parameter version that generated each token (-1 for the
  prompt and empty slots); done [B] rows that emitted a stop token; step: decode steps
  taken (next completion slot is P + step); next_logits [B, V] logits for the next token;
  next_position [B] RoPE position of the next token; cache: KV cache of S slots; rng.
  """
  tokens: jax.Array
  token_mask: jax.Array
  behavior_logp: jax.Array
  version: jax.Array
  done: jax.Array
  step: jax.Array
  next_logits: jax.Array
  next_position: jax.Array
  cache: dict
  rng: jax.Array
  prompt_len: int = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class Generation:
  """A finished (or stopped) batch of sequences, ready to be scored.

  tokens [B, S]; prompt_mask / completion_mask [B, S]; behavior_logp [B, S];
  version [B, S]; completion_len [B]; stopped [B] (emitted a stop token, as opposed to
  running out of slots); decode_steps: loop iterations run (scalar).
  """
  tokens: jax.Array
  prompt_mask: jax.Array
  completion_mask: jax.Array
  behavior_logp: jax.Array
  version: jax.Array
  completion_len: jax.Array
  stopped: jax.Array
  decode_steps: jax.Array


def prefill(params, prompt_tokens: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
            model_config: ModelConfig, sampling_config: SamplingConfig) -> SamplerState:
  """Runs the prompts [B, P] (left-padded) through the model and returns a fresh state."""
  chex.assert_rank([prompt_tokens, prompt_mask], 2)
  batch, prompt_len = prompt_tokens.shape
  slots = prompt_len + sampling_config.max_new_tokens
  pad = ((0, 0), (0, sampling_config.max_new_tokens))
  tokens = jnp.pad(prompt_tokens.astype(jnp.int32), pad, constant_values=sampling_config.pad_id)
  token_mask = jnp.pad(prompt_mask.astype(bool), pad)
  positions = transformer.positions_from_mask(prompt_mask)
  cache = transformer.init_cache(model_config, batch, slots)
  logits, cache = transformer.forward(params, prompt_tokens, positions, token_mask, model_config,
                                      cache=cache, cache_index=0)
  return SamplerState(
      tokens=tokens, token_mask=token_mask,
      behavior_logp=jnp.zeros((batch, slots), jnp.float32),
      version=jnp.full((batch, slots), -1, jnp.int32),
      done=jnp.zeros((batch,), bool), step=jnp.zeros((), jnp.int32),
      next_logits=logits[:, -1], next_position=positions[:, -1] + 1,
      cache=cache, rng=rng, prompt_len=prompt_len)


def _advance(state: SamplerState, version: jax.Array, sampling_config: SamplingConfig,
             forward) -> SamplerState:
  """One decode step; forward(token [B,1], position [B,1], kv_mask [B,S], cache, slot)."""
  rng, key = jax.random.split(state.rng)
  token, logp = sample_tokens(key, state.next_logits, sampling_config.temperature,
                              sampling_config.top_k, sampling_config.top_p)
  live = ~state.done
  token = jnp.where(live, token, sampling_config.pad_id)
  slot = state.prompt_len + state.step
  write = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, slot, axis=1)
  token_mask = write(state.token_mask, live)
  stop_ids = jnp.asarray(sampling_config.stop_tokens, jnp.int32)
  stopped = live & jnp.isin(token, stop_ids) if sampling_config.stop_tokens else jnp.zeros_like(live)
  logits, cache = forward(token[:, None], state.next_position[:, None], token_mask, state.cache,
                          slot)
  return state.replace(
      tokens=write(state.tokens, token),
      token_mask=token_mask,
      behavior_logp=write(state.behavior_logp, jnp.where(live, logp, 0.0)),
      version=write(state.version, jnp.where(live, version, -1).astype(jnp.int32)),
      done=state.done | stopped,
      step=state.step + 1,
      next_logits=logits[:, 0],
      next_position=state.next_position + live.astype(jnp.int32),
      cache=cache, rng=rng)


def decode_step(params, state: SamplerState, version: jax.Array, model_config: ModelConfig,
                sampling_config: SamplingConfig) -> SamplerState:
  """Samples one token for every live row, writes it, and advances the cache."""
  forward = lambda token, position, kv_mask, cache, slot: transformer.forward(
      params, token, position, kv_mask, model_config, cache=cache, cache_index=slot)
  return _advance(state, version, sampling_config, forward)


def decode(params, state: SamplerState, version: jax.Array, model_config: ModelConfig,
           sampling_config: SamplingConfig, max_steps: jax.Array | int | None = None, *,
           position_limit: jax.Array | None = None,
           until: Callable[[SamplerState], jax.Array] | None = None) -> SamplerState:
  """Decodes until every row is done, the slots run out, or `max_steps` more steps.

  Each step equals `decode_step`; inside the loop the KV cache is held per layer in the
  decode layout (`transformer.to_decode_cache`) and the layers run unrolled
  (`transformer.forward_decode`), so a step writes only its new slots and never copies
  or transposes a layer's cache. The state's cache is converted once on entry and exit.

  Two optional early stops serve partial rollouts (sampling/partial.py):
    position_limit [B]: a row also finishes once its next RoPE position reaches this
      (a per-row length budget, for rows that resume part-way through their completion).
    until: a predicate of the state (traced inside the loop); decoding stops as soon as it
      is true, e.g. "the target number of complete groups is reached" (APRIL).
  """
  total = state.tokens.shape[1] - state.prompt_len
  limit = total if max_steps is None else jnp.minimum(total, state.step + max_steps)
  layers = transformer.unstack_layers(params)
  forward = lambda token, position, kv_mask, cache, slot: transformer.forward_decode(
      layers, token, position, kv_mask, model_config, cache, slot)

  def exhausted(s):
    if position_limit is None:
      return s
    return s.replace(done=s.done | (s.next_position >= position_limit))

  def cond(s):
    keep_going = (s.step < limit) & ~jnp.all(s.done)
    return keep_going if until is None else keep_going & ~until(s)

  def body(s):
    return exhausted(_advance(s, version, sampling_config, forward))

  state = exhausted(state.replace(cache=transformer.to_decode_cache(state.cache)))
  state = jax.lax.while_loop(cond, body, state)
  return state.replace(cache=transformer.from_decode_cache(state.cache))


def to_generation(state: SamplerState) -> Generation:
  """The state's sequences as a `Generation` (rows still running count as unstopped)."""
  slots = jnp.arange(state.tokens.shape[1])
  is_completion = slots[None, :] >= state.prompt_len
  completion_mask = state.token_mask & is_completion
  return Generation(
      tokens=state.tokens, prompt_mask=state.token_mask & ~is_completion,
      completion_mask=completion_mask, behavior_logp=state.behavior_logp,
      version=state.version, completion_len=completion_mask.sum(axis=1).astype(jnp.int32),
      stopped=state.done, decode_steps=state.step)


def sample(params, prompt_tokens: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
           model_config: ModelConfig, sampling_config: SamplingConfig,
           version: jax.Array | int = 0,
           constrain: Callable[[SamplerState], SamplerState] | None = None) -> Generation:
  """Samples completions for left-padded prompts [B, P]: prefill, then the decode loop.

  Pure and un-jitted (`generate` is its jit). `version` is recorded on every generated
  token. `constrain`, if given, is applied to the state after prefill, before the loop
  carries it: the hook through which a caller pins the state's layout (e.g. a sharding
  constraint on the KV cache) without this module knowing about devices.
  """
  state = prefill(params, prompt_tokens, prompt_mask, rng, model_config, sampling_config)
  if constrain is not None:
    state = constrain(state)
  state = decode(params, state, jnp.asarray(version, jnp.int32), model_config, sampling_config)
  return to_generation(state)


@functools.partial(jax.jit, static_argnames=("model_config", "sampling_config"))
def generate(params, prompt_tokens: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
             model_config: ModelConfig, sampling_config: SamplingConfig,
             version: jax.Array | int = 0) -> Generation:
  """Samples completions for left-padded prompts [B, P]; one jitted prefill + decode loop.

  `version` (the parameter version, traced so it never recompiles) is recorded on every
  generated token.
  """
  return sample(params, prompt_tokens, prompt_mask, rng, model_config, sampling_config, version)
