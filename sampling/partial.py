"""Partial rollouts (APRIL, CoPRIS): more rows than a batch needs, decoded in resumable rounds.

A `RolloutPool` holds R = num_slots rows in G-row blocks ("group slots": one prompt, G
completions). A round (`run_round`) decodes every unfinished row and stops as soon as
`target_groups` group slots are complete (every row stopped or used its N tokens), instead
of waiting for the longest row. Complete groups are taken out (`take`) and trained; the
unfinished rows keep their tokens, behaviour log-probs and per-token versions and continue
first in the next round, under the parameters passed to that round. Empty group slots are
refilled with new prompts (`fill`). Nothing is dropped here: a row leaves the pool only
through `take` or `clear`, so the caller can account for every started sequence.

Layout. Rows have S = P + N + D slots (P prompt slots, N = max_new_tokens, D =
decode_window <= N). Between rounds every row is right-aligned so that its content
(left-padded prompt, then the k < N tokens generated so far) ends at the resume slot
C = P + N; `start[r] = C - P - k` is where its prompt region begins. All rows then write
their next token at the same slot (the sampler's shared scalar cache index); a round
decodes at most D steps (with D = N any row can finish in one round; a smaller D shrinks
the KV cache, which every decode step reads, at the price of more rounds). After the round,
each row is shifted left so that it ends at C again.

Resumption (`PartialConfig.resume`). Before decoding, a round recomputes the keys/values of
the last W slots [C - W, C) of every row under the round's parameters:
  'reprefill' (W = C): the whole prefix is re-encoded. A resumed row continues as an exact
    sample of pi_new(. | prefix). Costs R * (P + N) prefill tokens per round, and nothing
    but the tokens needs to be kept (the KV cache is never checkpointed anyway).
  'kept_kv' (W = P): keys/values of older slots, computed by earlier parameters, are kept;
    only the last P slots (where fresh prompts sit) are recomputed. Costs R * P prefill
    tokens per round (the cache is rolled once per round), but a resumed row conditions on
    stale keys/values, so its continuation is sampled from a mixture of versions.
In both modes each token's recorded behaviour log-prob is exactly the probability the
sampler drew it with, so IS ratios against the concatenated per-segment log-probs (CoPRIS
cross-stage IS) stay exact; the version recorded is the round's parameter version. A pool
restored from a checkpoint has no KV: run its first round with `full_refresh=True`.

Turns (tool calls, rl.environments.turns). Between rounds a caller may append tokens the
policy did not write to rows that stopped (`append_observations`): the row is shifted left
so that it still ends at C, the tokens are written before C with version -1 and log-prob 0,
and the row is live again (a row may also be resumed with nothing appended). Its next round must re-encode the whole prefix ('reprefill').
Appended tokens count against the row's N-token budget. `RolloutPool.env_status` keeps
what the environment said about each row across rounds (and checkpoints).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from models import transformer
from models.config import ModelConfig
from sampling.sampler import (Generation, SamplerState, SamplingConfig, decode, make_generation,
                              routing_record, stop_mask)

RESUME_MODES = ("reprefill", "kept_kv")
ENV_RUNNING, ENV_ENDED, ENV_FAILED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PartialConfig:
  """Shape of a partial-rollout pool.

  Fields:
    num_slots: rows R in the pool (APRIL over-provisioning: more than the G * groups a batch
      needs); a multiple of group_size.
    group_size: completions G per prompt; a group is trained only when all G are complete.
    resume: 'reprefill' or 'kept_kv' (module docstring: cost vs exactness trade-off); no
      default: a run's config.rollout.resume is the one.
    decode_window: most decode steps per round, D (0: max_new_tokens).
  """
  num_slots: int
  group_size: int
  resume: str
  decode_window: int = 0

  def __post_init__(self):
    if self.group_size <= 0 or self.num_slots <= 0:
      raise ValueError(f"PartialConfig.num_slots={self.num_slots} and group_size="
                       f"{self.group_size} must be positive.")
    if self.num_slots % self.group_size:
      raise ValueError(f"PartialConfig.num_slots={self.num_slots} must be a multiple of "
                       f"group_size={self.group_size} (rows are allocated in whole groups).")
    if self.decode_window < 0:
      raise ValueError(f"PartialConfig.decode_window={self.decode_window} must be >= 0 "
                       "(0 = max_new_tokens).")
    if self.resume not in RESUME_MODES:
      raise ValueError(f"PartialConfig.resume={self.resume!r}; use one of {RESUME_MODES}.")

  @property
  def num_groups(self) -> int:
    return self.num_slots // self.group_size


@flax.struct.dataclass
class RolloutPool:
  """The rows of a partial-rollout pool, between rounds (every row ends at slot C = P + N).

  sampler: SamplerState over R rows of S = P + N + D slots; its static `prompt_len` is C
    (the first slot a round decodes into) and `step` the decode steps of the last round.
  start [R] int32: first slot of each row's P-slot prompt region.
  group_id [R / G] int32: caller's id of the group in each group slot (-1: empty).
  prompt_slots: P; max_new_tokens: N (static).
  env_status [R] int32: with turns, ENV_RUNNING, ENV_ENDED (the environment ended the row)
    or ENV_FAILED (its step failed: the row ends with reward 0); None without turns.
  """
  sampler: SamplerState
  start: jax.Array
  group_id: jax.Array
  prompt_slots: int = flax.struct.field(pytree_node=False)
  max_new_tokens: int = flax.struct.field(pytree_node=False)
  env_status: jax.Array | None = None

  @property
  def resume_slot(self) -> int:
    return self.sampler.prompt_len


def init_pool(partial_config: PartialConfig, model_config: ModelConfig,
              sampling_config: SamplingConfig, prompt_slots: int, rng: jax.Array,
              turns: bool = False) -> RolloutPool:
  """An empty pool: every group slot free, every row done, an all-zero KV cache
  (`turns`: with an `env_status` per row, for `append_observations`)."""
  rows, n = partial_config.num_slots, sampling_config.max_new_tokens
  window = partial_config.decode_window
  if window > n:
    raise ValueError(f"PartialConfig.decode_window={window} exceeds max_new_tokens={n}.")
  resume_slot = prompt_slots + n
  slots = resume_slot + (window or n)
  sampler = SamplerState(
      tokens=jnp.full((rows, slots), sampling_config.pad_id, jnp.int32),
      token_mask=jnp.zeros((rows, slots), bool),
      behavior_logp=jnp.zeros((rows, slots), jnp.float32),
      version=jnp.full((rows, slots), -1, jnp.int32),
      done=jnp.ones((rows,), bool), step=jnp.zeros((), jnp.int32),
      next_logits=jnp.zeros((rows, model_config.vocab_size), jnp.float32),
      next_position=jnp.zeros((rows,), jnp.int32),
      cache=transformer.init_cache(model_config, rows, slots), rng=rng,
      prompt_len=resume_slot)
  start = jnp.full((rows,), resume_slot - prompt_slots, jnp.int32)
  return RolloutPool(sampler=sampler, start=start,
                     group_id=jnp.full((partial_config.num_groups,), -1, jnp.int32),
                     prompt_slots=prompt_slots, max_new_tokens=n,
                     env_status=jnp.zeros((rows,), jnp.int32) if turns else None)


def _rows(group_mask: jax.Array, group_size: int) -> jax.Array:
  return jnp.repeat(group_mask, group_size, total_repeat_length=group_mask.shape[0] * group_size)


@functools.partial(jax.jit, static_argnames=("pad_id",))
def clear(pool: RolloutPool, group_mask: jax.Array, pad_id: int = 0) -> RolloutPool:
  """Empties the group slots in `group_mask` [R/G] (after `take`, or to discard them)."""
  g = pool.sampler.tokens.shape[0] // pool.group_id.shape[0]
  rows = _rows(group_mask, g)[:, None]
  s = pool.sampler
  sampler = s.replace(tokens=jnp.where(rows, pad_id, s.tokens),
                      token_mask=s.token_mask & ~rows,
                      behavior_logp=jnp.where(rows, 0.0, s.behavior_logp),
                      version=jnp.where(rows, -1, s.version),
                      done=s.done | rows[:, 0])
  env_status = (None if pool.env_status is None
                else jnp.where(rows[:, 0], ENV_RUNNING, pool.env_status))
  return pool.replace(sampler=sampler, group_id=jnp.where(group_mask, -1, pool.group_id),
                      start=jnp.where(rows[:, 0], pool.resume_slot - pool.prompt_slots, pool.start),
                      env_status=env_status)


@jax.jit
def fill(pool: RolloutPool, group_mask: jax.Array, prompt_tokens: jax.Array,
         prompt_mask: jax.Array, group_id: jax.Array) -> RolloutPool:
  """Starts new groups in the (empty) group slots of `group_mask` [R/G].

  prompt_tokens / prompt_mask [R/G, P]: left-padded prompt of each group slot (rows of
  unselected slots are ignored); group_id [R/G]: the caller's id of each new group. The
  prompt is written at [C - P, C) of the slot's G rows.
  """
  groups, p = prompt_tokens.shape
  g = pool.sampler.tokens.shape[0] // groups
  c = pool.resume_slot
  rows = _rows(group_mask, g)
  s = pool.sampler
  region = (slice(None), slice(c - p, c))
  tokens = s.tokens.at[region].set(
      jnp.where(rows[:, None], jnp.repeat(prompt_tokens, g, axis=0), s.tokens[region]))
  new_mask = jnp.repeat(prompt_mask.astype(bool), g, axis=0)
  token_mask = s.token_mask.at[region].set(jnp.where(rows[:, None], new_mask, s.token_mask[region]))
  sampler = s.replace(tokens=tokens, token_mask=token_mask, done=s.done & ~rows)
  return pool.replace(sampler=sampler, start=jnp.where(rows, c - p, pool.start),
                      group_id=jnp.where(group_mask, group_id, pool.group_id))


@jax.jit
def append_observations(pool: RolloutPool, tokens: jax.Array, lengths: jax.Array,
                        live: jax.Array, env_status: jax.Array) -> RolloutPool:
  """Appends tokens [R, L] the policy did not write (their first lengths[r] of row r) to
  the rows, which end at C (between rounds): each row with lengths > 0 is shifted left by
  its length and the tokens take slots [C - length, C) with version -1 and log-prob 0.
  Rows with live [R] (every row with lengths > 0, and any other to resume as it is) decode
  again; env_status [R] replaces the pool's. The KV cache moves with the rows, so a round
  under the same parameters may refresh only the last slots (`run_round`'s
  refresh_slots: at least the longest observation + 1, the call token having no KV yet);
  under other parameters it must refresh the whole prefix. The caller keeps every row's
  generated + appended tokens within N."""
  s, c = pool.sampler, pool.resume_slot
  rows, slots = s.tokens.shape
  index = jnp.arange(slots)[None, :]
  length = lengths.astype(jnp.int32)[:, None]
  kept = index < c - length                               # the row, moved left
  appended = (index >= c - length) & (index < c)          # the new tokens
  source = jnp.minimum(index + length, slots - 1)
  at = jnp.clip(index - (c - length), 0, tokens.shape[1] - 1)
  moved = lambda buf: jnp.take_along_axis(buf, source, axis=1)
  new = lambda buf, fill, other: jnp.where(kept, moved(buf), jnp.where(appended, other, fill))
  changed = (length > 0)
  pick = lambda before, after: jnp.where(changed, after, before)
  cache = None if s.cache is None else _shift_cache_rows(s.cache, lengths.astype(jnp.int32))
  sampler = s.replace(
      cache=cache,
      tokens=pick(s.tokens, new(s.tokens, 0, jnp.take_along_axis(tokens.astype(jnp.int32), at,
                                                                axis=1))),
      token_mask=pick(s.token_mask, new(s.token_mask, False, True)),
      behavior_logp=pick(s.behavior_logp, new(s.behavior_logp, 0.0, 0.0)),
      version=pick(s.version, new(s.version, -1, -1)),
      done=s.done & ~(live | changed[:, 0]))
  return pool.replace(sampler=sampler, start=pool.start - lengths.astype(jnp.int32),
                      env_status=env_status.astype(jnp.int32))


def _complete_groups(done: jax.Array, group_id: jax.Array) -> jax.Array:
  """[R/G] bool: occupied group slots whose rows are all done."""
  return done.reshape(group_id.shape[0], -1).all(axis=1) & (group_id >= 0)


def _shift_cache_rows(cache, shift: jax.Array):
  """Each row r of a KV cache ({k, v} [layers, R, S, heads, head_dim]) moved left by
  shift[r] slots, cyclically (the slots that wrap around are recomputed before use)."""
  def move(x):
    slots = x.shape[2]
    index = (jnp.arange(slots)[None, :] + shift[:, None]) % slots
    return jnp.take_along_axis(x, index.reshape((1,) + index.shape + (1,) * (x.ndim - 3)),
                               axis=2)
  return jax.tree.map(move, cache)


def _realign(pool: RolloutPool, sampler: SamplerState, roll_cache: bool) -> RolloutPool:
  """Shifts every row left so that it ends at the resume slot C again (module docstring),
  its KV cache with it (`roll_cache`)."""
  c, p = pool.resume_slot, pool.prompt_slots
  rows, slots = sampler.tokens.shape
  index = jnp.arange(slots)[None, :]
  generated = (sampler.token_mask & (index >= pool.start[:, None] + p)).sum(axis=1)
  shift = jnp.maximum(pool.start + p + generated - c, 0).astype(jnp.int32)
  source = index + shift[:, None]
  inside = source < slots
  source = jnp.minimum(source, slots - 1)

  def move(buf, fill_value):
    return jnp.where(inside, jnp.take_along_axis(buf, source, axis=1), fill_value)

  cache = sampler.cache
  if roll_cache:
    # Live rows all ended at C + step (shift = step); a row that stopped earlier moves by
    # its own shift, so its keys and values stay aligned should it resume (turns).
    cache = _shift_cache_rows(cache, shift)
  sampler = sampler.replace(
      tokens=move(sampler.tokens, 0), token_mask=move(sampler.token_mask, False),
      behavior_logp=move(sampler.behavior_logp, 0.0), version=move(sampler.version, -1),
      cache=cache)
  return pool.replace(sampler=sampler, start=pool.start - shift)


@functools.partial(jax.jit, static_argnames=("model_config", "sampling_config", "partial_config",
                                             "full_refresh", "refresh_slots", "keep_cache"))
def run_round(params, pool: RolloutPool, version: jax.Array, target_groups: jax.Array,
              model_config: ModelConfig, sampling_config: SamplingConfig,
              partial_config: PartialConfig, full_refresh: bool = False,
              refresh_slots: int = 0, keep_cache: bool = False) -> RolloutPool:
  """One round: refresh the KV of the resume window, then decode until `target_groups`
  group slots are complete (counting ones already complete), every row is done, or the
  round's D decode steps are used up.

  `version` is recorded on every token this round generates. `full_refresh` forces the
  'reprefill' window (after a restore, when the pool has no KV cache). refresh_slots > 0
  (not with full_refresh) refreshes only the last W = refresh_slots slots, keeping the
  rest of the cache: exact when the cache was computed under these same parameters and
  every slot before C - W has its keys and values (a later round of the same call, as
  rollouts with turns run them: W covers an appended observation and its call token).
  `keep_cache` realigns the cache with the rows after a full refresh too, for such a round.
  Returns the realigned pool; `pool.sampler.step` is the number of decode steps run.
  """
  c, p, n = pool.resume_slot, pool.prompt_slots, pool.max_new_tokens
  if full_refresh:
    window = c
  elif refresh_slots:
    window = min(refresh_slots, c)
  else:
    window = c if partial_config.resume == "reprefill" else p
  s = pool.sampler
  positions = transformer.positions_from_mask(s.token_mask)
  logits, cache = transformer.forward(params, s.tokens[:, c - window:c],
                                      positions[:, c - window:c], s.token_mask, model_config,
                                      cache=s.cache, cache_index=c - window)
  real = s.token_mask.sum(axis=1).astype(jnp.int32)
  generated = (s.token_mask[:, c - n:c] & (jnp.arange(c - n, c)[None, :] >= pool.start[:, None] + p)
               ).sum(axis=1).astype(jnp.int32)
  s = s.replace(next_logits=logits[:, -1], next_position=real, cache=cache,
                step=jnp.zeros((), jnp.int32))
  group_id = pool.group_id
  s = decode(params, s, jnp.asarray(version, jnp.int32), model_config, sampling_config,
             position_limit=real + n - generated,
             until=lambda st: _complete_groups(st.done, group_id).sum() >= target_groups)
  return _realign(pool, s, roll_cache=window < c or keep_cache)


def complete_groups(pool: RolloutPool) -> np.ndarray:
  """[R/G] host bool: group slots ready to be taken."""
  return np.asarray(jax.device_get(_complete_groups(pool.sampler.done, pool.group_id)))


def oldest_version(pool: RolloutPool) -> np.ndarray:
  """[R/G] host int: the oldest parameter version among each group's generated tokens
  (a large value for a group with no generated token yet)."""
  version = np.asarray(jax.device_get(pool.sampler.version))
  version = np.where(version >= 0, version, np.iinfo(np.int32).max)
  return version.reshape(pool.group_id.shape[0], -1).min(axis=1)


def take(pool: RolloutPool, group_slots, sampling_config: SamplingConfig) -> Generation:
  """The rows of `group_slots` (list of group-slot indices) in the plain sampler layout
  [len * G, P + N] (prompt in [0, P), completion in [P, P + N)), in the listed order."""
  p, n = pool.prompt_slots, pool.max_new_tokens
  groups = pool.group_id.shape[0]
  g = pool.sampler.tokens.shape[0] // groups
  rows = (np.asarray(group_slots, np.int32)[:, None] * g + np.arange(g)).reshape(-1)
  s = pool.sampler
  index = jnp.asarray(pool.start)[rows][:, None] + jnp.arange(p + n)[None, :]
  inside = index < s.tokens.shape[1]  # rows end at C; slots past S would be empty anyway
  index = jnp.minimum(index, s.tokens.shape[1] - 1)
  gather = lambda buf, empty: jnp.where(inside, jnp.take_along_axis(buf[rows], index, axis=1),
                                        empty)
  tokens, token_mask = gather(s.tokens, sampling_config.pad_id), gather(s.token_mask, False)
  completion = token_mask & (jnp.arange(p + n)[None, :] >= p)
  record = routing_record(s.cache)
  if record is not None:
    record = jnp.where(inside[..., None, None], jnp.take_along_axis(
        record[rows], index[..., None, None], axis=1), 0).astype(record.dtype)
  return make_generation(tokens, token_mask, gather(s.behavior_logp, 0.0),
                         gather(s.version, -1), prompt_len=p,
                         stopped=stop_mask(tokens, completion, sampling_config).any(axis=1),
                         decode_steps=s.step, experts=record)
