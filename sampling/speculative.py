"""Lossless speculative decoding with model-free drafts: several tokens per target forward,
exactly the policy's distribution.

Each decode step of a row proposes up to k draft tokens (`DraftConfig.tokens`) by n-gram
lookup (prompt lookup decoding, Saxena 2023): the row's last n tokens are searched for in
the draft sources, and the (up to) k tokens that followed a match are the draft. Sources,
composable (`DraftConfig.sources`):

  prompt_lookup  the row's own prompt and completion so far;
  group          what the row's siblings (the other completions of the same prompt, rows
                 in contiguous blocks of `group_size`) have written so far (Seer-style
                 grouped drafts);
  history        a given reference completion per row, e.g. the prompt's completion from
                 its previous visit (SPEC-RL's draft), passed to `speculative_decode`.

One cached forward (`models.transformer.forward_verify`) runs the row's pending token and
its k drafts; the drafts are accepted left to right by the speculative-sampling rule for a
deterministic draft x: accept with probability p(x) under the distribution actually
sampled (temperature, top-k, top-p applied); at the first rejection the next token is drawn
from p with x removed and renormalised, and the step ends. If every draft is accepted (or
the draft was shorter, or the row's slots end), the next token is drawn from p itself.
Each emitted token then has marginal distribution p given its prefix, exactly as plain
decoding draws it (P(x) = p(x); P(y != x) = (1 - p(x)) p(y) / (1 - p(x))). Greedy decoding
(T = 0) accepts while the draft is the argmax. The behaviour log-prob recorded for every
token, accepted or drawn, is log p(token) from the target forward: the distribution the
token has, which is what plain sampling records. (SPEC-RL's reference code skips the
residual draw on a rejection and is biased.)

A step writes between 1 and k + 1 tokens per row; rows advance by their own counts, each
at its own cache slot. The row's newest token is written but not yet run through the model
("pending"); the next step's forward runs it together with the next draft. Rows that have
stopped stop costing, as in `sampling.sampler.decode` (rounds of live-row compaction). The
loop does not leave a resumable state (the last pending token never runs through the
model): partial rollouts and tree rollouts do not use it.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from models import transformer
from models.config import ModelConfig
from sampling import sampler
from sampling.logits import greedy_tokens, inverse_cdf, sampled_weights
from sampling.sampler import DraftStats, Generation, SamplerState, SamplingConfig

SOURCES = ("prompt_lookup", "group", "history")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
  """Speculative decoding's drafts.

  Attributes:
    tokens: k, draft tokens verified per forward (> 0).
    sources: the draft sources, searched together; a match in an earlier-listed source
      wins over a later one, and within a source the latest match wins.
    ngram: the longest suffix matched; shorter ones (down to 1 token) are tried when it
      finds nothing.
    group_size: rows per prompt, in contiguous blocks (the 'group' source's siblings).
  No default for `tokens`: a run's config.rollout.speculative (whose tokens = 0 means
  plain decoding) is the one set of defaults (`from_settings`).

  >>> DraftConfig(tokens=4, sources=("prompt_lookup", "history")).sources
  ('prompt_lookup', 'history')
  >>> DraftConfig(tokens=4, sources=("oracle",))
  Traceback (most recent call last):
  ...
  ValueError: DraftConfig.sources = ('oracle',): use one or more of ('prompt_lookup', 'group', 'history').
  """
  tokens: int
  sources: tuple[str, ...] = ("prompt_lookup",)
  ngram: int = 3
  group_size: int = 1

  @classmethod
  def from_settings(cls, settings, group_size: int) -> "DraftConfig | None":
    """The drafts of a run's config.rollout.speculative (any object with tokens, sources and
    ngram, as rl.settings' SpeculativeSettings), or None when its tokens are 0 (plain
    decoding); `group_size`: the run's rows per prompt."""
    if not settings.tokens:
      return None
    return cls(tokens=settings.tokens, sources=tuple(settings.sources), ngram=settings.ngram,
               group_size=group_size)

  def __post_init__(self):
    if self.tokens < 1:
      raise ValueError(f"DraftConfig.tokens must be >= 1, got {self.tokens}.")
    if self.ngram < 1:
      raise ValueError(f"DraftConfig.ngram must be >= 1, got {self.ngram}.")
    unknown = sorted(set(self.sources) - set(SOURCES))
    if unknown or not self.sources:
      raise ValueError(f"DraftConfig.sources = {self.sources}: use one or more of {SOURCES}.")
    if "group" in self.sources and self.group_size < 2:
      raise ValueError("The 'group' draft source needs group_size >= 2 rows per prompt.")


