"""The running_sum testbed task: generator, teacher, verifier, splits and length tail."""

import re

import numpy as np
import pytest

from rl import running_sum
from rl.running_sum import Problem
from rl.tasks import make_task


def test_hand_cases():
  problem = Problem(start=37, digit=5, steps=4)
  assert problem.total == 57
  assert running_sum.question(problem) == "37+5*d="
  assert running_sum.question(Problem(899, 1, 26)) == "899+1*z="
  assert running_sum.worked_solution(problem) == "a42b47c52d57"
  # 37+5 carries: a slip writes 32 and the teacher goes on from what it wrote.
  assert running_sum.worked_solution(problem, [True, False, False, False]) == "a32b37c42d47"
  # A slip only acts where the units wrap: 42+5 does not carry, 47+5 does.
  assert running_sum.worked_solution(problem, [False, True, True, False]) == "a42b47c42d47"
  assert running_sum.worked_solution(Problem(98, 1, 3)) == "a99b100c101"
  assert running_sum.worked_solution(Problem(98, 1, 3), [False, True, True]) == "a99b90c91"


@pytest.mark.parametrize("completion, expected", [
    ("a42b47c52d57", 57), ("57", 57), (" a42b47c52d57\nmore", 57),
    ("a42b47c52d57<|im_end|>", 57), ("a42 d 0057", 57), ("", None), ("a42b", None),
    ("a42b5x", None), ("d-57", None), ("d5.7", None), ("d" + "9" * 13, None),
    ("9" * 10**6, None), ("__import__('os')", None), ("d١٢", None),
])
def test_parse_final_answer(completion, expected):
  assert running_sum.parse_final_answer(completion) == expected


