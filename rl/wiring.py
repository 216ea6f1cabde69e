"""A run's configuration turned into the objects that run it: the config checked
(`validate`: every inconsistent field refused with the fix, before anything is built), then
the task, the device mesh, the policy, each phase's LoopContext and optimiser, its fresh
TrainState and the RL phase's batch producer.

The launcher (`python -m experiments.train`) calls these, and so do held-out evaluation
(experiments/eval.py), the configuration reference and anything else that needs a run's
objects from its config: one place builds them. The config is the ml_collections
ConfigDict of experiments/configs/default.py (docs/configuration.md lists every field);
`settings(config)` reads it once into its typed `RunSettings` (`validate` reads, checks
and returns them), and every other function here takes those.

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
from rl.settings import run as run_lib
from sampling import sampler as sampler_lib
from sampling import speculative
from sharding import mesh as mesh_lib
from sharding import reshard

WARM_START, RL = "warm_start", "rl"


def settings(config: ml_collections.ConfigDict) -> run_lib.RunSettings:
  """The run's config read into its typed settings (rl/settings/), once: every other
  function here takes them."""
  return run_lib.RunSettings.from_config(config)


def make_turns(run: run_lib.RunSettings, tokenizer) -> turns_lib.Turns | None:
  """The environment config.tools names with its budgets, for the run's tokenizer (None
  when config.tools.name is empty)."""
  return turns_lib.make_turns(run.tools, tokenizer)


def lora_config(run: run_lib.RunSettings) -> lora_lib.LoraConfig | None:
  """The RL phase's LoRA settings (models/lora.py), or None when config.lora.rank = 0
  (`rl.composition.check` refuses a bad rank, alpha or target)."""
  return lora_lib.LoraConfig.from_settings(run.lora)


def validate(config: ml_collections.ConfigDict) -> run_lib.RunSettings:
  """The run's settings, checked: raises ValueError naming the inconsistent fields and how
  to fix them. The launcher calls it before anything else, so a bad config fails before
  the first training step: the typed settings' checks (`RunSettings.check`), the names and
  combinations (`rl.composition.check`), the task's own settings (built here) and a warm
  start's source (compared with this config as config.json holds it)."""
  run = settings(config)
  run.check()
  composition.check(run)
  task = build_task(run)  # a task's own settings (difficulty fields, prompt style) fail here
  rewards.make_stage(run.reward, task, None, run.seed, advantages.is_process(run.advantage.name))
  if run.warm_start.init_from:
    warm_start.check_source(run.warm_start.init_from, run.warm_start.steps,
                            json.loads(config.to_json_best_effort()))
  return run


def build_task(run: run_lib.RunSettings):
  """The run's task: config.task.name with its prompt style, seed, eval_size and difficulty
  fields, and for the dataset task its files and fields (config.task.path, ...;
  rl.settings.dataset.DatasetSettings, which refuses them set for another task). A bad field
  or value is a ValueError naming it (rl.tasks.make_task)."""
  difficulty = dict(run.task.difficulty)
  files = run.dataset.builder_arguments(run.task.name, difficulty)
  return tasks.make_task(run.task.name, run.task.prompt_style, seed=run.seed,
                         eval_size=run.task.eval_size, **files, **difficulty)


def build_mesh(run: run_lib.RunSettings) -> jax.sharding.Mesh | None:
  """The configured (data, fsdp, tensor) mesh over all devices of all processes, or None for
  the single-device default; every batch must split evenly over data x fsdp."""
  mesh_config = mesh_lib.MeshConfig(data=run.mesh.data, fsdp=run.mesh.fsdp,
                                    tensor=run.mesh.tensor)
  if mesh_config.is_single_device and jax.process_count() == 1:
    return None
  mesh = mesh_lib.make_mesh(mesh_config)
  shards = mesh_lib.batch_size_multiple(mesh)
  r = run.rollout
  micro, mini = run.rl.num_microbatches, run.rl.num_minibatches
  for name, rows, multiple, parts in (
      ("rollout.prompts_per_step * rollout.group_size", r.prompts_per_step * r.group_size,
       "mesh.data * mesh.fsdp * rl.num_minibatches * rl.num_microbatches", mini * micro),
      ("warm_start.batch_size", run.warm_start.batch_size,
       "mesh.data * mesh.fsdp * rl.num_microbatches", micro),
      ("eval.batch_size", run.eval.batch_size, "mesh.data * mesh.fsdp", 1)):
    divisor = shards * parts
    if rows % divisor:
      raise ValueError(f"config.{name} = {rows} does not split over the mesh: make it a "
                       f"multiple of {multiple} = {divisor}.")
  return mesh


