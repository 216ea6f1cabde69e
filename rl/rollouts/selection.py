"""Choosing what to roll out (docs/benchmarks_selection.md).

GRPO learns nothing from a group whose rewards are all equal (every advantage is 0), and
late in training most groups are like that. Five ways to pick the rows of a GRPO batch,
selected by `config.selection.kind`, each a registered `SelectionRule` whose settings are
`SelectionSettings`:

  uniform   the next `prompts_per_step` prompts, `group_size` rollouts each (plain GRPO).
  dynamic   DAPO dynamic sampling (Yu et al. 2025): roll out the next prompts, drop groups
            with zero reward variance, and refill from the following prompts until the batch
            holds `prompts_per_step` informative groups; groups beyond that are discarded.
            After `max_attempts` rounds without filling the batch, a ValueError.
  greso     GRESO (Zheng et al. 2025, "Act Only When It Pays"): before rollout, skip a prompt
            whose recent groups were all-equal with probability 1 - p_e ** z, where z is its
            run of consecutive uninformative rollouts and p_e an exploration probability kept
            per class (easy: all-equal at a high reward; hard: at a low one). Then dynamic
            sampling as above (`greso.refill`; off: train on what was rolled out).
  adaptive  a fixed rollout budget B = prompts_per_step * group_size spent adaptively
            (AERO / VIGOR / Pilot-Commit style): `initial_rollouts` pilot rollouts for each of
            `adaptive.prompts` prompts, then the rest of the budget one rollout at a time to the
            prompt with the highest score / rollouts-so-far (D'Hondt, which approaches
            Neyman allocation n_i ~ score_i), capped at `max_rollouts` per prompt. Groups that
            stay all-equal are rejected (their rows are masked out of the loss).
  pods      PODS max-variance down-sampling (Xu et al. 2025, arXiv 2504.13818): roll out
            `pods.rollouts` = n > group_size completions of each of the next prompts, and
            train on the group_size = m of them whose rewards have the largest variance
            (`max_variance_subset`); advantages are then computed over the m kept rows, as
            the paper's GRPO-PODS does. Sampling is cheap and parallel, the update is not:
            the batch's train cost is that of m rows per prompt.
  ar3po     AR3PO adaptive rollout and response reuse (arXiv 2509.25808): rollouts come in
            `ar3po.stages` stages of group_size / stages completions; a prompt stops
            getting more once one of its completions is an exact answer, so easy prompts
            cost one stage and only unsolved ones get the whole group_size. A prompt whose
            group stays all wrong gets, with `ar3po.reuse`, the exact response it produced
            on an earlier visit (`ResponseMemory`), with the log-probs and parameter
            version it was sampled with, in place of its group's last row, so the group
            has a non-zero advantage. Details the paper's abstract leaves open, chosen
            here: "correct" is the task's exact match; the memory keeps each prompt's
            latest exact response; the batch keeps the fixed prompts_per_step x
            group_size rows of the other rules (one compiled train step), the rows a
            stopped prompt did not sample being padding (no completion tokens, a
            singleton group of reward 0: zero advantage, left out of every loss mean but
            Dr.GRPO's constant normaliser); a later stage samples its waiting prompts
            padded to a power of two (`stage_prompts`: a few sampler shapes, each
            compiled once; the padding rows are decoded, counted and dropped); a reused
            row has no scored text (training
            samples skip it). A reused row is as old as the visit that sampled it: the
            step's `staleness` metric counts it, and rl.max_staleness (which schedules
            the async producer) does not bound it; the objective's clipping or
            correction is what handles it, as for any off-policy row. With tools, the
            stored row keeps its environment tokens.
            Like adaptive allocation its groups differ in size, so the prefix-shared
            forward and the 'group' draft source are refused with it.

Prompt identity. With `train_pool = P > 0` the train split is a finite pool: data cursor c
reads train position c mod P, so prompts recur once per epoch of P cursor steps and their
history (`SelectionState`, indexed by pool position) means something. GRESO needs a pool;
the adaptive Beta score uses the history when there is one. With P = 0 the train split is
unbounded and no per-prompt state is kept.

The state lives in `LoopState.selection` (AR3PO's stored responses too) and is checkpointed with it, and every random
decision is drawn from the loop's key, so a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rl import stages
from rl.registry import Registry
from rl.rollouts import statistics
from rl.settings.selection import SelectionSettings
from rl.rollouts.batches import ScoredSamples
from rl.types import Rollout

EASY, HARD = 0, 1  # indices into SelectionState.explore_prob
_SKIP_STREAM = 0x5EED  # fold_in tag of the key stream for GRESO's skip draws
# An all-equal group is 'easy' when its common reward is at least this (solved), else 'hard'.
_EASY_REWARD = 0.5

# sample(row_positions [R] int, rng) -> ScoredSamples of R rows, row i answering the prompt
# at train position row_positions[i] (groups are assigned by `collect`).
SampleFn = Callable[[np.ndarray, jax.Array], ScoredSamples]


@flax.struct.dataclass
class ResponseMemory:
  """AR3PO's stored exact responses, one per pool prompt, each row as it was sampled:
  tokens, prompt_mask, completion_mask, env_mask [P, T] (an environment's answers, all
  False without one), behavior_logp [P, T] (the sampler's log-probs) and version [P, T]
  (the parameter version that generated each token), reward [P]; stored [P]: whether the
  prompt has one yet."""
  tokens: jax.Array
  prompt_mask: jax.Array
  completion_mask: jax.Array
  env_mask: jax.Array
  behavior_logp: jax.Array
  version: jax.Array
  reward: jax.Array
  stored: jax.Array


def init_memory(pool_size: int, sequence_length: int) -> ResponseMemory:
  """An empty ResponseMemory for a pool of `pool_size` prompts of `sequence_length` slots."""
  shape = (pool_size, sequence_length)
  no = np.zeros(shape, bool)
  return ResponseMemory(tokens=np.zeros(shape, np.int32), prompt_mask=no, completion_mask=no,
                        env_mask=no, behavior_logp=np.zeros(shape, np.float32),
                        version=np.full(shape, -1, np.int32),
                        reward=np.zeros(pool_size, np.float32),
                        stored=np.zeros(pool_size, bool))


@flax.struct.dataclass
class SelectionState:
  """Per-prompt selection history over a train pool of P prompts (checkpointed).

  uninformative_run [P] int32: consecutive rollouts of the prompt whose group had all-equal
    rewards (GRESO's z); 0 after an informative group.
  uninformative_easy [P] bool: whether the last all-equal group was at a high reward.
  skip_run [P] int32: consecutive epochs GRESO skipped the prompt.
  reward_sum, failure_sum [P] float32: discounted Beta pseudo-counts, sum(r) and sum(1 - r)
    over the prompt's past rollouts (rewards in [0, 1]; partial credit counts fractionally).
  explore_prob [2] float32: GRESO's exploration probability p_e for (easy, hard) prompts.
  memory: AR3PO's stored responses (`ResponseMemory`), None for the other rules.
  """
  uninformative_run: jax.Array
  uninformative_easy: jax.Array
  skip_run: jax.Array
  reward_sum: jax.Array
  failure_sum: jax.Array
  explore_prob: jax.Array
  memory: Optional[ResponseMemory] = None


@dataclasses.dataclass
class Collected:
  """A training batch and what it cost: `rollout` [rows, T]; `exact` [rows] exact-match
  flags; `selection` the updated state; `cursor` the next data cursor; `stats` over every
  row rolled out (rl/rollouts/statistics.py), with the rule's counters."""
  rollout: Rollout
  exact: np.ndarray
  selection: Optional[SelectionState]
  cursor: int
  stats: statistics.BatchStats


@dataclasses.dataclass(frozen=True)
class SelectionRule:
  """One way of choosing a GRPO batch's rows (config.selection.kind), registered in
  `SELECTION_RULES`.

  Attributes:
    collect: `(state, cursor, rng, sample, *, settings, prompts_per_step, group_size,
      pool_size) -> Collected`: rolls out and assembles one batch (`sample` rolls out rows
      of given train positions; `state` is the SelectionState or None).
    keeps_history: records each rolled-out group in the SelectionState.
    skips_prompts: draws GRESO's skip decision for each candidate before rollout.
    needs_pool: needs prompts that recur (config.task.train_pool > 0).
    refills: `(settings) -> bool`: whether, under these settings, the rule rolls out further
      rounds until the batch holds prompts_per_step informative groups (DAPO dynamic
      sampling).
    check: `(settings, prompts_per_step, group_size) -> None`: raises ValueError for
      settings the rule cannot run with these batch sizes.
    chooses: chooses prompts or rollout counts (False: each prompt in data order with
      group_size rows, which every rollout kind can do).
    equal_groups: every group has exactly group_size rows (False: adaptive allocation
      sizes them per prompt).
    stores_responses: keeps a `ResponseMemory` in its state (AR3PO's reuse).
    declares: `(settings) -> rl.stages.Declaration`: what its batches are and what it
      reads while making them (a rule that chooses prompts by their rewards reads them;
      AR3PO's reused responses were sampled by earlier parameters, scored at an earlier
      step and keep no routing record), checked against the stages' and the train step's
      needs.

  >>> greso = SELECTION_RULES.get("greso")
  >>> greso.refills(SelectionSettings(kind="greso")), SELECTION_RULES.get("uniform").refills(
  ...     SelectionSettings())
  (True, False)
  >>> SELECTION_RULES.get("adaptive").check(SelectionSettings(kind="adaptive"), 4, 1)
  Traceback (most recent call last):
  ...
  ValueError: config.selection.adaptive: prompts (4) * initial_rollouts (4) must not exceed the rollout budget prompts_per_step * group_size = 4; lower prompts or initial_rollouts.
  """
  collect: Callable[..., "Collected"]
  keeps_history: bool = True
  skips_prompts: bool = False
  needs_pool: bool = False
  refills: Callable[[SelectionSettings], bool] = lambda settings: False
  check: Callable[[SelectionSettings, int, int], None] = lambda settings, prompts, group: None
  chooses: bool = True
  equal_groups: bool = True
  stores_responses: Callable[[SelectionSettings], bool] = lambda settings: False
  declares: Callable[[SelectionSettings], stages.Declaration] = (
      lambda settings: stages.Declaration())


def init_state(pool_size: int, settings: SelectionSettings,
               sequence_length: int = 0) -> Optional[SelectionState]:
  """Fresh history for a pool of `pool_size` prompts (None when the pool is unbounded);
  with a rule that stores responses, an empty `ResponseMemory` of rows of
  `sequence_length` slots (prompt_len + max_new_tokens)."""
  if pool_size <= 0:
    return None
  memory = None
  if rule_of(settings).stores_responses(settings):
    if sequence_length <= 0:
      raise ValueError(f"config.selection.kind={settings.kind!r} stores responses: "
                       "init_state needs their sequence_length (prompt_len + max_new_tokens).")
    memory = init_memory(pool_size, sequence_length)
  zeros_i = jnp.zeros((pool_size,), jnp.int32)
  zeros_f = jnp.zeros((pool_size,), jnp.float32)
  p_e = settings.greso.explore_prob
  return SelectionState(uninformative_run=zeros_i, uninformative_easy=jnp.zeros((pool_size,), bool),
                        skip_run=zeros_i, reward_sum=zeros_f, failure_sum=zeros_f,
                        explore_prob=jnp.array([p_e, p_e], jnp.float32), memory=memory)


def check(settings: SelectionSettings, *, prompts_per_step: int, group_size: int,
          pool_size: int) -> None:
  """Raises ValueError naming the inconsistent `config.selection` field and the fix."""
  settings.check()
  rule = rule_of(settings)
  if pool_size < 0:
    raise ValueError(f"config.task.train_pool = {pool_size} must be >= 0 (0 = unbounded).")
  if rule.needs_pool and pool_size <= 0:
    raise ValueError(f"config.selection.kind={settings.kind!r} needs recurring prompts: set "
                     "config.task.train_pool > 0 (the size of the finite prompt pool).")
  rule.check(settings, prompts_per_step, group_size)


def _check_adaptive(settings: SelectionSettings, prompts_per_step: int, group_size: int) -> None:
  """The pilot rollouts fit in the budget B = prompts_per_step * group_size, and the caps
  can hold it."""
  a = settings.adaptive
  prompts = a.prompts or prompts_per_step
  budget = prompts_per_step * group_size
  max_rollouts = a.max_rollouts or 2 * group_size
  if prompts * a.initial_rollouts > budget:
    raise ValueError(
        f"config.selection.adaptive: prompts ({prompts}) * initial_rollouts "
        f"({a.initial_rollouts}) must not exceed the rollout budget prompts_per_step * "
        f"group_size = {budget}; lower prompts or initial_rollouts.")
  if prompts * max_rollouts < budget or max_rollouts < a.initial_rollouts:
    raise ValueError(
        f"config.selection.adaptive: prompts ({prompts}) * max_rollouts ({max_rollouts}) "
        f"cannot hold the budget {budget} (or max_rollouts < initial_rollouts); raise "
        "max_rollouts or prompts.")


def train_position(cursor: int | np.ndarray, pool_size: int):
  """The train-split position read at data cursor `cursor` (cycling over a finite pool)."""
  return cursor % pool_size if pool_size > 0 else cursor


def keep_probability(state: SelectionState, positions: np.ndarray,
                     settings: SelectionSettings) -> np.ndarray:
  """GRESO's probability of rolling out each prompt at `positions` [n] this epoch.

  1 for a prompt whose last group was informative (z = 0); otherwise
  max(p_e ** z, min_keep_prob) with p_e of the prompt's class (the exploration floor), and
  1 again once the prompt has been skipped `max_skips` epochs in a row, so no prompt
  is starved.
  """
  g = settings.greso
  z = np.asarray(state.uninformative_run)[positions]
  easy = np.asarray(state.uninformative_easy)[positions]
  p_e = np.where(easy, np.asarray(state.explore_prob)[EASY], np.asarray(state.explore_prob)[HARD])
  keep = np.maximum(np.power(p_e.astype(np.float64), z), g.min_keep_prob)
  keep = np.where(z == 0, 1.0, keep)
  return np.where(np.asarray(state.skip_run)[positions] >= g.max_skips, 1.0, keep)


def choose_prompts(state: Optional[SelectionState], cursor: int, n: int, rng: jax.Array,
                   settings: SelectionSettings,
                   pool_size: int) -> tuple[np.ndarray, int, int, Optional[SelectionState]]:
  """The next `n` prompts from `cursor`, skipping GRESO-filtered ones.

  Returns (positions [n], new cursor, number skipped, state with updated skip runs). Without
  GRESO it is the next n positions. Candidates are scanned in cursor order; each is kept
  with `keep_probability` (one uniform draw from `rng` per candidate, in order).
  """
  if not rule_of(settings).skips_prompts:
    return train_position(np.arange(cursor, cursor + n), pool_size), cursor + n, 0, state
  draws = np.random.default_rng(np.asarray(jax.random.key_data(rng)).tolist())
  skip_run = np.array(state.skip_run)
  chosen, skipped = [], 0
  while len(chosen) < n:  # ends: a prompt skipped max_skips times in a row is kept
    position = int(train_position(cursor, pool_size))
    cursor += 1
    if draws.random() < keep_probability(state.replace(skip_run=skip_run), np.array([position]),
                                          settings)[0]:
      chosen.append(position)
      skip_run[position] = 0
    else:
      skipped += 1
      skip_run[position] += 1
  return np.array(chosen), cursor, skipped, state.replace(skip_run=jnp.asarray(skip_run))


def observe(state: Optional[SelectionState], positions: np.ndarray, group_rewards: list[np.ndarray],
            settings: SelectionSettings) -> Optional[SelectionState]:
  """Records each rolled-out group (`group_rewards[i]` answers `positions[i]`) in the history.

  z grows by one for an all-equal group and resets to 0 otherwise; the Beta pseudo-counts
  decay by `adaptive.history_decay` and add the group's sum(r) and sum(1 - r). GRESO's p_e
  per class moves by `greso.adapt_step` towards keeping the share of all-equal groups of
  that class at `greso.target_zero_variance` (down when above it, up when below), within
  [min_keep_prob, 1]. A rule that keeps no history (uniform) records nothing.
  """
  if state is None or not rule_of(settings).keeps_history:
    return state
  g, decay = settings.greso, settings.adaptive.history_decay
  run, easy = np.array(state.uninformative_run), np.array(state.uninformative_easy)
  rsum, fsum = np.array(state.reward_sum), np.array(state.failure_sum)
  counts = np.zeros(2)
  for position, rewards in zip(positions, group_rewards):
    rewards = np.asarray(rewards, np.float64)
    if np.all(rewards == rewards[0]):
      run[position] += 1
      easy[position] = rewards[0] >= _EASY_REWARD
      counts[EASY if easy[position] else HARD] += 1
    else:
      run[position] = 0
    rsum[position] = decay * rsum[position] + rewards.sum()
    fsum[position] = decay * fsum[position] + (1.0 - rewards).sum()
  share = counts / max(len(group_rewards), 1)
  p_e = np.array(state.explore_prob, np.float64)
  p_e = np.where(share > g.target_zero_variance, p_e - g.adapt_step, p_e + g.adapt_step)
  p_e = np.clip(p_e, g.min_keep_prob, 1.0)
  return state.replace(uninformative_run=jnp.asarray(run), uninformative_easy=jnp.asarray(easy),
                       reward_sum=jnp.asarray(rsum, jnp.float32),
                       failure_sum=jnp.asarray(fsum, jnp.float32),
                       explore_prob=jnp.asarray(p_e, jnp.float32))


def allocation_scores(pilot_rewards: np.ndarray, positions: np.ndarray,
                      state: Optional[SelectionState], settings: SelectionSettings) -> np.ndarray:
  """Adaptive allocation's score per prompt from its pilot rewards [N, n0].

  variance: the pilot group's reward standard deviation (ddof=0), as AERO / VIGOR.
  beta: the standard deviation of the prompt's mean reward under a Beta(1 + s, 1 + f)
    posterior, s and f being the pilot's sum(r) and sum(1 - r) plus the prompt's discounted
    history (when there is a pool).
  """
  pilot_rewards = np.asarray(pilot_rewards, np.float64)
  if settings.adaptive.score == "variance":
    return pilot_rewards.std(axis=1)
  a = 1.0 + pilot_rewards.sum(axis=1)
  b = 1.0 + (1.0 - pilot_rewards).sum(axis=1)
  if state is not None:
    decay = settings.adaptive.history_decay
    a = a + decay * np.asarray(state.reward_sum, np.float64)[positions]
    b = b + decay * np.asarray(state.failure_sum, np.float64)[positions]
  return np.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))


