"""The run's other sections (task, warm_start, rl, lora, advantage, eval, metrics,
checkpoint, mesh) typed, and the run as a whole: `RunSettings` reads every section of a
run's config once, and `RunSettings.check` refuses, before anything is built, each field
out of its range or unknown to its registry and each combination of switches that does not
compose (the cross-section table below), naming the fields and the fix.

Like the other settings modules it imports no JAX: a check that needs a registry imports it
when it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from rl.settings import Settings, nested, setting, used_when
from rl.settings.dataset import DatasetSettings
from rl.settings.distill import DistillSettings
from rl.settings.loss import LossSettings
from rl.settings.model import ModelSettings
from rl.settings.moe import MoeSettings
from rl.settings.reward import RewardSettings
from rl.settings.rollout import RolloutSettings
from rl.settings.selection import SelectionSettings
from rl.settings.tools import ToolSettings


@dataclasses.dataclass(frozen=True)
class TaskSettings(Settings):
  """config.task's fields every task reads (the dataset task's own are DatasetSettings;
  `difficulty` holds the task's own settings, checked by the task's builder)."""
  SECTION = "task"
  name: str = setting("running_sum", "running_sum (rl/tasks/running_sum.py), gsm_symbolic "
                      "(math word problems, rl/tasks/gsm.py; configs/smollm2_gsm.py), dataset "
                      "(a local file, rl/tasks/dataset.py; docs/datasets.md) or a "
                      "reasoning-gym dataset (rl/tasks/gym.py; configs/chain_sum_compact.py)")
  prompt_style: str = setting("compact", "\"compact\" (\"4-1=\") for the char tokenizer; "
                              "\"full\"")
  eval_size: int = setting(500, "held-out items (greedy exact match)", low=1)
  train_pool: int = setting(0, "GRPO cycles over train positions [0, pool) (0 = unbounded)",
                            low=0)
  difficulty: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def check_names(self) -> None:
    """Refuses a task or prompt style no registry knows."""
    from rl import tasks  # pylint: disable=import-outside-toplevel
    if self.name not in tasks.task_names():
      raise ValueError(f"Unknown task {self.name!r} (config.task.name); known tasks: "
                       f"{', '.join(tasks.task_names())} (rl.tasks.register_task adds one).")
    if self.prompt_style not in tasks.PROMPT_STYLES:
      raise ValueError(f"config.task.prompt_style = {self.prompt_style!r}; use one of "
                       f"{tasks.PROMPT_STYLES}.")


@dataclasses.dataclass(frozen=True)
class WarmStartSettings(Settings):
  """config.warm_start: supervised steps on the task's reference answers before RL."""
  SECTION = "warm_start"
  steps: int = setting(900, "supervised steps on reference answers (0 = skip)", low=0)
  batch_size: int = setting(32, "(prompt, reference answer) pairs per step", low=1)
  learning_rate: float = setting(3e-3, "peak; linear warmup then linear decay to 10%", low=0,
                                 low_open=True)
  warmup_steps: int = setting(20, "steps of linear learning-rate warmup", low=0)
  length_window: int = setting(8, "batches per length-sorted window of train examples (1 = "
                               "data order): short batches train at short lengths", low=1)
  init_from: str = setting("", "\"\" = train the warm start here; else the workdir of a run "
                           "whose warm start finished (same seed, task, model and warm-start "
                           "settings; e.g. --config.rl.steps=0): RL starts from its "
                           "end-of-warm-start checkpoint")


