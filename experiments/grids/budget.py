"""Fewer tokens for the same learning, on the testbed: uniform GRPO against PODS
max-variance down-sampling, NAT token subsampling (random prefix cut and uniform random
tokens), AR3PO's adaptive rollout with response reuse and arrol's learned pruning, 3 seeds, each cell's RL phase from its seed's shared warm start
(experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/budget.py --out=docs/results/budget
    python -m experiments.grid --spec=experiments/grids/budget.py --out=docs/results/budget \
        --render --page=docs/benchmarks_budget.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, GRPO,
held-out greedy accuracy every 30 steps), all on the same finite pool of 256 train
prompts (`uniform` has the selection grid's (B6) flags; its numbers differ from B6's,
which ran from warm starts trained by older code), with the default train
length buckets (a batch is trained at 24 or 48 completion slots when its longest row fits,
else at all 101; trimming changes no number, only the time; the shared warm starts were
trained with them):
- `uniform`: plain GRPO, 8 rollouts of each of the next 8 prompts.
- `pods`: 16 rollouts of each prompt, trained on the 8 with the largest reward variance
  (PODS, arXiv 2504.13818): twice the sampling, the same update.
- `nat_rpc`: NAT's random prefix cut (arXiv 2603.06619), half the completion tokens in
  expectation, one cut per batch, Horvitz-Thompson reweighted: the same sampling, a shorter
  update.
- `nat_urs`: NAT's uniform random tokens, half in expectation: the estimator without the
  shorter update.
- `ar3po`: AR3PO (arXiv 2509.25808): 4 rollouts of each prompt, 4 more only for the
  prompts with no exact answer yet, and a prompt's earlier exact response reused in a group
  left all wrong (the pool makes prompts recur about 3.75 times, so there is something to
  reuse).
- `uniform_hard`, `ar3po_hard`: the hard setting (HARD_FLAGS, below), where AR3PO's
  response reuse has all-wrong groups to act on.
- `arrol`: arrol's online pruning (arXiv 2603.24840): 8 rollouts of each prompt start, and
  after 12 tokens the quality head keeps 4 (its 2 most and 2 least promising), which decode
  to the end and are trained: fewer tokens sampled and half the rows trained per update.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
TRAIN_POOL = 256
ARROL_PREFIX = 12  # tokens before the head decides: the first two or three ",k:state" steps

METHOD_FLAGS = {
    "uniform": {},
    "pods": {"config.selection.kind": "pods", "config.selection.pods.rollouts": 16},
    "nat_rpc": {"config.loss.token_subsample": "rpc", "config.loss.token_keep": 0.5},
    "nat_urs": {"config.loss.token_subsample": "urs", "config.loss.token_keep": 0.5},
    "ar3po": {"config.selection.kind": "ar3po", "config.selection.ar3po.stages": 2},
    "arrol": {"config.rollout.kind": "pruned", "config.rollout.group_size": 4,
              "config.rollout.pruning.candidates": 8,
              "config.rollout.pruning.prefix_tokens": ARROL_PREFIX},
}
METHODS = tuple(METHOD_FLAGS)

# AR3PO's reuse needs groups that stay all wrong after every stage, for prompts solved on an
# earlier visit: long problems early in RL. The hard setting trains on k >= 5 additions
# only (61-101 tokens), from its own warm starts (experiments/grids/warm_starts.py's
# `warm_hard` cells: 300 supervised steps on those problems), for 60 updates.
HARD_FLAGS = {"config.task.difficulty.min_steps": 5, "config.warm_start.steps": 300}
HARD_WARM_START = "runs/warm/runs/warm_hard_s{seed}"
HARD_METHODS = ("uniform", "ar3po")

SPEC = {"cells": [{"name": f"{method}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START,
                             "config.task.train_pool": TRAIN_POOL,
                             **flags}}
                  for seed in SEEDS for method, flags in METHOD_FLAGS.items()]
         + [{"name": f"{method}_hard_s{seed}", "module": "experiments.train", "seed": seed,
             "flags": {"config.warm_start.init_from": HARD_WARM_START,
                       "config.task.train_pool": TRAIN_POOL, "config.rl.steps": 60,
                       **HARD_FLAGS, **METHOD_FLAGS[method]}}
            for seed in SEEDS for method in HARD_METHODS]}


# --- The page ---

TARGET = 0.80  # held-out accuracy the methods race to (uniform GRPO ends near 0.87)


def _to_target(result: dict, axis: str) -> float | None:
  return pages.first_reaching(*pages.rl_curve(result, axis), TARGET)


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _mean_step(result: dict, field: str) -> float | None:
  return result["summary"]["rl_step_means"].get(field)


def own_counters(name: str, group: list[dict]) -> str:
  """What the method does per RL step, from its cells' step means: PODS's rows sampled,
  NAT's kept share of tokens, AR3PO's rows sampled and responses reused."""
  def mean(field):
    return pages.mean_std([_mean_step(r, field) for r in group], 2)
  if name in ("nat_rpc", "nat_urs"):
    return f"kept share {mean('token_subsample_kept_fraction')}"
  if name in ("ar3po", "ar3po_hard"):
    return (f"{mean('rollouts')} rows sampled, {mean('reused_responses')} reused, "
            f"informative groups {mean('batch_informative_groups')}")
  if name == "arrol":
    return (f"{mean('rollouts')} rows started, {mean('pruned_rows')} pruned; head accuracy "
            f"{mean('head_accuracy')}")
  return (f"{mean('rollouts')} rows sampled, informative groups "
          f"{mean('batch_informative_groups')}")


def _row(name: str, group: list[dict], uniform: list[dict]) -> str:
  s = [r["summary"] for r in group]
  return pages.table_row(name, group, [
      pages.mean_std([x["final_accuracy"] for x in s]),
      pages.paired_difference(group, uniform, _final) if not name.startswith("uniform")
      else "-",
      pages.mean_std([x["tokens"]["sampled"] / 1e3 for x in s], 0) + "k",
      pages.mean_std([x["tokens"]["trained"] / 1e3 for x in s], 0) + "k",
      pages.per_seed([_to_target(r, "tokens") for r in group], lambda t: f"{t / 1e3:.0f}k"),
      pages.per_seed([_to_target(r, "updates") for r in group], lambda u: f"{u:.0f}"),
      pages.per_seed([_to_target(r, "seconds") for r in group], lambda t: f"{t:.0f}"),
      pages.mean_std([x["time_s"]["rollout"] for x in s], 0),
      pages.mean_std([x["time_s"]["train"] for x in s], 0),
      own_counters(name, group)])


def render_page(results: list[dict], page_path: str) -> str:
  """The budget grid's table and figure from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  uniform = groups.get("uniform", [])
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           f"To {TARGET}: RL tokens sampled, optimiser updates and RL wall seconds before the "
           f"first held-out evaluation at or above {TARGET} (per seed; - = never); paired: "
           "final accuracy minus uniform GRPO's, seed by seed; rollout s and train s: the RL "
           "phase's time sampling and scoring, and in train steps; the last column is what "
           "the method did per step (means over the RL steps).", "",
           pages.table_head(["method", "seeds", "final accuracy", "minus uniform's, paired",
                             "RL tokens sampled", "tokens trained", "tokens to 0.80",
                             "updates to 0.80", "seconds to 0.80", "rollout s", "train s",
                             "per step"])]
  lines += [_row(name, groups[name], uniform) for name in METHODS if name in groups]
  hard_uniform = groups.get("uniform_hard", [])
  hard = [f"{name}_hard" for name in HARD_METHODS if f"{name}_hard" in groups]
  if hard:
    lines += ["", "The hard setting (k >= 5 additions only, its own warm starts, 60 updates; "
              "tokens, updates and seconds to 0.80 rarely apply):", "",
              pages.table_head(["method", "seeds", "final accuracy",
                                "minus uniform's, paired", "RL tokens sampled",
                                "tokens trained", "tokens to 0.80", "updates to 0.80",
                                "seconds to 0.80", "rollout s", "train s", "per step"])]
    lines += [_row(name, groups[name], hard_uniform) for name in hard]
  stem = os.path.splitext(page_path)[0]
  if results:
    series = {name: groups.get(name, []) for name in METHODS}
    pages.plot_panels([("accuracy per update", "updates", series),
                       ("accuracy per RL token sampled", "tokens", series),
                       ("accuracy per RL second", "seconds", series)], stem + ".png")
    lines += ["", f"![accuracy against updates, tokens and seconds]({os.path.basename(stem)}"
              ".png)"]
  return "\n".join(lines) + "\n"