def model_source(run: run_lib.RunSettings) -> str:
  """The policy's preset or checkpoint, as an error message names it."""
  return (f"config.model.preset = {run.model.preset!r} / checkpoint "
          f"{run.model.checkpoint!r}")


def sequence_length(run: run_lib.RunSettings) -> int:
  """Slots of a rollout: rollout.prompt_len + max_new_tokens."""
  return run.rollout.prompt_len + run.rollout.max_new_tokens


def load_policy(run: run_lib.RunSettings, rng):
  """(tokenizer, model_config, initial params) of the run (`rl.policy.load_policy`):
  config.model's checkpoint, or its preset from scratch. experiments/eval.py resolves a
  run's policy here too."""
  return policy.load_policy(run.model, sequence_length(run), rng)


def load_teacher(run: run_lib.RunSettings, tokenizer):
  """(params, ModelConfig) of the frozen teacher config.distill.teacher names
  (`rl.policy.load_teacher`)."""
  return policy.load_teacher(run.distill.teacher, run.model, tokenizer, sequence_length(run),
                             run.distill.top_k)


def length_buckets(run: run_lib.RunSettings) -> tuple[int, ...]:
  """Sequence lengths (prompt_len + completion slots) the train step may cut batches to."""
  r = run.rollout
  return tuple(sorted(r.prompt_len + b for b in r.train_length_buckets if b < r.max_new_tokens))


def rl_loss(run: run_lib.RunSettings) -> losses.LossSettings:
  """config.loss as the GRPO train step reads it (`LossSettings.resolved`): the unset
  fields an objective may fix take the objective's values, else FIXABLE_DEFAULTS', and
  norm_len 0 becomes the generation budget (rollout.max_new_tokens)."""
  return losses.resolve(run.loss, run.rollout.max_new_tokens)


