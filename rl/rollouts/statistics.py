"""What a producer reports about the batch it made: one typed record, built in one place.

Every producer (rl/rollouts/producers.py, partial.py) describes its batch with `batch_stats`,
from the rows it scored and the rows it hands to the trainer; its own counts (selection
rounds, tree leaves, a partial pool's ledger, ...) ride along as `counters`. The loop adds
the phase times (`rl.loop.produce_timed`) and logs `BatchStats.metrics()`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class BatchStats:
  """Statistics of one produced batch.

  reward_mean, exact_match: over every row the producer scored for the batch (all rounds
    of a selection rule, rejected groups included; a tree's leaves).
  informative_groups: share of the scored groups whose rewards are not all equal.
  completion_len: mean completion length of the scored rows (a tree leaf: its whole
    root-to-leaf path).
  decoded_tokens: completion tokens the sampler decoded for the batch (a tree decodes a
    shared prefix once; a partial pool's are the batch's rows).
  completion_length_counts: histogram of the trained rows' completion lengths (counts[n] =
    rows with n tokens).
  reward_timeouts, reward_errors: scored rows whose scorer timed out or failed (reward 0).
  counters: the producer's own counts, logged as they are (decode_steps, rollout_rounds,
    leaves, generated_tokens, groups_started, ...).
  rows: the trained batch's rows as their scorer saw them (`rl.samples.ScoredRow`, None
    for a row nothing scored), in batch order: what training samples show; not a metric.
  """
  reward_mean: float
  exact_match: float
  informative_groups: float
  completion_len: float
  decoded_tokens: float
  completion_length_counts: np.ndarray
  reward_timeouts: int
  reward_errors: int
  counters: dict = dataclasses.field(default_factory=dict)
  rows: tuple = ()

  @property
  def sampled_tokens(self) -> int:
    """Tokens generated for this batch: a partial pool's decoded this step
    (`generated_tokens`), else `decoded_tokens`."""
    return int(self.counters.get("generated_tokens", self.decoded_tokens))

  def with_counters(self, **counters) -> "BatchStats":
    """These statistics with `counters` added to (or replacing) the batch's counters."""
    return dataclasses.replace(self, counters={**self.counters, **counters})

  def metrics(self) -> dict:
    """The record as the loop logs it (the counters alongside the fixed fields)."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
              if f.name not in ("counters", "rows")}
    return dict(fields, **self.counters)


def informative(group_rewards: np.ndarray) -> np.ndarray:
  """[groups] bool: groups [groups, G] whose rewards are not all equal (exactly: an
  all-equal group has zero advantage however its mean rounds)."""
  group_rewards = np.asarray(group_rewards)
  return group_rewards.max(axis=1) != group_rewards.min(axis=1)


def batch_stats(group_rewards: Sequence[np.ndarray], exact: np.ndarray,
                scored_lengths: np.ndarray, trained_lengths: np.ndarray, *,
                decoded_tokens: float, scored: Sequence, rows: Sequence = (),
                **counters) -> BatchStats:
  """The BatchStats of a batch.

  group_rewards: each scored group's rewards, in row order (groups may differ in size);
  exact [rows]: exact-match flags of the scored rows; scored_lengths [rows] and
  trained_lengths [trained rows]: completion lengths; decoded_tokens: tokens decoded for
  the batch; scored: the scoring results the rows came from (each with `reward_timeouts`
  and `reward_errors`); rows: the trained rows' `ScoredRow`s, in batch order; counters:
  the producer's own counts.
  """
  rewards = np.concatenate([np.asarray(r).reshape(-1) for r in group_rewards])
  return BatchStats(
      reward_mean=float(rewards.mean()), exact_match=float(np.asarray(exact).mean()),
      informative_groups=float(np.mean([np.ptp(np.asarray(r)) > 0 if np.size(r) else False
                                        for r in group_rewards])),
      completion_len=float(np.asarray(scored_lengths).mean()),
      decoded_tokens=float(decoded_tokens),
      completion_length_counts=np.bincount(np.asarray(trained_lengths, np.int64)),
      reward_timeouts=sum(s.reward_timeouts for s in scored),
      reward_errors=sum(s.reward_errors for s in scored), counters=counters, rows=tuple(rows))


def tool_counters(scored: Sequence) -> dict:
  """Rollouts with turns' counters over the scoring results `scored` (their `tools`, a
  `sampling.sampler.ToolRows`; {} without an environment): tool_calls_per_rollout (answered
  calls), env_tokens_per_rollout, tool_failed_rollouts (rows whose environment step failed:
  reward 0), tool_steps, tool_errors, tool_timeouts, tool_observations_cut and time_env_s
  (wall time in environment steps)."""
  stats = [s.tools for s in scored if getattr(s, "tools", None) is not None]
  if not stats:
    return {}
  rows = sum(np.size(s.calls) for s in stats)
  total = lambda name: sum(float(np.sum(getattr(s, name))) for s in stats)
  return dict(tool_calls_per_rollout=total("calls") / max(rows, 1),
              env_tokens_per_rollout=total("env_mask") / max(rows, 1),
              tool_failed_rollouts=int(total("failed")), tool_steps=int(total("steps")),
              tool_errors=int(total("errors")), tool_timeouts=int(total("timeouts")),
              tool_observations_cut=int(total("cut")), time_env_s=total("env_time_s"))


def draft_counters(scored: Sequence) -> dict:
  """Speculative decoding's counters over the scoring results `scored` (their
  `draft_stats`; {} when none decoded speculatively): spec_drafted / spec_accepted draft
  tokens, spec_acceptance (accepted / drafted), spec_forwards_per_token (target forwards
  per generated token: 1 for plain decoding) and, per draft source, spec_drafted_<source>,
  spec_accepted_<source> and spec_acceptance_<source> (0 in a step where the source
  drafted nothing: average the counts, not this ratio, over steps)."""
  stats = [s.draft_stats for s in scored if getattr(s, "draft_stats", None) is not None]
  if not stats:
    return {}
  sources = stats[0].sources
  drafted = np.sum([np.asarray(s.drafted) for s in stats], axis=0)
  accepted = np.sum([np.asarray(s.accepted) for s in stats], axis=0)
  forwards = sum(int(s.forwards) for s in stats)
  emitted = sum(int(s.emitted) for s in stats)
  counters = dict(spec_drafted=int(drafted.sum()), spec_accepted=int(accepted.sum()),
                  spec_acceptance=float(accepted.sum() / max(drafted.sum(), 1)),
                  spec_forwards_per_token=forwards / max(emitted, 1))
  for name, d, a in zip(sources, drafted, accepted):
    counters[f"spec_drafted_{name}"] = int(d)
    counters[f"spec_accepted_{name}"] = int(a)
    counters[f"spec_acceptance_{name}"] = float(a / max(d, 1))
  return counters
