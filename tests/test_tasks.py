"""Tests for rl.tasks: determinism, split disjointness, scoring."""

import math

import pytest

from models.tokenizer import CharTokenizer
from rl import tasks
from rl.tasks import gym


def _small_chain_sum(**kwargs):
  return tasks.make_task("chain_sum", min_terms=2, max_terms=3, min_digits=1, max_digits=2,
              **kwargs)


def test_compact_prompt_and_answer():
  task = _small_chain_sum()
  example = task.examples("train", 1)[0]
  expression = example.entry["metadata"]["expression"]
  assert example.prompt == expression.replace(" ", "") + "="
  assert example.answer == example.entry["answer"]
  assert " " not in example.prompt


def test_full_prompt_is_the_question():
  task = _small_chain_sum(prompt_style="full")
  example = task.examples("eval", 1)[0]
  assert example.prompt == example.entry["question"]


def test_examples_are_a_pure_function_of_split_start_n():
  a = _small_chain_sum().examples("train", 50, start=100)
  b = _small_chain_sum().examples("train", 50, start=100)
  assert a == b
  # A cursor resumes exactly where a longer read would have been.
  task = _small_chain_sum()
  whole = task.examples("train", 30, start=0)
  assert task.examples("train", 10, start=0) + task.examples("train", 20, start=10) == whole
  assert task.examples("eval", 5, start=3) == task.examples("eval", 10)[3:8]
  # The seed changes the stream.
  assert _small_chain_sum(seed=1).examples("train", 50) != _small_chain_sum().examples(
    "train", 50)


def test_splits_are_disjoint():
  task = tasks.make_task("chain_sum", eval_size=2000)
  eval_prompts = {e.prompt for e in task.examples("eval", 2000)}
  train_prompts = {e.prompt for e in task.examples("train", 20000)}
  assert not eval_prompts & train_prompts


def test_splits_are_disjoint_when_questions_repeat():
  # 1-digit, 2-term sums: only 200 distinct questions, so the seeds alone collide and
  # the train split must filter the eval questions out.
  task = tasks.make_task("chain_sum", eval_size=40, min_terms=2, max_terms=2,
              min_digits=1, max_digits=1)
  eval_prompts = {e.prompt for e in task.examples("eval", 40)}
  train_prompts = {e.prompt for e in task.examples("train", 2000)}
  assert not eval_prompts & train_prompts
  assert len(train_prompts) > 100


def test_eval_covering_all_questions_is_a_clear_error():
  task = tasks.make_task("chain_sum", eval_size=5000, min_terms=2, max_terms=2,
              min_digits=1, max_digits=1)
  with pytest.raises(ValueError, match="eval_size=5000"):
    task.examples("train", 1)


def test_eval_beyond_eval_size_is_an_error():
  task = _small_chain_sum(eval_size=10)
  with pytest.raises(ValueError, match="eval_size=10"):
    task.examples("eval", 5, start=8)
  with pytest.raises(ValueError, match="split"):
    task.examples("test", 1)


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic"])
def test_reference_answer_scores_one_and_wrong_answer_less(name):
  task = tasks.make_task(name, max_digits=2)
  for example in task.examples("train", 20):
    assert task.reward(example.answer, example) == 1.0
    assert task.exact_match(example.answer + "\nmore text", example)
    wrong = str(int(example.answer) + 1)
    assert task.reward(wrong, example) < 1.0
    assert not task.exact_match(wrong, example)


def test_partial_credit_for_sign_error():
  task = _small_chain_sum()
  # reasoning-gym credits len(reference) / len(completion) when the reference is inside.
  example = next(e for e in task.examples("train", 50) if 0 < int(e.answer) < 10)
  assert task.reward("-" + example.answer, example) == 0.5


def test_reward_is_never_nan():
  task = tasks.make_task("countdown", eval_size=2, min_numbers=3, max_numbers=3)
  example = task.examples("train", 1)[0]
  for completion in ["", "   ", "((((", "1/0", "nan", "inf", "a" * 500, "9" * 400]:
    reward = task.reward(completion, example)
    assert math.isfinite(reward) and 0.0 <= reward <= 1.0


