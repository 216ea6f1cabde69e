"""Prefill + decode as one jitted loop over an explicit sampler state.

Layout: every row holds a left-padded prompt in slots [0, P) and its completion in slots
[P, P + N). All rows write the same slot at each decode step, so the KV cache index is a
scalar; per-row RoPE positions count real tokens, so left padding does not shift them.

The state is a pytree (`SamplerState`): a loop can stop mid-sequence and resume later
(partial rollouts), and rows can be gathered/copied (tree rollouts fork KV rows).

This module is also the decode core that every sampling policy shares: `write_token` (the
token step: write a sampled token, its behaviour log-prob and version, detect stops, run the
model on it) and `make_generation` (the one trajectory type, `Generation`). Plain sampling
(`decode`), tree rollouts (sampling/tree.py) and partial rollouts (sampling/partial.py)
differ only in how they pick rows, keys and slots around them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import chex
import flax.struct
import jax
import jax.numpy as jnp

from models import transformer
from models.config import ModelConfig
from sampling.logits import greedy_tokens, sample_tokens, sample_with_uniform


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
    phase_tokens: the decode loop runs in phases ending after this many completion
      tokens, twice that, four times, ...; a phase attends only over the cache slots it
      can have filled (0 = one phase over all slots). See `decode`.
    compact_min_rows: from the second phase on, live rows are gathered into the narrowest
      of batch, batch/2, batch/4 rows that holds them, never narrower than this
      (0 = never compact).
    The two phase fields shape the lockstep loop (`decode`: plain and partial rollouts);
    they change its cost, never its output. Tree rollouts (sampling/tree.py) decode each
    row at its own slot and do not use them.
  """
  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  pad_id: int = 0
  phase_tokens: int = 64
  compact_min_rows: int = 8

  def __post_init__(self):
    if self.max_new_tokens <= 0:
      raise ValueError(f"SamplingConfig.max_new_tokens must be positive, got {self.max_new_tokens}.")
    if self.temperature < 0:
      raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}.")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k < 0:
      raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}.")
    if self.phase_tokens < 0:
      raise ValueError(f"SamplingConfig.phase_tokens must be >= 0 (0 = one phase), got "
                       f"{self.phase_tokens}.")
    if self.compact_min_rows < 0:
      raise ValueError(f"SamplingConfig.compact_min_rows must be >= 0 (0 = never compact), "
                       f"got {self.compact_min_rows}.")


