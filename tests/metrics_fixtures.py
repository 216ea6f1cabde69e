"""Reading back what a run's metrics writers wrote, for tests/test_metrics.py and
tests/test_experiment_train.py.

Event files are read with a small independent TFRecord reader (length, CRC, payload, CRC
framing) and tensorboardX's Event protobuf, not with the writer's own code; `FakeWandb`
stands in for the `wandb` module.
"""

import pathlib
import struct
import types

from tensorboardX.proto import event_pb2


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
          for v in e.summary.value if not v.HasField("tensor")]


def texts(events) -> list[tuple[int, str, str]]:
  return [(e.step, v.tag, v.tensor.string_val[0].decode()) for e in events
          if e.HasField("summary") for v in e.summary.value if v.HasField("tensor")]


class FakeTable(types.SimpleNamespace):
  """A `wandb.Table` stand-in: its columns and rows."""


class FakeWandb(types.ModuleType):
  """The part of wandb's API the writer uses, recording every call."""

  Table = FakeTable

  def __init__(self):
    super().__init__("wandb")
    self.runs = []

  def init(self, **kwargs):
    run = types.SimpleNamespace(init=kwargs, logged=[], summary={}, finished=False)
    run.log = lambda data, step: run.logged.append((step, dict(data)))
    run.finish = lambda: setattr(run, "finished", True)
    self.runs.append(run)
    return run
