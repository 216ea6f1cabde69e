"""The launchers' `--config` flag: ml_collections' config-file flag, with a clear error for an
override of a field the config does not have.

ml_collections answers `--config.rl.stepz=5` with a bare `AttributeError: "'stepz'"` (a
traceback at import when the default config file is used). This flag reports it as a flag
error that names the whole override and lists the fields that do exist at that level:

    FATAL Flags parsing error: --config.rl.stepz: config.rl has no field 'stepz'; valid
    fields: async_, learning_rate, ...

A config *file* may still add fields (a custom objective's settings, say); only
command-line overrides must name existing ones, as ml_collections requires.
"""

from __future__ import annotations

import os
import sys
from typing import Collection, NoReturn

from absl import app
from absl import flags
from ml_collections import config_dict
from ml_collections.config_flags import config_flags as ml_config_flags


def unknown_field(config: config_dict.ConfigDict, path: str) -> str | None:
  """A message naming the first part of the dotted `path` that `config` lacks, with the
  valid fields at that level; None when every part exists."""
  node, parents = config, []
  for name in path.split("."):
    if not isinstance(node, config_dict.ConfigDict):
      return None  # inside a tuple or other value: ml_collections' own message applies
    if name not in node:
      where = ".".join(["config"] + parents)
      return (f"--config.{path}: {where} has no field {name!r}; valid fields: "
              f"{', '.join(sorted(node.keys()))}.")
    node, parents = node[name], parents + [name]
  return None


class _ConfigFileFlag(ml_config_flags._ConfigFlag):  # pylint: disable=protected-access
  """ml_collections' `_ConfigFlag`, turning an unknown override into a flag error."""

  error: flags.IllegalFlagValueError | None = None

  def _parse(self, argument):
    try:
      return super()._parse(argument)
    except (AttributeError, KeyError) as error:
      config = self.parser.parse(argument)  # the file's config, before any override
      for path in self._GetOverrides(self._GetArgv()):
        message = unknown_field(config, path)
        if message:
          raise flags.IllegalFlagValueError(message) from error
      raise

  def _set_default(self, default):
    # Without --config on the command line, ml_collections parses the default file and the
    # overrides here, while the flag is being defined (at import); keep the error for
    # `parse_flags` to report when absl parses the command line, instead of failing the
    # import.
    try:
      super()._set_default(default)
    except flags.IllegalFlagValueError as error:
      self.error, self.default, self.default_as_str = error, None, repr(default)


def define_config_file(name: str, default: str, help_string: str) -> flags.FlagHolder:
  """Like `ml_collections.config_flags.DEFINE_config_file` (a locked ConfigDict from a
  Python file, fields overridable as --name.field=value), with clear unknown-field errors."""
  flag = _ConfigFileFlag(parser=ml_config_flags.ConfigFileFlagParser(name=name, lock_config=True),
                         serializer=flags.ArgumentSerializer(), name=name, default=default,
                         help_string=help_string, flag_values=flags.FLAGS)
  _DEFINED.append(name)
  return flags.DEFINE_flag(flag, flags.FLAGS)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`), first reporting an
  unknown override found while a config flag was defined, the way absl reports flag
  errors (message on stderr, exit status 1)."""
  for name in _DEFINED:
    error = flags.FLAGS[name].error
    if error is not None:
      sys.stderr.write(f"FATAL Flags parsing error: {error}\n"
                       "Pass --helpshort or --helpfull to see help on flags.\n")
      sys.exit(1)
  return app.parse_flags_with_usage(argv)


_DEFINED: list[str] = []


class InputError(ValueError):
  """A config or an input a launcher refuses before it does any work (the settings check,
  the task's files, the resume check): its message names the field or file and the fix."""


TRACEBACK_ENV = "ARBOR_TRACEBACK"  # set to 1 for a refused input's whole traceback


def exit_on_input_error(error: InputError) -> NoReturn:
  """Prints `error: <message>` on stderr and exits with status 2, or, with the
  environment variable ARBOR_TRACEBACK=1, re-raises it with its traceback."""
  if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
    raise error
  sys.stderr.write(f"error: {error}\n")
  sys.exit(2)


DEFAULT_RUN_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.py")


def task_defaults(config: config_dict.ConfigDict, overrides: Collection[str],
                  file_task: str) -> config_dict.ConfigDict:
  """`config` with the task's own fields at that task's defaults when the command line
  switched config.task.name away from the config file's task (`file_task`): the file's
  task.difficulty belongs to the file's task (the default config's are running_sum's carry
  settings), so only the difficulty fields the command line sets (`overrides`, dotted
  paths) are kept, and task.prompt_style, unless set there, becomes the new task's own
  (`rl.tasks.default_prompt_style`). A field of another task set on the command line is
  still refused, by the task that does not know it.

  >>> from experiments.configs import default
  >>> c = task_defaults(default.get_config().copy_and_resolve_references(), (), "running_sum")
  >>> c.task.name = "dataset"
  >>> c = task_defaults(c, ["task.name"], "running_sum")
  >>> dict(c.task.difficulty), c.task.prompt_style
  ({}, 'full')
  """
  if config.task.name == file_task:
    return config
  from rl import tasks  # pylint: disable=import-outside-toplevel
  config = config_dict.ConfigDict(config.to_dict())
  if "task.difficulty" not in overrides:
    given = {path.split(".", 2)[2] for path in overrides if path.startswith("task.difficulty.")}
    config.task.difficulty = config_dict.ConfigDict(
        {key: value for key, value in config.task.difficulty.items() if key in given})
  if "task.prompt_style" not in overrides and config.task.name in tasks.task_names():
    config.task.prompt_style = tasks.default_prompt_style(config.task.name)
  return config


def resolved(holder: flags.FlagHolder) -> config_dict.ConfigDict:
  """The run config of the command line: the `--config` flag's value, with `task_defaults`
  applied for the overrides the command line gave."""
  flag = flags.FLAGS[holder.name]
  overrides = flag._GetOverrides(flag._GetArgv())  # pylint: disable=protected-access
  file_task = flag.parser.parse(flag.config_filename).task.name
  return task_defaults(holder.value, overrides, file_task)


def run_config() -> flags.FlagHolder:
  """The `--config` flag of a run (default: experiments/configs/default.py), defined once
  per process: the launcher and experiments/eval.py read the same run configuration, and a
  process (a test, a notebook) may import both."""
  if "config" not in flags.FLAGS:
    return define_config_file("config", DEFAULT_RUN_CONFIG, "Run configuration file.")
  return flags.FlagHolder(flags.FLAGS, flags.FLAGS["config"])

