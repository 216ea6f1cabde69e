"""Benchmark B3 (docs/benchmarks.md): tree rollouts vs independent sampling per decoded token.

    python -m experiments.bench_tree --workdir=runs/bench_tree            # B3 + training
    python -m experiments.bench_tree --workdir=runs/bench_tree --train_seeds=0  # B3 only

Part 1 (B3). A policy is warm-started on the compact chain_sum task (the supervised phase of
configs/chain_sum_compact.py), then the same prompts are rolled out by independent sampling
with G = 2..8 completions per prompt and by each tree fork policy. For each: leaves per
prompt, decoded tokens (sampled tokens; a tree's shared prefixes are decoded once), decoded
tokens per leaf, distinct final answers per prompt, fraction of groups with non-zero reward
variance, reward signal per 1k decoded tokens (sum over leaves of |reward - group mean
reward|, the mass GRPO-style advantages are built from), coverage (prompts with an exact leaf)
and the sample + score wall time (best of N after compilation, interleaved, relative to
independent G = 8; the machine is shared, so only the ratio is meaningful). The B3 part is
cached in --workdir/b3.json (delete it to measure again). The independent sweep over G gives
the equal-decoded-token-budget comparison: a tree row is compared with the independent row
whose decoded tokens are closest.

Part 2. `experiments.train` is run with that config both ways (independent
G = 8, and config.rollout.kind='tree' with the default fork policy, 8 leaves per prompt),
one workdir per (kind, seed) (a finished workdir is reused), and held-out accuracy is
plotted against cumulative decoded rollout tokens.

Writes results.json, benchmarks_tree.md (tables + command) and its plots
(benchmarks_tree_b3.png, benchmarks_tree_train.png) to --workdir, and copies the markdown
and plots to --docs_dir.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from absl import app
from absl import flags
import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from experiments import train as train_lib
from experiments.configs import chain_sum_compact
from models import transformer
from models.tokenizer import CharTokenizer
from rl import advantages
from rl import checkpoint
from rl import loop
from rl import rollout as rollout_lib
from rl import train as rl_train
from rl.tasks import make_task
from sampling import tree

_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_tree", "Output directory.")
_DOCS_DIR = flags.DEFINE_string("docs_dir", "docs", "Where the markdown and plots are copied.")
_WARM_STEPS = flags.DEFINE_integer("warm_start_steps", None, "config.warm_start.steps "
                                   "(default: the chain_sum config's).")
_WARM_LR = flags.DEFINE_float("warm_start_lr", None, "config.warm_start.learning_rate.")
_RL_LR = flags.DEFINE_float("rl_lr", None, "config.rl.learning_rate.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "config.eval.every of the training runs.")
_INIT_CHECKPOINT = flags.DEFINE_string(
    "init_checkpoint", "", "Optional checkpoints/ directory of an experiments.train run "
    "(chain_sum config and seed) whose newest checkpoint is the warm-started policy for B3, "
    "instead of running the warm start here (e.g. a copy of step warm_start_steps).")
_PROMPTS = flags.DEFINE_integer("prompts", 128, "Prompts per B3 rollout batch.")
_SEEDS = flags.DEFINE_integer("seeds", 4, "B3 rollout batches (different prompts and keys).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (best of) per B3 configuration.")
_TRAIN_SEEDS = flags.DEFINE_list("train_seeds", ["0"], "Seeds of the training comparison "
                                 "(an empty string skips it).")
_RL_STEPS = flags.DEFINE_integer("rl_steps", None, "config.rl.steps of the training runs.")

TREES = {
    "entropy M4 N2 B2": tree.EntropyFork(init_chains=4, fork_points=2, branches=2, rounds=1),
    "entropy M2 N3 B2": tree.EntropyFork(init_chains=2, fork_points=3, branches=2, rounds=1),
    "entropy M2 N1 B2 L3": tree.EntropyFork(init_chains=2, fork_points=1, branches=2, rounds=3),
    "segments M1 S1 b2 D3": tree.FixedSegments(init_chains=1, segment_len=1, branches=2,
                                               max_depth=3),
    "segments M2 S2 b2 D2": tree.FixedSegments(init_chains=2, segment_len=2, branches=2,
                                               max_depth=2),
    "lookahead M4 k2 H>=0.5": tree.Lookahead(init_chains=4, leaves=8, top_k=2, min_entropy=0.5,
                                             lookahead_steps=1, prune_similarity=1.0),
}
GROUP_SIZES = (2, 3, 4, 5, 6, 8)


def _base_config():
  """The chain_sum config with this benchmark's overrides (flags left unset keep it)."""
  config = chain_sum_compact.get_config()
  for value, (section, field) in ((_WARM_STEPS.value, ("warm_start", "steps")),
                                  (_WARM_LR.value, ("warm_start", "learning_rate")),
                                  (_RL_STEPS.value, ("rl", "steps")),
                                  (_RL_LR.value, ("rl", "learning_rate"))):
    if value is not None:
      config[section][field] = value
  config.eval.every = _EVAL_EVERY.value
  return config


