"""Why a completion scored what it did: the failure categories and a scorer's `Verdict`.

A reward says how good a completion was; a category says why it failed, which is what a
researcher reading samples looks for (a format bug, truncation, reward hacking). Every
scored completion gets one category:

- from the task's scorer (`TASK_CATEGORIES`): `correct`; `no_answer` (nothing the scorer
  could take as an answer: an empty reply, prose without a number); `malformed` (something
  in the answer's place that is not an answer of the task's form: "12a", an expression
  that does not parse, a box holding a word); `wrong_value` (a well-formed answer that is
  wrong, partial credit included);
- from the rollout, which the scorer cannot see (`ROLLOUT_CATEGORIES`): `truncated` (the
  completion ran out of `max_new_tokens` without stopping, and is not correct); `tool_error`
  (an environment step failed: reward 0, docs/tools.md); `scorer_failed` (the scorer timed
  out, raised or crashed: reward 0, counted in `reward_timeouts` / `reward_errors`).

A task reports its categories with an optional method `verdict(completion, example) ->
Verdict` (docs/add_task.md), which runs in the scoring worker beside `reward` and
`exact_match`, on the same terms. Without it, `task_verdict` gives `correct` or
`wrong_value` from the exact-match flag. This module imports only the standard library:
the scoring worker (rl/scoring.py) imports it.
"""

from __future__ import annotations

import dataclasses

CORRECT = "correct"
NO_ANSWER = "no_answer"
MALFORMED = "malformed"
WRONG_VALUE = "wrong_value"
TRUNCATED = "truncated"
TOOL_ERROR = "tool_error"
SCORER_FAILED = "scorer_failed"

TASK_CATEGORIES = (CORRECT, NO_ANSWER, MALFORMED, WRONG_VALUE)
ROLLOUT_CATEGORIES = (TRUNCATED, TOOL_ERROR, SCORER_FAILED)
CATEGORIES = TASK_CATEGORIES + ROLLOUT_CATEGORIES

MAX_TEXT_CHARS = 200  # a verdict's answer and target are cut to this many characters


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What the scorer made of one completion: its category (one of `CATEGORIES`), the
  answer it read (for `malformed`, the text it could not read; None when it found none or
  does not say) and the target it compared with (None when it does not say)."""
  category: str
  answer: str | None = None
  target: str | None = None


def _bounded(text) -> str | None:
  """`text` as a string of at most MAX_TEXT_CHARS characters; None for None or ''."""
  if text is None:
    return None
  text = str(text)[:MAX_TEXT_CHARS]
  return text or None


def task_verdict(task, completion: str, example, exact: bool) -> Verdict:
  """The task's verdict on a scored completion, in the scoring worker: its `verdict`
  method's (answer and target cut to MAX_TEXT_CHARS), else `correct` / `wrong_value` by
  `exact` with the example's reference answer as the target. The category always agrees
  with `exact` (the reward decides what is correct). A category outside TASK_CATEGORIES
  is a ValueError: the worker counts it as a scorer error."""
  method = getattr(task, "verdict", None)
  if method is None:
    return Verdict(CORRECT if exact else WRONG_VALUE,
                   target=_bounded(getattr(example, "answer", None)))
  verdict = method(completion, example)
  if not isinstance(verdict, Verdict) or verdict.category not in TASK_CATEGORIES:
    raise ValueError(f"Task {getattr(task, 'name', task)!r}: verdict() returned {verdict!r}; "
                     f"it must be an rl.verdicts.Verdict with a category in {TASK_CATEGORIES}.")
  category = (CORRECT if exact else
              WRONG_VALUE if verdict.category == CORRECT else verdict.category)
  return Verdict(category, _bounded(verdict.answer), _bounded(verdict.target))


def after_rollout(verdict: Verdict, *, stopped: bool, tool_failed: bool) -> Verdict:
  """The verdict with what the rollout adds: `tool_error` for a row whose environment step
  failed, `truncated` for one that did not stop before the length limit and is not
  correct (a correct truncated answer stays correct: its reward counts). A scorer
  failure stays one."""
  if verdict.category == SCORER_FAILED:
    return verdict
  if tool_failed:
    return dataclasses.replace(verdict, category=TOOL_ERROR)
  if not stopped and verdict.category != CORRECT:
    return dataclasses.replace(verdict, category=TRUNCATED)
  return verdict


def counts(verdicts) -> dict[str, int]:
  """{category: completions} over `verdicts`, every category present (zeros included), in
  `CATEGORIES` order."""
  total = dict.fromkeys(CATEGORIES, 0)
  for verdict in verdicts:
    total[verdict.category] += 1
  return total
