"""One TRL GRPOTrainer update on a batch Arbor fixed (B9 parity), run in the torch peer's
virtualenv. Started by experiments/trl_parity.py as

    <venv>/bin/python experiments/peers/trl_step_peer.py '<json spec>'

and prints one JSON line (the results) last on stdout. Never imported by Arbor.

The spec names Arbor's exported weights (a Hugging Face folder), the batch (each row's
prompt ids, completion ids and reward, rows of one prompt consecutive, `group_size` per
prompt) and the update's settings (loss_type, clip range, learning rate, AdamW, gradient
clipping, temperature; LoRA rank / alpha / modules with Arbor's initial adapters in an .npz).
TRL's own code computes everything from there, through its public extension points:
`rollout_func` returns the fixed prompt and completion ids instead of generating, a reward
function returns the fixed rewards, and `trainer.train()` runs one step (max_steps=1):
advantages (`_generate_and_score_completions`), loss (`_compute_loss`), backward, gradient
clipping and the AdamW update. Two things are observed, not changed: `_compute_loss` is
wrapped to record its inputs (advantages, masks), the per-token log-probs it trains on and
the loss it returns, and the accelerator's `clip_grad_norm_` to record the gradient norm.
One thing is changed: TRL shuffles a generation batch's rows before splitting it into
steps; with one step per generation that only reorders rows, and the shuffle is turned off
so the recorded rows keep Arbor's order.

Results: the rows' advantages, per-token log-probs and ratios, the loss, the gradient norm,
and the trained parameters after the update written to the spec's "out" .npz (LoRA: each
adapted module's lora_A / lora_B weights; full weights: the whole state dict), each with
AdamW's first moment after the step under "exp_avg/<name>" ((1 - beta1) times the clipped
gradient: the gradient itself, compared element by element).
"""

from __future__ import annotations

import collections
import os
import tempfile

import numpy as np
import torch
import transformers

import torch_peer  # this folder


def lora_tensors(model) -> dict[str, torch.Tensor]:
  """The LoRA weights of a PEFT model by name (lora_A / lora_B of every adapted module)."""
  return {name: p for name, p in model.named_parameters() if ".lora_" in name}


def load_adapters(model, path: str) -> int:
  """Sets the PEFT model's LoRA weights from the .npz Arbor wrote (same names); returns
  how many tensors were set. Every LoRA tensor must be given."""
  given = np.load(path)
  tensors = lora_tensors(model)
  missing = sorted(set(tensors) - set(given.files))
  if missing:
    raise ValueError(f"{path} lacks LoRA tensors {missing[:4]}...")
  with torch.no_grad():
    for name, p in tensors.items():
      value = torch.from_numpy(given[name])
      if value.shape != p.shape:
        raise ValueError(f"{name}: Arbor's shape {tuple(value.shape)} != TRL's {tuple(p.shape)}")
      p.copy_(value)
  return len(tensors)


def run(spec: dict) -> dict:
  import datasets  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel
  from trl.trainer import grpo_trainer  # pylint: disable=import-outside-toplevel

  rows = len(spec["rewards"])
  g = spec["group_size"]
  prompts = rows // g
  texts = [f"prompt {p}" for p in range(prompts)]  # stand-ins: rollout_func supplies the ids
  served = collections.Counter()
  rewarded = collections.Counter()

  def rollout_func(batch_prompts, trainer):
    del trainer
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for text in batch_prompts:
      row = texts.index(text) * g + served[text]
      served[text] += 1
      out["prompt_ids"].append(spec["prompt_ids"][row])
      out["completion_ids"].append(spec["completion_ids"][row])
      out["logprobs"].append([0.0] * len(spec["completion_ids"][row]))
    return out

  def reward(prompts, completions, **kwargs):
    del completions, kwargs
    values = []
    for text in prompts:
      values.append(float(spec["rewards"][texts.index(text) * g + rewarded[text]]))
      rewarded[text] += 1
    return values

  grpo_trainer.shuffle_sequence_dict = lambda batch: batch  # keep Arbor's row order
  seen = {}

  class Recording(trl.GRPOTrainer):
    def _compute_loss(self, model, inputs):
      ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
      mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
      with torch.no_grad():
        logps, _, _ = self._get_per_token_logps_and_entropies(
            model, ids, mask, inputs["completion_ids"].size(1))
      loss = super()._compute_loss(model, inputs)
      seen.update(advantages=inputs["advantages"].tolist(),
                  completion_mask=inputs["completion_mask"].tolist(),
                  logps=logps.tolist(), loss=float(loss.detach()),
                  old_logps_given=inputs.get("old_per_token_logps") is not None)
      return loss

  folder = spec["weights"]
  tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
  tokenizer.padding_side = "left"
  settings = spec["settings"]
  args = trl.GRPOConfig(
      output_dir=tempfile.mkdtemp(prefix="arbor_trl_step_"), per_device_train_batch_size=rows,
      num_generations=g, max_completion_length=max(len(c) for c in spec["completion_ids"]),
      temperature=settings["temperature"], beta=0.0, num_iterations=1,
      loss_type=settings["loss_type"], epsilon=settings["epsilon_low"],
      epsilon_high=settings["epsilon_high"], scale_rewards="group",
      learning_rate=settings["learning_rate"], adam_beta1=settings["adam_beta1"],
      adam_beta2=settings["adam_beta2"], adam_epsilon=settings["adam_epsilon"],
      weight_decay=settings["weight_decay"], max_grad_norm=settings["max_grad_norm"],
      optim="adamw_torch", lr_scheduler_type="constant", warmup_steps=0, max_steps=1,
      bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, report_to="none",
      logging_steps=1, save_strategy="no", shuffle_dataset=False, seed=0,
      dataloader_num_workers=0, model_init_kwargs={"dtype": "float32"})
  peft_config = None
  lora = spec.get("lora")
  if lora:
    import peft  # pylint: disable=import-outside-toplevel
    peft_config = peft.LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"],
                                  target_modules=lora["modules"], lora_dropout=0.0,
                                  bias="none", task_type="CAUSAL_LM")
  os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
  trainer = Recording(model=folder, reward_funcs=reward, args=args,
                      train_dataset=datasets.Dataset.from_dict({"prompt": texts}),
                      processing_class=tokenizer, rollout_func=rollout_func,
                      peft_config=peft_config)
  result = {"adapters_set": load_adapters(trainer.model, lora["init"]) if lora else 0}
  norms = []
  clip = trainer.accelerator.clip_grad_norm_

  def recording_clip(parameters, max_norm, *a, **k):
    norm = clip(parameters, max_norm, *a, **k)
    norms.append(float(norm))
    return norm

  trainer.accelerator.clip_grad_norm_ = recording_clip
  trainer.train()
  after = (lora_tensors(trainer.model) if lora else
           dict(trainer.model.named_parameters()))
  optimizer_state = trainer.optimizer.optimizer.state  # torch AdamW: exp_avg = (1 - b1) g
  saved = {k: v.detach().float().numpy() for k, v in after.items()}
  saved.update({f"exp_avg/{k}": optimizer_state[v]["exp_avg"].float().numpy()
                for k, v in after.items()})
  np.savez(spec["out"], **saved)
  result.update(seen, grad_norm=norms, rows=rows, trained_tensors=len(after),
                trainable=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad))
  return result


if __name__ == "__main__":
  torch_peer.trl_main(run)