def _warm_start(config):
  """Supervised warm start of the chain_sum run (or its restored checkpoint); returns
  (params, the RL LoopContext)."""
  tokenizer = CharTokenizer()
  task = make_task(config.task.name, config.task.prompt_style, seed=config.seed,
                   eval_size=config.task.eval_size, **config.task.difficulty)
  model_config = train_lib.build_model_config(config, tokenizer)
  ctx, optimizer = train_lib.make_context(config, task, tokenizer, model_config,
                                          train_lib.WARM_START)
  init_rng, loop_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  params = transformer.init_params(model_config, init_rng)
  state = loop.LoopState(train=rl_train.init_train_state(params, optimizer), rng=loop_rng)
  if _INIT_CHECKPOINT.value:
    restored = checkpoint.restore_latest(checkpoint.make_manager(_INIT_CHECKPOINT.value), state)
    if restored is None:
      raise ValueError(f"--init_checkpoint={_INIT_CHECKPOINT.value} holds no checkpoint; "
                       "point it at an experiments.train workdir's checkpoints/ directory.")
    state = restored[1]
  else:
    for _ in range(config.warm_start.steps):
      state, _ = loop.sft_iteration(state, ctx)
  rl_ctx, _ = train_lib.make_context(config, task, tokenizer, model_config, train_lib.RL)
  return state.train.params, rl_ctx


def _group_stats(rewards, exact, completions, leaf):
  """Per-batch statistics from [prompts, rows] arrays (rows outside `leaf` ignored)."""
  count = leaf.sum(axis=1)
  mean = (rewards * leaf).sum(axis=1) / np.maximum(count, 1)
  dev = np.abs(rewards - mean[:, None]) * leaf
  var = (dev ** 2).sum(axis=1) / np.maximum(count, 1)
  distinct = [len({c for c, l in zip(row_c, row_l) if l}) for row_c, row_l in zip(completions, leaf)]
  return dict(leaves=float(count.mean()), informative=float(np.mean(var > 0)),
              signal=float(dev.sum()), distinct=float(np.mean(distinct)),
              coverage=float(np.mean((exact & leaf).any(axis=1))),
              reward=float((rewards * leaf).sum() / leaf.sum()))


def _rollout(params, ctx, examples, rng, what):
  """Samples and scores one batch: (scored samples, leaf mask, decoded, refed tokens)."""
  if isinstance(what, int):
    samples = rollout_lib.sample_and_score(
        params, examples, task=ctx.task, tokenizer=ctx.tokenizer, rng=rng, group_size=what,
        prompt_len=ctx.prompt_len, model_config=ctx.model_config,
        sampling_config=ctx.sampling_config, advantage_fn=advantages.grpo_advantages)
    leaf = np.ones(len(samples.completions), bool)
    decoded, refed = int(np.asarray(samples.rollout.completion_mask).sum()), 0
  else:
    samples = rollout_lib.tree_sample_and_score(
        params, examples, task=ctx.task, tokenizer=ctx.tokenizer, rng=rng,
        prompt_len=ctx.prompt_len, model_config=ctx.model_config,
        sampling_config=ctx.sampling_config, policy=what,
        advantage_fn=advantages.treerl_advantages)
    leaf, decoded, refed = samples.leaf, samples.decoded_tokens, samples.refed_tokens
  jax.block_until_ready(samples.rollout.advantages)
  return samples, leaf, decoded, refed


