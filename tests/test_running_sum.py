"""The running_sum testbed task: generator, teacher, verifier, splits and length tail."""

import re

import numpy as np
import pytest

from experiments import train as train_launcher
from rl.tasks import running_sum
from rl.tasks.running_sum import Problem
from rl.tasks import make_task
from tests.launcher_config import default_run_config


def test_hand_cases():
  problem = Problem(start=37, step=5, steps=4)
  assert problem.total == 57
  assert running_sum.question(problem) == "+5,4:37"
  assert running_sum.question(Problem(12345678, 1, 9)) == "+1,9:12345678"
  # The solution restates the initial state, then writes the state after each addition.
  assert running_sum.worked_solution(problem) == ",4:37,3:42,2:47,1:52,0:57"
  # 37+5 carries: a slip writes 32 and the teacher goes on from what it wrote.
  assert running_sum.worked_solution(problem, [True, False, False, False]) == (
      ",4:37,3:32,2:37,1:42,0:47")
  # A slip only acts where the units wrap: 42+5 does not carry, 47+5 does.
  assert running_sum.worked_solution(problem, [False, True, True, False]) == (
      ",4:37,3:42,2:47,1:42,0:47")
  assert running_sum.worked_solution(Problem(98, 1, 3)) == ",3:98,2:99,1:100,0:101"
  assert running_sum.worked_solution(Problem(98, 1, 3), [False, True, True]) == (
      ",3:98,2:99,1:90,0:91")


@pytest.mark.parametrize("completion, expected", [
    (",3:42,2:47,1:52,0:57", 57), ("57", 57), (" ,1:52,0:57\nmore", 57),
    (",0:57<|im_end|>", 57), (",0: 0057", 57), ("", None), (",1:52,0:", None),
    (",0:5x", None), (",0:-57", None), (",0:5.7", None), (",0:" + "9" * 13, None),
    ("9" * 10**6, None), ("__import__('os')", None), (",0:\u0661\u0662", None),
])
def test_parse_final_answer(completion, expected):
  assert running_sum.parse_final_answer(completion) == expected


@pytest.mark.parametrize("completion, expected", [
    (",4:37,3:42,2:47,1:52,0:57", 4), (",4:37,3:42,2:47,1:52,0:58", 3),
    (",4:37,3:42,2:37,1:52,0:57", 1), (",4:37,3:42,2:47", 2), (",4:37,3:42,2:47\n,1:52,0:57", 2),
    (",4:37,3:423,2:47", 0), (",4:37,3:42,2:47,", 2), (" ,4:37,3:42x", 0), ("", 0), ("57", 0),
    (",4:37,3:42,3:42,2:47", 1), (",4:37" + ",3:42" * 10**5, 1), (",4:37", 0),
    # Without the restated initial state nothing counts, even true states after it.
    (",3:42,2:47,1:52,0:57", 0), (",4:36,3:42,2:47,1:52,0:57", 0),
])
def test_correct_leading_states(completion, expected):
  assert running_sum.correct_leading_states(completion, Problem(37, 5, 4)) == expected


def test_state_credit_rewards_leading_true_states_and_never_reaches_one():
  plain = make_task("running_sum", eval_size=10)
  shaped = make_task("running_sum", eval_size=10, state_credit=0.5)
  example = next(e for e in shaped.examples("train", 50) if e.size == 4)
  states = re.findall(r",\d:\d+", example.entry["solution"])
  assert len(states) == 5  # the initial state, then four additions
  wrong_last = "".join(states[:4]) + ",0:1"
  for completion, credit in [("".join(states), 1.0), (wrong_last, 0.5 * 3 / 4),
                             ("".join(states[:2]) + ",9:9", 0.5 / 4),
                             ("".join(states[1:4]) + ",0:1", 0.0), ("junk" * 100, 0.0)]:
    assert shaped.reward(completion, example) == pytest.approx(credit)
    assert shaped.exact_match(completion, example) == (credit == 1.0)
    assert plain.reward(completion, example) == float(credit == 1.0)
  with pytest.raises(ValueError, match="state_credit"):
    make_task("running_sum", state_credit=1.0)


