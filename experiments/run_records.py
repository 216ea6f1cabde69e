"""A launcher run's records: what it keeps beside the loop state (`new_meta`, stored in
each checkpoint's meta so a resumed run reports the whole run) and the summary fields
computed from them (accuracy curve, step-metric means, throughput).

Plain Python on JSON-able dicts: experiments/job.py updates them step by step.
"""

from __future__ import annotations

import numpy as np

from rl import verdicts
from rl import wiring

TIME_PARTS = ("warm_start", "rollout", "train", "eval")
ROLLOUT_PARTS = ("sample", "score")  # the rollout time's parts (rl.loop.produce_timed)
TOKEN_COUNTS = ("warm_start_trained", "sampled", "trained")
CATEGORY_PREFIX = "eval_category_"  # an evaluation record's count of one failure category


def add_counts(counts: list[int], more) -> list[int]:
  """Elementwise sum of two histograms of different lengths, as a list (JSON-able)."""
  total = [0] * max(len(counts), len(more))
  for i, c in enumerate(counts):
    total[i] += int(c)
  for i, c in enumerate(more):
    total[i] += int(c)
  return total


def accuracy_by_size_table(warm: dict, final: dict) -> dict[str, dict]:
  """{size: {examples, warm_start, final}} from two evaluation records."""
  return {size: {"examples": final["eval_examples_by_size"][size],
                 "warm_start": warm.get("eval_accuracy_by_size", {}).get(size),
                 "final": acc}
          for size, acc in sorted(final["eval_accuracy_by_size"].items(), key=lambda x: int(x[0]))}


def new_meta() -> dict:
  """Run-level records kept in the checkpoint meta, so a resumed run reports the whole run:
  held-out evaluations, the histogram of RL rollout completion lengths, the prompts
  selection skipped, the wall time spent in each part (seconds; compilation counts where
  it happens; the rollout time also split into sample and score), the RL steps' wall time
  (time_rl_s: evaluations and checkpoints excluded, async rollout and training overlapping
  counted once) and its value at each evaluation (time_rl_at_evals_s: clocks stay out of the
  evaluation records), and the real tokens sampled and trained."""
  return {"phase": wiring.WARM_START, "iteration": 0, "evals": [],
          "completion_length_counts": [],
          "time_s": dict.fromkeys(TIME_PARTS + ROLLOUT_PARTS, 0.0),
          "prompts_skipped": 0, "tokens": dict.fromkeys(TOKEN_COUNTS, 0),
          "rl_metric_sums": {}, "rl_steps_recorded": 0, "time_rl_s": 0.0,
          "time_rl_at_evals_s": [], "eval_step_sums": [], "time_rl_sample_s": []}


def upgrade_meta(meta: dict) -> dict:
  """A restored meta with the records added since its checkpoint was written, zeroed."""
  meta.setdefault("prompts_skipped", 0)
  meta.setdefault("rl_metric_sums", {})
  meta.setdefault("rl_steps_recorded", 0)
  meta.setdefault("time_rl_s", 0.0)
  meta.setdefault("time_rl_sample_s", [])
  # Evaluations restored from a checkpoint written before their RL clock and step sums were
  # kept: a warm-start evaluation's are known (no RL yet); an RL one's are unknown (None).
  for name, before_rl in (("time_rl_at_evals_s", 0.0),
                          ("eval_step_sums", {"steps": 0, "sums": {}})):
    known = meta.setdefault(name, [])
    missing = meta["evals"][:len(meta["evals"]) - len(known)]
    meta[name] = [before_rl if e["phase"] == wiring.WARM_START else None for e in missing] + known
  for part in ROLLOUT_PARTS:
    meta["time_s"].setdefault(part, 0.0)
  meta.setdefault("tokens", {})
  for name in TOKEN_COUNTS:
    meta["tokens"].setdefault(name, 0)
  return meta


def add_step_metrics(meta: dict, step_metrics: dict) -> None:
  """Adds one RL step's clock-free metrics to meta's running sums (`rl_step_means`), and
  its sampling seconds to the list behind `time_sample_median_s`."""
  meta["time_rl_sample_s"].append(float(step_metrics.get("time_sample_s", 0.0)))
  sums = meta["rl_metric_sums"]
  for name, value in step_metrics.items():
    if not (name.startswith("time_") or name.endswith("_per_s")):
      sums[name] = sums.get(name, 0.0) + float(value)
  meta["rl_steps_recorded"] += 1


def rl_step_means(meta: dict) -> dict[str, float]:
  """Each RL step metric's mean over the run's RL steps (clip, mask and veto fractions,
  gradient norm, reward, ...; wall-clock fields left out). A metric some steps lack (e.g.
  one only a correction reports) is averaged over all steps, counting its absence as 0."""
  count = meta["rl_steps_recorded"]
  return {name: total / count for name, total in sorted(meta["rl_metric_sums"].items())
          } if count else {}


def time_sample_median_s(meta: dict) -> float | None:
  """The median RL step's sampling seconds (its compiling first steps do not move it, unlike
  the total); None before any RL step."""
  times = meta.get("time_rl_sample_s") or []
  return float(np.median(times)) if times else None


