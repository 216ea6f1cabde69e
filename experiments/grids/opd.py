"""On-policy distillation on the testbed: pure OPD (each objective), GRPO + OPD, and OPD
under simulated staleness, 3 seeds, each cell's RL phase from its seed's shared warm start
with the teacher of experiments/grids/warm_starts.py (the seed-0 warm start trained on a
demonstrator that never slips).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/opd.py --out=docs/results/opd
    python -m experiments.grid --spec=experiments/grids/opd.py --out=docs/results/opd \\
        --render --page=docs/distillation.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions; held-out
greedy accuracy every 10 steps, so tokens-to-accuracy has that resolution):
- `grpo`: GRPO alone (the baseline: the default run's RL phase).
- `opd_<objective>`: pure OPD (config.distill.with_reward = False, coef 1): reverse_kl
  (exact), k1 (sampled, as per-token advantages), forward_kl_topk (top 16).
- `mix_c<coef>`: GRPO + coef * reverse KL, coef in {0.1, 1}.
- `stale_<objective>_k<k>`: pure OPD with reverse_kl or forward_kl_topk at simulated
  staleness k in {8, 32} updates (k = 0 is `opd_<objective>`): AsyncOPD's claim that the
  forward KL tolerates stale samples and the reverse KL does not.
- `lr1e-3_<grpo | opd_reverse_kl>` (a follow-up, added after the first seed): both at 4x the
  default learning rate (1e-3), whether the dense signal lets OPD take larger steps than
  GRPO can.
Cells run in that order (every seed of one block before the next), so a grid stopped
midway has whole comparisons.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
TEACHER = "runs/warm/runs/teacher"
EVAL_EVERY = 10
TARGET = 0.80  # held-out accuracy the token counts are measured to
PURE = ("reverse_kl", "k1", "forward_kl_topk")
COEFS = (0.1, 1.0)
STALENESS = (8, 32)


def _cell(name: str, seed: int, flags: dict) -> dict:
  return {"name": f"{name}_s{seed}", "module": "experiments.train", "seed": seed,
          "flags": {"config.warm_start.init_from": WARM_START,
                    "config.eval.every": EVAL_EVERY, **flags}}


def _distill(objective: str, coef: float = 1.0, with_reward: bool = False) -> dict:
  return {"config.distill.teacher": TEACHER, "config.distill.objective": objective,
          "config.distill.coef": coef, "config.distill.with_reward": with_reward}


SETTINGS = ([("grpo", {})] + [(f"opd_{o}", _distill(o)) for o in PURE]
            + [(f"mix_c{c:g}", _distill("reverse_kl", c, True)) for c in COEFS]
            + [(f"stale_{o}_k{k}", {**_distill(o), "config.rl.staleness": k})
               for o in ("reverse_kl", "forward_kl_topk") for k in STALENESS]
            + [(f"lr1e-3_{name}", {**flags, "config.rl.learning_rate": 1e-3})
               for name, flags in (("grpo", {}), ("opd_reverse_kl", _distill("reverse_kl")))])
_BLOCKS = (("grpo", "opd_"), ("mix_",), ("stale_",), ("lr1e-3_",))
SPEC = {"cells": [_cell(name, seed, flags) for block in _BLOCKS for seed in SEEDS
                  for name, flags in SETTINGS if name.startswith(block)]}


# --- The page ---

def _tokens_to_target(result: dict) -> float | None:
  return pages.first_reaching(*pages.rl_curve(result, "tokens"), TARGET)


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _reference(name: str) -> str:
  """The setting a row's paired column compares with: the same objective without staleness
  for the staleness rows, the same learning rate's GRPO for the lr rows, else GRPO."""
  if name.startswith("stale_"):
    return "opd_" + name.removeprefix("stale_").rsplit("_k", 1)[0]
  return "lr1e-3_grpo" if name.startswith("lr1e-3_") else "grpo"


def _row(name: str, group: list[dict], grpo: list[dict], reference: list[dict]) -> str:
  tokens = [_tokens_to_target(r) for r in group]
  base = {r["seed"]: _tokens_to_target(r) for r in grpo}
  # One entry per seed of `group`, None ('-') where either run never reached the target,
  # so that the per-seed column lines up with the seeds column.
  ratio = [t / base[r["seed"]] if t is not None and base.get(r["seed"]) else None
           for r, t in zip(group, tokens)]
  means = [r["summary"]["rl_step_means"] for r in group]
  kl = [m.get("distill_reverse_kl") for m in means]
  return pages.table_row(name, group, [
      pages.mean_std([_final(r) for r in group]),
      pages.per_seed([_final(r) for r in group], lambda v: f"{v:.3f}"),
      pages.paired_difference(group, reference, _final) if _reference(name) != name else "-",
      pages.per_seed(tokens, lambda t: f"{t / 1e3:.0f}k"),
      pages.per_seed(ratio, lambda x: f"{x:.2f}"),
      pages.mean_std([pages.area_under_curve(*pages.rl_curve(r)) for r in group]),
      pages.mean_std(kl), pages.mean_std([r["summary"]["time_rl_s"] for r in group], 0)])


def render_page(results: list[dict], page_path: str) -> str:
  """The distillation grid's table and figure from the finished cells' results."""
  groups = pages.by_setting(results)
  grpo = groups.get("grpo", [])
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           f"Tokens to {TARGET:.2f}: RL tokens sampled before the first evaluation at or "
           f"above {TARGET:.2f} held-out accuracy (evaluations every {EVAL_EVERY} steps; "
           "- = never); vs GRPO: that over GRPO's in the same seed; paired: final accuracy "
           "minus the reference's in the same seed (GRPO's; for a staleness row, the same "
           "objective's at k = 0; for a lr1e-3 row, GRPO's at lr 1e-3); area: mean accuracy "
           "over the RL phase; KL: the per-token reverse KL to the teacher, mean over the RL "
           "steps.", "",
           pages.table_head(["setting", "seeds", "final accuracy", "per seed",
                             "final minus reference's, paired", f"tokens to {TARGET:.2f}",
                             "vs GRPO", "area", "KL to teacher", "RL s"])]
  lines += [_row(name, groups[name], grpo, groups.get(_reference(name), []))
            for name, _ in SETTINGS if name in groups]
  figure = os.path.splitext(page_path)[0] + ".png"
  if results:
    pure = {name: groups.get(name, []) for name, _ in SETTINGS
            if name == "grpo" or name.startswith(("opd_", "mix_"))}
    stale = {name: groups.get(name, []) for name, _ in SETTINGS
             if name.startswith(("opd_reverse", "opd_forward", "stale_"))}
    pages.plot_panels([("pure and mixed OPD", "tokens", pure),
                       ("OPD under staleness", "updates", stale)], figure)
    lines += ["", f"![accuracy against tokens and updates]({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