def _run_b3(params, ctx):
  """Part 1: every configuration on the same prompt batches; returns rows of results.

  Statistics are means over --seeds batches. Timing runs afterwards, interleaved (every
  configuration once per repeat, on the first batch, after a compiling call), best of
  --repeats, so that the machine's load drifts over all configurations alike.
  """
  configs = [(f"independent G={g}", g) for g in GROUP_SIZES] + list(TREES.items())
  batches = [(ctx.task.examples("train", _PROMPTS.value, 10 ** 6 + seed * _PROMPTS.value),
              jax.random.PRNGKey(1000 + seed)) for seed in range(_SEEDS.value)]
  rows = {}
  for name, what in configs:
    stats = []
    for examples, rng in batches:
      samples, leaf, decoded, refed = _rollout(params, ctx, examples, rng, what)
      shape = (len(examples), -1)
      completions = np.array(samples.completions, object).reshape(shape)
      one = _group_stats(np.asarray(samples.rollout.reward).reshape(shape),
                         samples.exact.reshape(shape), completions, leaf.reshape(shape))
      one.update(decoded=decoded, refed=refed)
      stats.append(one)
    mean = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
    prompts = _PROMPTS.value
    rows[name] = dict(
        leaves_per_prompt=mean["leaves"], decoded_per_prompt=mean["decoded"] / prompts,
        decoded_per_leaf=mean["decoded"] / (mean["leaves"] * prompts),
        refed_per_prompt=mean["refed"] / prompts, distinct_answers=mean["distinct"],
        informative_groups=mean["informative"],
        signal_per_1k_decoded=1000 * mean["signal"] / mean["decoded"],
        coverage=mean["coverage"], mean_reward=mean["reward"])
    print(name, json.dumps(rows[name]), flush=True)
  times = {name: [] for name, _ in configs}
  examples, rng = batches[0]
  for _ in range(_REPEATS.value):
    for name, what in configs:
      started = time.perf_counter()
      _rollout(params, ctx, examples, rng, what)
      times[name].append(time.perf_counter() - started)
  base = min(times[f"independent G={max(GROUP_SIZES)}"])
  for name, row in rows.items():
    row["rollout_s"] = min(times[name])
    row["rollout_time_vs_independent_g8"] = row["rollout_s"] / base
  return rows


def _run_training(seeds):
  """Part 2: the chain_sum run both ways; returns {kind: [per-seed results]}.

  A workdir that already has metrics is read as it is (a finished run, or one stopped
  early): a run's numbers are taken at its last evaluation (`rl_steps_done` steps).
  """
  results = {}
  for kind in ("independent", "tree"):
    for seed in seeds:
      config = _base_config()
      config.workdir = os.path.join(_WORKDIR.value, "train", f"{kind}_seed{seed}")
      config.seed = seed
      config.rollout.kind = kind
      metrics_path = os.path.join(config.workdir, "metrics.jsonl")
      if not os.path.exists(metrics_path):
        train_lib.run(config)
      records = [json.loads(line) for line in open(metrics_path)]
      tokens, curve, decoded, informative, steps = 0.0, [], [], [], 0
      for r in records:
        if r["phase"] != "rl" and r.get("event") != "warm_start_end":
          continue
        if "decoded_tokens" in r:
          steps += 1
          tokens += r["decoded_tokens"]
          decoded.append(r["decoded_tokens"])
          informative.append(r["informative_groups"])
        if "eval_accuracy" in r:
          curve.append((tokens, r["eval_accuracy"], steps))
      summary_path = os.path.join(config.workdir, "summary.json")
      wall = json.load(open(summary_path))["wall_time_s"] if os.path.exists(summary_path) else None
      results.setdefault(kind, []).append(dict(
          seed=seed, curve=curve, rl_steps_done=curve[-1][2], warm_start_accuracy=curve[0][1],
          final_accuracy=curve[-1][1], best_accuracy=max(c[1] for c in curve),
          decoded_tokens=curve[-1][0], decoded_per_step=float(np.mean(decoded)),
          informative_groups=float(np.mean(informative)), wall_time_s=wall))
  return results


