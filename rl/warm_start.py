"""Starting a run's RL phase from another run's warm start (config.warm_start.init_from):
which settings decide what a warm start trains, and the check that a source run's match.
It reads runs' resolved configs as their config.json files hold them (plain JSON)."""

from __future__ import annotations

import json
import os

from rl.settings.dataset import DatasetSettings

# The config fields that decide what a warm start trains: a run may start its RL phase from
# another run's warm start (config.warm_start.init_from) only when these agree
# (task.train_pool excepted: the warm start reads the unbounded train split whatever it is;
# model.remat too: it trades memory for compute and trains the same policy).
WARM_START_FIELDS = ("seed", "task", "model", "warm_start", "rollout.prompt_len",
                     "rollout.max_new_tokens", "rollout.train_length_buckets",
                     "rl.max_grad_norm", "rl.num_microbatches", "tools.name")
# Fields of WARM_START_FIELDS added after runs were made: a config.json without one was
# trained with its default.
_ADDED_WARM_START_DEFAULTS = {"model.compute_dtype": "", "tools.name": "",
                              "task.difficulty.tool_share": 0.0,
                              **{f"task.{field}": default for field, default
                                 in DatasetSettings.defaults().items()}}


def _flat(value, prefix: str) -> dict:
  """{dotted path: leaf} of a JSON value (nested dicts flattened, lists kept whole)."""
  if not isinstance(value, dict):
    return {prefix: value}
  return {path: leaf for key, sub in value.items()
          for path, leaf in _flat(sub, f"{prefix}.{key}").items()}


def warm_start_settings(config_json: dict) -> dict:
  """The `WARM_START_FIELDS` of a resolved config (as config.json holds it), flattened;
  warm_start.init_from is where a warm start came from, not how it was trained."""
  settings = {}
  for path in WARM_START_FIELDS:
    node = config_json
    for name in path.split("."):
      node = node.get(name) if isinstance(node, dict) else None
    settings.update(_flat(node, path))
  settings.pop("warm_start.init_from", None)
  settings.pop("task.train_pool", None)  # RL's finite prompt pool; the warm start ignores it
  settings.pop("model.remat", None)  # what the backward keeps, not what is trained
  for path, default in _ADDED_WARM_START_DEFAULTS.items():
    settings.setdefault(path, default)
  return settings


def check_source(source: str, steps: int, config_json: dict) -> None:
  """Raises ValueError unless `source` (config.warm_start.init_from) is the workdir of a run
  whose warm start finished with the `WARM_START_FIELDS` of this run (`config_json`, its
  resolved config as config.json holds it; `steps`, its warm_start.steps): seed, task,
  model and tokenizer, warm-start schedule, sequence lengths. Any other warm start would not
  be this run's."""
  make_one = (f"train it with this run's flags and --config.rl.steps=0 "
              f"--config.workdir={source}")
  if not steps:
    raise ValueError(f"config.warm_start.init_from = {source!r} with config.warm_start.steps "
                     "= 0: there is no warm start to take. Leave init_from empty, or set "
                     "warm_start.steps to the source run's.")
  config_path = os.path.join(source, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"config.warm_start.init_from = {source!r} holds no config.json (not a "
                     f"run's workdir); {make_one}.")
  with open(config_path) as f:
    theirs = warm_start_settings(json.load(f))
  mine = warm_start_settings(config_json)
  for path in sorted(set(mine) | set(theirs)):
    if mine.get(path) != theirs.get(path):
      raise ValueError(
          f"config.warm_start.init_from = {source!r} was trained with config.{path} = "
          f"{theirs.get(path)!r}; this run has {mine.get(path)!r}, so that warm start is not "
          f"this run's. Set config.{path} to match, or {make_one}.")
