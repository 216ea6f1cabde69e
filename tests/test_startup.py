"""Fast start-up: the launcher's `--help` does not load JAX, torch or the rest, and the
TensorBoard writer does not load torch (tensorboardX would, for torch tensors only).

Each check runs in a fresh interpreter, so modules this test process loaded do not count.
"""

import os
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEAVY = ("torch", "jax", "tensorboardX", "matplotlib", "orbax", "reasoning_gym",
          "transformers")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, *args, "-c", code] if code else
                        [sys.executable, *args], cwd=_REPO, env=env, capture_output=True,
                        text=True, timeout=300)


def _loaded(code: str) -> list[str]:
  """The heavy modules in sys.modules after running `code` in a fresh interpreter."""
  result = _python(code + f"\nimport sys\nprint([m for m in {_HEAVY!r} if m in sys.modules])")
  assert result.returncode == 0, result.stderr[-3000:]
  return eval(result.stdout.strip().splitlines()[-1])  # pylint: disable=eval-used


def test_importing_the_launcher_loads_no_heavy_library():
  assert _loaded("import experiments.train") == []


def test_the_settings_and_their_checks_load_no_heavy_library():
  """The typed settings (rl/settings/) build the default config and check it without JAX;
  the names and combinations, which need the registries, are rl.composition's (JAX)."""
  sections = ("dataset", "distill", "loss", "model", "rollout", "selection", "tools")
  imports = "".join(f"import rl.settings.{name}\n" for name in sections)
  assert _loaded(imports + "from experiments.configs import default\n"
                 "default.get_config()") == []
  assert _loaded("from rl.settings import run\nrun.RunSettings().check()") == []
  assert "jax" in _loaded("import rl.composition")


def test_tensorboard_writer_does_not_load_torch(tmp_path):
  code = (f"from experiments import metrics\n"
          f"writer = metrics.TensorBoardWriter({str(tmp_path)!r})\n"
          "writer.write_scalars(1, {'phase': 'rl', 'loss': 0.5})\n"
          "writer.write_text(1, 'config', 'text')\n"
          "writer.close()\n")
  assert _loaded(code) == ["tensorboardX"]
  assert list(tmp_path.glob("events.out.tfevents.*"))


def test_help_answers_within_a_generous_bound():
  """About 1 s on two loaded CPU cores (10 to 16 s when the launcher imported everything);
  the bound leaves room for a slower machine. Best of two runs."""
  seconds = []
  for _ in range(2):
    started = time.perf_counter()
    result = _python("", "-m", "experiments.train", "--help")
    seconds.append(time.perf_counter() - started)
    assert "--config" in result.stdout, result.stderr[-3000:]  # absl exits 1 after --help
  assert min(seconds) < 8.0, seconds
