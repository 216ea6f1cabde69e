"""rl.tasks.register_task: a reasoning-gym dataset with a custom reward becomes a task."""

import math

import pytest

from rl import tasks


@pytest.fixture
def registered():
  names = []
  yield names
  for name in names:
    tasks.TASKS.unregister(name)


def lcm_spec(reward):
  return dict(key=lambda e: tuple(sorted(e["metadata"]["numbers"])),
              compact_prompt=lambda e: "lcm(" + ",".join(map(str, e["metadata"]["numbers"])) + ")=",
              compact_answer=lambda e: e["answer"], default_eval_size=10, reward=reward)


def test_custom_reward_replaces_the_dataset_scorer(registered):
  calls = []

  def reward(answer, entry):
    calls.append(answer)
    if answer == "boom":
      raise ZeroDivisionError
    if answer == "nan":
      return math.nan
    return 0.25 if answer == entry["answer"] else 0.0

  tasks.register_task("lcm", **lcm_spec(reward))
  registered.append("lcm")
  assert "lcm" in tasks.task_names() and "lcm" not in tasks.TASK_NAMES
  task = tasks.make_task("lcm", max_value=20)
  assert task.eval_size == 10
  example = task.examples("eval", 1)[0]
  assert example.prompt.startswith("lcm(") and example.prompt.endswith(")=")
  assert task.reward(f" {example.answer}\nmore", example) == 0.25  # parsed, then scored
  assert not task.exact_match(example.answer, example)            # 0.25 is not full credit
  # A raising reward raises here; the trainer scores through rl.scoring, which gives 0 to
  # a raising or non-finite reward and counts it (tests/test_scoring.py runs that path).
  with pytest.raises(ZeroDivisionError):
    task.reward("boom", example)
  assert math.isnan(task.reward("nan", example))
  assert calls == [example.answer, example.answer, "boom", "nan"]
  # Train questions stay disjoint from the held-out ones under the registered key.
  eval_keys = {tuple(sorted(e.entry["metadata"]["numbers"])) for e in task.examples("eval", 10)}
  assert not eval_keys & {tuple(sorted(e.entry["metadata"]["numbers"]))
                          for e in task.examples("train", 50)}


def test_register_task_rejects_duplicates_and_unknown_datasets():
  with pytest.raises(ValueError, match="already registered"):
    tasks.register_task("chain_sum", **lcm_spec(None))
  with pytest.raises(ValueError, match="not a reasoning-gym dataset"):
    tasks.register_task("no_such_dataset", **lcm_spec(None))
  with pytest.raises(ValueError, match="Unknown task .no_such_dataset.*docs/add_task.md"):
    tasks.make_task("no_such_dataset")
