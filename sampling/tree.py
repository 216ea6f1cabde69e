"""Tree-structured rollouts: rows fork from one another so that leaves share prefixes.

One interface, `tree_generate(params, prompts, ..., policy)`, with the fork policy as a
static parameter (docs/concepts.md, Rollout kinds):

- `EntropyFork` (TreeRL's EPTree / entropy-fork tree rollouts): grow M chains to completion,
  then `rounds` times pick the N highest-entropy tokens of the tree and fork B branches at
  each; every branch continues to completion.
- `FixedSegments` (TreePO-like): every `segment_len` tokens each live row branches into
  `branches` children, up to `max_depth` levels (leaf budget M * branches**max_depth).
- `Lookahead` (LATR): at a step whose sampling entropy reaches `min_entropy`, a row spawns
  children that take the most likely tokens other than its own; after `lookahead_steps`
  steps a child whose continuation still matches its parent's (fraction of equal tokens >=
  `prune_similarity`) is pruned and its row freed for later branches.

Layout. Each prompt owns `policy.leaves` rows (the leaf budget), contiguous, in the plain
sampler's layout (left-padded prompt in slots [0, P), completion in [P, P + N)). A row is a
root-to-leaf path. A fork copies the parent row (tokens, behaviour log-probs, versions, KV
cache rows, ...) into an unused row, so the shared prefix is never recomputed; the child
then decodes its own tokens from completion position `prefix_len` on. Rows keep their own
decode position (`step`), so the KV cache write slot is per row. Unused rows are masked.

Randomness. The token at completion position j of row r is drawn with `fold_in(rng[r], j)`
(the row's own key), so a child's continuation is exactly what plain decoding of the same
prefix with the same key would produce (tests/test_tree.py checks this against an uncached
forward pass).

Accounting. `decoded_tokens` counts sampled tokens (one per live row per step): with no
pruning it equals the number of distinct tree-node tokens. An entropy fork happens at a
past position, whose next-token logits are not stored (that would cost [rows, N, vocab]),
so the child re-feeds its last shared token once (`refed_tokens`, one per fork) to get
them. Pruned branches' tokens are counted in `decoded_tokens` and in `pruned_tokens`.

Everything runs inside one jit: fork rounds and tree levels are unrolled at trace time
(their number is static), tokens are decoded by `lax.while_loop`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Union

import chex
import flax.struct
import jax
import jax.numpy as jnp

from models import transformer
from models.config import ModelConfig
from sampling.sampler import (Generation, SamplerState, SamplingConfig, TreePaths, draw,
                              make_generation, prefill, routing_record, write_token)


def _require_positive(policy) -> None:
  """Raises unless every field of the policy (all counts) is positive."""
  for field in dataclasses.fields(policy):
    value = getattr(policy, field.name)
    if value <= 0:
      raise ValueError(f"{type(policy).__name__}.{field.name} must be positive, got {value}.")


@dataclasses.dataclass(frozen=True)
class EntropyFork:
  """Entropy-guided forking (TreeRL, EPTree): M chains, then `rounds` x (N points x B branches).

  A branch forks *at* the uncertain token: it shares the parent's tokens before position j
  and draws its own token j (the one whose distribution had high entropy) and onwards.
  Candidates are tokens the tree has decoded that are not already a branch point.
  Fields: init_chains (M), fork_points (N), branches (B), rounds (L).
  """
  init_chains: int = 4
  fork_points: int = 2
  branches: int = 2
  rounds: int = 1

  def __post_init__(self):
    _require_positive(self)

  @property
  def leaves(self) -> int:
    return self.init_chains + self.rounds * self.fork_points * self.branches


@dataclasses.dataclass(frozen=True)
class FixedSegments:
  """Fixed-segment branching (TreePO-like): every `segment_len` tokens each live row forks
  into `branches` rows (itself and branches - 1 copies), `max_depth` times.

  A row that has stopped before a branch point does not branch (its would-be children stay
  unused), so a prompt gets at most init_chains * branches**max_depth leaves.
  """
  init_chains: int = 1
  segment_len: int = 2
  branches: int = 2
  max_depth: int = 3

  def __post_init__(self):
    _require_positive(self)
    if self.branches < 2:
      raise ValueError(f"FixedSegments.branches must be >= 2 to branch, got {self.branches}.")

  @property
  def leaves(self) -> int:
    return self.init_chains * self.branches ** self.max_depth


@dataclasses.dataclass(frozen=True)
class Lookahead:
  """Lookahead branching (LATR): branch into distinct top-k tokens at uncertain steps,
  decode `lookahead_steps` more tokens, prune children that stay similar to their parent.

  At a step where a live row's sampling entropy (nats) is >= min_entropy and the row is
  not inside its own lookahead window, it requests top_k - 1 children; child i takes the
  i-th most likely token that differs from the token the parent draws (recorded with its
  policy log-prob). Requests are served in row order while unused rows remain (leaf budget
  `leaves`). When a child's window ends (lookahead_steps tokens after its branch token, or
  it stops), it is pruned if the fraction of window positions where its token equals the
  parent's (padding counts) is >= prune_similarity.
  """
  init_chains: int = 2
  leaves: int = 8
  top_k: int = 2
  min_entropy: float = 1.0
  lookahead_steps: int = 2
  prune_similarity: float = 1.0

  def __post_init__(self):
    if not 0 < self.init_chains <= self.leaves:
      raise ValueError(f"Lookahead.init_chains={self.init_chains} must be in [1, leaves="
                       f"{self.leaves}].")
    if self.top_k < 2:
      raise ValueError(f"Lookahead.top_k must be >= 2 (1 + children), got {self.top_k}.")
    if self.lookahead_steps <= 0:
      raise ValueError(f"Lookahead.lookahead_steps must be positive, got {self.lookahead_steps}.")
    if not 0.0 <= self.prune_similarity <= 1.0:
      raise ValueError(f"Lookahead.prune_similarity must be in [0, 1], got {self.prune_similarity}.")


ForkPolicy = Union[EntropyFork, FixedSegments, Lookahead]


@flax.struct.dataclass
class TreeState(SamplerState):
  """The rows of all trees. R = prompts * leaves rows, S = P + N slots, cache S + 1 slots.

  `SamplerState`'s fields, but per row: step [R] (next completion position), rng [R, 2]
  (the row's own key); plus entropy [R, N] (sampling entropy at each completion position),
  branched [R, N] (position already used as a branch point), born [R] (row holds a tree
  path), parent [R] (row within the prompt it forked from, -1 for a chain from the
  prompt), depth [R] (fork generations: 0 for a chain, parent's + 1), prefix_len [R]
  (completion tokens shared with the parent), birth_step [R] (step at which the row
  forked; -1 for chains), window_open [R] (lookahead child not yet checked for pruning),
  last_fork [R] (step of the row's latest fork, as child or parent; lookahead cool-down);
  counters decoded_tokens, refed_tokens, pruned_tokens, decode_steps (decode loop
  iterations). The last cache slot is a scratch slot that rows which are not decoding
  write to.
  """
  entropy: jax.Array
  branched: jax.Array
  born: jax.Array
  parent: jax.Array
  depth: jax.Array
  prefix_len: jax.Array
  birth_step: jax.Array
  window_open: jax.Array
  last_fork: jax.Array
  decoded_tokens: jax.Array
  refed_tokens: jax.Array
  pruned_tokens: jax.Array
  decode_steps: jax.Array
  leaves: int = flax.struct.field(pytree_node=False)


def sampling_entropy(logits: jax.Array, temperature: float) -> jax.Array:
  """Entropy (nats) of softmax(logits / T) per row, [B, V] -> [B]; T = 0 uses T = 1."""
  scaled = logits.astype(jnp.float32) / (temperature or 1.0)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _sample_rows(keys: jax.Array, logits: jax.Array, sampling_config: SamplingConfig):
  """One token per row, each row with its own key: (tokens [R], logp [R])."""
  def one(key, row_logits):
    token, logp = draw(key, row_logits[None], sampling_config)
    return token[0], logp[0]
  return jax.vmap(one)(keys, logits)


def _forward_rows(params, tokens, positions, kv_mask, cache, slots, model_config):
  """One-token forward per row, each writing its KV at its own cache slot.

  tokens, positions, slots [R]; kv_mask [R, S + 1]. Returns (logits [R, V], cache).
  A mixture-of-experts model runs its experts by dense dispatch here: `jax.lax.ragged_dot`
  cannot be batched by `vmap` (JAX 0.10: "NYI"). With one token per row the dense dispatch
  reads each expert's weights once, as the grouped matmul does once a decode batch hits every
  expert, and gives the same values (tests/test_moe.py).
  """
  if model_config.is_moe:
    model_config = model_config.replace(moe_dispatch="dense")
  def one(token, position, mask, cache_row, slot):
    cache_row = jax.tree.map(lambda c: c[:, None], cache_row)
    logits, cache_row = transformer.forward(params, token[None, None], position[None, None],
                                            mask[None], model_config, cache=cache_row,
                                            cache_index=slot)
    return logits[0, 0], jax.tree.map(lambda c: c[:, 0], cache_row)
  return jax.vmap(one, in_axes=(0, 0, 0, 1, 0), out_axes=(0, 1))(
      tokens, positions, kv_mask, cache, slots)


def _write_and_forward(params, st: TreeState, live, token, logp, entropy, version,
                       model_config: ModelConfig, sampling_config: SamplingConfig) -> TreeState:
  """The shared token step (`sampler.write_token`) with each live row at its own slot
  P + step; rows that are not live write to the scratch slot and keep their state."""
  scratch = st.tokens.shape[1]

  def forward(token, position, token_mask, cache, slot):
    kv_mask = jnp.pad(token_mask, ((0, 0), (0, 1))) | (slot == scratch)[:, None] & (
        jnp.arange(scratch + 1)[None, :] == scratch)
    logits, cache = _forward_rows(params, token[:, 0], position[:, 0], kv_mask, cache, slot,
                                  model_config)
    return logits[:, None], cache

  slot = jnp.where(live, st.prompt_len + st.step, scratch)
  new = write_token(st, live, token, logp, version, slot, sampling_config, forward)
  at_pos = (jnp.arange(st.entropy.shape[1])[None, :] == st.step[:, None]) & live[:, None]
  return new.replace(
      entropy=jnp.where(at_pos, entropy[:, None], st.entropy),
      step=st.step + live.astype(jnp.int32),
      next_logits=jnp.where(live[:, None], new.next_logits, st.next_logits),
      decoded_tokens=st.decoded_tokens + live.sum(dtype=jnp.int32),
      decode_steps=st.decode_steps + 1)


def _live(st: TreeState) -> jax.Array:
  return st.born & ~st.done & (st.step < st.tokens.shape[1] - st.prompt_len)


def _sample_live(st: TreeState, sampling_config: SamplingConfig):
  keys = jax.vmap(jax.random.fold_in)(st.rng, st.step)
  token, logp = _sample_rows(keys, st.next_logits, sampling_config)
  return token, logp, sampling_entropy(st.next_logits, sampling_config.temperature)


def _decode(params, st: TreeState, version, model_config, sampling_config, stop_at=None) -> TreeState:
  """Decodes every live row until it stops, runs out of slots or reaches completion
  position `stop_at` (static; None = the end)."""
  limit = st.tokens.shape[1] - st.prompt_len if stop_at is None else stop_at

  def active(s):
    return _live(s) & (s.step < limit)

  def body(s):
    token, logp, entropy = _sample_live(s, sampling_config)
    return _write_and_forward(params, s, active(s), token, logp, entropy, version,
                              model_config, sampling_config)

  return jax.lax.while_loop(lambda s: jnp.any(active(s)), body, st)


# --- Row bookkeeping. Rows are [prompts * leaves]; the cache keeps rows on axis 1. ---

_COUNTERS = ("decoded_tokens", "refed_tokens", "pruned_tokens", "decode_steps")
_NOT_PER_ROW = ("prompt_len", "leaves") + _COUNTERS


def _row_fields(st: TreeState) -> list[tuple[str, int]]:
  """(name, row axis) of every per-row array field; the cache keeps rows on axis 1."""
  return [(f.name, 1 if f.name == "cache" else 0) for f in dataclasses.fields(st)
          if f.name not in _NOT_PER_ROW]


def _map_rows(fn, st: TreeState, **static) -> TreeState:
  """Applies fn(x, axis) to every per-row array of the state (counters untouched)."""
  fields = {name: jax.tree.map(lambda x, a=axis: fn(x, a), getattr(st, name))
            for name, axis in _row_fields(st)}
  return st.replace(**fields, **static)


def _where_rows(mask: jax.Array, new: TreeState, old: TreeState) -> TreeState:
  """Rows of `new` where mask [R], else rows of `old` (counters from `old`)."""
  def pick(a, b, axis):
    shape = [1] * a.ndim
    shape[axis] = -1
    return jnp.where(mask.reshape(shape), a, b)
  fields = {name: jax.tree.map(lambda a, b, ax=axis: pick(a, b, ax), getattr(new, name),
                               getattr(old, name))
            for name, axis in _row_fields(old)}
  return old.replace(**fields)


def _block(st: TreeState, start: int, stop: int) -> TreeState:
  """Rows [start, stop) of every prompt, as a state of prompts * (stop - start) rows."""
  def take(x, axis):
    shape = x.shape[:axis] + (-1, st.leaves) + x.shape[axis + 1:]
    x = jax.lax.slice_in_dim(x.reshape(shape), start, stop, axis=axis + 1)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
  return _map_rows(take, st, leaves=stop - start)


def _put_block(st: TreeState, block: TreeState, start: int) -> TreeState:
  """Writes `block` (from `_block(st, start, ...)`) back into rows [start, ...)."""
  def put(x, axis, y):
    shape = lambda a, n: a.shape[:axis] + (-1, n) + a.shape[axis + 1:]
    out = jax.lax.dynamic_update_slice_in_dim(
        x.reshape(shape(x, st.leaves)), y.reshape(shape(y, block.leaves)), start, axis=axis + 1)
    return out.reshape(x.shape)
  fields = {name: jax.tree.map(lambda x, y, a=axis: put(x, a, y), getattr(st, name),
                               getattr(block, name))
            for name, axis in _row_fields(st)}
  return st.replace(**fields, **{name: getattr(block, name) for name in _COUNTERS})


def _gather_rows(st: TreeState, rows: jax.Array) -> TreeState:
  """The state whose row i is row rows[i] of `st` (global indices); leaves = len / prompts."""
  prompts = st.born.shape[0] // st.leaves
  return _map_rows(lambda x, axis: jnp.take(x, rows, axis=axis), st,
                   leaves=rows.shape[0] // prompts)


def _truncate(st: TreeState, keep: jax.Array) -> TreeState:
  """Forgets completion positions >= keep [R] (the cache slots stay; they are masked)."""
  completion_len = st.tokens.shape[1] - st.prompt_len
  slot = jnp.arange(st.tokens.shape[1])[None, :]
  drop = slot >= st.prompt_len + keep[:, None]
  pos = jnp.arange(completion_len)[None, :] >= keep[:, None]
  return st.replace(
      tokens=jnp.where(drop, 0, st.tokens), token_mask=st.token_mask & ~drop,
      behavior_logp=jnp.where(drop, 0.0, st.behavior_logp),
      version=jnp.where(drop, -1, st.version), entropy=jnp.where(pos, 0.0, st.entropy),
      branched=st.branched & ~pos, done=jnp.zeros_like(st.done), step=keep,
      next_position=st.next_position - (st.step - keep))


def _refeed(params, st: TreeState, rows: jax.Array, model_config) -> TreeState:
  """Recomputes next-token logits of `rows` [R] (bool) by re-running their last kept token
  (slot P + step - 1, the last prompt token when step = 0) against their copied cache."""
  slot = st.prompt_len + st.step - 1
  token = jnp.take_along_axis(st.tokens, slot[:, None], axis=1)[:, 0]
  scratch = st.tokens.shape[1]
  slot = jnp.where(rows, slot, scratch)
  kv_mask = jnp.pad(st.token_mask, ((0, 0), (0, 1))) | (
      jnp.arange(scratch + 1)[None, :] == slot[:, None])
  logits, cache = _forward_rows(params, token, st.next_position - 1, kv_mask, st.cache, slot,
                                model_config)
  return st.replace(next_logits=jnp.where(rows[:, None], logits, st.next_logits), cache=cache,
                    refed_tokens=st.refed_tokens + rows.sum(dtype=jnp.int32))


def _init_state(params, prompt_tokens, prompt_mask, rng, model_config, sampling_config,
                leaves: int, init_chains: int) -> TreeState:
  """Prefills each prompt once and copies it into its `leaves` rows; the first
  `init_chains` rows of each prompt are born (chains from the prompt)."""
  first = prefill(params, prompt_tokens, prompt_mask, rng, model_config, sampling_config,
                  scratch_slots=1)
  rows, completion_len = prompt_tokens.shape[0] * leaves, sampling_config.max_new_tokens
  repeat = lambda x, axis=0: jnp.repeat(x, leaves, axis=axis)
  index = jnp.arange(rows) % leaves
  return TreeState(
      tokens=repeat(first.tokens), token_mask=repeat(first.token_mask),
      behavior_logp=repeat(first.behavior_logp), version=repeat(first.version),
      done=repeat(first.done), step=jnp.zeros((rows,), jnp.int32),
      next_logits=repeat(first.next_logits), next_position=repeat(first.next_position),
      cache=jax.tree.map(lambda c: repeat(c, axis=1), first.cache),
      rng=jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(rows)),
      entropy=jnp.zeros((rows, completion_len), jnp.float32),
      branched=jnp.zeros((rows, completion_len), bool), born=index < init_chains,
      parent=jnp.full((rows,), -1, jnp.int32), depth=jnp.zeros((rows,), jnp.int32),
      prefix_len=jnp.zeros((rows,), jnp.int32), birth_step=jnp.full((rows,), -1, jnp.int32),
      window_open=jnp.zeros((rows,), bool),
      last_fork=jnp.full((rows,), -(2 ** 20), jnp.int32), decoded_tokens=jnp.zeros((), jnp.int32),
      refed_tokens=jnp.zeros((), jnp.int32), pruned_tokens=jnp.zeros((), jnp.int32),
      decode_steps=jnp.zeros((), jnp.int32), prompt_len=first.prompt_len, leaves=leaves)


def _adopt(child: TreeState, born, parent_local, prefix_len, depth, birth_step, keys) -> TreeState:
  """Marks copied rows as forks: tree metadata, the row's own key, born flag."""
  return child.replace(born=born, parent=jnp.where(born, parent_local, -1),
                       depth=jnp.where(born, depth, 0),
                       prefix_len=jnp.where(born, prefix_len, 0),
                       birth_step=jnp.where(born, birth_step, -1), rng=keys)


# --- Fork policies. ---

def _entropy_fork(params, st: TreeState, version, policy: EntropyFork, model_config,
                  sampling_config) -> TreeState:
  """EPTree: decode the chains, then per round fork B branches at the N highest-entropy
  unbranched tree tokens (each token counted once, in the row that decoded it)."""
  m, n, b = policy.init_chains, policy.fork_points, policy.branches
  completion_len = sampling_config.max_new_tokens
  prompts = st.born.shape[0] // st.leaves
  chains = _decode(params, _block(st, 0, m), version, model_config, sampling_config)
  st = _put_block(st, chains, 0)
  for round_index in range(policy.rounds):
    grown = m + round_index * n * b  # rows that exist before this round
    tree = _block(st, 0, grown)
    pos = jnp.arange(completion_len)[None, :]
    owned = (tree.born[:, None] & (pos >= tree.prefix_len[:, None]) & (pos < tree.step[:, None])
             & ~tree.branched)
    score = jnp.where(owned, tree.entropy, -jnp.inf).reshape(prompts, grown * completion_len)
    best, flat = jax.lax.top_k(score, n)                             # [prompts, n]
    ok = jnp.isfinite(best)
    local_row, fork_pos = flat // completion_len, flat % completion_len
    # Mark the chosen tokens as branch points in their rows.
    global_row = jnp.arange(prompts)[:, None] * st.leaves + local_row
    mark = jnp.zeros_like(st.branched).at[global_row.reshape(-1), fork_pos.reshape(-1)].max(
        ok.reshape(-1))
    st = st.replace(branched=st.branched | mark)
    # Children of fork point i are rows grown + i * b + j, j < b.
    rep = lambda x: jnp.repeat(x, b, axis=1).reshape(-1)
    child = _gather_rows(st, rep(global_row))
    child_born, child_pos = rep(ok), rep(fork_pos)
    child = _truncate(child, child_pos)
    child = child.replace(branched=child.branched | (pos == child_pos[:, None]))
    child_rows = (jnp.arange(prompts)[:, None] * st.leaves + grown
                  + jnp.arange(n * b)[None, :]).reshape(-1)
    fresh_keys = jax.vmap(jax.random.fold_in)(st.rng[child_rows], jnp.full_like(child_rows, 1))
    child = _adopt(child, child_born, rep(local_row), child_pos, child.depth + 1,
                   child_pos, fresh_keys)
    child = _refeed(params, child, child_born, model_config)
    child = _decode(params, child, version, model_config, sampling_config)
    st = _put_block(st, child, grown)
  return st


def _fixed_segments(params, st: TreeState, version, policy: FixedSegments, model_config,
                    sampling_config) -> TreeState:
  """TreePO-like: decode `segment_len` tokens, then every live row of the current level
  forks into `branches` rows; repeat `max_depth` times, then decode to the end."""
  width = policy.init_chains
  prompts = st.born.shape[0] // st.leaves
  for level in range(policy.max_depth):
    block = _decode(params, _block(st, 0, width), version, model_config, sampling_config,
                    stop_at=(level + 1) * policy.segment_len)
    st = _put_block(st, block, 0)
    # Row i of the level forks into rows i + k * width, k = 1 .. branches - 1.
    parents = jnp.arange(prompts)[:, None] * st.leaves + jnp.arange(width)[None, :]
    parents = jnp.tile(parents, (1, policy.branches - 1)).reshape(-1)
    child = _gather_rows(st, parents)
    child_born = _live(child)
    child_rows = (jnp.arange(prompts)[:, None] * st.leaves + width
                  + jnp.arange(width * (policy.branches - 1))[None, :]).reshape(-1)
    keys = jax.vmap(jax.random.fold_in)(st.rng[child_rows], jnp.full_like(child_rows, 1))
    child = _adopt(child, child_born, parents % st.leaves, child.step, child.depth + 1,
                   child.step, keys)
    st = _put_block(st, child, width)
    width *= policy.branches
  return _put_block(st, _decode(params, _block(st, 0, width), version, model_config,
                                sampling_config), 0)


def _lookahead(params, st: TreeState, version, policy: Lookahead, model_config,
               sampling_config) -> TreeState:
  """LATR: one decode loop in which uncertain rows spawn top-k children into unused rows
  and children that stay similar to their parent over the lookahead window are pruned."""
  prompts, leaves = st.born.shape[0] // st.leaves, st.leaves
  completion_len = sampling_config.max_new_tokens
  kids, window = policy.top_k - 1, policy.lookahead_steps
  prompt_base = jnp.repeat(jnp.arange(prompts) * leaves, leaves)

  def spawn(s: TreeState, token, logp, entropy):
    """Children of uncertain rows: copies of the row before this step, with a forced token."""
    want = _live(s) & (entropy >= policy.min_entropy) & (s.step - s.last_fork > window)
    _, top = jax.lax.top_k(s.next_logits, policy.top_k)                # [R, top_k]
    differs_last = jnp.argsort(top == token[:, None], axis=1, stable=True)
    others = jnp.take_along_axis(top, differs_last, axis=1)[:, :kids]  # [R, kids]
    # Request q = (row q // kids, candidate q % kids) goes to the rank(q)-th unused row.
    request = jnp.repeat(want, kids).reshape(prompts, leaves * kids)
    free = ~s.born.reshape(prompts, leaves)
    match = (request[:, :, None] & free[:, None, :]
             & ((jnp.cumsum(request, axis=1) - 1)[:, :, None]
                == (jnp.cumsum(free, axis=1) - 1)[:, None, :]))       # [prompts, requests, leaves]
    gets_child = match.any(axis=1).reshape(-1)                         # [R]
    served = jnp.argmax(match, axis=1)                                 # [prompts, leaves]
    src_row = prompt_base + served.reshape(-1) // kids
    forced = jnp.take_along_axis(others.reshape(prompts, leaves * kids), served, axis=1).reshape(-1)
    keys = jax.vmap(jax.random.fold_in)(s.rng, s.step + 1)
    child = _gather_rows(s, jnp.where(gets_child, src_row, jnp.arange(src_row.shape[0])))
    child = _adopt(child, gets_child, src_row % leaves, child.step, child.depth + 1, child.step,
                   keys).replace(window_open=gets_child, last_fork=child.step)
    forked = jnp.zeros_like(s.born).at[src_row].max(gets_child)
    s = _where_rows(gets_child, child, s)
    s = s.replace(last_fork=jnp.where(forked, s.step, s.last_fork))
    scaled = s.next_logits / (sampling_config.temperature or 1.0)
    forced_logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), forced[:, None],
                                      axis=1)[:, 0]
    return (s, jnp.where(gets_child, forced, token), jnp.where(gets_child, forced_logp, logp),
            jnp.where(gets_child, entropy[src_row], entropy))

  def prune(s: TreeState) -> TreeState:
    """Closes finished lookahead windows; prunes children that matched their parent."""
    pos = jnp.arange(completion_len)[None, :]
    completion = s.tokens[:, s.prompt_len:]
    parent_tokens = completion[prompt_base + jnp.maximum(s.parent, 0)]
    in_window = ((pos > s.birth_step[:, None]) & (pos <= s.birth_step[:, None] + window)
                 & (pos < s.step[:, None]))
    closing = s.window_open & ((s.step > s.birth_step + window) | s.done
                               | (s.step >= completion_len))
    size = in_window.sum(axis=1)
    same = (in_window & (completion == parent_tokens)).sum(axis=1)
    pruned = closing & (size > 0) & (same >= policy.prune_similarity * size)
    return s.replace(born=s.born & ~pruned, window_open=s.window_open & ~closing,
                     pruned_tokens=s.pruned_tokens + jnp.where(pruned, s.step - s.prefix_len,
                                                               0).sum(dtype=jnp.int32))

  def body(s):
    token, logp, entropy = _sample_live(s, sampling_config)
    s, token, logp, entropy = spawn(s, token, logp, entropy)
    s = _write_and_forward(params, s, _live(s), token, logp, entropy, version, model_config,
                           sampling_config)
    return prune(s)

  return jax.lax.while_loop(lambda s: jnp.any(_live(s)), body, st)


def _to_generation(st: TreeState) -> Generation:
  """The trees' rows as a `Generation` with its tree fields; unused rows are emptied."""
  born = st.born[:, None]
  unused = (jnp.arange(st.tokens.shape[1])[None, :] >= st.prompt_len) & ~born
  return make_generation(
      jnp.where(unused, 0, st.tokens), st.token_mask & ~unused,
      jnp.where(born, st.behavior_logp, 0.0), jnp.where(born, st.version, -1),
      prompt_len=st.prompt_len, stopped=st.done & st.born, decode_steps=st.decode_steps,
      experts=routing_record(st.cache),
      tree=TreePaths(
          entropy=jnp.where(born, st.entropy, 0.0), leaf=st.born,
          node=jnp.where(st.born, jnp.arange(st.born.shape[0]) % st.leaves, -1),
          parent=jnp.where(st.born, st.parent, -1), depth=jnp.where(st.born, st.depth, 0),
          prefix_len=jnp.where(st.born, st.prefix_len, 0), row_key=st.rng,
          decoded_tokens=st.decoded_tokens, refed_tokens=st.refed_tokens,
          pruned_tokens=st.pruned_tokens))


@functools.partial(jax.jit, static_argnames=("model_config", "sampling_config", "policy"))
def tree_generate(params, prompt_tokens: jax.Array, prompt_mask: jax.Array, rng: jax.Array,
                  model_config: ModelConfig, sampling_config: SamplingConfig,
                  policy: ForkPolicy, version: jax.Array | int = 0) -> Generation:
  """Samples one tree per left-padded prompt [prompts, P]; rows [prompts * policy.leaves].

  Rows of prompt i are [i * leaves, (i + 1) * leaves); the `Generation` has its tree
  fields set. `version` is recorded on every generated token (traced, so it never
  recompiles).
  """
  chex.assert_rank([prompt_tokens, prompt_mask], 2)
  version = jnp.asarray(version, jnp.int32)
  st = _init_state(params, prompt_tokens, prompt_mask, rng, model_config, sampling_config,
                   policy.leaves, policy.init_chains)
  if isinstance(policy, EntropyFork):
    st = _entropy_fork(params, st, version, policy, model_config, sampling_config)
  elif isinstance(policy, FixedSegments):
    st = _fixed_segments(params, st, version, policy, model_config, sampling_config)
  elif isinstance(policy, Lookahead):
    st = _lookahead(params, st, version, policy, model_config, sampling_config)
  else:
    raise ValueError(f"Unknown fork policy {policy!r}; use EntropyFork, FixedSegments or "
                     "Lookahead.")
  return _to_generation(st)
