"""Named, pluggable pieces, all registered and looked up the same way.

Every piece a config field names is an entry of a `Registry`: objectives
(`rl.objectives.losses.LOSSES`, config.loss.name), corrections (`CORRECTIONS`,
config.loss.corrections), advantage estimators (`ADVANTAGES`, `TREE_ADVANTAGES`), tasks
(`rl.tasks.TASKS`), rollout kinds (`rl.rollouts.kinds.ROLLOUT_KINDS`), tree fork policies
and prompt-selection rules. A registry refuses a name registered twice and answers an
unknown name with a ValueError naming the config field and every known name, so a typo
fails before any work:

>>> SHAPES = Registry("shape", "config.shape.name")
>>> @SHAPES.register("square")
... def square(side):
...   return side * side
>>> SHAPES.get("square")(3)
9
>>> SHAPES.names()
('square',)
>>> SHAPES.get("circle")
Traceback (most recent call last):
...
ValueError: Unknown shape 'circle' (config.shape.name); known: square.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar, overload

T = TypeVar("T")


class Registry(Generic[T]):
  """Entries of one kind by name. `kind` names the kind in messages ("loss"); `field` is
  the config field that selects an entry ("config.loss.name"); `how_to_add`, if given,
  ends the unknown-name message ("docs/add_objective.md adds one")."""

  def __init__(self, kind: str, field: str, how_to_add: str = ""):
    self.kind = kind
    self.field = field
    self.how_to_add = how_to_add
    self._entries: dict[str, T] = {}

  @overload
  def register(self, name: str) -> Callable[[T], T]: ...

  @overload
  def register(self, name: str, entry: T) -> T: ...

  def register(self, name, entry=None):
    """Adds `entry` under `name` and returns it; without `entry`, a decorator that does.
    A name registered twice is a ValueError (a second definition would silently win)."""
    if entry is None:
      return lambda decorated: self.register(name, decorated)
    if not isinstance(name, str) or not name:
      raise ValueError(f"A {self.kind} needs a non-empty string name, got {name!r}.")
    if name in self._entries:
      raise ValueError(f"{self.kind.capitalize()} {name!r} is already registered "
                       f"({self.field}); pick another name.")
    self._entries[name] = entry
    return entry

  def unregister(self, name: str) -> None:
    """Removes `name` if it is registered: a test's temporary entry, or a notebook cell that
    registers again when it is re-run."""
    self._entries.pop(name, None)

  def get(self, name: str) -> T:
    """The entry `name`, or a ValueError naming the config field and the known names."""
    if name not in self._entries:
      hint = f" ({self.how_to_add})" if self.how_to_add else ""
      raise ValueError(f"Unknown {self.kind} {name!r} ({self.field}); known: "
                       f"{', '.join(self.names())}{hint}.")
    return self._entries[name]

  def names(self) -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(self._entries))

  def items(self) -> list[tuple[str, T]]:
    """(name, entry) pairs, sorted by name."""
    return [(name, self._entries[name]) for name in self.names()]

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    return iter(self.names())

  def __len__(self) -> int:
    return len(self._entries)