def _brute_force_totals(problem, slips):
  """Independent teacher: the written totals, from explicit units/tens digit arithmetic."""
  written, totals = problem.start, []
  for slip in slips:
    units_sum = written % 10 + problem.digit
    carry = 0 if slip else units_sum // 10
    written = (written // 10 + carry) * 10 + units_sum % 10
    totals.append(written)
  return totals


def _totals(solution):
  return [int(x) for x in re.split("[a-z]", solution)[1:]]


def test_generator_and_verifier_against_brute_force():
  task = make_task("running_sum", seed=3, eval_size=50)
  for example in task.examples("train", 400):
    problem = example.entry["problem"]
    assert example.size == problem.steps and 2 <= problem.steps <= 26
    assert 10 <= problem.start <= 899 and problem.digit == 1  # the default: counting on
    assert example.prompt == running_sum.question(problem)
    assert example.entry["total"] == problem.start + sum([problem.digit] * problem.steps)
    correct = _totals(example.entry["solution"])
    assert correct == [problem.start + problem.digit * j for j in range(1, problem.steps + 1)]
    assert task.reward(example.entry["solution"], example) == 1.0
    teacher = _totals(example.answer)
    steps_taken = np.diff([problem.start] + teacher)
    slips = list(steps_taken != problem.digit)  # where the teacher deviated
    assert set(steps_taken[slips]) <= {problem.digit - 10}
    assert teacher == _brute_force_totals(problem, slips)
    assert task.reward(example.answer, example) == float(teacher[-1] == problem.total)
    assert task.reward(example.entry["solution"] + "1", example) == 0.0
    assert task.exact_match(example.entry["solution"], example)


def test_teacher_slips_at_the_configured_rate():
  task = make_task("running_sum", eval_size=10, teacher_carry_slip=0.6, max_digit=9)
  carries = slips = 0
  for example in task.examples("train", 1000):
    problem = example.entry["problem"]
    written = problem.start
    for total in _totals(example.answer):
      if written % 10 + problem.digit >= 10:
        carries += 1
        slips += total == written + problem.digit - 10
      written = total
  assert carries > 3000
  assert abs(slips / carries - 0.6) < 0.03
  perfect = make_task("running_sum", eval_size=10, teacher_carry_slip=0.0)
  assert all(e.answer == e.entry["solution"] for e in perfect.examples("train", 200))


def test_examples_are_index_addressable_and_deterministic():
  task = make_task("running_sum", seed=1, eval_size=20)
  again = make_task("running_sum", seed=1, eval_size=20)
  assert task.examples("train", 5, 10) == task.examples("train", 15)[10:]
  assert task.examples("train", 8, 3) == again.examples("train", 8, 3)
  assert task.examples("eval", 20) == again.examples("eval", 20)
  assert task.examples("train", 8) != make_task("running_sum", seed=2).examples("train", 8)


def test_splits_are_disjoint_even_when_questions_are_few():
  # 90 distinct questions: an eval set of 60 covers half of them.
  task = make_task("running_sum", eval_size=60, min_steps=2, max_steps=2, max_start=99)
  eval_questions = {e.prompt for e in task.examples("eval", 60)}
  train = task.examples("train", 500)
  assert not eval_questions & {e.prompt for e in train}
  assert all(e.size == 2 for e in train)
  with pytest.raises(ValueError, match="collided with the eval set"):
    make_task("running_sum", eval_size=200, min_steps=1, max_steps=1,
              max_start=19).examples("train", 50)


def test_default_length_distribution_has_a_long_tail():
  """The default config's bars: median >= 16 tokens, p95 >= 4 x median, max >= 96
  (completion tokens of the correct worked solution, EOS included)."""
  task = make_task("running_sum", eval_size=500)
  for split, n in (("train", 4000), ("eval", 500)):
    lengths = np.array([len(e.entry["solution"]) + 1 for e in task.examples(split, n)])
    median = np.median(lengths)
    assert median >= 16, split
    assert np.percentile(lengths, 95) >= 4 * median, split
    assert lengths.max() >= 96, split
  sizes, probs = running_sum.Difficulty().size_probabilities()
  assert sizes[0] == 2 and sizes[-1] == 26 and probs[0] > probs[-1]
  assert probs.sum() == pytest.approx(1)


def test_bad_difficulty_and_splits_are_named():
  with pytest.raises(ValueError, match="no difficulty field"):
    make_task("running_sum", max_digits=3)
  with pytest.raises(ValueError, match="min_steps"):
    make_task("running_sum", min_steps=5, max_steps=3)
  with pytest.raises(ValueError, match="max_steps"):
    make_task("running_sum", max_steps=27)
  with pytest.raises(ValueError, match="max_digit"):
    make_task("running_sum", max_digit=10)
  with pytest.raises(ValueError, match="min_start"):
    make_task("running_sum", min_start=50, max_start=20)
  with pytest.raises(ValueError, match="teacher_carry_slip"):
    make_task("running_sum", teacher_carry_slip=1.5)
  with pytest.raises(ValueError, match="prompt_style"):
    make_task("running_sum", "verbose")
  task = make_task("running_sum", eval_size=5)
  with pytest.raises(ValueError, match="eval_size=5"):
    task.examples("eval", 6)
  with pytest.raises(ValueError, match="unknown split"):
    task.examples("test", 1)


def test_full_prompt_style_keeps_the_problem_and_the_teacher():
  task = make_task("running_sum", "full", eval_size=5)
  example = task.examples("train", 1)[0]
  assert running_sum.question(example.entry["problem"]) in example.prompt
  assert example.answer == make_task("running_sum", eval_size=5).examples("train", 1)[0].answer


def test_scored_in_the_isolated_worker_like_any_task():
  """The task pickles as its arguments (rl.scoring rebuilds it in the worker) and scores
  hostile text there without timeouts or errors."""
  import pickle  # pylint: disable=import-outside-toplevel
  from rl import scoring  # pylint: disable=import-outside-toplevel
  task = make_task("running_sum", seed=4, eval_size=30, teacher_carry_slip=0.3)
  copy = pickle.loads(pickle.dumps(task))
  assert copy.examples("train", 5) == task.examples("train", 5)
  assert copy.difficulty == task.difficulty and copy.eval_size == 30
  examples = task.examples("train", 4)
  completions = [examples[0].entry["solution"], "9" * 10**6, "__import__('os').system('x')",
                 examples[3].entry["solution"][:-1]]
  scores = scoring.score(task, completions, examples)
  assert list(scores.rewards) == [1.0, 0.0, 0.0, 0.0]
  assert scores.timeouts == 0 and scores.errors == 0


def test_running_sum_config_runs_through_the_launcher(tmp_path):
  """experiments/configs/running_sum.py, shrunk: the launcher trains on it and reports
  per-size accuracy and rollout lengths in summary.json."""
  from experiments import train as train_launcher  # pylint: disable=import-outside-toplevel
  from experiments.configs import running_sum as running_sum_config  # pylint: disable=import-outside-toplevel
  config = running_sum_config.get_config()
  config.workdir = str(tmp_path / "run")
  config.task.difficulty.max_steps = 3
  config.task.difficulty.max_start = 99
  config.task.eval_size = 32
  config.rollout.max_new_tokens = 12
  config.rollout.prompts_per_step = 2
  config.rollout.group_size = 4
  config.rollout.train_length_buckets = (8,)
  config.warm_start.steps = 4
  config.warm_start.batch_size = 8
  config.warm_start.length_window = 2
  config.rl.steps = 2
  config.eval.every = 2
  config.eval.batch_size = 32
  summary = train_launcher.run(config)
  assert summary["steps"] == 6 and summary["nonfinite_updates"] == 0
  assert set(summary["accuracy_by_size"]) == {"2", "3"}
  assert sum(row["examples"] for row in summary["accuracy_by_size"].values()) == 32
  lengths = summary["rollout_completion_length"]
  assert lengths["rows"] == 2 * 8 and 1 <= lengths["median"] <= lengths["max"] <= 12
  assert set(summary["time_s"]) == {"warm_start", "rollout", "train", "eval"}
  assert 0 < sum(summary["time_s"].values()) < summary["wall_time_s"]
