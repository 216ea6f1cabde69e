"""Zero-RL GRPO on GSM8K from Qwen2.5-0.5B (base), after SimpleRL-Zoo, from local files.

    # Elsewhere (Arbor reaches no model hub): the base model as a Hugging Face folder, and
    # GSM8K's train / test splits as JSON Lines with the official fields "question" and
    # "answer" (a worked solution ending in "#### 72").
    #   huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir checkpoints/Qwen2.5-0.5B
    #   datasets: load_dataset("openai/gsm8k", "main")[split].to_json(f"data/gsm8k/{split}.jsonl")
    python -m experiments.train --config=experiments/configs/qwen2_5_gsm8k.py \\
        --config.model.checkpoint=/path/to/Qwen2.5-0.5B \\
        --config.task.path=/path/to/gsm8k/train.jsonl \\
        --config.task.eval_path=/path/to/gsm8k/test.jsonl

The task is `dataset` (rl/tasks/dataset.py, docs/datasets.md): the train file's rows are
shuffled afresh each pass, the whole test file (1319 problems) is the held-out set and no
test question is trained on; a completion scores 1 when its final answer (last \\boxed{},
else last '####' line, else last number) equals the '####' answer, by math-verify, else 0.
This recipe is not run in Arbor's tests or CI (no Qwen weights, no GPU there):
tests/test_dataset_task.py::test_the_qwen_recipe_validates_and_reads_gsm8k_files validates it
with a tiny random Qwen2 folder and tiny GSM8K-format files, and nothing here has been
measured on the real model.

What it keeps from SimpleRL-Zoo (Zeng et al. 2025, arXiv 2503.18892; hkust-nlp/simpleRL-
reason, "Reproducing SimpleRL-Zoo"):
  - zero RL: GRPO straight from the base model, no supervised warm start;
  - the reward: correctness alone (1 / 0), no format term;
  - their Qwen prompt ("qwen_boxed"), verbatim: system "You are a helpful assistant.", the
    question, then "Please reason step by step, and put your final answer within
    \\boxed{}." as one ChatML user turn, the assistant turn open. It is written out in
    `task.template` with `model.chat_template = False`: the checkpoint's own template would
    put Qwen2.5's default system prompt in its place;
  - 8 samples per prompt at temperature 1.0 (no top-k / top-p), learning rate 1e-6, PPO
    clip 0.2, gradient clipping at 1.0, and 4 PPO mini-batches per rollout batch (their
    1024 prompts in mini-batches of 256), one epoch; the loss a token mean over a batch's
    tokens (verl's masked mean).

What differs, and why:
  - GSM8K alone (train: 7473 problems), where SimpleRL-Zoo trains small models on 8K
    problems of GSM8K and MATH level 1 ("Easy"); point task.path elsewhere for theirs.
  - 16 prompts per step (128 completions), not 1024: Arbor samples a step's rollouts in one
    batch on one device, and the sampler's plan for 128 rows of 512 + 4096 tokens already
    peaks at 46.8 GiB (below); 512 rows did not even compile on a 139 GiB H200. The
    optimiser so takes 64 times as many updates per problem seen as theirs at the same
    learning rate; on a mesh of several devices, raise rollout.prompts_per_step (and
    rl.num_microbatches) in proportion.
  - Completions of at most 4096 tokens (theirs: 8192; their training script's default is
    3072): GSM8K's reference solutions are a few hundred characters, and an unfinished
    completion scores 0 either way. Prompts of up to 512 tokens (theirs: 1024; a longer
    prompt is an error naming rollout.prompt_len, never cut).
  - No KL term (theirs: low-variance KL loss, coefficient 1e-4 for 0.5B-14B models): the
    launcher has no reference policy and refuses loss.kl_coef > 0. No entropy bonus (theirs:
    1e-3): Arbor's objectives have none.
  - 6400 steps of 16 prompts: the prompts of their ~100 steps of 1024 (about 14 passes
    over GSM8K's train split).
  - Held-out accuracy is greedy (their reported numbers sample at temperature 1.0, top-p
    0.95, with Qwen2.5-Math's evaluation code).
  - Generation stops at the tokenizer's end-of-sequence token (the base model's
    tokenizer_config.json names <|endoftext|>). Decoding drops special tokens,
    <|im_end|> among them, so should the model write another turn after its own before
    <|endoftext|>, that text is scored too (its last box wins). Not observed here: the
    recipe has not been run.

Memory: float32 master weights and AdamW moments with bfloat16 compute
(model.compute_dtype), each layer rematerialised in the backward (model.remat=full) and
log-probs 256 positions at a time (rl.logprob_chunk), so no [B, T, 151936] logits exist;
8 micro-batches of 4 rows per update. XLA's memory analysis of the compiled programs
(experiments/memory.py's plan, compiled on one H200 with the JAX 0.11.2 installed there, not
the pinned 0.10.2; nothing was run, 2026-12-04): one update on 4 rows of 4608 tokens peaks
at 22.2 GiB (weights 1.8, AdamW 3.7, temporaries 16.7), the sampler on 128 rows of 512 + 4096
tokens at 46.8 GiB (its largest buffers: the prefill's attention scores over the whole
4608-slot cache), so each fits one 80 GB device. The train step's command:
`python -m experiments.memory --model=qwen2_5_0_5b --batch=4 --seq_len=4608
--new_tokens=4096 --logprob_chunk=256 --remat=full --compute_dtype=bfloat16` (docs/pod.md).
"""

