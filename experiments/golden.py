"""Golden outputs for a change that must not alter results: record short launcher runs'
records, then check that another tree reproduces them bit for bit.

    git worktree add /tmp/before <the commit before the change>
    (cd /tmp/before && python -m experiments.golden --record=/tmp/golden_before)
    python -m experiments.golden --record=/tmp/golden_after
    python -m experiments.golden --compare=/tmp/golden_before,/tmp/golden_after

Each cell is one `python -m experiments.train` process (so that the mesh cell gets its own
virtual devices) on the default testbed shrunk to seconds: 2 RL steps of 2 prompts x 4
completions, 16 held-out problems. Every RL cell starts from one warm start trained first
(`--config.warm_start.init_from`), so the matrix costs its RL steps. The cells cover the
ways a batch is made and trained: independent sampling under each selection rule, the
three tree policies, both partial-rollout resume modes, async, simulated staleness,
mu-GRPO stages (several updates per batch), LoRA, a 2 x 2 mesh, a run stopped after its
first checkpoint and resumed, speculative drafts, distillation from the warm start as
teacher, and the adder tool environment (from its own warm start, which demonstrates
calls).

A cell's golden is its metrics.jsonl and summary.json without wall-clock fields (any
`time_*` or `*_per_s` key, `wall_time_s`, and the summary's `time_s` and
`rollout_time_s`). Compare on one machine: float results differ between CPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

# Flag names no other experiments module defines: tests import several into one process.
_RECORD = flags.DEFINE_string("record", "", "Record the goldens into this folder.")
_COMPARE = flags.DEFINE_list("compare", [], "Two golden folders to compare.")
_CELLS = flags.DEFINE_list("cells", [], "Record only these cells (default: all).")

WARM = "warm"
# The testbed shrunk: flags shared by the warm start and every cell (the warm-start match
# covers the task, the model, warm_start.* and the rollout lengths).
BASE = {"config.task.eval_size": 16, "config.eval.batch_size": 16,
        "config.rollout.prompts_per_step": 2, "config.rollout.group_size": 4,
        "config.rl.steps": 2, "config.eval.every": 2, "config.checkpoint.every": 2,
        "config.warm_start.steps": 150}
CELLS = {
    "uniform": {},
    "dynamic": {"config.selection.kind": "dynamic", "config.selection.max_attempts": 30},
    "greso": {"config.selection.kind": "greso", "config.task.train_pool": 4,
              "config.selection.max_attempts": 30},
    "adaptive": {"config.selection.kind": "adaptive",
                 "config.selection.adaptive.initial_rollouts": 2,
                 "config.selection.adaptive.max_rollouts": 6},
    "tree_entropy": {"config.rollout.kind": "tree", "config.rollout.tree.policy": "entropy"},
    "tree_segments": {"config.rollout.kind": "tree", "config.rollout.tree.policy": "segments",
                      "config.rollout.tree.init_chains": 2},
    "tree_lookahead": {"config.rollout.kind": "tree",
                       "config.rollout.tree.policy": "lookahead"},
    "partial_kept_kv": {"config.rollout.kind": "partial", "config.rollout.resume": "kept_kv"},
    "partial_reprefill": {"config.rollout.kind": "partial",
                          "config.rollout.resume": "reprefill"},
    "async": {"config.rl.async_": True, "config.rl.max_staleness": 1},
    "staleness": {"config.rl.staleness": 2, "config.rl.steps": 3},
    "mu_grpo_stages": {"config.loss.name": "mu_grpo", "config.rl.num_minibatches": 2},
    "lora": {"config.lora.rank": 2},
    "mesh_2x2": {"config.mesh.data": 2, "config.mesh.fsdp": 2},
    "resume": {"config.rl.steps": 4},  # stopped after step 2 (its checkpoint), then resumed
    "speculative": {"config.rollout.speculative.tokens": 4,
                    "config.rollout.speculative.sources": ("prompt_lookup", "group")},
    "distill": {"config.distill.teacher": WARM, "config.distill.coef": 1.0},
    # The batch stages: the reward stage (majority vote; a noisy verifier with its second
    # opinion), NAT's token subsample, score centering's sampler record.
    "majority_vote": {"config.reward.kind": "majority_vote"},
    "noisy_verifier": {"config.reward.false_negative": 0.3, "config.reward.false_positive": 0.1,
                       "config.reward.second_opinion": True},
    "nat_rpc": {"config.loss.token_subsample": "rpc"},
    "score_centering": {"config.loss.corrections": ("tis", "score_centering")},
    # The adder's warm start demonstrates calls, so this cell trains its own warm start.
    "tools": {"config.tools.name": "adder", "config.task.difficulty.tool_share": 0.5,
              "config.rollout.max_new_tokens": 160},
}
_OWN_WARM_START = ("tools",)
_DEVICES = {"mesh_2x2": 4}
# Wall-clock fields named outside the time_* / *_per_s convention (second_opinion_s: the
# second opinion's seconds, kept in the per-step means the rewards grid reads).
_CLOCK_FIELDS = ("wall_time_s", "time_s", "rollout_time_s", "warm_start_from",
                 "second_opinion_s")


def clock_free(value):
  """A record (or any JSON value) without its wall-clock fields and the source path of a
  shared warm start, at any depth (the summary's per-step means hold second_opinion_s)."""
  if isinstance(value, list):
    return [clock_free(item) for item in value]
  if not isinstance(value, dict):
    return value
  return {k: clock_free(v) for k, v in value.items()
          if not (k.startswith("time_") or k.endswith("_per_s") or k in _CLOCK_FIELDS)}


def _launch(workdir: str, flags_: dict, devices: int = 1) -> None:
  argv = [sys.executable, "-m", "experiments.train", f"--config.workdir={workdir}"]
  argv += [f"--{k}={v}" for k, v in flags_.items()]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if devices > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")


def record(out: str, names: list[str]) -> None:
  """Runs the warm start, then each named cell from it; writes <out>/<cell>.json."""
  runs = os.path.join(out, "runs")
  warm = os.path.join(runs, WARM)
  if not os.path.exists(os.path.join(warm, "summary.json")):
    _launch(warm, {**BASE, "config.rl.steps": 0})
  for name in names:
    workdir = os.path.join(runs, name)
    start = {} if name in _OWN_WARM_START else {"config.warm_start.init_from": warm}
    cell = {**BASE, **start, **CELLS[name]}
    if cell.get("config.distill.teacher") == WARM:  # the shared warm start teaches
      cell["config.distill.teacher"] = warm
    if name == "resume":  # more steps are a meant change: the relaunch names it
      _launch(workdir, {**cell, "config.rl.steps": 2})
      cell = {**cell, "config.resume.allow_changes": "rl.steps"}
    _launch(workdir, cell, _DEVICES.get(name, 1))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      records = [clock_free(json.loads(line)) for line in f]
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = clock_free(json.load(f))
    with open(os.path.join(out, f"{name}.json"), "w") as f:
      json.dump({"records": records, "summary": summary}, f, indent=1, sort_keys=True)
    print(f"{name}: {len(records)} records", flush=True)


def first_difference(a, b, path: str = "") -> str | None:
  """Where two JSON values first differ (a dotted path and both values), or None."""
  if isinstance(a, dict) and isinstance(b, dict):
    for key in sorted(set(a) | set(b)):
      if key not in a or key not in b:
        return f"{path}.{key}: present in only one"
      found = first_difference(a[key], b[key], f"{path}.{key}")
      if found:
        return found
    return None
  if isinstance(a, list) and isinstance(b, list):
    if len(a) != len(b):
      return f"{path}: {len(a)} vs {len(b)} items"
    for i, (x, y) in enumerate(zip(a, b)):
      found = first_difference(x, y, f"{path}[{i}]")
      if found:
        return found
    return None
  return None if a == b else f"{path}: {a!r} vs {b!r}"


def compare(before: str, after: str) -> list[str]:
  """One line per cell of `before` that `after` lacks or does not reproduce exactly."""
  problems = []
  for name in sorted(f[:-5] for f in os.listdir(before) if f.endswith(".json")):
    path = os.path.join(after, f"{name}.json")
    if not os.path.exists(path):
      problems.append(f"{name}: no golden in {after}")
      continue
    with open(os.path.join(before, f"{name}.json")) as f:
      expected = clock_free(json.load(f))  # a golden recorded by an older version of
      # this tool may hold a wall-clock field it did not know
    with open(path) as f:
      found = first_difference(expected, clock_free(json.load(f)))
    if found:
      problems.append(f"{name}: {found}")
  return problems


def main(argv):
  del argv
  if _COMPARE.value:
    if len(_COMPARE.value) != 2:
      raise app.UsageError("--compare takes two folders: before,after.")
    problems = compare(*_COMPARE.value)
    print("\n".join(problems) or "identical")
    sys.exit(1 if problems else 0)
  if not _RECORD.value:
    raise app.UsageError("Give --record=<folder>, or --compare=<before>,<after>.")
  unknown = sorted(set(_CELLS.value) - set(CELLS))
  if unknown:
    raise app.UsageError(f"Unknown cells {unknown}; known: {sorted(CELLS)}.")
  record(_RECORD.value, _CELLS.value or list(CELLS))


if __name__ == "__main__":
  app.run(main)
