"""Online difficulty filtering as a batch stage: a group whose rewards are all equal teaches
GRPO nothing (its advantages are 0), so it is replaced by an informative group kept from an
earlier batch (config.stages.difficulty_filter).

DAPO's dynamic sampling (config.selection.kind='dynamic') gets the same kind of batch by
sampling more rounds until enough groups are informative, which costs rollouts. This stage
spends no rollout: it keeps a replay of the most recent informative groups (`capacity`
groups, each used at most `max_uses` times) and swaps one in for each all-equal group of a
new batch, before the advantages are computed. A replayed group keeps its behaviour
log-probs and versions, so it is stale data: the objective's ratio against the sampler's
log-probs and the staleness metric see it as such.

Choices made here: groups are a batch's rows sharing a group id; only groups of exactly
group_size rows are replaced or kept (adaptive allocation's other sizes pass through);
a batch's own informative groups join the replay after its all-equal ones are replaced, so
a batch never trains the same group twice; the newest unused entries are replayed first.
What it declares: it rewrites rows (tokens, masks, log-probs, versions, rewards), so it
refuses a piece that read rewards while making the batch (a choosing selection rule, a
pruning head), and pieces that need every row sampled by the batch's own parameters and
scored for this batch (score centering's record, process rewards, routing replay).
Policies with an environment or a mixture of experts are refused (their rows carry
records this replay does not keep).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rl import stages
from rl.settings import Settings, setting, used_when

NAME = "difficulty_filter"
FIELDS = ("tokens", "prompt_mask", "completion_mask", "behavior_logp", "version")


@dataclasses.dataclass(frozen=True)
class DifficultyFilterSettings(Settings):
  """config.stages.difficulty_filter (module docstring)."""
  SECTION = f"stages.{NAME}"
  enabled: bool = setting(False, "replace each group whose rewards are all equal by an "
                          "informative group replayed from earlier batches")
  capacity: int = setting(16, "informative groups kept for replay", low=1,
                          used_when=used_when("enabled"))
  max_uses: int = setting(1, "times one kept group may be replayed", low=1,
                          used_when=used_when("enabled"))


def declares(settings: DifficultyFilterSettings) -> stages.Declaration:
  """What the stage does to a batch when enabled (module docstring)."""
  if not settings.enabled:
    return stages.Declaration()
  return stages.Declaration(
      needs=frozenset({stages.INDEPENDENT_ROWS}),
      breaks=frozenset({stages.SAMPLED_BY_PRODUCING_PARAMS, stages.SCORED_THIS_STEP,
                        stages.ROUTING_RECORDED}),
      writes=frozenset({*FIELDS, "reward"}))


def empty_replay(capacity: int, group_size: int, slots: int) -> dict:
  """The replay (the stage's state): `capacity` groups of `group_size` rows of `slots`
  slots, none filled."""
  rows = (capacity, group_size, slots)
  return dict(tokens=np.zeros(rows, np.int32), prompt_mask=np.zeros(rows, bool),
              completion_mask=np.zeros(rows, bool), behavior_logp=np.zeros(rows, np.float32),
              version=np.zeros(rows, np.int32), reward=np.zeros(rows[:2], np.float32),
              uses=np.zeros(capacity, np.int32), filled=np.zeros(capacity, bool),
              stamp=np.zeros(capacity, np.int64), clock=np.zeros((), np.int64))


def filter_groups(batch: dict, replay: dict, group_size: int, max_uses: int
                  ) -> tuple[dict, dict, dict, np.ndarray]:
  """(batch with its all-equal groups replaced, the replay after this batch, counters, the
  replaced rows [B] bool) for a batch given as host arrays (`FIELDS`, "reward", "group")."""
  batch = {k: np.array(v) for k, v in batch.items()}
  replay = {k: np.array(v) for k, v in replay.items()}
  groups = [np.flatnonzero(batch["group"] == g) for g in dict.fromkeys(batch["group"].tolist())]
  whole = [rows for rows in groups if len(rows) == group_size]
  flat = [rows for rows in whole if np.all(batch["reward"][rows] == batch["reward"][rows[0]])]
  informative = [rows for rows in whole if not any(rows is f for f in flat)]
  replaced = []
  for rows in flat:
    usable = np.flatnonzero(replay["filled"] & (replay["uses"] < max_uses))
    if not usable.size:
      break
    entry = usable[np.argmax(replay["stamp"][usable])]  # the newest
    for field in (*FIELDS, "reward"):
      batch[field][rows] = replay[field][entry]
    replay["uses"][entry] += 1
    replaced.append(rows)
  for rows in informative:
    free = np.flatnonzero(~replay["filled"] | (replay["uses"] >= max_uses))
    entry = free[0] if free.size else int(np.argmin(replay["stamp"]))  # else the oldest
    for field in (*FIELDS, "reward"):
      replay[field][entry] = batch[field][rows]
    replay["uses"][entry], replay["filled"][entry] = 0, True
    replay["clock"] = replay["clock"] + 1
    replay["stamp"][entry] = replay["clock"]
  counters = dict(filter_flat_groups=float(len(flat)), filter_replaced_groups=float(len(replaced)),
                  filter_replay_groups=float((replay["filled"]
                                              & (replay["uses"] < max_uses)).sum()))
  replaced_rows = np.zeros(len(batch["group"]), bool)
  for rows in replaced:
    replaced_rows[rows] = True
  return batch, replay, counters, replaced_rows


def build(settings: DifficultyFilterSettings, context) -> stages.Stage | None:
  """The stage for the RL phase's `context` (an `rl.rollouts.producers.BatchContext`), or
  None when disabled."""
  if not settings.enabled:
    return None
  if context.turns is not None or context.model_config.is_moe:
    raise ValueError("config.stages.difficulty_filter replays rows without their environment "
                     "answers and routing records; turn it off with config.tools.name or a "
                     "mixture-of-experts policy.")
  group_size = context.group_size
  slots = context.prompt_len + context.sampling_config.max_new_tokens

  def apply(rollout, stats, replay, **extras):
    del extras
    host = {field: np.asarray(getattr(rollout, field)) for field in (*FIELDS, "reward", "group")}
    if host["tokens"].shape[1] != slots:
      raise ValueError(f"config.stages.difficulty_filter expects batches of {slots} slots, got "
                       f"{host['tokens'].shape[1]}.")
    batch, replay, counters, replaced = filter_groups(host, replay, group_size,
                                                      settings.max_uses)
    # A replayed row was scored at an earlier step: no scored row here (training samples
    # skip it).
    rows = tuple(None if replaced[i] else row for i, row in enumerate(stats.rows))
    rollout = rollout.replace(**{field: batch[field] for field in (*FIELDS, "reward")})
    return rollout, dataclasses.replace(stats.with_counters(**counters), rows=rows), replay

  return stages.Stage(init=lambda: empty_replay(settings.capacity, group_size, slots),
                      apply=apply, declares=declares(settings), name="difficulty filter")


stages.register_stage(NAME, stages.StageSpec(settings=DifficultyFilterSettings, build=build,
                                             declares=declares, before_advantages=True))
