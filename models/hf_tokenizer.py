"""Subword tokenizers of pretrained checkpoints (`tokenizer.json` via `tokenizers`).

`HFTokenizer` has the interface of `models.tokenizer.CharTokenizer` (pad_id, bos_id,
eos_id, vocab_size, encode(text, add_bos), decode(ids)), so the rollout, evaluation and
training code run unchanged on a pretrained model. It is built from a Hugging Face folder
(`from_pretrained`) or from GGUF metadata (`models.gguf_checkpoint.tokenizer_from_gguf`).

Special tokens. BOS is added only when the checkpoint's own tokenizer adds one
(`add_bos_token`; Qwen has no BOS, SmolLM2's GGUF says no) and never twice. Without a
pad token the EOS id pads (the sampler masks padding, so its id does not matter).

Chat template. With `chat=True`, `encode(text, add_bos=True)` (how Arbor encodes a
prompt) renders `text` as one user message through the checkpoint's Jinja chat template
with the assistant generation prompt, as transformers' `apply_chat_template` does;
`encode(text)` without `add_bos` (completions, reference answers) encodes the text as is.
"""

from __future__ import annotations

from collections.abc import Iterable
import json
import os

import jinja2
from jinja2 import sandbox
import tokenizers


def _token_text(value) -> str | None:
  """A special token from tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the checkpoint's special ids and chat template.

  Attributes: pad_id, bos_id (None when the checkpoint has no BOS token), eos_id,
  vocab_size (ids including added tokens), chat_template (Jinja source or None), chat.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_id: int, bos_id: int | None = None,
               pad_id: int | None = None, add_bos: bool = False,
               chat_template: str | None = None, chat: bool = False):
    if chat and not chat_template:
      raise ValueError("HFTokenizer(chat=True): this checkpoint has no chat template; "
                       "use chat=False (plain-text prompts).")
    self._tokenizer = tokenizer
    self.eos_id = eos_id
    self.bos_id = bos_id
    self.pad_id = eos_id if pad_id is None else pad_id
    self.add_bos = add_bos and bos_id is not None
    self.chat_template = chat_template
    self.chat = chat
    for name in ("eos_id", "bos_id", "pad_id"):
      value = getattr(self, name)
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(f"HFTokenizer.{name}={value} is outside the vocabulary "
                         f"(0..{self.vocab_size - 1}).")

  @classmethod
  def from_pretrained(cls, location: str, chat: bool = False) -> "HFTokenizer":
    """Reads `tokenizer.json`, `tokenizer_config.json` (special tokens, `add_bos_token`,
    `chat_template`) and `chat_template.jinja` (transformers 5) from a HF folder;
    `location` is the folder or its tokenizer.json file (the others are read beside it)."""
    if os.path.isfile(location):
      directory, path = os.path.dirname(location), location
    else:
      directory, path = location, os.path.join(location, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(f"{directory}: no tokenizer.json; save the tokenizer with "
                       "save_pretrained (a fast tokenizer) next to the weights.")
    tokenizer = tokenizers.Tokenizer.from_file(path)
    settings = {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(config_path):
      with open(config_path) as f:
        settings = json.load(f)
    template = settings.get("chat_template")
    template_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(template_path):
      with open(template_path) as f:
        template = f.read()

    def token_id(key):
      text = _token_text(settings.get(key))
      if text is None:
        return None
      token = tokenizer.token_to_id(text)
      if token is None:
        raise ValueError(f"{config_path}: {key} {text!r} is not in tokenizer.json's vocabulary.")
      return token

    eos_id = token_id("eos_token")
    if eos_id is None:
      raise ValueError(f"{directory}: tokenizer_config.json names no eos_token; Arbor needs "
                       "one to stop generation.")
    bos_id = token_id("bos_token")
    add_bos = settings.get("add_bos_token")
    if add_bos is None:  # ask the tokenizer's post-processor whether it prepends BOS
      with_specials = tokenizer.encode("a", add_special_tokens=True).ids
      add_bos = bos_id is not None and with_specials[:1] == [bos_id]
    return cls(tokenizer, eos_id=eos_id, bos_id=bos_id, pad_id=token_id("pad_token"),
               add_bos=bool(add_bos), chat_template=template, chat=chat)

  @property
  def vocab_size(self) -> int:
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  def token(self, token_id: int | None) -> str | None:
    return None if token_id is None else self._tokenizer.id_to_token(token_id)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Renders `messages` ([{'role', 'content'}]) with the checkpoint's chat template, in a
    sandboxed Jinja environment configured as transformers configures it."""
    if not self.chat_template:
      raise ValueError("This checkpoint's tokenizer has no chat template.")

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=self.token(self.bos_id) or "", eos_token=self.token(self.eos_id))

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    """Token ids of `text`; `add_bos` marks the start of a sequence (a prompt): BOS is
    prepended where the checkpoint adds one, and with `chat` the chat template is applied."""
    if add_bos and self.chat:
      text = self.apply_chat_template([{"role": "user", "content": text}])
    ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos and self.add_bos and ids[:1] != [self.bos_id]:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """The text up to the first EOS, without special tokens (PAD, BOS, chat markers).

    Accepts any iterable of ints; raises ValueError on an id outside the vocabulary.
    """
    kept = []
    for token in ids:
      token = int(token)
      if token == self.eos_id:
        break
      if not 0 <= token < self.vocab_size:
        raise ValueError(f"HFTokenizer cannot decode id {token}: ids run from 0 to "
                         f"{self.vocab_size - 1}.")
      kept.append(token)
    return self._tokenizer.decode(kept, skip_special_tokens=True)
