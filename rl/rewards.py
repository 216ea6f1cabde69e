"""The reward stage: what the trainer is rewarded with, when it is not the task's exact score.

A producer's batch arrives scored by the task (`Rollout.reward`, and each row's verdict in
`BatchStats.rows`). The reward stage, the first of the batch stages (`reward_stage`,
rl/stages.py), gives it the stage's rewards instead (config.reward, config.advantage):

* **A noisy verifier** (`inject_noise`): a share `false_negative` of the correct
  completions fail (reward 0) and a share `false_positive` of the wrong ones pass
  (reward 1). One uniform draw per row, from a hash of (seed, prompt, completion): the
  same completion of the same prompt always gets the same verdict, as from a deterministic
  rule verifier whose errors are about the text, not luck.
* **A second opinion** (TinyV, arXiv 2505.14625; `second_opinion`): every completion the
  verifier failed goes to the task's second scorer (`Task.second_opinion(completion,
  example) -> bool`: running_sum's exact check, gsm_symbolic's math-verify extraction), run
  in rl.scoring's worker under its time limit; a pass there scores 1. Its calls, passes,
  time and timeouts are counted.
* **Label-free majority vote** (TTRL, arXiv 2504.16084; `vote`): a row is rewarded 1 when
  the answer its verdict read is the most common answer of its group; no label is read.
  How often the vote agrees with the truth is logged, and, through a memory of each
  prompt's last majority (`VoteMemory`, checkpointed with the producer's state), how often
  a revisited prompt's majority flips between right and wrong.
* **Process rewards** (PURE, arXiv 2504.15275; `step_rewards`): the task's per-step rewards
  (`Task.step_rewards(completion, example) -> [(character offset past the step, reward)]`)
  placed on each step's last token as `Rollout.step_rewards`, for a process advantage
  estimator (rl.objectives.advantages.PROCESS_ADVANTAGES).

The stage runs after the producer, so a selection rule or learned pruning inside it would
see the task's true rewards: the run's check refuses those with an active reward stage
(`declaration`). The
task's own reward still decides `reward_mean` and `exact_match` (the truth the run is
measured by); `trained_reward_mean` is what the trainer saw.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import time
from typing import Any, Optional, Sequence

import flax.struct
import jax.numpy as jnp
import numpy as np

from rl import scoring
from rl import timing
from rl import verdicts
from rl import stages
from rl.rollouts.statistics import BatchStats
from rl.settings.reward import RewardSettings
from rl.tasks import math_answer
from rl.types import Rollout, StepRewards

VOTE_MEMORY_SLOTS = 1 << 16  # prompts remembered by the vote's flip counter (direct-mapped)
VOTING = (verdicts.CORRECT, verdicts.WRONG_VALUE)  # categories whose answer was read as a value
_UNSEEN, _WRONG, _RIGHT = 0, 1, 2


def _digest(*parts: object) -> int:
  """A 64-bit hash of `parts` (stable across processes, unlike Python's hash)."""
  text = "\x1f".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
  return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def noise_draw(seed: int, prompt: str, completion: str) -> float:
  """A uniform draw in [0, 1) that is a function of (seed, prompt, completion)."""
  return _digest("noise", seed, prompt, completion) / 2.0 ** 64


def is_correct(row) -> bool:
  """Whether a row's scorer judged it correct (its exact match); False for an unscored row."""
  return row is not None and row.verdict.category == verdicts.CORRECT


def inject_noise(rewards: np.ndarray, rows: Sequence, *, false_negative: float,
                 false_positive: float, seed: int) -> tuple[np.ndarray, dict]:
  """A noisy verifier's rewards: a correct row whose draw (`noise_draw`) is below
  `false_negative` gets 0, a wrong scored row whose draw is below `false_positive` gets 1;
  the rest keep their reward. Returns (rewards [B] float32, counters: verifier_false_negatives,
  verifier_false_positives, verifier_correct_rows, verifier_wrong_rows)."""
  noisy = np.array(rewards, np.float32)
  counts = dict(verifier_false_negatives=0, verifier_false_positives=0,
                verifier_correct_rows=0, verifier_wrong_rows=0)
  for i, row in enumerate(rows):
    if row is None:
      continue
    draw = noise_draw(seed, row.prompt, row.completion)
    if is_correct(row):
      counts["verifier_correct_rows"] += 1
      if draw < false_negative:
        noisy[i] = 0.0
        counts["verifier_false_negatives"] += 1
    else:
      counts["verifier_wrong_rows"] += 1
      if draw < false_positive:
        noisy[i] = 1.0
        counts["verifier_false_positives"] += 1
  return noisy, counts


class SecondOpinion:
  """The task's second scorer as a task rl.scoring runs: reward 1.0 when
  `task.second_opinion(completion, example)` passes the completion, else 0.0."""

  def __init__(self, task):
    self.task = task
    self.name = f"{task.name}:second_opinion"
    self.reward_timeout_s = getattr(task, "reward_timeout_s", scoring.DEFAULT_TIMEOUT_S)
    self.reward_limits = getattr(task, "reward_limits", scoring.DEFAULT_LIMITS)

  def reward(self, completion: str, example) -> float:
    """1.0 when the second scorer passes the completion. There is no `exact_match`: the
    scoring worker then takes a reward of 1 as the exact match, so each completion costs
    one call."""
    return 1.0 if self.task.second_opinion(completion, example) else 0.0


def second_opinion(judge: SecondOpinion, rewards: np.ndarray, rows: Sequence) -> tuple[np.ndarray, dict]:
  """Re-checks every scored row the verifier failed (reward < 1) with `judge`; a pass
  scores 1. Returns (rewards, counters: second_opinion_calls, second_opinion_passes,
  second_opinion_timeouts, second_opinion_errors, second_opinion_s)."""
  failed = [i for i, row in enumerate(rows) if row is not None and rewards[i] < 1.0]
  started = time.perf_counter()
  checked = np.array(rewards, np.float32)
  scores = None
  if failed:
    with timing.phase("score"):
      scores = scoring.score(judge, [rows[i].completion for i in failed],
                             [rows[i].example for i in failed])
    checked[failed] = np.where(scores.exact, 1.0, checked[failed])
  return checked, dict(
      second_opinion_calls=len(failed),
      second_opinion_passes=int(scores.exact.sum()) if scores else 0,
      second_opinion_timeouts=scores.timeouts if scores else 0,
      second_opinion_errors=scores.errors if scores else 0,
      second_opinion_s=time.perf_counter() - started)


def normalised_answer(answer: str) -> str:
  """An answer as votes compare it: a numeral's exact value ('1,234', '1234.0' and
  '\\frac{2468}{2}' are one answer; `math_answer.parse_number`), else its text stripped."""
  number = math_answer.parse_number(math_answer.clean(answer))
  return str(number) if number is not None else answer.strip()


def ballot(row) -> Optional[str]:
  """A row's vote: its normalised answer when its verdict read a value (correct or
  wrong_value); None (it abstains) for no answer, a malformed or truncated one, a failed
  scorer or tool, an unscored row."""
  if row is None or row.verdict.category not in VOTING or row.verdict.answer is None:
    return None
  return normalised_answer(row.verdict.answer)


def majority(ballots: Sequence[Optional[str]]) -> Optional[str]:
  """The most common of the non-None ballots; a tie goes to the answer cast first (row
  order: deterministic); None when every row abstains."""
  counts = collections.Counter(b for b in ballots if b is not None)
  if not counts:
    return None
  best = max(counts.values())
  return next(b for b in ballots if b is not None and counts[b] == best)


@dataclasses.dataclass(frozen=True)
class Vote:
  """One batch's majority vote: rewards [B] (1.0 for a row voting with its group's
  majority); per group (in group-id order) its prompt, its majority answer and whether
  that answer is right (some row with it was judged correct)."""
  rewards: np.ndarray
  prompts: tuple
  answers: tuple
  right: np.ndarray


def vote(rows: Sequence, group: np.ndarray) -> Vote:
  """TTRL's label-free reward over each group of `rows` (group ids `group` [B])."""
  ballots = [ballot(row) for row in rows]
  rewards = np.zeros(len(rows), np.float32)
  prompts, answers, right = [], [], []
  for g in np.unique(group):
    members = np.flatnonzero(group == g)
    winner = majority([ballots[i] for i in members])
    for i in members:
      rewards[i] = 1.0 if winner is not None and ballots[i] == winner else 0.0
    scored = [rows[i] for i in members if rows[i] is not None]
    prompts.append(scored[0].prompt if scored else "")
    answers.append(winner)
    right.append(winner is not None and any(ballots[i] == winner and is_correct(rows[i])
                                            for i in members))
  return Vote(rewards, tuple(prompts), tuple(answers), np.asarray(right, bool))


@flax.struct.dataclass
class VoteMemory:
  """Each prompt's last majority verdict (`_RIGHT`, `_WRONG`; `_UNSEEN`), in a direct-mapped
  table of VOTE_MEMORY_SLOTS slots indexed by a hash of the prompt, whose `tag` (another 32
  bits of the hash) tells a prompt from another that maps to its slot (then the slot is
  overwritten and counted as a first visit: with 256 prompts about one collision in 500
  pairs)."""
  tag: np.ndarray
  state: np.ndarray

  @classmethod
  def empty(cls, slots: int = VOTE_MEMORY_SLOTS) -> "VoteMemory":
    return cls(tag=np.zeros(slots, np.uint32), state=np.zeros(slots, np.int8))


def remember(memory: VoteMemory, prompts: Sequence[str], right: np.ndarray
             ) -> tuple[VoteMemory, dict]:
  """Stores each prompt's majority verdict; counts the prompts seen before (vote_revisited)
  and those whose majority went from right to wrong or from wrong to right since their
  last visit (vote_flips_right_to_wrong, vote_flips_wrong_to_right)."""
  tag, state = np.array(memory.tag), np.array(memory.state)
  counts = dict(vote_revisited=0, vote_flips_right_to_wrong=0, vote_flips_wrong_to_right=0)
  for prompt, ok in zip(prompts, right):
    digest = _digest("vote", prompt)
    slot, key = digest % len(tag), np.uint32(digest >> 32)
    now = _RIGHT if ok else _WRONG
    if state[slot] != _UNSEEN and tag[slot] == key:
      counts["vote_revisited"] += 1
      if state[slot] == _RIGHT and now == _WRONG:
        counts["vote_flips_right_to_wrong"] += 1
      elif state[slot] == _WRONG and now == _RIGHT:
        counts["vote_flips_wrong_to_right"] += 1
    tag[slot], state[slot] = key, now
  return VoteMemory(tag=tag, state=state), counts


def vote_counters(result: Vote, rows: Sequence, flips: dict) -> dict:
  """What a vote logs: vote_accuracy (share of groups whose majority answer is right),
  vote_label_agreement (share of scored rows whose vote reward equals their true exact
  match), vote_abstained_groups (groups where no row gave a value), the flip counts and
  vote_flip_rate (flips per revisited prompt)."""
  scored = [i for i, row in enumerate(rows) if row is not None]
  agree = [float(result.rewards[i] == float(is_correct(rows[i]))) for i in scored]
  flipped = flips["vote_flips_right_to_wrong"] + flips["vote_flips_wrong_to_right"]
  return dict(vote_accuracy=float(np.mean(result.right)) if len(result.right) else 0.0,
              vote_label_agreement=float(np.mean(agree)) if agree else 0.0,
              vote_abstained_groups=sum(a is None for a in result.answers),
              vote_flip_rate=flipped / max(flips["vote_revisited"], 1), **flips)


def token_of_offset(tokenizer, ids: Sequence[int], offset: int) -> int:
  """The index of the token of `ids` whose decoded text reaches character `offset` (the
  first k with len(decode(ids[:k + 1])) >= offset): exact for any tokenizer whose prefix
  decodes grow monotonically (the character tokenizer, byte-level BPE away from a
  multi-byte character split across tokens). Binary search: O(log n) decodes."""
  lengths = _PrefixLengths(tokenizer, ids)
  return min(bisect.bisect_left(lengths, offset), len(ids) - 1)


class _PrefixLengths(Sequence):
  def __init__(self, tokenizer, ids):
    self.tokenizer, self.ids = tokenizer, list(ids)

  def __len__(self):
    return len(self.ids)

  def __getitem__(self, k):
    return len(self.tokenizer.decode(self.ids[:k + 1]))


def step_rewards(task, rows: Sequence, tokenizer, tokens: np.ndarray,
                 completion_mask: np.ndarray) -> StepRewards:
  """The batch's process rewards: each row's `task.step_rewards` placed on the completion
  token where its step ends (`token_of_offset`); two steps ending in one token add up."""
  value = np.zeros(tokens.shape, np.float32)
  mask = np.zeros(tokens.shape, bool)
  for i, row in enumerate(rows):
    positions = np.flatnonzero(completion_mask[i])
    if row is None or not len(positions):
      continue
    ids = tokens[i, positions]
    for offset, reward in task.step_rewards(row.completion, row.example):
      at = positions[token_of_offset(tokenizer, ids, offset)]
      value[i, at] += reward
      mask[i, at] = True
  return StepRewards(value=jnp.asarray(value), mask=jnp.asarray(mask))


@dataclasses.dataclass(frozen=True)
class RewardStage:
  """The stage a run's config.reward and config.advantage ask for (`make_stage`).

  settings: config.reward. task: the run's task (its step rewards). tokenizer: decodes
  step offsets to tokens. seed: the verifier noise's seed (the run's). process: whether to
  add the task's step rewards (a process advantage estimator). judge: the task's second
  scorer (`SecondOpinion`; one object, which rl.scoring pickles once), with
  settings.second_opinion.
  """
  settings: RewardSettings
  task: Any
  tokenizer: Any
  seed: int
  process: bool = False
  judge: Optional[SecondOpinion] = None

  def init_memory(self) -> Optional[VoteMemory]:
    return VoteMemory.empty() if self.settings.kind == "majority_vote" else None

  def apply(self, rollout: Rollout, stats: BatchStats, memory: Optional[VoteMemory]
            ) -> tuple[Rollout, BatchStats, Optional[VoteMemory]]:
    """The batch with the stage's rewards (and step rewards), its stats with the stage's
    counters, and the vote memory after it."""
    rows = stats.rows
    rewards = np.asarray(rollout.reward, np.float32)
    counters = {}
    if self.settings.kind == "majority_vote":
      result = vote(rows, np.asarray(rollout.group))
      memory, flips = remember(memory, result.prompts, result.right)
      rewards = result.rewards
      counters.update(vote_counters(result, rows, flips))
    else:
      if self.settings.noisy:
        rewards, noise = inject_noise(rewards, rows, false_negative=self.settings.false_negative,
                                      false_positive=self.settings.false_positive, seed=self.seed)
        counters.update(noise)
      if self.settings.second_opinion:
        rewards, checked = second_opinion(self.judge, rewards, rows)
        counters.update(checked)
    scored = [i for i, row in enumerate(rows) if row is not None]
    counters["trained_reward_mean"] = float(np.mean(rewards[scored])) if scored else 0.0
    rollout = rollout.replace(reward=jnp.asarray(rewards))
    if self.process:
      steps = step_rewards(self.task, rows, self.tokenizer, np.asarray(rollout.tokens),
                           np.asarray(rollout.completion_mask))
      rollout = rollout.replace(step_rewards=steps)
      counted = np.asarray(steps.mask)
      counters.update(process_steps=float(counted.sum()) / max(len(scored), 1),
                      process_reward_mean=float(np.asarray(steps.value)[counted].mean())
                      if counted.any() else 0.0)
    return rollout, dataclasses.replace(stats, counters={**stats.counters, **counters}), memory


def make_stage(settings: RewardSettings, task, tokenizer, seed: int, process: bool
               ) -> Optional[RewardStage]:
  """The stage config.reward and a process estimator ask for, or None when the trainer
  is to see the task's rewards as they are. Raises ValueError for a task that lacks what
  the stage needs (a second scorer, step rewards)."""
  if not (settings.active or process):
    return None
  for needed, method, setting_name in ((settings.second_opinion, "second_opinion",
                                        "config.reward.second_opinion"),
                                       (process, "step_rewards", "config.advantage.name")):
    if needed and not callable(getattr(task, method, None)):
      raise ValueError(f"{setting_name}: task {task.name!r} has no {method}(completion, "
                       f"example) (running_sum has both; gsm_symbolic a second opinion); "
                       "turn it off or use a task that has it.")
  return RewardStage(settings, task, tokenizer, seed, process,
                     SecondOpinion(task) if settings.second_opinion else None)


def declaration(settings: RewardSettings, process: bool) -> stages.Declaration:
  """What the reward stage does to a batch: it rewrites the rewards (an active
  config.reward), so a piece that read them while making the batch (a selection rule, a
  pruning head) would have read another value; and with a process estimator it places the
  task's step rewards, which needs rows scored for this batch, independent samples of their
  prompt, and completions that are the policy's text alone."""
  writes = ({"reward"} if settings.active else set()) | ({"step_rewards"} if process else set())
  needs = ({stages.SCORED_THIS_STEP, stages.INDEPENDENT_ROWS, stages.POLICY_TEXT_ONLY}
           if process else set())
  return stages.Declaration(needs=frozenset(needs), writes=frozenset(writes))


def reward_stage(stage: RewardStage) -> stages.Stage:
  """`stage` as a batch stage (`rl.stages`; its state: the vote memory, None unless
  majority_vote)."""
  def apply(rollout, stats, memory, **extras):
    del extras
    return stage.apply(rollout, stats, memory)

  return stages.Stage(init=stage.init_memory, apply=apply, name="the reward stage",
                      declares=declaration(stage.settings, stage.process))
