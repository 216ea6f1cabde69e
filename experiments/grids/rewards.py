"""Denser and noisier rewards on the testbed: PURE's process-reward credit (min-form against
sum-form), a verifier with false negatives with and without a second opinion, and TTRL's
label-free majority vote, 3 seeds, each cell's RL phase from its seed's shared warm start
(experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/rewards.py --out=docs/results/rewards
    python -m experiments.grid --spec=experiments/grids/rewards.py --out=docs/results/rewards \
        --render --page=docs/benchmarks_rewards.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, held-out
greedy accuracy every 30 steps), all on the same finite pool of 256 train prompts (so a
prompt recurs about every 32 steps, and a majority vote can flip between visits):
- `grpo`: GRPO on the exact outcome reward (the labelled reference of every comparison).
- `rloo`: the outcome reward with RLOO's leave-one-out baseline (PURE's estimator family).
- `pure_min`, `pure_sum`: PURE's credit over running_sum's exact per-step rewards (+1 a
  right step, -1 a wrong one, judged from the state it reads), with the verifier's outcome
  reward beside them (PRM+VR, weight 1): the min-form value (the worst step ahead) and the
  sum-form (the mean step reward summed ahead).
- `fn20`, `fn40`: GRPO whose verifier fails 20% / 40% of the correct completions.
- `fn20_second`, `fn40_second`: the same verifier, every failure re-checked by the second
  opinion (running_sum's exact check), which finds every false negative: what it costs is
  its calls.
- `ttrl`: TTRL's majority vote over each group as the reward, no label read.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
TRAIN_POOL = 256

METHOD_FLAGS = {
    "grpo": {},
    "rloo": {"config.advantage.name": "rloo"},
    "pure_min": {"config.advantage.name": "pure_min"},
    "pure_sum": {"config.advantage.name": "pure_sum"},
    "fn20": {"config.reward.false_negative": 0.2},
    "fn40": {"config.reward.false_negative": 0.4},
    "fn20_second": {"config.reward.false_negative": 0.2, "config.reward.second_opinion": True},
    "fn40_second": {"config.reward.false_negative": 0.4, "config.reward.second_opinion": True},
    "ttrl": {"config.reward.kind": "majority_vote"},
}
METHODS = tuple(METHOD_FLAGS)

SPEC = {"cells": [{"name": f"{method}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START,
                             "config.task.train_pool": TRAIN_POOL,
                             **flags}}
                  for seed in SEEDS for method, flags in METHOD_FLAGS.items()]}


# --- The page ---

TARGET = 0.80  # held-out accuracy the methods race to (GRPO reaches it by its second evaluation)
FAMILIES = (("Process rewards (PURE)", ("grpo", "rloo", "pure_min", "pure_sum")),
            ("A verifier with false negatives, and its second opinion",
             ("grpo", "fn20", "fn40", "fn20_second", "fn40_second")),
            ("Label-free majority vote (TTRL)", ("grpo", "ttrl")))


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _step_mean(result: dict, field: str) -> float | None:
  return result["summary"]["rl_step_means"].get(field)


def _updates_to_target(result: dict) -> float | None:
  return pages.first_reaching(*pages.rl_curve(result, "updates"), TARGET)


def own_counters(name: str, group: list[dict]) -> str:
  """What the method's reward stage did per RL step (means over the steps)."""
  def mean(field, digits=2):
    return pages.mean_std([_step_mean(r, field) for r in group], digits)
  if name.startswith("pure"):
    return (f"{mean('process_steps')} steps per row, step reward {mean('process_reward_mean')}, "
            f"outcome reward {mean('reward_mean')}")
  if name.startswith("fn"):
    text = (f"trained reward {mean('trained_reward_mean')} (true {mean('reward_mean')}); "
            f"{mean('verifier_false_negatives', 1)} of {mean('verifier_correct_rows', 1)} "
            "correct rows failed")
    if name.endswith("second"):
      text += (f"; second opinion: {mean('second_opinion_calls', 1)} calls, "
               f"{mean('second_opinion_passes', 1)} passes, "
               f"{mean('second_opinion_s', 3)} s per step")
    return text
  if name == "ttrl":
    return (f"trained reward {mean('trained_reward_mean')} (true {mean('reward_mean')}); "
            f"majority right {mean('vote_accuracy')}, vote = truth on "
            f"{mean('vote_label_agreement')} of rows")
  return f"reward {mean('reward_mean')}"


