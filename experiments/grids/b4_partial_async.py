"""B4, partial and asynchronous rollouts on the testbed: synchronous GRPO vs partial
rollouts (both resume modes) vs async training (max_staleness 1 and 4), 3 seeds, each
cell's RL phase from its seed's shared warm start (experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/b4_partial_async.py --out=docs/results/b4
    python -m experiments.grid --spec=experiments/grids/b4_partial_async.py \
        --out=docs/results/b4 --render --page=docs/benchmarks_partial.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, GRPO,
held-out greedy accuracy every 30 steps, the default):
- `sync`: each step samples a fresh batch and waits for its longest completion.
- `partial_kept_kv` / `partial_reprefill` (APRIL, CoPRIS): a pool of 2 x 64 rows; a round
  decodes until 8 groups are complete, trains on them, and continues the unfinished rows
  next step (kept_kv: with their KV cache; reprefill: re-prefilled under the new
  parameters). Tokens older than rl.max_staleness = 4 updates are not trained on.
- `async_s1` / `async_s4` (AReaL): a producer thread samples the next batches while the
  trainer trains, at most 1 or 4 updates behind.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
SETTINGS = {
    "sync": {},
    "partial_kept_kv": {"config.rollout.kind": "partial", "config.rollout.resume": "kept_kv"},
    "partial_reprefill": {"config.rollout.kind": "partial",
                          "config.rollout.resume": "reprefill"},
    "async_s1": {"config.rl.async_": True, "config.rl.max_staleness": 1},
    "async_s4": {"config.rl.async_": True, "config.rl.max_staleness": 4},
}

SPEC = {"cells": [{"name": f"{name}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START, **flags}}
                  for seed in SEEDS for name, flags in SETTINGS.items()]}


# --- The page ---

def sequences_per_decode_step(result: dict) -> float:
  """Completed sequences trained on per decode step of the sampler, over the RL phase.

  Partial-rollout steps report no `rollouts` count (their ledger counts groups, and
  cumulatively); every trained row is a completed sequence, so their count is the trained
  tokens over the mean trained completion length."""
  means = result["summary"]["rl_step_means"]
  if "rollouts" in means:
    return means["rollouts"] / means["decode_steps"]
  return means["trained_tokens"] / means["completion_len"] / means["decode_steps"]


def _seconds_to(result: dict, target: float) -> float | None:
  return pages.first_reaching(*pages.rl_curve(result, "seconds"), target)


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _row(name: str, group: list[dict], groups: dict[str, list[dict]]) -> str:
  s = [r["summary"] for r in group]
  sync = {r["seed"]: r for r in groups.get("sync", [])}
  speed = [sequences_per_decode_step(r) / sequences_per_decode_step(sync[r["seed"]])
           for r in group if r["seed"] in sync]
  # Wall time to the synchronous run's final accuracy in the same seed.
  to_target = [_seconds_to(r, sync[r["seed"]]["summary"]["final_accuracy"])
               if r["seed"] in sync else None for r in group]
  staleness = [r["summary"]["rl_step_means"].get("staleness", 0.0) for r in group]
  return pages.table_row(name, group, [
      pages.mean_std([x["final_accuracy"] for x in s]),
      pages.mean_std([x["final_accuracy_stderr"] for x in s]),
      pages.mean_std([sequences_per_decode_step(r) for r in group], 3),
      pages.mean_std(speed, 2),
      pages.mean_std([x["tokens"]["sampled"] / 1e3 for x in s], 0) + "k",
      pages.mean_std([x["time_rl_s"] for x in s], 0),
      pages.per_seed(to_target, lambda t: f"{t:.0f}"),
      pages.mean_std(staleness, 2),
      pages.paired_difference(group, groups.get("sync", []), _final) if name != "sync" else "-"])


def render_page(results: list[dict], page_path: str) -> str:
  """B4's table and figure from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           "Sequences per decode step: completed sequences trained on per sampler decode "
           "step over the RL phase (vs sync: its ratio to the synchronous run of the same "
           "seed); RL s: wall time of the RL steps (evaluations and checkpoints excluded); "
           "s to sync's final: RL seconds before the first evaluation at or above the "
           "synchronous run's final accuracy in the same seed (per seed; - = never); "
           "staleness: mean updates between a token's sampling parameters and the update "
           "that trains on it; paired: final accuracy minus the synchronous run's, seed by "
           "seed.", "",
           pages.table_head(["setting", "seeds", "final accuracy", "its stderr",
                             "sequences per decode step", "vs sync", "RL tokens sampled",
                             "RL s", "s to sync's final (per seed)", "staleness",
                             "final minus sync's, paired"])]
  lines += [_row(name, groups[name], groups) for name in SETTINGS if name in groups]
  figure = os.path.splitext(page_path)[0] + ".png"
  if results:
    series = {name: groups.get(name, []) for name in SETTINGS}
    pages.plot_panels([("accuracy per RL token", "tokens", series),
                       ("accuracy per RL second", "seconds", series)], figure)
    lines += ["", f"![accuracy against tokens and seconds]({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
