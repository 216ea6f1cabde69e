"""experiments/golden.py: the record/compare tool for changes that must keep outputs bit for bit."""

import json

import pytest

from experiments import golden
from experiments import grid  # pylint: disable=unused-import  (one process: no flag clash)
from experiments.configs import default
from rl import wiring


def test_clock_free_drops_every_wall_clock_field_and_keeps_the_rest():
  record = {"step": 3, "loss": 0.5, "time_step_s": 1.0, "sampled_tokens_per_s": 9.0,
            "time_s": {"train": 1.0}, "rollout_time_s": {}, "wall_time_s": 2.0,
            "warm_start_from": "/a", "accuracy_curve": [{"step": 1, "accuracy": 0.5}],
            "means": [{"second_opinion_s": 1.2, "time_step_s": 0.1, "reward_mean": 0.5}]}
  assert golden.clock_free(record) == {"step": 3, "loss": 0.5,
                                       "accuracy_curve": [{"step": 1, "accuracy": 0.5}],
                                       "means": [{"reward_mean": 0.5}]}


def test_first_difference_names_the_path_and_both_values():
  a = {"records": [{"loss": 0.25, "step": 1}], "summary": {"final_accuracy": 0.5}}
  assert golden.first_difference(a, json.loads(json.dumps(a))) is None
  b = {"records": [{"loss": 0.25000001, "step": 1}], "summary": {"final_accuracy": 0.5}}
  assert golden.first_difference(a, b) == ".records[0].loss: 0.25 vs 0.25000001"
  c = {"records": [], "summary": {"final_accuracy": 0.5}}
  assert golden.first_difference(a, c) == ".records: 1 vs 0 items"
  d = {"records": [{"loss": 0.25, "step": 1, "extra": 1}], "summary": {"final_accuracy": 0.5}}
  assert golden.first_difference(a, d) == ".records[0].extra: present in only one"


def test_compare_reports_each_cell_that_differs_or_is_missing(tmp_path):
  before, after = tmp_path / "before", tmp_path / "after"
  before.mkdir()
  after.mkdir()
  for name, loss in (("uniform", 0.5), ("lora", 0.7), ("tree_entropy", 0.1)):
    (before / f"{name}.json").write_text(json.dumps({"records": [{"loss": loss}]}))
  (after / "uniform.json").write_text(json.dumps({"records": [{"loss": 0.5}]}))
  (after / "lora.json").write_text(json.dumps({"records": [{"loss": 0.75}]}))
  assert golden.compare(str(before), str(after)) == [
      "lora: .records[0].loss: 0.7 vs 0.75", f"tree_entropy: no golden in {after}"]


@pytest.mark.parametrize("name", sorted(golden.CELLS))
def test_every_golden_cell_is_a_valid_launcher_config(name):
  config = default.get_config()
  for path, value in {**golden.BASE, **golden.CELLS[name]}.items():
    *parents, leaf = path.removeprefix("config.").split(".")
    node = config
    for part in parents:
      node = node[part]
    assert leaf in node, path
    node[leaf] = value
  wiring.validate(config)
