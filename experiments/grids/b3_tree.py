"""B3, tree rollouts on the testbed: independent sampling vs the three tree policies at an
equal number of leaves per prompt, 3 seeds, each cell's RL phase from its seed's shared
warm start (experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/b3_tree.py --out=docs/results/b3
    python -m experiments.grid --spec=experiments/grids/b3_tree.py --out=docs/results/b3 \
        --render --page=docs/benchmarks_tree.md

Cells (the default config otherwise: 120 RL steps of 8 prompts, 8 sequences per prompt,
GRPO, held-out greedy accuracy every 30 steps, the default):
- `independent`: 8 independent completions per prompt (the default run).
- `entropy` (TreeRL's EPTree): 4 chains, then one round forking at the 2 highest-entropy
  tokens into 2 branches each: 4 + 1 x 2 x 2 = 8 leaves.
- `segments` (TreePO): 2 chains, each live row forking into 2 every 8 tokens, twice:
  2 x 2^2 = 8 leaves. (The testbed's solutions are 21-101 tokens, median 21, so branching
  every 8 tokens shares the first 8 and 16 tokens of each chain.)
- `lookahead` (LATR): up to 8 leaves from 4 chains, branching into distinct top-2 tokens
  where the sampling entropy is at least 0.3 nats, children pruned when their 16-token
  lookahead window matches the parent's. The testbed needs both settings: the
  warm-started policy's entropy peaks at the carries, 0.33-0.69 nats for the teacher's
  slip rates of 0.9-0.55 (at the default 1 nat it never branches), and a carry changes one
  digit, whose continuation matches the parent's for several tokens (the default 2-token
  window pruned nearly every child; 8 tokens still most). In a 2-step check from seed 0's
  warm start it made 5-7 leaves per prompt of the 8 allowed: the table reports leaves per
  prompt.
Tree cells use the tree advantage `treerl` (value gaps over the tree / sqrt(leaves)), the
tree policies' own estimator; the independent cells use GRPO's group advantage.
"""

import os

from experiments.configs import default
from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
TREES = {
    "entropy": {"config.rollout.tree.policy": "entropy", "config.rollout.tree.init_chains": 4,
                "config.rollout.tree.fork_points": 2, "config.rollout.tree.branches": 2,
                "config.rollout.tree.rounds": 1},
    "segments": {"config.rollout.tree.policy": "segments", "config.rollout.tree.init_chains": 2,
                 "config.rollout.tree.branches": 2, "config.rollout.tree.segment_len": 8,
                 "config.rollout.tree.max_depth": 2},
    "lookahead": {"config.rollout.tree.policy": "lookahead", "config.rollout.tree.init_chains": 4,
                  "config.rollout.tree.leaves": 8, "config.rollout.tree.top_k": 2,
                  "config.rollout.tree.min_entropy": 0.3,
                  "config.rollout.tree.lookahead_steps": 16},
}
METHODS = ("independent",) + tuple(TREES)


def _cells(seed: int) -> list[dict]:
  cells = [{"name": f"independent_s{seed}", "module": "experiments.train", "seed": seed,
            "flags": {"config.warm_start.init_from": WARM_START}}]
  for name, tree in TREES.items():
    cells.append({"name": f"{name}_s{seed}", "module": "experiments.train", "seed": seed,
                  "flags": {"config.warm_start.init_from": WARM_START,
                            "config.rollout.kind": "tree", **tree}})
  return cells


SPEC = {"cells": [cell for seed in SEEDS for cell in _cells(seed)]}


# --- The page ---

def leaves_per_prompt(result: dict) -> float:
  """Sequences trained on per prompt (a tree's leaves; independent sampling's group)."""
  means = result["summary"]["rl_step_means"]
  rows = means.get("leaves", means.get("rollouts"))
  prompts = result["flags"].get("config.rollout.prompts_per_step",
                                default.get_config().rollout.prompts_per_step)
  return rows / int(prompts)


def tokens_per_leaf(result: dict) -> float:
  """Decoded tokens per sequence trained on: a tree decodes each shared node once."""
  means = result["summary"]["rl_step_means"]
  if "decoded_tokens_per_leaf" in means:
    return means["decoded_tokens_per_leaf"]
  return means["decoded_tokens"] / means["rollouts"]


def _target(groups: dict[str, list[dict]], seed: int) -> float | None:
  """Independent sampling's final accuracy in this seed: the accuracy a tree must reach."""
  base = [r for r in groups.get("independent", []) if r["seed"] == seed]
  return base[0]["summary"]["final_accuracy"] if base else None


def _tokens_to_target(result: dict, groups: dict[str, list[dict]]) -> float | None:
  target = _target(groups, result["seed"])
  if target is None:
    return None
  return pages.first_reaching(*pages.rl_curve(result, "tokens"), target)


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _row(name: str, group: list[dict], groups: dict[str, list[dict]]) -> str:
  s = [r["summary"] for r in group]
  independent = {r["seed"]: tokens_per_leaf(r) for r in groups.get("independent", [])}
  ratio = [tokens_per_leaf(r) / independent[r["seed"]] for r in group
           if r["seed"] in independent]
  reached = [_tokens_to_target(r, groups) for r in group]
  return pages.table_row(name, group, [
      pages.mean_std([x["final_accuracy"] for x in s]),
      pages.mean_std([leaves_per_prompt(r) for r in group], 1),
      pages.mean_std([tokens_per_leaf(r) for r in group], 1),
      pages.mean_std(ratio, 2),
      pages.mean_std([x["tokens"]["sampled"] / 1e3 for x in s], 0) + "k",
      pages.per_seed(reached, lambda t: f"{t / 1e3:.0f}k"),
      pages.mean_std([x["time_rl_s"] for x in s], 0),
      pages.mean_std([x["time_s"]["rollout"] for x in s], 0),
      pages.paired_difference(group, groups.get("independent", []), _final)
      if name != "independent" else "-"])


def render_page(results: list[dict], page_path: str) -> str:
  """B3's table and figure from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           "Tokens per leaf: decoded tokens per trained sequence (RL step means); vs "
           "independent: that over independent sampling's in the same seed; tokens to "
           "target: RL tokens sampled before the first evaluation at or above independent "
           "sampling's final accuracy in the same seed (per seed; - = never reached); RL "
           "seconds: wall time of the RL steps, and of their rollouts; paired: final accuracy "
           "minus independent sampling's, seed by seed.", "",
           pages.table_head(["method", "seeds", "final accuracy", "leaves per prompt",
                             "tokens per leaf", "vs independent", "RL tokens sampled",
                             "tokens to target (per seed)", "RL s", "rollout s",
                             "final minus independent's, paired"])]
  lines += [_row(name, groups[name], groups) for name in METHODS if name in groups]
  figure = os.path.splitext(page_path)[0] + ".png"
  if results:
    series = {name: groups.get(name, []) for name in METHODS}
    pages.plot_panels([("accuracy per RL token", "tokens", series),
                       ("accuracy per update", "updates", series),
                       ("accuracy per RL second", "seconds", series)], figure)
    lines += ["", f"![accuracy against tokens, updates and seconds]({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
