"""Launch an Arbor RL run: supervised warm start, then GRPO, with held-out evaluation.

    python -m experiments.train                                   # the embedded default
    python -m experiments.train --config=experiments/configs/default.py --config.rl.steps=50

Writes to config.workdir: metrics.jsonl (one line per iteration and per evaluation, with
the step's learning rate, phase times and token rates), TensorBoard event files of the
same scalars and the resolved config as text (`tensorboard --logdir runs`; held-out
accuracy is one `eval/accuracy` curve across both phases), plot.png (train reward and
held-out accuracy against step), checkpoints/ (orbax), config.json and summary.json. With
config.metrics.wandb_project set the scalars also go to Weights & Biases (pip install
wandb). A rerun with the same workdir resumes from the newest checkpoint.

With `config.model.checkpoint` set (a HF folder, a .gguf file, or "smollm2") the policy and
tokenizer are loaded from it instead of being initialised from scratch with the character
tokenizer (docs/checkpoints.md).

Resume is exact: a run of N steps equals a run killed at any moment (SIGKILL included)
and rerun, bit for bit in parameters and in metrics.jsonl (except the wall-clock fields:
the seconds in time_* and the rates in *_per_s). The checkpoint meta stores the
number of metrics records written, and a resumed run first cuts metrics.jsonl back to it.

    python -m experiments.train --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2

shards the run over a device mesh (default: all 1, one device); docs/pod.md covers several
GPUs, pod slices and multi-process starts (--config.distributed.*). Only process 0 writes
metrics, plots and the summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app
from absl import flags
from absl import logging
import ml_collections
import tqdm

from experiments import config_flag
from experiments import lazy
from experiments import metrics
from experiments.configs import default as default_config

# JAX, orbax, reasoning-gym and the model code load on first use (experiments/lazy.py), so
# `--help` and flag errors answer at once; a run imports them when it starts.
jax = lazy.module("jax")
transformer = lazy.module("models.transformer")
model_configs = lazy.module("models.config")
lora_lib = lazy.module("models.lora")
pretrained = lazy.module("models.pretrained")
tokenizers = lazy.module("models.tokenizer")
advantages = lazy.module("rl.objectives.advantages")
async_loop = lazy.module("rl.rollouts.async_loop")
checkpoint = lazy.module("rl.checkpoint")
evaluation = lazy.module("rl.evaluation")
loop = lazy.module("rl.loop")
losses = lazy.module("rl.objectives.losses")
partial_rollout = lazy.module("rl.rollouts.partial")
selection = lazy.module("rl.rollouts.selection")
train = lazy.module("rl.train")
trajectory_store = lazy.module("rl.rollouts.trajectory_store")
tasks = lazy.module("rl.tasks")
rollout_lib = lazy.module("rl.rollouts.batches")
tree_lib = lazy.module("sampling.tree")
partial_lib = lazy.module("sampling.partial")
sampler_lib = lazy.module("sampling.sampler")
mesh_lib = lazy.module("sharding.mesh")
multihost = lazy.module("sharding.multihost")
reshard = lazy.module("sharding.reshard")

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.py")
_CONFIG = config_flag.define_config_file("config", _DEFAULT_CONFIG, "Run configuration file.")

WARM_START, RL = "warm_start", "rl"


def build_fork_policy(tree_config) -> tree_lib.ForkPolicy:
  """The sampling.tree fork policy named by config.rollout.tree.policy."""
  t = tree_config
  if t.policy == "entropy":
    return tree_lib.EntropyFork(init_chains=t.init_chains, fork_points=t.fork_points,
                                branches=t.branches, rounds=t.rounds)
  if t.policy == "segments":
    return tree_lib.FixedSegments(init_chains=t.init_chains, segment_len=t.segment_len,
                                  branches=t.branches, max_depth=t.max_depth)
  if t.policy == "lookahead":
    return tree_lib.Lookahead(init_chains=t.init_chains, leaves=t.leaves, top_k=t.top_k,
                              min_entropy=t.min_entropy, lookahead_steps=t.lookahead_steps,
                              prune_similarity=t.prune_similarity)
  raise ValueError(f"Unknown config.rollout.tree.policy {t.policy!r}; use 'entropy', "
                   "'segments' or 'lookahead'.")


def rows_per_prompt(config) -> int:
  """Sequences per prompt in an RL batch: group_size, or the tree's leaf budget."""
  if config.rollout.kind == "tree":
    return build_fork_policy(config.rollout.tree).leaves
  return config.rollout.group_size


# Numeric fields and the range each must lie in: (dotted path, lowest, inclusive?, highest).
# Sizes and counts are positive; counts that may be off are >= 0.
_RANGES = (
    [(f"rollout.{k}", 1, True, None) for k in ("prompts_per_step", "group_size", "prompt_len",
                                               "max_new_tokens")]
    + [(f"rollout.{k}", 0, True, None) for k in ("num_slots", "decode_window",
                                                 "top_k", "temperature")]
    + [("rollout.top_p", 0, False, 1.0)]
    + [("task.eval_size", 1, True, None), ("task.train_pool", 0, True, None)]
    + [("warm_start.batch_size", 1, True, None), ("warm_start.steps", 0, True, None),
       ("warm_start.warmup_steps", 0, True, None), ("warm_start.learning_rate", 0, False, None),
       ("warm_start.length_window", 1, True, None)]
    + [(f"rl.{k}", 1, True, None) for k in ("num_microbatches", "num_minibatches", "ppo_epochs")]
    + [(f"rl.{k}", 0, True, None) for k in ("steps", "warmup_steps", "staleness",
                                            "max_staleness", "weight_decay", "max_grad_norm")]
    + [("rl.learning_rate", 0, False, None)]
    + [(f"loss.{k}", 0, True, None) for k in ("eps_low", "eps_high", "kl_coef", "is_floor",
                                              "norm_len", "mu_eps_low", "mu_eps_high")]
    + [(f"loss.{k}", 0, False, None) for k in ("is_cap", "m2_tau", "sat_bandwidth",
                                               "vcpo_rho_ref", "vcpo_is_cap")]
    + [("loss.sat_quantile", 0, False, 1.0)]
    + [("lora.rank", 0, True, None), ("lora.alpha", 0, False, None)]
    + [("eval.every", 1, True, None), ("eval.batch_size", 1, True, None),
       ("checkpoint.every", 1, True, None), ("checkpoint.max_to_keep", 1, True, None)])


def _field(config, path: str):
  node = config
  for name in path.split("."):
    node = node[name]
  return node