def make_context(run: run_lib.RunSettings, task, tokenizer, model_config, phase, mesh=None,
                 teacher=None):
  """The LoopContext (and optimizer) of one phase of the run (sharded over `mesh`, if any);
  `teacher` = (params, ModelConfig) from `load_teacher` makes the RL phase's train step
  distil (config.distill)."""
  r = run.rollout
  if phase == WARM_START:
    w = run.warm_start
    rate = dict(learning_rate=w.learning_rate, warmup_steps=w.warmup_steps,
                decay_steps=max(w.steps - w.warmup_steps, 1), end_lr_fraction=0.1)
    optimizer = train.make_optimizer(**rate, max_grad_norm=run.rl.max_grad_norm)
    loss = losses.LossSettings(name="sft", aggregation="token_mean", norm_len=1.0)
    prompts = w.batch_size
  else:
    rate = dict(learning_rate=run.rl.learning_rate, warmup_steps=run.rl.warmup_steps)
    optimizer = train.make_optimizer(**rate, weight_decay=run.rl.weight_decay,
                                     max_grad_norm=run.rl.max_grad_norm)
    loss = rl_loss(run)
    prompts = r.prompts_per_step
  sampling_config = sampler_lib.SamplingConfig(
      max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
      stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  # Prefix sharing needs groups of one prompt: GRPO batches, not the warm start's.
  shared_prefix = ((r.group_size, r.prompt_len)
                   if phase == RL and run.rl.prefix_shared_forward else None)
  # PPO minibatches / epochs are for rollout batches; the warm start takes one update each.
  updates = (dict(num_minibatches=run.rl.num_minibatches, ppo_epochs=run.rl.ppo_epochs)
             if phase == RL else {})
  step = train.make_train_step(model_config, optimizer, loss,
                               num_microbatches=run.rl.num_microbatches, **updates,
                               temperature=r.temperature if phase == RL else 1.0,
                               shared_prefix=shared_prefix, mesh=mesh,
                               length_buckets=length_buckets(run),
                               learning_rate=train.learning_rate_schedule(**rate),
                               lora=phase_lora(run, phase),
                               logprob_chunk=run.rl.logprob_chunk,
                               router=composite.RouterTerms.from_settings(
                                   run.moe, model_config, phase == RL, model_source(run)),
                               **(distill_settings(run, teacher) if phase == RL else {}))
  drafts = (speculative.DraftConfig.from_settings(r.speculative, r.group_size)
            if phase == RL else None)
  turns = make_turns(run, tokenizer)
  batch = producers.BatchContext(
      task=task, tokenizer=tokenizer, model_config=model_config,
      sampling_config=sampling_config, prompt_len=r.prompt_len,
      prompts_per_step=prompts, group_size=r.group_size, train_pool=run.task.train_pool,
      keep_completions=drafts is not None and "history" in drafts.sources, turns=turns,
      generate_fn=samplers.make_sampler(model_config, sampling_config, mesh=mesh,
                                        drafts=drafts, turns=turns))
  publish = sampler_publish(run, model_config, phase, mesh)
  if phase == WARM_START:
    return loop.LoopContext(batch=batch, train_step=step, publish=publish), optimizer
  logprob_check = loop.PeriodicCheck(train.make_batch_size_check(
      model_config, r.temperature, logprob_chunk=run.rl.logprob_chunk,
      replay=model_config.is_moe and run.moe.routing_replay),
      run.metrics.logprob_check_every)
  ctx = loop.LoopContext(batch=batch, train_step=step,
                         stages=batch_stages(run, batch, model_config, loss),
                         staleness=run.rl.staleness_in_batches, publish=publish,
                         logprob_check=logprob_check)
  return ctx, optimizer


def batch_stages(run: run_lib.RunSettings, batch: producers.BatchContext, model_config,
                 loss) -> stages.Stage:
  """The RL phase's batch stages, in order (rl/stages.py): the reward stage when
  config.reward or a process estimator asks for one, the sampler's record when a correction
  reads it, the registered stages of rl/extensions/ that run before the advantages, the
  advantages, the training samples, NAT's token subsample when set, and the registered
  stages that run after."""
  reward = rewards.make_stage(run.reward, batch.task, batch.tokenizer, run.seed,
                              advantages.is_process(run.advantage.name))
  added = lambda before: [spec.build(run.stages[name], batch) for name, spec
                          in stages.STAGES.items() if spec.before_advantages == before]
  parts = (None if reward is None else rewards.reward_stage(reward),
           sampler_topk.record_stage(model_config, loss, run.rollout),
           *added(True), advantages.advantage_stage(batch_advantages(run)),
           samples.train_samples_stage(run.metrics.train_samples,
                                       run.metrics.train_samples_every),
           None if loss.token_subsample == "none" else subsample_lib.TokenSubsample(
               loss.token_subsample, loss.token_keep, loss.aggregation,
               run.rl.num_minibatches).stage(), *added(False))
  return stages.chain(*(part for part in parts if part is not None))


def sampler_publish(run: run_lib.RunSettings, model_config, phase: str, mesh=None):
  """`LoopContext.publish`: quantised in the RL phase with config.rollout.weights (one
  device), else resharded into the sampler's layout on a mesh, else None."""
  weights = run.rollout.weights if phase == RL else ""
  quantizer = jax.jit(functools.partial(quantize.quantize_params, name=weights)) if weights else None
  return quantizer or (None if mesh is None else reshard.make_publish(mesh, jax.eval_shape(
      lambda: transformer.init_params(model_config, jax.random.PRNGKey(0)))))


def batch_advantages(run: run_lib.RunSettings) -> advantages.BatchAdvantages:
  """The advantage stage: a process estimator over the batch's step rewards (PURE), else
  the rollout kind's stage over config.advantage.name's outcome estimator."""
  advantage = run.advantage
  if advantages.is_process(advantage.name):
    return advantages.process_relative(advantages.PROCESS_ADVANTAGES.get(advantage.name),
                                       advantage.verifier_coef)
  return kinds.kind_of(run.rollout).batch_advantages(
      run.rollout, advantages.get_advantage_fn(advantage.name))


def distill_settings(run: run_lib.RunSettings, teacher) -> dict:
  """make_train_step's distillation arguments: none without a teacher."""
  if teacher is None:
    return {}
  params, teacher_config = teacher
  return dict(distill=distillation.Distill.from_settings(run.distill, teacher_config),
              teacher_params=params)


def phase_lora(run: run_lib.RunSettings, phase: str) -> lora_lib.LoraConfig | None:
  """LoRA settings of `phase`: the RL phase's (`lora_config`); the warm start trains full
  weights."""
  return lora_config(run) if phase == RL else None


def lora_rng(seed: int) -> jax.Array:
  """The key the adapters' A matrices are drawn from: folded from the parameter key, so
  the launcher's other keys (and runs without LoRA) are unchanged."""
  init_rng, _ = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.fold_in(init_rng, 1)


def new_train_state(run: run_lib.RunSettings, model_config, params, optimizer, phase: str,
                    mesh=None):
  """The fresh TrainState of `phase` over `params`: full weights, or under LoRA in the RL
  phase adapters over `params` frozen; with a mesh, in the trainer's sharded layout. Eval
  builds the shapes of a checkpoint's state here too."""
  lora = phase_lora(run, phase)
  init = lambda p: train.init_train_state(p, optimizer, lora=lora, model_config=model_config,
                                          lora_rng=lora_rng(run.seed))
  if mesh is None:
    return init(params)
  return jax.jit(init, out_shardings=train.train_state_shardings(
      model_config, optimizer, mesh, lora=lora))(params)


def make_rl_producer(run: run_lib.RunSettings, ctx) -> producers.Producer:
  """The RL phase's batch producer (the one strategy-specific piece of the RL phase) for
  the RL LoopContext `ctx`: config.rollout.kind's entry of rl.rollouts.kinds."""
  return kinds.kind_of(run.rollout).make_producer(
      run.rollout, ctx.batch, selection=run.selection, max_staleness=run.rl.max_staleness)


def loop_state_like(run: run_lib.RunSettings, model_config, params_like, phase: str, optimizer,
                    producer: producers.Producer | None,
                    batch_stages: stages.Stage | None = None) -> loop.LoopState:
  """The shapes of the LoopState a checkpoint of `phase` holds (unsharded): the phase's
  TrainState over parameters shaped like `params_like`, the staleness ring when
  config.rl.staleness is set, the producer state (the warm start's data cursor; the RL
  `producer`'s state as `for_checkpoint` keeps it) and the RL phase's `batch_stages`'
  state. Restoring with it reads every leaf."""
  train_like = jax.eval_shape(
      lambda p: new_train_state(run, model_config, p, optimizer, phase), params_like)
  staleness = run.rl.staleness_in_batches
  history = (jax.eval_shape(lambda p: loop.init_history(p, staleness), train_like.params)
             if staleness else None)
  if phase == WARM_START:
    producer_state, stage_state = producers.CursorState(cursor=producers.cursor_array(0)), None
  else:
    producer_state = producer.for_checkpoint(producer.init(0))
    stage_state = None if batch_stages is None else batch_stages.init()
  return loop.LoopState(train=train_like, rng=jax.eval_shape(lambda: jax.random.PRNGKey(0)),
                        history=history, producer=producer_state, stages=stage_state)
