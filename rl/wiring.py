"""A run's configuration turned into the objects that run it: the config checked
(`validate`: every inconsistent field refused with the fix, before anything is built), then
the task, the device mesh, the policy, each phase's LoopContext and optimiser, its fresh
TrainState and the RL phase's batch producer.

The launcher (`python -m experiments.train`) calls these, and so do held-out evaluation
(experiments/eval.py), the configuration reference and anything else that needs a run's
objects from its config: one place builds them. The config is the ml_collections
ConfigDict of experiments/configs/default.py (docs/configuration.md lists every field).

A run has two phases, `WARM_START` (supervised, on the task's reference answers) and `RL`.
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from models import config as model_configs
from models import lora as lora_lib
from models import pretrained
from models import tokenizer as tokenizers
from models import transformer
from rl import checkpoint
from rl import environments
from rl import loop
from rl import tasks
from rl import train
from rl.objectives import advantages
from rl.objectives import distillation
from rl.objectives import losses
from rl.rollouts import batches as rollout_lib
from rl.rollouts import kinds
from rl.rollouts import partial as partial_rollout
from rl.rollouts import producers
from rl.rollouts import selection
from rl.rollouts import turns as turns_lib
from rl.tasks import dataset as dataset_task
from sampling import sampler as sampler_lib
from sampling import speculative
from sharding import mesh as mesh_lib
from sharding import reshard

WARM_START, RL = "warm_start", "rl"


def rows_per_prompt(config) -> int:
  """Sequences per prompt in an RL batch: group_size, or the tree's leaf budget."""
  return kinds.ROLLOUT_KINDS.get(config.rollout.kind).rows_per_prompt(config)


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
    + [("distill.coef", 0, True, None), ("distill.top_k", 1, True, None)]
    + [("rl.logprob_chunk", 0, True, None)]
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
    if value is None and path.removeprefix("loss.") in losses.OBJECTIVE_FIXABLE:
      continue  # unset: the objective's value, else LOSS_DEFAULTS'
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
  if config.model.compute_dtype not in ("", "float32", "bfloat16"):
    raise ValueError(f"config.model.compute_dtype = {config.model.compute_dtype!r}; use '' "
                     "(config.model.dtype), 'float32' or 'bfloat16' (mixed precision: "
                     "model.dtype='float32', model.compute_dtype='bfloat16').")
  losses.check_config(config.loss)
  losses.check_settings_read(config.loss)
  advantages.get_advantage_fn(config.advantage.name)
  distillation.DISTILL_OBJECTIVES.get(config.distill.objective)
  kinds.ROLLOUT_KINDS.get(config.rollout.kind).check(config)


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
  rollout_kind = kinds.ROLLOUT_KINDS.get(r.kind)
  if not rollout_kind.any_selection and kind != "uniform":
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
  if not rollout_kind.mesh and not single_device:
    raise ValueError(f"config.rollout.kind = {r.kind!r} decodes on one device; the sharded "
                     f"sampler (mesh data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) decodes "
                     "independent samples only. Use rollout.kind='independent' or mesh.data = "
                     "mesh.fsdp = mesh.tensor = 1.")


_TOOL_DEFAULTS = dict(max_turns=16, max_observation_tokens=32, timeout_s=0.0)


def tool_config(config: ml_collections.ConfigDict) -> turns_lib.ToolConfig | None:
  """config.tools as the rollouts' ToolConfig; None when config.tools.name is empty (then
  a budget changed from its default is refused: it would be ignored)."""
  t = config.get("tools")  # a config.json from before tools has none
  if t is None:
    return None
  if not t.name:
    changed = [k for k, v in _TOOL_DEFAULTS.items() if t[k] != v]
    if changed:
      raise ValueError(f"config.tools.{changed[0]} = {t[changed[0]]!r} has no effect without "
                       "an environment: set config.tools.name (e.g. 'adder'), or leave it at "
                       f"its default {_TOOL_DEFAULTS[changed[0]]!r}.")
    return None
  return turns_lib.ToolConfig(max_turns=t.max_turns, max_observation_tokens=t.max_observation_tokens,
                              timeout_s=float(t.timeout_s))