def check_ranges(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for a numeric field outside its range (`_RANGES`): a size of 0 would
  train on empty batches (NaN rewards) or skip every update without an error."""
  for path, low, inclusive, high in _RANGES:
    value = _field(config, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ValueError(f"config.{path} = {value!r} must be a number.")
    bound = (f">= {low}" if inclusive else f"> {low}") + (f" and <= {high}" if high else "")
    if value < low or (not inclusive and value == low) or (high is not None and value > high):
      raise ValueError(f"config.{path} = {value} must be {bound}.")


def check_names(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for a name no registry knows: task, prompt style, model preset and
  dtype, objective, aggregation, corrections, proximal estimate, advantage estimator, tree
  policy and tree advantage, partial-rollout resume mode."""
  if config.task.name not in tasks.task_names():
    raise ValueError(f"Unknown task {config.task.name!r} (config.task.name); known tasks: "
                     f"{', '.join(tasks.task_names())} (rl.tasks.register_task adds one).")
  if config.task.prompt_style not in tasks.PROMPT_STYLES:
    raise ValueError(f"config.task.prompt_style = {config.task.prompt_style!r}; use one of "
                     f"{tasks.PROMPT_STYLES}.")
  if not config.model.get("checkpoint") and config.model.preset not in model_configs.PRESETS:
    raise ValueError(f"Unknown config.model.preset {config.model.preset!r}; known: "
                     f"{sorted(model_configs.PRESETS)}.")
  if config.model.get("tokenizer") and not config.model.get("checkpoint"):
    raise ValueError(f"config.model.tokenizer = {config.model.tokenizer!r} is the tokenizer "
                     "of a pretrained checkpoint; set config.model.checkpoint too, or leave "
                     "config.model.tokenizer empty (a from-scratch run uses the character "
                     "tokenizer).")
  if config.model.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"config.model.dtype = {config.model.dtype!r}; use 'float32' or "
                     "'bfloat16'.")
  losses.check_config(config.loss)
  losses.check_settings_read(config.loss)
  advantages.get_advantage_fn(config.advantage.name)
  if config.rollout.kind == "tree":
    advantages.get_tree_advantage_fn(config.rollout.tree.advantage)
  if config.rollout.kind == "partial" and config.rollout.resume not in ("kept_kv", "reprefill"):
    raise ValueError(f"config.rollout.resume = {config.rollout.resume!r}; use 'kept_kv' or "
                     "'reprefill'.")


def updates_per_batch(config: ml_collections.ConfigDict) -> int:
  """Optimiser updates one RL batch takes: rl.num_minibatches * rl.ppo_epochs."""
  return config.rl.num_minibatches * config.rl.ppo_epochs


def staleness_in_batches(config: ml_collections.ConfigDict) -> int:
  """Simulated staleness as the loop applies it: config.rl.staleness counts optimiser
  updates (like every version), the loop lags whole batches (validate checks the multiple)."""
  return config.rl.staleness // updates_per_batch(config)


def check_composition(config: ml_collections.ConfigDict) -> None:
  """Refuses the switch combinations that do not compose (docs/configuration.md has the
  whole matrix): every other combination of rollout.kind, selection.kind, rl.async_,
  rl.staleness and the mesh runs, each switch with its effect."""
  r, kind = config.rollout, config.selection.kind
  if r.kind != "independent" and kind != "uniform":
    raise ValueError(f"config.selection.kind = {kind!r} chooses prompts and rollout counts for "
                     f"independent samples; config.rollout.kind = {r.kind!r} cannot skip or "
                     "re-weight groups (a tree shares one root per prompt; a partial pool has "
                     "started them already). Use selection.kind='uniform' or "
                     "rollout.kind='independent'.")
  if config.rl.async_ and config.rl.staleness:
    raise ValueError(f"config.rl.async_ has real staleness (bounded by rl.max_staleness); "
                     f"config.rl.staleness = {config.rl.staleness} simulates it in the sync "
                     "loop. Set one of them: rl.staleness = 0 or rl.async_ = False.")
  updates = updates_per_batch(config)
  if config.rl.staleness % updates:
    raise ValueError(f"config.rl.staleness = {config.rl.staleness} counts optimiser updates, "
                     f"and parameters change once per batch of config.rl.num_minibatches * "
                     f"ppo_epochs = {updates} updates: set rl.staleness to a multiple of "
                     f"{updates} (sampling then lags rl.staleness // {updates} batches).")
  if config.rl.async_ and 0 < config.rl.max_staleness < updates:
    raise ValueError(f"config.rl.max_staleness = {config.rl.max_staleness} counts optimiser "
                     f"updates, and one batch is config.rl.num_minibatches * ppo_epochs = "
                     f"{updates} of them: a batch sampled even one batch ahead is {updates} "
                     "updates stale, so config.rl.async_ could never run ahead. Set "
                     f"rl.max_staleness = 0 (synchronous) or >= {updates} (the producer then "
                     f"runs max_staleness // {updates} batches ahead).")
  m = config.mesh
  single_device = mesh_lib.MeshConfig(data=m.data, fsdp=m.fsdp, tensor=m.tensor).is_single_device
  if r.kind != "independent" and not single_device:
    raise ValueError(f"config.rollout.kind = {r.kind!r} decodes on one device; the sharded "
                     f"sampler (mesh data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) decodes "
                     "independent samples only. Use rollout.kind='independent' or mesh.data = "
                     "mesh.fsdp = mesh.tensor = 1.")


def lora_config(config: ml_collections.ConfigDict) -> lora_lib.LoraConfig | None:
  """The RL phase's LoRA settings (models/lora.py), or None when config.lora.rank = 0.

  Raises ValueError for a bad rank, alpha or target name, and for alpha or targets changed
  while LoRA is off (they would be accepted and then ignored)."""
  lora = config.lora
  if isinstance(lora.rank, bool) or not isinstance(lora.rank, int):
    raise ValueError(f"config.lora.rank = {lora.rank!r} must be an integer (0 = LoRA off).")
  if lora.rank == 0:
    defaults = default_config.get_config().lora
    changed = [name for name in ("alpha", "targets") if _as_tuple(lora[name])
               != _as_tuple(defaults[name])]
    if changed:
      raise ValueError(f"config.lora.{changed[0]} = {lora[changed[0]]!r} has no effect with "
                       "config.lora.rank = 0 (LoRA off, RL trains full weights); set "
                       f"config.lora.rank > 0 to train adapters, or leave config.lora."
                       f"{changed[0]} at its default {defaults[changed[0]]!r}.")
    return None
  # --config.lora.targets=q,v arrives as ('q,v',); "('q', 'v')" as a tuple.
  items = (lora.targets,) if isinstance(lora.targets, str) else lora.targets
  targets = tuple(t.strip() for item in items for t in str(item).split(",") if t.strip())
  return lora_lib.LoraConfig(rank=lora.rank, alpha=float(lora.alpha), targets=targets)


def _as_tuple(value):
  return tuple(value) if isinstance(value, (list, tuple)) else value


