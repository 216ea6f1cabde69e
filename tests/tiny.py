"""The one tiny model the tests start from.

`MODEL` is small enough that a forward pass, a sampler and a train step compile in a few
seconds on a CPU, and still has everything the model code branches on: two layers,
grouped-query attention (2 query heads share 1 key/value head), a gated MLP and tied
embeddings. A test that needs another shape, family feature or vocabulary says so with
`model(**changes)`, so the difference from the common case is all it writes.
"""

from models.config import ModelConfig, get_preset

# The library's "micro" preset (what the tests' launcher runs use, tests/launcher_config.py)
# at the character tokenizer's vocabulary.
MODEL = get_preset("micro", vocab_size=51, max_seq_len=32)


def model(**changes) -> ModelConfig:
  """`MODEL` with the fields in `changes` replaced (e.g. vocab_size=tokenizer.vocab_size,
  qkv_bias=True, num_experts=4)."""
  return MODEL.replace(**changes)
