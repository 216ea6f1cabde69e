"""config.model: the policy's shapes, weights, tokenizer and numerics.

The policy is loaded by rl/policy.py from these settings; this module imports nothing above
rl/settings/, so the default config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses

from rl.settings import Settings, setting

DTYPES = ("float32", "bfloat16")


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
                       "gradients, less memory")

  def check(self) -> None:
    super().check()
    if self.tokenizer and not self.checkpoint:
      raise ValueError(f"config.model.tokenizer = {self.tokenizer!r} is the tokenizer of a "
                       "pretrained checkpoint; set config.model.checkpoint too, or leave "
                       "config.model.tokenizer empty (a from-scratch run uses the character "
                       "tokenizer).")
