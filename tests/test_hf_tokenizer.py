"""models.hf_tokenizer.HFTokenizer against transformers' tokenizer of the same folder."""

import numpy as np
import pytest

from models.hf_tokenizer import HFTokenizer
from tests.hf_reference import save_bpe_tokenizer

_TEXTS = ["What is 4 + 17?", "héllo  wörld\n\tagain <|user|> 12", ""]


@pytest.mark.parametrize("add_bos", [False, True])
def test_matches_transformers(add_bos, tmp_path):
  reference = save_bpe_tokenizer(tmp_path, add_bos)
  tok = HFTokenizer.from_pretrained(str(tmp_path))
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
  assert tok.vocab_size == len(reference)
  for text in _TEXTS:
    assert tok.encode(text) == reference(text, add_special_tokens=False).input_ids
    assert tok.encode(text, add_bos=True) == reference(text).input_ids
    ids = tok.encode(text, add_bos=True)
    assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == text.replace("<|user|>", "")  # special tokens are dropped


def test_chat_template_matches_transformers(tmp_path):
  reference = save_bpe_tokenizer(tmp_path, add_bos=True)
  tok = HFTokenizer.from_pretrained(str(tmp_path), chat=True)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "4+17?"}]
  rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert tok.apply_chat_template(messages) == rendered
  assert "<|sys|>Be brief.</s>" in rendered
  # A prompt is one user turn plus the generation prompt; the template's BOS is not doubled.
  prompt = reference.apply_chat_template([{"role": "user", "content": "4+17?"}],
                                         add_generation_prompt=True)
  prompt = getattr(prompt, "input_ids", prompt)
  assert tok.encode("4+17?", add_bos=True) == list(np.asarray(prompt).reshape(-1))
  assert tok.encode("21") == reference("21", add_special_tokens=False).input_ids


def test_decode_stops_at_eos_and_skips_specials(tmp_path):
  save_bpe_tokenizer(tmp_path, add_bos=True)
  tok = HFTokenizer.from_pretrained(str(tmp_path))
  ids = [tok.bos_id] + tok.encode("It is 21.") + [tok.eos_id] + tok.encode("junk")
  assert tok.decode(ids) == "It is 21."
  assert tok.decode(np.array([tok.pad_id] + ids)) == "It is 21."
  with pytest.raises(ValueError, match="ids run from 0"):
    tok.decode([tok.vocab_size])


def test_errors_name_the_fix(tmp_path):
  with pytest.raises(ValueError, match="no tokenizer.json"):
    HFTokenizer.from_pretrained(str(tmp_path))
  save_bpe_tokenizer(tmp_path, add_bos=False)
  tok = HFTokenizer.from_pretrained(str(tmp_path))
  with pytest.raises(ValueError, match="no chat template"):
    HFTokenizer(tok._tokenizer, eos_id=1, chat=True)  # pylint: disable=protected-access
