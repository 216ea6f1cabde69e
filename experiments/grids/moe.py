"""Rollout routing replay (R3) on the testbed's mixture-of-experts policy: replay off and on
at simulated staleness 0, 8 and 32 optimiser updates, 3 seeds, each cell's RL phase from its
seed's shared MoE warm start (experiments/grids/warm_starts.py's `warm_moe` cells).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/moe.py --out=docs/results/moe
    python -m experiments.grid --spec=experiments/grids/moe.py --out=docs/results/moe \
        --render --page=docs/moe.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, one
optimiser update each, held-out greedy accuracy every 30 steps; the policy `tiny2_moe`,
8 experts of width 256, top 2, in both layers):
- `plain_k<k>`: the trainer routes every token with its own router.
- `replay_k<k>`: the trainer runs the experts the sampler recorded (R3), weighted by its
  own router renormalised over them.
k is rl.staleness (step t samples with the parameters of step max(t - k, 0)). In float32
the sampler's routing equals the trainer's on the same parameters, so at k = 0 the record
is the trainer's own choice; staleness is what moves the routers apart on this testbed.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
STALENESS = (0, 8, 32)
WARM_START = "runs/warm/runs/warm_moe_s{seed}"  # experiments/grids/warm_starts.py's cells
MOE_FLAGS = {"config.model.preset": "tiny2_moe", "config.warm_start.init_from": WARM_START}

SPEC = {"cells": [{"name": f"{mode}_k{k}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {**MOE_FLAGS, "config.rl.staleness": k,
                             "config.moe.routing_replay": mode == "replay"}}
                  for seed in SEEDS for k in STALENESS for mode in ("plain", "replay")]}


# --- The page ---

def _row(name: str, group: list[dict], groups: dict[str, list[dict]]) -> str:
  s = [r["summary"] for r in group]
  mean = lambda field, digits=4: pages.mean_std([pages.step_mean(r, field) for r in group], digits)
  plain = groups.get(name.replace("replay", "plain"), [])
  cells = [pages.mean_std([x["final_accuracy"] for x in s]),
           pages.paired_difference(group, plain, pages.final_accuracy) if name.startswith("replay") else "-",
           mean("moe_routing_mismatch"), mean("behavior_train_kl", 5),
           mean("moe_unreplayed_kl", 5), mean("moe_expert_load_max_l0", 2),
           mean("moe_expert_load_max_l1", 2),
           pages.mean_std([x["time_s"]["rollout"] for x in s], 0)]
  return pages.table_row(name, group, cells)


def render_page(results: list[dict], page_path: str) -> str:
  """The MoE grid's table and figure from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           "Means over the 120 RL steps (the routing mismatch and the KLs at each batch's "
           "first update), then over the seeds. Paired: replay's final held-out accuracy "
           "minus plain routing's at the same staleness, seed by seed.", "",
           pages.table_head(["cell", "seeds", "final accuracy", "minus plain, paired",
                             "routing mismatch", "KL(sampler‖trainer)",
                             "KL without replay", "expert load max, layer 0",
                             "layer 1", "rollout s"])]
  names = [f"{mode}_k{k}" for k in STALENESS for mode in ("plain", "replay")]
  lines += [_row(name, groups[name], groups) for name in names if name in groups]
  if results:
    stem = os.path.splitext(page_path)[0]
    pages.plot_panels([(f"staleness {k}", "updates",
                        {mode: groups.get(f"{mode}_k{k}", []) for mode in ("plain", "replay")})
                       for k in STALENESS], stem + ".png")
    lines += ["", f"![held-out accuracy per update, replay off and on, by staleness]"
              f"({os.path.basename(stem)}.png)"]
  return "\n".join(lines) + "\n"
