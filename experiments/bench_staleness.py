"""Benchmark B5 (docs/benchmarks.md): robustness of objectives to simulated staleness.

For each seed: one supervised warm start (shared by every cell of that seed), then for each
objective and staleness k a GRPO run that samples with the parameters of k iterations
earlier (`rl.loop` simulated staleness). Held-out greedy accuracy is evaluated along the
way. Writes to --out: results.json (every curve, rewritten after each run, so a killed
benchmark keeps what it finished), table.md, and plot.png (accuracy vs k per objective;
grad norm and masked/clipped-token fraction over training at the largest k).

    PYTHONPATH=. python -m experiments.bench_staleness --out=runs/bench_staleness \\
        --objectives=grpo,decoupled,m2po,sat,vcpo --staleness=0,4,16,64,256 --seeds=0,1,2

Scores per cell: final accuracy (mean of the last two evaluations), area under the
accuracy curve (mean over evaluations, warm start included), and collapse (final accuracy
below the warm start's by more than --collapse_margin). Ratios are to k = 0 of the same
objective and seed set. Runs are sequential in one process; compiled functions are shared.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app
from absl import flags
import flax.serialization
import jax
import jax.numpy as jnp
import matplotlib
import ml_collections
import numpy as np

from experiments import train as launcher
from experiments.configs import chain_sum_compact
from models import transformer
from models.tokenizer import CharTokenizer
from rl import evaluation
from rl import loop
from rl import train
from rl.tasks import make_task

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

_OUT = flags.DEFINE_string("out", "runs/bench_staleness", "Output folder.")
_OBJECTIVES = flags.DEFINE_list("objectives", "grpo,decoupled,m2po,sat,vcpo",
                                "config.loss.name values.")
_STALENESS = flags.DEFINE_list("staleness", "0,4,16,64,256", "Simulated staleness values k.")
_SEEDS = flags.DEFINE_list("seeds", "0,1,2", "Seeds (parameters, data order, sampling).")
_STEPS = flags.DEFINE_integer("steps", 50, "GRPO steps per run.")
_WARM = flags.DEFINE_integer("warm_start_steps", 300, "Supervised warm-start steps per seed.")
_WARM_LR = flags.DEFINE_float("warm_start_lr", 1e-3, "Peak warm-start learning rate.")
_LR = flags.DEFINE_float("learning_rate", 3e-5, "GRPO learning rate (Adam).")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 8, "Prompts per GRPO step.")
_GROUP = flags.DEFINE_integer("group_size", 8, "Completions per prompt.")
_MINIBATCHES = flags.DEFINE_integer(
    "num_minibatches", 1,
    "Optimiser updates per rollout batch and epoch (config.rl.num_minibatches).")
_EPOCHS = flags.DEFINE_integer("ppo_epochs", 1, "Passes over each batch (config.rl.ppo_epochs).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 10, "GRPO steps between evaluations.")
_EVAL_SIZE = flags.DEFINE_integer("eval_size", 512, "Held-out items per evaluation.")
_DIFFICULTY = flags.DEFINE_list(
    "difficulty", [], "Overrides of config.task.difficulty as name=int pairs, e.g. "
    "max_digits=1 (reasoning-gym chain_sum fields).")
_MARGIN = flags.DEFINE_float("collapse_margin", 0.02, "Collapse: final < warm start - margin.")
_REPORT_ONLY = flags.DEFINE_list(
    "report_only", [], "results.json files to merge; writes table.md, plot.png and a merged "
    "results.json to --out without running anything.")
_SHARE = flags.DEFINE_bool(
    "share_on_policy", True, "At k = 0, run the objectives that equal grpo on-policy only as "
    "grpo and record grpo's curves for them, marked shared_from (see same_as_grpo_on_policy).")


def same_as_grpo_on_policy(objective: str, updates_per_batch: int) -> bool:
  """Whether `objective` at k = 0 is the grpo objective (tests/test_objectives.py,
  tests/test_train.py::test_decoupled_equals_grpo_on_policy_over_minibatches).

  decoupled: on-policy the proximal policy (the batch's starting parameters) is the
  behaviour policy, so its IS weight is 1 and it clips like PPO, whatever the number of
  updates per batch. sat: its kernel factor is 1 only while logp = behav, i.e. with one
  update per batch.
  """
  return objective == "decoupled" or (objective == "sat" and updates_per_batch == 1)


def bench_config(seed: int, objective: str, staleness: int) -> ml_collections.ConfigDict:
  """The compact chain_sum run's config (configs/chain_sum_compact.py) with the benchmark's
  sizes."""
  c = chain_sum_compact.get_config()
  c.seed = seed
  c.warm_start.steps = _WARM.value
  c.warm_start.learning_rate = _WARM_LR.value
  c.rl.steps = _STEPS.value
  c.rl.learning_rate = _LR.value
  c.rl.staleness = staleness
  c.rollout.prompts_per_step = _PROMPTS.value
  c.rollout.group_size = _GROUP.value
  c.rl.num_minibatches = _MINIBATCHES.value
  c.rl.ppo_epochs = _EPOCHS.value
  c.task.eval_size = _EVAL_SIZE.value
  c.eval.batch_size = _EVAL_SIZE.value
  c.loss.name = objective
  for pair in _DIFFICULTY.value:
    name, _, value = pair.partition("=")
    if name not in c.task.difficulty or not value.lstrip("-").isdigit():
      raise ValueError(f"--difficulty={pair!r}: use name=int with name one of "
                       f"{sorted(c.task.difficulty)}.")
    c.task.difficulty[name] = int(value)
  return c


def warm_start(seed: int, task, tokenizer, model_config):
  """Supervised warm start of one seed: (params, loop rng, data cursor)."""
  config = bench_config(seed, "grpo", 0)
  ctx, optimizer = launcher.make_context(config, task, tokenizer, model_config, launcher.WARM_START)
  init_rng, loop_rng = jax.random.split(jax.random.PRNGKey(seed))
  params = transformer.init_params(model_config, init_rng)
  state = loop.LoopState(train=train.init_train_state(params, optimizer), rng=loop_rng)
  for _ in range(config.warm_start.steps):
    state, _ = loop.sft_iteration(state, ctx)
  return state.train.params, state.rng, state.data_cursor


def run_cell(seed, objective, staleness, warm, task, tokenizer, model_config, held_out, cache):
  """One GRPO run from the seed's warm start; returns its curves."""
  config = bench_config(seed, objective, staleness)
  key = objective
  if key not in cache:  # one compiled train step per objective, shared across k and seeds
    cache[key] = launcher.make_context(config, task, tokenizer, model_config, launcher.RL)
  ctx, optimizer = cache[key]
  ctx = dataclasses.replace(ctx, task=task, staleness=staleness)
  params, rng, cursor = warm
  params = jax.tree.map(lambda p: p.copy(), params)
  state = loop.LoopState(train=train.init_train_state(params, optimizer), rng=rng,
                         history=loop.init_history(params, staleness) if staleness else None,
                         data_cursor=cursor)
  curve = {"step": [0], "accuracy": [held_out(params)], "grad_norm": [], "clip_fraction": [],
           "masked_fraction": [], "reward_mean": [], "lr_scale": [], "update_skipped": 0}
  for it in range(1, config.rl.steps + 1):
    state, m = loop.grpo_iteration(state, ctx)
    curve["grad_norm"].append(float(m["grad_norm"]))
    curve["clip_fraction"].append(float(m.get("clip_fraction", 0.0)))
    curve["masked_fraction"].append(float(m.get("masked_fraction", 0.0)))
    curve["reward_mean"].append(float(m["reward_mean"]))
    curve["lr_scale"].append(float(m["lr_scale"]))
    curve["update_skipped"] += int(m["update_skipped"])
    if it % _EVAL_EVERY.value == 0 or it == config.rl.steps:
      curve["step"].append(it)
      curve["accuracy"].append(held_out(state.train.params))
  return curve


def summarise(results: dict, margin: float) -> dict:
  """Per (objective, k): mean/std over seeds of final accuracy and AUC, collapse rate, and
  the ratio of mean final accuracy to the same objective's k = 0."""
  table = {}
  for objective, by_k in results["runs"].items():
    for k, by_seed in by_k.items():
      finals = [np.mean(c["accuracy"][-2:]) for c in by_seed.values()]
      aucs = [np.mean(c["accuracy"]) for c in by_seed.values()]
      collapsed = [np.mean(c["accuracy"][-2:]) < c["accuracy"][0] - margin for c in by_seed.values()]
      masked = [np.mean(c["masked_fraction"]) for c in by_seed.values()]
      clipped = [np.mean(c["clip_fraction"]) for c in by_seed.values()]
      table.setdefault(objective, {})[k] = dict(
          seeds=len(finals), final_mean=float(np.mean(finals)), final_std=float(np.std(finals)),
          auc_mean=float(np.mean(aucs)), collapse_rate=float(np.mean(collapsed)),
          masked_fraction=float(np.mean(masked)), clip_fraction=float(np.mean(clipped)))
    on_policy = table[objective].get("0")
    for row in table[objective].values():
      row["ratio_to_k0"] = (row["final_mean"] / on_policy["final_mean"]
                            if on_policy and on_policy["final_mean"] > 0 else float("nan"))
  return table


def write_table(results: dict, table: dict, path: str) -> None:
  ks = sorted({int(k) for by_k in table.values() for k in by_k})
  lines = [f"Warm-start accuracy (mean over seeds): {results['warm_start_accuracy_mean']:.3f}", "",
           "| objective | " + " | ".join(f"k={k}" for k in ks) + " |",
           "|---|" + "---|" * len(ks)]
  for objective, by_k in table.items():
    cells = []
    for k in ks:
      row = by_k.get(str(k))
      cells.append("" if row is None else
                   f"{row['final_mean']:.3f}"
                   + (f" ± {row['final_std']:.3f}" if row["seeds"] > 1 else "")
                   + f" (x{row['ratio_to_k0']:.2f}, "
                   f"AUC {row['auc_mean']:.3f}, n={row['seeds']})")
    lines.append(f"| {objective} | " + " | ".join(cells) + " |")
  lines += ["", "Mean masked / clipped-token fraction over training:", "",
            "| objective | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
  for objective, by_k in table.items():
    cells = [("" if str(k) not in by_k else
              f"{by_k[str(k)]['masked_fraction']:.4f} / {by_k[str(k)]['clip_fraction']:.4f}")
             for k in ks]
    lines.append(f"| {objective} | " + " | ".join(cells) + " |")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def plot(results: dict, table: dict, path: str) -> None:
  fig, (ax_acc, ax_norm, ax_frac) = plt.subplots(1, 3, figsize=(15, 4))
  for objective, by_k in table.items():
    ks = sorted(by_k, key=int)
    x = [max(int(k), 1) for k in ks]  # k = 0 drawn at 1 on the log axis
    ax_acc.errorbar(x, [by_k[k]["final_mean"] for k in ks], yerr=[by_k[k]["final_std"] for k in ks],
                    marker="o", capsize=3, label=objective)
    runs = results["runs"][objective][max(ks, key=int)]
    norms = np.mean([c["grad_norm"] for c in runs.values()], axis=0)
    fractions = np.mean([np.maximum(c["masked_fraction"], c["clip_fraction"]) for c in runs.values()], axis=0)
    ax_norm.plot(norms, lw=0.8, label=f"{objective} k={max(ks, key=int)}")
    ax_frac.plot(fractions, lw=0.8, label=f"{objective} k={max(ks, key=int)}")
  ax_acc.axhline(results["warm_start_accuracy_mean"], color="gray", ls="--", lw=0.8, label="warm start")
  ax_acc.set(xscale="log", xlabel="staleness k (k=0 at 1)", ylabel="final held-out accuracy",
             title="Accuracy vs staleness (mean ± std over seeds)")
  ax_norm.set(xlabel="GRPO step", ylabel="grad norm", title="Gradient norm (largest k)")
  ax_frac.set(xlabel="GRPO step", ylabel="fraction of tokens",
              title="Masked / clipped-token fraction (largest k)")
  for ax in (ax_acc, ax_norm, ax_frac):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  os.makedirs(_OUT.value, exist_ok=True)
  json_path = os.path.join(_OUT.value, "results.json")
  if _REPORT_ONLY.value:
    results = {"runs": {}, "warm_start": {}, "sources": _REPORT_ONLY.value, "wall_s": 0.0}
    for path in _REPORT_ONLY.value:
      with open(path) as f:
        part = json.load(f)
      results["flags"] = part["flags"]
      results["warm_start"].update(part["warm_start"])
      results["wall_s"] += part["wall_s"]
      for objective, by_k in part["runs"].items():
        for k, by_seed in by_k.items():
          results["runs"].setdefault(objective, {}).setdefault(k, {}).update(by_seed)
    results["warm_start_accuracy_mean"] = float(np.mean(list(results["warm_start"].values())))
    results["summary"] = summarise(results, _MARGIN.value)
    with open(json_path, "w") as f:
      json.dump(results, f)
    write_table(results, results["summary"], os.path.join(_OUT.value, "table.md"))
    plot(results, results["summary"], os.path.join(_OUT.value, "plot.png"))
    return
  tokenizer = CharTokenizer()
  results = {"flags": {f: flags.FLAGS[f].value for f in (
      "objectives", "staleness", "seeds", "steps", "warm_start_steps", "warm_start_lr",
      "learning_rate", "prompts_per_step", "group_size", "num_minibatches", "ppo_epochs",
      "difficulty", "eval_every", "eval_size")}, "runs": {}, "warm_start": {}}
  started = time.time()
  cache = {}
  for seed in map(int, _SEEDS.value):
    config = bench_config(seed, "grpo", 0)
    task = make_task(config.task.name, config.task.prompt_style, seed=seed,
                     eval_size=config.task.eval_size, **config.task.difficulty)
    model_config = launcher.build_model_config(config, tokenizer)
    eval_examples = task.examples("eval", config.task.eval_size)

    def held_out(params):
      return evaluation.evaluate(params, eval_examples, task=task, tokenizer=tokenizer,
                                 prompt_len=config.rollout.prompt_len,
                                 max_new_tokens=config.rollout.max_new_tokens,
                                 model_config=model_config,
                                 batch_size=config.eval.batch_size).accuracy

    warm_path = os.path.join(_OUT.value,
                             f"warm_start_seed{seed}_{_WARM.value}_{_WARM_LR.value:g}"
                             f"{''.join('_' + pair for pair in _DIFFICULTY.value)}.msgpack")
    if os.path.exists(warm_path):  # a rerun reuses the seed's warm start
      with open(warm_path, "rb") as f:
        saved = flax.serialization.msgpack_restore(f.read())
      warm = (jax.tree.map(jnp.asarray, saved["params"]), jnp.asarray(saved["rng"]),
              int(saved["cursor"]))
    else:
      warm = warm_start(seed, task, tokenizer, model_config)
      with open(warm_path, "wb") as f:
        f.write(flax.serialization.msgpack_serialize(jax.device_get(
            {"params": warm[0], "rng": warm[1], "cursor": warm[2]})))
    results["warm_start"][str(seed)] = held_out(warm[0])
    print(f"[{time.time() - started:.0f}s] seed {seed}: warm-start accuracy "
          f"{results['warm_start'][str(seed)]:.3f}", flush=True)
    for k in map(int, _STALENESS.value):
      for objective in _OBJECTIVES.value:
        t0 = time.time()
        updates = _MINIBATCHES.value * _EPOCHS.value
        if _SHARE.value and k == 0 and same_as_grpo_on_policy(objective, updates):
          by_seed = results["runs"].get("grpo", {}).get("0", {})
          if str(seed) not in by_seed:
            by_seed[str(seed)] = run_cell(seed, "grpo", 0, warm, task, tokenizer, model_config,
                                          held_out, cache)
            results["runs"].setdefault("grpo", {})["0"] = by_seed
          curve = dict(by_seed[str(seed)], shared_from="grpo")
        else:
          curve = run_cell(seed, objective, k, warm, task, tokenizer, model_config, held_out, cache)
        curve["wall_s"] = time.time() - t0
        results["runs"].setdefault(objective, {}).setdefault(str(k), {})[str(seed)] = curve
        print(f"[{time.time() - started:.0f}s] seed {seed} k={k} {objective}: accuracy "
              f"{curve['accuracy'][0]:.3f} -> {curve['accuracy'][-1]:.3f} "
              f"({curve['wall_s']:.0f}s)", flush=True)
        results["warm_start_accuracy_mean"] = float(np.mean(list(results["warm_start"].values())))
        results["wall_s"] = time.time() - started
        results["summary"] = summarise(results, _MARGIN.value)
        with open(json_path + ".tmp", "w") as f:
          json.dump(results, f)
        os.replace(json_path + ".tmp", json_path)
  write_table(results, results["summary"], os.path.join(_OUT.value, "table.md"))
  plot(results, results["summary"], os.path.join(_OUT.value, "plot.png"))


if __name__ == "__main__":
  app.run(main)
