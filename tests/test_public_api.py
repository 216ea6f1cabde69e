"""The packages' public surfaces (rl/__init__.py, sampling/__init__.py) name real objects."""

import importlib

import pytest

import rl
import sampling


@pytest.mark.parametrize("package", [rl, sampling], ids=["rl", "sampling"])
def test_every_public_name_resolves(package):
  assert package.__all__ == sorted(package.__all__) and package.__all__
  for name in package.__all__:
    assert getattr(package, name) is not None, name


def test_rl_names_come_from_their_modules_and_unknown_names_are_refused():
  assert rl.get_loss is importlib.import_module("rl.losses").get_loss
  assert rl.Rollout is importlib.import_module("rl.types").Rollout
  with pytest.raises(AttributeError, match="public names"):
    getattr(rl, "no_such_name")
