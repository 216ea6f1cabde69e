"""A run's metrics file (JSONL, resumable) and its end-of-run plot."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top


class MetricsLog:
  """Append-only JSONL of metric records, each with a global 'step'.

  After a resume from checkpoint step s, `truncate_after(s)` drops the records written
  after that checkpoint, so the log of a killed and resumed run equals an uninterrupted one.
  """

  def __init__(self, path: str):
    self.path = path

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def truncate_after(self, step: int) -> None:
    kept = [r for r in self.read() if r["step"] <= step]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, self.path)

  def write(self, record: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")


def plot_run(records: list[dict], path: str) -> None:
  """Train reward (GRPO steps) and held-out accuracy against global step, as a PNG."""
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
  fig.savefig(path, dpi=110)
  plt.close(fig)
