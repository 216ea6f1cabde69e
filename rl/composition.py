"""Which switches compose: the run's check of every name against its registry and of every
combination of pieces against what each declares (the launcher runs it after
`RunSettings.check`, before anything is built: `rl.wiring.validate`).

Each refusal names the fields and the fix. Most combinations are decided from what the
pieces declare of themselves, not from their names:

- A rollout kind (`rl.rollouts.kinds.RolloutKind`) declares what it can do (decode on a
  mesh, pause at tool calls, let a selection rule choose, ...), whether it computes its
  own advantages or bounds staleness, and what its batches are (`declares`, an
  `rl.stages.Declaration`); a selection rule (`rl.rollouts.selection.SelectionRule`)
  whether it chooses prompts, refills, needs a pool, and what its batches are.
- The batch stages (`rl.stages`), the environment and the train step's consumers of a
  batch declare what they need of it, what they break and what they write
  (`_declarations`): a piece that needs a property another piece does not keep is refused
  with both named, and so is a stage that rewrites a batch field a piece read while making
  the batch.
- Objectives and corrections declare their scope, anchor and what they do to a token's
  term (`rl.objectives.losses.check`, `rl.objectives.token_subsample.check_composes`).
"""

from __future__ import annotations

import rl.extensions  # registers the batch stages of rl/extensions/  # pylint: disable=unused-import
from models import config as model_configs
from models import quantize
from models import transformer
from rl import environments
from rl import rewards
from rl import stages
from rl import tasks
from rl.objectives import advantages
from rl.objectives import corrections
from rl.objectives import distillation
from rl.objectives import losses
from rl.objectives import token_subsample
from rl.rollouts import kinds
from rl.rollouts import selection
from rl.settings import run as run_settings
from rl.settings.run import RunSettings
from sampling import partial as partial_lib
from sampling import speculative


def check(settings: RunSettings) -> None:
  """Raises ValueError naming the first name no registry knows or the first combination of
  switches that does not compose, with the fix."""
  check_names(settings)
  for rule in _CROSS_CHECKS:
    rule(settings)


# --- Names ---------------------------------------------------------------------------


def _choice(path: str, value, known) -> None:
  if value not in known:
    raise ValueError(f"{path} = {value!r}; use one of {', '.join(repr(k) for k in known)}.")


def check_names(settings: RunSettings) -> None:
  """Every name the config gives is one its registry knows, and each piece's own
  constraints hold (a rollout kind's, a selection rule's, the loss's)."""
  s = settings
  if s.task.name not in tasks.task_names():
    raise ValueError(f"Unknown task {s.task.name!r} (config.task.name); known tasks: "
                     f"{', '.join(tasks.task_names())} (rl.tasks.register_task adds one).")
  _choice("config.task.prompt_style", s.task.prompt_style, tasks.PROMPT_STYLES)
  if not s.model.checkpoint and s.model.preset not in model_configs.PRESETS:
    raise ValueError(f"Unknown config.model.preset {s.model.preset!r}; known: "
                     f"{sorted(model_configs.PRESETS)}.")
  _choice("config.model.remat", s.model.remat, tuple(transformer.REMAT_POLICIES))
  _choice("config.rollout.weights", s.rollout.weights, ("",) + tuple(quantize.FORMATS))
  _choice("config.rollout.resume", s.rollout.resume, tuple(partial_lib.RESUME_MODES))
  losses.check(s.loss)
  known = advantages.ADVANTAGES.names() + advantages.PROCESS_ADVANTAGES.names()
  if s.advantage.name not in known:
    raise ValueError(f"Unknown advantage estimator {s.advantage.name!r} "
                     f"(config.advantage.name); known: {', '.join(known)}.")
  if not advantages.is_process(s.advantage.name) and s.advantage.verifier_coef != 1.0:
    raise ValueError(f"config.advantage.verifier_coef = {s.advantage.verifier_coef} weighs the "
                     f"outcome reward beside process rewards, and config.advantage.name = "
                     f"{s.advantage.name!r} reads none, so it would be ignored; leave it at "
                     "1.0 or use pure_min / pure_sum.")
  kinds.kind_of(s.rollout).check(s.rollout, bool(s.tools.name))
  if s.tools.name:
    environments.ENVIRONMENTS.get(s.tools.name)
  distillation.DISTILL_OBJECTIVES.get(s.distill.objective)
  if s.lora.rank:
    from models import lora  # pylint: disable=import-outside-toplevel
    lora.LoraConfig.from_settings(s.lora)  # an unknown target fails here
  rule = selection.rule_of(s.selection)
  selection.check(s.selection, prompts_per_step=s.rollout.prompts_per_step,
                  group_size=s.rollout.group_size, pool_size=s.task.train_pool)
  default_attempts = run_settings.SelectionSettings.defaults()["max_attempts"]
  if not rule.refills(s.selection) and s.selection.max_attempts != default_attempts:
    raise ValueError(f"config.selection.max_attempts = {s.selection.max_attempts} has no effect "
                     f"with config.selection.kind = {s.selection.kind!r}: it is read only by a "
                     "rule that refills its batch (dynamic, or greso with greso.refill). Set "
                     f"that, or leave it at its default {default_attempts}.")


