"""MetricsLog: one write reaches the JSONL and every writer (TensorBoard, W&B); a resume
purges TensorBoard too; held-out accuracy is one tag across phases.

Event files are read back with tests/metrics_fixtures.py's small independent TFRecord reader,
not with the writer's own code. The W&B writer runs against a fake `wandb` module put in
sys.modules.
"""

import json
import sys

import pytest
from tensorboardX.proto import event_pb2

from experiments import metrics
from tests.metrics_fixtures import FakeWandb, read_events, scalars, texts


def test_one_write_goes_to_jsonl_and_tensorboard(tmp_path):
  log = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"))
  log.truncate_after(-1)
  records = [{"step": 1, "phase": "warm_start", "loss": 2.5, "nll": 2.5},
             {"step": 2, "phase": "rl", "loss": -0.125, "reward_mean": 0.75, "event": "eval",
              "skipped": True},
             {"step": 3, "eval_accuracy": 0.5}]
  for record in records:
    log.write(record)
  log.close()
  assert log.read() == records
  assert scalars(read_events(tmp_path)) == [
      (1, "warm_start/loss", 2.5), (1, "warm_start/nll", 2.5),
      (2, "rl/loss", -0.125), (2, "rl/reward_mean", 0.75), (3, "eval/accuracy", 0.5)]


def test_held_out_accuracy_is_one_series_across_phases(tmp_path):
  log = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"))
  log.truncate_after(-1)
  log.write({"step": 3, "phase": "warm_start", "event": "warm_start_end", "eval_accuracy": 0.25,
             "eval_accuracy_stderr": 0.0625, "eval_accuracy_by_size": {"2": 0.5},
             "time_eval_s": 1.5})
  log.write({"step": 5, "phase": "rl", "event": "eval", "eval_accuracy": 0.75,
             "eval_accuracy_stderr": 0.03125, "time_eval_s": 1.25})
  log.close()
  assert scalars(read_events(tmp_path)) == [
      (3, "eval/accuracy", 0.25), (3, "eval/accuracy_stderr", 0.0625),
      (3, "warm_start/time_eval_s", 1.5),
      (5, "eval/accuracy", 0.75), (5, "eval/accuracy_stderr", 0.03125),
      (5, "rl/time_eval_s", 1.25)]


def test_scalar_tags_keep_real_numbers_only():
  record = {"step": 7, "phase": "rl", "loss": 1, "skipped": True, "event": "eval",
            "eval_reward": 0.5, "eval_accuracy_by_size": {"3": 1.0}, "learning_rate": 1e-4}
  assert metrics.scalar_tags(record) == {"rl/loss": 1.0, "eval/reward": 0.5,
                                         "rl/learning_rate": 1e-4}
  assert metrics.scalar_tags({"step": 1, "loss": 2.0}) == {"loss": 2.0}


def test_text_goes_to_tensorboard_at_its_step(tmp_path):
  log = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"))
  config_json = json.dumps({"rl": {"steps": 5}}, indent=2)
  log.write_text(4, "config", metrics.config_markdown(config_json))
  log.close()
  ((step, tag, text),) = texts(read_events(tmp_path))
  assert (step, tag) == (4, "config/text_summary")
  assert text.splitlines() == ["    " + line for line in config_json.splitlines()]
  assert not log.read()  # texts are not metric records


def test_wandb_writer_gets_the_tensorboard_tags(tmp_path, monkeypatch):
  fake = FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  writers = metrics.make_writers(str(tmp_path), tensorboard=False, wandb_project="arbor",
                                 config={"seed": 3})
  log = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"), writers=writers)
  log.truncate_after(-1)
  log.write_text(0, "config", "    {}")
  log.write({"step": 1, "phase": "warm_start", "loss": 2.5, "learning_rate": 0.001})
  log.write({"step": 1, "phase": "warm_start", "event": "warm_start_end", "eval_accuracy": 0.5})
  log.flush()
  (run,) = fake.runs
  assert not run.finished
  log.close()
  assert run.init == {"project": "arbor", "name": tmp_path.name, "config": {"seed": 3},
                      "dir": str(tmp_path)}
  assert run.logged == [(1, {"warm_start/loss": 2.5, "warm_start/learning_rate": 0.001}),
                        (1, {"eval/accuracy": 0.5})]
  assert run.summary == {"config": "    {}"} and run.finished
  assert not list(tmp_path.glob("events.out.tfevents.*"))
  assert len(log.read()) == 2


