"""Character-level tokenizer for the built-in arithmetic tasks.

A tiny from-scratch policy learns `chain_sum` / `basic_arithmetic` prompts such as
"4-1=" one character per token. The vocabulary is fixed (ids never change between runs,
so checkpoints stay valid):

  0 PAD, 1 BOS, 2 EOS,
  3..12   digits "0123456789"
  13      " "
  14..21  "+-*/=()."
  22..47  "abcdefghijklmnopqrstuvwxyz"
  48..50  ",?:"

vocab_size is 51.
"""

from collections.abc import Iterable

_SPECIALS = ("<pad>", "<bos>", "<eos>")
ALPHABET = "0123456789" + " " + "+-*/=()." + "abcdefghijklmnopqrstuvwxyz" + ",?:"


class CharTokenizer:
  """Maps each character of `ALPHABET` to one id after the three special tokens."""

  pad_id = 0
  bos_id = 1
  eos_id = 2

  def __init__(self):
    self._char_to_id = {c: i + len(_SPECIALS) for i, c in enumerate(ALPHABET)}
    self._id_to_char = {i: c for c, i in self._char_to_id.items()}

  @property
  def vocab_size(self) -> int:
    return len(_SPECIALS) + len(ALPHABET)

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Returns one id per character, with BOS first if `add_bos`.

    Raises ValueError naming the first character outside the alphabet.
    """
    ids = [self.bos_id] if add_bos else []
    for pos, char in enumerate(text):
      token = self._char_to_id.get(char)
      if token is None:
        raise ValueError(
          f"CharTokenizer cannot encode character {char!r} at position {pos} "
          f"of {text!r}; the alphabet is {ALPHABET!r} (lowercase the text or "
          f"use a subword tokenizer for free text)."
        )
      ids.append(token)
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Returns the text up to the first EOS, skipping PAD and BOS.

    Accepts any iterable of ints (a list, or a NumPy/JAX row). Raises ValueError on an
    id outside the vocabulary.
    """
    chars = []
    for token in ids:
      token = int(token)
      if token == self.eos_id:
        break
      if token in (self.pad_id, self.bos_id):
        continue
      char = self._id_to_char.get(token)
      if char is None:
        raise ValueError(
          f"CharTokenizer cannot decode id {token}: ids run from 0 to "
          f"{self.vocab_size - 1}."
        )
      chars.append(char)
    return "".join(chars)
