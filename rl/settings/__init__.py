"""Typed settings: what an extension point reads, its defaults written once, checked.

A settings class is a frozen dataclass of `Settings` whose fields are declared with
`setting(default, doc, ...)`: the default, one line of documentation and the field's range
or choices. `rl.wiring` reads a run's ml_collections config into these classes once
(`from_config`) and builds each piece from them; nothing below the wiring reads the config.
experiments/configs/default.py takes a section's defaults from its class (`defaults`) and
`python -m experiments.config_reference` documents the section from the fields' docs, so a
new setting is one field, in one place.

The run's sections are this package's modules: `model`, `rollout` (with its tree and
speculative subsections), `loss`, `distill`, `selection`, `tools` and `dataset` (the dataset
task's config.task fields). They import nothing above rl/settings/ (what needs a registry,
the names and how the sections compose, is `rl.composition.check`), so the launcher, which
loads the default config while defining its --config flag, answers --help and refuses a bad
flag in about a second. A settings class
for an extension of your own (docs/add_objective.md) lives wherever its code does:

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Clip(Settings):
...   SECTION = "loss"
...   eps: float = setting(0.2, "PPO clip width", low=0.0)
>>> Clip.from_config({"eps": 0.3, "unrelated": 1}).eps
0.3
>>> Clip(eps=-1.0).check()
Traceback (most recent call last):
...
ValueError: config.loss.eps = -1.0 must be >= 0.0.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, ClassVar, Mapping, Sequence

from ml_collections import config_dict

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class UsedWhen:
  """When a field (or a nested section) is read: while sibling field `field` is one of
  `values` (e.g. rollout.tree while rollout.kind == 'tree'), or, with no values, while it
  is set (non-zero, non-empty: tools.max_turns while tools.name is). `predicate`
  (settings -> bool) replaces that test where the rule is richer, and `condition` then
  says it in words. `Settings.check` refuses a field that differs from its default while
  it is not read: a setting accepted and then ignored would silently change what a run
  means."""
  field: str
  values: tuple = ()
  predicate: Callable[[Any], bool] | None = None
  condition: str = ""

  def holds(self, settings: "Settings") -> bool:
    if self.predicate is not None:
      return bool(self.predicate(settings))
    value = getattr(settings, self.field)
    return value in self.values if self.values else bool(value)

  def describe(self, settings: "Settings") -> str:
    """The condition in words, with config paths."""
    if self.condition:
      return self.condition
    path = settings.path(self.field)
    if not self.values:
      return f"{path} is set"
    return " or ".join(f"{path} = {v!r}" for v in self.values)


def used_when(field: str, *values: Any, predicate: Callable[[Any], bool] | None = None,
              condition: str = "") -> UsedWhen:
  """A `UsedWhen` for `setting(..., used_when=...)` and `nested(..., used_when=...)`."""
  return UsedWhen(field, tuple(values), predicate, condition)


def setting(default: Any, doc: str, *, low: float | None = None, high: float | None = None,
            low_open: bool = False,
            choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
            optional: bool = False, used_when: UsedWhen | None = None) -> Any:
  """A settings field.

  Args:
    default: its value when the config does not set it (None only with `optional`).
    doc: what it does, as docs/configuration.md shows it.
    low, high: its range (numbers); `low_open` excludes `low` itself.
    choices: the values it may take, or a function returning them when the field is
      checked (for choices defined in a module that imports JAX: the settings modules
      import none, so the default config and the launcher's --help stay light).
    optional: None is allowed (unset: the piece decides, e.g. an objective's own value).
    used_when: when the field is read (`UsedWhen`); a value other than the default is
      refused while it is not.

  Returns:
    A `dataclasses.field` carrying these in its metadata.
  """
  return dataclasses.field(default=default, metadata=dict(
      doc=doc, low=low, high=high, low_open=low_open,
      choices=choices if choices is None or callable(choices) else tuple(choices),
      optional=optional, used_when=used_when))


def nested(cls: type, doc: str, *, used_when: UsedWhen | None = None) -> Any:
  """A field holding another settings class (a config subsection, e.g. selection.greso),
  at that class's defaults; `used_when` as in `setting` (for the whole section)."""
  return dataclasses.field(default=cls(), metadata=dict(doc=doc, nested=True,
                                                        used_when=used_when))


def as_tuple(value):
  """A list as a tuple (a command-line flag gives a tuple field as a list), anything else
  as it is: so that config values compare and hash alike however they were given."""
  return tuple(value) if isinstance(value, list) else value


def _is_nested(f: dataclasses.Field) -> bool:
  return f.metadata.get("nested", False)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Base of the typed settings (module docstring). `SECTION` is the config section the
  class reads ("loss", "rollout.tree"), used in messages and docs."""
  SECTION: ClassVar[str] = ""

  @classmethod
  def from_config(cls, node: Mapping[str, Any], **extra: Any) -> "Settings":
    """The settings from a config section (a ConfigDict or dict): each field the section
    sets, else its default; lists become tuples; `extra` sets fields the section does not
    hold. Unknown keys of the section are left to other readers."""
    values = {}
    for f in dataclasses.fields(cls):
      if f.name in extra:
        values[f.name] = extra[f.name]
      elif f.name in node:
        value = node[f.name]
        values[f.name] = (type(f.default).from_config(value) if _is_nested(f)
                          else as_tuple(value))
    return cls(**values)

  @classmethod
  def defaults(cls) -> dict[str, Any]:
    """{field: default} of the fields with one (the config section's starting values)."""
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}

  @classmethod
  def config_section(cls) -> config_dict.ConfigDict:
    """The config section of these settings at their defaults, as
    experiments/configs/default.py holds it: an optional field unset (None) is a typed
    placeholder, so a command-line value still parses to its type."""
    hints = typing.get_type_hints(cls)
    section = config_dict.ConfigDict()
    for name, value in cls.defaults().items():
      if isinstance(value, Settings):
        value = type(value).config_section()
      elif value is None:
        kinds = [t for t in typing.get_args(hints[name]) if t is not type(None)]
        value = config_dict.placeholder(kinds[0])
      section[name] = value
    return section

  @classmethod
  def docs(cls) -> list[tuple[str, Any, str]]:
    """(field, default, doc) of each documented field, in declaration order; a nested
    section's fields follow as (section.field, ...)."""
    rows = []
    for f in dataclasses.fields(cls):
      if _is_nested(f):
        rows += [(f"{f.name}.{name}", default, doc) for name, default, doc in f.default.docs()]
      elif "doc" in f.metadata:
        rows.append((f.name, f.default, f.metadata["doc"]))
    return rows

  def path(self, name: str) -> str:
    """The dotted config path of field `name`: config.<SECTION>.<name>."""
    return f"config.{self.SECTION}.{name}" if self.SECTION else f"config.{name}"

  def check(self) -> None:
    """Raises ValueError naming the first field out of its range or choices, or set while
    it is not read (`UsedWhen`); a nested section is checked whole (its own `check`).
    Subclasses add their own checks after calling this one."""
    self._check_fields(lambda section: section.check())
    self.check_unread()

  def check_ranges(self) -> None:
    """Raises ValueError naming the first field, or field of a nested section, out of its
    range or choices: what a component given its settings directly checks (a `Turns` given
    its environment object has no use for the environment's name, the train step's
    resolved loss settings set fields the objective may not read)."""
    self._check_fields(lambda section: section.check_ranges())

  def _check_fields(self, check_section: Callable[["Settings"], None]) -> None:
    """Checks each field's range and choices in declaration order, and each nested section
    with `check_section`."""
    for f in dataclasses.fields(self):
      if _is_nested(f):
        check_section(getattr(self, f.name))
        continue
      if "doc" not in f.metadata:
        continue
      value, meta = getattr(self, f.name), f.metadata
      if value is None and meta["optional"]:
        continue
      choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
      if choices is not None and value not in choices:
        raise ValueError(f"{self.path(f.name)} = {value!r}; use one of "
                         f"{', '.join(repr(c) for c in choices)}.")
      if meta["low"] is None and meta["high"] is None:
        continue
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{self.path(f.name)} = {value!r} must be a number.")
      low, high = meta["low"], meta["high"]
      below = low is not None and (value < low or (meta["low_open"] and value == low))
      if below or (high is not None and value > high):
        bound = " and ".join(
            ([f"> {low}" if meta["low_open"] else f">= {low}"] if low is not None else [])
            + ([f"<= {high}"] if high is not None else []))
        raise ValueError(f"{self.path(f.name)} = {value} must be {bound}.")

  def check_unread(self) -> None:
    """Raises ValueError for a field, or a field of a nested section, that differs from its
    default while its `used_when` does not hold: it names the field, the setting that
    selects it and the fix."""
    for f in dataclasses.fields(self):
      when = f.metadata.get("used_when")
      if when is None or when.holds(self) or f.default is dataclasses.MISSING:
        continue
      value = getattr(self, f.name)
      if _is_nested(f):
        changed = [(name, default, getattr(value, name)) for name, default
                   in f.default.defaults().items()
                   if as_tuple(getattr(value, name)) != as_tuple(default)]
        if not changed:
          continue
        name, default, value = changed[0]
        path = f"{self.path(f.name)}.{name}"
      elif as_tuple(value) == as_tuple(f.default):
        continue
      else:
        path, default = self.path(f.name), f.default
      now = getattr(self, when.field)
      raise ValueError(
          f"{path} = {value!r} has no effect with {self.path(when.field)} = {now!r}: it is "
          f"read only when {when.describe(self)}. Set that, or leave {path} at its default "
          f"{default!r}.")
