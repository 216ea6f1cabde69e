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

import functools
import json

import jax
import ml_collections

from models import lora as lora_lib
from models import quantize
from models import transformer
import rl.extensions  # registers the batch stages of rl/extensions/  # pylint: disable=unused-import
from rl import composition
from rl import loop
from rl import policy
from rl import rewards
from rl import samples
from rl import stages
from rl import tasks
from rl import train
from rl import warm_start
from rl.environments import turns as turns_lib
from rl.objectives import advantages
from rl.objectives import composite
from rl.objectives import distillation
from rl.objectives import losses
from rl.objectives import token_subsample as subsample_lib
from rl.rollouts import kinds
from rl.rollouts import producers
from rl.rollouts import sampler_topk
from rl.rollouts import samplers
from rl.rollouts import selection
from rl.settings import run as run_lib
from rl.settings.dataset import DatasetSettings
from rl.settings.distill import DistillSettings
from rl.settings.tools import ToolSettings
from sampling import sampler as sampler_lib
from sampling import speculative
from sharding import mesh as mesh_lib
from sharding import reshard

WARM_START, RL = "warm_start", "rl"


def settings(config) -> run_lib.RunSettings:
  """The run's config read into its typed settings (rl/settings/)."""
  return run_lib.RunSettings.from_config(config)


def staleness_in_batches(config) -> int:
  """Simulated staleness in whole batches, as the loop applies it (`RLSettings`)."""
  return run_lib.RLSettings.from_config(config.rl).staleness_in_batches


def tool_settings(config) -> ToolSettings:
  """config.tools, typed (a config.json from before tools has none: no environment)."""
  return ToolSettings.from_config(config.get("tools") or {})


def make_turns(config, tokenizer) -> turns_lib.Turns | None:
  """The environment config.tools names with its budgets, for the run's tokenizer (None
  when config.tools.name is empty)."""
  return turns_lib.make_turns(tool_settings(config), tokenizer)


def lora_config(config) -> lora_lib.LoraConfig | None:
  """The RL phase's LoRA settings (models/lora.py), or None when config.lora.rank = 0
  (`rl.composition.check` refuses a bad rank, alpha or target)."""
  return lora_lib.LoraConfig.from_settings(run_lib.LoraSettings.from_config(config.lora))


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the inconsistent fields and how to fix them. The launcher calls
  it before anything else, so a bad config fails before the first training step: the typed
  settings' checks (`RunSettings.check`), the names and combinations
  (`rl.composition.check`), the task's own settings (built here) and a warm start's
  source."""
  run = settings(config)
  run.check()
  composition.check(run)
  task = build_task(config)  # a task's own settings (difficulty fields, prompt style) fail here
  rewards.make_stage(run.reward, task, None, config.seed,
                     advantages.is_process(run.advantage.name))
  if config.warm_start.init_from:
    warm_start.check_source(config.warm_start.init_from, config.warm_start.steps,
                            json.loads(config.to_json_best_effort()))


def build_task(config: ml_collections.ConfigDict):
  """The run's task: config.task.name with its prompt style, seed, eval_size and difficulty
  fields, and for the dataset task its files and fields (config.task.path, ...;
  rl.settings.dataset.DatasetSettings, which refuses them set for another task). A bad field
  or value is a ValueError naming it (rl.tasks.make_task)."""
  files = DatasetSettings.from_config(config.task).builder_arguments(
      config.task.name, dict(config.task.get("difficulty") or {}))
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


def model_source(config) -> str:
  """The policy's preset or checkpoint, as an error message names it."""
  return (f"config.model.preset = {config.model.preset!r} / checkpoint "
          f"{config.model.checkpoint!r}")


def sequence_length(config) -> int:
  """Slots of a rollout: rollout.prompt_len + max_new_tokens."""
  return config.rollout.prompt_len + config.rollout.max_new_tokens


