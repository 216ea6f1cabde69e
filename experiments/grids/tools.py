"""Tool use on the testbed: GRPO with running_sum's adder against the same GRPO without it,
3 seeds, each from its seed's shared warm start (experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/tools.py --out=docs/results/tools
    python -m experiments.grid --spec=experiments/grids/tools.py --out=docs/results/tools \\
        --render --page=docs/tools.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions at
temperature 1; held-out greedy accuracy every 30 steps):
- `grpo`: the default run's RL phase, no tool, from `warm_s<seed>` (the baseline).
- `tools`: the same with config.tools.name = 'adder', from `warm_tools_s<seed>`, whose
  demonstrations do each addition with the adder at probability TOOL_SHARE (exact) and by
  hand otherwise (with the teacher's carry slips), calling "?+5=" (the step, added to the
  running total: nothing copied; ",2:?+5=1234572"); max_new_tokens 160 fits nine tool
  additions. Sampling at temperature 1 calls the adder at about that share, and a call
  never slips: RL can make it the likely choice where a carry would slip. (Earlier tries
  with the call "?1234567+5=", which copies the previous total: at share 0.3 the warm
  start's calls were mostly malformed, copy errors after "?", and accuracy stayed flat;
  at share 0.5 RL solved 1-5 additions but lost the countdown on 6-8; docs/tools.md.)
Each seed's pair runs before the next seed's, so a grid stopped midway has whole pairs.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
TOOL_SHARE = 0.5
TOOL_NEW_TOKENS = 160
EVAL_EVERY = 30
LONG = 5  # the accuracy reported on problems of at least LONG additions
WARM_START = "runs/warm/runs/warm_s{seed}"
TOOL_WARM_START = "runs/warm/runs/warm_tools_s{seed}"
TOOL_FLAGS = {"config.tools.name": "adder", "config.task.difficulty.tool_share": TOOL_SHARE,
              "config.rollout.max_new_tokens": TOOL_NEW_TOKENS}


def _cell(name: str, seed: int, flags: dict) -> dict:
  return {"name": f"{name}_s{seed}", "module": "experiments.train", "seed": seed,
          "flags": {"config.eval.every": EVAL_EVERY, **flags}}


SETTINGS = (("grpo", {"config.warm_start.init_from": WARM_START}),
            ("tools", {"config.warm_start.init_from": TOOL_WARM_START, **TOOL_FLAGS}))
SPEC = {"cells": [_cell(name, seed, flags) for seed in SEEDS for name, flags in SETTINGS]}


# --- The page ---

def long_accuracy(by_size: dict, counts: dict, when: str = "final") -> float:
  """Held-out accuracy on problems of at least LONG additions: by-size accuracies `by_size`
  ({size: {when: accuracy}}) weighted by the held-out counts `counts` ({size: examples})."""
  sizes = [s for s in by_size if int(s) >= LONG]
  total = sum(counts[s] for s in sizes)
  return sum(by_size[s][when] * counts[s] for s in sizes) / total


def _counts(result: dict) -> dict:
  return {s: v["examples"] for s, v in result["summary"]["accuracy_by_size"].items()}


def _long(result: dict, when: str = "final") -> float:
  return long_accuracy(result["summary"]["accuracy_by_size"], _counts(result), when)


def _long_without_tools(result: dict) -> float | None:
  tools = result["summary"].get("tools")
  return None if tools is None else long_accuracy(tools["accuracy_by_size_no_tools"],
                                                  _counts(result))


def _tool_calls(result: dict, when: str) -> float | None:
  tools = result["summary"].get("tools")
  return None if tools is None else tools[f"{when}_tool_calls"]


def _rl_calls(result: dict, window: int) -> float | None:
  """RL rollouts' tool calls per rollout over the steps before evaluation `window` (1:
  the first EVAL_EVERY steps, -1: the last)."""
  windows = result["summary"]["rl_step_means_between_evals"]
  return windows[window].get("tool_calls_per_rollout") if len(windows) > 1 else None


def _row(name: str, group: list[dict], grpo: list[dict]) -> str:
  final = lambda r: r["summary"]["final_accuracy"]
  return pages.table_row(name, group, [
      pages.mean_std([r["summary"]["warm_start_accuracy"] for r in group]),
      pages.mean_std([final(r) for r in group]),
      pages.mean_std([_long(r, "warm_start") for r in group]),
      pages.mean_std([_long(r) for r in group]),
      pages.per_seed([_long(r) for r in group], lambda v: f"{v:.3f}"),
      pages.paired_difference(group, grpo, _long) if name != "grpo" else "-",
      pages.mean_std([_long_without_tools(r) for r in group]),
      pages.mean_std([_tool_calls(r, "warm_start") for r in group], 2),
      pages.mean_std([_tool_calls(r, "final") for r in group], 2),
      pages.mean_std([_rl_calls(r, 1) for r in group], 2),
      pages.mean_std([_rl_calls(r, -1) for r in group], 2),
      pages.mean_std([r["summary"]["time_rl_s"] for r in group], 0)])


def render_page(results: list[dict], page_path: str) -> str:
  """The tool grid's table and figure from the finished cells' results."""
  groups = pages.by_setting(results)
  grpo = groups.get("grpo", [])
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           f"k >= {LONG}: held-out greedy accuracy on the problems of {LONG} to 9 additions "
           "(the by-size accuracies weighted by their counts); paired: the tool run's minus "
           "GRPO's in the same seed; without the tool: the tool run's policy decoded with no "
           "environment (a call is answered by nobody and the policy writes on); calls: "
           "tool calls answered per held-out answer (greedy) at the warm start's end and at "
           "the end, and per RL rollout (temperature 1) over the first and the last "
           f"{EVAL_EVERY} RL steps.", "",
           pages.table_head(["setting", "seeds", "warm-start accuracy", "final accuracy",
                             f"warm start k >= {LONG}", f"final k >= {LONG}", "per seed",
                             "minus GRPO's, paired", f"final k >= {LONG} without the tool",
                             "held-out calls, warm start", "held-out calls, final",
                             "RL calls, first steps", "RL calls, last steps", "RL s"])]
  lines += [_row(name, groups[name], grpo) for name, _ in SETTINGS if name in groups]
  figure = os.path.splitext(page_path)[0] + ".png"
  if results:
    curves = {name: groups.get(name, []) for name, _ in SETTINGS}
    pages.plot_panels([("held-out accuracy", "updates", curves)], figure)
    lines += ["", f"![accuracy against updates]({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
