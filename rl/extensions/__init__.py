"""Batch-level methods added as one module each: every module of this package is imported
here, and registers its batch stage (`rl.stages.register_stage`) with its settings
(config.stages.<name>). The launcher's wiring and the default config import this package,
so a new method is its module alone: the loop, its context, the wiring and the run's
settings do not change. docs/concepts.md, "Adding a batch stage", says how to write one.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
  importlib.import_module(f"{__name__}.{_module.name}")