def load_policy(config, rng):
  """(tokenizer, model_config, initial params) of the run (`rl.policy.load_policy`):
  config.model's checkpoint, or its preset from scratch. experiments/eval.py resolves a
  run's policy here too."""
  return policy.load_policy(settings(config).model, sequence_length(config), rng)


def load_teacher(config, tokenizer):
  """(params, ModelConfig) of the frozen teacher config.distill.teacher names
  (`rl.policy.load_teacher`)."""
  return policy.load_teacher(config.distill.teacher, settings(config).model, tokenizer,
                             sequence_length(config), config.distill.top_k)


def length_buckets(config) -> tuple[int, ...]:
  """Sequence lengths (prompt_len + completion slots) the train step may cut batches to."""
  r = config.rollout
  return tuple(sorted(r.prompt_len + b for b in r.train_length_buckets if b < r.max_new_tokens))


def rl_loss(config) -> losses.LossSettings:
  """config.loss as the GRPO train step reads it (`LossSettings.resolved`): the unset
  fields an objective may fix take the objective's values, else FIXABLE_DEFAULTS', and
  norm_len 0 becomes the generation budget (rollout.max_new_tokens)."""
  return losses.resolve(losses.LossSettings.from_config(config.loss),
                        config.rollout.max_new_tokens)


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
    loss = losses.LossSettings(name="sft", aggregation="token_mean", norm_len=1.0)
    prompts = config.warm_start.batch_size
  else:
    rate = dict(learning_rate=config.rl.learning_rate, warmup_steps=config.rl.warmup_steps)
    optimizer = train.make_optimizer(**rate, weight_decay=config.rl.weight_decay,
                                     max_grad_norm=config.rl.max_grad_norm)
    loss = rl_loss(config)
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
  step = train.make_train_step(model_config, optimizer, loss,
                               num_microbatches=config.rl.num_microbatches, **updates,
                               temperature=config.rollout.temperature if phase == RL else 1.0,
                               shared_prefix=shared_prefix, mesh=mesh,
                               length_buckets=length_buckets(config),
                               learning_rate=train.learning_rate_schedule(**rate),
                               lora=phase_lora(config, phase),
                               logprob_chunk=config.rl.logprob_chunk,
                               router=composite.RouterTerms.from_settings(
                                   settings(config).moe, model_config, phase == RL,
                                   model_source(config)),
                               **(distill_settings(config, teacher) if phase == RL else {}))
  drafts = (speculative.DraftConfig.from_settings(settings(config).rollout.speculative,
                                                 config.rollout.group_size)
            if phase == RL else None)
  turns = make_turns(config, tokenizer)
  publish = sampler_publish(config, model_config, phase, mesh)
  batch = producers.BatchContext(
      task=task, tokenizer=tokenizer, model_config=model_config,
      sampling_config=sampling_config, prompt_len=config.rollout.prompt_len,
      prompts_per_step=prompts, group_size=config.rollout.group_size,
      train_pool=config.task.train_pool,
      keep_completions=drafts is not None and "history" in drafts.sources, turns=turns,
      generate_fn=samplers.make_sampler(model_config, sampling_config, mesh=mesh,
                                        drafts=drafts, turns=turns))
  if phase == WARM_START:
    return loop.LoopContext(batch=batch, train_step=step, publish=publish), optimizer
  logprob_check = loop.PeriodicCheck(train.make_batch_size_check(
      model_config, config.rollout.temperature, logprob_chunk=config.rl.logprob_chunk,
      replay=model_config.is_moe and config.moe.routing_replay),
      config.metrics.logprob_check_every)
  ctx = loop.LoopContext(batch=batch, train_step=step,
                         stages=batch_stages(config, batch, model_config, loss),
                         staleness=staleness_in_batches(config), publish=publish,
                         logprob_check=logprob_check)
  return ctx, optimizer


