"""Final answers of chain-of-thought math completions: extraction and equivalence.

A model that reasons before answering writes its answer at the end, so the scorer looks for
it in the whole completion. `extract_answer` takes, in this order of precedence:

  1. `boxed`: the content of the last well-formed, non-empty `\\boxed{...}` (or `\\fbox{...}`),
     braces nested, at most `MAX_ANSWER_CHARS` characters;
  2. `####`: else the first number on the line after the last `####` marker (GSM8K's
     format), e.g. "#### $1,234 dollars" gives "1,234";
  3. `number`: else the last number in the text (`1,234`, `-5`, `2.5`, `3/4`, `\\frac{3}{4}`,
     `75%`); none at all is no answer.

`equivalent(answer, gold)` compares an answer with a numeric reference (`matches_reference`
also takes a LaTeX one, such as MATH's `\\frac{\\pi}{2}`: math-verify parses it). A plain numeral
(after removing `\\$`, `\\text{...}` units, thousands commas, a trailing period, `x =`) is
read exactly by `parse_number` into a Fraction (so "0.75", "3/4", "\\dfrac{3}{4}" are equal
and "75%" is 75: GSM answers give a percentage as its number); anything else in a box
("2 \\cdot 36", "\\sqrt{5184}") goes to math-verify's LaTeX parser. Both sides then go to
math-verify's `verify` (HuggingFace's maintained verifier), which decides equality.

Safety. Completions are policy text and never evaluated. math-verify is used only with its
LaTeX extraction (`LatexExtractionConfig`): its other mode, `ExprExtractionConfig`, runs
sympy's `parse_expr` (which evaluates Python) on free text. In the LaTeX path
(latex2sympy2_extended, an ANTLR grammar) `parse_expr` is reached only through
`sympy.Number(token)` on the lexer's number tokens (digits, '.', ','), never on free text.
Input is bounded before it reaches math-verify: a box of more than `MAX_ANSWER_CHARS`
characters is not an answer, and a numeral of more than `MAX_DIGITS` digits is not a number.

Time. math-verify's work on one answer (parse and comparison together) is bounded by
Arbor's own wall-clock alarm, `VERIFY_TIMEOUT_S`, which raises TimeoutError: the scoring
worker (rl/scoring.py) counts that completion in `reward_timeouts`, with reward 0. (math-
verify's own alarms are off: when they fire, math-verify returns "not equal", and a
timeout would be a silent wrong answer.) The alarm is SIGALRM, which needs the main
thread, where the worker scores; what it cannot interrupt (C code that never returns to the
interpreter) is ended by the worker's per-completion time limit and counted the same way.
In another thread no alarm can be set, and math-verify runs unbounded.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import logging
import re
import signal
import sys
import threading

from math_verify import LatexExtractionConfig, parse, verify
import sympy

from rl import verdicts

MAX_ANSWER_CHARS = 100  # longer boxed content is not an answer (bounds the LaTeX parser)
MAX_DIGITS = 30         # a numeral with more digits is not a number
VERIFY_TIMEOUT_S = 1.0  # wall-clock seconds for math-verify's parse and comparison of an answer
_REPEAT_S = 0.05        # the alarm fires again this often until the call has ended

SOURCES = ("boxed", "####", "number")
EOS_MARKERS = ("<|endoftext|>", "<|im_end|>", "</s>")  # end-of-sequence text a decode may keep
_MAX_BOX_TRIES = 16      # boxes tried, from the last one back
_NUMBER_WINDOW = 2 * MAX_ANSWER_CHARS  # characters around the last digit searched for it

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = "####"
# One number in running text: a LaTeX fraction, or a numeral (thousands commas, decimals, a
# slash fraction, percent). A minus sign counts only where it cannot be subtraction (not after
# a digit, letter or closing bracket). ASCII digits only: \d would take other scripts' digits.
_NUMBER = re.compile(
    r"\\[dt]?frac\s*\{\s*-?[0-9]+\s*\}\s*\{\s*[0-9]+\s*\}"
    r"|(?:(?<![0-9A-Za-z)\]}])[-\u2212])?"
    r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?"
    r"(?:\s*/\s*[0-9]+(?![0-9.]))?(?:\s*\\?%)?")
_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|~|\\\$|\$|\{,\}|\\left|\\right")
_TRAILING_WORDS = re.compile(r"(?<=[0-9}%])\s+[A-Za-z][A-Za-z.\s]*$")
_PLAIN = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]*)?|\.[0-9]+"
_FRAC = re.compile(rf"\\frac\s*\{{\s*(-?(?:{_PLAIN}))\s*\}}\s*\{{\s*({_PLAIN})\s*\}}")
_SLASH = re.compile(rf"({_PLAIN})\s*/\s*({_PLAIN})")
_DECIMAL = re.compile(_PLAIN)


def _without_timeout_warning(record: logging.LogRecord) -> bool:
  """Drops math-verify's warning that its own timeout is off: `_within` bounds the call."""
  return not record.getMessage().startswith("Timeout is disabled")