@dataclasses.dataclass(frozen=True)
class RLSettings(Settings):
  """config.rl: the GRPO phase's optimiser, batch layout and staleness."""
  SECTION = "rl"
  steps: int = setting(120, "GRPO steps", low=0)
  learning_rate: float = setting(2.5e-4, "AdamW: peak, then constant", low=0, low_open=True)
  warmup_steps: int = setting(20, "optimiser updates of linear warmup from 0 (0 = none)",
                              low=0)
  weight_decay: float = setting(0.0, "AdamW decoupled weight decay", low=0)
  max_grad_norm: float = setting(1.0, "global-norm gradient clipping, both phases (0 = off)",
                                 low=0)
  num_minibatches: int = setting(1, "optimiser updates per rollout batch and epoch (PPO "
                                 "minibatches of contiguous whole groups)", low=1)
  ppo_epochs: int = setting(1, "passes over each rollout batch (GRPO's mu)", low=1)
  num_microbatches: int = setting(1, "gradient accumulation within an update; "
                                  "num_minibatches * num_microbatches divides "
                                  "prompts*group_size", low=1)
  staleness: int = setting(0, "simulated staleness k: sample with params k optimiser updates "
                           "old (a multiple of num_minibatches * ppo_epochs)", low=0)
  async_: bool = setting(False, "producer thread samples while the trainer trains (AReaL)")
  max_staleness: int = setting(4, "async / partial: bound on train step - oldest token "
                               "version (versions count optimiser updates, several per batch "
                               "with num_minibatches * ppo_epochs > 1)", low=0)
  prefix_shared_forward: bool = setting(False, "run each group's prompt once in the loss "
                                        "forward/backward")
  logprob_chunk: int = setting(0, "> 0: log-probs this many positions at a time, so no "
                               "[B, T, V] logits buffer exists (0 = dense)", low=0)

  @property
  def updates_per_batch(self) -> int:
    """Optimiser updates one RL batch takes: num_minibatches * ppo_epochs."""
    return self.num_minibatches * self.ppo_epochs

  @property
  def staleness_in_batches(self) -> int:
    """Simulated staleness as the loop applies it: `staleness` counts optimiser updates
    (like every version), the loop lags whole batches (the check refuses a remainder)."""
    return self.staleness // self.updates_per_batch


@dataclasses.dataclass(frozen=True)
class LoraSettings(Settings):
  """config.lora: LoRA (Hu et al. 2021; docs/lora.md). The RL phase trains low-rank adapters
  on the chosen projections of the warm-started (or loaded) policy, whose weights stay
  frozen; the warm start always trains full weights. alpha and targets changed while LoRA
  is off are refused (they would be ignored)."""
  SECTION = "lora"
  rank: int = setting(0, "adapter rank r (0 = off: RL trains full weights)", low=0)
  alpha: float = setting(16.0, "the update A @ B is scaled by alpha / r", low=0, low_open=True,
                         used_when=used_when("rank"))
  targets: tuple[str, ...] = setting(("q", "k", "v", "o", "gate", "up", "down"),
                                     "adapted projections", used_when=used_when("rank"))

  @property
  def target_names(self) -> tuple[str, ...]:
    """`targets` as names: --config.lora.targets=q,v arrives as ('q,v',)."""
    items = (self.targets,) if isinstance(self.targets, str) else self.targets
    return tuple(t.strip() for item in items for t in str(item).split(",") if t.strip())

  def check(self) -> None:
    if isinstance(self.rank, bool) or not isinstance(self.rank, int):
      raise ValueError(f"config.lora.rank = {self.rank!r} must be an integer (0 = LoRA off).")
    super().check()
    if self.rank:
      self.lora_config()  # an unknown target fails here

  def lora_config(self):
    """The models/lora.py LoraConfig of these settings, or None when rank = 0."""
    if not self.rank:
      return None
    from models import lora  # pylint: disable=import-outside-toplevel
    return lora.LoraConfig(rank=self.rank, alpha=float(self.alpha), targets=self.target_names)


@dataclasses.dataclass(frozen=True)
class AdvantageSettings(Settings):
  """config.advantage: the group advantage estimator."""
  SECTION = "advantage"
  name: str = setting("grpo", "rl/objectives/advantages.py registries: grpo | drgrpo | rloo | "
                      "median (outcome rewards), pure_min | pure_sum (PURE's process-reward "
                      "credit, arXiv 2504.15275: the task's per-step rewards)")
  verifier_coef: float = setting(1.0, "pure_min / pure_sum: weight of the verifier's outcome "
                                 "reward beside the process rewards (PURE's PRM+VR; 0 = "
                                 "process rewards alone)", low=0)

  @property
  def is_process(self) -> bool:
    """Whether the estimator reads per-step process rewards."""
    from rl.objectives import advantages  # pylint: disable=import-outside-toplevel
    return self.name in advantages.PROCESS_ADVANTAGES.names()

  def check(self) -> None:
    super().check()
    from rl.objectives import advantages  # pylint: disable=import-outside-toplevel
    known = advantages.ADVANTAGES.names() + advantages.PROCESS_ADVANTAGES.names()
    if self.name not in known:
      raise ValueError(f"Unknown advantage estimator {self.name!r} (config.advantage.name); "
                       f"known: {', '.join(known)}.")
    if not self.is_process:
      if self.verifier_coef != 1.0:
        raise ValueError(f"config.advantage.verifier_coef = {self.verifier_coef} weighs the "
                         f"outcome reward beside process rewards, and config.advantage.name = "
                         f"{self.name!r} reads none, so it would be ignored; leave it at 1.0 or "
                         "use pure_min / pure_sum.")


