"""Speculative rollouts on the testbed: plain decoding vs model-free drafts (prompt lookup,
and prompt lookup + the group's text), 3 seeds, each cell's RL phase from its seed's
shared warm start (experiments/grids/warm_starts.py).

    python -m experiments.grid --spec=experiments/grids/warm_starts.py --out=runs/warm
    python -m experiments.grid --spec=experiments/grids/speculative.py --out=docs/results/spec
    python -m experiments.grid --spec=experiments/grids/speculative.py \\
        --out=docs/results/spec --render --page=docs/speculative.md

Cells (the default config otherwise: 120 RL steps of 8 prompts x 8 completions, GRPO):
- `plain`: the phased, compacting decode loop (sampling/sampler.py).
- `lookup_k<k>`: speculative decoding, k draft tokens per forward from the row's own
  prompt and text (n-gram lookup, n <= 3).
- `lookup_group_k4`: the same, with the siblings' text (the other completions of the same
  prompt) searched when the row's own text has no match.
- `plain_pool<P>`, `history_k4_pool<P>`: SPEC-RL's draft, the prompt's completion from its
  previous visit, needs prompts that come back: both cycle over a finite pool of P train
  prompts (task.train_pool; 120 steps x 8 prompts visit each of P = 128 about 7.5 times),
  and the history cell is compared with plain decoding on the same pool. Its sources are
  the history, then prompt lookup where the history has no match.
Speculative decoding draws from the same distribution as plain decoding, so the
accuracy columns should agree within noise; what it changes is how many target forwards
(and seconds) a step's sampling costs.
"""

import os

from experiments.grids import pages

SEEDS = (0, 1, 2)
WARM_START = "runs/warm/runs/warm_s{seed}"  # experiments/grids/warm_starts.py's cells
LOOKUP = "('prompt_lookup',)"
POOL = 128
SETTINGS = {
    "plain": {},
    "lookup_k2": {"config.rollout.speculative.tokens": 2,
                  "config.rollout.speculative.sources": LOOKUP},
    "lookup_k4": {"config.rollout.speculative.tokens": 4,
                  "config.rollout.speculative.sources": LOOKUP},
    "lookup_group_k4": {"config.rollout.speculative.tokens": 4,
                        "config.rollout.speculative.sources": "('prompt_lookup', 'group')"},
    f"plain_pool{POOL}": {"config.task.train_pool": POOL},
    f"history_k4_pool{POOL}": {"config.task.train_pool": POOL,
                               "config.rollout.speculative.tokens": 4,
                               "config.rollout.speculative.sources": "('history', 'prompt_lookup')"},
}
# The plain decoding each setting is compared with (its prompts' distribution).
BASELINE = {name: f"plain_pool{POOL}" if "pool" in name else "plain" for name in SETTINGS}

SPEC = {"cells": [{"name": f"{name}_s{seed}", "module": "experiments.train", "seed": seed,
                   "flags": {"config.warm_start.init_from": WARM_START, **flags}}
                  for seed in SEEDS for name, flags in SETTINGS.items()]}


# --- The page ---

def _sample_s(result: dict) -> float:
  return result["summary"]["time_sample_median_s"]


def _final(result: dict) -> float:
  return result["summary"]["final_accuracy"]


def _means(result: dict) -> dict:
  return result["summary"]["rl_step_means"]


def _acceptance(result: dict, source: str = "") -> float | None:
  """Accepted / drafted draft tokens over the RL steps (of `source`; "" = all): the ratio
  of the step means, so steps that drafted nothing weigh nothing; None for a result
  recorded without the counts."""
  suffix = f"_{source}" if source else ""
  means = _means(result)
  if f"spec_accepted{suffix}" not in means:
    return None
  return means[f"spec_accepted{suffix}"] / max(means[f"spec_drafted{suffix}"], 1e-9)


def _by_source(group: list[dict]) -> str:
  """Each draft source's acceptance (mean over the seeds) and its share of the drafts."""
  parts = []
  for source in ("history", "prompt_lookup", "group"):
    drafted = [_means(r).get(f"spec_drafted_{source}", 0.0) for r in group]
    accepted = [_acceptance(r, source) for r in group]
    if not any(drafted) or None in accepted:
      continue
    total = [_means(r)["spec_drafted"] for r in group]
    parts.append(f"{source} {sum(accepted) / len(accepted):.3f} "
                 f"({sum(drafted) / max(sum(total), 1e-9):.0%} of drafts)")
  return "; ".join(parts) or "-"


def _row(name: str, group: list[dict], groups: dict[str, list[dict]]) -> str:
  baseline = groups.get(BASELINE[name], [])
  plain = {r["seed"]: r for r in baseline}
  speedup = [_sample_s(plain[r["seed"]]) / _sample_s(r) for r in group if r["seed"] in plain]
  spec = not name.startswith("plain")
  return pages.table_row(name, group, [
      pages.mean_std([_final(r) for r in group]),
      pages.paired_difference(group, baseline, _final) if spec else "-",
      pages.mean_std([_sample_s(r) for r in group], 3),
      pages.mean_std(speedup, 2) if spec else "-",
      pages.mean_std([_acceptance(r) for r in group], 3) if spec else "-",
      _by_source(group) if spec else "-",
      pages.mean_std([_means(r).get("spec_forwards_per_token", 1.0) for r in group], 3),
      pages.mean_std([_means(r)["completion_len"] for r in group], 1),
      pages.mean_std([r["summary"]["time_rl_s"] for r in group], 0)])


def render_page(results: list[dict], page_path: str) -> str:
  """The speculative grid's table and figure from the finished cells (experiments.grid)."""
  groups = pages.by_setting(results)
  lines = [pages.provenance(results, len(SPEC["cells"])), "",
           "Final accuracy: held-out greedy exact match after 120 RL steps; paired: minus "
           "plain decoding's, seed by seed; sample s / step: the median RL step's sampling "
           "seconds (compilation excluded); speed-up: plain's over this setting's, same "
           "seed (the pool cells: plain decoding on the same pool); acceptance: accepted / "
           "verified draft tokens, overall and by source (with each source's share of the "
           "drafted tokens); forwards / token: target forwards per generated token (plain: "
           "1); RL s: wall time of the RL steps.", "",
           pages.table_head(["setting", "seeds", "final accuracy", "minus plain's, paired",
                             "sample s / step", "speed-up", "acceptance", "by source",
                             "forwards / token", "completion length", "RL s"])]
  lines += [_row(name, groups[name], groups) for name in SETTINGS if name in groups]
  figure = os.path.splitext(page_path)[0] + ".png"
  if results:
    series = {name: groups.get(name, []) for name in SETTINGS}
    pages.plot_panels([("accuracy per RL token", "tokens", series),
                       ("accuracy per RL second", "seconds", series)], figure)
    lines += ["", f"![accuracy against tokens and seconds]({os.path.basename(figure)})"]
  return "\n".join(lines) + "\n"