# --- What each piece declares of the batch --------------------------------------------


def pieces(settings: RunSettings) -> list[tuple[str, stages.Declaration]]:
  """Every piece of the run that makes, changes or consumes the batch, named as the config
  selects it, with what it declares (`rl.stages.Declaration`), in the batch's order: the
  rollout kind and the selection rule make it, an environment writes into it, the stages
  change it, and the train step's consumers read it."""
  s = settings
  out = [(f"config.rollout.kind = {s.rollout.kind!r}", kinds.kind_of(s.rollout).declares)]
  out.append((f"config.selection.kind = {s.selection.kind!r}",
              selection.rule_of(s.selection).declares(s.selection)))
  if s.tools.name:
    out.append((f"config.tools.name = {s.tools.name!r}", stages.Declaration(
        breaks=frozenset({stages.POLICY_TEXT_ONLY, stages.CONTEXT_IS_THE_PROMPT}))))
  process = advantages.is_process(s.advantage.name)
  if s.reward.active or process:
    what = ", ".join(filter(None, ("config.reward" if s.reward.active else "",
                                   f"config.advantage.name = {s.advantage.name!r}"
                                   if process else "")))
    out.append((f"the reward stage ({what})", rewards.declaration(s.reward, process)))
  if losses.reads_sampler_topk(s.loss):
    out.append(("score centering's sampler record (config.loss.corrections "
                "'score_centering')", stages.Declaration(
                    needs=frozenset({stages.SAMPLED_BY_PRODUCING_PARAMS}))))
  if s.loss.token_subsample != "none":
    out.append((f"config.loss.token_subsample = {s.loss.token_subsample!r}",
                token_subsample.declaration(s.loss.token_subsample)))
  for name, spec in stages.STAGES.items():  # the registered stages of rl/extensions/
    out.append((f"the batch stage config.stages.{name}", spec.declares(s.stages[name])))
  if s.rl.prefix_shared_forward:
    out.append(("config.rl.prefix_shared_forward", stages.Declaration(
        needs=frozenset({stages.CONTEXT_IS_THE_PROMPT}))))
  if s.distill.teacher:
    out.append(("config.distill.teacher", stages.Declaration(
        needs=frozenset({stages.EVERY_COMPLETION_TOKEN}))))
  if s.moe.routing_replay:
    out.append(("config.moe.routing_replay", stages.Declaration(
        needs=frozenset({stages.ROUTING_RECORDED}))))
  return out


def conflicts(declared: list[tuple[str, stages.Declaration]]) -> list[str]:
  """What the declared pieces (in batch order) cannot do together: a piece that needs a
  property another does not keep, and a piece that writes a batch field an earlier piece
  read while making the batch."""
  found = []
  for name, declares in declared:
    for need in sorted(declares.needs):
      for other, other_declares in declared:
        if other != name and need in other_declares.breaks:
          found.append(f"{name} needs that {need}, and {other} does not keep that; turn one "
                       "of them off.")
  for index, (name, declares) in enumerate(declared):
    for field in sorted(declares.writes):
      for other, other_declares in declared[:index]:
        if field in other_declares.reads_inside:
          found.append(f"{name} changes the batch's {field} after it is made, and {other} "
                       f"reads the {field} while making it (it would act on values the "
                       "trainer never sees); turn one of them off.")
  return found


def _declarations(settings: RunSettings) -> None:
  found = conflicts(pieces(settings))
  if found:
    raise ValueError(found[0])


# --- The cross-section table: each rule refuses one combination that does not compose ----