def check_metrics(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError when config.metrics asks for W&B and wandb is not installed (W&B is
  optional: Arbor does not depend on it)."""
  if config.metrics.wandb_project:
    try:
      metrics.import_wandb()
    except ImportError as error:
      raise ValueError(str(error)) from None


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the inconsistent fields and how to fix them. `run` calls it
  before anything else, so a bad config fails before the first training step."""
  check_ranges(config)
  check_names(config)
  r = config.rollout
  if r.kind not in ("independent", "tree", "partial"):
    raise ValueError(f"config.rollout.kind = {r.kind!r}; use 'independent', 'tree' or "
                     "'partial'.")
  rows = r.prompts_per_step * rows_per_prompt(config)
  rl_parts = config.rl.num_minibatches * config.rl.num_microbatches
  if rows % rl_parts:
    raise ValueError(f"config.rollout.prompts_per_step * group_size = {rows} is not divisible "
                     f"by config.rl.num_minibatches * num_microbatches = {rl_parts} (with "
                     "kind='tree', group_size is the tree's leaf budget).")
  if config.warm_start.batch_size % config.rl.num_microbatches:
    raise ValueError(f"config.warm_start.batch_size = {config.warm_start.batch_size} is not "
                     f"divisible by config.rl.num_microbatches = {config.rl.num_microbatches}.")
  if config.rl.prefix_shared_forward and r.kind != "independent":
    raise ValueError(f"config.rl.prefix_shared_forward needs groups of G independent samples of "
                     f"one prompt (config.rollout.kind='independent'), got {r.kind!r}.")
  if config.rl.prefix_shared_forward and r.prompts_per_step % rl_parts:
    raise ValueError(f"config.rl.prefix_shared_forward needs whole groups per microbatch: "
                     f"config.rollout.prompts_per_step = {r.prompts_per_step} must be divisible "
                     f"by config.rl.num_minibatches * num_microbatches = {rl_parts}.")
  if config.rl.prefix_shared_forward and config.selection.kind == "adaptive":
    raise ValueError("config.rl.prefix_shared_forward needs groups of exactly "
                     "config.rollout.group_size rows; config.selection.kind='adaptive' gives "
                     "prompts different rollout counts. Use another selection kind or turn "
                     "prefix sharing off.")
  if r.temperature == 0 and config.rl.steps > 0:
    raise ValueError(f"config.rollout.temperature = {r.temperature} is greedy decoding: "
                     "every rollout of a prompt is the same completion, so group advantages "
                     "are zero and RL never learns. Set config.rollout.temperature > 0 (1.0 "
                     "samples the policy itself); held-out evaluation decodes greedily "
                     "regardless.")
  if r.kind in ("independent", "partial") and r.group_size < 2:
    raise ValueError(f"config.rollout.group_size = {r.group_size}: group-relative advantages "
                     "need at least 2 completions per prompt.")
  if any(b < 1 for b in r.train_length_buckets):
    raise ValueError(f"config.rollout.train_length_buckets = {r.train_length_buckets}: every "
                     "bucket must be a positive number of completion slots.")
  check_composition(config)
  lora_config(config)
  check_metrics(config)
  selection.check_config(config.selection, prompts_per_step=r.prompts_per_step,
                         group_size=r.group_size, pool_size=config.task.train_pool)
  build_task(config)  # a task's own settings (difficulty fields, prompt style) fail here
  if config.warm_start.init_from:
    check_warm_start_source(config)


# The config fields that decide what a warm start trains: a run may start its RL phase from
# another run's warm start (config.warm_start.init_from) only when these agree
# (task.train_pool excepted: the warm start reads the unbounded train split whatever it is).
WARM_START_FIELDS = ("seed", "task", "model", "warm_start", "rollout.prompt_len",
                     "rollout.max_new_tokens", "rollout.train_length_buckets",
                     "rl.max_grad_norm", "rl.num_microbatches")


def _flat(value, prefix: str) -> dict:
  """{dotted path: leaf} of a JSON value (nested dicts flattened, lists kept whole)."""
  if not isinstance(value, dict):
    return {prefix: value}
  return {path: leaf for key, sub in value.items()
          for path, leaf in _flat(sub, f"{prefix}.{key}").items()}


def warm_start_settings(config_json: dict) -> dict:
  """The `WARM_START_FIELDS` of a resolved config (as config.json holds it), flattened;
  warm_start.init_from is where a warm start came from, not how it was trained."""
  settings = {}
  for path in WARM_START_FIELDS:
    node = config_json
    for name in path.split("."):
      node = node.get(name) if isinstance(node, dict) else None
    settings.update(_flat(node, path))
  settings.pop("warm_start.init_from", None)
  settings.pop("task.train_pool", None)  # RL's finite prompt pool; the warm start ignores it
  return settings


def check_warm_start_source(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError unless config.warm_start.init_from is the workdir of a run whose
  warm start finished with this run's `WARM_START_FIELDS` (seed, task, model and tokenizer,
  warm-start schedule, sequence lengths): any other warm start would not be this run's."""
  source = config.warm_start.init_from
  make_one = (f"train it with this run's flags and --config.rl.steps=0 "
              f"--config.workdir={source}")
  if not config.warm_start.steps:
    raise ValueError(f"config.warm_start.init_from = {source!r} with config.warm_start.steps "
                     "= 0: there is no warm start to take. Leave init_from empty, or set "
                     "warm_start.steps to the source run's.")
  config_path = os.path.join(source, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"config.warm_start.init_from = {source!r} holds no config.json (not a "
                     f"run's workdir); {make_one}.")
  with open(config_path) as f:
    theirs = warm_start_settings(json.load(f))
  mine = warm_start_settings(json.loads(config.to_json_best_effort()))
  for path in sorted(set(mine) | set(theirs)):
    if mine.get(path) != theirs.get(path):
      raise ValueError(
          f"config.warm_start.init_from = {source!r} was trained with config.{path} = "
          f"{theirs.get(path)!r}; this run has {mine.get(path)!r}, so that warm start is not "
          f"this run's. Set config.{path} to match, or {make_one}.")


def build_task(config: ml_collections.ConfigDict):
  """The run's task: config.task.name with its prompt style, seed, eval_size and difficulty
  fields (rl.tasks.make_task; a bad field or value is a ValueError naming it)."""
  return tasks.make_task(config.task.name, config.task.prompt_style, seed=config.seed,
                         eval_size=config.task.eval_size, **config.task.difficulty)


def build_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh | None:
  """The configured (data, fsdp, tensor) mesh over all devices of all processes, or None for
  the single-device default; every batch must split evenly over data x fsdp."""
  mesh_config = mesh_lib.MeshConfig(data=config.mesh.data, fsdp=config.mesh.fsdp,
                                    tensor=config.mesh.tensor)
  if mesh_config.is_single_device and jax.process_count() == 1:
    return None
  mesh = mesh_lib.make_mesh(mesh_config)
  shards = mesh_lib.batch_size_multiple(mesh)
  r = config.rollout
  micro, mini = config.rl.num_microbatches, config.rl.num_minibatches
  for name, rows, multiple, parts in (
      ("rollout.prompts_per_step * rollout.group_size", r.prompts_per_step * r.group_size,
       "mesh.data * mesh.fsdp * rl.num_minibatches * rl.num_microbatches", mini * micro),
      ("warm_start.batch_size", config.warm_start.batch_size,
       "mesh.data * mesh.fsdp * rl.num_microbatches", micro),
      ("eval.batch_size", config.eval.batch_size, "mesh.data * mesh.fsdp", 1)):
    divisor = shards * parts
    if rows % divisor:
      raise ValueError(f"config.{name} = {rows} does not split over the mesh: make it a "
                       f"multiple of {multiple} = {divisor}.")
  return mesh


def build_model_config(config, tokenizer):
  """The preset's shapes, with the tokenizer's vocabulary (the policy is trained from
  scratch) and room for prompt + completion."""
  model_config = model_configs.get_preset(config.model.preset, dtype=config.model.dtype,
                            vocab_size=tokenizer.vocab_size)
  return _with_room(config, model_config)


def _with_room(config, model_config):
  needed = config.rollout.prompt_len + config.rollout.max_new_tokens
  return model_config.replace(max_seq_len=max(model_config.max_seq_len, needed))


def load_policy(config, rng):
  """(tokenizer, model_config, initial params): from `config.model.checkpoint` (with
  `config.model.tokenizer`, if set) when set, else a from-scratch `config.model.preset`
  with the character tokenizer. experiments/eval.py resolves a run's policy here too."""
  checkpoint_spec = config.model.get("checkpoint")
  if checkpoint_spec:
    model_config, params, tokenizer = pretrained.load_pretrained(
        checkpoint_spec, config.model.dtype, chat=config.model.get("chat_template", False),
        tokenizer=config.model.get("tokenizer") or None)
    if tokenizer is None:
      raise ValueError(f"{checkpoint_spec} has no tokenizer.json; pass "
                       "config.model.tokenizer=<path> (a tokenizer.json file or a Hugging "
                       "Face folder that holds one, e.g. the base model's).")
    return tokenizer, _with_room(config, model_config), params
  tokenizer = tokenizers.CharTokenizer()
  model_config = build_model_config(config, tokenizer)
  return tokenizer, model_config, transformer.init_params(model_config, rng)


def length_buckets(config) -> tuple[int, ...]:
  """Sequence lengths (prompt_len + completion slots) the train step may cut batches to."""
  r = config.rollout
  return tuple(sorted(r.prompt_len + b for b in r.train_length_buckets if b < r.max_new_tokens))


def rl_loss_config(config) -> ml_collections.FrozenConfigDict:
  """config.loss as the GRPO train step reads it: norm_len 0 becomes the generation budget
  (rollout.max_new_tokens; `losses.resolve_norm_len`)."""
  return ml_collections.FrozenConfigDict(dict(
      config.loss, norm_len=losses.resolve_norm_len(config.loss.norm_len,
                                                    config.rollout.max_new_tokens)))


def make_context(config, task, tokenizer, model_config, phase, mesh=None):
  """The LoopContext (and optimizer) of one phase of the run (sharded over `mesh`, if any)."""
  if phase == WARM_START:
    rate = dict(learning_rate=config.warm_start.learning_rate,
                warmup_steps=config.warm_start.warmup_steps,
                decay_steps=max(config.warm_start.steps - config.warm_start.warmup_steps, 1),
                end_lr_fraction=0.1)
    optimizer = train.make_optimizer(**rate, max_grad_norm=config.rl.max_grad_norm)
    loss_config = ml_collections.FrozenConfigDict(dict(
        name="sft", aggregation="token_mean", norm_len=1.0))
    prompts = config.warm_start.batch_size
  else:
    rate = dict(learning_rate=config.rl.learning_rate, warmup_steps=config.rl.warmup_steps)
    optimizer = train.make_optimizer(**rate, weight_decay=config.rl.weight_decay,
                                     max_grad_norm=config.rl.max_grad_norm)
    loss_config = rl_loss_config(config)
    prompts = config.rollout.prompts_per_step
  sampling_config = sampler_lib.SamplingConfig(
      max_new_tokens=config.rollout.max_new_tokens, temperature=config.rollout.temperature,
      top_k=config.rollout.top_k, top_p=config.rollout.top_p,
      stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  # Prefix sharing needs groups of one prompt: GRPO batches, not the warm start's.
  shared_prefix = ((config.rollout.group_size, config.rollout.prompt_len)
                   if phase == RL and config.rl.prefix_shared_forward else None)
  # PPO minibatches / epochs are for rollout batches; the warm start takes one update each.
  updates = (dict(num_minibatches=config.rl.num_minibatches, ppo_epochs=config.rl.ppo_epochs)
             if phase == RL else {})
  step = train.make_train_step(model_config, optimizer, loss_config,
                               num_microbatches=config.rl.num_microbatches, **updates,
                               temperature=config.rollout.temperature if phase == RL else 1.0,
                               shared_prefix=shared_prefix, mesh=mesh,
                               length_buckets=length_buckets(config),
                               learning_rate=train.learning_rate_schedule(**rate),
                               lora=phase_lora(config, phase))
  sharded = {} if mesh is None else dict(
      generate_fn=rollout_lib.make_generate(model_config, sampling_config, mesh),
      publish=reshard.make_publish(mesh, jax.eval_shape(
          lambda: transformer.init_params(model_config, jax.random.PRNGKey(0)))))
  ctx = loop.LoopContext(
      task=task, tokenizer=tokenizer, model_config=model_config,
      sampling_config=sampling_config, prompt_len=config.rollout.prompt_len,
      prompts_per_step=prompts, group_size=config.rollout.group_size, train_step=step,
      advantage_fn=advantages.get_advantage_fn(config.advantage.name),
      staleness=staleness_in_batches(config) if phase == RL else 0,
      selection=ml_collections.FrozenConfigDict(config.selection),
      train_pool=config.task.train_pool, **sharded)
  if config.rollout.kind == "tree":
    ctx = dataclasses.replace(
        ctx, tree_policy=build_fork_policy(config.rollout.tree),
        tree_advantage_fn=advantages.get_tree_advantage_fn(config.rollout.tree.advantage))
  return ctx, optimizer


def phase_lora(config, phase: str) -> lora_lib.LoraConfig | None:
  """LoRA settings of `phase`: the RL phase's (`lora_config`); the warm start trains full
  weights."""
  return lora_config(config) if phase == RL else None


def lora_rng(seed: int) -> jax.Array:
  """The key the adapters' A matrices are drawn from: folded from the parameter key, so
  the launcher's other keys (and runs without LoRA) are unchanged."""
  init_rng, _ = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.fold_in(init_rng, 1)


def new_train_state(config, model_config, params, optimizer, phase: str, mesh=None):
  """The fresh TrainState of `phase` over `params`: full weights, or under LoRA in the RL
  phase adapters over `params` frozen; with a mesh, in the trainer's sharded layout. Eval
  builds the shapes of a checkpoint's state here too."""
  lora = phase_lora(config, phase)
  init = lambda p: train.init_train_state(p, optimizer, lora=lora, model_config=model_config,
                                          lora_rng=lora_rng(config.seed))
  if mesh is None:
    return init(params)
  return jax.jit(init, out_shardings=train.train_state_shardings(
      model_config, optimizer, mesh, lora=lora))(params)


def make_rl_producer(config, ctx):
  """The RL phase's batch producer (rl.loop.Producer; the one strategy-specific piece of
  the RL phase) and its partial-rollout pool (None unless rollout.kind='partial')."""
  rollouts = None
  produce = loop.make_producer(ctx)
  r = config.rollout
  if r.kind == "partial":
    slots = r.num_slots or 2 * r.prompts_per_step * r.group_size
    rollouts = partial_rollout.for_task(
        ctx, partial_lib.PartialConfig(num_slots=slots, group_size=r.group_size, resume=r.resume,
                           decode_window=r.decode_window),
        max_staleness=config.rl.max_staleness)
    produce = partial_rollout.producer(ctx, rollouts)
  return produce, rollouts


TIME_PARTS = ("warm_start", "rollout", "train", "eval")
ROLLOUT_PARTS = ("sample", "score")  # the rollout time's parts (rl.loop.produce_timed)
TOKEN_COUNTS = ("warm_start_trained", "sampled", "trained")


def add_counts(counts: list[int], more) -> list[int]:
  """Elementwise sum of two histograms of different lengths, as a list (JSON-able)."""
  total = [0] * max(len(counts), len(more))
  for i, c in enumerate(counts):
    total[i] += int(c)
  for i, c in enumerate(more):
    total[i] += int(c)
  return total


def accuracy_by_size_table(warm: dict, final: dict) -> dict[str, dict]:
  """{size: {examples, warm_start, final}} from two evaluation records."""
  return {size: {"examples": final["eval_examples_by_size"][size],
                 "warm_start": warm.get("eval_accuracy_by_size", {}).get(size),
                 "final": acc}
          for size, acc in sorted(final["eval_accuracy_by_size"].items(), key=lambda x: int(x[0]))}


def _new_meta() -> dict:
  """Run-level records kept in the checkpoint meta, so a resumed run reports the whole run:
  held-out evaluations, the histogram of RL rollout completion lengths, the prompts
  selection skipped, the wall time spent in each part (seconds; compilation counts where
  it happens; the rollout time also split into sample and score), the RL steps' wall time
  (time_rl_s: evaluations and checkpoints excluded, async rollout and training overlapping
  counted once) and its value at each evaluation (time_rl_at_evals_s: clocks stay out of the
  evaluation records), and the real tokens sampled and trained."""
  return {"phase": WARM_START, "data_cursor": 0, "iteration": 0, "evals": [],
          "completion_length_counts": [],
          "time_s": dict.fromkeys(TIME_PARTS + ROLLOUT_PARTS, 0.0),
          "prompts_skipped": 0, "tokens": dict.fromkeys(TOKEN_COUNTS, 0),
          "rl_metric_sums": {}, "rl_steps_recorded": 0, "time_rl_s": 0.0,
          "time_rl_at_evals_s": [], "eval_step_sums": []}


def _upgrade_meta(meta: dict) -> dict:
  """A restored meta with the records added since its checkpoint was written, zeroed."""
  meta.setdefault("prompts_skipped", 0)
  meta.setdefault("rl_metric_sums", {})
  meta.setdefault("rl_steps_recorded", 0)
  meta.setdefault("time_rl_s", 0.0)
  # Evaluations restored from a checkpoint written before their RL clock and step sums were
  # kept: a warm-start evaluation's are known (no RL yet); an RL one's are unknown (None).
  for name, before_rl in (("time_rl_at_evals_s", 0.0),
                          ("eval_step_sums", {"steps": 0, "sums": {}})):
    known = meta.setdefault(name, [])
    missing = meta["evals"][:len(meta["evals"]) - len(known)]
    meta[name] = [before_rl if e["phase"] == WARM_START else None for e in missing] + known
  for part in ROLLOUT_PARTS:
    meta["time_s"].setdefault(part, 0.0)
  meta.setdefault("tokens", {})
  for name in TOKEN_COUNTS:
    meta["tokens"].setdefault(name, 0)
  return meta


def add_step_metrics(meta: dict, step_metrics: dict) -> None:
  """Adds one RL step's clock-free metrics to meta's running sums (`rl_step_means`)."""
  sums = meta["rl_metric_sums"]
  for name, value in step_metrics.items():
    if not (name.startswith("time_") or name.endswith("_per_s")):
      sums[name] = sums.get(name, 0.0) + float(value)
  meta["rl_steps_recorded"] += 1


def rl_step_means(meta: dict) -> dict[str, float]:
  """Each RL step metric's mean over the run's RL steps (clip, mask and veto fractions,
  gradient norm, reward, ...; wall-clock fields left out). A metric some steps lack (e.g.
  one only a correction reports) is averaged over all steps, counting its absence as 0."""
  count = meta["rl_steps_recorded"]
  return {name: total / count for name, total in sorted(meta["rl_metric_sums"].items())
          } if count else {}


def step_means_between_evals(meta: dict) -> list[dict[str, float]]:
  """Per evaluation, each RL step metric's mean over the RL steps since the previous
  evaluation (empty where there were none, e.g. the warm start's; None where a restored
  checkpoint predates these records): how clip fractions, informative groups, rewards, ...
  move over the run, at the evaluations' resolution."""
  windows, previous = [], {"steps": 0, "sums": {}}
  for current in meta["eval_step_sums"]:
    if current is None or previous is None:  # restored from a checkpoint that lacked them
      windows.append(None)
      previous = current
      continue
    steps = current["steps"] - previous["steps"]
    windows.append({name: (total - previous["sums"].get(name, 0.0)) / steps
                    for name, total in sorted(current["sums"].items())} if steps else {})
    previous = current
  return windows


def accuracy_curve(meta: dict) -> list[dict]:
  """The run's held-out evaluations in order: step, event, accuracy and its stderr, and
  the RL tokens sampled before it (decoded: a tree's shared nodes once, every selection
  round's and every partial-rollout round's tokens)."""
  return [{"step": e["step"], "event": e["event"], "accuracy": e["eval_accuracy"],
           "stderr": e["eval_accuracy_stderr"], "sampled_tokens": e.get("sampled_tokens", 0)}
          for e in meta["evals"]]


def throughput_summary(meta: dict) -> dict:
  """The run's rollout time split into sample and score (parts of time_s.rollout), the
  real tokens sampled and trained (RL, and the warm start's trained), and the RL rates:
  sampled tokens per second of sampling, trained tokens per second of RL training."""
  time_s, tokens = meta["time_s"], meta["tokens"]
  per_second = lambda count, seconds: count / seconds if seconds > 0 else 0.0
  return {"rollout_time_s": {part: time_s[part] for part in ROLLOUT_PARTS},
          "tokens": dict(tokens),
          "sampled_tokens_per_s": per_second(tokens["sampled"], time_s["sample"]),
          "trained_tokens_per_s": per_second(tokens["trained"], time_s["train"])}


def _eval_record(result, step: int, phase: str, label: str, sampled_tokens: int) -> dict:
  """The metrics.jsonl record of one held-out evaluation (with the RL tokens sampled so far)."""
  record = {"step": step, "phase": phase, "event": label, "sampled_tokens": sampled_tokens,
            "eval_accuracy": result.accuracy, "eval_accuracy_stderr": result.accuracy_stderr,
            "eval_reward": result.mean_reward, "eval_length": result.mean_length}
  if result.accuracy_by_size:
    record["eval_accuracy_by_size"] = {str(k): acc for k, (_, acc) in
                                       result.accuracy_by_size.items()}
    record["eval_examples_by_size"] = {str(k): n for k, (n, _) in
                                       result.accuracy_by_size.items()}
  return record


class _Run:
  """One launcher job: its policy, task, phase contexts, checkpoints, logs and run-level
  records (`meta`), with the steps of `run` as methods. `done` counts the steps of both
  phases taken so far (the checkpoint step)."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.config = config
    self.started = time.time()
    d = config.distributed
    multihost.initialize(d.coordinator_address or None, d.num_processes or None,
                         None if d.process_id < 0 else d.process_id)
    self.mesh = build_mesh(config)
    self.primary = multihost.is_primary()
    os.makedirs(config.workdir, exist_ok=True)
    self.config_json = config.to_json_best_effort(indent=2, sort_keys=True)
    if self.primary:  # the resolved config of the latest launch, to reproduce the run
      with open(os.path.join(config.workdir, "config.json"), "w") as f:
        f.write(self.config_json)
    init_rng, loop_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    self.tokenizer, self.model_config, params = load_policy(config, init_rng)
    if lora_config(config) is not None:  # before the warm start, not after it
      lora_lib.check_rank(self.model_config, lora_config(config))
    self.task = build_task(config)
    self.eval_examples = self.task.examples("eval", config.task.eval_size)
    self.contexts = {phase: make_context(config, self.task, self.tokenizer, self.model_config,
                                         phase, self.mesh)
                     for phase in (WARM_START, RL)}
    if self.mesh is not None:  # a global array, so every process checkpoints the same key
      loop_rng = multihost.replicate(loop_rng, self.mesh)
    train_state = self.new_train_state(params, WARM_START)
    self.state = loop.LoopState(
        train=train_state, rng=loop_rng, history=self.history(train_state.params),
        selection=selection.init_state(config.task.train_pool, config.selection))
    self.meta = _new_meta()
    self.manager = checkpoint.make_manager(os.path.join(config.workdir, "checkpoints"),
                                           config.checkpoint.max_to_keep,
                                           remove_unfinished=True)
    if not config.resume and self.manager.latest_step() is not None:
      raise ValueError(f"config.resume=False but {config.workdir} already holds checkpoints "
                       f"(latest step {self.manager.latest_step()}); use a new "
                       "config.workdir or resume=True.")
    self.log = metrics.MetricsLog(
        os.path.join(config.workdir, "metrics.jsonl"),
        writers=metrics.make_writers(
            config.workdir, tensorboard=config.metrics.tensorboard,
            wandb_project=config.metrics.wandb_project,
            config=json.loads(self.config_json)) if self.primary else [])
    # Unfinished partial rollouts live in a zarr3 trajectory store.
    self.store = None
    if config.rollout.kind == "partial":
      self.store = trajectory_store.TrajectoryStore(os.path.join(config.workdir, "trajectories"))
    self.produce, self.rollouts = make_rl_producer(config, self.contexts[RL][0])
    self.phase_steps = {WARM_START: config.warm_start.steps, RL: config.rl.steps}
    self.done = 0
    self.bar = None

  def new_train_state(self, params, phase: str):
    """The fresh TrainState of `phase` over `params` (module-level `new_train_state`)."""
    return new_train_state(self.config, self.model_config, params, self.contexts[phase][1],
                           phase, self.mesh)

  def state_like(self, meta: dict) -> loop.LoopState:
    """The shapes of the LoopState a checkpoint with `meta` holds: its phase's TrainState
    (under LoRA the RL phase trains adapters over a frozen base, the warm start does not)."""
    lora = lora_config(self.config)
    if meta["phase"] == WARM_START or lora is None:
      return self.state
    optimizer = self.contexts[RL][1]
    train_like = jax.eval_shape(
        lambda p: new_train_state(self.config, self.model_config, p, optimizer, RL),
        self.state.train.params)
    history = (None if self.state.history is None
               else jax.eval_shape(self.history, train_like.params))
    if self.mesh is not None:  # restore straight into the trainer's layout
      placed = lambda like, sharding: jax.ShapeDtypeStruct(like.shape, like.dtype,
                                                           sharding=sharding)
      train_like = jax.tree.map(placed, train_like, train.train_state_shardings(
          self.model_config, optimizer, self.mesh, lora=lora))
      if history is not None:  # adapters and versions: small, replicated
        history = jax.tree.map(
            lambda like: placed(like, jax.sharding.NamedSharding(
                self.mesh, jax.sharding.PartitionSpec())), history)
    return self.state.replace(train=train_like, history=history)

  def history(self, params):
    """Simulated staleness's parameter history (None without staleness)."""
    staleness = staleness_in_batches(self.config)
    return loop.init_history(params, staleness) if staleness else None

  def restore_warm_start(self, source: str) -> tuple[int, loop.LoopState, dict]:
    """(step, state, meta) at the start of the RL phase, taken from the end-of-warm-start
    checkpoint of the run in `source` (config.warm_start.init_from) as if this run had
    trained it: its policy, loop key, data cursor and run records, with this run's fresh RL
    TrainState, staleness ring and selection state built over that policy exactly as
    `run_phase` builds them. Its metrics records up to that checkpoint are copied into this
    run's log, so the curves and the summary cover the whole run."""
    step = self.phase_steps[WARM_START]
    directory = os.path.join(source, "checkpoints")
    steps = (checkpoint.make_manager(directory).all_steps() if os.path.isdir(directory)
             else [])  # never create a folder in another run's workdir
    if step not in steps:
      raise ValueError(
          f"config.warm_start.init_from = {source!r} holds no checkpoint at the end of its "
          f"warm start (step {step}; it holds {sorted(steps)}): a run that went "
          "on into RL may have pruned it. Train a warm start alone with --config.rl.steps=0.")
    tree, meta = checkpoint.restore_tree(checkpoint.make_manager(directory), step)
    if meta["phase"] != RL or meta["iteration"] != 0:
      raise ValueError(f"{source} checkpoint {step} is not the end of a warm start (phase "
                       f"{meta['phase']!r}, iteration {meta['iteration']}).")
    trained = tree["train"]["frozen"] or tree["train"]["params"]
    # Each host array goes where this run's parameters live: one device, or with a mesh
    # the trainer's sharding (every process giving its own shards).
    params = jax.tree.map(
        lambda like, value: jax.make_array_from_callback(
            like.shape, like.sharding,
            lambda index: jax.numpy.asarray(value, like.dtype)[index]),
        self.state.train.params, trained)
    rng = jax.numpy.asarray(tree["rng"])
    if self.mesh is not None:
      rng = multihost.replicate(rng, self.mesh)
    train_state = self.new_train_state(params, RL)
    state = loop.LoopState(train=train_state, rng=rng, history=self.history(train_state.params),
                           selection=self.state.selection, data_cursor=meta["data_cursor"],
                           iteration=0)
    records = metrics.MetricsLog(os.path.join(source, "metrics.jsonl"), writers=[]).read()
    if self.primary:
      self.log.truncate_after(-1)
      for record in records[:meta["log_records"]]:
        self.log.write(record)
    kept = set(_new_meta()) | {"log_records"}  # not the source's digest or partial pool
    meta = {key: value for key, value in meta.items() if key in kept}
    meta["warm_start_from"] = os.path.abspath(source)
    return step, state, meta

  def restore_or_start(self) -> None:
    """Resumes from the newest checkpoint (config.resume), else starts RL from
    config.warm_start.init_from when set, else clears what a fresh run overwrites; then
    opens the progress bar at the step reached."""
    restored = (checkpoint.restore_latest(self.manager, self.state_like)
                if self.config.resume else None)
    source = self.config.warm_start.init_from
    from_source = restored is None and bool(source)
    if from_source:
      restored = self.restore_warm_start(source)
    if restored is not None:
      step, state, meta = restored
      meta = _upgrade_meta(meta)  # checkpoints written before some records existed
      self.state = state.replace(data_cursor=meta["data_cursor"], iteration=meta["iteration"])
      self.meta = meta
      if self.primary:
        self.log.truncate_to(meta["log_records"], step)
      if self.rollouts is not None and "partial_ledger" in meta:
        self.rollouts.load(self.store.load_pool(step, partial_rollout.POOL_FIELDS),
                           meta["partial_ledger"])
      if self.primary:  # absl logs only warnings here (see main), so say it plainly
        print(f"Starting RL from the warm start in {source}." if from_source else
              f"Resumed from step {step} ({meta['phase']} phase) in {self.config.workdir}.",
              flush=True)
    elif self.primary:
      self.log.truncate_after(-1)
    self.done = ((0 if self.meta["phase"] == WARM_START else self.phase_steps[WARM_START])
                 + self.state.iteration)
    if self.primary:  # once per launch, at the step it starts from
      self.log.write_text(self.done, "config", metrics.config_markdown(self.config_json))
    self.bar = tqdm.tqdm(total=sum(self.phase_steps.values()), initial=self.done,
                         desc=self.meta["phase"], dynamic_ncols=True, disable=not self.primary)

  def save(self) -> None:
    """Checkpoints the loop state and run records at step `done`."""
    extra = {}
    if self.rollouts is not None:  # the pool snapshot first: the checkpoint is the commit point
      self.store.save_pool(self.done, self.rollouts.arrays())
      extra["partial_ledger"] = self.rollouts.ledger.as_dict()
    state = self.state
    checkpoint.save(self.manager, self.done, state,
                    dict(self.meta, data_cursor=state.data_cursor, iteration=state.iteration,
                         log_records=len(self.log.read()), **extra))
    self.log.flush()  # TensorBoard events up to the checkpoint reach disk with it
    if self.rollouts is not None:
      self.store.prune(self.manager.all_steps())

  def record_step(self, phase: str, step_metrics: dict) -> None:
    """Counts one step and logs its metrics; folds its lengths, skips and times into meta."""
    self.done += 1
    step_metrics = dict(step_metrics)
    counts = step_metrics.pop("completion_length_counts", None)
    if counts is not None:
      self.meta["completion_length_counts"] = add_counts(self.meta["completion_length_counts"],
                                                         counts)
    self.meta["prompts_skipped"] += int(step_metrics.get("prompts_skipped", 0))
    tokens = self.meta["tokens"]
    if phase == WARM_START:  # its time is counted whole, in advance()
      tokens["warm_start_trained"] += int(step_metrics.get("trained_tokens", 0))
    else:
      for part in ("rollout", "train") + ROLLOUT_PARTS:
        self.meta["time_s"][part] += float(step_metrics.get(f"time_{part}_s", 0.0))
      tokens["sampled"] += int(step_metrics.get("sampled_tokens", 0))
      tokens["trained"] += int(step_metrics.get("trained_tokens", 0))
      add_step_metrics(self.meta, step_metrics)
    record = {"step": self.done, "phase": phase,
              **{k: float(v) for k, v in step_metrics.items()}}
    if self.primary:
      self.log.write(record)
    self.bar.update(1)
    self.bar.set_postfix({k: f"{record[k]:.3f}" for k in ("loss", "reward_mean") if k in record})

  def evaluate(self, label: str) -> None:
    """Greedy held-out evaluation of the current parameters, logged and kept in meta."""
    eval_started = time.perf_counter()
    config = self.config
    result = evaluation.evaluate(
        self.state.train.policy_params(), self.eval_examples, task=self.task,
        tokenizer=self.tokenizer, prompt_len=config.rollout.prompt_len,
        max_new_tokens=config.rollout.max_new_tokens, model_config=self.model_config,
        batch_size=config.eval.batch_size, mesh=self.mesh)
    eval_s = time.perf_counter() - eval_started
    self.meta["time_s"]["eval"] += eval_s
    record = _eval_record(result, self.done, self.meta["phase"], label,
                          self.meta["tokens"]["sampled"])
    self.meta["evals"].append(record)
    self.meta["time_rl_at_evals_s"].append(self.meta["time_rl_s"])
    self.meta["eval_step_sums"].append({"steps": self.meta["rl_steps_recorded"],
                                        "sums": dict(self.meta["rl_metric_sums"])})
    if self.primary:  # its wall time goes to the log only: meta's records stay clock-free
      self.log.write(dict(record, time_eval_s=eval_s, time_rl_s=self.meta["time_rl_s"]))
    self.bar.write(f"[step {self.done}] {label}: held-out accuracy {result.accuracy:.3f}, "
                   f"mean reward {result.mean_reward:.3f}")

  def advance(self, phase: str) -> None:
    """One step of `phase` (for async RL: every step up to the next evaluation, checkpoint
    or the end; nothing is in flight after it)."""
    config, ctx = self.config, self.contexts[phase][0]
    if phase == WARM_START:
      step_started = time.perf_counter()
      self.state, step_metrics = loop.sft_iteration(self.state, ctx,
                                                    config.warm_start.length_window)
      self.meta["time_s"]["warm_start"] += time.perf_counter() - step_started
      self.record_step(phase, step_metrics)
    elif config.rl.async_:
      boundary = min(self.phase_steps[phase],
                     *((self.state.iteration // every + 1) * every
                       for every in (config.eval.every, config.checkpoint.every)))
      self.state, _ = async_loop.run_async(
          self.state, ctx, self.produce, boundary - self.state.iteration,
          max_staleness=config.rl.max_staleness, publish=ctx.publish or (lambda p: p),
          updates_per_batch=updates_per_batch(config),
          on_step=lambda _, step_metrics: self.record_step(RL, step_metrics))
    else:
      self.state, step_metrics = loop.grpo_iteration(self.state, ctx, self.produce)
      self.record_step(phase, step_metrics)

  def run_phase(self, phase: str) -> None:
    """Steps `phase` to its end, evaluating (RL) and checkpointing on schedule; the warm
    start ends with an evaluation and hands its parameters to RL with a fresh optimiser."""
    self.bar.set_description(phase)
    while self.state.iteration < self.phase_steps[phase]:
      started = time.perf_counter()
      self.advance(phase)
      if phase == RL:
        self.meta["time_rl_s"] += time.perf_counter() - started
      iteration = self.state.iteration
      if phase == RL and iteration % self.config.eval.every == 0:
        self.evaluate("eval")
      if iteration % self.config.checkpoint.every == 0 and iteration < self.phase_steps[phase]:
        self.save()  # the phase's last step is saved below
    if phase == WARM_START:
      self.evaluate("warm_start_end")
      self.meta["phase"] = RL
      train_state = self.new_train_state(self.state.train.params, RL)
      self.state = loop.LoopState(
          train=train_state, rng=self.state.rng,
          history=self.history(train_state.params), selection=self.state.selection,
          data_cursor=self.state.data_cursor, iteration=0)
      self.save()

  def finish(self) -> dict:
    """The final evaluation and checkpoint (if the schedule did not just make them), then
    summary.json and plot.png; returns the summary."""
    self.bar.close()
    last = self.meta["evals"][-1]
    if self.config.rl.steps and (last["step"] != self.done or last["event"] != "eval"):
      self.evaluate("eval")
    if self.manager.latest_step() != self.done:
      self.save()
    summary = self.summary()
    if self.primary:
      with open(os.path.join(self.config.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
      self.log.close()  # every writer's events on disk, the W&B run finished
      metrics.plot_run(self.log.read(), os.path.join(self.config.workdir, "plot.png"))
    return summary

  def summary(self) -> dict:
    """Held-out accuracies (warm start and final, with standard errors and by size), steps,
    wall time and its split, rollout lengths, the selection / partial counts, and the
    tokens sampled and trained with their rates (`throughput_summary`)."""
    meta = self.meta
    warm = next(e for e in meta["evals"] if e["event"] == "warm_start_end")
    final = meta["evals"][-1]
    summary = {"warm_start_accuracy": warm["eval_accuracy"],
               "final_accuracy": final["eval_accuracy"],
               "warm_start_accuracy_stderr": warm["eval_accuracy_stderr"],
               "final_accuracy_stderr": final["eval_accuracy_stderr"],
               "warm_start_reward": warm["eval_reward"], "final_reward": final["eval_reward"],
               "steps": self.done, "wall_time_s": time.time() - self.started,
               "time_s": {part: meta["time_s"][part] for part in TIME_PARTS},
               "rollout_completion_length": metrics.length_stats(
                   meta["completion_length_counts"]),
               "prompts_skipped": meta["prompts_skipped"],
               "nonfinite_updates": int(multihost.fetch(self.state.train.nonfinite_updates)),
               **throughput_summary(meta)}
    if "eval_accuracy_by_size" in final:
      summary["accuracy_by_size"] = accuracy_by_size_table(warm, final)
    if self.rollouts is not None:
      summary["partial_ledger"] = self.rollouts.ledger.as_dict()
    summary["accuracy_curve"] = accuracy_curve(meta)
    summary["time_rl_s"] = meta["time_rl_s"]
    summary["time_rl_at_evals_s"] = list(meta["time_rl_at_evals_s"])
    summary["rl_step_means"] = rl_step_means(meta)
    summary["rl_step_means_between_evals"] = step_means_between_evals(meta)
    if "warm_start_from" in meta:
      summary["warm_start_from"] = meta["warm_start_from"]
    return summary


def run(config: ml_collections.ConfigDict) -> dict:
  """Runs (or resumes) the configured job and returns its summary."""
  validate(config)
  job = _Run(config)
  job.restore_or_start()
  for phase in (WARM_START, RL):
    if job.meta["phase"] == phase:
      job.run_phase(phase)
  return job.finish()


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  summary = run(_CONFIG.value)
  print(f"Warm-start held-out accuracy: {summary['warm_start_accuracy']:.3f} "
        f"+- {summary['warm_start_accuracy_stderr']:.3f}")
  print(f"Final held-out accuracy:      {summary['final_accuracy']:.3f} "
        f"+- {summary['final_accuracy_stderr']:.3f}  "
        f"({100 * (summary['final_accuracy'] - summary['warm_start_accuracy']):+.1f} points)")
  if "accuracy_by_size" in summary:
    print("Held-out accuracy by problem size (examples: warm start -> final):")
    for size, row in summary["accuracy_by_size"].items():
      before = "  -  " if row["warm_start"] is None else f"{row['warm_start']:.3f}"
      print(f"  size {size:>3} ({row['examples']:>4}): {before} -> {row['final']:.3f}")
  lengths = summary["rollout_completion_length"]
  if lengths:
    print(f"Rollout completion lengths (tokens): median {lengths['median']}, p95 "
          f"{lengths['p95']}, max {lengths['max']}")
  print(f"Throughput: {summary['sampled_tokens_per_s']:.0f} tokens/s sampled, "
        f"{summary['trained_tokens_per_s']:.0f} tokens/s trained (RL)")
  split = ", ".join(f"{part} {seconds:.0f} s" for part, seconds in summary["time_s"].items())
  print(f"Wall time: {summary['wall_time_s']:.0f} s ({split}); outputs in "
        f"{_CONFIG.value.workdir}")


if __name__ == "__main__":
  app.run(main, flags_parser=config_flag.parse_flags)