def allocate(scores: np.ndarray, *, initial: int, budget: int, max_rollouts: int) -> np.ndarray:
  """Rollouts per prompt [N] summing exactly to `budget`, each in [initial, max_rollouts].

  Every prompt starts with `initial`; each further rollout goes to the prompt with the
  highest score / current count (D'Hondt; ties to the fewest rollouts, then the lowest
  index), so with equal scores the budget is spread evenly.
  """
  scores = np.asarray(scores, np.float64)
  n = scores.shape[0]
  if n * initial > budget or n * max_rollouts < budget:
    raise ValueError(f"Cannot allocate a budget of {budget} rollouts over {n} prompts with "
                     f"{initial} to {max_rollouts} each; change the adaptive allocation config.")
  counts = np.full(n, initial, np.int64)
  for _ in range(budget - n * initial):
    priority = np.where(counts < max_rollouts, scores / counts, -np.inf)
    best = np.flatnonzero(priority == priority.max())
    counts[best[np.argmin(counts[best])]] += 1
  return counts


def max_variance_subset(rewards: np.ndarray, m: int) -> np.ndarray:
  """PODS max-variance down-sampling: the indices (ascending) of the m of `rewards` [n]
  whose population variance is largest.

  The paper's lemma: some maximiser is the k largest rewards with the m - k smallest, for
  some k in 0..m, so sorting once and trying each k (prefix sums of r and r^2, O(n log n))
  finds it. Ties between k (and between equal rewards) go to the smallest k and the
  lowest indices, so the choice is deterministic.

  >>> max_variance_subset(np.array([0.0, 1.0, 1.0, 0.0, 1.0, 1.0]), 4).tolist()
  [0, 1, 2, 3]
  """
  rewards = np.asarray(rewards, np.float64)
  n = len(rewards)
  if not 1 <= m <= n:
    raise ValueError(f"max_variance_subset: m = {m} must be in 1..{n}.")
  order = np.argsort(rewards, kind="stable")
  ascending = rewards[order]
  low_sum = np.concatenate([[0.0], np.cumsum(ascending)])
  low_sq = np.concatenate([[0.0], np.cumsum(ascending ** 2)])
  high_sum = np.concatenate([[0.0], np.cumsum(ascending[::-1])])
  high_sq = np.concatenate([[0.0], np.cumsum(ascending[::-1] ** 2)])
  k = np.arange(m + 1)  # rows taken from the top
  total = high_sum[k] + low_sum[m - k]
  variance = (high_sq[k] + low_sq[m - k]) / m - (total / m) ** 2
  best = int(np.argmax(variance > variance.max() - 1e-12 * max(1.0, variance.max())))
  return np.sort(np.concatenate([order[:m - best], order[n - best:]]))


