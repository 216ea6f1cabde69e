"""The chain-of-thought math task: answer extraction and equivalence (rl/tasks/math_answer.py),
the gsm_symbolic task (rl/tasks/gsm.py) through the scoring worker, hostile completions, split
disjointness, and its settings through the launcher."""

import concurrent.futures
import os
import pickle
import subprocess
import sys
import time
from fractions import Fraction

import pytest
from experiments import config_flag
from experiments.configs import chain_sum_compact
from experiments.configs import smollm2_gsm
from rl.tasks import gsm
from rl.tasks import math_answer
from rl import scoring
from rl import tasks
from rl.tasks.math_answer import Answer
from tests import scoring_tasks
from tests.launcher_config import refusal
from rl import wiring

F = Fraction
HOSTILE = scoring_tasks.MATH_HOSTILE
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (completion, source of the extracted answer, its value); None: no answer at all.
EXTRACTION_CASES = [
    # \boxed, nested braces, trailing text, the last box wins.
    ("So the total is 5 + 3 = 8.\n\\boxed{8}", "boxed", F(8)),
    ("\\boxed{8} is wrong, the answer is \\boxed{9}", "boxed", F(9)),
    ("The answer is \\boxed{12}. I hope this helps! 100% sure.", "boxed", F(12)),
    ("\\boxed{\\frac{3}{4}}", "boxed", F(3, 4)),
    ("\\boxed{\\dfrac{3}{4}} of the cake", "boxed", F(3, 4)),
    ("\\boxed{\\tfrac{-1}{2}}", "boxed", F(-1, 2)),
    ("\\boxed{-\\frac{1}{2}}", "boxed", F(-1, 2)),
    ("\\boxed{{{7}}}", "boxed", None),  # nested braces: content '{{7}}', not a plain numeral
    ("Total: \\boxed{1,234}", "boxed", F(1234)),
    ("\\boxed{\\$12.50}", "boxed", F(25, 2)),
    ("\\boxed{12 \\text{ apples}}", "boxed", F(12)),
    ("\\boxed{\\text{12}}", "boxed", F(12)),
    ("\\boxed{75\\%}", "boxed", F(75)),
    ("\\boxed{x = 42}", "boxed", F(42)),
    ("\\boxed{3/4}", "boxed", F(3, 4)),
    ("\\boxed{-17}", "boxed", F(-17)),
    ("\\boxed {0.5}", "boxed", F(1, 2)),
    ("\\fbox{6}", "boxed", F(6)),
    ("\\boxed{} so 5", "number", F(5)),  # an empty box is no box
    ("\\boxed{5 and then 7 more, unclosed", "number", F(7)),  # unclosed: no box
    # GSM8K's #### line: the first number on the last such line.
    ("3 * 4 = 12\n#### 12", "####", F(12)),
    ("#### 3\nmore thinking\n#### $1,234 dollars", "####", F(1234)),
    ("#### -5 degrees\nThat is all.", "####", F(-5)),
    ("#### 2.5", "####", F(5, 2)),
    ("#### none\nbut 7", "number", F(7)),  # a #### line without a number: fall back
    ("\\boxed{4}\n#### 5", "boxed", F(4)),  # a box wins over ####
    # The last number in the text.
    ("He has 3 apples and buys 4, so 7 apples.", "number", F(7)),
    ("The answer is 1,234,567.", "number", F(1234567)),
    ("It costs $2.50 in total", "number", F(5, 2)),
    ("So the answer is 3/4 of a pie", "number", F(3, 4)),
    ("that gives \\frac{5}{8}.", "number", F(5, 8)),
    ("The temperature is -12 now", "number", F(-12)),
    ("10-4=6", "number", F(6)),  # a minus after a digit is subtraction
    ("x-3", "number", F(3)),
    ("The discount is 25%.", "number", F(25)),
    ("answer: 12\n\nHope that helps", "number", F(12)),
    ("1,23", "number", F(23)),  # not a thousands group: the last numeral
    ("٣ + ٤", None, None),  # other scripts' digits are not numbers
    ("I don't know.", None, None),
    ("", None, None),
]


@pytest.mark.parametrize("completion,source,value", EXTRACTION_CASES)
def test_extraction_precedence_and_numerals(completion, source, value):
  answer = math_answer.extract_answer(completion)
  if source is None:
    assert answer is None
    return
  assert answer.source == source
  assert math_answer.parse_number(math_answer.clean(answer.text)) == value


def test_there_are_at_least_thirty_extraction_cases():
  assert len(EXTRACTION_CASES) >= 30


