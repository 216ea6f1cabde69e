"""The policy model: decoder, KV cache, checkpoint import/export, tokenizers."""

from models.gguf_checkpoint import load_gguf, smollm2_path, tokenizer_from_gguf
from models.hf_checkpoint import load_hf, save_hf
from models.hf_tokenizer import HFTokenizer
from models.pretrained import load_pretrained
from models.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "HFTokenizer",
    "load_gguf",
    "load_hf",
    "load_pretrained",
    "save_hf",
    "smollm2_path",
    "tokenizer_from_gguf",
]
