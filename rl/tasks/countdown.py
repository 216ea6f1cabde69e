"""A safe countdown verifier: its own small arithmetic parser and exact rational arithmetic.

Why not reasoning-gym's `score_answer`: it evaluates the answer with sympy's `parse_expr`,
which runs Python (`__import__('os').system(...)` executes), and `9**9**9` or `1e999999`
never return. The policy writes the answer, so the scorer must treat it as hostile text.

Grammar (whitespace between tokens is ignored):

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := ('+' | '-') factor | number | '(' expr ')'
    number := 0 | [1-9][0-9]*

Nothing else is accepted: no `**`, no decimals or exponents, no names, no non-ASCII digits.
Limits keep every call cheap whatever the input: at most `MAX_CHARS` characters,
`MAX_DIGITS` digits per number, `MAX_DEPTH` nested parentheses / unary signs, and
intermediate values whose numerator and denominator fit in `MAX_BITS` bits. Arithmetic is
exact (`fractions.Fraction`), so `(6/4)*4` is 6 and a result is compared with the target
exactly.

Reward (`reward`), the same scale as reasoning-gym's countdown scorer, so runs stay
comparable: 1.0 for an expression that uses every given number exactly once and equals
the target; 0.05 for a well-formed expression that uses other numbers or misses the target;
0.01 for anything else (empty, malformed, over a limit, division by zero). The question
asks for all the numbers, each once, so full credit needs exactly the given multiset.
"""

from __future__ import annotations

import collections
import fractions
from typing import Sequence

from rl import verdicts

MAX_CHARS = 256
MAX_DIGITS = 12
MAX_DEPTH = 32
MAX_BITS = 1024

CORRECT, WELL_FORMED, MALFORMED = 1.0, 0.05, 0.01

_DIGITS = frozenset("0123456789")
_OPERATORS = frozenset("+-*/()")
_SPACE = frozenset(" \t")


class ExpressionError(ValueError):
  """The text is not an expression of the countdown grammar, or breaks a limit."""


def tokenize(text: str) -> list[str]:
  """Numbers (digit strings) and single-character operators of `text`, in order.

  Raises ExpressionError for any other character, a number longer than MAX_DIGITS or with
  a leading zero, or a text longer than MAX_CHARS (checked first, so a megabyte of input costs nothing).
  """
  if len(text) > MAX_CHARS:
    raise ExpressionError(f"longer than {MAX_CHARS} characters")
  tokens, i = [], 0
  while i < len(text):
    ch = text[i]
    if ch in _SPACE:
      i += 1
    elif ch in _OPERATORS:
      tokens.append(ch)
      i += 1
    elif ch in _DIGITS:
      start = i
      while i < len(text) and text[i] in _DIGITS:
        i += 1
      if i - start > MAX_DIGITS:
        raise ExpressionError(f"a number longer than {MAX_DIGITS} digits")
      if text[start] == "0" and i - start > 1:  # as Python (and so reasoning-gym) rejects
        raise ExpressionError(f"number {text[start:i]!r} has a leading zero")
      tokens.append(text[start:i])
    else:
      raise ExpressionError(f"character {ch!r} is not a digit, operator or parenthesis")
  return tokens


class _Parser:
  """Recursive descent over `tokenize`'s output; records every number literal it reads."""

  def __init__(self, tokens: list[str]):
    self.tokens, self.pos, self.depth = tokens, 0, 0
    self.numbers: list[int] = []

  def peek(self) -> str | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def take(self) -> str:
    token = self.peek()
    if token is None:
      raise ExpressionError("unexpected end of expression")
    self.pos += 1
    return token

  def expr(self) -> fractions.Fraction:
    value = self.term()
    while self.peek() in ("+", "-"):
      op = self.take()
      value = _checked(value + self.term() if op == "+" else value - self.term())
    return value

  def term(self) -> fractions.Fraction:
    value = self.factor()
    while self.peek() in ("*", "/"):
      op = self.take()
      right = self.factor()
      if op == "*":
        value = _checked(value * right)
      elif right == 0:
        raise ExpressionError("division by zero")
      else:
        value = _checked(value / right)
    return value

  def factor(self) -> fractions.Fraction:
    token = self.take()
    if token in ("+", "-", "("):
      self.depth += 1
      if self.depth > MAX_DEPTH:
        raise ExpressionError(f"nested deeper than {MAX_DEPTH}")
      if token == "(":
        value = self.expr()
        if self.take() != ")":
          raise ExpressionError("unbalanced parenthesis")
      else:
        value = self.factor() if token == "+" else -self.factor()
      self.depth -= 1
      return value
    if token[0] in _DIGITS:
      self.numbers.append(int(token))
      return fractions.Fraction(int(token))
    raise ExpressionError(f"unexpected {token!r}")


def _checked(value: fractions.Fraction) -> fractions.Fraction:
  if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
    raise ExpressionError(f"an intermediate value exceeds {MAX_BITS} bits")
  return value


def evaluate(text: str) -> tuple[fractions.Fraction, list[int]]:
  """(exact value, number literals in order) of a countdown expression.

  Raises ExpressionError when `text` is not in the grammar or breaks a limit.
  """
  parser = _Parser(tokenize(text))
  if parser.peek() is None:
    raise ExpressionError("empty expression")
  value = parser.expr()
  if parser.peek() is not None:
    raise ExpressionError(f"unexpected {parser.peek()!r} after the expression")
  return value, parser.numbers


def score(answer: str, numbers: Sequence[int], target: int) -> float:
  """The countdown reward of `answer` (see the module docstring for the scale)."""
  try:
    value, used = evaluate(answer)
  except ExpressionError:
    return MALFORMED
  if collections.Counter(used) != collections.Counter(int(n) for n in numbers):
    return WELL_FORMED
  return CORRECT if value == target else WELL_FORMED


def reward(answer: str, entry: dict) -> float:
  """`score` against a reasoning-gym countdown entry (`metadata.numbers`, `metadata.target`);
  the task reward of rl.tasks' countdown."""
  meta = entry["metadata"]
  return score(answer, meta["numbers"], meta["target"])


def category(answer: str, entry: dict) -> str:
  """Why a countdown answer that is not correct failed (rl.verdicts): no_answer when it is
  empty, malformed when it is not an expression of the grammar (or breaks a limit: what
  `reward` scores 0.01), else wrong_value (a well-formed expression with other numbers or
  another value: 0.05)."""
  del entry  # the numbers and target decide wrong_value only, which needs no check here
  if not answer.strip():
    return verdicts.NO_ANSWER
  try:
    evaluate(answer)
  except ExpressionError:
    return verdicts.MALFORMED
  return verdicts.WRONG_VALUE
