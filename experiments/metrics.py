"""A run's metrics: JSONL (resumable) and TensorBoard from one write, and the end-of-run plot."""

from __future__ import annotations

import json
import numbers
import os
import time

import matplotlib
import numpy as np

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


def length_stats(counts) -> dict[str, float]:
  """Median, 95th percentile, max and mean of a length histogram (counts[n] = rows of n
  tokens); {} when it is empty. Percentiles are the smallest length covering the fraction."""
  counts = np.asarray(counts, np.int64)
  total = int(counts.sum())
  if total == 0:
    return {}
  cumulative = np.cumsum(counts)
  lengths = np.arange(len(counts))
  quantile = lambda q: int(np.searchsorted(cumulative, q * total))
  return {"median": quantile(0.5), "p95": quantile(0.95),
          "max": int(lengths[counts > 0].max()), "mean": float((lengths * counts).sum() / total),
          "rows": total}


def run_figure(records: list[dict]) -> plt.Figure:
  """Train reward (GRPO steps), held-out accuracy against global step (with its standard
  error) and, for tasks with problem sizes, held-out accuracy per size after the warm start
  and at the last evaluation."""
  train = [r for r in records if "reward_mean" in r]
  evals = [r for r in records if "eval_accuracy" in r]
  sized = [r for r in evals if r.get("eval_accuracy_by_size")]
  panels = 3 if sized else 2
  fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8))
  ax_reward, ax_acc = axes[:2]
  ax_reward.plot([r["step"] for r in train], [r["reward_mean"] for r in train], lw=0.8,
                 label="mean reward")
  ax_reward.plot([r["step"] for r in train], [r["exact_match"] for r in train], lw=0.8,
                 label="exact match")
  ax_reward.set(xlabel="step", ylabel="train rollouts", title="GRPO rollouts")
  ax_reward.legend()
  ax_acc.errorbar([r["step"] for r in evals], [r["eval_accuracy"] for r in evals],
                  yerr=[r.get("eval_accuracy_stderr", 0.0) for r in evals], fmt="o-", capsize=2)
  ax_acc.set(xlabel="step", ylabel="held-out exact match (greedy)", title="Held-out accuracy")
  if sized:
    first = next((r for r in sized if r.get("event") == "warm_start_end"), sized[0])
    for record, label in ((first, f"step {first['step']} ({first.get('event', 'eval')})"),
                          (sized[-1], f"step {sized[-1]['step']} (last)")):
      by_size = sorted((int(k), v) for k, v in record["eval_accuracy_by_size"].items())
      axes[2].plot([k for k, _ in by_size], [v for _, v in by_size], "o-", label=label)
    axes[2].set(xlabel="problem size", ylabel="held-out exact match", title="Accuracy by size")
    axes[2].legend()
  for ax in axes:
    ax.grid(alpha=0.3)
  fig.tight_layout()
  return fig


def plot_run(records: list[dict], path: str) -> None:
  """Saves `run_figure(records)` as a PNG."""
  fig = run_figure(records)
  fig.savefig(path, dpi=110)
  plt.close(fig)