def check_tools(config: ml_collections.ConfigDict) -> None:
  """Refuses an unknown environment, demonstrations of a tool the run does not have, and
  what rollouts with turns do not compose with."""
  tools = tool_config(config)
  share = config.task.difficulty.get("tool_share", 0.0)
  if tools is None and share:
    raise ValueError(f"config.task.difficulty.tool_share = {share} demonstrates the adder, "
                     "but the run has no environment to answer it (the policy would be "
                     "trained to write the tool's answers itself): set "
                     "config.tools.name='adder', or tool_share=0.")
  if tools is None:
    return
  environments.ENVIRONMENTS.get(config.tools.name)
  r = config.rollout
  if r.kind == "tree":
    raise ValueError("config.tools.name with config.rollout.kind='tree': a tree forks rows "
                     "that share a prefix, and an environment's answer would have to be "
                     "copied into every branch of it; use rollout.kind='independent' or "
                     "'partial' with tools.")
  if r.kind == "partial" and r.resume != "reprefill":
    raise ValueError(f"config.tools.name with config.rollout.resume = {r.resume!r}: a row "
                     "the environment answered must re-encode its prefix, which 'kept_kv' "
                     "does not; set config.rollout.resume='reprefill'.")
  if r.speculative.tokens:
    raise ValueError("config.tools.name with config.rollout.speculative.tokens > 0: "
                     "speculative decoding does not pause rows at tool calls; set "
                     "rollout.speculative.tokens=0.")
  if config.rl.prefix_shared_forward:
    raise ValueError("config.tools.name with config.rl.prefix_shared_forward: environment "
                     "answers are context after the prompt, which the prefix-shared forward "
                     "does not allow; turn config.rl.prefix_shared_forward off.")
  m = config.mesh
  if not mesh_lib.MeshConfig(data=m.data, fsdp=m.fsdp, tensor=m.tensor).is_single_device:
    raise ValueError("config.tools.name runs turns on one device; set mesh.data = mesh.fsdp "
                     "= mesh.tensor = 1.")


def make_turns(config, tokenizer) -> turns_lib.Turns | None:
  """The environment config.tools names with its budgets, for the run's tokenizer (None
  when config.tools.name is empty)."""
  tools = tool_config(config)
  if tools is None:
    return None
  return turns_lib.Turns(environments.make_environment(config.tools.name), tokenizer, tools)


