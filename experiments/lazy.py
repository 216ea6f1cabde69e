"""Modules imported on first use, so a launcher's `--help` does not load JAX and the rest.

`module("rl.loop")` returns a stand-in that imports `rl.loop` the first time one of its
attributes is read and then forwards every read to it (the module in `sys.modules`, so a
monkeypatched attribute is seen). Nothing is put in `sys.modules`: the import system, and
every other importer of the module, see only the real one.
"""

from __future__ import annotations

import importlib
import sys
import types


class _LazyModule(types.ModuleType):
  """Stands for the module `__name__`; reading an attribute imports it."""

  def __getattr__(self, attribute: str):
    name = self.__name__
    loaded = sys.modules.get(name) or importlib.import_module(name)
    return getattr(loaded, attribute)


def module(name: str) -> types.ModuleType:
  """A stand-in for the module `name` (dotted) that imports it on first attribute read."""
  return _LazyModule(name)