def test_wandb_without_the_package_says_how_to_install_it(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
  with pytest.raises(ImportError, match="pip install wandb"):
    metrics.make_writers(str(tmp_path), wandb_project="arbor")
  assert metrics.make_writers(str(tmp_path), tensorboard=False) == []


def test_resume_truncates_jsonl_and_purges_tensorboard_from_the_next_step(tmp_path):
  log = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"))
  log.truncate_after(-1)
  for step in range(1, 5):
    log.write({"step": step, "phase": "rl", "loss": float(step)})
  log.close()  # (a killed run leaves what it closed at its last checkpoint, or more)

  resumed = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"))
  resumed.truncate_after(2)
  resumed.write({"step": 3, "phase": "rl", "loss": 30.0})
  resumed.close()
  assert [r["loss"] for r in resumed.read()] == [1.0, 2.0, 30.0]

  events = read_events(tmp_path)
  starts = [i for i, e in enumerate(events) if e.HasField("session_log")]
  assert events[starts[-1]].step == 3  # purge_step: TensorBoard drops older events from 3 on
  assert events[starts[-1]].session_log.status == event_pb2.SessionLog.START
  # What TensorBoard shows after applying the purge marker equals the JSONL.
  shown = [s for s in scalars(events[:starts[-1]]) if s[0] < 3] + scalars(events[starts[-1]:])
  assert shown == [(1, "rl/loss", 1.0), (2, "rl/loss", 2.0), (3, "rl/loss", 30.0)]


def test_tensorboard_can_be_switched_off(tmp_path):
  log = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"), tensorboard=False)
  log.write({"step": 1, "loss": 1.0})
  log.close()
  assert not list(tmp_path.glob("events.out.tfevents.*"))
  assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.0}


@pytest.mark.parametrize("records", [[], [{"step": 1, "reward_mean": 0.5, "exact_match": 0.25},
                                          {"step": 1, "eval_accuracy": 0.5}]])
def test_plot_run_writes_a_png(tmp_path, records):
  metrics.plot_run(records, str(tmp_path / "plot.png"))
  assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_length_stats_against_the_sorted_lengths():
  import numpy as np  # pylint: disable=import-outside-toplevel
  lengths = np.array([3, 3, 4, 7, 7, 7, 9, 20, 20, 50] * 3)
  stats = metrics.length_stats(np.bincount(lengths))
  ordered = np.sort(lengths)
  assert stats["median"] == ordered[int(np.ceil(0.5 * len(ordered))) - 1] == 7
  assert stats["p95"] == ordered[int(np.ceil(0.95 * len(ordered))) - 1] == 50
  assert stats["max"] == 50 and stats["rows"] == 30
  assert stats["mean"] == pytest.approx(lengths.mean())
  assert metrics.length_stats([]) == {} and metrics.length_stats([0, 0]) == {}


def test_plot_has_an_accuracy_by_size_panel_when_evals_carry_sizes():
  records = [{"step": 1, "reward_mean": 0.5, "exact_match": 0.25},
             {"step": 1, "event": "warm_start_end", "eval_accuracy": 0.3}]
  sized = [dict(r, eval_accuracy_stderr=0.01, eval_accuracy_by_size={"2": 0.5, "3": 0.25})
           if "eval_accuracy" in r else r for r in records]
  assert len(metrics.run_figure(sized).axes) == 3
  assert len(metrics.run_figure(records).axes) == 2
