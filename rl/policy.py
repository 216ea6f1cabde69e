"""The run's policy: where its weights and tokenizer come from (config.model, typed as
`ModelSettings`) and loading them: a from-scratch preset with the character tokenizer, a
pretrained checkpoint (a Hugging Face folder, a .gguf file or "smollm2"), the newest
checkpoint of an Arbor run, or a frozen distillation teacher (one of those, checked
against the student)."""

from __future__ import annotations

import json
import os

import jax

from models import config as model_configs
from models import lora as lora_lib
from models import pretrained as pretrained_lib
from models import tokenizer as tokenizers
from models import transformer
from rl import checkpoint
from rl.settings.model import ModelSettings


def with_room(model: ModelSettings, model_config: model_configs.ModelConfig,
              seq_len: int) -> model_configs.ModelConfig:
  """The model config as the run uses it: room for `seq_len` (prompt + completion), and
  the run's rematerialisation policy and compute dtype."""
  return model_config.replace(max_seq_len=max(model_config.max_seq_len, seq_len),
                              remat=model.remat, compute_dtype=model.compute_dtype)


def pretrained(model: ModelSettings, spec: str):
  """(ModelConfig, params, tokenizer or None) of checkpoint `spec` in the run's dtype, chat
  template and tokenizer (`models.pretrained.load_pretrained`)."""
  return pretrained_lib.load_pretrained(spec, model.dtype, chat=model.chat_template,
                                        tokenizer=model.tokenizer or None)


def load_policy(model: ModelSettings, seq_len: int, rng: jax.Array):
  """(tokenizer, model_config, initial params): from `model.checkpoint` (with
  `model.tokenizer`, if set) when set, else a from-scratch `model.preset` with the
  character tokenizer; room for `seq_len` tokens."""
  if model.checkpoint:
    model_config, params, tokenizer = pretrained(model, model.checkpoint)
    if tokenizer is None:
      raise ValueError(f"{model.checkpoint} has no tokenizer.json; pass "
                       "config.model.tokenizer=<path> (a tokenizer.json file or a Hugging "
                       "Face folder that holds one, e.g. the base model's).")
    return tokenizer, with_room(model, model_config, seq_len), params
  tokenizer = tokenizers.CharTokenizer()
  model_config = with_room(model, model_configs.get_preset(
      model.preset, dtype=model.dtype, vocab_size=tokenizer.vocab_size), seq_len)
  return tokenizer, model_config, transformer.init_params(model_config, rng)


def run_policy(workdir: str):
  """(tokenizer, model_config, params) of the newest checkpoint of the Arbor run in
  `workdir` (its config.json says how its policy was built; LoRA adapters are merged)."""
  with open(os.path.join(workdir, "config.json")) as f:
    run = json.load(f)
  seq_len = run["rollout"]["prompt_len"] + run["rollout"]["max_new_tokens"]
  tokenizer, model_config, _ = load_policy(ModelSettings.from_config(run["model"]), seq_len,
                                           jax.random.PRNGKey(0))
  manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"))
  if manager.latest_step() is None:
    raise ValueError(f"config.distill.teacher = {workdir!r} holds no checkpoint yet.")
  tree, _ = checkpoint.restore_tree(manager, manager.latest_step())
  trained = tree["train"]
  params = trained["params"]
  if trained.get("frozen") is not None:  # a LoRA run: the adapters merged into the base
    lora = run["lora"]
    params = lora_lib.merge(trained["frozen"], params, lora["alpha"] / lora["rank"])
  return tokenizer, model_config, params


def _vocabulary(tokenizer) -> tuple:
  """What makes two tokenizers the same: every id's text and the special ids."""
  return (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id,
          tuple(tokenizer.decode([i]) for i in range(tokenizer.vocab_size)))


def load_teacher(spec: str, model: ModelSettings, tokenizer, seq_len: int, top_k: int):
  """(params, ModelConfig) of the frozen teacher `spec` (config.distill.teacher): an Arbor
  workdir (its newest checkpoint), a HF folder, a .gguf file or 'smollm2', loaded like the
  student (`model`). Refused unless its tokenizer is the student's `tokenizer` (every token
  and the special ids), its context holds a rollout (`seq_len`) and its vocabulary has
  `top_k` tokens."""
  if os.path.isdir(os.path.join(spec, "checkpoints")):
    teacher_tokenizer, teacher_config, params = run_policy(spec)
  else:
    teacher_config, params, teacher_tokenizer = pretrained(model, spec)
  if teacher_tokenizer is None or _vocabulary(teacher_tokenizer) != _vocabulary(tokenizer):
    raise ValueError(f"config.distill.teacher = {spec!r} has another tokenizer than the "
                     "student (its vocabulary or special tokens differ): distillation compares "
                     "the two distributions token by token, so they must share one.")
  if teacher_config.max_seq_len < seq_len:
    raise ValueError(f"config.distill.teacher = {spec!r} has a context of "
                     f"{teacher_config.max_seq_len} tokens, shorter than a rollout "
                     f"(rollout.prompt_len + max_new_tokens = {seq_len}).")
  if top_k > teacher_config.vocab_size:
    raise ValueError(f"config.distill.top_k = {top_k} exceeds the vocabulary "
                     f"({teacher_config.vocab_size} tokens).")
  return params, teacher_config