def sibling_rows(batch: int, group_size: int) -> jax.Array:
  """[B, G - 1]: the other rows of each row's contiguous block of `group_size`."""
  rows = jnp.arange(batch)
  return rows[:, None] // group_size * group_size + (
      jnp.arange(1, group_size)[None, :] + rows[:, None] % group_size) % group_size


def siblings_of(tokens: jax.Array, valid: jax.Array, config: DraftConfig):
  """The 'group' source of rows [B, S] in contiguous groups: ([B, G - 1, S] tokens, their
  validity), or None when the config does not draft from the group."""
  if "group" not in config.sources:
    return None
  if tokens.shape[0] % config.group_size:
    raise ValueError(f"{tokens.shape[0]} rows do not split into groups of "
                     f"{config.group_size} (DraftConfig.group_size) for the 'group' source.")
  others = sibling_rows(tokens.shape[0], config.group_size)
  return tokens[others], valid[others]


def _source_arrays(tokens, valid, config: DraftConfig, siblings, history, history_mask):
  """[B, M, L] source tokens and validity, highest priority last (see `draft`)."""
  slots = tokens.shape[1]
  arrays = []
  for name in reversed(config.sources):
    if name == "prompt_lookup":
      src, ok = tokens[:, None], valid[:, None]
    elif name == "group":
      src, ok = siblings if siblings is not None else siblings_of(tokens, valid, config)
    else:
      length = history.shape[1]
      pad = ((0, 0), (0, max(slots - length, 0)))
      src = jnp.pad(history, pad)[:, None, :slots]
      ok = jnp.pad(history_mask, pad)[:, None, :slots]
      if length > slots:
        raise ValueError(f"history has {length} slots, more than the rows' {slots}.")
    arrays.append((src, ok, name))
  return arrays