def _take_rows(rollouts: list[Rollout], index: np.ndarray) -> Rollout:
  """Rows `index` of the row-wise concatenation of `rollouts`."""
  return jax.tree.map(lambda *xs: jnp.asarray(np.concatenate([np.asarray(x) for x in xs])[index]),
                      *rollouts)


def _finish(rollout: Rollout, group: np.ndarray, keep_rows: np.ndarray) -> Rollout:
  """Sets the final batch's group ids and masks out rejected rows (the loop then computes
  advantages on it)."""
  completion_mask = rollout.completion_mask & jnp.asarray(keep_rows)[:, None]
  return rollout.replace(group=jnp.asarray(group, jnp.int32), completion_mask=completion_mask)


def _lengths(rollouts: list[Rollout]) -> np.ndarray:
  """Completion lengths of the rows of `rollouts`, in order."""
  return np.concatenate([np.asarray(r.completion_mask).sum(axis=1) for r in rollouts])


def _group_rewards(reward: np.ndarray, group: np.ndarray, n: int) -> list[np.ndarray]:
  return [reward[group == i] for i in range(n)]


def collect(state: Optional[SelectionState], cursor: int, rng: jax.Array, sample: SampleFn, *,
            settings: SelectionSettings, prompts_per_step: int, group_size: int,
            pool_size: int) -> Collected:
  """Rolls out and assembles one GRPO batch of `prompts_per_step * group_size` rows with
  the rule settings.kind names (`SELECTION_RULES`). Metrics count everything decoded, kept
  or not."""
  return rule_of(settings).collect(
      state, cursor, rng, sample, settings=settings, prompts_per_step=prompts_per_step,
      group_size=group_size, pool_size=pool_size)