def test_countdown_is_scorable():
  task = tasks.make_task("countdown", eval_size=3, min_numbers=3, max_numbers=4)
  example = task.examples("train", 1)[0]
  assert task.reward(example.answer, example) == 1.0
  assert task.reward("1+1", example) < 1.0
  full = tasks.make_task("countdown", prompt_style="full", eval_size=3, min_numbers=3,
              max_numbers=4).examples("train", 1)[0]
  assert full.prompt == full.entry["question"]
  assert full.entry == example.entry


@pytest.mark.parametrize("name", [n for n in tasks.TASK_NAMES if n != "gsm_symbolic"])
def test_compact_style_fits_the_char_tokenizer(name):  # gsm_symbolic: full prompts only
  tok = CharTokenizer()
  task = tasks.make_task(name, eval_size=2)
  for example in task.examples("train", 3) + task.examples("eval", 2):
    assert tok.decode(tok.encode(example.prompt + example.answer)) == (
      example.prompt + example.answer)


def test_unknown_task_lists_known_tasks():
  with pytest.raises(ValueError, match="chain_sum.*countdown|basic_arithmetic.*chain_sum"):
    tasks.make_task("sudoku_xl")


def test_unknown_difficulty_field_names_task_and_fields():
  with pytest.raises(ValueError, match=r"'chain_sum'.*max_term.*max_terms"):
    tasks.make_task("chain_sum", max_term=3)


def test_invalid_difficulty_value_is_a_value_error():
  with pytest.raises(ValueError, match="chain_sum"):
    tasks.make_task("chain_sum", min_terms=5, max_terms=2)


def test_unknown_prompt_style():
  with pytest.raises(ValueError, match="prompt_style"):
    tasks.make_task("chain_sum", prompt_style="verbose")


def test_parse_completion():
  assert tasks.parse_completion("  42 \nignored") == "42"
  assert tasks.parse_completion("\n7<|endoftext|>junk") == "7"


@pytest.mark.parametrize("name", ["chain_sum", "basic_arithmetic", "leg_counting"])
def test_reasoned_style_asks_for_a_boxed_answer_and_scores_the_whole_reply(name):
  task = tasks.make_task(name, prompt_style="reasoned", eval_size=4)
  full = tasks.make_task(name, prompt_style="full", eval_size=4)
  example = task.examples("train", 1, 3)[0]
  assert example.entry == full.examples("train", 1, 3)[0].entry  # the same problems
  assert example.prompt == f"{example.entry['question'].strip()} {gym.REASONED_INSTRUCTION}"
  gold = example.entry["answer"]
  assert example.answer == f"\\boxed{{{gold}}}"
  assert task.reward(example.answer, example) == 1.0
  # The whole reply counts: reasoning lines first, the box last; the first line alone
  # (what the `full` style scores) is not the answer.
  reply = f"First I add the numbers.\nSo the total is:\n\\boxed{{{gold}}}<|im_end|>"
  assert task.reward(reply, example) == 1.0 and task.exact_match(reply, example)
  assert full.reward(reply, full.examples("train", 1, 3)[0]) < 1.0
  assert task.reward(f"The answer is {gold}.", example) == 1.0  # last number, no box
  assert task.reward(f"\\boxed{{{int(gold) + 1}}}", example) == 0.0
  assert task.reward(f"\\boxed{{{gold}}}<|im_end|> later text 12345", example) == 1.0
  assert task.reward("no number at all", example) == 0.0


def test_reasoned_style_is_refused_where_the_answer_is_not_a_number():
  with pytest.raises(ValueError, match="countdown.*'full' or 'compact'"):
    tasks.make_task("countdown", prompt_style="reasoned", eval_size=2)


def test_leg_counting_splits_are_disjoint_by_the_animals():
  task = tasks.make_task("leg_counting", eval_size=50, min_animals=1, max_animals=2,
                         max_instances=3)
  held_out = {gym._animals_key(e.entry) for e in task.examples("eval", 50)}
  train = [gym._animals_key(e.entry) for e in task.examples("train", 200)]
  assert not held_out & set(train)
  example = task.examples("eval", 1)[0]
  animals = example.entry["metadata"]["animals"]
  assert example.prompt == ",".join(f"{n}{a}" for a, n in animals.items()) + "="