def draft(tokens: jax.Array, valid: jax.Array, last: jax.Array, config: DraftConfig,
          siblings=None, history: jax.Array | None = None,
          history_mask: jax.Array | None = None, prompt_len: int = 0):
  """Each row's draft: the k tokens after the latest occurrence of its last n tokens.

  tokens, valid [B, S]: the rows and their written slots; last [B]: each row's newest slot
  (its n-gram ends there; the row's own matches must end before it). siblings: the
  'group' source as ([B, M, S] tokens, validity); default `siblings_of(tokens, valid)`
  (rows in contiguous groups). history, history_mask [B, H] (H <= S): the 'history'
  source, a completion (slot 0 = the first completion token); prompt_len: where the rows'
  completions start, so that a history match nearest the row's own position wins. Returns (draft [B, k]; length [B]: how many leading draft tokens are real;
  source [B]: index into config.sources of the match, -1 for none). The longest
  n <= config.ngram with a match is used, and its latest match (in a history: the match
  nearest the row's position); a match counts only if a written token follows it. In the
  row's own text the continuation may reach its newest
  token: the draft then repeats the text from the match on (period last - match end), as
  text that has repeated once tends to.
  """
  k = config.tokens
  batch, slots = tokens.shape
  positions = jnp.arange(slots)
  rows = jnp.arange(batch)
  arrays = _source_arrays(tokens, valid, config, siblings, history, history_mask)
  best_draft = jnp.zeros((batch, k), jnp.int32)
  best_len = jnp.zeros((batch,), jnp.int32)
  best_source = jnp.full((batch,), -1, jnp.int32)
  found = jnp.zeros((batch,), bool)
  for n in range(config.ngram, 0, -1):  # the longest n that matches anywhere
    key_slots = last[:, None] - (n - 1) + jnp.arange(n)[None, :]  # [B, n]
    key = jnp.take_along_axis(tokens, jnp.maximum(key_slots, 0), axis=1)
    key_ok = jnp.all(key_slots >= 0, axis=1)
    n_draft = jnp.zeros((batch, k), jnp.int32)
    n_len = jnp.zeros((batch,), jnp.int32)
    n_source = jnp.full((batch,), -1, jnp.int32)
    n_found = jnp.zeros((batch,), bool)
    for src, ok, name in arrays:  # highest priority last: it overwrites
      match = ok & key_ok[:, None, None]
      for i in range(n):  # the match ends at j: src[j - n + 1 + i] == key[i]
        shifted = jnp.pad(src, ((0, 0), (0, 0), (n - 1 - i, 0)))[..., :slots]
        shifted_ok = jnp.pad(ok, ((0, 0), (0, 0), (n - 1 - i, 0)))[..., :slots]
        match &= shifted_ok & (shifted == key[:, None, i:i + 1])
      match &= positions[None, None, :] >= n - 1
      match &= jnp.pad(ok[..., 1:], ((0, 0), (0, 0), (0, 1)))  # a written continuation
      if name == "prompt_lookup":
        match &= positions[None, None, :] < last[:, None, None]
      # The latest match over the source's rows and slots; in a history, the one nearest
      # the row's own position (its completion so far is as long as the history's prefix).
      rank = positions[None, None, :]
      if name == "history":
        aligned = (last - prompt_len)[:, None, None]
        rank = 2 * slots - jnp.abs(rank - aligned)
      score = jnp.where(match, rank, -1).reshape(batch, -1)
      best = jnp.argmax(score, axis=1)
      hit = jnp.max(score, axis=1) >= 0
      row, end = best // slots, best % slots
      src_row, ok_row = src[rows, row], ok[rows, row]
      steps = jnp.arange(k)[None, :]
      if name == "prompt_lookup":
        # The row's own text after the match runs into its newest token: the text repeats
        # with period last - end, so the draft continues that cycle (k tokens).
        cont = end[:, None] + 1 + steps % jnp.maximum(last - end, 1)[:, None]
      else:
        cont = end[:, None] + 1 + steps
      cont_ok = (cont < slots) & jnp.take_along_axis(ok_row, jnp.minimum(cont, slots - 1), 1)
      length = jnp.sum(jnp.cumprod(cont_ok, axis=1), axis=1).astype(jnp.int32)
      hit &= length > 0
      n_draft = jnp.where(hit[:, None], jnp.take_along_axis(src_row, jnp.minimum(
          cont, slots - 1), 1), n_draft)
      n_len = jnp.where(hit, length, n_len)
      n_source = jnp.where(hit, config.sources.index(name), n_source)
      n_found |= hit
    take = n_found & ~found
    best_draft = jnp.where(take[:, None], n_draft, best_draft)
    best_len = jnp.where(take, n_len, best_len)
    best_source = jnp.where(take, n_source, best_source)
    found |= n_found
  return best_draft, best_len, best_source


