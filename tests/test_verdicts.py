"""Why a completion failed (rl/verdicts.py): every task's scorer names each category on
hand-made completions, through the scoring worker as training and evaluation score; the
default for tasks without a `verdict`; what the rollout adds (truncated, tool_error); and
the worker's reply record, which carries the verdict as checked data."""

import json

import pytest

from rl import scoring
from rl import verdicts
from rl.tasks import Example
from rl.tasks import make_task
from rl.verdicts import Verdict
from tests import scoring_tasks

CORRECT, NO_ANSWER, MALFORMED, WRONG = (verdicts.CORRECT, verdicts.NO_ANSWER,
                                        verdicts.MALFORMED, verdicts.WRONG_VALUE)


def _judged(task, cases, example):
  """[(category, answer, target)] of `cases` ({completion: ...}) scored in the worker."""
  completions = list(cases)
  scores = scoring.score(task, completions, [example] * len(completions))
  assert scores.timeouts == scores.errors == 0
  for completion, verdict, exact in zip(completions, scores.verdicts, scores.exact):
    assert exact == (verdict.category == CORRECT), completion
  return [(v.category, v.answer, v.target) for v in scores.verdicts]


def test_running_sum_names_each_category():
  task = make_task("running_sum")
  example = task.examples("eval", 1)[0]
  total = str(example.entry["total"])
  cases = {example.entry["solution"]: (CORRECT, total),
           "": (NO_ANSWER, None),
           ",2:": (NO_ANSWER, None),                    # cut before any total
           ",1:12a4": (MALFORMED, "12a4"),
           ",1:1234567,": (MALFORMED, None),            # a trailing comma: no last state
           ",0:1234567": (WRONG, "1234567")}
  judged = _judged(task, cases, example)
  for (category, answer), (got, got_answer, target) in zip(cases.values(), judged):
    assert got == category and target == total
    if answer is not None:
      assert got_answer == answer


@pytest.mark.parametrize("name,style", [("chain_sum", "compact"), ("basic_arithmetic", "full"),
                                        ("leg_counting", "compact")])
def test_numeric_reasoning_gym_tasks_name_each_category(name, style):
  task = make_task(name, style, eval_size=4)
  example = task.examples("eval", 1)[0]
  gold = example.entry["answer"]
  cases = {f"{gold}\nthe rest is not read": CORRECT, "": NO_ANSWER, "  \n": NO_ANSWER,
           "the sum is twelve": MALFORMED, "12a": MALFORMED,
           str(int(gold) + 1): WRONG, str(-int(gold) or 7): WRONG}  # a sign error: partial
  judged = _judged(task, cases, example)
  assert [category for category, _, _ in judged] == list(cases.values())
  assert all(target == example.answer for _, _, target in judged)
  assert judged[0][1] == gold and judged[1][1] is None and judged[3][1] == "the sum is twelve"


def test_countdown_names_each_category():
  task = make_task("countdown", eval_size=2)
  example = task.examples("eval", 1)[0]
  numbers = example.entry["metadata"]["numbers"]
  cases = {example.answer: CORRECT, "  ": NO_ANSWER, "1 +": MALFORMED,
           "__import__('os').system('x')": MALFORMED, "9**9**9": MALFORMED,
           "+".join(map(str, numbers[:-1])): WRONG,       # a number left out
           "+".join(map(str, numbers)) + "+0": WRONG}     # a number that is not given
  assert [c for c, _, _ in _judged(task, cases, example)] == list(cases.values())


def _math_cases(gold: str) -> dict:
  return {f"Step by step... so \\boxed{{{gold}}}.": CORRECT,
          "I am not able to compute this.": NO_ANSWER,
          "The final answer is \\boxed{answer}.": MALFORMED,   # a copied placeholder
          f"#### {int(gold) + 1}": WRONG,
          f"We get {int(gold) + 2} in the end": WRONG}


def test_gsm_symbolic_names_each_category():
  task = make_task("gsm_symbolic", "full", eval_size=2)
  example = task.examples("eval", 1)[0]
  gold = example.entry["answer"]
  judged = _judged(task, _math_cases(gold), example)
  assert [c for c, _, _ in judged] == list(_math_cases(gold).values())
  assert [a for _, a, _ in judged] == [gold, None, "answer", str(int(gold) + 1),
                                       str(int(gold) + 2)]
  assert {t for _, _, t in judged} == {gold}


def test_reasoned_reasoning_gym_task_is_judged_as_the_math_task():
  task = make_task("basic_arithmetic", "reasoned", eval_size=2)
  example = task.examples("eval", 1)[0]
  gold = example.entry["answer"]
  judged = _judged(task, _math_cases(gold), example)
  assert [c for c, _, _ in judged] == list(_math_cases(gold).values())
  assert {t for _, _, t in judged} == {gold}


def test_dataset_task_names_each_category_for_numeric_and_latex_golds(tmp_path):
  rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
          for i in range(1, 9)]
  rows.append({"question": "Half of pi?", "answer": "\\frac{\\pi}{2}"})
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  held = tmp_path / "held.jsonl"
  held.write_text(json.dumps(rows[-1]) + "\n" + json.dumps(rows[0]) + "\n")
  task = make_task("dataset", "full", eval_size=2, path=str(path), eval_path=str(held))
  latex, numeric = task.examples("eval", 2)
  assert [c for c, _, _ in _judged(task, _math_cases("2"), numeric)] == list(
      _math_cases("2").values())
  # Against a LaTeX gold any answer found is well-formed: a box of words is just wrong.
  judged = _judged(task, {"\\boxed{\\frac{\\pi}{2}}": None, "no idea": None,
                          "\\boxed{answer}": None, "\\boxed{\\pi}": None}, latex)
  assert [c for c, _, _ in judged] == [CORRECT, NO_ANSWER, WRONG, WRONG]
  assert judged[0][2] == "\\frac{\\pi}{2}"


