"""Rollout kinds (config.rollout.kind): how the RL phase makes its batches, each one entry of
`ROLLOUT_KINDS` that builds its producer and declares what it composes with.

  independent  group_size independent samples of each prompt the selection rule picks
               (uniform selection: plain GRPO); decodes on one device or a mesh.
  tree         one tree per prompt (TreeRL / TreePO / LATR fork policies, `FORK_POLICIES`),
               its leaves scored and tree advantages computed; one device.
  partial      resumable partial rollouts (APRIL / CoPRIS): a pool of group slots decoded in
               rounds, unfinished rows carried to the next step; one device.

`rl.wiring.validate` refuses a combination a kind's declarations exclude (a tree with
dynamic sampling, a partial pool on a mesh, ...) naming the field, and `rl.wiring` builds
the producer of config.rollout.kind here. A new kind is one registered `RolloutKind`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import ml_collections

from rl.objectives import advantages
from rl.registry import Registry
from rl.rollouts import partial as partial_rollout
from rl.rollouts import producers
from sampling import partial as partial_lib
from sampling import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class RolloutKind:
  """One way of making RL batches.

  make_producer(config, ctx) -> the `rl.rollouts.producers.Producer` of the RL phase,
    built from the run's config and `BatchContext` (its state, whatever the kind keeps
    between batches, lives in the LoopState and is checkpointed with it).
  rows_per_prompt(config): sequences per prompt in a batch.
  batch_advantages(config): the loop's advantage stage for these batches (default:
    group-relative, config.advantage.name's estimator over each prompt's rows).
  check(config): raises ValueError for a bad setting of the kind's own fields.
  any_selection: composes with every config.selection.kind (else only 'uniform': the kind
    cannot skip or re-weight the prompts it rolls out).
  mesh: decodes on a device mesh (else one device).
  identical_prompt_groups: each prompt's rows are group_size samples of the same prompt,
    so the train step may share the prompt's forward (config.rl.prefix_shared_forward).
  group_relative: rows of a prompt form one group for group-relative advantages, so
    config.rollout.group_size must be >= 2.
  """
  make_producer: Callable[[Any, producers.BatchContext], producers.Producer]
  rows_per_prompt: Callable[[Any], int]
  batch_advantages: Callable[[Any], advantages.BatchAdvantages] = (
      lambda config: advantages.group_relative(
          advantages.get_advantage_fn(config.advantage.name)))
  check: Callable[[Any], None] = lambda config: None
  any_selection: bool = False
  mesh: bool = False
  identical_prompt_groups: bool = False
  group_relative: bool = True


ROLLOUT_KINDS: Registry[RolloutKind] = Registry("rollout kind", "config.rollout.kind")

# builder(config.rollout.tree) -> sampling.tree.ForkPolicy, by config.rollout.tree.policy.
FORK_POLICIES: Registry[Callable[[Any], tree_lib.ForkPolicy]] = Registry(
    "tree policy", "config.rollout.tree.policy")
FORK_POLICIES.register("entropy", lambda t: tree_lib.EntropyFork(
    init_chains=t.init_chains, fork_points=t.fork_points, branches=t.branches,
    rounds=t.rounds))
FORK_POLICIES.register("segments", lambda t: tree_lib.FixedSegments(
    init_chains=t.init_chains, segment_len=t.segment_len, branches=t.branches,
    max_depth=t.max_depth))
FORK_POLICIES.register("lookahead", lambda t: tree_lib.Lookahead(
    init_chains=t.init_chains, leaves=t.leaves, top_k=t.top_k, min_entropy=t.min_entropy,
    lookahead_steps=t.lookahead_steps, prune_similarity=t.prune_similarity))


def fork_policy(tree_config) -> tree_lib.ForkPolicy:
  """The fork policy config.rollout.tree.policy names, built from config.rollout.tree."""
  return FORK_POLICIES.get(tree_config.policy)(tree_config)


def _group_size(config) -> int:
  return config.rollout.group_size


ROLLOUT_KINDS.register("independent", RolloutKind(
    make_producer=lambda config, ctx: producers.independent(
        ctx, ml_collections.FrozenConfigDict(config.selection)),
    rows_per_prompt=_group_size, any_selection=True, mesh=True,
    identical_prompt_groups=True))


def _check_tree(config) -> None:
  advantages.get_tree_advantage_fn(config.rollout.tree.advantage)
  fork_policy(config.rollout.tree)


def _tree_advantages(config) -> advantages.BatchAdvantages:
  return advantages.per_tree(advantages.get_tree_advantage_fn(config.rollout.tree.advantage),
                             config.rollout.prompt_len)


ROLLOUT_KINDS.register("tree", RolloutKind(
    make_producer=lambda config, ctx: producers.tree(ctx, fork_policy(config.rollout.tree)),
    rows_per_prompt=lambda config: fork_policy(config.rollout.tree).leaves,
    batch_advantages=_tree_advantages, check=_check_tree, group_relative=False))


def _check_partial(config) -> None:
  if config.rollout.resume not in partial_lib.RESUME_MODES:
    raise ValueError(f"config.rollout.resume = {config.rollout.resume!r}; use one of "
                     f"{', '.join(repr(m) for m in partial_lib.RESUME_MODES)}.")


def _partial_producer(config, ctx):
  r = config.rollout
  slots = r.num_slots or 2 * r.prompts_per_step * r.group_size
  rollouts = partial_rollout.for_task(
      ctx, partial_lib.PartialConfig(num_slots=slots, group_size=r.group_size,
                                     resume=r.resume, decode_window=r.decode_window),
      max_staleness=config.rl.max_staleness)
  return partial_rollout.producer(ctx, rollouts)


ROLLOUT_KINDS.register("partial", RolloutKind(
    make_producer=_partial_producer, rows_per_prompt=_group_size, check=_check_partial))