def _tokens_to_reach(curve, target):
  return next((t for t, acc, _ in curve if acc >= target), None)


def _markdown(b3, training, config) -> str:
  lines = [
      "# B3: tree rollouts vs independent sampling",
      "",
      f"Policy: the chain_sum run's warm start ({config.warm_start.steps} supervised steps, seed "
      f"{config.seed}, "
      f"tiny preset, task {config.task.name}, {config.rollout.max_new_tokens} completion "
      f"slots, temperature {config.rollout.temperature}). {_SEEDS.value} batches of "
      f"{_PROMPTS.value} prompts, means over batches. Decoded = sampled tokens (a tree's "
      "shared prefix is decoded once); refed = tokens an entropy fork re-runs to recover "
      "its next-token logits. Signal = sum over leaves of |reward - group mean| per 1k "
      "decoded tokens. Time = rollout wall time relative to independent G=8 (best of "
      f"{_REPEATS.value}; a shared 2-core machine with other jobs running, so rough).",
      "",
      "| rollout | leaves/prompt | decoded/prompt | decoded/leaf | refed/prompt | distinct "
      "answers | non-zero-variance groups | signal per 1k decoded | coverage | time vs G=8 |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in b3.items():
    lines.append(
        f"| {name} | {r['leaves_per_prompt']:.2f} | {r['decoded_per_prompt']:.1f} | "
        f"{r['decoded_per_leaf']:.2f} | {r['refed_per_prompt']:.2f} | "
        f"{r['distinct_answers']:.2f} | {r['informative_groups']:.3f} | "
        f"{r['signal_per_1k_decoded']:.1f} | {r['coverage']:.3f} | "
        f"{r['rollout_time_vs_independent_g8']:.2f} |")
  independent = {k: v for k, v in b3.items() if k.startswith("independent")}
  lines += ["", "Equal decoded-token budget (closest independent G):", "",
            "| tree | decoded/prompt | non-zero-var groups | leaves | vs independent | "
            "decoded/prompt | non-zero-var groups | leaves | decoded/leaf ratio (tree / G=8) |",
            "|---|---|---|---|---|---|---|---|---|"]
  g8 = b3[f"independent G={max(GROUP_SIZES)}"]
  for name, r in b3.items():
    if name in independent:
      continue
    match = min(independent, key=lambda k: abs(independent[k]["decoded_per_prompt"]
                                                - r["decoded_per_prompt"]))
    m = independent[match]
    lines.append(
        f"| {name} | {r['decoded_per_prompt']:.1f} | {r['informative_groups']:.3f} | "
        f"{r['leaves_per_prompt']:.2f} | {match} | {m['decoded_per_prompt']:.1f} | "
        f"{m['informative_groups']:.3f} | {m['leaves_per_prompt']:.2f} | "
        f"{r['decoded_per_leaf'] / g8['decoded_per_leaf']:.2f} |")
  lines += ["", "![B3](benchmarks_tree_b3.png)", ""]
  if training:
    lines += [
        "## The chain_sum task trained both ways", "",
        f"`experiments.train` chain_sum config with {config.warm_start.steps} warm-start steps "
        f"at peak lr {config.warm_start.learning_rate}, up to {config.rl.steps} GRPO steps at "
        f"lr {config.rl.learning_rate} (column RL steps: how many ran), "
        f"{config.rollout.prompts_per_step} prompts/step, eval every {config.eval.every} steps "
        f"on {config.task.eval_size} held-out items (greedy exact match): independent G=8 vs "
        f"`--config.rollout.kind=tree` ({train_lib.build_fork_policy(config.rollout.tree)}, "
        f"{config.rollout.tree.advantage} advantages, shared-prefix tokens trained once).", "",
        "| run | seed | RL steps | warm-start acc | final acc | best acc | decoded tokens "
        "(total) | decoded tokens/step | non-zero-var groups | decoded tokens to reach "
        "independent's final acc |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    lines[-2:-2] = [
        "Numbers at each run's last evaluation; a run with fewer RL steps than configured "
        "was stopped early. Held-out greedy accuracy moves by several points between "
        "evaluations at this learning rate, so one seed is an indication, not a result.", ""]
    partners = {run["seed"]: run for run in training.get("independent", [])}
    for kind, runs in training.items():
      for run in runs:
        partner = partners.get(run["seed"])
        reach = _tokens_to_reach(run["curve"], partner["final_accuracy"]) if partner else None
        lines.append(
            f"| {kind} | {run['seed']} | {run['rl_steps_done']} | "
            f"{run['warm_start_accuracy']:.3f} | {run['final_accuracy']:.3f} | "
            f"{run['best_accuracy']:.3f} | {run['decoded_tokens']:.0f} | "
            f"{run['decoded_per_step']:.0f} | {run['informative_groups']:.3f} | "
            f"{'not reached' if reach is None else f'{reach:.0f}'} |")
    lines += ["", "![accuracy vs decoded tokens](benchmarks_tree_train.png)", ""]
  init = f"--init_checkpoint={_INIT_CHECKPOINT.value} " if _INIT_CHECKPOINT.value else ""
  lines += ["Command: `PYTHONPATH=. python -m experiments.bench_tree "
            f"--workdir={_WORKDIR.value} --prompts={_PROMPTS.value} --seeds={_SEEDS.value} "
            f"{init}--warm_start_steps={config.warm_start.steps} "
            f"--warm_start_lr={config.warm_start.learning_rate} --rl_steps={config.rl.steps} "
            f"--rl_lr={config.rl.learning_rate} --eval_every={config.eval.every} "
            f"--train_seeds={','.join(_TRAIN_SEEDS.value)}`", ""]
  return "\n".join(lines)


def _plots(b3, training, workdir):
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  independent = [(k, v) for k, v in b3.items() if k.startswith("independent")]
  trees = [(k, v) for k, v in b3.items() if not k.startswith("independent")]
  for ax, key, label in ((axes[0], "informative_groups", "non-zero-variance groups"),
                         (axes[1], "distinct_answers", "distinct answers / prompt")):
    ax.plot([v["decoded_per_prompt"] for _, v in independent], [v[key] for _, v in independent],
            "o-", color="k", label="independent G=2..8")
    for name, v in trees:
      ax.plot(v["decoded_per_prompt"], v[key], "s", label=name)
    ax.set_xlabel("decoded tokens / prompt")
    ax.set_ylabel(label)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, "benchmarks_tree_b3.png"), dpi=110)
  plt.close(fig)
  if training:
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, color in (("independent", "k"), ("tree", "tab:green")):
      for run in training.get(kind, []):
        tokens, acc, _ = zip(*run["curve"])
        ax.plot(np.array(tokens) / 1e3, acc, "o-", color=color, ms=3,
                label=f"{kind} seed {run['seed']}")
    ax.set_xlabel("cumulative decoded rollout tokens (k)")
    ax.set_ylabel("held-out exact match")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "benchmarks_tree_train.png"), dpi=110)
    plt.close(fig)


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  config = _base_config()
  b3_path = os.path.join(_WORKDIR.value, "b3.json")
  if os.path.exists(b3_path):  # delete it to measure again
    b3 = json.load(open(b3_path))
  else:
    params, ctx = _warm_start(config)
    b3 = _run_b3(params, ctx)
    with open(b3_path, "w") as f:
      json.dump(b3, f, indent=2)
  seeds = [int(s) for s in _TRAIN_SEEDS.value if s.strip()]
  training = _run_training(seeds) if seeds else {}
  with open(os.path.join(_WORKDIR.value, "results.json"), "w") as f:
    json.dump({"b3": b3, "training": training}, f, indent=2)
  _plots(b3, training, _WORKDIR.value)
  text = _markdown(b3, training, config)
  with open(os.path.join(_WORKDIR.value, "benchmarks_tree.md"), "w") as f:
    f.write(text)
  os.makedirs(_DOCS_DIR.value, exist_ok=True)
  for name in ("benchmarks_tree.md", "benchmarks_tree_b3.png", "benchmarks_tree_train.png"):
    if os.path.exists(os.path.join(_WORKDIR.value, name)):
      shutil.copy(os.path.join(_WORKDIR.value, name), _DOCS_DIR.value)
  print(text)


if __name__ == "__main__":
  app.run(main)