@pytest.mark.parametrize("text,value", [
    ("42", F(42)), ("-42", F(-42)), ("+7", F(7)), ("1,000,000", F(10**6)), ("0.125", F(1, 8)),
    (".5", F(1, 2)), ("5.", F(5)), ("3 / 4", F(3, 4)), ("\\frac{6}{8}", F(3, 4)),
    ("\\frac{1.5}{3}", F(1, 2)), ("50%", F(50)), ("-\\frac{3}{4}", F(-3, 4)),
])
def test_parse_number_reads_numerals_exactly(text, value):
  assert math_answer.parse_number(text) == value


@pytest.mark.parametrize("text", [
    "", "abc", "1/0", "\\frac{1}{0}", "1,23", "1e5", "0x10", "9**9", "2^10", "1.2.3", "--1",
    "1" * (math_answer.MAX_DIGITS + 1), "__import__('os')",
])
def test_parse_number_refuses_everything_else(text):
  assert math_answer.parse_number(text) is None


@pytest.mark.parametrize("answer,gold,equal", [
    (Answer("72", "number"), "72", True),
    (Answer("72.0", "####"), "72", True),
    (Answer("0072", "number"), "72", True),
    (Answer("1,234", "boxed"), "1234", True),
    (Answer("\\frac{144}{2}", "boxed"), "72", True),
    (Answer("144/2", "number"), "72", True),
    (Answer("2 \\cdot 36", "boxed"), "72", True),  # math-verify's LaTeX parser
    (Answer("\\sqrt{5184}", "boxed"), "72", True),
    (Answer("72 \\text{ dollars}", "boxed"), "72", True),
    (Answer("72 dollars", "boxed"), "72", True),
    (Answer("\\$72", "boxed"), "72", True),
    (Answer("75\\%", "boxed"), "75", True),
    (Answer("-3", "number"), "-3", True),
    (Answer("0.75", "number"), "0.75", True),
    (Answer("\\frac{3}{4}", "boxed"), "0.75", True),
    (Answer("73", "boxed"), "72", False),
    (Answer("-72", "boxed"), "72", False),
    (Answer("72.5", "number"), "72", False),
    (Answer("7.2", "number"), "72", False),
    (Answer("x", "boxed"), "72", False),
    (Answer("72, 73", "boxed"), "72", False),  # a set is not a number
    (Answer("1,23", "number"), "123", False),
])
def test_equivalence(answer, gold, equal):
  assert math_answer.equivalent(answer, gold) is equal


@pytest.mark.parametrize("completion,formatted", [
    ("\\boxed{72}", True), ("\\boxed{\\$1,234.50}", True), ("\\boxed{\\frac{3}{4}}", True),
    ("#### 72", True), ("work\n#### -3 apples", True),
    ("\\boxed{answer}", False),  # SmolLM2 copies a placeholder from the instruction
    ("\\boxed{2 \\cdot 36}", False), ("\\boxed{}", False), ("the answer is 72", False),
    ("nothing", False), ("\\boxed{" + "1" * 200 + "}", False),
])
def test_formatted_means_a_number_in_a_box_or_on_a_hashes_line(completion, formatted):
  assert math_answer.is_formatted(math_answer.extract_answer(completion)) is formatted


def test_a_reference_that_is_not_a_numeral_is_an_error():
  with pytest.raises(ValueError, match="not a numeral"):
    math_answer.equivalent(Answer("1", "boxed"), "x + 1")


def _task(**options) -> gsm.GsmTask:
  return tasks.make_task("gsm_symbolic", "full", eval_size=8, **options)


def test_gsm_symbolic_is_a_registered_task_with_full_prompts():
  assert "gsm_symbolic" in tasks.TASK_NAMES
  task = _task()
  example = task.examples("train", 1)[0]
  assert example.prompt.endswith(gsm.DEFAULT_INSTRUCTION)
  assert example.entry["question"] in example.prompt
  assert example.answer.endswith(f"\\boxed{{{example.entry['answer']}}}")
  assert "####" not in example.answer  # the worked solution ends in the box instead
  assert task.examples("train", 3, start=5) == _task().examples("train", 3, start=5)
  assert pickle.loads(pickle.dumps(task)).examples("eval", 2) == task.examples("eval", 2)


def test_compact_prompts_and_bad_settings_are_refused_with_the_fix():
  with pytest.raises(ValueError, match="needs prompt_style='full'.*config.model.checkpoint"):
    tasks.make_task("gsm_symbolic")
  with pytest.raises(ValueError, match=r"format_reward = 1.5 must be a number in \[0, 1\)"):
    _task(format_reward=1.5)
  with pytest.raises(ValueError, match=r"no difficulty field\(s\) \['max_terms'\]; valid "
                                       "fields: difficulty, format_reward, instruction"):
    _task(max_terms=3)
  with pytest.raises(ValueError, match="supports only 1.0"):
    _task(difficulty=2.0)
  with pytest.raises(ValueError, match="already registered"):
    tasks.register_task("gsm_symbolic", key=str, compact_prompt=str, compact_answer=str)


