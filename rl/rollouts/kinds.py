"""Rollout kinds (config.rollout.kind): how the RL phase makes its batches, each one entry of
`ROLLOUT_KINDS` that builds its producer and declares what it composes with.

  independent  group_size independent samples of each prompt the selection rule picks
               (uniform selection: plain GRPO); decodes on one device or a mesh.
  tree         one tree per prompt (TreeRL / TreePO / LATR fork policies, `FORK_POLICIES`),
               its leaves scored and tree advantages computed; one device.
  partial      resumable partial rollouts (APRIL / CoPRIS): a pool of group slots decoded in
               rounds, unfinished rows carried to the next step; one device.
  pruned       arrol's online pruning: more rollouts than group_size start, a quality head
               learned online keeps group_size of them after a prefix (rl/rollouts/pruning.py);
               one device.

config.rollout is `RolloutSettings` (rl/settings/rollout.py, with the tree's and
speculative decoding's settings nested). `rl.wiring.validate` refuses a combination a kind's
declarations exclude (a tree with dynamic sampling, a partial pool on a mesh or with tools
and kept KV, ...) naming the field, and `rl.wiring` builds the producer of config.rollout.kind here. A new kind is one
registered `RolloutKind`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rl import stages
from rl.objectives import advantages
from rl.registry import Registry
from rl.rollouts import partial as partial_rollout
from rl.rollouts import producers
from rl.rollouts import pruning
from rl.settings.rollout import RolloutSettings, TreeSettings
from sampling import partial as partial_lib
from sampling import tree as tree_lib


# builder(TreeSettings) -> sampling.tree.ForkPolicy, by config.rollout.tree.policy.
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


@dataclasses.dataclass(frozen=True)
class RolloutKind:
  """One way of making RL batches (config.rollout.kind), registered in `ROLLOUT_KINDS`;
  the run's config check reads its declarations to refuse what it does not compose with.

  Attributes:
    make_producer: `(rollout, ctx, selection=, max_staleness=) -> Producer`: the
      `rl.rollouts.producers.Producer` of the RL phase, from the run's `RolloutSettings`,
      its `BatchContext`, its `SelectionSettings` and its staleness bound (its state,
      whatever the kind keeps between batches, lives in the LoopState and is checkpointed
      with it).
    rows_per_prompt: `(rollout) -> int`: sequences per prompt in a batch.
    batch_advantages: `(rollout, estimator) -> BatchAdvantages`: the loop's advantage stage
      for these batches, given config.advantage.name's estimator (default: group-relative
      over each prompt's rows).
    own_advantages: `batch_advantages` ignores the estimator (a tree's advantages come from
      config.rollout.tree.advantage), so config.advantage.name is not read.
    bounds_staleness: the producer itself discards rows older than config.rl.max_staleness
      (a partial pool), so that bound is read without config.rl.async_.
    declares: what its batches are and what it reads while making them
      (`rl.stages.Declaration`: a partial pool's rows were sampled across parameter
      versions; a tree's rows share prefixes; a pruning head reads rewards), checked
      against the batch stages' and the train step's needs.
    check: `(rollout, tools) -> None`: raises ValueError for a bad setting of the kind's own
      fields (`tools`: whether an environment answers tool calls).
    any_selection: composes with every config.selection.kind (else only 'uniform': the kind
      cannot skip or re-weight the prompts it rolls out).
    mesh: decodes on a device mesh (else one device).
    identical_prompt_groups: each prompt's rows are group_size samples of the same prompt,
      so the train step may share the prompt's forward (config.rl.prefix_shared_forward).
    group_relative: rows of a prompt form one group for group-relative advantages, so
      config.rollout.group_size must be >= 2.
    tools: can pause rows at an environment's calls (config.tools.name).
    speculative: can decode with drafts (config.rollout.speculative.tokens).

  >>> tree = ROLLOUT_KINDS.get("tree")
  >>> tree.rows_per_prompt(RolloutSettings(kind="tree")), tree.tools, tree.any_selection
  (8, False, False)
  >>> ROLLOUT_KINDS.get("independent").rows_per_prompt(RolloutSettings(group_size=4))
  4
  """
  make_producer: Callable[..., producers.Producer]
  rows_per_prompt: Callable[[RolloutSettings], int]
  batch_advantages: Callable[[RolloutSettings, Callable], advantages.BatchAdvantages] = (
      lambda rollout, estimator: advantages.group_relative(estimator))
  check: Callable[[RolloutSettings, bool], None] = lambda rollout, tools: None
  own_advantages: bool = False
  bounds_staleness: bool = False
  declares: stages.Declaration = stages.Declaration()
  any_selection: bool = False
  mesh: bool = False
  identical_prompt_groups: bool = False
  group_relative: bool = True
  tools: bool = False
  speculative: bool = False


ROLLOUT_KINDS: Registry[RolloutKind] = Registry("rollout kind", "config.rollout.kind")


def kind_of(rollout: RolloutSettings) -> RolloutKind:
  """The registered rollout kind config.rollout.kind names."""
  return ROLLOUT_KINDS.get(rollout.kind)


def rows_per_prompt(rollout: RolloutSettings) -> int:
  """Sequences per prompt in an RL batch: group_size, or the tree's leaf budget.

  >>> rows_per_prompt(RolloutSettings(kind="tree"))  # 4 chains + 1 round x 2 forks x 2 branches
  8
  """
  return kind_of(rollout).rows_per_prompt(rollout)


def fork_policy(tree: TreeSettings) -> tree_lib.ForkPolicy:
  """The fork policy config.rollout.tree.policy names (a sampling.tree.ForkPolicy), built
  from config.rollout.tree."""
  return FORK_POLICIES.get(tree.policy)(tree)


def _group_size(rollout: RolloutSettings) -> int:
  return rollout.group_size


ROLLOUT_KINDS.register("independent", RolloutKind(
    make_producer=lambda rollout, ctx, selection, max_staleness: producers.independent(
        ctx, selection),
    rows_per_prompt=_group_size, any_selection=True, mesh=True,
    identical_prompt_groups=True, tools=True, speculative=True))


ROLLOUT_KINDS.register("tree", RolloutKind(
    make_producer=lambda rollout, ctx, selection, max_staleness: producers.tree(
        ctx, fork_policy(rollout.tree)),
    rows_per_prompt=lambda rollout: fork_policy(rollout.tree).leaves,
    batch_advantages=lambda rollout, estimator: advantages.per_tree(
        advantages.get_tree_advantage_fn(rollout.tree.advantage), rollout.prompt_len),
    check=lambda rollout, tools: _check_tree(rollout.tree), own_advantages=True,
    group_relative=False,
    declares=stages.Declaration(breaks=frozenset({stages.INDEPENDENT_ROWS}))))


def _check_tree(tree: TreeSettings) -> None:
  """Refuses a tree advantage estimator or fork policy no registry knows, or a fork policy
  its settings cannot build."""
  advantages.get_tree_advantage_fn(tree.advantage)
  fork_policy(tree)


def _check_partial(rollout: RolloutSettings, tools: bool) -> None:
  if tools and rollout.resume != "reprefill":
    raise ValueError(f"config.tools.name with config.rollout.resume = {rollout.resume!r}: a "
                     "row the environment answered must re-encode its prefix, which 'kept_kv' "
                     "does not; set config.rollout.resume='reprefill'.")


def _partial_producer(rollout: RolloutSettings, ctx, selection, max_staleness):
  del selection  # a pool reads prompts in data order (uniform; any_selection is False)
  slots = rollout.num_slots or 2 * rollout.prompts_per_step * rollout.group_size
  rollouts = partial_rollout.for_task(
      ctx, partial_lib.PartialConfig(num_slots=slots, group_size=rollout.group_size,
                                     resume=rollout.resume, decode_window=rollout.decode_window),
      max_staleness=max_staleness)
  return partial_rollout.producer(ctx, rollouts)


ROLLOUT_KINDS.register("partial", RolloutKind(
    make_producer=_partial_producer, rows_per_prompt=_group_size, check=_check_partial,
    bounds_staleness=True, tools=True,
    declares=stages.Declaration(breaks=frozenset({stages.SAMPLED_BY_PRODUCING_PARAMS}))))


ROLLOUT_KINDS.register("pruned", RolloutKind(
    make_producer=lambda rollout, ctx, selection, max_staleness: pruning.producer(
        ctx, rollout.pruning.resolved(rollout.group_size, rollout.max_new_tokens)),
    rows_per_prompt=_group_size,
    check=lambda rollout, tools: pruning.check(rollout.pruning, rollout.group_size,
                                               rollout.max_new_tokens),
    identical_prompt_groups=True,
    # Its head learns from the task's rewards of the rows it kept, chosen by predicted
    # success (not independent samples).
    declares=stages.Declaration(reads_inside=frozenset({"reward"}),
                                breaks=frozenset({stages.INDEPENDENT_ROWS}))))
