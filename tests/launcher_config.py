"""The launcher config of the end-to-end tests (the compact chain_sum run on the micro
model preset, shrunk to seconds), how to override its fields, the launcher's refusal of a
config, the records a run writes, and the killed-run script of the resume tests."""

import json
import os
import textwrap

import pytest

from experiments import config_flag
from experiments import train
from experiments.configs import chain_sum_compact
from experiments.configs import default


def tiny_run_config(workdir, overrides: dict | None = None, base=chain_sum_compact):
  """`experiments/configs/chain_sum_compact.py` (answers of a few tokens; or another config
  module `base`) with tiny sizes: the micro model preset, 3 warm-start steps of 8, 2 GRPO
  steps of 2 prompts x 4 completions, 16 held-out items evaluated and checkpoints saved
  every 2 steps. `overrides` maps dotted field paths ("rl.steps", "rollout.tree.rounds",
  "model.preset" for a test that needs a policy that learns) to values.
  """
  c = base.get_config()
  c.workdir = str(workdir)
  c.model.preset = "micro"
  c.task.eval_size = 16
  c.warm_start.steps = 3
  c.warm_start.batch_size = 8
  c.rl.steps = 2
  c.rollout.prompts_per_step = 2
  c.rollout.group_size = 4
  c.eval.every = 2
  c.eval.batch_size = 16
  c.checkpoint.every = 2
  return apply_overrides(c, overrides)


def tiny_running_sum_config(workdir, overrides: dict | None = None):
  """The default run (running_sum) at `tiny_run_config`'s sizes, on problems of 1-3
  additions."""
  return tiny_run_config(workdir, {"task.difficulty.max_steps": 3, **(overrides or {})},
                         base=default)


def default_run_config(workdir, overrides: dict | None = None):
  """`experiments/configs/default.py` (what `python -m experiments.train` runs) with
  `workdir` and `overrides` (dotted field paths) set."""
  return apply_overrides(default.get_config(), {"workdir": str(workdir), **(overrides or {})})


def refusal(config) -> str:
  """The message the launcher (`experiments.train.run`, what `python -m experiments.train`
  calls after parsing its flags) refuses `config` with; it must do so before any work, so
  the workdir is never made. The one-line message and exit status a shell sees are
  tests/test_launcher_validation.py's."""
  with pytest.raises(config_flag.InputError) as refused:
    train.run(config)
  assert not os.path.exists(config.workdir), "refused after creating the workdir"
  return str(refused.value)


def apply_overrides(c, overrides: dict | None):
  """`c` with `overrides` ({"rl.steps": 4, ...}: dotted field paths) set; a path that is
  not a field is a KeyError."""
  for path, value in (overrides or {}).items():
    *parents, leaf = path.split(".")
    node = c
    for name in parents:
      node = node[name]
    if leaf not in node:
      raise KeyError(f"no config field {path!r}.")
    node[leaf] = value
  return c


# Runs the launcher in a child process that SIGKILLs itself when orbax is about to rename
# the finished temporary directory of step `kill_step` into place: every byte of that
# checkpoint is written, only the atomic rename is missing. argv: config JSON, kill_step.
KILLED_RUN = textwrap.dedent("""
    import json, os, signal, sys
    import ml_collections
    from orbax.checkpoint._src.path import atomicity
    from experiments import train

    config = ml_collections.ConfigDict(json.loads(sys.argv[1]))
    kill_step = int(sys.argv[2])
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killing_finalize(self, *args, **kwargs):
      if os.path.basename(str(self.get())) == f"{kill_step}.orbax-checkpoint-tmp":
        os.kill(os.getpid(), signal.SIGKILL)
      return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize
    train.run(config)
""")


def records(workdir) -> list[dict]:
  """Every record of the run in `workdir`: its metrics.jsonl, in order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def rl_steps(workdir) -> list[dict]:
  """The RL train steps' records (phase "rl", with a loss) of the run in `workdir`."""
  return [r for r in records(workdir) if r.get("phase") == "rl" and "loss" in r]


def without_clock(record: dict) -> dict:
  """A metrics record or checkpoint meta without its wall-clock fields (seconds time_*,
  rates *_per_s), the only values that differ between two runs of the same config."""
  return {k: v for k, v in record.items()
          if not k.startswith("time_") and not k.endswith("_per_s")}
