"""config.model: the policy's shapes, weights, tokenizer and numerics.

The policy is loaded by rl/policy.py; this module imports no JAX (it imports models/ where a
method needs it), so the default config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rl.settings import Settings, setting

if TYPE_CHECKING:
  from models.config import ModelConfig

DTYPES = ("float32", "bfloat16")


def _remat_policies() -> tuple[str, ...]:
  """models/transformer.py REMAT_POLICIES' names, read when config.model.remat is checked."""
  from models import transformer  # pylint: disable=import-outside-toplevel
  return tuple(transformer.REMAT_POLICIES)


@dataclasses.dataclass(frozen=True)
class ModelSettings(Settings):
  """config.model: the policy's shapes, weights, tokenizer and numerics."""
  SECTION = "model"
  preset: str = setting("tiny2", "models/config.py PRESETS (two layers, RoPE base 100)")
  dtype: str = setting("float32", "parameters (master weights; AdamW's moments follow): "
                       "float32 | bfloat16", choices=DTYPES)
  compute_dtype: str = setting("", "matmuls, activations, KV cache: \"\" (= dtype) | float32 "
                               "| bfloat16 (mixed precision over float32 parameters)",
                               choices=("", *DTYPES))
  checkpoint: str = setting("", "\"\" = from scratch (preset + char tokenizer); else a HF "
                            "folder, a .gguf file or \"smollm2\" (docs/checkpoints.md)")
  tokenizer: str = setting("", "\"\" = the checkpoint's own; else a tokenizer.json file or a "
                           "HF folder holding one (for a folder without it)")
  chat_template: bool = setting(False, "wrap prompts in the checkpoint's chat template")
  remat: str = setting("none", "training forward: rematerialise each layer in the backward: "
                       "none | full (keep layer inputs) | dots (and matmul outputs); same "
                       "gradients, less memory", choices=_remat_policies)

  def check(self) -> None:
    super().check()
    from models import config as model_configs  # pylint: disable=import-outside-toplevel
    if not self.checkpoint and self.preset not in model_configs.PRESETS:
      raise ValueError(f"Unknown config.model.preset {self.preset!r}; known: "
                       f"{sorted(model_configs.PRESETS)}.")
    if self.tokenizer and not self.checkpoint:
      raise ValueError(f"config.model.tokenizer = {self.tokenizer!r} is the tokenizer of a "
                       "pretrained checkpoint; set config.model.checkpoint too, or leave "
                       "config.model.tokenizer empty (a from-scratch run uses the character "
                       "tokenizer).")

  def with_room(self, model_config: ModelConfig, seq_len: int) -> ModelConfig:
    """The model config as the run uses it: room for `seq_len` (prompt + completion), and
    the run's rematerialisation policy and compute dtype."""
    return model_config.replace(max_seq_len=max(model_config.max_seq_len, seq_len),
                                remat=self.remat, compute_dtype=self.compute_dtype)

  def pretrained(self, spec: str):
    """(ModelConfig, params, tokenizer or None) of checkpoint `spec` in this dtype, chat
    template and tokenizer (`models.pretrained.load_pretrained`)."""
    from models import pretrained  # pylint: disable=import-outside-toplevel
    return pretrained.load_pretrained(spec, self.dtype, chat=self.chat_template,
                                      tokenizer=self.tokenizer or None)
