"""Tests for models.tokenizer.CharTokenizer."""

import numpy as np
import pytest

from models.tokenizer import ALPHABET, CharTokenizer


def test_vocabulary_is_fixed():
  tok = CharTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 51
  # Ids are part of checkpoints: pin a few by hand.
  assert tok.encode("0") == [3]
  assert tok.encode("9") == [12]
  assert tok.encode(" ") == [13]
  assert tok.encode("+-*/=().") == list(range(14, 22))
  assert tok.encode("a") == [22]
  assert tok.encode(":") == [50]
  assert len(set(ALPHABET)) == len(ALPHABET)


def test_round_trip():
  tok = CharTokenizer()
  text = "12+(3*4)-5/6=7. what is it, really?: yes"
  assert tok.decode(tok.encode(text)) == text
  ids = tok.encode(text, add_bos=True)
  assert ids[0] == tok.bos_id
  assert tok.decode(ids) == text
  assert max(ids) < tok.vocab_size


def test_unknown_character_names_it_and_the_text():
  with pytest.raises(ValueError, match=r"'A'.*'1\+A'"):
    CharTokenizer().encode("1+A")


def test_decode_stops_at_eos_and_skips_pad_and_bos():
  tok = CharTokenizer()
  ids = [tok.pad_id, tok.bos_id] + tok.encode("4-1=3") + [tok.eos_id] + tok.encode("99")
  assert tok.decode(ids) == "4-1=3"
  assert tok.decode(np.array(ids + [tok.pad_id] * 3)) == "4-1=3"


def test_decode_rejects_out_of_range_id():
  with pytest.raises(ValueError, match="51"):
    CharTokenizer().decode([3, 51])