def _brute_force_totals(problem, slips):
  """Independent teacher: the written totals, from explicit units/tens digit arithmetic."""
  written, totals = problem.start, []
  for slip in slips:
    units_sum = written % 10 + problem.step
    carry = 0 if slip else units_sum // 10
    written = (written // 10 + carry) * 10 + units_sum % 10
    totals.append(written)
  return totals


def _states(solution):
  """[(count, total)] of a worked solution's additions (the restated initial state
  dropped), parsed independently of the task's parser."""
  states = [(int(count), int(total)) for count, total in re.findall(r",(\d):(\d+)", solution)]
  return states[1:]


def test_generator_and_verifier_against_brute_force():
  task = make_task("running_sum", seed=3, eval_size=50)
  low, high = running_sum.Difficulty().start_range
  assert (low, high) == (1_000_000, 9_999_954)
  for example in task.examples("train", 400):
    problem = example.entry["problem"]
    assert example.size == problem.steps and 1 <= problem.steps <= 9
    assert low <= problem.start <= high and problem.step == 5  # the default: count by fives
    assert example.prompt == running_sum.question(problem)
    assert example.entry["total"] == problem.start + sum([problem.step] * problem.steps)
    states = _states(example.entry["solution"])
    assert states == [(problem.steps - j, problem.start + problem.step * j)
                      for j in range(1, problem.steps + 1)]
    assert all(len(str(total)) == 7 for _, total in states)  # fixed width
    initial = f",{problem.steps}:{problem.start}"
    assert example.entry["solution"] == initial + "".join(f",{c}:{t}" for c, t in states)
    assert example.answer.startswith(initial)
    assert task.reward(example.entry["solution"], example) == 1.0
    teacher = [total for _, total in _states(example.answer)]
    steps_taken = np.diff([problem.start] + teacher)
    slips = list(steps_taken != problem.step)  # where the teacher deviated
    assert set(steps_taken[slips]) <= {problem.step - 10}
    assert teacher == _brute_force_totals(problem, slips)
    assert task.reward(example.answer, example) == float(teacher[-1] == problem.total)
    assert task.reward(example.entry["solution"] + "1", example) == 0.0
    assert task.exact_match(example.entry["solution"], example)


def test_teacher_slips_at_the_configured_rate():
  task = make_task("running_sum", eval_size=10, teacher_carry_slip=0.6, step=9)
  carries = slips = 0
  for example in task.examples("train", 1400):
    problem = example.entry["problem"]
    written = problem.start
    for _, total in _states(example.answer):
      if written % 10 + problem.step >= 10:
        carries += 1
        slips += total == written + problem.step - 10
      written = total
  assert carries > 3000
  assert abs(slips / carries - 0.6) < 0.03
  perfect = make_task("running_sum", eval_size=10, teacher_carry_slip=0.0)
  assert all(e.answer == e.entry["solution"] for e in perfect.examples("train", 200))


def test_teacher_slip_rate_is_linear_in_the_units_digit():
  """teacher_carry_slip=(first, last): at step 5 the carrying units digits are 5..9, with
  slip rates 0.2, 0.35, 0.5, 0.65, 0.8 (hand-computed), counted over 1400 demonstrations
  (over 300 carries per digit, so 0.08 is about 3 standard errors)."""
  task = make_task("running_sum", eval_size=10, teacher_carry_slip=(0.2, 0.8), step=5)
  carries, slips = np.zeros(10), np.zeros(10)
  for example in task.examples("train", 1400):
    problem = example.entry["problem"]
    written = problem.start
    for _, total in _states(example.answer):
      units = written % 10
      if units + problem.step >= 10:
        carries[units] += 1
        slips[units] += total == written + problem.step - 10
      else:
        assert total == written + problem.step
      written = total
  assert carries[:5].sum() == 0 and carries[5:].min() > 300
  np.testing.assert_allclose(slips[5:] / carries[5:], [0.2, 0.35, 0.5, 0.65, 0.8], atol=0.08)
  difficulty = running_sum.Difficulty(step=3, teacher_carry_slip=(0.5, 0.9))
  assert [difficulty.carry_slip(u) for u in range(10)] == pytest.approx([0.0] * 7 + [0.5, 0.7, 0.9])
  assert running_sum.Difficulty(step=1, teacher_carry_slip=(0.4, 0.9)).carry_slip(9) == 0.4


def test_examples_are_index_addressable_and_deterministic():
  task = make_task("running_sum", seed=1, eval_size=20)
  again = make_task("running_sum", seed=1, eval_size=20)
  assert task.examples("train", 5, 10) == task.examples("train", 15)[10:]
  assert task.examples("train", 8, 3) == again.examples("train", 8, 3)
  assert task.examples("eval", 20) == again.examples("eval", 20)
  assert task.examples("train", 8) != make_task("running_sum", seed=2).examples("train", 8)


def test_splits_are_disjoint_even_when_questions_are_few():
  # Two-digit totals, one step of 1: the 89 starts 10..98 are all the questions there are,
  # and an eval set of 60 draws covers about half of them.
  few = dict(min_steps=1, max_steps=1, digits=2, step=1)
  task = make_task("running_sum", eval_size=60, **few)
  eval_questions = {e.prompt for e in task.examples("eval", 60)}
  train = task.examples("train", 500)
  assert not eval_questions & {e.prompt for e in train}
  assert all(e.size == 1 for e in train)
  with pytest.raises(ValueError, match="collided with the eval set"):
    make_task("running_sum", eval_size=2000, **few).examples("train", 50)


def test_size_law_is_zipf_with_the_tail_folded_into_the_largest_size():
  sizes, probs = running_sum.Difficulty(length_tail=2.0).size_probabilities()
  assert list(sizes) == list(range(1, 10))
  # zeta(2) = pi^2 / 6: P(k) = k^-2 / zeta(2) below 9, and P(9) = the rest of the law.
  np.testing.assert_allclose(probs[:-1], sizes[:-1] ** -2.0 / (np.pi ** 2 / 6), rtol=1e-9)
  np.testing.assert_allclose(probs[-1], 1 - (sizes[:-1] ** -2.0).sum() / (np.pi ** 2 / 6),
                             rtol=1e-9)
  assert running_sum.zipf_tail(9, 1.7) == pytest.approx(
      sum(j ** -1.7 for j in range(9, 2_000_000)) + 2_000_000 ** -0.7 / 0.7, rel=1e-9)
  sizes, probs = running_sum.Difficulty(min_steps=3, max_steps=5).size_probabilities()
  assert list(sizes) == [3, 4, 5] and probs.sum() == pytest.approx(1)


def test_default_length_distribution_has_a_long_tail():
  """The default config's bars: median >= 16 tokens, p95 >= 4 x median, max >= 96
  (completion tokens of the correct worked solution, EOS included). One-step problems
  (21 tokens) are well over half, so a run's ~1000 rollout prompts keep the median at 21."""
  from experiments.configs import default  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  task = make_task("running_sum", eval_size=500, **config.task.difficulty)
  for split, n in (("train", 4000), ("eval", 500)):
    lengths = np.array([len(e.entry["solution"]) + 1 for e in task.examples(split, n)])
    median = np.median(lengths)
    assert np.mean(lengths == 21) > 0.53, split
    assert median >= 16, split
    assert np.percentile(lengths, 95) >= 4 * median, split
    assert lengths.max() >= 96, split


def test_bad_difficulty_and_splits_are_named():
  for settings, message in [
      (dict(max_digits=3), "no difficulty field"), (dict(min_steps=5, max_steps=3), "min_steps"),
      (dict(max_steps=10), "max_steps"), (dict(step=10), "step=10"), (dict(digits=1), "digits=1"),
      (dict(length_tail=1.0), "length_tail"), (dict(teacher_carry_slip=1.5), "teacher_carry_slip"),
      (dict(teacher_carry_slip=(0.5, 0.6, 0.7)), "teacher_carry_slip"),
      (dict(prompt_style="verbose"), "prompt_style")]:
    with pytest.raises(ValueError, match=message):
      make_task("running_sum", **settings)
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


@pytest.mark.slow
def test_default_config_runs_through_the_launcher(tmp_path):
  """The default config (the running_sum testbed), shrunk: the launcher trains on it and
  reports per-size accuracy and rollout lengths in summary.json."""
  summary = train_launcher.run(default_run_config(tmp_path / "run", {
      "task.difficulty.min_steps": 2, "task.difficulty.max_steps": 3,
      "task.difficulty.digits": 3, "task.eval_size": 32,
      # Four 6-token states (the restatement, three additions).
      "rollout.max_new_tokens": 25, "rollout.prompts_per_step": 2, "rollout.group_size": 4,
      "rollout.train_length_buckets": (8,), "warm_start.steps": 4, "warm_start.batch_size": 8,
      "warm_start.length_window": 2, "rl.steps": 2, "eval.every": 2, "eval.batch_size": 32}))
  assert summary["steps"] == 6 and summary["nonfinite_updates"] == 0
  assert set(summary["accuracy_by_size"]) == {"2", "3"}
  assert sum(row["examples"] for row in summary["accuracy_by_size"].values()) == 32
  lengths = summary["rollout_completion_length"]
  assert lengths["rows"] == 2 * 8 and 1 <= lengths["median"] <= lengths["max"] <= 25
  assert set(summary["time_s"]) == {"warm_start", "rollout", "train", "eval"}
  assert 0 < sum(summary["time_s"].values()) < summary["wall_time_s"]


@pytest.mark.slow
def test_short_run_improves_held_out_accuracy(tmp_path):
  """The testbed's mechanism end to end on small problems (two-digit totals, one or two
  additions): the warm start copies the teacher (greedy forgets every carry, so only the
  problems without one are right), and GRPO then learns to carry."""
  summary = train_launcher.run(default_run_config(tmp_path / "run", {
      "task.difficulty.max_steps": 2, "task.difficulty.digits": 2,
      "task.difficulty.teacher_carry_slip": (0.6, 0.6),  # one carry context, as measured
      "task.eval_size": 128, "rollout.prompt_len": 8, "rollout.max_new_tokens": 16,
      "rollout.train_length_buckets": (), "rollout.prompts_per_step": 16,
      "warm_start.steps": 300, "warm_start.length_window": 1, "rl.steps": 30,
      "rl.warmup_steps": 10, "eval.every": 30, "eval.batch_size": 128}))
  assert summary["warm_start_accuracy"] <= 0.75
  assert summary["final_accuracy"] >= summary["warm_start_accuracy"] + 0.15