def _collect_rounds(state, cursor, rng, sample, *, settings, prompts_per_step, group_size,
                    pool_size) -> Collected:
  """uniform, dynamic and greso: rounds of the next prompts (GRESO skipping some), refilled
  until the batch holds `prompts_per_step` informative groups when the rule refills.

  `rng` is the iteration's sampling key: the first rollout round samples with it unchanged
  (so 'uniform' reproduces plain GRPO exactly); round k > 0 uses fold_in(rng, k) and GRESO's
  skip draws of round k use fold_in(fold_in(rng, _SKIP_STREAM), k).
  """
  refill = rule_of(settings).refills(settings)
  rounds, kept = [], []  # kept: (round index, group index) of informative groups
  skipped = rows = tokens = decode_steps = 0
  skip_rng = jax.random.fold_in(rng, _SKIP_STREAM)
  for attempt in range(settings.max_attempts if refill else 1):
    key = rng if attempt == 0 else jax.random.fold_in(rng, attempt)
    positions, cursor, n_skipped, state = choose_prompts(
        state, cursor, prompts_per_step, jax.random.fold_in(skip_rng, attempt), settings,
        pool_size)
    samples = sample(np.repeat(positions, group_size), key)
    reward = np.asarray(samples.rollout.reward).reshape(prompts_per_step, group_size)
    state = observe(state, positions, list(reward), settings)
    rounds.append(samples)
    skipped += n_skipped
    rows += reward.size
    tokens += int(np.asarray(samples.rollout.completion_mask).sum())
    decode_steps += samples.decode_steps
    informative = (statistics.informative(reward) if refill
                   else np.ones(prompts_per_step, bool))
    kept += [(attempt, i) for i in np.flatnonzero(informative)]
    if len(kept) >= prompts_per_step:
      break
  else:
    raise ValueError(
        f"Selection {settings.kind!r}: only {len(kept)} of the {prompts_per_step} groups a "
        f"batch needs had non-zero reward variance after {settings.max_attempts} rounds of "
        f"{prompts_per_step} prompts (config.selection.max_attempts); the prompts are all "
        "solved or all failed by this policy. Raise max_attempts, change the task difficulty, "
        "or use config.selection.kind='uniform'.")
  kept = kept[:prompts_per_step]
  index = np.concatenate([r * prompts_per_step * group_size + i * group_size + np.arange(group_size)
                          for r, i in kept])
  rollout = _take_rows([s.rollout for s in rounds], index)
  exact_all = np.concatenate([s.exact for s in rounds])
  rows_all = [row for s in rounds for row in s.rows]
  group = np.repeat(np.arange(prompts_per_step), group_size)
  rollout = _finish(rollout, group, np.ones(len(index), bool))
  all_rewards = np.concatenate([np.asarray(s.rollout.reward) for s in rounds])
  batch_informative = statistics.informative(
      np.asarray(rollout.reward).reshape(prompts_per_step, group_size))
  counters = dict(rollout_rounds=len(rounds), prompts_skipped=skipped, rollouts=rows,
                  decode_steps=decode_steps,
                  batch_informative_groups=float(np.mean(batch_informative)),
                  informative_rows=int(group_size * np.sum(batch_informative)))
  if state is not None:
    counters.update(explore_prob_easy=float(state.explore_prob[EASY]),
                    explore_prob_hard=float(state.explore_prob[HARD]))
  stats = statistics.batch_stats(
      list(all_rewards.reshape(-1, group_size)), exact_all,
      _lengths([s.rollout for s in rounds]), _lengths([rollout]), decoded_tokens=tokens,
      scored=rounds, rows=[rows_all[i] for i in index], **counters,
      **statistics.draft_counters(rounds),
      **statistics.tool_counters(rounds))
  return Collected(rollout=rollout, exact=exact_all[index], selection=state, cursor=cursor,
                   stats=stats)


