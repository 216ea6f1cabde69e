"""What scoring in the isolated worker costs (docs/add_task.md): a batch of completions
scored in this process (`rl.scoring.score_one`, no isolation) against the same batch
through `rl.scoring.Scorer` (a separate process with time and memory limits), alternated,
median over batches.

    python -m experiments.bench_scoring --tasks=running_sum,countdown --batches=50

Each batch is --batch completions of distinct training examples: each example's own
answer (`Example.answer`, the warm start's demonstration: running_sum's teacher slips at
carries, so not all are right), every second one with its last character changed (a wrong
or unparsable answer), so both of a scorer's paths run. The worker is
started (and the task sent to it) before timing: a run pays that once.
Writes bench_scoring.json and bench_scoring.md to --out.
"""

from __future__ import annotations

import statistics
import time

from absl import app
from absl import flags

from experiments.measure import load, write_results
from rl import scoring
from rl import tasks

_TASKS = flags.DEFINE_list("tasks", ["running_sum", "countdown"], "Tasks to score (rl.tasks).")
_BATCH = flags.DEFINE_integer("batch", 256, "Completions per batch.")
_BATCHES = flags.DEFINE_integer("batches", 50, "Timed batches per side (median reported).")
_OUT = flags.DEFINE_string("out", "runs/bench_scoring", "Output directory.")
_SMOKE = flags.DEFINE_bool("smoke", False, "One task, small batches (for CI).")


def completions_for(examples) -> list[str]:
  """The examples' answers, every second one with its last character changed."""
  answers = [example.answer for example in examples]
  return [a if i % 2 == 0 else a[:-1] + ("0" if a[-1:] != "0" else "1")
          for i, a in enumerate(answers)]


def bench_task(name: str, batch: int, batches: int) -> dict:
  task = tasks.make_task(name, seed=0)
  examples = task.examples("train", batch, 0)
  completions = completions_for(examples)
  scorer = scoring.Scorer()
  try:
    expected = [scoring.score_one(task, c, e)[0] for c, e in zip(completions, examples)]
    warm = scorer.score(task, completions, examples)
    assert list(warm.rewards) == expected, "the worker and the trainer disagree"
    in_process, worker = [], []
    for _ in range(batches):  # alternated so that a drifting load favours neither side
      start = time.perf_counter()
      for c, e in zip(completions, examples):
        scoring.score_one(task, c, e)
      in_process.append(time.perf_counter() - start)
      start = time.perf_counter()
      scorer.score(task, completions, examples)
      worker.append(time.perf_counter() - start)
  finally:
    scorer.close()
  in_s, worker_s = statistics.median(in_process), statistics.median(worker)
  return dict(task=name, batch=batch, batches=batches, rewarded=sum(expected),
              in_process_s=in_s, worker_s=worker_s,
              overhead_per_completion_us=1e6 * (worker_s - in_s) / batch)


def markdown(result: dict) -> str:
  lines = ["| task | completions per batch | in process ms | worker ms | worker overhead per "
           "completion us |", "|---|---|---|---|---|"]
  for r in result["cases"]:
    lines.append(f"| {r['task']} | {r['batch']} | {1e3 * r['in_process_s']:.2f} | "
                 f"{1e3 * r['worker_s']:.2f} | {r['overhead_per_completion_us']:.1f} |")
  return "\n".join(lines) + (f"\n\nMedian of {result['cases'][0]['batches']} batches per side. "
                             f"Load: {result['load_before']} -> {result['load_after']}\n")


def main(argv):
  del argv
  names, batch, batches = ((_TASKS.value[:1], 8, 2) if _SMOKE.value
                           else (_TASKS.value, _BATCH.value, _BATCHES.value))
  load_before = load()
  cases = [bench_task(name, batch, batches) for name in names]
  for case in cases:
    print(f"{case['task']}: in process {1e3 * case['in_process_s']:.2f} ms, worker "
          f"{1e3 * case['worker_s']:.2f} ms per batch of {case['batch']}", flush=True)
  write_results(_OUT.value, "bench_scoring",
                {"cases": cases, "load_before": load_before, "load_after": load()}, markdown,
                plot=None)


if __name__ == "__main__":
  app.run(main)
