"""The embedded default run: the running_sum testbed (rl/tasks/running_sum.py, docs/testbed.md).

`python -m experiments.train` uses this file; override any field on the command line,
e.g. `--config.rl.steps=50 --config.loss.name=grpo`.

A two-layer decoder from scratch warm-starts on worked solutions (add 5 to a 7-digit number
k = 1..9 times, writing the state "count:total" after each addition: 21 to 101 completion
tokens) from a teacher that forgets 55-90% of the carries, then GRPO learns to carry and the
held-out accuracy climbs from about a quarter. About ten minutes on two CPU cores.
experiments/configs/chain_sum_compact.py is the previous default.
"""

import ml_collections

# The typed settings of each section (rl/settings/): they import no JAX, so loading this file
# (the launcher does, when its --config flag is defined) stays light.
from rl.settings import dataset
from rl.settings import distill
from rl.settings import loss
from rl.settings import model
from rl.settings import moe
from rl.settings import reward
from rl.settings import rollout
from rl.settings import run
from rl.settings import selection
from rl.settings import stages
from rl.settings import tools

import rl.extensions  # registers the batch stages of rl/extensions/ (config.stages)  # pylint: disable=unused-import,wrong-import-order


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0                          # seeds parameters, data order and sampling
  c.workdir = "runs/default"          # metrics.jsonl, plot.png, checkpoints/ go here
  c.resume = ml_collections.ConfigDict()
  c.resume.enabled = True             # continue from the newest checkpoint in workdir
  c.resume.allow_changes = ""         # fields a relaunch may change before resuming, e.g.
                                      # "rl.steps,eval.every"; any other field that differs
                                      # from the launch that wrote the checkpoints is refused
                                      # (launches.jsonl records each launch's config)

  # The task and its held-out split (rl/settings/run.py TaskSettings declares each field).
  c.task = run.TaskSettings.config_section()
  # The task's difficulty fields (running_sum: rl/tasks/running_sum.py Difficulty; gsm_symbolic:
  # rl/tasks/gsm.py Options, with format_reward; a reasoning-gym dataset: its config's fields).
  c.task.difficulty = ml_collections.ConfigDict(dict(
      min_steps=1, max_steps=9, length_tail=1.9, digits=7, step=5,
      teacher_carry_slip=(0.55, 0.9), state_credit=0.0, tool_share=0.0))
  # The dataset task's files and fields (task.name = "dataset"; docs/datasets.md;
  # rl/settings/dataset.py DatasetSettings declares each): another task refuses any of them
  # changed from its default. Its difficulty must be empty (--config.task.difficulty={} on
  # this config).
  c.task.update(dataset.DatasetSettings.config_section())

  # The policy's shapes, weights, tokenizer and numerics (rl/settings/model.py ModelSettings).
  c.model = model.ModelSettings.config_section()

  # How the RL phase samples its batches (rl/settings/rollout.py RolloutSettings, with
  # TreeSettings and SpeculativeSettings nested: each field's default, range and meaning are
  # declared there).
  c.rollout = rollout.RolloutSettings.config_section()

  # Supervised steps on the task's reference answers before RL (rl/settings/run.py
  # WarmStartSettings declares each field).
  c.warm_start = run.WarmStartSettings.config_section()

  # The GRPO phase's optimiser, batch layout and staleness (rl/settings/run.py RLSettings).
  c.rl = run.RLSettings.config_section()

  # LoRA (Hu et al. 2021; docs/lora.md; rl/settings/run.py LoraSettings): the RL phase
  # trains low-rank adapters on the chosen projections of the warm-started (or loaded)
  # policy, whose weights stay frozen. The warm start always trains full weights.
  c.lora = run.LoraSettings.config_section()

  # The objective, its off-policy corrections and every setting they read: each field's
  # default, range and meaning are declared once, in rl/settings/loss.py LossSettings.
  # The fields an objective may fix (eps_low, eps_high, aggregation) are unset: its own
  # value where it fixes one, else 0.2 / 0.2 / seq_mean_token_mean. A field set here or on
  # the command line, even to that default, is refused where the objective fixes another
  # value or never reads the field.
  c.loss = loss.LossSettings.config_section()

  # The advantage estimator (rl/settings/run.py AdvantageSettings).
  c.advantage = run.AdvantageSettings.config_section()

  # What the trainer is rewarded with: a noisy verifier and its second opinion, or TTRL's
  # majority vote (rl/rewards.py; rl/settings/reward.py RewardSettings declares each field).
  c.reward = reward.RewardSettings.config_section()

  # A mixture-of-experts policy's rollout routing replay (R3) and router losses
  # (docs/moe.md; rl/settings/moe.py MoeSettings declares each field).
  c.moe = moe.MoeSettings.config_section()

  # On-policy distillation (docs/distillation.md; rl/settings/distill.py
  # DistillSettings declares each field).
  c.distill = distill.DistillSettings.config_section()

  # Which prompts a GRPO step rolls out, and how often (rl/settings/selection.py
  # SelectionSettings: each field's default, range and meaning are declared there).
  c.selection = selection.SelectionSettings.config_section()

  # Tools and multi-turn environments (docs/tools.md; rl/settings/tools.py
  # ToolSettings declares each field). Evaluation reports held-out accuracy with the
  # environment and without it (eval_accuracy_no_tools).
  c.tools = tools.ToolSettings.config_section()

  # Held-out evaluation during the run (rl/settings/run.py EvalSettings).
  c.eval = run.EvalSettings.config_section()

  # Where metrics go besides metrics.jsonl (experiments/metrics.py; always written), and the
  # samples kept (rl/settings/run.py MetricsSettings).
  c.metrics = run.MetricsSettings.config_section()

  # How often the run is saved, and how many saves are kept (CheckpointSettings).
  c.checkpoint = run.CheckpointSettings.config_section()

  # Device mesh (sharding/mesh.py; docs/pod.md; rl/settings/run.py MeshSettings). All 1 =
  # one device, unsharded. The product must equal the number of devices; one axis may be -1
  # (the devices the others leave).
  c.mesh = run.MeshSettings.config_section()

  # Batch stages added by the modules of rl/extensions/ (rl/settings/stages.py): one section
  # per stage, config.stages.<name>, from the settings class the module registers.
  c.stages = stages.config_section()

  # Multi-process start (sharding/multihost.py). Empty coordinator = read
  # JAX_COORDINATOR_ADDRESS; unset there too = a single-process run. 'auto' = let JAX detect
  # the cluster (Cloud TPU, SLURM, Open MPI, Kubernetes).
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""  # host:port of process 0
  c.distributed.num_processes = 0     # 0 = JAX_NUM_PROCESSES or auto-detect
  c.distributed.process_id = -1       # -1 = JAX_PROCESS_ID or auto-detect
  return c
