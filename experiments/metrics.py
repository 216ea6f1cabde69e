"""A run's metrics: one write reaches every writer (JSONL, TensorBoard, W&B); the run plot.

`MetricsLog` is what a run writes through: metrics.jsonl (the record of the run, which a
resume cuts back), the sample files beside it (`samples/<kind>_<step>.jsonl`, rl/samples.py)
and the writers the launcher built (`make_writers`), which it never names.
A writer is anything with the `MetricsWriter` methods. Heavy libraries load only when a
writer or a plot needs them, so importing this module costs numpy alone.
"""

from __future__ import annotations

import glob
import importlib
import json
import numbers
import os
import re
import sys
import time
from typing import Any, Protocol, Sequence

import numpy as np

from rl import samples as samples_lib

EVAL_PREFIX = "eval_"
SAMPLES_DIR = "samples"  # beside metrics.jsonl: <kind>_<step>.jsonl, one sample per line
_SAMPLE_FILE = re.compile(r"[a-z]+_([0-9]+)\.jsonl")


class MetricsWriter(Protocol):
  """A destination of metric records (JSONL, TensorBoard, W&B, or your own)."""

  def write_scalars(self, step: int, record: dict) -> None:
    """One record at global step `step`: its real-number fields are the scalars (tagged by
    `scalar_tags`); other fields (phase, event, per-size tables) describe it."""

  def write_text(self, step: int, tag: str, text: str) -> None:
    """A markdown text under `tag` (the resolved config, once per launch)."""

  def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
    """Sample records (rl/samples.py: one dict per completion, the same fields in each)
    under `tag` (`samples/eval`, `samples/train`)."""

  def discard_after(self, step: int) -> None:
    """A resumed run continues from checkpoint `step`: drop what was written after it, as
    far as the destination allows."""

  def flush(self) -> None:
    """Puts everything written so far on disk (or on the wire); writing may go on."""

  def close(self) -> None:
    """Flushes and ends the writer (the end of the run)."""


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def scalar_tags(record: dict) -> dict[str, float]:
  """The scalars of a record, by tag: a held-out evaluation field `eval_<name>` is
  `eval/<name>` in every phase (one curve from the warm start through RL); any other real
  number is `<phase>/<field>` (or `<field>` when the record has no phase). 'step' is the x
  axis, not a scalar; strings, booleans and tables are skipped."""
  prefix = f"{record['phase']}/" if "phase" in record else ""
  tags = {}
  for key, value in record.items():
    if key == "step" or not _is_real(value):
      continue
    tag = "eval/" + key[len(EVAL_PREFIX):] if key.startswith(EVAL_PREFIX) else prefix + key
    tags[tag] = float(value)
  return tags


class JsonlWriter:
  """metrics.jsonl: one JSON line per record, as written (never buffered). It holds metric
  records only; texts such as the config are files of their own (config.json)."""

  def __init__(self, path: str):
    self.path = path

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def write_scalars(self, step: int, record: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps({"step": step, **record}) + "\n")

  def write_text(self, step: int, tag: str, text: str) -> None:
    del step, tag, text  # not a metric record (see the class docstring)

  def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
    del step, tag, samples  # not metric records: MetricsLog writes their own files

  def discard_after(self, step: int) -> None:
    self._rewrite([r for r in self.read() if r["step"] <= step])

  def truncate_to(self, num_records: int) -> None:
    """Keeps the first `num_records` records (the count a checkpoint stored), dropping
    records a killed run wrote after that checkpoint, even at the same step."""
    lines = []
    if os.path.exists(self.path):
      with open(self.path) as f:  # raw lines: a line cut by a kill is never parsed
        lines = [line for line in f.read().splitlines() if line.strip()]
    if len(lines) < num_records:
      raise ValueError(f"{self.path} has {len(lines)} records but the checkpoint being "
                       f"resumed was saved after {num_records}: the metrics file was "
                       "truncated or replaced; restore it or use a new workdir.")
    self._rewrite([json.loads(line) for line in lines[:num_records]])

  def _rewrite(self, kept: list[dict]) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, self.path)

  def flush(self) -> None:
    """Nothing to do: every write is appended and closed at once."""

  def close(self) -> None:
    """Nothing to do: every write is appended and closed at once."""