def _collect_adaptive(state, cursor, rng, sample, *, settings, prompts_per_step, group_size,
                      pool_size) -> Collected:
  """Pilot rollouts, then the rest of the budget where the score is highest (see module doc)."""
  a = settings.adaptive
  n = a.prompts or prompts_per_step
  budget = prompts_per_step * group_size
  positions = train_position(np.arange(cursor, cursor + n), pool_size)
  pilot = sample(np.repeat(positions, a.initial_rollouts), rng)
  pilot_rewards = np.asarray(pilot.rollout.reward).reshape(n, a.initial_rollouts)
  counts = allocate(allocation_scores(pilot_rewards, positions, state, settings),
                    initial=a.initial_rollouts, budget=budget,
                    max_rollouts=a.max_rollouts or 2 * group_size)
  extra_counts = counts - a.initial_rollouts
  rounds = [pilot]
  group = np.repeat(np.arange(n), a.initial_rollouts)
  if extra_counts.sum():
    extra = sample(np.repeat(positions, extra_counts), jax.random.fold_in(rng, 1))
    rounds.append(extra)
    group = np.concatenate([group, np.repeat(np.arange(n), extra_counts)])
  order = np.argsort(group, kind="stable")  # groups contiguous, pilot rows first
  rollout = _take_rows([s.rollout for s in rounds], order)
  group = group[order]
  reward = np.asarray(rollout.reward)
  group_rewards = _group_rewards(reward, group, n)
  informative = np.array([np.ptp(r) > 0 for r in group_rewards])
  rollout = _finish(rollout, group, informative[group])
  state = observe(state, positions, group_rewards, settings)
  exact = np.concatenate([s.exact for s in rounds])[order]
  rows_all = [row for s in rounds for row in s.rows]
  scored_lengths = _lengths([s.rollout for s in rounds])
  stats = statistics.batch_stats(
      group_rewards, exact, scored_lengths, _lengths([rollout]),
      decoded_tokens=int(scored_lengths.sum()), scored=rounds,
      rows=[rows_all[i] for i in order], rollout_rounds=len(rounds),
      prompts_skipped=0, rollouts=budget, decode_steps=sum(s.decode_steps for s in rounds),
      batch_informative_groups=float(informative.mean()),
      informative_rows=int(np.sum(informative[group])), max_group_size=int(counts.max()),
      **statistics.draft_counters(rounds), **statistics.tool_counters(rounds))
  return Collected(rollout=rollout, exact=exact, selection=state, cursor=cursor + n,
                   stats=stats)


