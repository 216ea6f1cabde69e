"""The run's other sections (task, warm_start, rl, lora, advantage, eval, metrics,
checkpoint, mesh) typed, and the run as a whole: `RunSettings` reads every section of a
run's config once, and `RunSettings.check` refuses, before anything is built, each field
out of its range or choices, or set while it is not read, naming the field and the fix.
The names a registry knows and the combinations of switches that do not compose are
checked above this package, by `rl.composition.check`.

Like the other settings modules it imports nothing above rl/settings/.
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
from rl.settings import stages as stage_settings
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

  >>> RunSettings(rl=RLSettings(steps=-1)).check()
  Traceback (most recent call last):
  ...
  ValueError: config.rl.steps = -1 must be >= 0.
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
  # config.stages: each registered batch stage's settings, by name (rl/settings/stages.py).
  stages: Mapping[str, Settings] = dataclasses.field(
      default_factory=lambda: stage_settings.read({}))

  @classmethod
  def from_config(cls, node: Mapping[str, Any], **extra: Any) -> "RunSettings":
    """The run's settings from its config; the dataset fields are read from config.task,
    and a section a config.json from before it was added lacks is at its defaults."""
    task = node["task"]
    return super().from_config(node, dataset=DatasetSettings.from_config(task),
                               task=TaskSettings.from_config(task, difficulty=dict(
                                   task.get("difficulty") or {})),
                               stages=stage_settings.read(node.get("stages")), **extra)

  def check(self) -> None:
    """Raises ValueError naming the first field out of its range or choices, or set while
    it is not read, section by section. What needs the registries (names) and how the
    sections compose is `rl.composition.check`, which the launcher runs after this."""
    super().check()
    for stage in self.stages.values():
      stage.check()