def import_tensorboardx():
  """tensorboardX, without torch when torch is not loaded yet.

  tensorboardX's package import runs `import torch` (about 4 s) only so that its writer
  accepts torch tensors; Arbor logs floats and strings. While tensorboardX loads,
  `sys.modules['torch'] = None` makes that import fail fast (tensorboardX catches the
  ImportError); the entry is removed right after, so a later `import torch` works.
  """
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    return importlib.import_module("tensorboardX")
  sys.modules["torch"] = None
  try:
    return importlib.import_module("tensorboardX")
  finally:
    if "torch" in sys.modules and sys.modules["torch"] is None:
      del sys.modules["torch"]


class TensorBoardWriter:
  """TensorBoard event files in `logdir` (`tensorboard --logdir runs` shows one run per
  workdir), written with tensorboardX (pure Python on protobuf and numpy; clu's writer
  would pull in TensorFlow).

  TensorBoard files are append-only: after `discard_after(s)` the next event file starts
  with a purge marker at step s + 1 (`purge_step`), so TensorBoard discards the older
  files' events from that step on and the curves match the JSONL. Closing is the only way
  to get tensorboardX's queued events to disk (its `flush` does not drain the queue its
  writer thread reads from), so `flush` closes the file and the next write opens another.
  """

  def __init__(self, logdir: str):
    self.logdir = logdir
    self._writer = None
    self._purge_step = None

  def write_scalars(self, step: int, record: dict) -> None:
    writer = self._open()
    for tag, value in scalar_tags(record).items():
      writer.add_scalar(tag, value, global_step=step)

  def write_text(self, step: int, tag: str, text: str) -> None:
    self._open().add_text(tag, text, global_step=step)

  def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
    """The samples as a markdown table (`rl.samples.markdown_table`) in the text tab."""
    self.write_text(step, tag, samples_lib.markdown_table(samples))

  def discard_after(self, step: int) -> None:
    self.close()
    self._purge_step = max(step + 1, 0)

  def flush(self) -> None:
    self.close()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def _open(self):
    if self._writer is None:
      # A unique suffix: tensorboardX names files by the second, and a second writer in
      # the same second would otherwise overwrite the first file.
      self._writer = import_tensorboardx().SummaryWriter(
          logdir=self.logdir, purge_step=self._purge_step,
          filename_suffix=f".{os.getpid()}.{time.time_ns()}")
      self._purge_step = None  # a file reopened after `close` continues; it purges nothing
    return self._writer


def import_wandb():
  """The wandb module, or ImportError saying how to install it (W&B is optional)."""
  try:
    return importlib.import_module("wandb")
  except ImportError as error:
    raise ImportError("config.metrics.wandb_project is set but wandb is not installed: "
                      "pip install wandb (or set config.metrics.wandb_project='').") from error


class WandbWriter:
  """A Weights & Biases run, with the same tags as TensorBoard (`scalar_tags`).

  Each launch is one W&B run (named after the workdir, the resolved config as its
  config). W&B keeps what it was sent, so `discard_after` has nothing to drop: a resumed
  launch's run starts at its checkpoint's step. Texts go to the run summary; samples are
  a `wandb.Table` logged at their step.
  """

  def __init__(self, project: str, *, name: str, config: dict | None = None,
               directory: str | None = None):
    self._wandb = import_wandb()
    self._run = self._wandb.init(project=project, name=name, config=config, dir=directory)

  def write_scalars(self, step: int, record: dict) -> None:
    self._run.log(scalar_tags(record), step=step)

  def write_text(self, step: int, tag: str, text: str) -> None:
    del step  # the summary holds one value per key
    self._run.summary[tag] = text

  def write_samples(self, step: int, tag: str, samples: list[dict]) -> None:
    columns = list(samples[0])
    table = self._wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])
    self._run.log({tag: table}, step=step)

  def discard_after(self, step: int) -> None:
    del step  # see the class docstring: nothing of this launch lies past its start

  def flush(self) -> None:
    """Nothing to do: wandb streams what it is sent from its own process."""

  def close(self) -> None:
    self._run.finish()


def make_writers(logdir: str, *, tensorboard: bool = True, wandb_project: str = "",
                 run_name: str = "", config: dict | None = None) -> list[MetricsWriter]:
  """The writers a run's settings (config.metrics) ask for, besides metrics.jsonl."""
  writers: list[MetricsWriter] = []
  if tensorboard:
    writers.append(TensorBoardWriter(logdir))
  if wandb_project:
    writers.append(WandbWriter(wandb_project,
                               name=run_name or os.path.basename(os.path.normpath(logdir)),
                               config=config, directory=logdir))
  return writers


