"""The reward stage (rl/rewards.py) and PURE's process advantages: each against a hand
computation or a slow reference, then each path through the launcher, then its refusals.

A mutant these tests were run against (on a scratch copy, never committed): PURE's min-form
credit as the minimum over the steps so far instead of the steps ahead (`cummin` without
`reverse`) fails test_pure_credit_equals_the_hand_computation_with_padded_rows and
test_pure_credit_equals_a_slow_reference_on_long_random_batches[min].
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import train as launcher
from models.tokenizer import CharTokenizer
from rl import rewards
from rl import verdicts
from rl.objectives import advantages
from rl.samples import ScoredRow
from rl.tasks import make_task
from rl.tasks import math_answer
from rl.tasks.running_sum import Problem, step_rewards, worked_solution
from rl.verdicts import Verdict
from tests.launcher_config import refusal, rl_steps, tiny_run_config, tiny_running_sum_config


# --- PURE's process advantages ---


def test_pure_credit_equals_the_hand_computation_with_padded_rows():
  """Row 0: steps ending at 1, 3, 5 with +1, -1, +1 and a pass; row 1: steps at 2, 4 (+1,
  +1), a failure, its last slot padding; row 2 (another group, alone): no step, a failure.
  Hand computation (module docstring of pure_advantages):
  min-form: o = (-1, 1), per-step o/m = (-1/3, 1/2), baselines (1/2, -1/3); verifier
    v = (0, -1) centred to (1, -1); row 0 tokens 0-1: -1 - 3/2 + 1 = -1.5, 2-3: -1 - 1 + 1
    = -1, 4-5: 1 - 1/2 + 1 = 1.5; row 1 tokens 0-2: 1 + 2/3 - 1, 3-4: 1 + 1/3 - 1, 5: pad.
  sum-form: r/m = (1/3, -1/3, 1/3), (1/2, 1/2); o = (1/3, 1); per-step (1/9, 1/2).
  Row 2: a group of one has no baseline and no step: 0 everywhere."""
  value = np.zeros((3, 6), np.float32)
  mask = np.zeros((3, 6), bool)
  value[0, [1, 3, 5]], mask[0, [1, 3, 5]] = [1, -1, 1], True
  value[1, [2, 4]], mask[1, [2, 4]] = [1, 1], True
  completion = np.ones((3, 6), bool)
  completion[1, 5] = False
  reward, group = np.array([1.0, 0.0, 0.0]), np.array([0, 0, 1])
  args = [jnp.asarray(x) for x in (value, mask, reward, group, completion)]
  third = 1 / 3
  expected_min = [[-1.5, -1.5, -1, -1, 1.5, 1.5],
                  [2 * third, 2 * third, 2 * third, third, third, 0], [0] * 6]
  expected_sum = [[third - 1.5 + 1] * 2 + [0 - 1 + 1] * 2 + [third - 0.5 + 1] * 2,
                  [1 - 2 / 9 - 1] * 3 + [0.5 - 1 / 9 - 1] * 2 + [0], [0] * 6]
  np.testing.assert_allclose(advantages.pure_advantages(*args, form="min"), expected_min,
                             atol=1e-6)
  np.testing.assert_allclose(advantages.pure_advantages(*args, form="sum"), expected_sum,
                             atol=1e-6)
  # The verifier term alone moves every token of a row by its centred outcome.
  without = advantages.pure_advantages(*args, form="min", verifier_coef=0.0)
  np.testing.assert_allclose(np.asarray(expected_min)[0] - np.asarray(without)[0], 1.0,
                             atol=1e-6)


def _slow_pure(value, mask, reward, group, completion, form, coef):
  """PURE's returns row by row, token by token, in float64."""
  batch, length = value.shape
  steps = [[(t, float(value[i, t])) for t in range(length) if mask[i, t] and completion[i, t]]
           for i in range(batch)]

  def transformed(row):
    r = [x for _, x in row]
    if form == "min":
      mins = [min(r[j:]) for j in range(len(r))] + [0.0]
      return [mins[j] - mins[j + 1] for j in range(len(r))]
    return [x / len(r) for x in r]

  per_step = [sum(transformed(s)) / len(s) if s else 0.0 for s in steps]
  verifier = [r - 1.0 for r in reward]
  out = np.zeros((batch, length))
  for i in range(batch):
    others = [k for k in range(batch) if group[k] == group[i] and k != i]
    base = np.mean([per_step[k] for k in others]) if others else 0.0
    v = verifier[i] - np.mean([verifier[k] for k in others]) if others else 0.0
    shaped = [(t, x - base) for (t, _), x in zip(steps[i], transformed(steps[i]))]
    for t in range(length):
      if completion[i, t]:
        out[i, t] = sum(x for p, x in shaped if p >= t) + coef * v
  return out


