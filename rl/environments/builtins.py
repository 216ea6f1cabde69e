"""The built-in environments (`rl.environments.ENVIRONMENTS`, config.tools.name): the adder
(running_sum's tool) and the calculator (GSM8K's annotations). Each is one class and one
registration; a new environment is the same in its own module (docs/tools.md)."""

from __future__ import annotations

import fractions
import re
from typing import Optional

from rl.environments.base import ENVIRONMENTS


# The adder's calls, at the very end of the row's text (anchored: the regular expressions
# never scan more than the call): "?a+b=" (up to 18 digits each) and "?+b=", which adds b
# to the running total, the number the text wrote just before its last comma.
_ADDER_CALL = re.compile(r"\?([0-9]{1,18})\+([0-9]{1,18})=\Z")
_ADDER_RUNNING_CALL = re.compile(r"\?\+([0-9]{1,18})=\Z")
_RUNNING_TOTAL = re.compile(r"(?<![0-9])([0-9]{1,18}),[^,]*\Z")


class Adder:
  """Adds non-negative integers. "?a+b=" at the end of the row's text is answered a + b;
  "?+b=" is answered b plus the running total, the number that ends the text's last
  comma-separated item ("...,3:1234567,2:?+5=" -> "1234572": the total the row last wrote,
  by hand or by the adder). The short form is running_sum's demonstrated call: it copies
  nothing, so a tool state (",2:?+5=1234572", 14 characters) keeps close to a hand-written
  state's period (10); the long form's 21 characters lost the countdown on 6-9 additions
  (docs/tools.md). A call that is neither (a "?" within the last 40 characters, then
  something else; or "?+b=" with no number before the last comma, within the 80
  characters before the call) ends the row (None: it
  scores 0, so RL learns to avoid malformed calls; answering them "?" instead let an
  untrained policy loop on "=?=?"); a "=" with no "?" before it is not a call ("")."""
  name = "adder"
  call_end = "="
  timeout_s = 1.0

  def step(self, text: str) -> Optional[str]:
    tail = text[-40:]
    match = _ADDER_CALL.search(tail)
    if match is not None:
      return str(int(match.group(1)) + int(match.group(2)))
    running = _ADDER_RUNNING_CALL.search(tail)
    if running is None:
      return None if "?" in tail else ""
    end = len(text) - len(running.group(0))
    # Searched in the 80 characters before the call; the look-behind still sees the
    # character before them, so a number cut by the window is no total.
    total = _RUNNING_TOTAL.search(text, max(end - 80, 0), end)
    return None if total is None else str(int(total.group(1)) + int(running.group(1)))


_CALCULATOR_CALL = re.compile(r"<<([0-9+\-*/(). ]{1,80})=\Z")
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?|\.[0-9]+")


class _Expression:
  """A recursive-descent parser of + - * / with parentheses and unary minus over decimal
  numbers, computed in exact fractions (grammar: sum := product (('+'|'-') product)*;
  product := unary (('*'|'/') unary)*; unary := '-' unary | atom; atom := number | '('
  sum ')'). ValueError on anything else, on division by zero and past 32 levels of nesting."""

  def __init__(self, text: str):
    self.items = re.findall(r"[0-9.]+|[+\-*/()]", text.replace(" ", ""))
    if "".join(self.items) != text.replace(" ", ""):
      raise ValueError(text)
    self.at = 0

  def value(self) -> fractions.Fraction:
    result = self._sum(0)
    if self.at != len(self.items):
      raise ValueError("trailing input")
    return result

  def _peek(self) -> str:
    return self.items[self.at] if self.at < len(self.items) else ""

  def _take(self) -> str:
    item = self._peek()
    self.at += 1
    return item

  def _sum(self, depth: int) -> fractions.Fraction:
    total = self._product(depth)
    while self._peek() in ("+", "-"):
      sign = self._take()
      term = self._product(depth)
      total = total + term if sign == "+" else total - term
    return total

  def _product(self, depth: int) -> fractions.Fraction:
    total = self._unary(depth)
    while self._peek() in ("*", "/"):
      operator = self._take()
      factor = self._unary(depth)
      if operator == "/" and factor == 0:
        raise ValueError("division by zero")
      total = total * factor if operator == "*" else total / factor
    return total

  def _unary(self, depth: int) -> fractions.Fraction:
    if depth > 32:
      raise ValueError("nested too deeply")
    if self._peek() == "-":
      self._take()
      return -self._unary(depth + 1)
    item = self._take()
    if item == "(":
      inner = self._sum(depth + 1)
      if self._take() != ")":
        raise ValueError("unbalanced parentheses")
      return inner
    if not _NUMBER.fullmatch(item):
      raise ValueError(f"not a number: {item!r}")
    return fractions.Fraction(item)


def format_number(value: fractions.Fraction) -> str:
  """An exact integer as digits; anything else rounded to 6 decimals, zeros trimmed."""
  if value.denominator == 1:
    return str(value.numerator)
  text = f"{float(value):.6f}".rstrip("0").rstrip(".")
  return "0" if text == "-0" else text


class Calculator:
  """GSM8K's calculator: the row ends "<<expression=", the observation is the value and
  the closing ">>" ("<<48/2=" -> "24>>"). A "=" outside an open "<<" (prose, or an
  annotation already closed) is not a call (""). An open call that does not parse, longer
  than 80 characters, or dividing by zero, is answered "error>>"; so are values past
  10**30 in size (a policy cannot make the environment compute huge numbers)."""
  name = "calculator"
  call_end = "="
  timeout_s = 1.0

  def step(self, text: str) -> Optional[str]:
    if text.rfind("<<") <= text.rfind(">>"):
      return ""
    match = _CALCULATOR_CALL.search(text[-90:])
    if match is None:
      return "error>>"
    try:
      value = _Expression(match.group(1)).value()
    except (ValueError, ZeroDivisionError):
      return "error>>"
    if abs(value) > 10 ** 30 or value.denominator > 10 ** 30:
      return "error>>"
    return format_number(value) + ">>"


ENVIRONMENTS.register("adder", Adder)
ENVIRONMENTS.register("calculator", Calculator)
