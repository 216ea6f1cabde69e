"""Benchmark B10's peer (experiments/bench_accelerator.py): transformers' `generate` and
TRL's GRPOTrainer step at the shapes Arbor was just measured at, on the same accelerator.

    <python with torch, transformers and trl> experiments/peers/accelerator_peer.py '<spec>'

Never imported by Arbor. Each case is written to the spec's "part" file the moment it is
measured (the format of Arbor's sections: {"cases": [...]}), so a peer stopped by the
budget keeps what it measured. The model is a random-init Qwen2 of the spec's shape
(`torch_peer.qwen2_model`), built directly on the device: CUDA when torch sees it, else the
CPU (the benchmark's smoke run).

generate (kind "generate"): bfloat16 weights, `model.generate` on [B, P] random token
tensors, exactly N new tokens per row (min_new_tokens = max_new_tokens), T = 1 plain
sampling (top_k = 0, top_p = 1), transformers' default attention and KV cache; best of
`repeats` after a warm-up call (reported as warmup_s: CUDA start-up, kernel selection).

grpo_step (kind "grpo_step"): TRL's GRPOTrainer on the train shape (train_rows rows of P +
N tokens, groups of group_size), with the trainer's mixed precision (float32 weights, bf16
autocast; float32 on the CPU), gradient checkpointing (Arbor's step rematerialises too),
AdamW, beta 0, one update per step. Generation is replaced by fixed random completions
through TRL's `rollout_func` (no EOS among them, so every row keeps its N tokens) and the
reward is a fixed random number per row, so a step is TRL's scoring (decoding the
completions, the reward, the advantages: `_generate_and_score_completions`, timed as
score_s) and its update (forward, backward, AdamW: train_s = step_s - score_s, the part
Arbor's train step does). Best step of `repeats` after a first one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import transformers

from results_file import Part  # this folder
import torch_peer  # this folder


def synchronize(device: str) -> None:
  if device == "cuda":
    torch.cuda.synchronize()


def peak_bytes(device: str) -> int | None:
  return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def bench_generate(spec: dict, device: str, part: Part) -> None:
  model = torch_peer.qwen2_model(spec["shape"], torch.bfloat16, device)
  vocab, prompt_len, new_tokens = spec["shape"]["vocab_size"], spec["prompt_len"], spec["new_tokens"]
  for batch in spec["batch_sizes"]:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=gen).to(device)
    mask = torch.ones_like(prompts)

    def run(tokens: int) -> float:
      start = time.perf_counter()
      with torch.inference_mode():
        out = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, pad_token_id=0, eos_token_id=2)
      synchronize(device)
      assert out.shape == (batch, prompt_len + tokens), out.shape
      return time.perf_counter() - start

    warmup_s = run(min(8, new_tokens))
    best = min(run(new_tokens) for _ in range(spec["repeats"]))
    part.add(dict(kind="generate", batch=batch, tokens_per_s=batch * new_tokens / best,
                  best_s=best, warmup_s=warmup_s, measured_peak_bytes=peak_bytes(device)))
  del model
  if device == "cuda":
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def bench_grpo_step(spec: dict, device: str, part: Part) -> None:
  import datasets  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel

  shape, rows, group = spec["shape"], spec["train_rows"], spec["group_size"]
  prompt_len, new_tokens, steps = spec["prompt_len"], spec["new_tokens"], spec["repeats"] + 1
  prompts = rows // group
  rng = np.random.default_rng(0)
  prompt_ids = rng.integers(3, shape["vocab_size"], (prompts, prompt_len)).tolist()
  completion_ids = rng.integers(3, shape["vocab_size"], (rows, new_tokens)).tolist()
  rewards = rng.random(rows).tolist()
  texts = [f"t{3 + i}" for i in range(prompts * steps)]  # one dataset entry per prompt and step
  index = {text: i % prompts for i, text in enumerate(texts)}

  def rollout_func(batch_prompts, trainer):
    del trainer
    rows_of = [index[text] * group + k % group for k, text in enumerate(batch_prompts)]
    return {"prompt_ids": [prompt_ids[r // group] for r in rows_of],
            "completion_ids": [completion_ids[r] for r in rows_of],
            "logprobs": [[0.0] * new_tokens for _ in rows_of]}

  def reward(prompts, completions, **kwargs):
    del completions, kwargs
    return [rewards[index[text] * group + k % group] for k, text in enumerate(prompts)]

  folder = tempfile.mkdtemp(prefix="arbor_b10_trl_")
  tokenizer = torch_peer.word_tokenizer(folder, shape["vocab_size"])
  model = torch_peer.qwen2_model(shape, torch.float32, device)
  model.train()
  args = trl.GRPOConfig(
      output_dir=os.path.join(folder, "out"), per_device_train_batch_size=rows,
      num_generations=group, max_completion_length=new_tokens, beta=0.0, num_iterations=1,
      learning_rate=1e-6, max_steps=steps, bf16=device == "cuda", fp16=False,
      gradient_checkpointing=True, use_cpu=device == "cpu", report_to="none",
      logging_steps=1, save_strategy="no", shuffle_dataset=False, seed=0,
      dataloader_num_workers=0)
  os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
  trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                            train_dataset=datasets.Dataset.from_dict({"prompt": texts}),
                            processing_class=tokenizer, rollout_func=rollout_func)
  scoring = []
  inner = trainer._generate_and_score_completions  # pylint: disable=protected-access

  def timed_scoring(*a, **k):
    start = time.perf_counter()
    out = inner(*a, **k)
    synchronize(device)
    scoring.append(time.perf_counter() - start)
    return out

  trainer._generate_and_score_completions = timed_scoring  # pylint: disable=protected-access
  times = []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *a, **k):
      synchronize(device)
      self.start = time.perf_counter()

    def on_step_end(self, *a, **k):
      synchronize(device)
      times.append(time.perf_counter() - self.start)

  trainer.add_callback(Timer())
  trainer.train()
  if len(times) != steps or len(scoring) != steps:
    raise RuntimeError(f"TRL ran {len(times)} steps and {len(scoring)} scorings, not {steps}.")
  train_times = [t - s for t, s in zip(times, scoring)]
  best = int(np.argmin(train_times[1:])) + 1
  part.add(dict(kind="grpo_step", rows=rows, length=prompt_len + new_tokens,
                tokens_per_s=rows * (prompt_len + new_tokens) / train_times[best],
                train_s=train_times[best], step_s=times[best], score_s=scoring[best],
                first_step_s=times[0], measured_peak_bytes=peak_bytes(device)))


def main():
  spec = json.loads(sys.argv[1])
  device = "cuda" if torch.cuda.is_available() else "cpu"
  header = dict(section="peer", device=device, torch=torch.__version__,
                transformers=transformers.__version__)
  try:
    import trl  # pylint: disable=import-outside-toplevel
    header["trl"] = trl.__version__
  except ImportError as e:
    header["trl"] = f"not importable: {e}"
  part = Part(spec["part"], header)
  failures = []
  for bench in (bench_generate, bench_grpo_step):
    try:
      bench(spec, device, part)
    except Exception as e:  # pylint: disable=broad-except  (recorded; the next bench still runs)
      failures.append(f"{bench.__name__}: {type(e).__name__}: {e}")
      print(failures[-1], file=sys.stderr, flush=True)
  if failures:
    part.data["failures"] = failures
    part.write()
    raise SystemExit("; ".join(failures))


if __name__ == "__main__":
  main()