@dataclasses.dataclass(frozen=True)
class EvalSettings(Settings):
  """config.eval: held-out evaluation during the run."""
  SECTION = "eval"
  every: int = setting(30, "GRPO steps between held-out evaluations", low=1)
  batch_size: int = setting(250, "most rows per evaluation batch: a smaller held-out set "
                            "(times its samples) is one batch of its own size "
                            "(rl/evaluation.py batch_rows)", low=1)


@dataclasses.dataclass(frozen=True)
class MetricsSettings(Settings):
  """config.metrics: where metrics go besides metrics.jsonl (experiments/metrics.py; always
  written), and the samples kept."""
  SECTION = "metrics"
  tensorboard: bool = setting(True, "TensorBoard event files next to metrics.jsonl")
  wandb_project: str = setting("", "Weights & Biases project (\"\" = off; pip install wandb)")
  eval_samples: int = setting(16, "greedy completions kept per evaluation, the same spread of "
                              "held-out problems each time (samples/eval_<step>.jsonl, "
                              "TensorBoard text, a W&B table; 0 = none)", low=0)
  train_samples: int = setting(4, "rollouts kept per training-sample step, with their "
                               "advantages (samples/train_<step>.jsonl; 0 = none)", low=0)
  train_samples_every: int = setting(10, "RL steps between training samples (0 = none)",
                                     low=0)
  logprob_check_every: int = setting(10, "RL steps between checks of the trainer's log-probs "
                                     "of one batch scored all at once and one row at a time "
                                     "(trainer_logp_batch_gap; 0 = never)", low=0)


@dataclasses.dataclass(frozen=True)
class CheckpointSettings(Settings):
  """config.checkpoint: how often the run is saved, and how many saves are kept."""
  SECTION = "checkpoint"
  every: int = setting(100, "iterations between checkpoints (and at phase ends)", low=1)
  max_to_keep: int = setting(2, "newest checkpoints kept in workdir/checkpoints", low=1)


@dataclasses.dataclass(frozen=True)
class MeshSettings(Settings):
  """config.mesh: the device mesh (sharding/mesh.py; docs/pod.md). All 1 = one device,
  unsharded. The product must equal the number of devices; one axis may be -1 (the devices
  the others leave)."""
  SECTION = "mesh"
  data: int = setting(1, "data parallel: parameters replicated")
  fsdp: int = setting(1, "data parallel with parameters / optimiser state split")
  tensor: int = setting(1, "tensor parallel: heads and MLP units split")

  @property
  def is_single_device(self) -> bool:
    return (self.data, self.fsdp, self.tensor) == (1, 1, 1)


