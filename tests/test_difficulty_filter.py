"""The online difficulty filter (rl/extensions/difficulty_filter.py), a batch stage added as
one module: its replay, exactly, on hand-made batches; its switch through the launcher; and
what the run's check refuses from its declarations."""

import json

import numpy as np
import pytest

from experiments import train as launcher
from rl.extensions import difficulty_filter as dfilter
from tests.launcher_config import tiny_run_config

G, SLOTS = 2, 3


def _batch(rewards, first_token):
  """Groups of G rows, row r's tokens all `first_token + r`, behaviour log-probs -r."""
  rows = len(rewards)
  tokens = (first_token + np.arange(rows))[:, None] * np.ones((1, SLOTS), np.int32)
  return dict(tokens=tokens.astype(np.int32), prompt_mask=np.ones((rows, SLOTS), bool),
              completion_mask=np.zeros((rows, SLOTS), bool) | (np.arange(SLOTS) > 0),
              behavior_logp=-np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, SLOTS)),
              version=np.full((rows, SLOTS), first_token, np.int32),
              reward=np.asarray(rewards, np.float32), group=np.arange(rows) // G)


def test_flat_groups_are_replaced_by_the_newest_unused_informative_groups():
  replay = dfilter.empty_replay(capacity=3, group_size=G, slots=SLOTS)
  # Groups 0 and 2 informative, 1 and 3 flat; nothing to replay yet.
  first = _batch([1, 0, 0, 0, 0.5, 1, 1, 1], first_token=10)
  out, replay, counters, replaced = dfilter.filter_groups(first, replay, G, max_uses=1)
  assert counters == dict(filter_flat_groups=2.0, filter_replaced_groups=0.0,
                          filter_replay_groups=2.0)
  assert not replaced.any() and np.array_equal(out["tokens"], first["tokens"])
  # All four groups flat: groups 0 and 1 get the kept groups, newest (batch 1's group 2)
  # first; each is used once, so groups 2 and 3 stay.
  second = _batch([0, 0, 1, 1, 0, 0, 1, 1], first_token=50)
  out, replay, counters, replaced = dfilter.filter_groups(second, replay, G, max_uses=1)
  assert counters == dict(filter_flat_groups=4.0, filter_replaced_groups=2.0,
                          filter_replay_groups=0.0)  # both used up
  assert replaced.tolist() == [True] * 4 + [False] * 4
  for field in (*dfilter.FIELDS, "reward"):
    np.testing.assert_array_equal(out[field][0:2], first[field][4:6])  # batch 1's group 2
    np.testing.assert_array_equal(out[field][2:4], first[field][0:2])  # batch 1's group 0
    np.testing.assert_array_equal(out[field][4:], second[field][4:])
  assert out["group"].tolist() == second["group"].tolist()  # slots keep their group ids
  assert replay["uses"].tolist() == [1, 1, 0]
  # A third batch with one informative group: it takes a used slot (a used-up entry is free).
  third = _batch([0, 1], first_token=90)
  _, replay, counters, _ = dfilter.filter_groups(third, replay, G, max_uses=1)
  assert counters["filter_replay_groups"] == 1.0 and replay["uses"].tolist() == [0, 1, 0]


@pytest.mark.parametrize("overrides,message", [
    ({"stages.difficulty_filter.enabled": True, "selection.kind": "dynamic"},
     r"the batch stage config.stages.difficulty_filter changes the batch's reward after it "
     r"is made, and config.selection.kind = 'dynamic' reads the reward while making it"),
    ({"stages.difficulty_filter.enabled": True, "loss.corrections": ("score_centering",)},
     r"needs that every row was sampled by the parameters that produced the batch, and the "
     r"batch stage config.stages.difficulty_filter does not keep that"),
    ({"stages.difficulty_filter.capacity": 4},
     r"config.stages.difficulty_filter.capacity = 4 has no effect with "
     r"config.stages.difficulty_filter.enabled = False"),
    ({"stages.difficulty_filter.enabled": True, "rollout.kind": "tree"},
     r"needs that rows are independent samples of their prompt, and config.rollout.kind = "
     r"'tree' does not keep that"),
])
def test_the_launcher_refuses_what_it_does_not_compose_with(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    launcher.run(tiny_run_config(tmp_path / "run", overrides))
  assert not (tmp_path / "run").exists()


def test_the_switch_reaches_the_batch_through_the_launcher(tmp_path):
  """--config.stages.difficulty_filter.enabled=True: every RL step logs the stage's counts,
  and the groups it replaced are at most those that were flat, with a replay no larger than
  its capacity."""
  launcher.run(tiny_run_config(tmp_path, {"stages.difficulty_filter.enabled": True,
                                          "stages.difficulty_filter.capacity": 2,
                                          "rl.steps": 3}))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert len(steps) == 3
  for r in steps:
    assert 0 <= r["filter_replaced_groups"] <= r["filter_flat_groups"] <= 2
    assert r["filter_replay_groups"] <= 2
  resolved = json.loads((tmp_path / "config.json").read_text())
  assert resolved["stages"]["difficulty_filter"]["enabled"] is True
