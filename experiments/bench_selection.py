"""Benchmark B6 (docs/benchmarks.md): decoded tokens and wall time to a target accuracy, per
prompt-selection method (rl/selection.py), on the compact chain_sum task
(experiments/configs/chain_sum_compact.py, the default before the running_sum testbed).

    python -m experiments.bench_selection --seeds=0,1,2 --out=docs/benchmarks_selection.md

One supervised warm start (that config's, seed `--warm_start_seed`; cached in
`--warm_start_cache` so that seeds can run as parallel processes), then per seed and method a
GRPO run from the warm-started parameters and data cursor over the same finite prompt pool
(`--train_pool`), with a greedy held-out evaluation every `--eval_every` steps. The seed
sets the GRPO phase's RNG (sampling and selection draws); all methods of a seed share it. A method
reaches the target at its first evaluation with accuracy >= warm-start accuracy +
`--target_gain`; the tokens (completion tokens decoded, kept or discarded) and the
iteration wall time (evaluations excluded) spent until then are its cost. All methods run
the same number of GRPO steps, so final accuracies compare at equal steps.

Writes `<out>` (markdown table), `<out>.json` (every evaluation of every run) and
`<out minus .md>.png` (held-out accuracy against decoded tokens).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import ml_collections  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from experiments import train as launcher  # pylint: disable=g-import-not-at-top
from experiments.configs import chain_sum_compact  # pylint: disable=g-import-not-at-top
from models import transformer  # pylint: disable=g-import-not-at-top
from models.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top
from rl import evaluation  # pylint: disable=g-import-not-at-top
from rl import loop  # pylint: disable=g-import-not-at-top
from rl import selection  # pylint: disable=g-import-not-at-top
from rl import train  # pylint: disable=g-import-not-at-top
from rl.tasks import make_task  # pylint: disable=g-import-not-at-top

_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "GRPO-phase seeds (sampling, selection).")
_METHODS = flags.DEFINE_list("methods", ["uniform", "dynamic", "greso", "adaptive"],
                             "Methods to compare (keys of METHODS), uniform first.")
_WARM_SEED = flags.DEFINE_integer("warm_start_seed", 0, "Seed of parameters, task and warm start.")
_WARM = flags.DEFINE_integer("warm_start_steps", 300, "Supervised warm-start steps.")
_WARM_CACHE = flags.DEFINE_string("warm_start_cache", "", "Pickle of the warm-started state "
                                  "(read if present, else written); empty = no cache.")
_STEPS = flags.DEFINE_integer("rl_steps", 80, "GRPO steps per method.")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 16, "config.rollout.prompts_per_step.")
_GROUP = flags.DEFINE_integer("group_size", 8, "config.rollout.group_size.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 10, "GRPO steps between evaluations.")
_EVAL_SIZE = flags.DEFINE_integer("eval_size", 500, "Held-out items per evaluation.")
_POOL = flags.DEFINE_integer("train_pool", 512, "Finite GRPO prompt pool (config.task.train_pool).")
_GAIN = flags.DEFINE_float("target_gain", 0.05, "Target = warm-start accuracy + this.")
_LR = flags.DEFINE_float("rl_learning_rate", 0.0, "GRPO learning rate (0 = the config's).")
_OUT = flags.DEFINE_string("out", "docs/benchmarks_selection.md", "Markdown output path.")
_MERGE = flags.DEFINE_list("merge", [], "Instead of running: combine these JSON outputs of "
                           "earlier runs (e.g. one process per seed) into one table and plot.")

# Method name -> (selection.kind, overrides of config.selection.<block>.<field>).
METHODS = {
    "uniform": ("uniform", {}),
    "dynamic": ("dynamic", {}),
    "greso": ("greso", {}),
    "adaptive": ("adaptive", {"adaptive.score": "variance"}),
    "adaptive_beta": ("adaptive", {"adaptive.score": "beta"}),
}


def method_config(base: ml_collections.ConfigDict, name: str) -> ml_collections.FrozenConfigDict:
  kind, overrides = METHODS[name]
  config = ml_collections.ConfigDict(base.to_dict())
  config.kind = kind
  for path, value in overrides.items():
    block, field = path.split(".")
    config[block][field] = value
  return ml_collections.FrozenConfigDict(config)


def run_seed(seed: int, methods: list[str]) -> dict:
  """Warm start once, then each method's GRPO run; returns the records of this seed."""
  config = chain_sum_compact.get_config()
  config.seed = _WARM_SEED.value
  config.rollout.prompts_per_step, config.rollout.group_size = _PROMPTS.value, _GROUP.value
  if _LR.value:
    config.rl.learning_rate = _LR.value
  config.task.train_pool = _POOL.value
  config.task.eval_size = _EVAL_SIZE.value
  config.warm_start.steps = _WARM.value
  tokenizer = CharTokenizer()
  task = make_task(config.task.name, config.task.prompt_style, seed=config.seed,
                   eval_size=config.task.eval_size, **config.task.difficulty)
  model_config = launcher.build_model_config(config, tokenizer)
  eval_examples = task.examples("eval", config.task.eval_size)

  def accuracy(params):
    return evaluation.evaluate(params, eval_examples, task=task, tokenizer=tokenizer,
                               prompt_len=config.rollout.prompt_len,
                               max_new_tokens=config.rollout.max_new_tokens,
                               model_config=model_config,
                               batch_size=config.eval.batch_size).accuracy

  warm_ctx, warm_opt = launcher.make_context(config, task, tokenizer, model_config,
                                             launcher.WARM_START)
  rl_ctx, rl_opt = launcher.make_context(config, task, tokenizer, model_config, launcher.RL)
  if _WARM_CACHE.value and os.path.exists(_WARM_CACHE.value):
    with open(_WARM_CACHE.value, "rb") as f:
      warm = pickle.load(f)
  else:
    init_rng, loop_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    state = loop.LoopState(train=train.init_train_state(
        transformer.init_params(model_config, init_rng), warm_opt), rng=loop_rng)
    started = time.time()
    for _ in range(config.warm_start.steps):
      state, _ = loop.sft_iteration(state, warm_ctx)
    warm = dict(params=jax.device_get(state.train.params), data_cursor=state.data_cursor,
                wall_s=time.time() - started)
    warm["accuracy"] = accuracy(warm["params"])
    if _WARM_CACHE.value:  # written whole, then renamed: a parallel reader never sees half
      with open(_WARM_CACHE.value + ".tmp", "wb") as f:
        pickle.dump(warm, f)
      os.replace(_WARM_CACHE.value + ".tmp", _WARM_CACHE.value)
  warm_params, warm_acc = warm["params"], warm["accuracy"]
  print(f"warm start {warm['wall_s']:.0f} s, held-out accuracy {warm_acc:.3f}", flush=True)
  rl_rng = jax.random.PRNGKey(seed)

  runs, signals = {}, {}
  for name in methods:
    sel = method_config(config.selection, name)
    selection.check_config(sel, prompts_per_step=config.rollout.prompts_per_step,
                           group_size=config.rollout.group_size, pool_size=_POOL.value)
    ctx = dataclasses.replace(rl_ctx, selection=sel)  # shares the jitted train step
    run = loop.LoopState(
        train=train.init_train_state(jax.tree.map(jnp.asarray, warm_params), rl_opt),
        rng=rl_rng, selection=selection.init_state(_POOL.value, sel),
        data_cursor=warm["data_cursor"])
    # One untimed iteration on a copy compiles this method's sampler shapes before timing.
    loop.grpo_iteration(run.replace(train=train.init_train_state(
        jax.tree.map(jnp.asarray, warm_params), rl_opt)), ctx)
    evals = [dict(step=0, tokens=0, rollouts=0, wall_s=0.0, accuracy=warm_acc)]
    tokens = rollouts = 0
    wall = 0.0
    signal = dict(groups_decoded=0, informative_decoded=0, informative_trained=0, skipped=0,
                  informative_rows=0)
    for step in range(1, _STEPS.value + 1):
      tick = time.time()
      try:
        run, metrics = loop.grpo_iteration(run, ctx)
      except ValueError as error:  # dynamic sampling could not fill a batch: record, go on
        print(f"seed {seed} {name}: stopped at step {step}: {error}", flush=True)
        break
      jax.block_until_ready(run.train.params)
      wall += time.time() - tick
      tokens += int(metrics["decoded_tokens"])
      groups = metrics["rollouts"] / _GROUP.value
      signal["groups_decoded"] += groups
      signal["informative_decoded"] += metrics["informative_groups"] * groups
      signal["informative_trained"] += metrics["batch_informative_groups"] * _PROMPTS.value
      signal["skipped"] += metrics["prompts_skipped"]
      signal["informative_rows"] += metrics["informative_rows"]
      rollouts += int(metrics["rollouts"])
      if step % _EVAL_EVERY.value == 0 or step == _STEPS.value:
        evals.append(dict(step=step, tokens=tokens, rollouts=rollouts, wall_s=wall,
                          accuracy=accuracy(run.train.params)))
    runs[name] = evals
    per_1k = lambda count: 1e3 * count / max(tokens, 1)
    signals[name] = dict(signal, informative_trained_per_1k_tokens=per_1k(
        signal["informative_trained"]), informative_rows_per_1k_tokens=per_1k(
            signal["informative_rows"]))
    partial = dict(seed=seed, warm_accuracy=warm_acc, runs=runs, signals=signals)
    with open(_OUT.value + f".seed{seed}.partial.json", "w") as f:  # survives a later crash
      json.dump(partial, f)
    print(f"seed {seed} {name}: final accuracy {evals[-1]['accuracy']:.3f}, {tokens} tokens, "
          f"{wall:.0f} s", flush=True)
  return dict(seed=seed, warm_accuracy=warm_acc, warm_start_s=warm["wall_s"], runs=runs,
              signals=signals)