for _logger in ("math_verify.parser", "math_verify.grader"):
  logging.getLogger(_logger).addFilter(_without_timeout_warning)


@dataclasses.dataclass(frozen=True)
class Answer:
  """An extracted final answer: its text and where it came from (one of `SOURCES`)."""
  text: str
  source: str


def last_boxed(text: str) -> str | None:
  """The content of the last well-formed, non-empty \\boxed{...} (or \\fbox{...}) whose
  content has at most MAX_ANSWER_CHARS characters; braces nest, escaped braces do not.
  Only the last `_MAX_BOX_TRIES` boxes are tried (so a flood of unclosed boxes is cheap)."""
  for opening in list(_BOX_OPEN.finditer(text))[::-1][:_MAX_BOX_TRIES]:
    content = _braced(text, opening.end())
    if content and content.strip():
      return content.strip()
  return None


def _braced(text: str, start: int, limit: int | None = MAX_ANSWER_CHARS) -> str | None:
  """The text from `start` up to the brace closing the one before it, or None when it does
  not close within `limit` characters (None: anywhere)."""
  end = len(text) if limit is None else min(len(text), start + limit + 1)
  depth, i = 1, start
  while i < end:
    char = text[i]
    if char == "\\":
      i += 2
      continue
    if char == "{":
      depth += 1
    elif char == "}":
      depth -= 1
      if depth == 0:
        return text[start:i]
    i += 1
  return None


def after_last_hashes(text: str) -> str | None:
  """The first number on the line after the last '####' marker, or None."""
  position = text.rfind(_HASHES)
  if position < 0:
    return None
  line = text[position + len(_HASHES):].split("\n", 1)[0][:MAX_ANSWER_CHARS]
  match = _NUMBER.search(line)
  return match.group(0) if match else None


def last_number(text: str) -> str | None:
  """The last number in `text` (see `_NUMBER`), or None. It holds the last digit, so only
  the text around that digit is searched (linear in the text, not in its numbers)."""
  end = max(text.rfind(digit) for digit in "0123456789")
  if end < 0:
    return None
  last = None
  for last in _NUMBER.finditer(text[max(0, end - _NUMBER_WINDOW):end + _NUMBER_WINDOW]):
    pass
  return last.group(0) if last else None


def until_eos(completion: str) -> str:
  """The completion up to the first end-of-sequence marker left in decoded text."""
  for marker in EOS_MARKERS:
    completion = completion.split(marker, 1)[0]
  return completion


def extract_answer(text: str) -> Answer | None:
  """The final answer of a completion: last box, else last '####' line, else last number."""
  for source, find in (("boxed", last_boxed), ("####", after_last_hashes),
                       ("number", last_number)):
    found = find(text)
    if found is not None:
      return Answer(found, source)
  return None


def reference_answer(text: str) -> str | None:
  """The final answer of a trusted reference text (a data set's answer field): the rest of
  the last '####' line (GSM8K's worked solutions), else the content of the last closing
  \\boxed{...} (any length: MATH's solutions), else the whole text; stripped, None when empty.
  A bare answer ('42', '\\frac{3}{4}') is its own final answer."""
  position = text.rfind(_HASHES)
  if position >= 0:
    line = text[position + len(_HASHES):].split("\n", 1)[0].strip()
    if line:
      return line
  for opening in list(_BOX_OPEN.finditer(text))[::-1]:
    content = _braced(text, opening.end(), limit=None)
    if content and content.strip():
      return content.strip()
  return text.strip() or None


def solution_with_box(solution: str, answer: str) -> str:
  """A worked solution ending in \\boxed{answer}: its text before the last '####' marker (all
  of it when there is none), then the box on a line of its own."""
  steps = solution[:solution.rfind(_HASHES)] if _HASHES in solution else solution
  return (steps.rstrip() + "\n" if steps.strip() else "") + f"\\boxed{{{answer}}}"


def clean(text: str) -> str:
  """Strips what does not change a numeric answer: \\text{} wrappers (their words stay),
  dollar signs and LaTeX spacing, \\dfrac and \\tfrac (to \\frac), a trailing period, unit
  words after the number, and a leading 'x =' (the part after the last '=')."""
  for _ in range(3):  # \text{\textbf{...}}
    text = _WRAPPERS.sub(r" \1 ", text)
  text = _SPACING.sub(" ", text)
  text = re.sub(r"\\[dt]frac", r"\\frac", text).replace("\\%", "%").replace("\u2212", "-")
  text = text.rsplit("=", 1)[-1].strip().rstrip(".").strip()
  return _TRAILING_WORDS.sub("", text).strip()