def _accept(logits: jax.Array, drafts: jax.Array, length: jax.Array, uniforms: jax.Array,
            sampling_config: SamplingConfig):
  """The speculative-sampling rule on one verify forward.

  logits [B, k + 1, V]: logits[:, j] is the distribution of the token after draft j
  (j = 0: after the pending token); drafts [B, k]; length [B]: drafts to test;
  uniforms [B, k + 1]: the acceptance tests (columns < k) and the final draw (column k).
  Returns (accepted [B]: leading drafts accepted, final token [B], log p of each accepted
  draft [B, k], log p of the final token [B]).
  """
  k = drafts.shape[1]
  c = sampling_config
  tested = jnp.arange(k)[None, :] < length[:, None]
  if c.temperature == 0.0:
    argmax, argmax_logp = jax.vmap(greedy_tokens, in_axes=1, out_axes=1)(logits)  # [B, k+1]
    ok = tested & (drafts == argmax[:, :k])
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    final = jnp.take_along_axis(argmax, accepted[:, None], 1)[:, 0]
    final_logp = jnp.take_along_axis(argmax_logp, accepted[:, None], 1)[:, 0]
    return accepted, final, argmax_logp[:, :k], final_logp
  weights, shifted = sampled_weights(logits, c.temperature, c.top_k, c.top_p)  # [B, k+1, V]
  log_total = jnp.log(jnp.sum(weights, axis=-1))  # [B, k + 1]
  draft_weight = jnp.take_along_axis(weights[:, :k], drafts[..., None], -1)[..., 0]
  draft_logp = jnp.take_along_axis(shifted[:, :k], drafts[..., None], -1)[..., 0] - log_total[:, :k]
  prob = draft_weight / jnp.exp(log_total[:, :k])
  ok = tested & (uniforms[:, :k] < prob)
  accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
  rejected = accepted < length  # the draft at `accepted` was tested and failed
  final_weights = jnp.take_along_axis(weights, accepted[:, None, None], 1)[:, 0]  # [B, V]
  rejected_token = jnp.take_along_axis(drafts, jnp.minimum(accepted, k - 1)[:, None], 1)[:, 0]
  residual = jnp.where(rejected[:, None] & (jnp.arange(weights.shape[-1])[None, :]
                                             == rejected_token[:, None]), 0.0, final_weights)
  # A draft rejected although it held all the mass (f32 rounding of p = 1): keep it.
  residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, final_weights)
  final = inverse_cdf(residual, uniforms[:, k])
  final_shifted = jnp.take_along_axis(shifted, accepted[:, None, None], 1)[:, 0]
  final_logp = (jnp.take_along_axis(final_shifted, final[:, None], 1)[:, 0]
                - jnp.take_along_axis(log_total, accepted[:, None], 1)[:, 0])
  return accepted, final, draft_logp, final_logp


@flax.struct.dataclass
class _Loop:
  """The speculative loop's carry: the sampler state (its cache in the decode layout,
  `transformer.to_decode_cache`), each row's pending slot and RoPE position, the counters."""
  state: SamplerState
  last: jax.Array  # [B] slot of each row's newest (pending) token
  position: jax.Array  # [B] RoPE position of the pending token
  stats: DraftStats


def _active(lp: _Loop) -> jax.Array:
  """Rows still decoding: no stop token yet, and a slot after the pending token."""
  return ~lp.state.done & (lp.last < lp.state.tokens.shape[1] - 1)


def _take(lp: _Loop, index: jax.Array) -> _Loop:
  return lp.replace(state=sampler.take_rows(lp.state, index), last=lp.last[index],
                    position=lp.position[index])


def _put(lp: _Loop, index: jax.Array, part: _Loop) -> _Loop:
  return _Loop(state=sampler.put_rows(lp.state, index, part.state),
               last=lp.last.at[index].set(part.last),
               position=lp.position.at[index].set(part.position), stats=part.stats)


