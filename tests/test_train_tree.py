"""`experiments.train` with config.rollout.kind='tree' runs end to end (tiny shapes)."""

from __future__ import annotations

import pytest

from experiments import train
from rl import wiring
from rl.rollouts import kinds
from rl.settings import rollout as rollout_settings
from sampling import tree
from tests.launcher_config import rl_steps, tiny_run_config


def _config(workdir, **tree_fields):
  c = tiny_run_config(workdir, {"warm_start.steps": 2, "rollout.kind": "tree"})
  c.rollout.tree.update(init_chains=2, fork_points=1, branches=2, rounds=1, **tree_fields)
  return c


@pytest.mark.slow
def test_tree_run_end_to_end(tmp_path):
  summary = train.run(_config(tmp_path))
  assert summary["steps"] == 4 and summary["nonfinite_updates"] == 0
  rl = rl_steps(tmp_path)
  assert len(rl) == 2
  for r in rl:
    assert r["leaves"] == 2 * 4
    assert 0 < r["decoded_tokens"] <= r["leaves"] * r["completion_len"]


def test_fork_policy_from_config(tmp_path):
  c = _config(tmp_path, policy="segments", segment_len=2, max_depth=2)
  tree_settings = lambda: rollout_settings.TreeSettings.from_config(c.rollout.tree)
  assert kinds.fork_policy(tree_settings()) == tree.FixedSegments(2, 2, 2, 2)
  c.rollout.tree.policy = "lookahead"
  assert isinstance(kinds.fork_policy(tree_settings()), tree.Lookahead)
  c.rollout.tree.policy = "beam"
  with pytest.raises(ValueError, match="config.rollout.tree.policy"):
    wiring.validate(c)
  c.rollout.tree.policy = "entropy"
  c.rollout.kind = "forest"
  with pytest.raises(ValueError, match="config.rollout.kind"):
    wiring.validate(c)