class MetricsLog:
  """Append-only metrics.jsonl of records, each with a global 'step', mirrored to writers.

  Every `write` appends one JSON line and hands the record to each writer (default: a
  TensorBoard writer in the JSONL's directory, or none with `tensorboard=False`).

  After a resume from checkpoint step s, `truncate_to(n, s)` (n stored in the checkpoint)
  drops the records written after that checkpoint, so the log of a killed and resumed run
  equals an uninterrupted one, removes the sample files of later steps, and tells every
  writer to discard what followed step s.
  """

  def __init__(self, path: str, tensorboard: bool = True,
               writers: Sequence[MetricsWriter] | None = None):
    self.path = path
    self.jsonl = JsonlWriter(path)
    if writers is None:
      writers = [TensorBoardWriter(os.path.dirname(os.path.abspath(path)))] if tensorboard else []
    self.writers = list(writers)

  def read(self) -> list[dict]:
    return self.jsonl.read()

  def truncate_after(self, step: int) -> None:
    self.jsonl.discard_after(step)
    self._discard_after(step)

  def truncate_to(self, num_records: int, step: int) -> None:
    """Keeps the first `num_records` records (the count checkpoint `step` stored)."""
    self.jsonl.truncate_to(num_records)
    self._discard_after(step)

  def _discard_after(self, step: int) -> None:
    for path in glob.glob(os.path.join(self.samples_dir, "*.jsonl")):
      match = _SAMPLE_FILE.fullmatch(os.path.basename(path))
      if match and int(match.group(1)) > step:
        os.remove(path)
    for writer in self.writers:
      writer.discard_after(step)

  @property
  def samples_dir(self) -> str:
    """Where sample files go: `samples/` beside metrics.jsonl."""
    return os.path.join(os.path.dirname(os.path.abspath(self.path)), SAMPLES_DIR)

  def write(self, record: dict) -> None:
    step = record["step"]
    fields = {k: v for k, v in record.items() if k != "step"}
    for writer in [self.jsonl, *self.writers]:
      writer.write_scalars(step, fields)

  def write_text(self, step: int, tag: str, text: str) -> None:
    for writer in self.writers:
      writer.write_text(step, tag, text)

  def write_samples(self, step: int, kind: str, samples: list[dict]) -> str | None:
    """Writes `samples` (rl/samples.py records; `kind` 'eval' or 'train') to
    samples/<kind>_<step>.jsonl, one JSON object per line with its step first, and to every
    writer under the tag samples/<kind>; returns the file's path (None: no samples)."""
    if not samples:
      return None
    os.makedirs(self.samples_dir, exist_ok=True)
    path = os.path.join(self.samples_dir, f"{kind}_{step}.jsonl")
    with open(path, "w") as f:
      f.write(samples_lib.jsonl(step, samples))
    for writer in self.writers:
      writer.write_samples(step, f"{SAMPLES_DIR}/{kind}", samples)
    return path

  def flush(self) -> None:
    """Every writer's records so far reach disk (a checkpoint calls it)."""
    for writer in self.writers:
      writer.flush()

  def close(self) -> None:
    for writer in self.writers:
      writer.close()


def config_markdown(config_json: str) -> str:
  """A JSON config as a markdown code block (TensorBoard's text tab renders markdown)."""
  return "\n".join("    " + line for line in config_json.splitlines())


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


def _figure(**kwargs):
  """A matplotlib Figure outside pyplot: no backend is chosen or switched (a notebook keeps
  its inline one), savefig renders with Agg, and nothing needs closing. matplotlib loads
  on first use (about 1 s)."""
  from matplotlib import figure  # pylint: disable=import-outside-toplevel
  return figure.Figure(**kwargs)


def run_figure(records: list[dict]) -> Any:
  """A matplotlib Figure: train reward (GRPO steps), held-out accuracy against global step
  (with its standard error; the warm start's and RL's evaluations are one curve) and, for
  tasks with problem sizes, held-out accuracy per size after the warm start and at the last
  evaluation."""
  train = [r for r in records if "reward_mean" in r]
  evals = [r for r in records if "eval_accuracy" in r]
  sized = [r for r in evals if r.get("eval_accuracy_by_size")]
  panels = 3 if sized else 2
  fig = _figure(figsize=(5 * panels, 3.8))
  axes = fig.subplots(1, panels)
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
  run_figure(records).savefig(path, dpi=110)
