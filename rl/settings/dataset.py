"""The config.task fields of the dataset task (a local JSONL or Parquet file of problems).

The task is rl/tasks/dataset.py; this module imports none of the tasks, so the default
config and the launcher's `--help` stay light.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rl.settings import Settings, setting

NAME = "dataset"  # config.task.name of the dataset task
DEFAULT_TEMPLATE = "{question} {instruction}"


@dataclasses.dataclass(frozen=True)
class DatasetSettings(Settings):
  """The config.task fields only the dataset task reads (docs/datasets.md). Another task
  refuses any of them changed from its default (it would be accepted and ignored)."""
  SECTION = "task"
  path: str = setting("", "JSON Lines (one object per line) or Parquet file of rows")
  eval_path: str = setting("", "held-out rows' file (\"\" = hold out eval_size rows of path: "
                           "those whose prompt has the smallest SHA-256)")
  prompt_field: str = setting("question", "the rows' field holding the question text")
  answer_field: str = setting("answer", "the rows' field holding the reference answer: a "
                              "GSM8K solution ending \"#### 42\", a \\boxed{} solution, a "
                              "number or a LaTeX answer")
  instruction: Optional[str] = setting(None, "{instruction} in the template (unset: "
                                       "rl/tasks/gsm.py DEFAULT_INSTRUCTION; \"\" = none)",
                                       optional=True)
  template: str = setting(DEFAULT_TEMPLATE, "the prompt ({question}: the prompt field's "
                          "text), spaces stripped")

  def builder_arguments(self, task_name: str, difficulty: dict) -> dict:
    """The task builder's keyword arguments besides the difficulty: these fields for the
    dataset task, none for another (which refuses them changed). Raises ValueError for a
    dataset field set for another task, and for the dataset task with difficulty fields
    (it has none)."""
    defaults = self.defaults()
    if task_name != NAME:
      for field, default in defaults.items():
        if getattr(self, field) != default:
          raise ValueError(
              f"config.task.{field} = {getattr(self, field)!r} is a setting of the dataset "
              f"task; config.task.name = {task_name!r} never reads it. Set "
              f"config.task.name='dataset' to train on a file, or leave config.task.{field} "
              f"at its default {default!r}.")
      return {}
    if difficulty:
      raise ValueError(
          f"config.task.difficulty = {difficulty} holds another task's settings (the default "
          "config's are running_sum's); the dataset task has none: its settings are "
          "config.task.path, eval_path, prompt_field, answer_field, instruction and template. "
          "Pass --config.task.difficulty={} with --config.task.name=dataset, or start from a "
          "config whose task is the dataset (experiments/configs/qwen2_5_gsm8k.py).")
    return {field: getattr(self, field) for field in defaults}
