"""The packages' public surfaces (rl/__init__.py, sampling/__init__.py) name real objects."""

import importlib
import os
import subprocess
import sys

import pytest

import rl
import sampling


@pytest.mark.parametrize("package", [rl, sampling], ids=["rl", "sampling"])
def test_every_public_name_resolves(package):
  assert package.__all__ == sorted(package.__all__) and package.__all__
  for name in package.__all__:
    assert getattr(package, name) is not None, name


def test_rl_names_come_from_their_modules_and_unknown_names_are_refused():
  assert rl.get_loss is importlib.import_module("rl.objectives.losses").get_loss
  assert rl.Rollout is importlib.import_module("rl.types").Rollout
  with pytest.raises(AttributeError, match="public names"):
    getattr(rl, "no_such_name")


def test_importing_one_module_does_not_import_the_heavy_ones():
  """The scoring worker imports rl.scoring alone; the lazy surface keeps reasoning-gym,
  orbax and tensorstore out of it (a fresh interpreter, so earlier imports do not count)."""
  code = ("import sys, rl.scoring; print(sorted(m for m in ('reasoning_gym', 'orbax', "
          "'tensorstore', 'rl.loop') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.stdout.strip() == "[]"