def step_means_between_evals(meta: dict) -> list[dict[str, float]]:
  """Per evaluation, each RL step metric's mean over the RL steps since the previous
  evaluation (empty where there were none, e.g. the warm start's; None where a restored
  checkpoint predates these records): how clip fractions, informative groups, rewards, ...
  move over the run, at the evaluations' resolution."""
  windows, previous = [], {"steps": 0, "sums": {}}
  for current in meta["eval_step_sums"]:
    if current is None or previous is None:  # restored from a checkpoint that lacked them
      windows.append(None)
      previous = current
      continue
    steps = current["steps"] - previous["steps"]
    windows.append({name: (total - previous["sums"].get(name, 0.0)) / steps
                    for name, total in sorted(current["sums"].items())} if steps else {})
    previous = current
  return windows


def accuracy_curve(meta: dict) -> list[dict]:
  """The run's held-out evaluations in order: step, event, accuracy and its stderr, and
  the RL tokens sampled before it (decoded: a tree's shared nodes once, every selection
  round's and every partial-rollout round's tokens)."""
  return [{"step": e["step"], "event": e["event"], "accuracy": e["eval_accuracy"],
           "stderr": e["eval_accuracy_stderr"], "sampled_tokens": e.get("sampled_tokens", 0)}
          for e in meta["evals"]]


def throughput_summary(meta: dict) -> dict:
  """The run's rollout time split into sample and score (parts of time_s.rollout), the
  real tokens sampled and trained (RL, and the warm start's trained), and the RL rates:
  sampled tokens per second of sampling, trained tokens per second of RL training."""
  time_s, tokens = meta["time_s"], meta["tokens"]
  per_second = lambda count, seconds: count / seconds if seconds > 0 else 0.0
  return {"rollout_time_s": {part: time_s[part] for part in ROLLOUT_PARTS},
          "tokens": dict(tokens),
          "sampled_tokens_per_s": per_second(tokens["sampled"], time_s["sample"]),
          "trained_tokens_per_s": per_second(tokens["trained"], time_s["train"])}


def categories_of(record: dict) -> dict[str, int]:
  """{category: held-out answers} of an evaluation record ({} for a record written before
  categories were counted)."""
  return {key[len(CATEGORY_PREFIX):]: count for key, count in record.items()
          if key.startswith(CATEGORY_PREFIX)}


def categories_summary(warm: dict, final: dict) -> dict[str, dict[str, int]]:
  """summary.json's `categories`: the held-out answers of each category after the warm
  start and at the end."""
  return {"warm_start": categories_of(warm), "final": categories_of(final)}


def failures_line(categories: dict[str, int]) -> str:
  """', failures: wrong_value 12, truncated 3' for an evaluation's non-zero failure
  categories, most frequent first ('' when every answer is correct or none was counted)."""
  failed = sorted(((count, name) for name, count in categories.items()
                   if name != verdicts.CORRECT and count), key=lambda item: (-item[0], item[1]))
  return ", failures: " + ", ".join(f"{name} {count}" for count, name in failed) if failed else ""


def no_tools_record(without, with_tools) -> dict:
  """What an evaluation with an environment adds to its record: environment answers per
  answer (eval_tool_calls) and the same evaluation without the environment (a call is
  then answered by nobody: the policy writes on)."""
  record = {"eval_tool_calls": with_tools.tool_calls, "eval_accuracy_no_tools": without.accuracy,
            "eval_reward_no_tools": without.mean_reward}
  if without.accuracy_by_size:
    record["eval_accuracy_by_size_no_tools"] = {str(k): acc for k, (_, acc) in
                                                without.accuracy_by_size.items()}
  return record


def tools_summary(warm: dict, final: dict) -> dict:
  """With an environment: held-out calls per answer and accuracy without the environment,
  at the warm start's end and at the end, and the accuracy by size without it."""
  by_size = final.get("eval_accuracy_by_size_no_tools", {})
  return {"warm_start_tool_calls": warm["eval_tool_calls"],
          "final_tool_calls": final["eval_tool_calls"],
          "warm_start_accuracy_no_tools": warm["eval_accuracy_no_tools"],
          "final_accuracy_no_tools": final["eval_accuracy_no_tools"],
          "accuracy_by_size_no_tools": {
              size: {"warm_start": warm.get("eval_accuracy_by_size_no_tools", {}).get(size),
                     "final": acc}
              for size, acc in sorted(by_size.items(), key=lambda x: int(x[0]))}}


def eval_record(result, step: int, phase: str, label: str, sampled_tokens: int) -> dict:
  """The metrics.jsonl record of one held-out evaluation (with the RL tokens sampled so
  far), its category counts as `eval_category_<category>` numbers (TensorBoard curves)."""
  record = {"step": step, "phase": phase, "event": label, "sampled_tokens": sampled_tokens,
            "eval_accuracy": result.accuracy, "eval_accuracy_stderr": result.accuracy_stderr,
            "eval_reward": result.mean_reward, "eval_length": result.mean_length,
            **{CATEGORY_PREFIX + name: count for name, count in result.categories.items()}}
  if result.accuracy_by_size:
    record["eval_accuracy_by_size"] = {str(k): acc for k, (_, acc) in
                                       result.accuracy_by_size.items()}
    record["eval_examples_by_size"] = {str(k): n for k, (n, _) in
                                       result.accuracy_by_size.items()}
  return record