def _collect_pods(state, cursor, rng, sample, *, settings, prompts_per_step, group_size,
                  pool_size) -> Collected:
  """PODS: `pods.rollouts` rollouts of each of the next prompts in one round, down-sampled to
  the group_size with the largest reward variance (`max_variance_subset`)."""
  n = pods_rollouts(settings, group_size)
  positions = train_position(np.arange(cursor, cursor + prompts_per_step), pool_size)
  samples = sample(np.repeat(positions, n), rng)
  rewards = np.asarray(samples.rollout.reward).reshape(prompts_per_step, n)
  index = np.concatenate([i * n + max_variance_subset(r, group_size)
                          for i, r in enumerate(rewards)])
  rollout = _finish(_take_rows([samples.rollout], index),
                    np.repeat(np.arange(prompts_per_step), group_size),
                    np.ones(len(index), bool))
  kept = np.asarray(rollout.reward).reshape(prompts_per_step, group_size)
  informative = statistics.informative(kept)
  stats = statistics.batch_stats(
      list(rewards), samples.exact, _lengths([samples.rollout]), _lengths([rollout]),
      decoded_tokens=int(np.asarray(samples.rollout.completion_mask).sum()), scored=[samples],
      rows=[samples.rows[i] for i in index], rollout_rounds=1, prompts_skipped=0,
      rollouts=rewards.size, decode_steps=samples.decode_steps,
      batch_informative_groups=float(np.mean(informative)),
      informative_rows=int(group_size * np.sum(informative)),
      **statistics.draft_counters([samples]), **statistics.tool_counters([samples]))
  return Collected(rollout=rollout, exact=samples.exact[index], selection=state,
                   cursor=cursor + prompts_per_step, stats=stats)