@flax.struct.dataclass
class SamplerState:
  """Everything a decode loop needs to continue. S = P + N slots per row.

  tokens [B, S] ids; token_mask [B, S] real tokens (prompt or generated);
  prompt_len: P (static); behavior_logp [B, S] log-prob each generated token was drawn
  with, top-k / top-p truncation included (`sampling.logits.sample_tokens`; 0 elsewhere);
  version [B, S] parameter version that generated each token (-1 for the
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
class TreePaths:
  """What a tree rollout (sampling/tree.py) adds to its `Generation`, whose rows are
  root-to-leaf paths: entropy [B, N] sampling entropy at each completion position; leaf [B]
  row holds a tree path (unused rows have empty completions); node [B] row index within its
  prompt's tree (-1: unused row); parent, depth, prefix_len [B] (see `tree.TreeState`);
  row_key [B, 2] the row's key; decoded_tokens, refed_tokens, pruned_tokens (scalars, see
  sampling/tree.py)."""
  entropy: jax.Array
  leaf: jax.Array
  node: jax.Array
  parent: jax.Array
  depth: jax.Array
  prefix_len: jax.Array
  row_key: jax.Array
  decoded_tokens: jax.Array
  refed_tokens: jax.Array
  pruned_tokens: jax.Array


@flax.struct.dataclass
class DraftStats:
  """What speculative decoding (sampling/speculative.py) adds to its `Generation`: per
  draft source (`sources`, static), drafted [n] draft tokens proposed and verified and
  accepted [n] of them accepted; forwards: target forwards run (live rows x steps);
  emitted: tokens written."""
  drafted: jax.Array
  accepted: jax.Array
  forwards: jax.Array
  emitted: jax.Array
  sources: tuple = flax.struct.field(pytree_node=False, default=())


@flax.struct.dataclass
class ToolRows:
  """What rollouts with turns (rl.environments.turns) add to their `Generation`: env_mask
  [B, S] tokens an environment wrote (context: in prompt_mask, never in completion_mask);
  calls [B] tool calls the environment answered; failed [B] rows whose environment step
  timed out or failed (they score 0); and the batch's step counts: steps (environment
  steps run), errors, timeouts, cut (observations cut to their token cap) and env_time_s
  (wall time spent in environment steps)."""
  env_mask: jax.Array
  calls: jax.Array
  failed: jax.Array
  steps: jax.Array
  errors: jax.Array
  timeouts: jax.Array
  cut: jax.Array
  env_time_s: jax.Array


@flax.struct.dataclass
class Generation:
  """A finished (or stopped) batch of sequences, ready to be scored.

  tokens [B, S]; prompt_mask / completion_mask [B, S]; behavior_logp [B, S];
  version [B, S]; completion_len [B]; stopped [B] (emitted a stop token, as opposed to
  running out of slots); decode_steps: loop iterations run (scalar); tree: the tree
  rollout's paths (`TreePaths`), None for independent samples and partial rollouts;
  speculative: speculative decoding's draft counters (`DraftStats`), None otherwise;
  tools: rollouts with turns' environment tokens and counters (`ToolRows`), None otherwise.
  experts: an MoE policy's routing record [B, S, L, k] (`ModelConfig.expert_id_dtype`):
  the experts each slot's token ran through in each layer when the sampler processed it
  (`routing_record`), None for a dense policy.
  """
  tokens: jax.Array
  prompt_mask: jax.Array
  completion_mask: jax.Array
  behavior_logp: jax.Array
  version: jax.Array
  completion_len: jax.Array
  stopped: jax.Array
  decode_steps: jax.Array
  tree: Optional[TreePaths] = None
  speculative: Optional[DraftStats] = None
  tools: Optional[ToolRows] = None
  experts: Optional[jax.Array] = None


def routing_record(cache: dict | None) -> jax.Array | None:
  """The routing record [B, S, L, k] in a stacked KV cache (`transformer.init_cache`:
  'experts' [L, B, S, k], written wherever the sampler ran a token), None for a dense
  model. A slot rewritten (a partial rollout's refresh, a speculative draft replaced)
  holds the experts of its latest forward, as its keys and values do. A speculative row's
  final token, when the row stops on it, is never run and has no record (zeros); its
  routing reaches no log-prob, and the routing metrics leave each row's last token out."""
  if cache is None or "experts" not in cache:
    return None
  return jnp.moveaxis(cache["experts"], 0, 2)


def prefill(params, prompt_tokens: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
            model_config: ModelConfig, sampling_config: SamplingConfig,
            scratch_slots: int = 0) -> SamplerState:
  """Runs the prompts [B, P] (left-padded) through the model and returns a fresh state.

  The KV cache gets `scratch_slots` more slots after the S token slots, never attended to
  (tree rollouts park the writes of rows that are not decoding there).
  """
  chex.assert_rank([prompt_tokens, prompt_mask], 2)
  batch, prompt_len = prompt_tokens.shape
  slots = prompt_len + sampling_config.max_new_tokens
  pad = ((0, 0), (0, sampling_config.max_new_tokens))
  tokens = jnp.pad(prompt_tokens.astype(jnp.int32), pad, constant_values=sampling_config.pad_id)
  token_mask = jnp.pad(prompt_mask.astype(bool), pad)
  positions = transformer.positions_from_mask(prompt_mask)
  cache = transformer.init_cache(model_config, batch, slots + scratch_slots)
  kv_mask = jnp.pad(token_mask, ((0, 0), (0, scratch_slots)))
  logits, cache = transformer.forward(params, prompt_tokens, positions, kv_mask, model_config,
                                      cache=cache, cache_index=0)
  return SamplerState(
      tokens=tokens, token_mask=token_mask,
      behavior_logp=jnp.zeros((batch, slots), jnp.float32),
      version=jnp.full((batch, slots), -1, jnp.int32),
      done=jnp.zeros((batch,), bool), step=jnp.zeros((), jnp.int32),
      next_logits=logits[:, -1], next_position=positions[:, -1] + 1,
      cache=cache, rng=rng, prompt_len=prompt_len)


def draw(key: jax.Array, logits: jax.Array, sampling_config: SamplingConfig):
  """One token per row of logits [B, V] under the config, all from `key`: (tokens [B],
  behaviour log-probs [B])."""
  return sample_tokens(key, logits, sampling_config.temperature, sampling_config.top_k,
                       sampling_config.top_p)


def draw_rows(key: jax.Array, rows: jax.Array, logits: jax.Array,
              sampling_config: SamplingConfig):
  """Like `draw`, but row r's uniform comes from fold_in(key, rows[r]): a row's token does
  not depend on which other rows are in the batch (the decode loop gathers live rows into
  a narrower batch). Greedy decoding draws nothing."""
  c = sampling_config
  if c.temperature == 0.0:
    return greedy_tokens(logits)
  uniform = jax.vmap(lambda row: jax.random.uniform(jax.random.fold_in(key, row)))(rows)
  return sample_with_uniform(uniform, logits, c.temperature, c.top_k, c.top_p)


def stop_mask(tokens: jax.Array, live: jax.Array, sampling_config: SamplingConfig) -> jax.Array:
  """Where a live token (any shape, with `live` alike) is one of the config's stop tokens."""
  if not sampling_config.stop_tokens:
    return jnp.zeros_like(live)
  return live & jnp.isin(tokens, jnp.asarray(sampling_config.stop_tokens, jnp.int32))


def write_at(buf: jax.Array, value: jax.Array, slot: jax.Array) -> jax.Array:
  """buf [B, S] with value [B] at `slot`: one slot for every row (a scalar: an in-place
  update) or each row's own (slot [B]; a row whose slot is past S writes nothing)."""
  if jnp.ndim(slot) == 0:
    return jax.lax.dynamic_update_index_in_dim(buf, value, slot, axis=1)
  return jnp.where(jnp.arange(buf.shape[1])[None, :] == slot[:, None], value[:, None], buf)


def write_token(state, live: jax.Array, token: jax.Array, logp: jax.Array, version: jax.Array,
                slot: jax.Array, sampling_config: SamplingConfig, forward):
  """The token step of every policy: writes each live row's sampled token (pad in other
  rows), its behaviour log-prob and version at `slot` (see `write_at`), marks rows that
  emitted a stop token, and runs the model on the token.

  state: a `SamplerState` (or its per-row subclass `tree.TreeState`); advancing its step and
  rng is the caller's. forward(token [B, 1], position [B, 1], kv_mask [B, S], cache, slot) ->
  (logits [B, 1, V], cache), the model's one-token call.
  """
  token = jnp.where(live, token, sampling_config.pad_id)
  token_mask = write_at(state.token_mask, live, slot)
  logits, cache = forward(token[:, None], state.next_position[:, None], token_mask, state.cache,
                          slot)
  return state.replace(
      tokens=write_at(state.tokens, token, slot),
      token_mask=token_mask,
      behavior_logp=write_at(state.behavior_logp, jnp.where(live, logp, 0.0), slot),
      version=write_at(state.version, jnp.where(live, version, -1).astype(jnp.int32), slot),
      done=state.done | stop_mask(token, live, sampling_config),
      next_logits=logits[:, 0],
      next_position=state.next_position + live.astype(jnp.int32),
      cache=cache)


def _advance(state: SamplerState, rows: jax.Array, version: jax.Array,
             sampling_config: SamplingConfig, forward) -> SamplerState:
  """One lockstep decode step: row r draws with fold_in(a split of the state's key, rows[r])
  (greedy: no key is used or split) and every row writes at the shared slot P + step."""
  if sampling_config.temperature == 0.0:
    rng, key = state.rng, None
  else:
    rng, key = jax.random.split(state.rng)
  token, logp = draw_rows(key, rows, state.next_logits, sampling_config)
  state = write_token(state, ~state.done, token, logp, version, state.prompt_len + state.step,
                      sampling_config, forward)
  return state.replace(step=state.step + 1, rng=rng)


def decode_step(params, state: SamplerState, version: jax.Array, model_config: ModelConfig,
                sampling_config: SamplingConfig) -> SamplerState:
  """Samples one token for every live row, writes it, and advances the cache."""
  forward = lambda token, position, kv_mask, cache, slot: transformer.forward(
      params, token, position, kv_mask, model_config, cache=cache, cache_index=slot)
  return _advance(state, jnp.arange(state.done.shape[0]), version, sampling_config, forward)


def phase_ends(total: int, phase_tokens: int) -> list[int]:
  """Completion steps at which the decode loop's phases end: phase_tokens, twice that, ...,
  up to `total` (one phase when phase_tokens is 0 or >= total)."""
  ends = []
  end = phase_tokens
  while 0 < end < total:
    ends.append(end)
    end *= 2
  return ends + [total]


def compaction_widths(batch: int, min_rows: int) -> list[int]:
  """Batch widths a decode phase may run at: batch, and batch/2, batch/4 (floored) where
  they keep at least `min_rows` rows (min_rows 0: only `batch`)."""
  if min_rows <= 0:
    return [batch]
  return [batch] + [batch // 2 ** i for i in (1, 2) if batch // 2 ** i >= min_rows]


_SHARED_FIELDS = ("step", "rng")


def take_rows(state: SamplerState, index: jax.Array) -> SamplerState:
  """The state restricted to rows `index` [W] (step and rng are shared by all rows)."""
  take = lambda a: a[index]
  return state.replace(**{f.name: jax.tree.map(take, getattr(state, f.name))
                          for f in dataclasses.fields(state)
                          if f.name not in _SHARED_FIELDS and f.name != "prompt_len"})


def put_rows(state: SamplerState, index: jax.Array, part: SamplerState) -> SamplerState:
  """`state` with rows `index` replaced by the rows of `part` (which also brings step/rng)."""
  fields = {}
  for f in dataclasses.fields(state):
    if f.name == "prompt_len":
      continue
    new = getattr(part, f.name)
    if f.name not in _SHARED_FIELDS:
      new = jax.tree.map(lambda full, rows: full.at[index].set(rows), getattr(state, f.name), new)
    fields[f.name] = new
  return state.replace(**fields)


def decode(params, state: SamplerState, version: jax.Array, model_config: ModelConfig,
           sampling_config: SamplingConfig, max_steps: jax.Array | int | None = None, *,
           position_limit: jax.Array | None = None,
           until: Callable[[SamplerState], jax.Array] | None = None,
           row_ids: jax.Array | None = None) -> SamplerState:
  """Decodes until every row is done, the slots run out, or `max_steps` more steps.

  Each step equals `decode_step`. Inside the loop the KV cache is held per layer in the
  decode layout (`transformer.to_decode_cache`) and the layers run unrolled
  (`transformer.forward_decode`), so a step writes only its new slots and never copies
  or transposes a layer's cache. The state's cache is converted once on entry and exit.

  Cost that follows the tokens actually generated (`SamplingConfig.phase_tokens`,
  `compact_min_rows`): the loop runs in phases that end after phase_tokens, 2x, 4x, ...
  completion steps; a phase's attention reads only the cache slots it can have filled
  (prompt + phase end), and from the second phase on, the live rows are gathered into
  the narrowest of batch, batch/2, batch/4 rows that holds them all, so rows that have
  stopped stop costing. Tokens, log-probs and caches equal those of one full-width,
  full-length loop (draws are per row, `draw_rows`).

  Two optional early stops serve partial rollouts (sampling/partial.py):
    position_limit [B]: a row also finishes once its next RoPE position reaches this
      (a per-row length budget, for rows that resume part-way through their completion).
    until: a predicate of the state (traced inside the loop); decoding stops as soon as it
      is true, e.g. "the target number of complete groups is reached" (APRIL). It sees
      every row, so rows are never compacted when it is given.
  row_ids [B]: the id each row draws its tokens with (`draw_rows`; default its index). A
    caller that continues some rows of an earlier, wider state (`take_rows`) passes their
    indices there, so they draw exactly what they would have in the wide batch.
  """
  batch = state.done.shape[0]
  total = state.tokens.shape[1] - state.prompt_len
  limit = total if max_steps is None else jnp.minimum(total, state.step + max_steps)
  layers = transformer.unstack_layers(params, model_config, state.tokens.shape[1])
  if position_limit is None:
    position_limit = jnp.full((batch,), jnp.iinfo(jnp.int32).max, jnp.int32)

  def exhausted(s, budget):
    return s.replace(done=s.done | (s.next_position >= budget))

  def run_phase(end, s, rows, budget):
    """The while loop of one phase over whatever rows `s` holds (its cache: end's slots)."""
    slots = s.prompt_len + end
    forward = lambda token, position, kv_mask, cache, slot: transformer.forward_decode(
        layers, token, position, kv_mask[:, :slots], model_config, cache, slot)

    def cond(s):
      keep_going = (s.step < jnp.minimum(limit, end)) & ~jnp.all(s.done)
      return keep_going if until is None else keep_going & ~until(s)

    body = lambda s: exhausted(_advance(s, rows, version, sampling_config, forward), budget)
    return jax.lax.while_loop(cond, body, s)

  def run_narrow(end, width, s, rows, budget):
    """run_phase on the `width` rows that come first when live rows are put first."""
    if width == batch:
      return run_phase(end, s, rows, budget)
    index = jnp.argsort(s.done, stable=True)[:width]
    part = run_phase(end, take_rows(s, index), rows[index], budget[index])
    return put_rows(s, index, part)

  rows = jnp.arange(batch) if row_ids is None else jnp.asarray(row_ids, jnp.int32)
  full_cache = transformer.to_decode_cache(state.cache)
  state = exhausted(state, position_limit)
  ends = phase_ends(total, sampling_config.phase_tokens)
  widths = [batch] if until is not None else compaction_widths(
      batch, sampling_config.compact_min_rows)
  for phase, end in enumerate(ends):
    slots = state.prompt_len + end
    state = state.replace(cache=transformer.decode_cache_prefix(full_cache, slots))
    if phase == 0 or len(widths) == 1:
      state = run_phase(end, state, rows, position_limit)
    else:
      live = jnp.sum(~state.done)
      choice = sum((live <= w).astype(jnp.int32) for w in widths[1:])
      branches = [functools.partial(run_narrow, end, w) for w in widths]
      state = jax.lax.switch(choice, branches, state, rows, position_limit)
    full_cache = transformer.decode_cache_put_prefix(full_cache, state.cache)
  return state.replace(cache=transformer.from_decode_cache(full_cache))


def make_generation(tokens: jax.Array, token_mask: jax.Array, behavior_logp: jax.Array,
                    version: jax.Array, *, prompt_len: int, stopped: jax.Array,
                    decode_steps: jax.Array, tree: TreePaths | None = None,
                    experts: jax.Array | None = None) -> Generation:
  """The one place a `Generation` is assembled: slots [0, prompt_len) of the rows [B, S]
  are the prompt, the rest the completion; `tree` a tree rollout's paths; `experts` an
  MoE policy's routing record [B, S, L, k]."""
  is_completion = jnp.arange(tokens.shape[1])[None, :] >= prompt_len
  completion_mask = token_mask & is_completion
  return Generation(
      tokens=tokens, prompt_mask=token_mask & ~is_completion, completion_mask=completion_mask,
      behavior_logp=behavior_logp, version=version,
      completion_len=completion_mask.sum(axis=1).astype(jnp.int32), stopped=stopped,
      decode_steps=decode_steps, tree=tree,
      experts=None if experts is None else experts[:, :tokens.shape[1]])


def to_generation(state: SamplerState) -> Generation:
  """The state's sequences as a `Generation` (rows still running count as unstopped)."""
  return make_generation(state.tokens, state.token_mask, state.behavior_logp, state.version,
                         prompt_len=state.prompt_len, stopped=state.done,
                         decode_steps=state.step, experts=routing_record(state.cache))


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