def _verify_step(lp: _Loop, rows: jax.Array, layers, siblings, history, version: jax.Array,
                 model_config: ModelConfig, sampling_config: SamplingConfig,
                 draft_config: DraftConfig) -> _Loop:
  """One speculative step of every active row of `lp` (rows [W]: their indices in the
  whole batch, which key their random draws): draft, one verify forward over the pending
  token and the draft, accept, write the emitted tokens."""
  c, k = sampling_config, draft_config.tokens
  s = lp.state
  width, slots = s.tokens.shape
  live = _active(lp)
  room = slots - 1 - lp.last  # slots after the pending token
  drafts, length, source = draft(s.tokens, s.token_mask, lp.last, draft_config, siblings,
                                 *(history or (None, None)), prompt_len=s.prompt_len)
  length = jnp.where(live, jnp.minimum(length, room - 1), 0)
  pending = jnp.take_along_axis(s.tokens, lp.last[:, None], 1)
  fed = jnp.concatenate([pending, drafts], axis=1)  # [W, k + 1]
  window = jnp.arange(slots + k)[None, :] - lp.last[:, None]
  kv_mask = jnp.pad(s.token_mask, ((0, 0), (0, k))) | ((window >= 0) & (window <= k))
  logits, cache = transformer.forward_verify(
      layers, fed, lp.position[:, None] + jnp.arange(k + 1)[None, :], kv_mask, model_config,
      s.cache, lp.last)
  rng, key = jax.random.split(s.rng)
  uniforms = jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(key, r), (k + 1,)))(rows)
  accepted, final, draft_logp, final_logp = _accept(logits, drafts, length, uniforms, c)
  # Emitted tokens: the accepted drafts, then the final token; cut after a stop token.
  at_final = jnp.arange(k + 1)[None, :] == accepted[:, None]
  emitted = jnp.where(at_final, final[:, None], jnp.pad(drafts, ((0, 0), (0, 1))))
  emitted_logp = jnp.where(at_final, final_logp[:, None], jnp.pad(draft_logp, ((0, 0), (0, 1))))
  count = accepted + 1
  is_stop = sampler.stop_mask(emitted, jnp.arange(k + 1)[None, :] < count[:, None], c)
  stopped = jnp.any(is_stop, axis=1)
  count = jnp.where(live, jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, count), 0)
  tokens, token_mask, behav, versions = s.tokens, s.token_mask, s.behavior_logp, s.version
  for j in range(k + 1):
    slot = jnp.where(j < count, lp.last + 1 + j, slots)  # a slot past the row: no write
    tokens = sampler.write_at(tokens, emitted[:, j], slot)
    token_mask = sampler.write_at(token_mask, jnp.ones((width,), bool), slot)
    behav = sampler.write_at(behav, emitted_logp[:, j], slot)
    versions = sampler.write_at(versions, jnp.full((width,), version, jnp.int32), slot)
  sources = len(draft_config.sources)
  by_source = lambda x: jnp.zeros((sources,), jnp.int32).at[jnp.maximum(source, 0)].add(
      jnp.where(live & (source >= 0), x, 0))
  stats = lp.stats.replace(
      drafted=lp.stats.drafted + by_source(length),
      accepted=lp.stats.accepted + by_source(jnp.minimum(accepted, count)),  # written ones
      forwards=lp.stats.forwards + jnp.sum(live).astype(jnp.int32),
      emitted=lp.stats.emitted + jnp.sum(count).astype(jnp.int32))
  state = s.replace(tokens=tokens, token_mask=token_mask, behavior_logp=behav, version=versions,
                    done=s.done | (live & stopped), step=s.step + 1, rng=rng, cache=cache)
  return _Loop(state=state, last=lp.last + count, position=lp.position + count, stats=stats)