def check_distill(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for a distillation setting that would be ignored or cannot run."""
  d = config.distill
  if bool(d.teacher) != (d.coef > 0):
    raise ValueError(
        f"config.distill.teacher = {d.teacher!r} with config.distill.coef = {d.coef}: "
        "distillation needs both a teacher and a coefficient > 0 (or neither).")
  if not d.with_reward and not d.teacher:
    raise ValueError("config.distill.with_reward = False drops the policy objective: it needs "
                     "a teacher (config.distill.teacher and coef > 0), or nothing trains.")
  if d.teacher and config.rl.prefix_shared_forward:
    raise ValueError("config.distill needs the full per-token distributions of the batch; "
                     "turn config.rl.prefix_shared_forward off.")


def draft_config(config: ml_collections.ConfigDict) -> speculative.DraftConfig | None:
  """config.rollout.speculative as the sampler's DraftConfig; None when tokens = 0."""
  s = config.rollout.speculative
  if not s.tokens:
    return None
  return speculative.DraftConfig(tokens=s.tokens, sources=tuple(s.sources), ngram=s.ngram,
                                 group_size=config.rollout.group_size)


def check_speculative(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for speculative settings the launcher cannot run: other rollout
  kinds than independent samples, a mesh, the 'history' source without a finite prompt
  pool, or 'group' drafts with adaptive selection (whose groups differ in size)."""
  s = config.rollout.speculative
  if s.tokens < 0 or s.ngram < 1:
    raise ValueError(f"config.rollout.speculative.tokens = {s.tokens} must be >= 0 (0 = off) "
                     f"and ngram = {s.ngram} >= 1.")
  if not s.tokens:
    return
  if config.rollout.kind != "independent":
    raise ValueError(f"config.rollout.speculative decodes independent samples; "
                     f"config.rollout.kind = {config.rollout.kind!r} has its own decode loop. "
                     "Use kind='independent' or speculative.tokens=0.")
  if not mesh_lib.MeshConfig(data=config.mesh.data, fsdp=config.mesh.fsdp,
                            tensor=config.mesh.tensor).is_single_device:
    raise ValueError("config.rollout.speculative runs on one device; set the mesh to 1, 1, 1 "
                     "or speculative.tokens=0.")
  if "history" in s.sources and not config.task.train_pool:
    raise ValueError("config.rollout.speculative.sources 'history' drafts from a prompt's "
                     "completion at its previous visit: it needs prompts that come back, "
                     "config.task.train_pool > 0.")
  if "group" in s.sources and config.selection.kind == "adaptive":
    raise ValueError("config.rollout.speculative.sources 'group' needs groups of "
                     "config.rollout.group_size rows; config.selection.kind='adaptive' sizes "
                     "them per prompt. Use prompt_lookup or another selection kind.")
  draft_config(config)  # bad sources or sizes fail here


def lora_config(config: ml_collections.ConfigDict) -> lora_lib.LoraConfig | None:
  """The RL phase's LoRA settings (models/lora.py), or None when config.lora.rank = 0.

  Raises ValueError for a bad rank, alpha or target name, and for alpha or targets changed
  while LoRA is off (they would be accepted and then ignored)."""
  lora = config.lora
  if isinstance(lora.rank, bool) or not isinstance(lora.rank, int):
    raise ValueError(f"config.lora.rank = {lora.rank!r} must be an integer (0 = LoRA off).")
  if lora.rank == 0:
    defaults = {"alpha": lora_lib.DEFAULT_ALPHA, "targets": lora_lib.TARGETS}
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
def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the inconsistent fields and how to fix them. The launcher calls
  it before anything else, so a bad config fails before the first training step."""
  check_ranges(config)
  check_names(config)
  r = config.rollout
  rollout_kind = kinds.ROLLOUT_KINDS.get(r.kind)
  rows = r.prompts_per_step * rows_per_prompt(config)
  rl_parts = config.rl.num_minibatches * config.rl.num_microbatches
  if rows % rl_parts:
    raise ValueError(f"config.rollout.prompts_per_step * group_size = {rows} is not divisible "
                     f"by config.rl.num_minibatches * num_microbatches = {rl_parts} (with "
                     "kind='tree', group_size is the tree's leaf budget).")
  if config.warm_start.batch_size % config.rl.num_microbatches:
    raise ValueError(f"config.warm_start.batch_size = {config.warm_start.batch_size} is not "
                     f"divisible by config.rl.num_microbatches = {config.rl.num_microbatches}.")
  if config.rl.prefix_shared_forward and not rollout_kind.identical_prompt_groups:
    raise ValueError(f"config.rl.prefix_shared_forward needs groups of G independent samples of "
                     f"one prompt (config.rollout.kind='independent'), got {r.kind!r}.")
  if config.rl.prefix_shared_forward and r.prompts_per_step % rl_parts:
    raise ValueError(f"config.rl.prefix_shared_forward needs whole groups per microbatch: "
                     f"config.rollout.prompts_per_step = {r.prompts_per_step} must be divisible "
                     f"by config.rl.num_minibatches * num_microbatches = {rl_parts}.")
  if config.rl.prefix_shared_forward and config.rl.logprob_chunk:
    raise ValueError("config.rl.logprob_chunk chunks the plain forward's log-probs; the "
                     "prefix-shared forward has its own layout: turn one of them off.")
  if config.model.remat not in transformer.REMAT_POLICIES:
    raise ValueError(f"config.model.remat = {config.model.remat!r}; use one of "
                     f"{', '.join(transformer.REMAT_POLICIES)}.")
  check_speculative(config)
  if config.loss.kl_coef:
    raise ValueError(f"config.loss.kl_coef = {config.loss.kl_coef}: the launcher has no "
                     "reference policy to take a KL to (no reference forward is wired in). "
                     "Set config.loss.kl_coef=0; to keep the policy near another one, use "
                     "on-policy distillation (config.distill.teacher, docs/distillation.md).")
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
  if rollout_kind.group_relative and r.group_size < 2:
    raise ValueError(f"config.rollout.group_size = {r.group_size}: group-relative advantages "
                     "need at least 2 completions per prompt.")
  if any(b < 1 for b in r.train_length_buckets):
    raise ValueError(f"config.rollout.train_length_buckets = {r.train_length_buckets}: every "
                     "bucket must be a positive number of completion slots.")
  check_composition(config)
  check_tools(config)
  check_distill(config)
  lora_config(config)
  selection.check_config(config.selection, prompts_per_step=r.prompts_per_step,
                         group_size=r.group_size, pool_size=config.task.train_pool)
  build_task(config)  # a task's own settings (difficulty fields, prompt style) fail here
  if config.warm_start.init_from:
    check_warm_start_source(config)


# The config fields that decide what a warm start trains: a run may start its RL phase from
# another run's warm start (config.warm_start.init_from) only when these agree
# (task.train_pool excepted: the warm start reads the unbounded train split whatever it is;
# model.remat too: it trades memory for compute and trains the same policy).
WARM_START_FIELDS = ("seed", "task", "model", "warm_start", "rollout.prompt_len",
                     "rollout.max_new_tokens", "rollout.train_length_buckets",
                     "rl.max_grad_norm", "rl.num_microbatches", "tools.name")
# Fields of WARM_START_FIELDS added after runs were made: a config.json without one was
# trained with its default.
_ADDED_WARM_START_DEFAULTS = {"model.compute_dtype": "", "tools.name": "",
                              "task.difficulty.tool_share": 0.0,
                              **{f"task.{field}": default for field, default
                                 in dataset_task.CONFIG_DEFAULTS.items()}}


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
  settings.pop("model.remat", None)  # what the backward keeps, not what is trained
  for path, default in _ADDED_WARM_START_DEFAULTS.items():
    settings.setdefault(path, default)
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
  fields, and for the dataset task its files and fields (config.task.path, ...;
  rl.tasks.dataset.config_settings, which refuses them set for another task). A bad field
  or value is a ValueError naming it (rl.tasks.make_task)."""
  files = dataset_task.config_settings(config.task)
  return tasks.make_task(config.task.name, config.task.prompt_style, seed=config.seed,
                         eval_size=config.task.eval_size, **files, **config.task.difficulty)


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
  """The model config as the run uses it: room for prompt + completion, and the run's
  rematerialisation policy and compute dtype."""
  needed = config.rollout.prompt_len + config.rollout.max_new_tokens
  return model_config.replace(max_seq_len=max(model_config.max_seq_len, needed),
                              remat=config.model.get("remat", "none"),
                              compute_dtype=config.model.get("compute_dtype", ""))


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


def _vocabulary(tokenizer) -> tuple:
  """What makes two tokenizers the same: every id's text and the special ids."""
  return (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id,
          tuple(tokenizer.decode([i]) for i in range(tokenizer.vocab_size)))


def run_policy(workdir: str):
  """(tokenizer, model_config, params) of the newest checkpoint of the Arbor run in
  `workdir` (its config.json says how its policy was built; LoRA adapters are merged)."""
  with open(os.path.join(workdir, "config.json")) as f:
    run = ml_collections.ConfigDict(json.load(f))
  tokenizer, model_config, _ = load_policy(run, jax.random.PRNGKey(0))
  manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"))
  if manager.latest_step() is None:
    raise ValueError(f"config.distill.teacher = {workdir!r} holds no checkpoint yet.")
  tree, _ = checkpoint.restore_tree(manager, manager.latest_step())
  trained = tree["train"]
  params = trained["params"]
  if trained.get("frozen") is not None:  # a LoRA run: the adapters merged into the base
    params = lora_lib.merge(trained["frozen"], params, run.lora.alpha / run.lora.rank)
  return tokenizer, model_config, params


def load_teacher(config, tokenizer):
  """(params, ModelConfig) of the frozen teacher config.distill.teacher names: an Arbor
  workdir (its newest checkpoint), a HF folder, a .gguf file or 'smollm2'. Refused unless
  its tokenizer is the student's (every token and the special ids) and its context holds a
  rollout (prompt_len + max_new_tokens)."""
  spec = config.distill.teacher
  if os.path.isdir(os.path.join(spec, "checkpoints")):
    teacher_tokenizer, teacher_config, params = run_policy(spec)
  else:
    teacher_config, params, teacher_tokenizer = pretrained.load_pretrained(
        spec, config.model.dtype, chat=config.model.get("chat_template", False),
        tokenizer=config.model.get("tokenizer") or None)
  if teacher_tokenizer is None or _vocabulary(teacher_tokenizer) != _vocabulary(tokenizer):
    raise ValueError(f"config.distill.teacher = {spec!r} has another tokenizer than the "
                     "student (its vocabulary or special tokens differ): distillation compares "
                     "the two distributions token by token, so they must share one.")
  needed = config.rollout.prompt_len + config.rollout.max_new_tokens
  if teacher_config.max_seq_len < needed:
    raise ValueError(f"config.distill.teacher = {spec!r} has a context of "
                     f"{teacher_config.max_seq_len} tokens, shorter than a rollout "
                     f"(rollout.prompt_len + max_new_tokens = {needed}).")
  if config.distill.top_k > teacher_config.vocab_size:
    raise ValueError(f"config.distill.top_k = {config.distill.top_k} exceeds the vocabulary "
                     f"({teacher_config.vocab_size} tokens).")
  return params, teacher_config


def length_buckets(config) -> tuple[int, ...]:
  """Sequence lengths (prompt_len + completion slots) the train step may cut batches to."""
  r = config.rollout
  return tuple(sorted(r.prompt_len + b for b in r.train_length_buckets if b < r.max_new_tokens))


def rl_loss_config(config) -> ml_collections.FrozenConfigDict:
  """config.loss as the GRPO train step reads it: the unset fields an objective may fix
  (None) take the objective's values, else LOSS_DEFAULTS' (so an objective registered as a
  plain function reads numbers), and norm_len 0 becomes the generation budget
  (rollout.max_new_tokens; `losses.resolve_norm_len`)."""
  resolved = losses.resolve_config(
      config.loss, getattr(losses.get_loss(config.loss.name), "overrides", None))
  unset = {field: getattr(resolved, field) for field in losses.OBJECTIVE_FIXABLE
           if config.loss.get(field) is None}
  return ml_collections.FrozenConfigDict(dict(
      config.loss, **unset, norm_len=losses.resolve_norm_len(config.loss.norm_len,
                                                             config.rollout.max_new_tokens)))


def make_context(config, task, tokenizer, model_config, phase, mesh=None, teacher=None):
  """The LoopContext (and optimizer) of one phase of the run (sharded over `mesh`, if any);
  `teacher` = (params, ModelConfig) from `load_teacher` makes the RL phase's train step
  distil (config.distill)."""
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
                               lora=phase_lora(config, phase),
                               logprob_chunk=config.rl.logprob_chunk,
                               **(distill_settings(config, teacher) if phase == RL else {}))
  drafts = draft_config(config) if phase == RL else None
  turns = make_turns(config, tokenizer)
  sharded = {} if mesh is None else dict(
      generate_fn=rollout_lib.make_generate(model_config, sampling_config, mesh),
      publish=reshard.make_publish(mesh, jax.eval_shape(
          lambda: transformer.init_params(model_config, jax.random.PRNGKey(0)))))
  batch = producers.BatchContext(
      task=task, tokenizer=tokenizer, model_config=model_config,
      sampling_config=sampling_config, prompt_len=config.rollout.prompt_len,
      prompts_per_step=prompts, group_size=config.rollout.group_size,
      train_pool=config.task.train_pool,
      keep_completions=drafts is not None and "history" in drafts.sources, turns=turns,
      generate_fn=(rollout_lib.make_generate(model_config, sampling_config,
                                             draft_config=drafts) if drafts is not None else
                   partial_rollout.make_turns_generate(model_config, sampling_config, turns)
                   if turns is not None else sharded.get("generate_fn")))
  ctx = loop.LoopContext(
      batch=batch, train_step=step,
      batch_advantages=kinds.ROLLOUT_KINDS.get(config.rollout.kind).batch_advantages(config),
      staleness=staleness_in_batches(config) if phase == RL else 0,
      publish=sharded.get("publish"))
  return ctx, optimizer


def distill_settings(config, teacher) -> dict:
  """make_train_step's distillation arguments: none without a teacher."""
  if teacher is None:
    return {}
  params, teacher_config = teacher
  d = config.distill
  return dict(distill=distillation.Distill(
      objective=d.objective, coef=float(d.coef), with_reward=bool(d.with_reward),
      top_k=int(d.top_k), teacher_config=teacher_config), teacher_params=params)


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


def make_rl_producer(config, ctx) -> producers.Producer:
  """The RL phase's batch producer (the one strategy-specific piece of the RL phase) for
  the RL LoopContext `ctx`: config.rollout.kind's entry of rl.rollouts.kinds."""
  return kinds.ROLLOUT_KINDS.get(config.rollout.kind).make_producer(config, ctx.batch)


def loop_state_like(config, model_config, params_like, phase: str, optimizer,
                    producer: producers.Producer | None) -> loop.LoopState:
  """The shapes of the LoopState a checkpoint of `phase` holds (unsharded): the phase's
  TrainState over parameters shaped like `params_like`, the staleness ring when
  config.rl.staleness is set, and the producer state (the warm start's data cursor; the RL
  `producer`'s state as `for_checkpoint` keeps it). Restoring with it reads every leaf."""
  train_like = jax.eval_shape(
      lambda p: new_train_state(config, model_config, p, optimizer, phase), params_like)
  staleness = staleness_in_batches(config)
  history = (jax.eval_shape(lambda p: loop.init_history(p, staleness), train_like.params)
             if staleness else None)
  if phase == WARM_START:
    producer_state = producers.CursorState(cursor=producers.cursor_array(0))
  else:
    producer_state = producer.for_checkpoint(producer.init(0))
  return loop.LoopState(train=train_like, rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
                        history=history, producer=producer_state)
