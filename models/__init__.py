"""The policy model: decoder, KV cache, checkpoint import/export, tokenizers."""

from models.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
]