@dataclasses.dataclass(frozen=True)
class RunSettings(Settings):
  """A run's config, typed: every section the library reads (`from_config` reads them
  once; the launcher itself reads workdir, resume and distributed).

  >>> RunSettings(rl=RLSettings(async_=True, staleness=2)).check()
  Traceback (most recent call last):
  ...
  ValueError: config.rl.async_ has real staleness (bounded by rl.max_staleness); config.rl.staleness = 2 simulates it in the sync loop. Set one of them: rl.staleness = 0 or rl.async_ = False.
  """
  seed: int = setting(0, "seeds parameters, data order and sampling")
  task: TaskSettings = nested(TaskSettings, "the task")
  dataset: DatasetSettings = nested(DatasetSettings, "the dataset task's config.task fields")
  model: ModelSettings = nested(ModelSettings, "the policy")
  rollout: RolloutSettings = nested(RolloutSettings, "RL batches")
  warm_start: WarmStartSettings = nested(WarmStartSettings, "the supervised phase")
  rl: RLSettings = nested(RLSettings, "the GRPO phase")
  lora: LoraSettings = nested(LoraSettings, "LoRA adapters")
  loss: LossSettings = nested(LossSettings, "the objective")
  advantage: AdvantageSettings = nested(AdvantageSettings, "the advantage estimator")
  reward: RewardSettings = nested(RewardSettings, "the reward stage")
  moe: MoeSettings = nested(MoeSettings, "a mixture-of-experts policy's routing replay and "
                            "router losses")
  distill: DistillSettings = nested(DistillSettings, "on-policy distillation")
  selection: SelectionSettings = nested(SelectionSettings, "prompt selection")
  tools: ToolSettings = nested(ToolSettings, "the environment")
  eval: EvalSettings = nested(EvalSettings, "held-out evaluation")
  metrics: MetricsSettings = nested(MetricsSettings, "metrics and samples")
  checkpoint: CheckpointSettings = nested(CheckpointSettings, "checkpoints")
  mesh: MeshSettings = nested(MeshSettings, "the device mesh")

  @classmethod
  def from_config(cls, node: Mapping[str, Any], **extra: Any) -> "RunSettings":
    """The run's settings from its config; the dataset fields are read from config.task,
    and a section a config.json from before it was added lacks is at its defaults."""
    task = node["task"]
    return super().from_config(node, dataset=DatasetSettings.from_config(task),
                               task=TaskSettings.from_config(task, difficulty=dict(
                                   task.get("difficulty") or {})), **extra)

  def check(self) -> None:
    """Raises ValueError naming the first inconsistent field and its fix: ranges, then
    names, then the cross-section table (`_CROSS_CHECKS`, with the environment's and the
    distillation's own rules), then LoRA's and the selection rule's. The task's builder (difficulty fields) and a
    warm start's source are checked by rl.wiring.validate, which builds them."""
    for section in (self.task, self.warm_start, self.rl, self.lora, self.eval,
                    self.checkpoint, self.metrics):
      Settings.check(section)
    self.task.check_names()
    self.model.check()
    self.loss.check()
    self.advantage.check()
    self.reward.check()
    self.rollout.check()
    self.rollout.kind_spec.check(self.rollout, bool(self.tools.name))
    for rule in _CROSS_CHECKS:
      rule(self)
    self.lora.check()
    from rl.rollouts import selection  # pylint: disable=import-outside-toplevel
    selection.check(self.selection, prompts_per_step=self.rollout.prompts_per_step,
                    group_size=self.rollout.group_size, pool_size=self.task.train_pool)


# --- The cross-section table: each rule refuses one combination that does not compose -----


def _batch_layout(settings: RunSettings) -> None:
  r, rl = settings.rollout, settings.rl
  rows = r.prompts_per_step * r.rows_per_prompt
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
  if not r.kind_spec.identical_prompt_groups:
    raise ValueError(f"config.rl.prefix_shared_forward needs groups of G independent samples of "
                     f"one prompt (config.rollout.kind='independent'), got {r.kind!r}.")
  if r.prompts_per_step % rl_parts:
    raise ValueError(f"config.rl.prefix_shared_forward needs whole groups per microbatch: "
                     f"config.rollout.prompts_per_step = {r.prompts_per_step} must be divisible "
                     f"by config.rl.num_minibatches * num_microbatches = {rl_parts}.")
  if rl.logprob_chunk:
    raise ValueError("config.rl.logprob_chunk chunks the plain forward's log-probs; the "
                     "prefix-shared forward has its own layout: turn one of them off.")
  if settings.loss.token_subsample == "urs":
    raise ValueError("config.loss.token_subsample = 'urs' keeps the tokens it drops as "
                     "context after the prompt, which the prefix-shared forward does not "
                     "allow; use token_subsample='rpc' or turn config.rl.prefix_shared_forward "
                     "off.")


def _speculative(settings: RunSettings) -> None:
  """Speculative drafts decode independent samples on one device; 'history' needs prompts
  that recur, 'group' needs groups of group_size rows."""
  r, s = settings.rollout, settings.rollout.speculative
  if not s.tokens:
    return
  if not r.kind_spec.speculative:
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
  if "group" in s.sources and not settings.selection.rule.equal_groups:
    raise ValueError("config.rollout.speculative.sources 'group' needs groups of "
                     "config.rollout.group_size rows; config.selection.kind='adaptive' sizes "
                     "them per prompt. Use prompt_lookup or another selection kind.")
  s.draft_config(r.group_size)  # bad sources or sizes fail here


def _no_reference_policy(settings: RunSettings) -> None:
  if settings.loss.kl_coef:
    raise ValueError(f"config.loss.kl_coef = {settings.loss.kl_coef}: the launcher has no "
                     "reference policy to take a KL to (no reference forward is wired in). "
                     "Set config.loss.kl_coef=0; to keep the policy near another one, use "
                     "on-policy distillation (config.distill.teacher, docs/distillation.md).")


