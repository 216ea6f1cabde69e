"""MetricsLog: one write reaches the JSONL and TensorBoard; a resume purges TensorBoard too.

Event files are read back with a small independent TFRecord reader (length, CRC, payload,
CRC framing) and tensorboardX's Event protobuf, not with the writer's own code.
"""

import json
import pathlib
import struct

import pytest
from tensorboardX.proto import event_pb2

from experiments import metrics


def read_events(directory: pathlib.Path) -> list[event_pb2.Event]:
  """Every event of every event file in `directory`, files in name order (as TensorBoard)."""
  events = []
  for path in sorted(directory.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      payload = data[offset + 12:offset + 12 + length]  # skip the length's CRC
      events.append(event_pb2.Event.FromString(payload))
      offset += 12 + length + 4  # payload CRC
  return events


def scalars(events) -> list[tuple[int, str, float]]:
  return [(e.step, v.tag, v.simple_value) for e in events if e.HasField("summary")
          for v in e.summary.value]


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
      (2, "rl/loss", -0.125), (2, "rl/reward_mean", 0.75), (3, "eval_accuracy", 0.5)]


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