def _row(name: str, group: list[dict], reference: dict[str, list[dict]]) -> str:
  s = [r["summary"] for r in group]
  cells = [pages.mean_std([x["final_accuracy"] for x in s]),
           pages.paired_difference(group, reference["grpo"], _final) if name != "grpo" else "-"]
  cells.append(pages.paired_difference(group, reference["rloo"], _final)
               if name.startswith("pure") else "-")
  cells += [pages.mean_std([x["accuracy_curve"][1]["accuracy"] for x in s]),
            pages.per_seed([_updates_to_target(r) for r in group], lambda u: f"{u:.0f}"),
            pages.mean_std([x["time_s"]["rollout"] for x in s], 0),
            own_counters(name, group)]
  return pages.table_row(name, group, cells)


def _interval_means(result: dict, field: str) -> list[float | None]:
  """The field's mean over each evaluation interval's RL steps (after the warm start)."""
  return [m.get(field) for m in result["summary"]["rl_step_means_between_evals"][1:]]


def vote_curves(group: list[dict]) -> list[str]:
  """TTRL's vote against the truth per 30-step interval: majority right, vote = truth,
  flips per revisited prompt (summed counts over the seeds)."""
  lines = [pages.table_head(["RL steps", "held-out accuracy", "majority right",
                             "vote = truth (rows)", "revisited prompts per step",
                             "flips right -> wrong", "flips wrong -> right", "flip rate"])]
  intervals = min(len(r["summary"]["rl_step_means_between_evals"]) - 1 for r in group)
  for i in range(intervals):
    def means(field):
      return [_interval_means(r, field)[i] for r in group]
    revisited = sum(v or 0 for v in means("vote_revisited"))
    down = sum(v or 0 for v in means("vote_flips_right_to_wrong"))
    up = sum(v or 0 for v in means("vote_flips_wrong_to_right"))
    accuracy = [r["summary"]["accuracy_curve"][i + 1]["accuracy"] for r in group]
    lines.append("| " + " | ".join([
        f"{30 * i + 1}-{30 * (i + 1)}", pages.mean_std(accuracy),
        pages.mean_std(means("vote_accuracy")), pages.mean_std(means("vote_label_agreement")),
        pages.mean_std(means("vote_revisited"), 2),
        pages.mean_std(means("vote_flips_right_to_wrong"), 3),
        pages.mean_std(means("vote_flips_wrong_to_right"), 3),
        f"{(down + up) / revisited:.3f}" if revisited else "-"]) + " |")
  return lines


def render_page(results: list[dict], page_path: str) -> str:
  """The rewards grid's tables and figure from the finished cells' results (experiments.grid)."""
  groups = pages.by_setting(results)
  reference = {name: groups.get(name, []) for name in ("grpo", "rloo")}
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           f"Paired: final held-out accuracy minus GRPO's (and, for PURE, minus RLOO's, its "
           f"estimator family), seed by seed; updates to {TARGET}: optimiser updates before "
           f"the first held-out evaluation at or above {TARGET} (per seed; evaluations every "
           "30 updates; - = never); rollout s: the RL phase's time sampling and scoring (the "
           "second opinion's calls included); the last column is what the reward stage did "
           "per step (means over the 120 RL steps and the seeds)."]
  for title, names in FAMILIES:
    present = [n for n in names if n in groups]
    if not present:
      continue
    lines += ["", f"**{title}**", "",
              pages.table_head(["cell", "seeds", "final accuracy", "minus GRPO's, paired",
                                "minus RLOO's, paired", "accuracy after 30 updates",
                                f"updates to {TARGET}", "rollout s",
                                "per step"])]
    lines += [_row(name, groups[name], reference) for name in present]
  if groups.get("ttrl"):
    lines += ["", "**TTRL's vote against the truth, per evaluation interval** (means over "
              "the seeds; flip rate: the seeds' summed flips per summed revisits)", ""]
    lines += vote_curves(groups["ttrl"])
  stem = os.path.splitext(page_path)[0]
  if results:
    pages.plot_panels([(title, "updates", {n: groups.get(n, []) for n in names})
                       for title, names in FAMILIES], stem + ".png")
    lines += ["", f"![held-out accuracy per update, by family]({os.path.basename(stem)}.png)"]
  return "\n".join(lines) + "\n"
