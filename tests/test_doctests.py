"""The examples in the extension points' docstrings and in docs/add_*.md run as written
(`python -m pytest --doctest-modules` on the modules, `--doctest-glob='*.md'` on the
pages), so a reader can paste them."""

import doctest
import os

import pytest

from rl import registry
from rl import settings
from rl import stages
from rl.environments import base as environments
from rl.objectives import advantages
from rl.objectives import corrections
from rl.objectives import losses
from rl.rollouts import kinds
from rl.rollouts import selection
from rl.settings import loss as loss_settings
from rl.settings import rollout as rollout_settings
from rl.settings import run as run_settings
from rl.settings import selection as selection_settings
from rl.settings import stages as stage_settings
from rl.tasks import base as task_base
from sampling import speculative

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The settings base, the run's settings, and each extension point's base type with its
# settings: the registry, objectives, corrections, advantage estimators, rollout kinds,
# selection rules, environments, tasks, draft sources and batch stages.
MODULES = (settings, run_settings, registry, losses, loss_settings, corrections, advantages,
           kinds, rollout_settings, selection, selection_settings, environments, task_base,
           speculative, stages, stage_settings)
PAGES = ("docs/add_objective.md",)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_module_examples_run(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page):
  result = doctest.testfile(os.path.join(ROOT, page), module_relative=False,
                            optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