def _groups(settings: RunSettings) -> None:
  r = settings.rollout
  if settings.rl.prefix_shared_forward and not settings.selection.rule.equal_groups:
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
  if r.kind_spec.group_relative and r.group_size < 2:
    raise ValueError(f"config.rollout.group_size = {r.group_size}: group-relative advantages "
                     "need at least 2 completions per prompt.")
  if any(b < 1 for b in r.train_length_buckets):
    raise ValueError(f"config.rollout.train_length_buckets = {r.train_length_buckets}: every "
                     "bucket must be a positive number of completion slots.")


def check_composition(settings: RunSettings) -> None:
  """The switch combinations that do not compose (docs/configuration.md has the whole
  matrix): every other combination of rollout.kind, selection.kind, rl.async_,
  rl.staleness and the mesh runs, each switch with its effect."""
  r, rl, kind, m = settings.rollout, settings.rl, settings.selection.kind, settings.mesh
  if not r.kind_spec.any_selection and settings.selection.rule.chooses:
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
  default_bound = RLSettings.defaults()["max_staleness"]
  if not rl.async_ and not r.kind_spec.bounds_staleness and rl.max_staleness != default_bound:
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
  if not r.kind_spec.mesh and not m.is_single_device:
    raise ValueError(f"config.rollout.kind = {r.kind!r} decodes on one device; the sharded "
                     f"sampler (mesh data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) decodes "
                     "independent samples only. Use rollout.kind='independent' or mesh.data = "
                     "mesh.fsdp = mesh.tensor = 1.")


def _tools(settings: RunSettings) -> None:
  """Demonstrations of a tool the run does not have, and what rollouts with turns do not
  compose with."""
  tools, r = settings.tools, settings.rollout
  tools.check()
  share = settings.task.difficulty.get("tool_share", 0.0)
  if not tools.name and share:
    raise ValueError(f"config.task.difficulty.tool_share = {share} demonstrates the adder, "
                     "but the run has no environment to answer it (the policy would be "
                     "trained to write the tool's answers itself): set "
                     "config.tools.name='adder', or tool_share=0.")
  if not tools.name:
    return
  if not r.kind_spec.tools:
    raise ValueError(f"config.tools.name with config.rollout.kind={r.kind!r}: its rows cannot "
                     "pause at the environment's calls (a tree forks rows that share a "
                     "prefix, and an answer would have to be copied into every branch); use "
                     "rollout.kind='independent' or 'partial' with tools.")
  if r.speculative.tokens:
    raise ValueError("config.tools.name with config.rollout.speculative.tokens > 0: "
                     "speculative decoding does not pause rows at tool calls; set "
                     "rollout.speculative.tokens=0.")
  if settings.rl.prefix_shared_forward:
    raise ValueError("config.tools.name with config.rl.prefix_shared_forward: environment "
                     "answers are context after the prompt, which the prefix-shared forward "
                     "does not allow; turn config.rl.prefix_shared_forward off.")
  if not settings.mesh.is_single_device:
    raise ValueError("config.tools.name runs turns on one device; set mesh.data = mesh.fsdp "
                     "= mesh.tensor = 1.")


def _distillation(settings: RunSettings) -> None:
  settings.distill.check()
  if settings.distill.teacher and settings.rl.prefix_shared_forward:
    raise ValueError("config.distill needs the full per-token distributions of the batch; "
                     "turn config.rl.prefix_shared_forward off.")
  if settings.distill.teacher and settings.loss.token_subsample != "none":
    raise ValueError(f"config.loss.token_subsample = {settings.loss.token_subsample!r} with "
                     "config.distill.teacher: NAT reweights the policy objective's kept "
                     "tokens, and the distillation term would be taken over the kept tokens "
                     "unweighted (a biased estimate); set loss.token_subsample='none' or "
                     "distill.teacher=''.")


