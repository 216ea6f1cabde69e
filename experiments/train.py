"""Launch an Arbor RL run: supervised warm start, then GRPO, with held-out evaluation.

    python -m experiments.train                                   # the embedded default
    python -m experiments.train --config=experiments/configs/default.py --config.rl.steps=50

Writes to config.workdir: metrics.jsonl (one line per iteration and per evaluation, with
the step's learning rate, phase times and token rates), TensorBoard event files of the
same scalars and the resolved config as text (`tensorboard --logdir runs`; held-out
accuracy is one `eval/accuracy` curve across both phases), plot.png (train reward and
held-out accuracy against step), samples/ (what the policy wrote: the greedy completions
of fixed held-out problems at every evaluation and a few rollouts every
config.metrics.train_samples_every RL steps, each with the answer read, the target, reward
and why it failed; docs/metrics.md), checkpoints/ (orbax), config.json and summary.json. With
config.metrics.wandb_project set the scalars also go to Weights & Biases (pip install
wandb). A rerun with the same workdir resumes from the newest checkpoint.

With `config.model.checkpoint` set (a HF folder, a .gguf file, or "smollm2") the policy and
tokenizer are loaded from it instead of being initialised from scratch with the character
tokenizer (docs/checkpoints.md).

Resume is exact: a run of N steps equals a run killed at any moment (SIGKILL included)
and rerun, bit for bit in parameters and in metrics.jsonl (except the wall-clock fields:
the seconds in time_* and the rates in *_per_s). The checkpoint meta stores the
number of metrics records written, and a resumed run first cuts metrics.jsonl back to it.

    python -m experiments.train --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2

shards the run over a device mesh (default: all 1, one device); docs/pod.md covers several
GPUs, pod slices and multi-process starts (--config.distributed.*). Only process 0 writes
metrics, plots and the summary.
"""

from __future__ import annotations

from absl import app
from absl import flags
from absl import logging
import ml_collections

from experiments import config_flag
from experiments import metrics

CONFIG = config_flag.run_config()


def check_metrics(settings) -> None:
  """Raises ValueError when config.metrics (`settings`, typed: MetricsSettings) asks for W&B
  and wandb is not installed (W&B is optional: Arbor does not depend on it)."""
  if settings.wandb_project:
    try:
      metrics.import_wandb()
    except ImportError as error:
      raise ValueError(str(error)) from None


def run(config: ml_collections.ConfigDict) -> dict:
  """Runs (or resumes) the configured job and returns its summary. The config is checked
  (rl.wiring.validate) before anything is built, so a bad one fails before step 1; what is
  refused before the first step (the config, the task's files, the resume check) raises
  `config_flag.InputError`."""
  # JAX, orbax, reasoning-gym and the model code load here, not at import: `--help` and
  # flag errors answer at once.
  from experiments import job as job_lib  # pylint: disable=import-outside-toplevel
  from rl import wiring  # pylint: disable=import-outside-toplevel

  try:
    run_settings = wiring.validate(config)
    check_metrics(run_settings.metrics)
    job = job_lib.Job(config, run_settings)
    job.restore_or_start()
  except ValueError as error:
    raise config_flag.InputError(str(error)) from error
  for phase in (wiring.WARM_START, wiring.RL):
    if job.meta["phase"] == phase:
      job.run_phase(phase)
  return job.finish()


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  config = config_flag.resolved(CONFIG)
  try:
    summary = run(config)
  except config_flag.InputError as error:
    config_flag.exit_on_input_error(error)
  print("\n".join(report(config, summary)))


def report(config: ml_collections.ConfigDict, summary: dict) -> list[str]:
  """The lines the launcher prints after a run: accuracy before and after, answers by
  category, accuracy by problem size, completion lengths, throughput and wall time."""
  # The first evaluation is the warm start's end, or the initial policy without one.
  start = "Warm-start" if config.warm_start.steps or config.warm_start.init_from else "Initial"
  lines = [f"{start + ' held-out accuracy:':<29} {summary['warm_start_accuracy']:.3f} "
           f"+- {summary['warm_start_accuracy_stderr']:.3f}",
           f"Final held-out accuracy:      {summary['final_accuracy']:.3f} "
           f"+- {summary['final_accuracy_stderr']:.3f}  "
           f"({100 * (summary['final_accuracy'] - summary['warm_start_accuracy']):+.1f} points)"]
  final = summary["categories"]["final"]
  if final:
    lines.append("Final held-out answers by category: "
                 + ", ".join(f"{name} {count}" for name, count in final.items() if count)
                 + f" (why each failed: {config.workdir}/samples/, docs/metrics.md)")
  if "accuracy_by_size" in summary:
    lines.append(f"Held-out accuracy by problem size (examples: {start.lower()} -> final):")
    for size, row in summary["accuracy_by_size"].items():
      before = "  -  " if row["warm_start"] is None else f"{row['warm_start']:.3f}"
      lines.append(f"  size {size:>3} ({row['examples']:>4}): {before} -> {row['final']:.3f}")
  lengths = summary["rollout_completion_length"]
  if lengths:
    lines.append(f"Rollout completion lengths (tokens): median {lengths['median']}, p95 "
                 f"{lengths['p95']}, max {lengths['max']}")
  lines.append(f"Throughput: {summary['sampled_tokens_per_s']:.0f} tokens/s sampled, "
               f"{summary['trained_tokens_per_s']:.0f} tokens/s trained (RL)")
  split = ", ".join(f"{part} {seconds:.0f} s" for part, seconds in summary["time_s"].items())
  lines.append(f"Wall time: {summary['wall_time_s']:.0f} s ({split}); outputs in "
               f"{config.workdir}")
  return lines


if __name__ == "__main__":
  app.run(main, flags_parser=config_flag.parse_flags)