def first_reach(evals: list[dict], target: float) -> dict | None:
  return next((e for e in evals if e["step"] > 0 and e["accuracy"] >= target), None)


def summarise(results: list[dict], methods: list[str]) -> str:
  """The markdown table: per method, cost to target (each seed and mean) and final accuracy."""
  gain = _GAIN.value
  lines = [
      "| method | reached | decoded tokens to target (per seed) | token speed-up "
      "(uniform / method) | wall s to target (per seed) | wall speed-up | final accuracy (mean) |",
      "|---|---|---|---|---|---|---|"]
  base = {}
  for name in methods:
    reached, tokens, walls, finals = 0, [], [], []
    for r in results:
      hit = first_reach(r["runs"][name], r["warm_accuracy"] + gain)
      tokens.append(hit["tokens"] if hit else None)
      walls.append(hit["wall_s"] if hit else None)
      reached += hit is not None
      finals.append(r["runs"][name][-1]["accuracy"])
    if name == "uniform":
      base = dict(tokens=tokens, walls=walls)

    def ratio(key, values):
      pairs = [(b, v) for b, v in zip(base.get(key, []), values) if b and v]
      return f"{np.mean([b / v for b, v in pairs]):.2f}x" if pairs else "n/a"

    fmt = lambda xs, f: ", ".join("-" if x is None else f.format(x) for x in xs)
    lines.append(f"| {name} | {reached}/{len(results)} | {fmt(tokens, '{:,}')} | "
                 f"{ratio('tokens', tokens)} | {fmt(walls, '{:.0f}')} | {ratio('walls', walls)} | "
                 f"{np.mean(finals):.3f} ({fmt(finals, '{:.3f}')}) |")
  if all(name in r.get("signals", {}) for r in results for name in methods):
    lines += ["", "| method | informative groups per 1k decoded tokens (trained) | "
              "share of decoded groups informative | prompts skipped per seed | "
              "rows in informative groups per 1k decoded tokens |", "|---|---|---|---|---|"]
    for name in methods:
      sig = [r["signals"][name] for r in results]
      rows = ("n/a" if any("informative_rows_per_1k_tokens" not in x for x in sig) else
              f"{np.mean([x['informative_rows_per_1k_tokens'] for x in sig]):.1f}")
      lines.append(
          f"| {name} | {np.mean([x['informative_trained_per_1k_tokens'] for x in sig]):.2f} | "
          f"{np.mean([x['informative_decoded'] / max(x['groups_decoded'], 1) for x in sig]):.2f} | "
          f"{np.mean([x['skipped'] for x in sig]):.0f} | {rows} |")
  return "\n".join(lines)