def _reward_stage(settings: RunSettings) -> None:
  reward, process = settings.reward, settings.advantage.is_process
  name = f"config.advantage.name = {settings.advantage.name!r}"
  if reward.active and settings.selection.kind != "uniform":
    raise ValueError("An active config.reward (noise, second opinion or majority vote) changes "
                     f"rewards after the batch is made, and config.selection.kind = "
                     f"{settings.selection.kind!r} chooses prompts from the task's own rewards, "
                     "which it would then read instead; set selection.kind='uniform'.")
  if reward.active and settings.rollout.kind == "pruned":
    raise ValueError("An active config.reward (noise, second opinion or majority vote) changes "
                     "rewards after the batch is made, and config.rollout.kind = 'pruned' trains "
                     "its head on the task's own rewards; use another rollout kind.")
  if process and settings.selection.kind != "uniform":
    raise ValueError(f"{name} reads step rewards of rows scored for this batch, and "
                     f"config.selection.kind = {settings.selection.kind!r} may train rows no "
                     "scorer saw this step (AR3PO's reused responses would get no step "
                     "reward); process estimators run with selection.kind='uniform'.")
  if process and settings.rollout.kind not in ("independent", "partial"):
    raise ValueError(f"{name} needs independent rows (rollout.kind 'independent' or "
                     f"'partial'); config.rollout.kind = {settings.rollout.kind!r} "
                     + ("has its own advantage stage (config.rollout.tree.advantage)."
                        if settings.rollout.kind == "tree" else "is not one of them."))
  if process and settings.tools.name:
    raise ValueError(f"{name} places step rewards on the policy's tokens, and "
                     "config.tools.name puts environment text between them; turn one off.")


def _advantage_source(settings: RunSettings) -> None:
  """config.advantage.name is read only where the rollout kind takes its advantages from
  the estimator, and a correction that computes advantages of its own (VCPO's baseline:
  GRPO's group statistics around its off-policy baseline) replaces whatever the estimator
  or the tree computed, so it runs with the default estimator on group-relative batches."""
  name, kind = settings.advantage.name, settings.rollout.kind_spec
  default = AdvantageSettings.defaults()["name"]
  if kind.own_advantages and name != default:
    raise ValueError(f"config.advantage.name = {name!r} has no effect with "
                     f"config.rollout.kind = {settings.rollout.kind!r}, whose advantages are "
                     "config.rollout.tree.advantage's; set that, or leave "
                     f"config.advantage.name at its default {default!r}.")
  from rl.objectives import corrections  # pylint: disable=import-outside-toplevel
  own = [c for c in settings.loss.chain
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
  from models import config as model_configs  # pylint: disable=import-outside-toplevel
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
  if moe.routing_replay and settings.selection.kind == "ar3po" and settings.selection.ar3po.reuse:
    raise ValueError("config.moe.routing_replay replays each row's recorded experts, and "
                     "AR3PO's reused responses (config.selection.ar3po.reuse) keep none; set "
                     "selection.ar3po.reuse = False.")


def _low_precision(settings: RunSettings) -> None:
  """config.rollout.weights (a quantised sampler) and score centering's sampler record
  against the rest."""
  weights, single = settings.rollout.weights, settings.mesh.is_single_device
  if weights and not single:
    raise ValueError(f"config.rollout.weights={weights!r} runs on one device: the sampler's "
                     "sharding rules lay out float weights, not quantised ones; drop the mesh "
                     "or set config.rollout.weights=''.")
  if not settings.loss.reads_sampler_topk:
    return
  name = "Score centering (config.loss.corrections 'score_centering')"
  if settings.rollout.kind == "partial":
    raise ValueError(f"{name} records the sampler's distribution with the parameters that "
                     "produced the batch, and config.rollout.kind = 'partial' continues rows "
                     "sampled by earlier ones; use another rollout kind.")
  if settings.selection.kind == "ar3po" and settings.selection.ar3po.reuse:
    raise ValueError(f"{name} records the sampler's distribution with the parameters that "
                     "produced the batch, and AR3PO's reused responses were sampled by "
                     "earlier ones; set selection.ar3po.reuse = False.")
  if not single:
    raise ValueError(f"{name} records the sampler's distribution on one device; set "
                     "mesh.data = mesh.fsdp = mesh.tensor = 1.")
  if settings.rl.prefix_shared_forward or settings.rl.logprob_chunk or settings.distill.teacher:
    raise ValueError(f"{name} reads the trainer's log-probs of the sampler's top-K tokens "
                     "from the full forward's dense log-softmax; turn off config.rl."
                     "prefix_shared_forward, config.rl.logprob_chunk and config.distill.")


_CROSS_CHECKS = (_batch_layout, _prefix_sharing, _speculative, _no_reference_policy, _groups,
                 check_composition, _tools, _distillation, _reward_stage, _advantage_source,
                 _moe, _low_precision)
