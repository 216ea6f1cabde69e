"""Tasks: prompts with reference answers and a scorer for each completion.

`make_task(name, prompt_style, seed=..., eval_size=..., **difficulty)` builds any task in
the `TASKS` registry (config.task.name):

- `running_sum` (`rl.tasks.running_sum`): Arbor's testbed, a procedural, exactly
  verifiable task where RL from a warm start measurably helps;
- `gsm_symbolic` (`rl.tasks.gsm`): GSM8K-style word problems scored on the final answer
  of a chain of thought (`rl.tasks.math_answer`);
- `dataset` (`rl.tasks.dataset`): problems from a local JSONL or Parquet file (GSM8K,
  MATH-500, your own), scored as gsm_symbolic is (docs/datasets.md);
- reasoning-gym datasets (`rl.tasks.gym`): chain_sum, basic_arithmetic, leg_counting, countdown (scored
  by `rl.tasks.countdown`'s safe verifier), and any other dataset `register_task` adds.

Every task has the interface `rl.tasks.base.Task`; its scorer runs in `rl.scoring`'s
isolated, time-bounded worker. docs/add_task.md shows how to add one.
"""

from rl.tasks import gsm  # registers gsm_symbolic
from rl.tasks import running_sum  # registers running_sum
from rl.tasks.base import (PROMPT_STYLES, TASKS, Example, Task, default_prompt_style, make_task,
                           task_names)
from rl.tasks.gym import ReasoningGymTask, parse_completion, register_task

TASK_NAMES = task_names()  # the built-in tasks that build from their defaults alone

# pylint: disable=wrong-import-position
from rl.tasks import dataset  # registers dataset: built in, but it needs a file (config.task.path)

__all__ = ["PROMPT_STYLES", "TASKS", "TASK_NAMES", "Example", "ReasoningGymTask", "Task",
           "default_prompt_style", "make_task", "parse_completion", "register_task",
           "task_names"]