def test_train_and_eval_splits_are_disjoint():
  task = tasks.make_task("gsm_symbolic", "full", eval_size=300)
  eval_keys = {gsm.question_key(e.entry) for e in task.examples("eval", 300)}
  train = task.examples("train", 600)
  assert not eval_keys & {gsm.question_key(e.entry) for e in train}
  assert len({gsm.question_key(e.entry) for e in train}) > 590  # templates vary the numbers
  # The filter is what keeps them apart: an eval question put on the first train stream
  # is skipped there (the next stream's item takes its place).
  task._eval = (task._eval[0], task._eval[1] | {gsm.question_key(train[0].entry)})
  assert task.examples("train", 1)[0].entry["question"] != train[0].entry["question"]


def test_reward_and_exact_match_through_the_scoring_worker():
  task, boxed_task = _task(), _task(format_reward=0.2)
  example = task.examples("eval", 1)[0]
  gold = example.entry["answer"]
  wrong = str(int(gold) + 1)
  completions = [
      example.answer,                                          # the worked solution
      f"Let me think.\nSo it is {gold}.",                      # correct, bare number
      f"... so #### {gold}",                                   # correct, GSM8K line
      f"\\boxed{{{wrong}}}",                                   # wrong, boxed
      f"It is {wrong}.",                                       # wrong, bare
      f"\\boxed{{{gold}}}<|im_end|>\\boxed{{{wrong}}}",        # text after EOS is ignored
      "no answer here",
      "\\boxed{answer}",                                       # a copied placeholder
  ]
  examples = [example] * len(completions)
  plain = scoring.score(task, completions, examples)
  assert plain.rewards.tolist() == [1, 1, 1, 0, 0, 1, 0, 0]
  assert plain.exact.tolist() == [True, True, True, False, False, True, False, False]
  shaped = scoring.score(boxed_task, completions, examples)
  assert shaped.rewards.tolist() == pytest.approx([1, 0.8, 1, 0.2, 0, 1, 0, 0])
  assert shaped.exact.tolist() == plain.exact.tolist()  # exact match ignores the format
  assert plain.timeouts == plain.errors == shaped.timeouts == shaped.errors == 0