class _Plain:
  """A task without `verdict`: the default applies."""
  name = "plain"

  def reward(self, completion, example):
    return float(completion == example.answer)


class _Lying(_Plain):
  """A verdict that disagrees with the exact match: the reward decides what is correct."""

  def verdict(self, completion, example):
    return Verdict(CORRECT if completion != example.answer else NO_ANSWER, "x" * 1000)


class _Bad(_Plain):
  def verdict(self, completion, example):
    return Verdict("exploded")


def test_a_task_without_verdict_gets_correct_or_wrong_value_with_its_reference_as_target():
  example = Example(prompt="p", answer="7", entry={})
  scores = scoring.score(_Plain(), ["7", "8", ""], [example] * 3)
  assert list(scores.verdicts) == [Verdict(CORRECT, None, "7"), Verdict(WRONG, None, "7"),
                                   Verdict(WRONG, None, "7")]


def test_a_verdict_agrees_with_the_exact_match_and_its_texts_are_bounded():
  example = Example(prompt="p", answer="7", entry={})
  scores = scoring.score(_Lying(), ["7", "8"], [example] * 2)
  assert [v.category for v in scores.verdicts] == [CORRECT, WRONG]
  assert all(len(v.answer) == verdicts.MAX_TEXT_CHARS for v in scores.verdicts)


def test_a_verdict_outside_the_task_categories_is_a_scorer_error():
  example = Example(prompt="p", answer="7", entry={})
  scores = scoring.score(_Bad(), ["7"], [example])
  assert scores.errors == 1 and scores.rewards.tolist() == [0.0]
  assert scores.verdicts == (Verdict(verdicts.SCORER_FAILED),)


def test_scorer_failures_are_their_own_category():
  """A scorer that raises, returns NaN or kills its worker: scorer_failed, beside the
  verdicts of the completions around it (the default's, for a task without `verdict`)."""
  example = Example(prompt="p", answer="7", entry={})
  scores = scoring.score(scoring_tasks.MisbehavingTask(),
                         ["abc", "RAISE", "NAN", "EXIT", "abcdefghijk"], [example] * 5)
  assert scores.errors == 3
  assert [v.category for v in scores.verdicts] == [WRONG] + [verdicts.SCORER_FAILED] * 3 + [
      CORRECT]


@pytest.mark.parametrize("category,stopped,tool_failed,expected", [
    (CORRECT, True, False, CORRECT),
    (CORRECT, False, False, CORRECT),                  # a correct answer that ran on counts
    (WRONG, False, False, verdicts.TRUNCATED),
    (NO_ANSWER, False, False, verdicts.TRUNCATED),
    (MALFORMED, True, False, MALFORMED),
    (WRONG, True, True, verdicts.TOOL_ERROR),
    (CORRECT, False, True, verdicts.TOOL_ERROR),       # its reward is 0: the tool failed
    (verdicts.SCORER_FAILED, False, True, verdicts.SCORER_FAILED),
])
def test_after_rollout_adds_truncation_and_tool_errors(category, stopped, tool_failed, expected):
  verdict = Verdict(category, "a", "t")
  judged = verdicts.after_rollout(verdict, stopped=stopped, tool_failed=tool_failed)
  assert judged == Verdict(expected, "a", "t")


def test_counts_every_category_in_order():
  counted = verdicts.counts([Verdict(WRONG), Verdict(CORRECT), Verdict(WRONG)])
  assert list(counted) == list(verdicts.CATEGORIES)
  assert counted == {**dict.fromkeys(verdicts.CATEGORIES, 0), CORRECT: 1, WRONG: 2}


def test_result_records_carry_the_verdict_as_checked_text():
  """The worker's reply: numbers, a category index and UTF-8 texts; anything else (an
  unknown category, a length past the texts, invalid UTF-8, oversized texts) is malformed,
  and a failed status carries no verdict but `scorer_failed`."""
  verdict = Verdict(MALFORMED, "12a\u00e9", "12")
  record = scoring.result_record(3, 0.25, False, verdict, scoring._OK)
  assert scoring._result(record, {3}) == (3, 0.25, False, verdict, scoring._OK)
  assert scoring._result(record, {4}) is None  # not an index the trainer waits for
  failed = scoring.result_record(3, 0.0, False, Verdict(verdicts.SCORER_FAILED), scoring._ERROR)
  assert scoring._result(failed, {3})[3] == Verdict(verdicts.SCORER_FAILED)
  header = scoring._RESULT.size
  forged = [scoring._RESULT.pack(b"r", 3, 0.0, False, scoring._OK, 9, 0),          # category
            scoring._RESULT.pack(b"r", 3, 0.0, False, scoring._OK, 0, 5) + b"ab",  # length
            scoring._RESULT.pack(b"r", 3, 0.0, False, scoring._OK, 0, 2) + b"\xff\xfe",
            scoring._RESULT.pack(b"r", 3, 0.0, False, scoring._OK, 0, 0)
            + b"x" * (2 * 4 * verdicts.MAX_TEXT_CHARS + 1),
            record[:header - 1]]
  assert [scoring._result(frame, {3}) for frame in forged] == [None] * len(forged)
