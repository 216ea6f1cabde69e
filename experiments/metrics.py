"""A run's metrics: JSONL (resumable) and TensorBoard from one write, and the end-of-run plot."""

from __future__ import annotations

import json
import numbers
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import tensorboardX  # pylint: disable=g-import-not-at-top


class MetricsLog:
  """Append-only JSONL of metric records, each with a global 'step', mirrored to TensorBoard.

  Every `write` appends one JSON line and, when `tensorboard` is on, adds each numeric field
  as a scalar tagged `<phase>/<field>` (or `<field>` when the record has no 'phase') at the
  record's step, in TensorBoard event files in the JSONL's directory (so
  `tensorboard --logdir runs` shows one run per workdir).

  After a resume from checkpoint step s, `truncate_to(n, s)` (n stored in the checkpoint)
  drops the records written after that checkpoint, so the log of a killed and resumed run equals an uninterrupted one.
  TensorBoard files are append-only, so the next event file starts with a purge marker at
  step s + 1 (`purge_step`): TensorBoard then discards the older files' events from that
  step on, and the curves match the JSONL.

  TensorBoard writer: tensorboardX (pure Python on protobuf and numpy). clu's writer would
  pull in TensorFlow, which Arbor does not otherwise need.
  """

  def __init__(self, path: str, tensorboard: bool = True):
    self.path = path
    self.tensorboard = tensorboard
    self._writer = None
    self._purge_step = None

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def truncate_after(self, step: int) -> None:
    self._rewrite([r for r in self.read() if r["step"] <= step], purge_step=step + 1)

  def truncate_to(self, num_records: int, step: int) -> None:
    """Keeps the first `num_records` records (the count checkpoint `step` stored), dropping
    records a killed run wrote after that checkpoint, even at the same step."""
    lines = []
    if os.path.exists(self.path):
      with open(self.path) as f:  # raw lines: a line cut by a kill is never parsed
        lines = [line for line in f.read().splitlines() if line.strip()]
    if len(lines) < num_records:
      raise ValueError(f"{self.path} has {len(lines)} records but the checkpoint being "
                       f"resumed was saved after {num_records}: the metrics file was "
                       "truncated or replaced; restore it or use a new workdir.")
    self._rewrite([json.loads(line) for line in lines[:num_records]], purge_step=step + 1)

  def _rewrite(self, kept: list[dict], purge_step: int) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, self.path)
    self._restart_tensorboard(purge_step=purge_step)

  def write(self, record: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if not self.tensorboard:
      return
    writer = self._tensorboard_writer()
    prefix = f"{record['phase']}/" if "phase" in record else ""
    for key, value in record.items():
      if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool):
        writer.add_scalar(prefix + key, float(value), global_step=record["step"])

  def close(self) -> None:
    """Closes the TensorBoard event file, so every event written so far is on disk (the
    JSONL is never buffered); a later `write` opens a new event file.

    Closing is the only way to get tensorboardX's queued events to disk: its `flush` does
    not drain the queue its writer thread reads from.
    """
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def _restart_tensorboard(self, purge_step: int) -> None:
    self.close()
    self._purge_step = max(purge_step, 0)

  def _tensorboard_writer(self) -> tensorboardX.SummaryWriter:
    if self._writer is None:
      # A unique suffix: tensorboardX names files by the second, and a second writer in
      # the same second would otherwise overwrite the first file.
      self._writer = tensorboardX.SummaryWriter(
          logdir=os.path.dirname(os.path.abspath(self.path)), purge_step=self._purge_step,
          filename_suffix=f".{os.getpid()}.{time.time_ns()}")
      self._purge_step = None  # a file reopened after `close` continues; it purges nothing
    return self._writer


def run_figure(records: list[dict]) -> plt.Figure:
  """Train reward (GRPO steps) and held-out accuracy against global step."""
  train = [r for r in records if "reward_mean" in r]
  evals = [r for r in records if "eval_accuracy" in r]
  fig, (ax_reward, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
  ax_reward.plot([r["step"] for r in train], [r["reward_mean"] for r in train], lw=0.8,
                 label="mean reward")
  ax_reward.plot([r["step"] for r in train], [r["exact_match"] for r in train], lw=0.8,
                 label="exact match")
  ax_reward.set(xlabel="step", ylabel="train rollouts", title="GRPO rollouts")
  ax_reward.legend()
  ax_acc.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-")
  ax_acc.set(xlabel="step", ylabel="held-out exact match (greedy)", title="Held-out accuracy")
  for ax in (ax_reward, ax_acc):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  return fig


def plot_run(records: list[dict], path: str) -> None:
  """Saves `run_figure(records)` as a PNG."""
  fig = run_figure(records)
  fig.savefig(path, dpi=110)
  plt.close(fig)