def _collect_ar3po(state, cursor, rng, sample, *, settings, prompts_per_step, group_size,
                   pool_size) -> Collected:
  """AR3PO: stages of group_size / stages rollouts for the prompts not yet solved, then a
  stored exact response into each group left all wrong (module docstring). Stage s > 0
  samples with fold_in(rng, s)."""
  per_stage = group_size // settings.ar3po.stages
  positions = train_position(np.arange(cursor, cursor + prompts_per_step), pool_size)
  unsolved = np.ones(prompts_per_step, bool)
  rounds, groups = [], []
  decoded_rows = decoded_tokens = decode_steps = 0
  for stage in range(settings.ar3po.stages):
    waiting = np.flatnonzero(unsolved)
    if not waiting.size:
      break
    sampled = stage_prompts(waiting, prompts_per_step)
    samples = sample(np.repeat(positions[sampled], per_stage),
                     rng if stage == 0 else jax.random.fold_in(rng, stage))
    decoded_rows += len(sampled) * per_stage
    decoded_tokens += int(np.asarray(samples.rollout.completion_mask).sum())
    decode_steps += samples.decode_steps
    samples = _first_rows(samples, len(waiting) * per_stage)
    group = np.repeat(waiting, per_stage)
    rounds.append(samples)
    groups.append(group)
    unsolved[group[np.asarray(samples.exact, bool)]] = False
  group = np.concatenate(groups)
  order = np.argsort(group, kind="stable")  # groups contiguous, earlier stages first
  rollout, group = _take_rows([s.rollout for s in rounds], order), group[order]
  exact = np.concatenate([s.exact for s in rounds])[order]
  rows_all = [row for s in rounds for row in s.rows]
  rows = [rows_all[i] for i in order]
  memory = None if state is None else state.memory
  reused = np.zeros(len(group), bool)
  if memory is not None:
    rollout, reused = _reuse_responses(rollout, group, unsolved, positions, memory)
    state = state.replace(memory=_store_responses(memory, rollout, group, exact & ~reused,
                                                  positions))
    rows = [None if r else row for row, r in zip(rows, reused)]
  sampled_rewards = _group_rewards(np.concatenate(
      [np.asarray(s.rollout.reward) for s in rounds])[order], group, prompts_per_step)
  trained_rewards = _group_rewards(np.asarray(rollout.reward), group, prompts_per_step)
  informative = np.array([np.ptp(r) > 0 for r in trained_rewards])
  padding = prompts_per_step * group_size - len(group)
  rollout = _pad_rows(_finish(rollout, group, np.ones(len(group), bool)), padding,
                      first_group=prompts_per_step)
  scored_lengths = _lengths([s.rollout for s in rounds])
  stats = statistics.batch_stats(
      sampled_rewards, exact, scored_lengths, _lengths([rollout]),
      decoded_tokens=decoded_tokens, scored=rounds, rows=rows + [None] * padding,
      rollout_rounds=len(rounds), prompts_skipped=0, rollouts=decoded_rows,
      stage_padding_rows=decoded_rows - len(group), decode_steps=decode_steps,
      batch_informative_groups=float(informative.mean()),
      informative_rows=int(sum(len(r) for r, i in zip(trained_rewards, informative) if i)),
      reused_responses=int(reused.sum()), padding_rows=padding,
      **statistics.draft_counters(rounds), **statistics.tool_counters(rounds))
  return Collected(rollout=rollout,
                   exact=np.concatenate([exact | reused, np.zeros(padding, bool)]),
                   selection=state, cursor=cursor + prompts_per_step, stats=stats)


def stage_prompts(waiting: np.ndarray, prompts_per_step: int) -> np.ndarray:
  """The prompts a stage samples for the `waiting` ones: those, then copies of the last
  up to the next power of two (at most prompts_per_step), so that the sampler sees at most
  log2(prompts_per_step) + 1 batch shapes (each compiles once) instead of one per count;
  the copies' rows are decoded and dropped (`stage_padding_rows`).

  >>> stage_prompts(np.array([1, 4, 6]), 8).tolist()
  [1, 4, 6, 6]
  """
  size = min(prompts_per_step, 1 << int(np.ceil(np.log2(len(waiting)))))
  return np.concatenate([waiting, np.full(size - len(waiting), waiting[-1])])


def _first_rows(samples: ScoredSamples, count: int) -> ScoredSamples:
  """The first `count` rows of a scored sample (its counters stay whole)."""
  if count == len(samples.exact):
    return samples
  rollout = jax.tree.map(lambda x: x[:count], samples.rollout)
  return dataclasses.replace(samples, rollout=rollout, exact=samples.exact[:count],
                             rows=samples.rows[:count], completions=samples.completions[:count])


def _memory_row(memory: ResponseMemory, position: int, env_mask: bool) -> dict:
  """The stored row of pool `position` as Rollout fields (env_mask when the batch has one)."""
  row = dict(tokens=memory.tokens, prompt_mask=memory.prompt_mask,
             completion_mask=memory.completion_mask, behavior_logp=memory.behavior_logp,
             version=memory.version, reward=memory.reward)
  if env_mask:
    row["env_mask"] = memory.env_mask
  return {name: np.asarray(value)[position] for name, value in row.items()}


def _reuse_responses(rollout: Rollout, group: np.ndarray, unsolved: np.ndarray,
                     positions: np.ndarray,
                     memory: ResponseMemory) -> tuple[Rollout, np.ndarray]:
  """The rollout with each unsolved group's last row replaced by its prompt's stored exact
  response (where one is stored), and which rows were replaced."""
  fields = {name: np.array(value) for name, value in jax.device_get(dict(
      tokens=rollout.tokens, prompt_mask=rollout.prompt_mask,
      completion_mask=rollout.completion_mask, behavior_logp=rollout.behavior_logp,
      version=rollout.version, reward=rollout.reward,
      **({} if rollout.env_mask is None else dict(env_mask=rollout.env_mask)))).items()}
  reused = np.zeros(len(group), bool)
  stored = np.asarray(memory.stored)
  for i in np.flatnonzero(unsolved):
    if stored[positions[i]]:
      row = np.flatnonzero(group == i)[-1]
      for name, value in _memory_row(memory, positions[i], "env_mask" in fields).items():
        fields[name][row] = value
      reused[row] = True
  if not reused.any():
    return rollout, reused
  return rollout.replace(**{name: jnp.asarray(v) for name, v in fields.items()}), reused