def _batch_layout(settings: RunSettings) -> None:
  r, rl = settings.rollout, settings.rl
  rows = r.prompts_per_step * kinds.rows_per_prompt(r)
  rl_parts = rl.num_minibatches * rl.num_microbatches
  if rows % rl_parts:
    raise ValueError(f"config.rollout.prompts_per_step * group_size = {rows} is not divisible "
                     f"by config.rl.num_minibatches * num_microbatches = {rl_parts} (with "
                     "kind='tree', group_size is the tree's leaf budget).")
  if settings.warm_start.batch_size % rl.num_microbatches:
    raise ValueError(f"config.warm_start.batch_size = {settings.warm_start.batch_size} is not "
                     f"divisible by config.rl.num_microbatches = {rl.num_microbatches}.")


def _prefix_sharing(settings: RunSettings) -> None:
  r, rl = settings.rollout, settings.rl
  if not rl.prefix_shared_forward:
    return
  rl_parts = rl.num_minibatches * rl.num_microbatches
  if not kinds.kind_of(r).identical_prompt_groups:
    raise ValueError(f"config.rl.prefix_shared_forward needs groups of G independent samples of "
                     f"one prompt (config.rollout.kind='independent'), got {r.kind!r}.")
  if r.prompts_per_step % rl_parts:
    raise ValueError(f"config.rl.prefix_shared_forward needs whole groups per microbatch: "
                     f"config.rollout.prompts_per_step = {r.prompts_per_step} must be divisible "
                     f"by config.rl.num_minibatches * num_microbatches = {rl_parts}.")
  if rl.logprob_chunk:
    raise ValueError("config.rl.logprob_chunk chunks the plain forward's log-probs; the "
                     "prefix-shared forward has its own layout: turn one of them off.")


def _speculative(settings: RunSettings) -> None:
  """Speculative drafts decode independent samples on one device; 'history' needs prompts
  that recur, 'group' needs groups of group_size rows."""
  r, s = settings.rollout, settings.rollout.speculative
  if not s.tokens:
    return
  if not kinds.kind_of(r).speculative:
    raise ValueError(f"config.rollout.speculative decodes independent samples; "
                     f"config.rollout.kind = {r.kind!r} has its own decode loop. "
                     "Use kind='independent' or speculative.tokens=0.")
  if not settings.mesh.is_single_device:
    raise ValueError("config.rollout.speculative runs on one device; set the mesh to 1, 1, 1 "
                     "or speculative.tokens=0.")
  if "history" in s.sources and not settings.task.train_pool:
    raise ValueError("config.rollout.speculative.sources 'history' drafts from a prompt's "
                     "completion at its previous visit: it needs prompts that come back, "
                     "config.task.train_pool > 0.")
  if "group" in s.sources and not selection.rule_of(settings.selection).equal_groups:
    raise ValueError("config.rollout.speculative.sources 'group' needs groups of "
                     "config.rollout.group_size rows; config.selection.kind='adaptive' sizes "
                     "them per prompt. Use prompt_lookup or another selection kind.")
  speculative.DraftConfig.from_settings(s, r.group_size)  # bad sources or sizes fail here


def _no_reference_policy(settings: RunSettings) -> None:
  if settings.loss.kl_coef:
    raise ValueError(f"config.loss.kl_coef = {settings.loss.kl_coef}: the launcher has no "
                     "reference policy to take a KL to (no reference forward is wired in). "
                     "Set config.loss.kl_coef=0; to keep the policy near another one, use "
                     "on-policy distillation (config.distill.teacher, docs/distillation.md).")


def _groups(settings: RunSettings) -> None:
  r = settings.rollout
  if settings.rl.prefix_shared_forward and not selection.rule_of(settings.selection).equal_groups:
    raise ValueError("config.rl.prefix_shared_forward needs groups of exactly "
                     "config.rollout.group_size rows; config.selection.kind='adaptive' gives "
                     "prompts different rollout counts. Use another selection kind or turn "
                     "prefix sharing off.")
  if r.temperature == 0 and settings.rl.steps > 0:
    raise ValueError(f"config.rollout.temperature = {r.temperature} is greedy decoding: "
                     "every rollout of a prompt is the same completion, so group advantages "
                     "are zero and RL never learns. Set config.rollout.temperature > 0 (1.0 "
                     "samples the policy itself); held-out evaluation decodes greedily "
                     "regardless.")
  if kinds.kind_of(r).group_relative and r.group_size < 2:
    raise ValueError(f"config.rollout.group_size = {r.group_size}: group-relative advantages "
                     "need at least 2 completions per prompt.")
  if any(b < 1 for b in r.train_length_buckets):
    raise ValueError(f"config.rollout.train_length_buckets = {r.train_length_buckets}: every "
                     "bucket must be a positive number of completion slots.")