import ml_collections

from experiments.configs import default

# SimpleRL-Zoo's Qwen prompt (their "qwen_boxed" template), with {question} and {instruction}.
SIMPLERL_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SIMPLERL_TEMPLATE = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                     "<|im_start|>user\n{question}\n{instruction}<|im_end|>\n"
                     "<|im_start|>assistant\n")


def get_config() -> ml_collections.ConfigDict:
  c = default.get_config()
  c.workdir = "runs/qwen2_5_gsm8k"

  c.task.name = "dataset"
  c.task.prompt_style = "full"        # the only style: the file's text needs a subword tokenizer
  c.task.path = "data/gsm8k/train.jsonl"  # GSM8K's train split (7473 rows), JSON Lines
  c.task.eval_path = "data/gsm8k/test.jsonl"  # GSM8K's test split: all held out
  c.task.eval_size = 1319             # the whole test split
  c.task.prompt_field = "question"    # GSM8K's fields
  c.task.answer_field = "answer"      # a worked solution ending "#### 72"
  c.task.instruction = SIMPLERL_INSTRUCTION
  c.task.template = SIMPLERL_TEMPLATE
  c.task.difficulty = ml_collections.ConfigDict()  # the dataset task has no difficulty fields

  c.model.checkpoint = "checkpoints/Qwen2.5-0.5B"  # a HF folder downloaded elsewhere (above)
  c.model.chat_template = False       # task.template is the whole ChatML prompt
  c.model.dtype = "float32"           # master weights and AdamW moments
  c.model.compute_dtype = "bfloat16"  # matmuls, activations and the KV cache
  c.model.remat = "full"              # their gradient checkpointing

  c.rollout.prompt_len = 512
  c.rollout.max_new_tokens = 4096
  c.rollout.temperature = 1.0
  c.rollout.top_k = 0
  c.rollout.top_p = 1.0
  c.rollout.group_size = 8
  c.rollout.prompts_per_step = 16     # SimpleRL-Zoo: 1024 (see the docstring)
  c.rollout.train_length_buckets = (256, 512, 1024, 2048)  # most solutions are short

  c.warm_start.steps = 0              # zero RL: no supervised warm start
  c.warm_start.batch_size = 8         # (unused; a multiple of rl.num_microbatches)

  c.rl.steps = 6400                   # SimpleRL-Zoo's ~100 steps x 1024 prompts
  c.rl.learning_rate = 1e-6
  c.rl.warmup_steps = 0
  c.rl.weight_decay = 0.0
  c.rl.max_grad_norm = 1.0
  c.rl.num_minibatches = 4            # PPO mini-batches of 4 prompts (theirs: 256 of 1024)
  c.rl.ppo_epochs = 1
  c.rl.num_microbatches = 8           # 4 rows of up to 4608 tokens at a time
  c.rl.logprob_chunk = 256            # no [B, T, V] logits (V = 151936)

  c.loss.name = "grpo"
  c.loss.eps_low = 0.2
  c.loss.eps_high = 0.2
  c.loss.aggregation = "token_mean"
  c.loss.kl_coef = 0.0                # theirs: 1e-4; the launcher has no reference policy
  c.advantage.name = "grpo"           # (reward - group mean) / group std

  c.eval.every = 20                   # greedy accuracy on the 1319 test problems
  c.eval.batch_size = 128             # greedy decoding: the sampler's 128 rows (above)
  c.checkpoint.every = 20             # ~6 GB each (float32 weights and moments)
  c.checkpoint.max_to_keep = 2
  return c
