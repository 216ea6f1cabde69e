"""What the policy wrote, as a reader inspects it: sample records of held-out and training
completions, and their tables.

A sample is one completion with its prompt, the answer the scorer read, the target, the
reward and the category (`rl.verdicts`: correct, no_answer, malformed, wrong_value,
truncated, tool_error, scorer_failed). Evaluation samples are fixed held-out problems
(`spread_indices`), so two evaluations, of one run or of two, show the same problems;
training samples are rows of a trained batch, with their advantage and behaviour log-prob
sum, so reward hacking and collapse show as they happen. experiments/metrics.py writes
them (`samples/eval_<step>.jsonl`, `samples/train_<step>.jsonl`, TensorBoard text, a W&B
table); docs/metrics.md lists the fields.

Completions are policy text: they are only ever stored and printed, never evaluated.
This module loads no numerical library (JAX when training samples are first taken), so the
launcher's metrics module imports it and `--help` stays fast.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Sequence


from rl.verdicts import Verdict

if TYPE_CHECKING:
  from rl.types import Rollout

EVAL_FIELDS = ("example", "category", "reward", "answer", "target", "length", "prompt",
               "completion")
TRAIN_FIELDS = ("row", "group", "category", "reward", "advantage", "behavior_logp_sum",
                "answer", "target", "length", "prompt", "completion")


@dataclasses.dataclass(frozen=True)
class ScoredRow:
  """One scored completion as its scorer saw it: the example's prompt, the completion's
  text (environment answers included) and the verdict; `example`, the task's Example it
  answers (what rl.rewards' stage re-scores; not shown in samples)."""
  prompt: str
  completion: str
  verdict: Verdict
  example: Any = None


def spread_indices(num_examples: int, count: int) -> list[int]:
  """`count` positions spread evenly over `num_examples` (all of them when count >=
  num_examples): i * num_examples // count. Fixed for a given held-out set, so every
  evaluation samples the same problems, and spread, so an ordered file is sampled
  throughout."""
  count = min(count, num_examples)
  return [i * num_examples // count for i in range(count)]


def eval_samples(rows: Sequence[ScoredRow], rewards, lengths, count: int) -> list[dict]:
  """The sample records (`EVAL_FIELDS`) of `count` held-out problems (`spread_indices`),
  from every problem's scored row, reward and completion length."""
  return [{"example": i, "category": rows[i].verdict.category, "reward": float(rewards[i]),
           "answer": rows[i].verdict.answer, "target": rows[i].verdict.target,
           "length": int(lengths[i]), "prompt": rows[i].prompt,
           "completion": rows[i].completion}
          for i in spread_indices(len(rows), count)]


def train_samples(rollout: Rollout, rows: Sequence[ScoredRow | None], count: int) -> list[dict]:
  """The sample records (`TRAIN_FIELDS`) of the first `count` rows of a trained batch that
  have a scored row and trained tokens (a rejected group's rows and a tree's unused rows
  have none): the first groups' completions, side by side as GRPO compares them. The
  advantage is the mean over the row's trained tokens (a sequence's advantage for GRPO, a
  node's mean for a tree), the log-prob sum the sampler's over the same tokens."""
  from sharding import multihost  # pylint: disable=import-outside-toplevel  (JAX)
  reward, advantages, logp, mask, group = multihost.fetch(
      (rollout.reward, rollout.advantages, rollout.behavior_logp, rollout.completion_mask,
       rollout.group))
  lengths = mask.sum(axis=1)
  chosen = [r for r in range(len(rows)) if rows[r] is not None and lengths[r]][:count]
  return [{"row": r, "group": int(group[r]), "category": rows[r].verdict.category,
           "reward": float(reward[r]),
           "advantage": float(advantages[r][mask[r]].mean()),
           "behavior_logp_sum": float(logp[r][mask[r]].sum()),
           "answer": rows[r].verdict.answer, "target": rows[r].verdict.target,
           "length": int(lengths[r]), "prompt": rows[r].prompt,
           "completion": rows[r].completion}
          for r in chosen]


def jsonl(step, samples: Sequence[dict]) -> str:
  """The samples as JSON Lines, one object per sample with `step` first (what the sample
  files hold: `cat samples/*.jsonl` stays readable as one stream)."""
  return "".join(json.dumps({"step": step, **sample}) + "\n" for sample in samples)


def elide(text: str | None, width: int) -> str:
  """`text` on one line (newlines shown as '\\n') of at most `width` characters: its start
  and end around '...' when longer (the end is where a final answer usually is)."""
  text = "" if text is None else str(text).replace("\n", "\\n")
  if len(text) <= width:
    return text
  head = (width - 3) // 2
  return text[:head] + "..." + text[len(text) - (width - 3 - head):]


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.3f}"
  return "" if value is None else str(value)


def markdown_table(samples: Sequence[dict], width: int = 400) -> str:
  """The samples as a markdown table (TensorBoard's text tab): one row each, texts on one
  line (`elide` at `width`), '|' escaped."""
  columns = list(samples[0])
  escape = lambda value: elide(_cell(value), width).replace("|", "\\|")
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(escape(s[c]) for c in columns) + " |" for s in samples]
  return "\n".join(lines)


def text_table(samples: Sequence[dict], prompt_width: int = 32,
               completion_width: int = 72) -> str:
  """The samples as a plain-text table for a terminal: their fields other than the texts
  in aligned columns, then the prompt and the completion, each elided to its width."""
  widths = {"prompt": prompt_width, "completion": completion_width}
  columns = list(samples[0])
  cells = [[elide(_cell(s[c]), widths.get(c, 24)) for c in columns] for s in samples]
  sizes = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  line = lambda values: "  ".join(v.ljust(n) for v, n in zip(values, sizes)).rstrip()
  return "\n".join([line(columns), line("-" * n for n in sizes)] + [line(row) for row in cells])


def train_samples_stage(count: int, every: int):
  """The training samples as a batch stage (`rl.stages`; metrics only): every `every`
  iterations the batch's statistics carry `samples`, `train_samples` of its first `count`
  rows (a list of records, not a number: whoever logs the metrics takes it out)."""
  from rl import stages  # pylint: disable=import-outside-toplevel  (JAX)

  def apply(rollout, stats, state, *, iteration, **extras):
    del extras
    if count and every and iteration % every == 0:
      stats = stats.with_counters(samples=train_samples(rollout, stats.rows, count))
    return rollout, stats, state

  return stages.Stage(init=lambda: None, apply=apply, name="training samples")
