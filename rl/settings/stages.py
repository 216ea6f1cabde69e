"""config.stages: the settings of the batch stages a module adds (`rl.stages.register_stage`),
one subsection per stage, config.stages.<name>.

A batch-level method added as a module of rl/extensions/ registers its settings class here
by name, so that the default config holds its section and the run reads it without
importing the method's module; like every settings module this one imports nothing above
rl/settings/.

>>> import dataclasses
>>> from rl.settings import Settings, setting
>>> @dataclasses.dataclass(frozen=True)
... class Tagging(Settings):
...   SECTION = "stages.tagging"
...   enabled: bool = setting(False, "tag every batch")
>>> _ = STAGE_SETTINGS.register("tagging", Tagging)
>>> read(config_section())["tagging"]
Tagging(enabled=False)
>>> read({"tagging": {"enabled": True}})["tagging"].enabled
True
>>> STAGE_SETTINGS.unregister("tagging")
"""

from __future__ import annotations

from typing import Any, Mapping

from ml_collections import config_dict

from rl.registry import Registry
from rl.settings import Settings

# The settings class of each registered batch stage (a Settings whose SECTION is
# "stages.<name>"), by name.
STAGE_SETTINGS: Registry[type] = Registry(
    "batch stage", "config.stages", "rl.stages.register_stage adds one: docs/concepts.md")


def config_section() -> config_dict.ConfigDict:
  """config.stages at its defaults: each registered stage's section."""
  return config_dict.ConfigDict({name: cls.config_section()
                                 for name, cls in STAGE_SETTINGS.items()})


def docs() -> list[tuple[str, Any, str]]:
  """(name.field, default, doc) of every registered stage's fields, as `Settings.docs`."""
  return [(f"{name}.{field}", default, doc) for name, cls in STAGE_SETTINGS.items()
          for field, default, doc in cls.docs()]


def read(node: Mapping[str, Any] | None) -> dict[str, Settings]:
  """Every registered stage's settings from config.stages (a stage the config does not
  mention is at its defaults); a subsection no registered stage owns is refused."""
  node = dict(node or {})
  unknown = sorted(set(node) - set(STAGE_SETTINGS.names()))
  if unknown:
    raise ValueError(f"config.stages.{unknown[0]}: no batch stage of that name is registered; "
                     f"known: {', '.join(STAGE_SETTINGS.names()) or 'none'}.")
  return {name: cls.from_config(node.get(name) or {}) for name, cls in STAGE_SETTINGS.items()}
