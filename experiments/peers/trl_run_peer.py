"""A whole TRL GRPOTrainer run on Arbor's task (B9 side by side), in the torch peer's
virtualenv. Started by experiments/trl_side_by_side.py as

    <venv>/bin/python experiments/peers/trl_run_peer.py '<json spec>'

and prints one JSON line (the results) last on stdout. Never imported by Arbor.

The spec gives Arbor's exported weights (a Hugging Face folder), the training prompts in
Arbor's order (chat-templated text, with Arbor's token ids of each, checked here), their
reference answers, and the run's settings. TRL trains LoRA adapters (PEFT) with GRPO:
`prompts_per_step` prompts x `group_size` completions per step, sampled by TRL's own
`generate` at the run's temperature, scored by the same function as Arbor's reasoned
tasks: Arbor's `rl/tasks/math_answer.py`, loaded from its file (it needs only math-verify
and sympy), the last box / '####' line / number of the reply against the reference. The
adapters are saved every `save_every` steps (`<out>/checkpoint-<step>`, with the optimiser
state, so a killed run resumes from its newest one); Arbor evaluates them afterwards with
its own held-out evaluation. Per-step wall times, the sampling part of each, and TRL's
logged metrics are returned.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
import time

import transformers

import torch_peer  # this folder


def load_math_answer(path: str):
  """Arbor's rl/tasks/math_answer.py as a module (its imports: math-verify, sympy)."""
  spec = importlib.util.spec_from_file_location("arbor_math_answer", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def run(spec: dict) -> dict:
  import datasets  # pylint: disable=import-outside-toplevel
  import peft  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel

  math_answer = load_math_answer(spec["math_answer"])
  s = spec["settings"]
  folder = spec["weights"]
  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
  tokenizer.padding_side = "left"
  ids = tokenizer(text=spec["prompts"], add_special_tokens=False)["input_ids"]
  mismatched = sum(a != b for a, b in zip(ids, spec["prompt_ids"]))
  if mismatched:
    raise ValueError(f"{mismatched} prompts tokenise differently in TRL than in Arbor.")
  answers = dict(zip(spec["prompts"], spec["answers"]))

  def reward(prompts, completions, **kwargs):
    del kwargs
    out = []
    for prompt, completion in zip(prompts, completions):
      answer = math_answer.extract_answer(math_answer.until_eos(completion))
      try:
        out.append(float(answer is not None and math_answer.equivalent(answer, answers[prompt])))
      except TimeoutError:
        out.append(0.0)
    return out

  rows = s["prompts_per_step"] * s["group_size"]
  # Arbor's microbatches are TRL's gradient accumulation: one generation of `rows`
  # completions per optimiser step, its loss and gradient taken `microbatches` slices at a time.
  args = trl.GRPOConfig(
      output_dir=spec["out"], per_device_train_batch_size=rows // s["microbatches"],
      gradient_accumulation_steps=s["microbatches"], num_generations=s["group_size"],
      max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_k=0,
      top_p=1.0, beta=0.0, num_iterations=1, loss_type=s["loss_type"],
      epsilon=s["epsilon_low"], epsilon_high=s["epsilon_high"], scale_rewards="group",
      learning_rate=s["learning_rate"], adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
      weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"], optim="adamw_torch",
      lr_scheduler_type="constant", warmup_steps=0, max_steps=s["steps"], bf16=False,
      fp16=False, gradient_checkpointing=False, use_cpu=True, report_to="none",
      logging_steps=1, save_strategy="steps", save_steps=s["save_every"],
      save_total_limit=None, shuffle_dataset=False, seed=s["seed"], dataloader_num_workers=0,
      model_init_kwargs={"dtype": "float32"})
  lora = peft.LoraConfig(r=s["lora_rank"], lora_alpha=s["lora_alpha"],
                         target_modules=s["lora_modules"], lora_dropout=0.0, bias="none",
                         task_type="CAUSAL_LM")
  trainer = trl.GRPOTrainer(model=folder, reward_funcs=reward, args=args,
                            train_dataset=datasets.Dataset.from_dict({"prompt": spec["prompts"]}),
                            processing_class=tokenizer, peft_config=lora)
  generated = []
  torch_peer.record_generate_times(trainer.model, generated)
  steps_path = os.path.join(spec["out"], "steps.jsonl")  # appended: survives a resume
  logs_path = os.path.join(spec["out"], "logs.jsonl")

  def append(path, record):
    with open(path, "a") as f:
      f.write(json.dumps(record) + "\n")

  class Recorder(transformers.TrainerCallback):
    def on_step_begin(self, *a, **k):
      self.start, self.seen = time.perf_counter(), len(generated)

    def on_step_end(self, _args, state, control, **k):
      del control, k
      append(steps_path, {"step": state.global_step, "step_s": time.perf_counter() - self.start,
                          "generate_s": sum(generated[self.seen:])})

    def on_log(self, _args, state, control, logs=None, **k):
      del control, k
      if logs:
        append(logs_path, dict(logs, step=state.global_step))

  trainer.add_callback(Recorder())
  os.makedirs(spec["out"], exist_ok=True)
  resume = bool(glob.glob(os.path.join(spec["out"], "checkpoint-*")))
  trainer.train(resume_from_checkpoint=True if resume else None)
  read = lambda path: [json.loads(line) for line in open(path)] if os.path.exists(path) else []
  return {"steps": read(steps_path), "logs": read(logs_path), "resumed": resume,
          "checkpoints": sorted(glob.glob(os.path.join(spec["out"], "checkpoint-*")))}


if __name__ == "__main__":
  torch_peer.trl_main(run)