def plot(results: list[dict], methods: list[str], path: str) -> None:
  fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6), squeeze=False)
  for ax, r in zip(axes[0], results):
    for name in methods:
      evals = r["runs"][name]
      ax.plot([e["tokens"] / 1e3 for e in evals], [e["accuracy"] for e in evals], "o-", ms=2.5,
              lw=1, label=name)
    ax.axhline(r["warm_accuracy"] + _GAIN.value, color="gray", ls="--", lw=0.8)
    ax.set(xlabel="decoded tokens (thousands)", ylabel="held-out exact match",
           title=f"seed {r['seed']}")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  methods = _METHODS.value
  unknown = sorted(set(methods) - set(METHODS))
  if unknown:
    raise ValueError(f"--methods has unknown {unknown}; known: {sorted(METHODS)}.")
  stem = _OUT.value[:-3] if _OUT.value.endswith(".md") else _OUT.value
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  if _MERGE.value:
    by_seed, run_flags = {}, []  # files may hold different methods of the same seed
    for path in _MERGE.value:
      with open(path) as f:
        loaded = json.load(f)
      run_flags.append(loaded["flags"])
      for r in loaded["results"]:
        merged = by_seed.setdefault(r["seed"], dict(r, runs={}, signals={}))
        merged["runs"].update(r["runs"])
        merged["signals"].update(r.get("signals", {}))
    results = [by_seed[k] for k in sorted(by_seed)]
    methods = [m for m in METHODS if all(m in r["runs"] for r in results)]
  else:
    results = [run_seed(int(s), methods) for s in _SEEDS.value]
    run_flags = [{k: flags.FLAGS[k].value for k in (
        "seeds", "methods", "warm_start_seed", "warm_start_steps", "rl_steps", "prompts_per_step",
        "group_size", "eval_every", "eval_size", "train_pool", "target_gain",
        "rl_learning_rate")}]
  with open(stem + ".json", "w") as f:
    json.dump(dict(flags=run_flags[0] if len(run_flags) == 1 else run_flags, results=results),
              f, indent=1)
  plot(results, methods, stem + ".png")
  if "uniform" not in methods:
    print("No uniform runs: the table needs them as the reference; merge runs with --merge.")
    return
  table = summarise(results, methods)
  with open(_OUT.value, "w") as f:
    f.write(table + "\n")
  print(table)


if __name__ == "__main__":
  app.run(main)
