"""sampling/__init__.py's public surface names real objects; rl/ imports nothing heavy that a
module does not need."""

import os
import subprocess
import sys

import sampling


def test_every_public_name_resolves():
  assert sampling.__all__ == sorted(sampling.__all__) and sampling.__all__
  for name in sampling.__all__:
    assert getattr(sampling, name) is not None, name


def test_importing_one_module_does_not_import_the_heavy_ones():
  """The scoring worker imports rl.scoring alone; the rl package imports nothing, so
  reasoning-gym, orbax and tensorstore stay out of it (a fresh interpreter, so earlier imports do not count)."""
  code = ("import sys, rl.scoring; print(sorted(m for m in ('reasoning_gym', 'orbax', "
          "'tensorstore', 'rl.loop') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.stdout.strip() == "[]"
