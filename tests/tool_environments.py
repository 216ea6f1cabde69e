"""Environments for tests/test_tools.py, in a module so the scoring worker can import them:
hostile ones (hang, crash, raise, answer a non-string, answer megabytes, loop forever) and
one that answers a fixed long text (for the observation cap)."""

import os


class Hostile:
  """Misbehaves as the row's text says: 'hang' loops forever, 'crash' kills its process,
  'raise' raises, 'number' answers a non-string, 'huge' answers 10 MB; otherwise 'ok'."""
  name = "hostile"
  call_end = "="
  timeout_s = 0.5

  def step(self, text):
    if "hang" in text:
      while True:
        pass
    if "crash" in text:
      os._exit(3)
    if "raise" in text:
      raise RuntimeError("a broken tool")
    if "number" in text:
      return 5
    if "huge" in text:
      return "9" * 10**7
    return "ok"


class Verbose:
  """Answers every call with 50 'a's (longer than any test's observation cap)."""
  name = "verbose"
  call_end = "="

  def step(self, text):
    del text
    return "a" * 50


class EndsAtSecondCall:
  """Answers a row's first call with '1' and ends the row at its second (answers None)."""
  name = "ends_at_second_call"
  call_end = "="

  def step(self, text):
    return "1" if text.count("=") == 1 else None


class ByLastCharacter:
  """Answers by the character before the call's "=", so that a random policy's rows take
  every path often: a digit -> the text's length (digits), a letter -> "" (not a call),
  "," or ":" -> None (ends the row), anything else -> "ab"."""
  name = "by_last_character"
  call_end = "="

  def step(self, text):
    before = text[-2] if len(text) >= 2 else ""
    if before.isdigit():
      return str(len(text))
    if before.isalpha():
      return ""
    if before in ",:":
      return None
    return "ab"


class AnswersZero:
  """Answers every call with '0'."""
  name = "answers_zero"
  call_end = "="

  def step(self, text):
    del text
    return "0"
