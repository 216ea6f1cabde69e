"""rl.registry.Registry, the one registry style, and a new rollout kind added as one
registered RolloutKind and reached through the launcher."""

import dataclasses
import json

import pytest

from experiments import train
from rl import composition
from rl import wiring
from rl.objectives import advantages
from rl.objectives import corrections
from rl.objectives import losses
from rl.registry import Registry
from rl.rollouts import kinds
from rl.rollouts import producers
from rl.rollouts import selection
from rl.tasks import TASKS
from tests.launcher_config import tiny_run_config


def test_register_get_and_refusals():
  things = Registry("thing", "config.thing.name", "docs/things.md adds one")
  assert things.register("b", 2) == 2

  @things.register("a")
  def a():
    return 1

  assert things.get("a") is a and things.get("b") == 2
  assert things.names() == ("a", "b") and list(things) == ["a", "b"] and len(things) == 2
  assert "a" in things and "c" not in things
  with pytest.raises(ValueError, match=r"Unknown thing 'c' \(config.thing.name\); known: a, "
                                       r"b \(docs/things.md adds one\)\."):
    things.get("c")
  with pytest.raises(ValueError, match=r"Thing 'a' is already registered \(config.thing.name\)"):
    things.register("a", 3)
  assert things.get("a") is a  # the refused entry did not replace it
  with pytest.raises(ValueError, match="non-empty string name"):
    things.register("", 1)
  things.unregister("a")
  things.unregister("a")  # absent: nothing to do
  assert things.names() == ("b",)


@pytest.mark.parametrize("registry, field", [
    (losses.LOSSES, "config.loss.name"), (corrections.CORRECTIONS, "config.loss.corrections"),
    (advantages.ADVANTAGES, "config.advantage.name"),
    (advantages.TREE_ADVANTAGES, "config.rollout.tree.advantage"),
    (TASKS, "config.task.name"), (kinds.ROLLOUT_KINDS, "config.rollout.kind"),
    (kinds.FORK_POLICIES, "config.rollout.tree.policy"),
    (selection.SELECTION_RULES, "config.selection.kind")])
def test_every_pluggable_piece_is_a_registry_naming_its_field(registry, field):
  assert isinstance(registry, Registry) and registry.field == field and len(registry) >= 2
  with pytest.raises(ValueError, match=f"Unknown .*'no_such_name' \\({field}\\); known: "
                                       f"{registry.names()[0]}"):
    registry.get("no_such_name")


def _tagged_producer(rollout, ctx, selection, max_staleness):
  """A toy rollout kind: plain independent samples whose batches carry a marker counter."""
  del rollout, selection, max_staleness
  inner = producers.independent(ctx)

  def produce(*args):
    rollout, stats, state = inner.produce(*args)
    tagged = dataclasses.replace(stats, counters=dict(stats.counters, toy_batches=1.0))
    return rollout, tagged, state
  return inner._replace(produce=produce)


@pytest.fixture
def toy_kind():
  kinds.ROLLOUT_KINDS.register("toy", kinds.RolloutKind(
      make_producer=_tagged_producer, rows_per_prompt=lambda rollout: rollout.group_size))
  yield "toy"
  kinds.ROLLOUT_KINDS.unregister("toy")


def test_a_registered_rollout_kind_runs_through_the_launcher(tmp_path, toy_kind):
  config = tiny_run_config(tmp_path, {"rollout.kind": toy_kind, "warm_start.steps": 2})
  summary = train.run(config)
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rl_steps = [r for r in records if r["phase"] == "rl" and "loss" in r]
  assert len(rl_steps) == 2 and all(r["toy_batches"] == 1.0 for r in rl_steps)
  assert summary["steps"] == 4


def test_a_rollout_kinds_declarations_decide_what_it_composes_with(tmp_path, toy_kind):
  """The toy kind declares the defaults: no selection rule but uniform, one device."""
  config = tiny_run_config(tmp_path, {"rollout.kind": toy_kind, "selection.kind": "dynamic"})
  with pytest.raises(ValueError, match="config.selection.kind = 'dynamic'"):
    wiring.validate(config)
  config = tiny_run_config(tmp_path, {"rollout.kind": toy_kind, "mesh.data": 2})
  with pytest.raises(ValueError, match="config.rollout.kind = 'toy' decodes on one device"):
    composition.check_switches(wiring.settings(config))
  config = tiny_run_config(tmp_path, {"rollout.kind": toy_kind, "rollout.group_size": 1})
  with pytest.raises(ValueError, match="config.rollout.group_size = 1"):
    wiring.validate(config)
  config = tiny_run_config(tmp_path, {"rollout.kind": "forest"})
  with pytest.raises(ValueError, match=r"Unknown rollout kind 'forest' \(config.rollout.kind\); "
                                       "known: independent, partial, pruned, toy, tree"):
    wiring.validate(config)
