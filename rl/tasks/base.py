"""What every task is: the `Task` interface, its `Example`s, and the `TASKS` registry that
`make_task` (and config.task.name) builds from.

A task gives the loop deterministic train and held-out prompts and scores completions.
`examples(split, n, start)` is a pure function of its arguments, so a loop resumes from
one integer cursor; `reward` is in [0, 1] and runs in `rl.scoring`'s worker process under
a time limit (with `exact_match` and the optional `verdict`, which says why a completion
failed), so a task must pickle (define it at module level). docs/add_task.md walks through
adding one.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Protocol

from rl.registry import Registry

# compact: for the character tokenizer; full: the question verbatim; reasoned: the question and
# an instruction to reason, then box the answer, the whole reply scored (reasoning-gym tasks).
PROMPT_STYLES = ("compact", "full", "reasoned")


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str  # the text fed to the policy
  answer: str  # reference answer (used for the supervised warm start)
  entry: dict  # the task's own record of the question, passed back to its scorer
  size: int = 0  # problem size (e.g. number of terms) for per-size accuracy; 0 = unsized


class Task(Protocol):
  """The interface the loop, the scorer and evaluation use. Optional attributes:
  `reward_timeout_s` and `reward_limits` (rl.scoring's bounds for this task's scorer), and
  the method `verdict(completion, example) -> rl.verdicts.Verdict`: why a completion
  failed (no_answer, malformed, wrong_value; or correct), the answer the scorer read and
  the target, shown in samples and counted at every evaluation. Without it a failure is
  wrong_value and the target is `Example.answer` (docs/add_task.md). For the reward stage
  (rl/rewards.py, docs/rewards.md): `step_rewards(completion, example) -> [(offset, reward)]`
  (process rewards, per step: the character offset just past it) and
  `second_opinion(completion, example) -> bool` (a second verifier)."""
  name: str
  prompt_style: str
  seed: int
  eval_size: int
  difficulty: dict[str, Any]

  def examples(self, split: str, n: int, start: int = 0) -> list[Example]:
    """Positions start .. start + n - 1 of 'train' (unbounded) or 'eval' (eval_size)."""

  def reward(self, completion: str, example: Example) -> float:
    """The completion's score in [0, 1]."""

  def exact_match(self, completion: str, example: Example) -> bool:
    """Whether the completion is fully correct."""


# builder(prompt_style, seed, eval_size=None, **difficulty) -> Task, by config.task.name.
TASKS: Registry[Callable[..., Task]] = Registry(
    "task", "config.task.name", "rl.tasks.register_task or TASKS.register adds one: docs/add_task.md")


def make_task(name: str, prompt_style: str = "compact", *, seed: int = 0,
              eval_size: int | None = None, **difficulty) -> Task:
  """Builds the registered task `name`; `difficulty` kwargs are its own settings (a bad
  one is a ValueError naming it). `eval_size` defaults per task (1000 for reasoning-gym
  datasets, 100 for countdown, 500 for running_sum, 200 for gsm_symbolic).

  Args:
    name: a `TASKS` name (config.task.name).
    prompt_style: one of PROMPT_STYLES.
    seed: the seed of its data.
    eval_size: held-out items (None: the task's default).
    **difficulty: the task's own settings.

  Returns:
    The task.

  >>> task = make_task("running_sum", seed=0, eval_size=4, min_steps=1, max_steps=1)
  >>> example = task.examples("eval", 1)[0]
  >>> task.reward(example.answer, example), task.exact_match("", example)
  (1.0, False)
  """
  build = TASKS.get(name)
  sized = {} if eval_size is None else {"eval_size": eval_size}
  return build(prompt_style, seed, **sized, **difficulty)


def default_prompt_style(name: str) -> str:
  """The prompt style the registered task `name` builds with when given none (its
  builder's default: 'full' for tasks that need a pretrained tokenizer).

  >>> default_prompt_style("running_sum"), default_prompt_style("dataset")
  ('compact', 'full')
  """
  parameter = inspect.signature(TASKS.get(name)).parameters.get("prompt_style")
  if parameter is None or parameter.default is inspect.Parameter.empty:
    return "compact"
  return parameter.default


def task_names() -> tuple[str, ...]:
  """Names `make_task` accepts: the built-in tasks and those registered since."""
  return TASKS.names()