def check_switches(settings: RunSettings) -> None:
  """The switch combinations that do not compose (docs/configuration.md has the whole
  matrix): every other combination of rollout.kind, selection.kind, rl.async_,
  rl.staleness and the mesh runs, each switch with its effect."""
  r, rl, kind, m = settings.rollout, settings.rl, settings.selection.kind, settings.mesh
  if not kinds.kind_of(r).any_selection and selection.rule_of(settings.selection).chooses:
    raise ValueError(f"config.selection.kind = {kind!r} chooses prompts and rollout counts for "
                     f"independent samples; config.rollout.kind = {r.kind!r} cannot skip or "
                     "re-weight groups (a tree shares one root per prompt; a partial pool has "
                     "started them already). Use selection.kind='uniform' or "
                     "rollout.kind='independent'.")
  if rl.async_ and rl.staleness:
    raise ValueError(f"config.rl.async_ has real staleness (bounded by rl.max_staleness); "
                     f"config.rl.staleness = {rl.staleness} simulates it in the sync "
                     "loop. Set one of them: rl.staleness = 0 or rl.async_ = False.")
  updates = rl.updates_per_batch
  if rl.staleness % updates:
    raise ValueError(f"config.rl.staleness = {rl.staleness} counts optimiser updates, "
                     f"and parameters change once per batch of config.rl.num_minibatches * "
                     f"ppo_epochs = {updates} updates: set rl.staleness to a multiple of "
                     f"{updates} (sampling then lags rl.staleness // {updates} batches).")
  default_bound = run_settings.RLSettings.defaults()["max_staleness"]
  if not rl.async_ and not kinds.kind_of(r).bounds_staleness and rl.max_staleness != default_bound:
    raise ValueError(f"config.rl.max_staleness = {rl.max_staleness} has no effect with "
                     f"config.rl.async_ = False and config.rollout.kind = {r.kind!r}: it "
                     "bounds the asynchronous producer's lead and a partial pool's oldest "
                     "rows. Set rl.async_ = True or rollout.kind = 'partial', or leave it at "
                     f"its default {default_bound}.")
  if rl.async_ and 0 < rl.max_staleness < updates:
    raise ValueError(f"config.rl.max_staleness = {rl.max_staleness} counts optimiser "
                     f"updates, and one batch is config.rl.num_minibatches * ppo_epochs = "
                     f"{updates} of them: a batch sampled even one batch ahead is {updates} "
                     "updates stale, so config.rl.async_ could never run ahead. Set "
                     f"rl.max_staleness = 0 (synchronous) or >= {updates} (the producer then "
                     f"runs max_staleness // {updates} batches ahead).")
  if not kinds.kind_of(r).mesh and not m.is_single_device:
    raise ValueError(f"config.rollout.kind = {r.kind!r} decodes on one device; the sharded "
                     f"sampler (mesh data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) decodes "
                     "independent samples only. Use rollout.kind='independent' or mesh.data = "
                     "mesh.fsdp = mesh.tensor = 1.")


def _tools(settings: RunSettings) -> None:
  """Demonstrations of a tool the run does not have, and what rollouts with turns do not
  compose with."""
  tools, r = settings.tools, settings.rollout
  share = settings.task.difficulty.get("tool_share", 0.0)
  if not tools.name and share:
    raise ValueError(f"config.task.difficulty.tool_share = {share} demonstrates the adder, "
                     "but the run has no environment to answer it (the policy would be "
                     "trained to write the tool's answers itself): set "
                     "config.tools.name='adder', or tool_share=0.")
  if not tools.name:
    return
  if not kinds.kind_of(r).tools:
    raise ValueError(f"config.tools.name with config.rollout.kind={r.kind!r}: its rows cannot "
                     "pause at the environment's calls (a tree forks rows that share a "
                     "prefix, and an answer would have to be copied into every branch); use "
                     "rollout.kind='independent' or 'partial' with tools.")
  if r.speculative.tokens:
    raise ValueError("config.tools.name with config.rollout.speculative.tokens > 0: "
                     "speculative decoding does not pause rows at tool calls; set "
                     "rollout.speculative.tokens=0.")
  if not settings.mesh.is_single_device:
    raise ValueError("config.tools.name runs turns on one device; set mesh.data = mesh.fsdp "
                     "= mesh.tensor = 1.")