@pytest.mark.parametrize("form", ["min", "sum"])
def test_pure_credit_equals_a_slow_reference_on_long_random_batches(form):
  """3000 slots, groups of 1-5, rows without steps, fractional rewards, padding."""
  rng = np.random.default_rng(7)
  batch, length = 12, 3000
  completion = np.arange(length)[None, :] < rng.integers(0, length, batch)[:, None]
  mask = (rng.random((batch, length)) < 0.02) & completion
  mask[3] = False
  value = np.where(mask, rng.uniform(-1, 1, (batch, length)), 0.0).astype(np.float32)
  reward = rng.choice([0.0, 0.5, 1.0], batch)
  group = np.array([0, 0, 0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
  got = advantages.pure_advantages(*(jnp.asarray(x) for x in (
      value, mask, reward, group, completion)), form=form, verifier_coef=0.7)
  np.testing.assert_allclose(got, _slow_pure(value, mask, reward, group, completion, form, 0.7),
                             atol=2e-4)


# --- running_sum's exact step rewards ---


def test_running_sum_step_rewards_judge_each_state_from_the_one_it_reads():
  problem = Problem(37, 5, 3)
  assert step_rewards(worked_solution(problem), problem) == [
      (5, 1.0), (10, 1.0), (15, 1.0), (20, 1.0)]
  # A forgotten carry is one wrong step; the next step, right from what was written, is +1.
  assert [r for _, r in step_rewards(",3:37,2:42,1:37,0:42", problem)] == [1, 1, -1, 1]
  # Junk, a state past count 0, a wrong restatement, an adder call naming another total.
  assert [r for _, r in step_rewards(",3:37,2:x,1:47", problem)] == [1, -1, -1]
  assert [r for _, r in step_rewards(" ,3:37,2:42,1:47,0:52,9:1", problem)][-1] == -1
  assert step_rewards(" ,3:37,2:42", problem)[0] == (6, 1.0)  # offsets count the whitespace
  assert [r for _, r in step_rewards(",3:38,2:43", problem)] == [-1, 1]
  assert [r for _, r in step_rewards(",3:37,2:?+5=42,1:?42+5=47,0:?40+5=52", problem)] == [
      1, 1, 1, -1]
  assert step_rewards("", problem) == [] and step_rewards("52", problem) == []


def test_teacher_slips_are_exactly_the_wrong_steps():
  """Over 300 teacher demonstrations, the -1 steps are the states where the teacher forgot
  a carry (its written total is 10 below the true running total of what it read)."""
  task = make_task("running_sum", seed=3, eval_size=10)
  for example in task.examples("train", 300):
    problem = example.entry["problem"]
    rewards_ = [r for _, r in step_rewards(example.answer, problem)]
    states = [int(s.split(":")[1]) for s in example.answer.split(",")[1:]]
    slips = [1 + j for j in range(problem.steps) if states[j + 1] != states[j] + problem.step]
    assert [j for j, r in enumerate(rewards_) if r < 0] == slips


def test_step_rewards_land_on_each_steps_last_token():
  task = make_task("running_sum", seed=0, eval_size=4, min_steps=2, max_steps=2)
  example = task.examples("eval", 1)[0]
  tokenizer = CharTokenizer()
  text = example.entry["solution"]
  ids = tokenizer.encode(text) + [tokenizer.eos_id]
  tokens = np.zeros((2, 4 + len(ids)), np.int32)
  tokens[0, 4:] = ids
  completion = np.zeros(tokens.shape, bool)
  completion[0, 4:] = True
  rows = [ScoredRow(example.prompt, text, Verdict(verdicts.CORRECT), example), None]
  steps = rewards.step_rewards(task, rows, tokenizer, tokens, completion)
  ends = [4 + i for i, c in enumerate(text) if i + 1 == len(text) or text[i + 1] == ","]
  assert np.flatnonzero(np.asarray(steps.mask)[0]).tolist() == ends
  assert np.asarray(steps.value)[0, ends].tolist() == [1.0, 1.0, 1.0]
  assert not np.asarray(steps.mask)[1].any()


# --- The noisy verifier and its second opinion ---


def _rows(count, correct_share=0.5, seed=0):
  rng = np.random.default_rng(seed)
  correct = rng.random(count) < correct_share
  rows = [ScoredRow(f"p{i % 50}", f"completion {i}",
                    Verdict(verdicts.CORRECT if c else verdicts.WRONG_VALUE))
          for i, c in enumerate(correct)]
  return rows, correct.astype(np.float32)


@pytest.mark.parametrize("false_negative,false_positive", [(0.2, 0.0), (0.4, 0.1), (0.0, 0.3)])
def test_injected_noise_meets_its_rates_within_sampling_error(false_negative, false_positive):
  rows, true = _rows(8000)
  noisy, counts = rewards.inject_noise(true, rows, false_negative=false_negative,
                                       false_positive=false_positive, seed=1)
  correct, wrong = true == 1.0, true == 0.0
  for rate, flipped, n in ((false_negative, (noisy == 0) & correct, correct.sum()),
                           (false_positive, (noisy == 1) & wrong, wrong.sum())):
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(flipped.sum() / n - rate) <= 4 * sigma + 1e-12
  assert counts["verifier_false_negatives"] == ((noisy == 0) & correct).sum()
  assert counts["verifier_false_positives"] == ((noisy == 1) & wrong).sum()
  # One draw per (seed, prompt, completion): the same batch gets the same verdicts; another
  # seed others.
  again, _ = rewards.inject_noise(true, rows, false_negative=false_negative,
                                  false_positive=false_positive, seed=1)
  other, _ = rewards.inject_noise(true, rows, false_negative=false_negative,
                                  false_positive=false_positive, seed=2)
  assert (again == noisy).all() and (other != noisy).any()


def test_second_opinion_rescues_every_false_negative_and_counts_its_calls():
  task = make_task("running_sum", seed=0, eval_size=40)
  examples = task.examples("eval", 40)
  completions = [e.entry["solution"] if i % 2 else e.answer for i, e in enumerate(examples)]
  rows = [ScoredRow(e.prompt, c, task.verdict(c, e), e) for e, c in zip(examples, completions)]
  true = np.array([task.reward(c, e) for e, c in zip(examples, completions)], np.float32)
  noisy, counts = rewards.inject_noise(true, rows, false_negative=0.5, false_positive=0.0,
                                       seed=0)
  assert counts["verifier_false_negatives"] > 0
  checked, opinion = rewards.second_opinion(rewards.SecondOpinion(task), noisy, rows)
  np.testing.assert_array_equal(checked, true)
  assert opinion["second_opinion_calls"] == (noisy < 1).sum()
  assert opinion["second_opinion_passes"] == counts["verifier_false_negatives"]
  assert opinion["second_opinion_timeouts"] == 0 and opinion["second_opinion_s"] > 0


def test_gsm_second_opinion_reads_what_the_rule_misses():
  """math-verify's own extraction finds an inline LaTeX answer where the rule scorer takes
  the last number."""
  completion = "Half of the 6 cakes is $\\frac{3}{1}$, so the answer is it, out of 8 trays."
  assert not math_answer.equivalent(math_answer.extract_answer(completion), "3")
  assert math_answer.verified_anywhere(completion, "3")
  assert not math_answer.verified_anywhere("It is 3/1 of 8", "3")


# --- TTRL's majority vote ---


def _slow_majority(ballots):
  """The most frequent non-None ballot, earliest among the tied."""
  best, best_count = None, 0
  for b in ballots:
    if b is None:
      continue
    count = sum(x == b for x in ballots)
    if count > best_count:
      best, best_count = b, count
  return best


def test_majority_vote_equals_a_slow_reference():
  rng = np.random.default_rng(0)
  categories = [verdicts.CORRECT, verdicts.WRONG_VALUE, verdicts.NO_ANSWER, verdicts.MALFORMED]
  for trial in range(200):
    size = int(rng.integers(1, 9))
    group = np.repeat(np.arange(3), size)
    rows = []
    for g in group:
      answer = str(rng.integers(0, 3))
      category = categories[rng.integers(0, 4)]
      right = category == verdicts.CORRECT
      rows.append(ScoredRow(f"q{g}", "", Verdict(category, answer if category in (
          verdicts.CORRECT, verdicts.WRONG_VALUE, verdicts.MALFORMED) else None,
          "0" if right else "9")))
    result = rewards.vote(rows, group)
    for g in range(3):
      members = np.flatnonzero(group == g)
      ballots = [rows[i].verdict.answer if rows[i].verdict.category in rewards.VOTING else None
                 for i in members]
      winner = _slow_majority(ballots)
      assert result.answers[g] == winner, trial
      assert [result.rewards[i] for i in members] == [
          float(winner is not None and b == winner) for b in ballots]
      assert result.right[g] == any(b == winner and rows[i].verdict.category == verdicts.CORRECT
                                    for b, i in zip(ballots, members) if winner is not None)


def test_votes_compare_numerals_by_value():
  assert rewards.normalised_answer("1,234") == rewards.normalised_answer("1234.0")
  assert rewards.majority(["1,234", "7", "1234", None, None]) == "1,234"


def test_flip_counter_follows_each_prompt_between_visits():
  memory = rewards.VoteMemory.empty()
  seen = []
  for prompts, right in ((["a", "b"], [True, False]), (["a", "b"], [False, False]),
                         (["a", "c"], [True, True]), (["b"], [True])):
    memory, counts = rewards.remember(memory, prompts, np.array(right))
    seen.append(counts)
  assert [c["vote_revisited"] for c in seen] == [0, 2, 1, 1]
  assert [c["vote_flips_right_to_wrong"] for c in seen] == [0, 1, 0, 0]
  assert [c["vote_flips_wrong_to_right"] for c in seen] == [0, 0, 1, 1]


# --- Through the launcher ---


@pytest.mark.slow
def test_each_reward_path_through_the_launcher(tmp_path):
  """One run per path, each checked for its effect: a verifier that passes everything
  rewards every row 1 while the true reward stays the task's; the second opinion is called
  on every row the verifier failed; PURE adds step rewards and changes the loss of the same
  first batch; the vote's memory sees the pool's prompts again at step 2."""
  runs = {"grpo": {}, "fp": {"reward.false_positive": 1.0},
          "second": {"reward.false_negative": 0.5, "reward.second_opinion": True},
          "pure": {"advantage.name": "pure_min"},
          "ttrl": {"reward.kind": "majority_vote", "task.train_pool": 2}}
  for name, overrides in runs.items():
    launcher.run(tiny_running_sum_config(tmp_path / name, overrides))
  grpo, fp, second, pure, ttrl = (rl_steps(tmp_path / name) for name in runs)
  assert "trained_reward_mean" not in grpo[0]
  assert [s["trained_reward_mean"] for s in fp] == [1.0, 1.0]
  assert [s["reward_mean"] for s in fp] == [s["reward_mean"] for s in grpo]
  assert fp[0]["verifier_false_positives"] == fp[0]["verifier_wrong_rows"] > 0
  for step in second:
    failed = 8 - round(step["trained_reward_mean"] * 8) + step["second_opinion_passes"]
    assert step["second_opinion_calls"] == failed
  assert pure[0]["sampled_tokens"] == grpo[0]["sampled_tokens"]
  assert pure[0]["process_steps"] > 0 and pure[0]["loss"] != grpo[0]["loss"]
  assert [s["vote_revisited"] for s in ttrl] == [0, 2]
  assert all(0 <= s["vote_label_agreement"] <= 1 for s in ttrl)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["partial", "tree"])
def test_the_stage_wraps_every_rollout_kind(tmp_path, kind):
  """A verifier that passes every wrong completion: every scored row trains with reward 1,
  while the task's own reward (the truth) is unchanged."""
  launcher.run(tiny_running_sum_config(tmp_path / "plain", {"rollout.kind": kind}))
  launcher.run(tiny_running_sum_config(tmp_path / "fp", {"rollout.kind": kind,
                                                         "reward.false_positive": 1.0}))
  plain, fp = rl_steps(tmp_path / "plain"), rl_steps(tmp_path / "fp")
  assert [s["trained_reward_mean"] for s in fp] == [1.0, 1.0]
  assert [s["reward_mean"] for s in fp] == [s["reward_mean"] for s in plain]
  assert fp[0]["verifier_false_positives"] == fp[0]["verifier_wrong_rows"] > 0


@pytest.mark.parametrize("overrides,message", [
    ({"reward.kind": "majority_vote", "reward.false_negative": 0.2},
     r"false_negative = 0.2 injects verifier errors"),
    ({"reward.kind": "majority_vote", "reward.second_opinion": True}, r"has no verifier"),
    ({"reward.false_negative": 0.2, "selection.kind": "dynamic"},
     r"the reward stage \(config.reward\) changes the batch's reward after it is made, and "
     r"config.selection.kind = 'dynamic' reads the reward while making it"),
    ({"advantage.name": "pure_min", "rollout.kind": "tree"},
     r"config.advantage.name = 'pure_min' has no effect with config.rollout.kind = 'tree', "
     r"whose advantages are config.rollout.tree.advantage's"),
    ({"advantage.name": "pure_min", "selection.kind": "ar3po", "task.train_pool": 64},
     r"needs that every row was scored for this batch, and config.selection.kind = 'ar3po' "
     r"does not keep that"),
    ({"advantage.name": "pure_sum", "rollout.kind": "pruned", "rollout.group_size": 4,
      "rollout.pruning.candidates": 8},
     r"needs that rows are independent samples of their prompt, and config.rollout.kind = "
     r"'pruned' does not keep that"),
    ({"reward.kind": "majority_vote", "rollout.kind": "pruned", "rollout.group_size": 4,
      "rollout.pruning.candidates": 8},
     r"changes the batch's reward after it is made, and config.rollout.kind = 'pruned' reads "
     r"the reward while making it"),
    ({"advantage.name": "pure_mean"}, r"Unknown advantage estimator 'pure_mean'.*pure_min"),
    ({"advantage.verifier_coef": 0.5}, r"verifier_coef = 0.5 .* 'grpo' reads none"),
])
def test_reward_refusals(tmp_path, overrides, message):
  assert re.search(message, refusal(tiny_running_sum_config(tmp_path / "run", overrides)))


@pytest.mark.parametrize("overrides,message", [
    ({"advantage.name": "pure_sum"}, r"task 'chain_sum' has no step_rewards"),
    ({"reward.second_opinion": True}, r"task 'chain_sum' has no second_opinion"),
])
def test_a_task_without_what_the_stage_needs_is_refused(tmp_path, overrides, message):
  assert re.search(message, refusal(tiny_run_config(tmp_path / "run", overrides)))