def parse_number(text: str) -> fractions.Fraction | None:
  """Reads a plain numeral exactly: '-1,234.5', '3/4', '\\frac{3}{4}', '75%' (as 75).
  None for anything else, or for more than MAX_DIGITS digits. Never evaluates the text."""
  text = text.strip()
  if sum(c.isdigit() for c in text) > MAX_DIGITS:
    return None
  text = text.removesuffix("%").strip()
  sign = -1 if text[:1] == "-" else 1
  text = text[1:].strip() if text[:1] in "+-" else text
  for pattern in (_FRAC, _SLASH):
    match = pattern.fullmatch(text)
    if match:
      numerator, denominator = (_decimal(group) for group in match.groups())
      return None if denominator == 0 else sign * numerator / denominator
  return sign * _decimal(text) if _DECIMAL.fullmatch(text) else None


def _decimal(text: str) -> fractions.Fraction:
  return fractions.Fraction(text.replace(",", "").rstrip(".") or "0")


def _as_verifiable(answer: Answer):
  """The answer as math-verify's `verify` takes it: an exact sympy number when it is a plain
  numeral, else what math-verify's LaTeX parser reads from the box (a list; empty when it
  reads nothing)."""
  if len(answer.text) > MAX_ANSWER_CHARS:
    return []
  number = parse_number(clean(answer.text))
  if number is not None:
    return sympy.Rational(number.numerator, number.denominator)
  if answer.source != "boxed":  # a number pattern that is not a numeral: '1,23'
    return []
  return parse("\\boxed{" + answer.text + "}", extraction_config=[LatexExtractionConfig()],
               parsing_timeout=None)


class _Expired(BaseException):
  """The alarm of `_within`. A BaseException, so that the `except Exception` handlers of
  math-verify and sympy let it through (as math-verify's own TimeoutException does)."""


def _expire(signum, frame):
  del signum, frame
  raise _Expired


@functools.cache
def _warm_up() -> None:
  """Builds math-verify's LaTeX grammar and sympy's first-use state, once per process and
  untimed. The first answer a process scores would otherwise pay for it inside its time
  bound: 0.2 s of CPU against 0.2 ms for the next (measured on a tuple with a fraction and
  pi), which on a loaded machine passed VERIFY_TIMEOUT_S and scored a correct answer as a
  timeout."""
  _equals_latex(Answer(text="(3, \\frac{\\pi}{2})", source="boxed"), "(3, \\frac{\\pi}{2})")
  _verified_text("so $\\frac{3}{4}$", fractions.Fraction(3, 4))


def _within(seconds: float, function, *args):
  """function(*args), ended with TimeoutError after `seconds` of wall-clock time (SIGALRM,
  in the main thread; elsewhere no alarm can be set and the call is unbounded), after the
  untimed one-off `_warm_up`. The alarm repeats every `_REPEAT_S` until the call ends: an
  exception raised where Python ignores it (a garbage-collector callback, a __del__) would
  otherwise let the call run on."""
  _warm_up()
  if threading.current_thread() is not threading.main_thread():
    return function(*args)
  previous = signal.signal(signal.SIGALRM, _expire)
  previous_hook = sys.unraisablehook
  sys.unraisablehook = functools.partial(_ignore_expired, previous_hook)
  try:
    try:
      signal.setitimer(signal.ITIMER_REAL, seconds, _REPEAT_S)
      return function(*args)
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
  except _Expired:
    raise TimeoutError(f"math-verify took more than {seconds} s on one answer") from None
  finally:
    signal.signal(signal.SIGALRM, previous)
    sys.unraisablehook = previous_hook


def _ignore_expired(hook, unraisable) -> None:
  """sys.unraisablehook while `_within` runs: an alarm that Python swallowed (in a gc
  callback or a __del__) is expected, and repeats; it is not reported. Reporting it (as
  pytest's hook does) could itself be cut by the next alarm."""
  if not isinstance(unraisable.exc_value, _Expired):
    hook(unraisable)


def equivalent(answer: Answer, gold: str) -> bool:
  """True when `answer` equals the numeric reference `gold` (a trusted numeral such as
  '288'), as math-verify decides. Raises ValueError when `gold` is not a numeral, and
  TimeoutError when math-verify takes more than VERIFY_TIMEOUT_S."""
  reference = parse_number(gold)
  if reference is None:
    raise ValueError(f"Reference answer {gold!r} is not a numeral; the math task compares "
                     "numeric answers only.")
  return _within(VERIFY_TIMEOUT_S, _equals, answer, reference)