def _distillation(settings: RunSettings) -> None:
  if settings.distill.teacher and settings.rl.prefix_shared_forward:
    raise ValueError("config.distill needs the full per-token distributions of the batch; "
                     "turn config.rl.prefix_shared_forward off.")


def _advantage_source(settings: RunSettings) -> None:
  """config.advantage.name is read only where the rollout kind takes its advantages from
  the estimator, and a correction that computes advantages of its own (VCPO's baseline:
  GRPO's group statistics around its off-policy baseline) replaces whatever the estimator
  or the tree computed, so it runs with the default estimator on group-relative batches."""
  name, kind = settings.advantage.name, kinds.kind_of(settings.rollout)
  default = run_settings.AdvantageSettings.defaults()["name"]
  if kind.own_advantages and name != default:
    raise ValueError(f"config.advantage.name = {name!r} has no effect with "
                     f"config.rollout.kind = {settings.rollout.kind!r}, whose advantages are "
                     "config.rollout.tree.advantage's; set that, or leave "
                     f"config.advantage.name at its default {default!r}.")
  own = [c for c in losses.chain_of(settings.loss)
         if not corrections.get_correction(c).scales_with_advantage]
  if not own:
    return
  if name != default:
    raise ValueError(f"config.advantage.name = {name!r} with the correction {own[0]!r} "
                     f"(config.loss.name = {settings.loss.name!r}): it computes advantages of "
                     "its own from the rewards, so the estimator's would be discarded; leave "
                     f"config.advantage.name at {default!r} or use another objective.")
  if kind.own_advantages:
    raise ValueError(f"config.rollout.kind = {settings.rollout.kind!r} with the correction "
                     f"{own[0]!r} (config.loss.name = {settings.loss.name!r}): it computes "
                     "group advantages of its own and would discard the tree's "
                     "(config.rollout.tree.advantage); use rollout.kind='independent' or "
                     "another objective.")


def _moe(settings: RunSettings) -> None:
  """config.moe against the rest (a checkpoint's model is checked once loaded,
  MoeSettings.router_terms)."""
  moe, model = settings.moe, settings.model
  if not moe.active:
    return
  if not model.checkpoint and not model_configs.PRESETS[model.preset].is_moe:
    raise ValueError(f"config.moe = {moe} needs a mixture-of-experts policy; "
                     f"config.model.preset = {model.preset!r} is dense (use 'tiny2_moe' or a "
                     "Qwen3-MoE / Mixtral checkpoint).")
  if settings.rl.prefix_shared_forward:
    raise ValueError("config.moe (routing replay, router losses) runs in the full forward, "
                     "and config.rl.prefix_shared_forward = True uses its own; turn one off.")
  if settings.distill.teacher:
    raise ValueError("config.moe (routing replay, router losses) runs in the full forward, "
                     "and config.distill uses its own; turn one off.")


def _low_precision(settings: RunSettings) -> None:
  """config.rollout.weights (a quantised sampler) and score centering's sampler record
  against the rest."""
  weights, single = settings.rollout.weights, settings.mesh.is_single_device
  if weights and not single:
    raise ValueError(f"config.rollout.weights={weights!r} runs on one device: the sampler's "
                     "sharding rules lay out float weights, not quantised ones; drop the mesh "
                     "or set config.rollout.weights=''.")
  if not losses.reads_sampler_topk(settings.loss):
    return
  name = "Score centering (config.loss.corrections 'score_centering')"
  if not single:
    raise ValueError(f"{name} records the sampler's distribution on one device; set "
                     "mesh.data = mesh.fsdp = mesh.tensor = 1.")
  if settings.rl.prefix_shared_forward or settings.rl.logprob_chunk or settings.distill.teacher:
    raise ValueError(f"{name} reads the trainer's log-probs of the sampler's top-K tokens "
                     "from the full forward's dense log-softmax; turn off config.rl."
                     "prefix_shared_forward, config.rl.logprob_chunk and config.distill.")


_CROSS_CHECKS = (_batch_layout, _prefix_sharing, _speculative, _no_reference_policy, _groups,
                 check_switches, _tools, _distillation, _advantage_source, _moe,
                 _low_precision, _declarations)
