"""Batch stages: what happens to a produced batch before the train step, one extension point.

A producer (rl/rollouts/producers.py) makes a scored batch. Between it and the train step
the batch passes through stages: the reward stage (a noisy verifier, a second opinion,
TTRL's majority vote, PURE's step rewards; rl/rewards.py), the sampler's top-K record that
score centering reads (rl/rollouts/sampler_topk.py), the advantages
(rl/objectives/advantages.py), the training samples the launcher logs (rl/samples.py) and
NAT's token subsample (rl/objectives/token_subsample.py). Each is a `Stage`, with the shape
optax gives a gradient transformation:

    stage = Stage(init, apply)
    state = stage.init()                                   # a pytree, checkpointed
    rollout, stats, state = stage.apply(rollout, stats, state, params=..., rng=...,
                                        iteration=...)

`rollout` is the batch (`rl.types.Rollout`), `stats` its `BatchStats` (a stage adds its
counters there, which the loop logs with the batch's metrics), and `state` the stage's own
(TTRL's vote memory; None for a stage that keeps none). The keyword-only extras are what
some stages need and others ignore: `params`, the parameters that sampled the batch;
`rng`, a key of the iteration's own (each stage folds in a stream of its own); `iteration`,
the phase's 1-based iteration. `chain(*stages)` applies stages in order, its state the
tuple of theirs, as `optax.chain` composes transformations. The loop keeps the chain's
state in `LoopState.stages`, beside the producer's, so a checkpoint stays one pytree and a
killed run resumes exactly.

A stage also says what it does to the batch (`Stage.declares`, a `Declaration`): which
batch fields it needs, which it writes, and which properties of the batch it needs from
the pieces upstream (e.g. "the batch was sampled by the parameters that produce it"). The
run's config check reads these against the rollout kind's and the selection rule's
declarations.

>>> import jax.numpy as jnp
>>> from rl.rollouts.statistics import BatchStats
>>> def double_rewards():
...   def apply(rollout, stats, state, **extras):
...     return rollout.replace(reward=2 * rollout.reward), stats, None
...   return Stage(init=lambda: None, apply=apply)
>>> def count_batches():
...   def apply(rollout, stats, count, **extras):
...     return rollout, stats.with_counters(batches=count + 1), count + 1
...   return Stage(init=lambda: 0, apply=apply)
>>> both = chain(double_rewards(), count_batches())
>>> state = both.init()
>>> state
(None, 0)
>>> from rl.types import Rollout
>>> ones = jnp.ones((2, 3))
>>> batch = Rollout(tokens=ones, prompt_mask=ones > 0, completion_mask=ones > 0,
...                 behavior_logp=ones, version=ones, group=jnp.zeros(2), reward=jnp.ones(2))
>>> stats = BatchStats(1.0, 1.0, 0.0, 3.0, 6.0, jnp.zeros(4), 0, 0)
>>> batch, stats, state = both.apply(batch, stats, state, params=None, rng=None, iteration=1)
>>> batch.reward.tolist(), stats.counters, state
([2.0, 2.0], {'batches': 1}, (None, 1))
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol

from rl.registry import Registry
from rl.settings import stages as stage_settings

if TYPE_CHECKING:  # this module loads no JAX: the default config imports the extensions
  import jax

  from rl.rollouts.statistics import BatchStats
  from rl.types import Rollout


class ApplyFn(Protocol):
  """A stage's `apply`: the batch, its statistics and the stage's state in, all three out;
  what only some stages need comes as keyword-only extras."""

  def __call__(self, rollout: Rollout, stats: BatchStats, state: Any, *, params: Any,
               rng: Optional[jax.Array], iteration: int
               ) -> tuple[Rollout, BatchStats, Any]:
    ...


@dataclasses.dataclass(frozen=True)
class Declaration:
  """What a stage, a rollout kind or a selection rule says of what it does to a batch, so
  that combinations are checked from these rather than from names.

  needs: batch properties it relies on, from the pieces upstream of it.
  breaks: batch properties it does not preserve (a piece upstream of a stage that needs
    one of them refuses it).
  writes: batch fields it changes (`Rollout` field names).
  reads_inside: batch fields it reads while the batch is being made (a selection rule
    choosing prompts by reward, a learned pruning head); a stage after it that writes one
    of them would leave it having read another value.
  """
  needs: frozenset = frozenset()
  breaks: frozenset = frozenset()
  writes: frozenset = frozenset()
  reads_inside: frozenset = frozenset()


# Batch properties a piece may need or break (`Declaration.needs` / `breaks`).
SAMPLED_BY_PRODUCING_PARAMS = "every row was sampled by the parameters that produced the batch"
SCORED_THIS_STEP = "every row was scored for this batch"
INDEPENDENT_ROWS = "rows are independent samples of their prompt"
POLICY_TEXT_ONLY = "completion tokens are the policy's alone (no environment text between them)"
EVERY_COMPLETION_TOKEN = "every sampled completion token is trained"
ROUTING_RECORDED = "every row carries the sampler's routing record (an MoE policy's experts)"
CONTEXT_IS_THE_PROMPT = "a row's context before its completion is its prompt alone"


class Stage(NamedTuple):
  """A batch stage (module docstring).

  init: () -> the stage's state (a pytree; None when it keeps none).
  apply: `ApplyFn`.
  declares: what it needs and does (`Declaration`).
  name: what messages call it.
  """
  init: Callable[[], Any]
  apply: ApplyFn
  declares: Declaration = Declaration()
  name: str = "stage"


def chain(*stages: Stage) -> Stage:
  """The stages applied in order; its state is the tuple of their states.

  Args:
    *stages: the stages, first applied first.

  Returns:
    One `Stage` whose declarations are the union of theirs.
  """
  def init():
    return tuple(stage.init() for stage in stages)

  def apply(rollout, stats, state, **extras):
    new_state = []
    for stage, one in zip(stages, state):
      rollout, stats, one = stage.apply(rollout, stats, one, **extras)
      new_state.append(one)
    return rollout, stats, tuple(new_state)

  declares = Declaration(
      needs=frozenset().union(*(s.declares.needs for s in stages)),
      breaks=frozenset().union(*(s.declares.breaks for s in stages)),
      writes=frozenset().union(*(s.declares.writes for s in stages)),
      reads_inside=frozenset().union(*(s.declares.reads_inside for s in stages)))
  return Stage(init, apply, declares, " -> ".join(s.name for s in stages) or "no stage")


# --- Batch stages a module adds --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """A batch stage a module registers (`register_stage`).

  settings: its settings class (an `rl.settings.Settings` with SECTION "stages.<name>"),
    read from config.stages.<name>.
  build: `(settings, context) -> Stage | None`: the stage for the run (None: off at these
    settings); `context` is the RL phase's `rl.rollouts.producers.BatchContext`.
  declares: `(settings) -> Declaration`: what the stage does to the batch at these
    settings, for the run's check (before anything is built).
  before_advantages: whether it runs before the advantage stage (a stage that changes
    rewards or rows) or after the built-in stages (one that reads advantages).
  """
  settings: type
  build: Callable[[Any, Any], Optional[Stage]]
  declares: Callable[[Any], Declaration] = lambda settings: Declaration()
  before_advantages: bool = True


STAGES: Registry[StageSpec] = Registry(
    "batch stage", "config.stages", "rl.stages.register_stage adds one: docs/concepts.md")


def register_stage(name: str, spec: StageSpec) -> StageSpec:
  """Adds a batch stage: its settings become config.stages.<name> (the default config holds
  them, the launcher checks them and its declarations), and the wiring builds it into
  every RL run's chain. The module that calls this goes in rl/extensions/, whose modules
  are all imported by the launcher and the default config.

  Args:
    name: the stage's name (its config section, config.stages.<name>).
    spec: its `StageSpec`.

  Returns:
    `spec`.
  """
  if spec.settings.SECTION != f"stages.{name}":
    raise ValueError(f"Batch stage {name!r}: its settings' SECTION must be 'stages.{name}', "
                     f"not {spec.settings.SECTION!r}.")
  stage_settings.STAGE_SETTINGS.register(name, spec.settings)
  return STAGES.register(name, spec)
