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
from ml_collections import config_dict


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

  c.task = ml_collections.ConfigDict()
  c.task.name = "running_sum"         # running_sum (rl/tasks/running_sum.py), gsm_symbolic (math
                                      # word problems, rl/tasks/gsm.py; configs/smollm2_gsm.py),
                                      # dataset (a local file, rl/tasks/dataset.py;
                                      # docs/datasets.md) or a reasoning-gym dataset
                                      # (rl/tasks/gym.py; configs/chain_sum_compact.py)
  c.task.prompt_style = "compact"     # "compact" ("4-1=") for the char tokenizer; "full"
  c.task.eval_size = 500              # held-out items (greedy exact match)
  # The task's difficulty fields (running_sum: rl/tasks/running_sum.py Difficulty; gsm_symbolic:
  # rl/tasks/gsm.py Options, with format_reward; a reasoning-gym dataset: its config's fields).
  c.task.difficulty = ml_collections.ConfigDict(dict(
      min_steps=1, max_steps=9, length_tail=1.9, digits=7, step=5,
      teacher_carry_slip=(0.55, 0.9), state_credit=0.0, tool_share=0.0))
  c.task.train_pool = 0               # GRPO cycles over train positions [0, pool) (0 = unbounded)
  # The dataset task's files and fields (task.name = "dataset"; docs/datasets.md): another
  # task refuses any of them changed from its default. Its difficulty must be empty
  # (--config.task.difficulty={} on this config).
  c.task.path = ""                    # JSON Lines (one object per line) or Parquet file of rows
  c.task.eval_path = ""               # held-out rows' file ("" = hold out eval_size rows of
                                      # path: those whose prompt has the smallest SHA-256)
  c.task.prompt_field = "question"    # the rows' field holding the question text
  c.task.answer_field = "answer"      # the rows' field holding the reference answer: a GSM8K
                                      # solution ending "#### 42", a \boxed{} solution, a number
                                      # or a LaTeX answer
  c.task.instruction = config_dict.placeholder(str)  # {instruction} in the template (unset:
                                      # rl/tasks/gsm.py DEFAULT_INSTRUCTION; "" = none)
  c.task.template = "{question} {instruction}"  # the prompt ({question}: the prompt field's
                                      # text), spaces stripped

  c.model = ml_collections.ConfigDict()
  c.model.preset = "tiny2"            # models/config.py PRESETS (two layers, RoPE base 100)
  c.model.dtype = "float32"           # parameters (master weights; AdamW's moments follow):
                                      # float32 | bfloat16
  c.model.compute_dtype = ""          # matmuls, activations, KV cache: "" (= dtype) | float32 |
                                      # bfloat16 (mixed precision over float32 parameters)
  c.model.checkpoint = ""             # "" = from scratch (preset + char tokenizer); else a HF
                                      # folder, a .gguf file or "smollm2" (docs/checkpoints.md)
  c.model.tokenizer = ""              # "" = the checkpoint's own; else a tokenizer.json file or
                                      # a HF folder holding one (for a folder without it)
  c.model.chat_template = False       # wrap prompts in the checkpoint's chat template
  c.model.remat = "none"              # training forward: rematerialise each layer in the
                                      # backward: none | full (keep layer inputs) | dots (and
                                      # matmul outputs); same gradients, less memory

  c.rollout = ml_collections.ConfigDict()
  c.rollout.prompt_len = 16           # prompt slots (BOS + prompt, left-padded)
  c.rollout.max_new_tokens = 101      # completion slots (the longest worked solution + EOS)
  c.rollout.temperature = 1.0         # sampling temperature of GRPO rollouts (> 0; evaluation
                                      # decodes greedily)
  c.rollout.top_k = 0                 # 0 = off
  c.rollout.top_p = 1.0               # 1.0 = off
  c.rollout.group_size = 8            # completions per prompt (G)
  c.rollout.prompts_per_step = 8      # prompts per GRPO step
  c.rollout.kind = "independent"      # "independent": group_size samples per prompt;
                                      # "tree": one tree per prompt (sampling/tree.py);
                                      # "partial": a resumable pool of rows, each round
                                      # stops once prompts_per_step groups are complete
                                      # (APRIL / CoPRIS; sampling/partial.py)
  c.rollout.tree = ml_collections.ConfigDict()  # used when kind == "tree"
  c.rollout.tree.policy = "entropy"   # entropy (TreeRL) | segments (TreePO) | lookahead (LATR)
  c.rollout.tree.advantage = "treerl"  # rl/objectives/advantages.py TREE_ADVANTAGES: treerl (value gaps
                                      # / sqrt(leaves)) | treerl_normalized (/ leaf std) | siblings
  c.rollout.tree.init_chains = 4      # chains grown from each prompt (M)
  c.rollout.tree.fork_points = 2      # entropy: forks per round at the N highest-entropy tokens
  c.rollout.tree.branches = 2         # entropy: branches per fork point (B); segments: b
  c.rollout.tree.rounds = 1           # entropy: fork rounds (L); leaves = M + L*N*B
  c.rollout.tree.segment_len = 2      # segments: tokens between branchings (S)
  c.rollout.tree.max_depth = 2        # segments: branchings; leaves = M * b**max_depth
  c.rollout.tree.leaves = 8           # lookahead: leaf budget per prompt
  c.rollout.tree.top_k = 2            # lookahead: 1 + children per branching
  c.rollout.tree.min_entropy = 1.0    # lookahead: branch when sampling entropy (nats) >= this
  c.rollout.tree.lookahead_steps = 2  # lookahead: window before a child is checked
  c.rollout.tree.prune_similarity = 1.0  # lookahead: prune when this fraction matches parent
  c.rollout.num_slots = 0             # partial: pool rows (0 = 2 * prompts_per_step * group_size)
  c.rollout.resume = "kept_kv"        # partial: kept_kv (cheap) | reprefill (exact pi_new)
  c.rollout.decode_window = 0         # partial: most decode steps per round (0 = max_new_tokens)
  c.rollout.train_length_buckets = (24, 48)  # completion slots the train step may cut a
                                      # batch to (its longest row's bucket; () = always
                                      # max_new_tokens)
  # Speculative decoding (sampling/speculative.py): draft tokens by n-gram lookup, verify
  # them several per forward, accept exactly (the same distribution as plain decoding).
  c.rollout.speculative = ml_collections.ConfigDict()
  c.rollout.speculative.tokens = 0    # draft tokens per forward (k; 0 = plain decoding)
  c.rollout.speculative.sources = ("prompt_lookup",)  # prompt_lookup (the row's own prompt
                                      # and text) | group (its siblings' text) | history (the
                                      # prompt's previous completion; needs task.train_pool);
                                      # an earlier-listed source's match wins
  c.rollout.speculative.ngram = 3     # longest suffix matched (shorter ones tried after)

  c.warm_start = ml_collections.ConfigDict()
  c.warm_start.steps = 900            # supervised steps on reference answers (0 = skip)
  c.warm_start.batch_size = 32        # (prompt, reference answer) pairs per step
  c.warm_start.learning_rate = 3e-3   # peak; linear warmup then linear decay to 10%
  c.warm_start.warmup_steps = 20      # steps of linear learning-rate warmup
  c.warm_start.length_window = 8      # batches per length-sorted window of train examples
                                      # (1 = data order): short batches train at short lengths
  c.warm_start.init_from = ""         # "" = train the warm start here; else the workdir of a
                                      # run whose warm start finished (same seed, task, model
                                      # and warm-start settings; e.g. --config.rl.steps=0): RL
                                      # starts from its end-of-warm-start checkpoint

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 120                    # GRPO steps
  c.rl.learning_rate = 2.5e-4         # AdamW: peak, then constant
  c.rl.warmup_steps = 20              # optimiser updates of linear warmup from 0 (0 = none)
  c.rl.weight_decay = 0.0             # AdamW decoupled weight decay
  c.rl.max_grad_norm = 1.0            # global-norm gradient clipping, both phases (0 = off)
  c.rl.num_minibatches = 1            # optimiser updates per rollout batch and epoch (PPO
                                      # minibatches of contiguous whole groups)
  c.rl.ppo_epochs = 1                 # passes over each rollout batch (GRPO's mu)
  c.rl.num_microbatches = 1           # gradient accumulation within an update; num_minibatches
                                      # * num_microbatches divides prompts*group_size
  c.rl.staleness = 0                  # simulated staleness k: sample with params k optimiser
                                      # updates old (a multiple of num_minibatches * ppo_epochs)
  c.rl.async_ = False                 # producer thread samples while the trainer trains (AReaL)
  c.rl.max_staleness = 4              # async / partial: bound on train step - oldest token version
                                      # (versions count optimiser updates, several per batch
                                      # with num_minibatches * ppo_epochs > 1)
  c.rl.prefix_shared_forward = False  # run each group's prompt once in the loss forward/backward
  c.rl.logprob_chunk = 0              # > 0: log-probs this many positions at a time, so no
                                      # [B, T, V] logits buffer exists (0 = dense)

  # LoRA (Hu et al. 2021; docs/lora.md): the RL phase trains low-rank adapters on the chosen
  # projections of the warm-started (or loaded) policy, whose weights stay frozen. The warm
  # start always trains full weights.
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0                     # adapter rank r (0 = off: RL trains full weights)
  c.lora.alpha = 16.0                 # the update A @ B is scaled by alpha / r
  c.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # adapted projections

  c.loss = ml_collections.ConfigDict()
  c.loss.name = "grpo"                # rl/objectives/losses.py registry
  # Unset (None): the objective's own value where it fixes one (dapo: eps 0.2 / 0.28 and
  # token_mean; gspo: eps 3e-4 / 4e-4), else 0.2 / 0.2 / seq_mean_token_mean. A value set
  # here or on the command line, even one equal to that default, is refused where the
  # objective fixes another or never reads the field.
  c.loss.eps_low = config_dict.placeholder(float)   # PPO clip: ratio >= 1 - eps_low, A < 0
  c.loss.eps_high = config_dict.placeholder(float)  # PPO clip: ratio <= 1 + eps_high, A > 0
  c.loss.aggregation = config_dict.placeholder(str)  # token_mean | seq_mean_token_mean |
                                                     # seq_mean_token_sum_norm
  c.loss.norm_len = 0.0               # constant normaliser of seq_mean_token_sum_norm (Dr.GRPO)
                                      # (0 = rollout.max_new_tokens, the generation budget)
  c.loss.kl_coef = 0.0                # k3 KL to a reference policy: the launcher wires none
                                      # and refuses > 0 (rl.train's step takes batch.ref_logp)
  # Off-policy corrections (rl/objectives/corrections.py) appended to the objective's own, in order:
  # 'tis' | 'mis' | 'm2po' | 'sat' | 'vcpo_baseline' | 'vcpo_ess' | 'mu_veto'. Objectives fix
  # the fields that define them (e.g. dapo: eps 0.2/0.28, token_mean); setting such a field
  # to another value, or a field the objective and its corrections never read (eps_* for
  # m2po), is refused before step 1.
  c.loss.corrections = ()
  c.loss.prox_estimate = "recompute"  # proximal log-probs: "recompute" (a forward) | "loglinear"
  c.loss.is_cap = 5.0                 # TIS truncation / MIS upper bound (decoupled PPO cap)
  c.loss.is_floor = 0.0               # MIS lower bound
  c.loss.m2_tau = 0.04                # M2PO: kept tokens' mean squared log-ratio <= tau
  c.loss.sat_quantile = 0.9           # SAT: tail quantile of |logp - behav| in the batch
  c.loss.sat_bandwidth = 0.1          # SAT: kernel exp(-(|d| - q) / bandwidth)
  c.loss.vcpo_rho_ref = 1.0           # VCPO: lr scale sqrt(min(1, ESS ratio / rho_ref))
  c.loss.vcpo_is_cap = 8.0            # VCPO: truncation of the IS weight
  c.loss.vcpo_is_level = "sequence"   # VCPO: one weight per sequence (the authors') | "token"
  c.loss.mu_eps_low = 0.5             # mu_grpo relaxed clip: ratio >= 1 - mu_eps_low where A < 0;
                                      # a response with A < 0 is vetoed from its first token
                                      # outside [1 - mu_eps_low, 1 + mu_eps_high]
  c.loss.mu_eps_high = 1.0            # mu_grpo relaxed clip: ratio <= 1 + mu_eps_high where A > 0
                                      # (default interval [1/2, 2])

  c.advantage = ml_collections.ConfigDict()
  c.advantage.name = "grpo"           # rl/objectives/advantages.py registry: grpo | drgrpo | rloo | median

  # On-policy distillation (docs/distillation.md): a frozen teacher scores every sampled
  # token inside the train step; loss = policy objective + coef * distillation term.
  c.distill = ml_collections.ConfigDict()
  c.distill.teacher = ""              # "" = off; an Arbor workdir (its newest checkpoint), a HF
                                      # folder, a .gguf file or "smollm2"; same tokenizer as the
                                      # student, context >= prompt_len + max_new_tokens
  c.distill.objective = "reverse_kl"  # reverse_kl (exact) | k1 | k3 (sampled, as per-token
                                      # advantages) | forward_kl_topk
  c.distill.coef = 0.0                # weight of the distillation term (> 0 with a teacher)
  c.distill.with_reward = True        # False: pure OPD, the policy objective is dropped
  c.distill.top_k = 16                # forward_kl_topk: teacher tokens kept (renormalised)

  # Which prompts a GRPO step rolls out, and how often (rl/rollouts/selection.py).
  c.selection = ml_collections.ConfigDict()
  c.selection.kind = "uniform"        # uniform | dynamic (DAPO) | greso | adaptive
  c.selection.max_attempts = 8        # dynamic / greso: rollout rounds to fill a batch, then error
  c.selection.greso = ml_collections.ConfigDict()
  c.selection.greso.explore_prob = 0.5  # initial p_e: keep prob after z all-equal groups is p_e**z
  c.selection.greso.min_keep_prob = 0.05  # exploration floor on the keep probability
  c.selection.greso.max_skips = 10    # a prompt skipped this many epochs in a row is rolled out
  c.selection.greso.target_zero_variance = 0.25  # p_e adapts to keep each class's share near this
  c.selection.greso.adapt_step = 0.01  # p_e change per rollout round (0 = fixed p_e)
  c.selection.greso.refill = True     # then DAPO dynamic sampling (False: train on all rolled out)
  c.selection.adaptive = ml_collections.ConfigDict()
  c.selection.adaptive.prompts = 0    # prompts per step given pilot rollouts (0 = prompts_per_step)
  c.selection.adaptive.initial_rollouts = 4  # pilot rollouts per prompt
  c.selection.adaptive.max_rollouts = 0  # cap per prompt (0 = 2 * group_size)
  c.selection.adaptive.score = "variance"  # variance (pilot reward std) | beta (posterior std)
  c.selection.adaptive.history_decay = 0.5  # weight of a prompt's past rollouts per epoch (pool)

  # Tools and multi-turn environments (docs/tools.md): a row pauses when it writes the
  # environment's call (e.g. "?+5="), the environment's answer ("1234572") is
  # appended as context that nothing trains on, and decoding resumes. Evaluation reports
  # held-out accuracy with the environment and without it (eval_accuracy_no_tools).
  c.tools = ml_collections.ConfigDict()
  c.tools.name = ""                   # "" = off; adder (running_sum's "?a+b=") | calculator
                                      # (GSM8K's "<<48/2=" -> "24>>"); rl/environments.py
  c.tools.max_turns = 16              # environment answers per rollout (a later call ends it)
  c.tools.max_observation_tokens = 32  # an answer is cut to this many tokens
  c.tools.timeout_s = 0.0             # time limit of one environment step in the scoring
                                      # worker (0 = the environment's own, 1 s for built-ins)

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 30                   # GRPO steps between held-out evaluations
  c.eval.batch_size = 250             # prompts per greedy decoding batch

  # Where metrics go besides metrics.jsonl (experiments/metrics.py; always written).
  c.metrics = ml_collections.ConfigDict()
  c.metrics.tensorboard = True        # TensorBoard event files next to metrics.jsonl
  c.metrics.wandb_project = ""        # Weights & Biases project ("" = off; pip install wandb)

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 100            # iterations between checkpoints (and at phase ends)
  c.checkpoint.max_to_keep = 2        # newest checkpoints kept in workdir/checkpoints

  # Device mesh (sharding/mesh.py; docs/pod.md). All 1 = one device, unsharded. The product
  # must equal the number of devices; one axis may be -1 (the devices the others leave).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1                     # data parallel: parameters replicated
  c.mesh.fsdp = 1                     # data parallel with parameters / optimiser state split
  c.mesh.tensor = 1                   # tensor parallel: heads and MLP units split

  # Multi-process start (sharding/multihost.py). Empty coordinator = read
  # JAX_COORDINATOR_ADDRESS; unset there too = a single-process run. 'auto' = let JAX detect
  # the cluster (Cloud TPU, SLURM, Open MPI, Kubernetes).
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""  # host:port of process 0
  c.distributed.num_processes = 0     # 0 = JAX_NUM_PROCESSES or auto-detect
  c.distributed.process_id = -1       # -1 = JAX_PROCESS_ID or auto-detect
  return c