def matches_reference(answer: Answer, gold: str) -> bool:
  """True when `answer` equals the trusted reference `gold`, as math-verify decides: a gold
  that is a plain numeral once cleaned (`clean`; '1,234', '\\$18', '75\\%', '\\frac{3}{4}'; no
  '=') is compared exactly as `equivalent` compares it; any other gold ('\\sqrt{2}',
  '(3, \\frac{\\pi}{2})', 'x^2+1') is read by math-verify's LaTeX parser and compared with what
  it reads from the answer. TimeoutError when the whole check takes more than
  VERIFY_TIMEOUT_S."""
  number = None if "=" in gold else parse_number(clean(gold))
  if number is not None:
    return _within(VERIFY_TIMEOUT_S, _equals, answer, number)
  _parsed_reference(gold)  # the trusted reference is parsed outside the answer's time bound
  return _within(VERIFY_TIMEOUT_S, _equals_latex, answer, gold)


@functools.lru_cache(maxsize=256)
def _parsed_reference(gold: str) -> list:
  """What math-verify's LaTeX parser reads from a reference (empty: nothing)."""
  return parse("\\boxed{" + gold + "}", extraction_config=[LatexExtractionConfig()],
               parsing_timeout=None)


def _equals_latex(answer: Answer, gold: str) -> bool:
  reference = _parsed_reference(gold)
  target = _as_verifiable(answer)
  if not reference or (isinstance(target, list) and not target):
    return False
  return bool(verify(reference, target, timeout_seconds=None))


def _equals(answer: Answer, reference: fractions.Fraction) -> bool:
  target = _as_verifiable(answer)
  if isinstance(target, list) and not target:
    return False
  return bool(verify(sympy.Rational(reference.numerator, reference.denominator), target,
                     timeout_seconds=None))


SECOND_OPINION_CHARS = 400  # the completion's tail math-verify's own extraction reads


def verified_anywhere(completion: str, gold: str) -> bool:
  """A second opinion on a completion the rule scorer failed: math-verify's own LaTeX
  extraction (inline `$...$`, `\\(...\\)`, display math and boxes, with its "final answer"
  priorities) over the last SECOND_OPINION_CHARS characters of the completion, compared with
  the numeric `gold`. It reads answers the rule extraction misses, such as "the answer is
  $\\frac{3}{4}$ of the 8 cakes" (the rule takes the last number, 8). TimeoutError after
  VERIFY_TIMEOUT_S, as `equivalent`."""
  reference = parse_number(gold)
  if reference is None:
    raise ValueError(f"Reference answer {gold!r} is not a numeral; the math task compares "
                     "numeric answers only.")
  text = until_eos(completion)[-SECOND_OPINION_CHARS:]
  return _within(VERIFY_TIMEOUT_S, _verified_text, text, reference)


def _verified_text(text: str, reference: fractions.Fraction) -> bool:
  found = parse(text, extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
  return bool(found) and bool(verify(sympy.Rational(reference.numerator, reference.denominator),
                                     found, timeout_seconds=None))


def is_formatted(answer: Answer | None) -> bool:
  """True for a number given in a final-answer format: a box or a '####' line holding a
  plain numeral (not '\\boxed{answer}', a copied placeholder), not a number found only as
  the last one of the text."""
  return (answer is not None and answer.source in ("boxed", "####")
          and len(answer.text) <= MAX_ANSWER_CHARS
          and parse_number(clean(answer.text)) is not None)


def verdict(completion: str, gold: str, correct: bool) -> verdicts.Verdict:
  """Why a completion scored as it did against the reference `gold`, given whether it is
  `correct` (the scorer's decision, made once): the answer `extract_answer` takes from it
  (up to an end-of-sequence marker) and its category (`failure_category`)."""
  answer = extract_answer(until_eos(completion))
  category = (verdicts.CORRECT if correct else
              failure_category(answer, numeric=parse_number(clean(gold)) is not None))
  return verdicts.Verdict(category, None if answer is None else answer.text, gold)


def failure_category(answer: Answer | None, numeric: bool) -> str:
  """The category of a final answer that is not correct: no_answer when none was found
  (no box, no '####' line, no number: prose); malformed when the reference is a number and
  the answer is not a plain numeral (`parse_number` after `clean`: a copied '\\boxed{answer}',
  a box holding an expression or words, where the task asks for a number); else
  wrong_value. Never evaluates the text."""
  if answer is None:
    return verdicts.NO_ANSWER
  if numeric and parse_number(clean(answer.text)) is None:
    return verdicts.MALFORMED
  return verdicts.WRONG_VALUE