def speculative_decode(params, state: SamplerState, version: jax.Array,
                       model_config: ModelConfig, sampling_config: SamplingConfig,
                       draft_config: DraftConfig, history: jax.Array | None = None,
                       history_mask: jax.Array | None = None) -> tuple[SamplerState, DraftStats]:
  """Decodes `state` (fresh from `sampler.prefill` with `scratch_slots=draft_config.tokens`)
  until every row is done, speculatively (module docstring). Returns the final state
  (tokens, masks, behaviour log-probs, versions and done flags as plain decoding would
  have them; its cache and next_logits are not resumable) and the draft counters.

  Rows that have stopped stop costing, as in `sampler.decode`: the loop runs in rounds of
  phase_tokens / (k + 1) steps (`SamplingConfig.phase_tokens`), and each round runs only
  the narrowest of batch, batch/2, batch/4 rows (`compact_min_rows`) that holds the rows
  still decoding. The 'group' source reads the siblings' text as of the round's start.
  """
  c, k = sampling_config, draft_config.tokens
  batch, slots = state.tokens.shape
  if "history" in draft_config.sources and history is None:
    raise ValueError("The 'history' draft source needs history and history_mask.")
  layers = transformer.unstack_layers(params, model_config, slots + k)
  rows = jnp.arange(batch)
  # The first completion token: a plain draw from the prefill's logits, written, pending.
  rng, key = jax.random.split(state.rng)
  token, logp = sampler.draw_rows(key, rows, state.next_logits, c)
  live, slot = ~state.done, state.prompt_len
  token = jnp.where(live, token, c.pad_id)
  state = state.replace(
      tokens=sampler.write_at(state.tokens, token, slot),
      token_mask=sampler.write_at(state.token_mask, live, slot),
      behavior_logp=sampler.write_at(state.behavior_logp, jnp.where(live, logp, 0.0), slot),
      version=sampler.write_at(state.version, jnp.where(live, version, -1).astype(jnp.int32),
                               slot),
      done=state.done | sampler.stop_mask(token, live, c),
      rng=rng, step=state.step + 1, cache=transformer.to_decode_cache(state.cache))
  zeros = jnp.zeros((len(draft_config.sources),), jnp.int32)
  loop = _Loop(state=state, last=jnp.full((batch,), slot, jnp.int32),
               position=state.next_position,
               stats=DraftStats(drafted=zeros, accepted=zeros, forwards=jnp.zeros((), jnp.int32),
                                emitted=jnp.sum(live).astype(jnp.int32),
                                sources=draft_config.sources))
  history_rows = None if history is None else (history, history_mask)
  widths = sampler.compaction_widths(batch, c.compact_min_rows)
  round_steps = max(1, c.phase_tokens // (k + 1)) if c.phase_tokens else slots

  def run(lp, rows, siblings, history):
    def cond(carry):
      return jnp.any(_active(carry[0])) & (carry[1] < round_steps)

    def body(carry):
      return (_verify_step(carry[0], rows, layers, siblings, history, version, model_config,
                           c, draft_config), carry[1] + 1)
    return jax.lax.while_loop(cond, body, (lp, 0))[0]

  def narrow(width, lp):
    siblings = siblings_of(lp.state.tokens, lp.state.token_mask, draft_config)
    if width == batch:
      return run(lp, rows, siblings, history_rows)
    index = jnp.argsort(~_active(lp), stable=True)[:width]  # active rows first
    pick = lambda tree: None if tree is None else jax.tree.map(lambda a: a[index], tree)
    return _put(lp, index, run(_take(lp, index), index, pick(siblings), pick(history_rows)))

  def one_round(lp):
    if len(widths) == 1:
      return narrow(batch, lp)
    live = jnp.sum(_active(lp))
    choice = sum((live <= w).astype(jnp.int32) for w in widths[1:])
    return jax.lax.switch(choice, [functools.partial(narrow, w) for w in widths], lp)

  loop = jax.lax.while_loop(lambda lp: jnp.any(_active(lp)), one_round, loop)
  return loop.state.replace(cache=transformer.from_decode_cache(loop.state.cache)), loop.stats


def speculative_sample(params, prompt_tokens: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
                       model_config: ModelConfig, sampling_config: SamplingConfig,
                       draft_config: DraftConfig, version: jax.Array | int = 0,
                       history: jax.Array | None = None,
                       history_mask: jax.Array | None = None) -> Generation:
  """`sampler.sample` with speculative decoding; the Generation carries its `DraftStats`."""
  state = sampler.prefill(params, prompt_tokens, prompt_mask, rng, model_config,
                          sampling_config, scratch_slots=draft_config.tokens)
  state, stats = speculative_decode(params, state, jnp.asarray(version, jnp.int32),
                                    model_config, sampling_config, draft_config, history,
                                    history_mask)
  return sampler.to_generation(state).replace(speculative=stats)


speculative_generate = jax.jit(speculative_sample,
                               static_argnames=("model_config", "sampling_config",
                                                "draft_config"))