def test_hostile_completions_are_bounded_in_the_worker(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  task = _task()
  example = task.examples("eval", 1)[0]
  completions = HOSTILE + [example.answer]
  start = time.perf_counter()
  scores = scoring.score(task, completions, [example] * len(completions))
  elapsed = time.perf_counter() - start
  assert scores.rewards.tolist() == [0.0] * len(HOSTILE) + [1.0]
  assert not (tmp_path / "PWNED").exists()
  # Arbor's bound on math-verify ends the unfinishable ones (about a second each) and each
  # counts as a timeout; whatever it could not interrupt would hit the worker's limit and
  # count the same way, never hang.
  assert scores.errors == 0 and scores.timeouts == scoring_tasks.MATH_UNFINISHABLE
  assert elapsed < len(HOSTILE) * (task.reward_timeout_s + 2), elapsed


def test_a_math_verify_timeout_counts_as_a_reward_timeout():
  # 9^(9^9) has 370 million digits: math-verify never finishes it. Arbor's bound on the call
  # (VERIFY_TIMEOUT_S) ends it with a TimeoutError, which the worker counts in
  # reward_timeouts; math-verify's own alarm used to return "not equal" and count nothing.
  task = _task()
  example = task.examples("eval", 1)[0]
  with pytest.raises(TimeoutError):
    gsm.score("\\boxed{9^{9^{9}}}", "72")
  scores = scoring.score(task, ["\\boxed{9^{9^{9}}}", example.answer], [example] * 2)
  assert scores.rewards.tolist() == [0.0, 1.0]
  assert scores.timeouts == 1 and scores.errors == 0


def test_the_first_answer_of_a_process_is_not_charged_for_math_verify_start_up():
  # The first parse in a process builds math-verify's LaTeX grammar (0.2 s of CPU, then
  # 0.2 ms a call): in a fresh process with the bound cut to 50 ms, the first answer
  # (a tuple with a fraction and pi, against the same gold) and the first second opinion
  # still score within it, because the start-up runs untimed before the bound.
  check = ("from rl.tasks import math_answer as m\n"
           "m.VERIFY_TIMEOUT_S = 0.05\n"
           "gold = '(3, \\\\frac{\\\\pi}{2})'\n"
           "assert m.matches_reference(m.Answer(text=gold, source='boxed'), gold)\n"
           "assert m.verified_anywhere('so the answer is $\\\\frac{3}{4}$', '0.75')\n")
  subprocess.run([sys.executable, "-c", check], check=True, timeout=120, cwd=_REPO)


def _spin_until(end: float) -> None:
  """Busy CPU until time.monotonic() reaches `end` (what a slow parse looks like)."""
  while time.monotonic() < end:
    pass


def test_the_bound_on_math_verify_survives_a_swallowed_alarm():
  # Python ignores an exception raised in a garbage-collector callback or a __del__: when the
  # alarm lands there, the bound must fire again (tests/test_run_alone.py once saw
  # math-verify run on for 5 s after JAX's gc callback swallowed the alarm).
  def swallow_the_first_alarm():
    end = time.monotonic() + 3
    try:
      _spin_until(end)
    except BaseException:  # pylint: disable=broad-except  (as Python does in a gc callback)
      pass
    _spin_until(end)

  start = time.monotonic()
  with pytest.raises(TimeoutError):
    math_answer._within(0.2, swallow_the_first_alarm)  # pylint: disable=protected-access
  assert time.monotonic() - start < 1.5


def test_an_alarm_swallowed_in_a_destructor_is_not_reported_and_the_bound_holds(monkeypatch):
  # Where Python swallows the alarm (a __del__), it reports it to sys.unraisablehook; a
  # reporting hook (pytest's) could itself be cut by the repeating alarm. While the bound
  # runs, those reports are dropped; other unraisable exceptions still reach the hook.
  reported = []
  monkeypatch.setattr(sys, "unraisablehook", reported.append)

  class SlowToDelete:
    def __del__(self):  # the first alarm lands here and ends it, swallowed
      _spin_until(time.monotonic() + 3)

  class FailsToDelete:
    def __del__(self):
      raise ValueError("not the alarm")

  def churn():
    FailsToDelete()
    SlowToDelete()
    _spin_until(time.monotonic() + 3)  # the repeated alarm ends this

  start = time.monotonic()
  with pytest.raises(TimeoutError):
    math_answer._within(0.2, churn)  # pylint: disable=protected-access
  assert time.monotonic() - start < 1.5
  assert [type(u.exc_value) for u in reported] == [ValueError]
  assert sys.unraisablehook == reported.append  # restored


def test_each_hostile_completion_takes_at_most_a_few_seconds_in_process():
  # The worker's limit is the backstop; in the main thread rl.tasks.math_answer's alarm fires. Timed
  # in this process's CPU seconds, which other processes' load does not inflate (each takes
  # ~1 s of wall time on an idle machine; 8.5 s once beside another pytest worker); CPU time
  # cannot see a blocking hang, so tests/test_run_alone.py bounds wall time, alone.
  scoring_tasks.assert_each_hostile_math_completion_is_bounded(time.process_time)


def test_format_reward_through_the_launcher_config(tmp_path):
  config = smollm2_gsm.get_config()
  assert config.task.difficulty.format_reward == 0.0  # off by default
  wiring.validate(config)
  config.task.difficulty.format_reward = 0.25
  task = wiring.build_task(wiring.settings(config))
  example = task.examples("eval", 1)[0]
  assert task.reward("\\boxed{-1}", example) == 0.25
  config.task.difficulty.format_reward = 1.0
  with pytest.raises(ValueError, match=r"format_reward = 1.0 must be a number in \[0, 1\)"):
    wiring.validate(config)
  config.task.difficulty.format_reward = 0.0
  config.task.prompt_style = "compact"
  with pytest.raises(ValueError, match="needs prompt_style='full'"):
    wiring.validate(config)
  # The launcher refuses a bad format reward before any work.
  config = smollm2_gsm.get_config()
  config.workdir = str(tmp_path / "run")
  config.task.difficulty.format_reward = 1.5
  assert "format_reward = 1.5 must be a number in [0, 1)" in refusal(config)
  # A task without a format reward has no such field to set on the command line.
  assert ("config.task.difficulty has no field 'format_reward'" in
          config_flag.unknown_field(chain_sum_compact.get_config(),
                                    "task.difficulty.format_reward"))


def test_scoring_outside_the_main_thread_runs_without_alarms():
  # SIGALRM can only be set in the main thread: math-verify then runs without rl.tasks.math_answer's
  # alarm (the scoring worker's limit still holds), rather than raising.
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    assert pool.submit(gsm.score, "\\boxed{2 \\cdot 36} (in a thread)", "72").result() == (
        1.0, True)