def batch_stages(config, batch: producers.BatchContext, model_config, loss) -> stages.Stage:
  """The RL phase's batch stages, in order (rl/stages.py): the reward stage when
  config.reward or a process estimator asks for one, the sampler's record when a correction
  reads it, the registered stages of rl/extensions/ that run before the advantages, the
  advantages, the training samples, NAT's token subsample when set, and the registered
  stages that run after."""
  run = settings(config)
  reward = rewards.make_stage(run.reward, batch.task, batch.tokenizer, config.seed,
                              advantages.is_process(run.advantage.name))
  added = lambda before: [spec.build(run.stages[name], batch) for name, spec
                          in stages.STAGES.items() if spec.before_advantages == before]
  parts = (None if reward is None else rewards.reward_stage(reward),
           sampler_topk.record_stage(model_config, loss, settings(config).rollout),
           *added(True), advantages.advantage_stage(batch_advantages(config)),
           samples.train_samples_stage(config.metrics.train_samples,
                                       config.metrics.train_samples_every),
           None if loss.token_subsample == "none" else subsample_lib.TokenSubsample(
               loss.token_subsample, loss.token_keep, loss.aggregation,
               config.rl.num_minibatches).stage(), *added(False))
  return stages.chain(*(part for part in parts if part is not None))


def sampler_publish(config, model_config, phase: str, mesh=None):
  """`LoopContext.publish`: quantised in the RL phase with config.rollout.weights (one
  device), else resharded into the sampler's layout on a mesh, else None."""
  weights = settings(config).rollout.weights if phase == RL else ""
  quantizer = jax.jit(functools.partial(quantize.quantize_params, name=weights)) if weights else None
  return quantizer or (None if mesh is None else reshard.make_publish(mesh, jax.eval_shape(
      lambda: transformer.init_params(model_config, jax.random.PRNGKey(0)))))


def batch_advantages(config) -> advantages.BatchAdvantages:
  """The advantage stage: a process estimator over the batch's step rewards (PURE), else
  the rollout kind's stage over config.advantage.name's outcome estimator."""
  advantage = settings(config).advantage
  if advantages.is_process(advantage.name):
    return advantages.process_relative(advantages.PROCESS_ADVANTAGES.get(advantage.name),
                                       advantage.verifier_coef)
  rollout = settings(config).rollout
  return kinds.kind_of(rollout).batch_advantages(rollout,
                                                 advantages.get_advantage_fn(advantage.name))


def distill_settings(config, teacher) -> dict:
  """make_train_step's distillation arguments: none without a teacher."""
  if teacher is None:
    return {}
  params, teacher_config = teacher
  settings = DistillSettings.from_config(config.distill)
  return dict(distill=distillation.Distill.from_settings(settings, teacher_config),
              teacher_params=params)


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
  rollout = settings(config).rollout
  return kinds.kind_of(rollout).make_producer(
      rollout, ctx.batch, selection=selection.SelectionSettings.from_config(config.selection),
      max_staleness=config.rl.max_staleness)


def loop_state_like(config, model_config, params_like, phase: str, optimizer,
                    producer: producers.Producer | None,
                    batch_stages: stages.Stage | None = None) -> loop.LoopState:
  """The shapes of the LoopState a checkpoint of `phase` holds (unsharded): the phase's
  TrainState over parameters shaped like `params_like`, the staleness ring when
  config.rl.staleness is set, the producer state (the warm start's data cursor; the RL
  `producer`'s state as `for_checkpoint` keeps it) and the RL phase's `batch_stages`'
  state. Restoring with it reads every leaf."""
  train_like = jax.eval_shape(
      lambda p: new_train_state(config, model_config, p, optimizer, phase), params_like)
  staleness = staleness_in_batches(config)
  history = (jax.eval_shape(lambda p: loop.init_history(p, staleness), train_like.params)
             if staleness else None)
  if phase == WARM_START:
    producer_state, stage_state = producers.CursorState(cursor=producers.cursor_array(0)), None
  else:
    producer_state = producer.for_checkpoint(producer.init(0))
    stage_state = None if batch_stages is None else batch_stages.init()
  return loop.LoopState(train=train_like, rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
                        history=history, producer=producer_state, stages=stage_state)