def _store_responses(memory: ResponseMemory, rollout: Rollout, group: np.ndarray,
                     exact: np.ndarray, positions: np.ndarray) -> ResponseMemory:
  """The memory with each prompt's last freshly sampled exact row of `rollout` stored."""
  if not exact.any():
    return memory
  new = {f.name: np.array(jax.device_get(getattr(memory, f.name)))
         for f in dataclasses.fields(memory)}
  batch = jax.device_get(dict(tokens=rollout.tokens, prompt_mask=rollout.prompt_mask,
                              completion_mask=rollout.completion_mask,
                              behavior_logp=rollout.behavior_logp, version=rollout.version,
                              reward=rollout.reward))
  if rollout.env_mask is not None:
    batch["env_mask"] = jax.device_get(rollout.env_mask)
  for row in np.flatnonzero(exact):  # in batch order: a prompt's last exact row wins
    position = positions[group[row]]
    for name, value in batch.items():
      new[name][position] = value[row]
    new["stored"][position] = True
  return ResponseMemory(**new)


def _pad_rows(rollout: Rollout, count: int, first_group: int) -> Rollout:
  """`rollout` with `count` padding rows appended: copies of its first row with no
  completion tokens, reward 0, each its own group (first_group, first_group + 1, ...)."""
  if not count:
    return rollout
  def pad(name, x):
    x = np.asarray(x)
    if name == "group":
      extra = np.arange(first_group, first_group + count, dtype=x.dtype)
    elif name in ("completion_mask", "reward", "behavior_logp"):
      extra = np.zeros((count, *x.shape[1:]), x.dtype)
    elif name == "version":
      extra = np.full((count, *x.shape[1:]), -1, x.dtype)
    else:
      extra = np.repeat(x[:1], count, axis=0)
    return jnp.asarray(np.concatenate([x, extra]))
  return rollout.replace(**{f.name: pad(f.name, getattr(rollout, f.name))
                            for f in dataclasses.fields(rollout)
                            if getattr(rollout, f.name) is not None and f.name != "tree"})


def _check_ar3po(settings: SelectionSettings, prompts_per_step: int, group_size: int) -> None:
  stages = settings.ar3po.stages
  if group_size % stages:
    raise ValueError(f"config.selection.ar3po.stages = {stages} must divide "
                     f"config.rollout.group_size = {group_size} (each stage samples "
                     "group_size / stages completions of every unsolved prompt).")


def pods_rollouts(settings: SelectionSettings, group_size: int) -> int:
  """PODS's n: config.selection.pods.rollouts, or 2 * group_size when it is 0."""
  return settings.pods.rollouts or 2 * group_size


def _check_pods(settings: SelectionSettings, prompts_per_step: int, group_size: int) -> None:
  n = pods_rollouts(settings, group_size)
  if n <= group_size:
    raise ValueError(f"config.selection.pods.rollouts = {settings.pods.rollouts}: PODS rolls "
                     f"out n completions per prompt and keeps config.rollout.group_size = "
                     f"{group_size} of them, so n must exceed it (0 = 2 * group_size).")


SELECTION_RULES: Registry[SelectionRule] = Registry("selection kind", "config.selection.kind")
def _reads_rewards(settings: SelectionSettings) -> stages.Declaration:
  """A rule that chooses prompts or rows by the task's rewards reads them while the batch is
  made."""
  del settings
  return stages.Declaration(reads_inside=frozenset({"reward"}))


def _ar3po_declares(settings: SelectionSettings) -> stages.Declaration:
  """AR3PO reads rewards while it stages its rollouts; its reused responses (ar3po.reuse)
  were sampled by earlier parameters, scored at an earlier step, and keep no routing
  record."""
  reused = (frozenset({stages.SAMPLED_BY_PRODUCING_PARAMS, stages.SCORED_THIS_STEP,
                       stages.ROUTING_RECORDED}) if settings.ar3po.reuse else frozenset())
  return stages.Declaration(reads_inside=frozenset({"reward"}), breaks=reused)


SELECTION_RULES.register("uniform", SelectionRule(_collect_rounds, keeps_history=False,
                                                  chooses=False))
SELECTION_RULES.register("dynamic", SelectionRule(_collect_rounds,
                                                  refills=lambda settings: True,
                                                  declares=_reads_rewards))
SELECTION_RULES.register("greso", SelectionRule(
    _collect_rounds, skips_prompts=True, needs_pool=True,
    refills=lambda settings: settings.greso.refill, declares=_reads_rewards))
SELECTION_RULES.register("adaptive", SelectionRule(_collect_adaptive, check=_check_adaptive,
                                                   equal_groups=False,
                                                   declares=_reads_rewards))
SELECTION_RULES.register("pods", SelectionRule(_collect_pods, keeps_history=False,
                                               check=_check_pods, declares=_reads_rewards))
SELECTION_RULES.register("ar3po", SelectionRule(
    _collect_ar3po, keeps_history=False, needs_pool=True, check=_check_ar3po,
    equal_groups=False, stores_responses=lambda settings: settings.ar3po.reuse,
    declares=_ar3po_declares))


def rule_of(settings: SelectionSettings) -> SelectionRule:
  """The registered rule config.selection.kind names."""
  return SELECTION_RULES.get(settings.kind)
