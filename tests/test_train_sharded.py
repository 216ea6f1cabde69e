"""The launcher on a data=2, fsdp=2, tensor=2 mesh of virtual CPU devices reproduces the
single-device run (same metrics within float tolerance, same greedy evaluations), with full
weights and with LoRA."""

import os

import jax
import numpy as np
import pytest

from experiments import train as launcher
from tests.launcher_config import records, tiny_run_config
from rl import wiring


def _config(workdir, data, fsdp, tensor, overrides=None):
  return tiny_run_config(workdir, {
      "task.eval_size": 8, "eval.batch_size": 8, "eval.every": 1, "warm_start.steps": 1,
      "rl.steps": 1, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
      **(overrides or {})})


# LoRA: the frozen base sharded like the weights, adapters replicated, the merged policy
# published to the sampler.
@pytest.mark.parametrize("overrides", [{}, {"lora.rank": 2}], ids=["full", "lora"])
@pytest.mark.slow
def test_sharded_run_matches_single_device_run(overrides, tmp_path):
  if jax.device_count() < 8:
    pytest.fail("Needs the 8 virtual CPU devices tests/conftest.py configures.")
  single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
  launcher.run(_config(single, 1, 1, 1, overrides))
  launcher.run(_config(sharded, 2, 2, 2, overrides))
  want, got = records(single), records(sharded)
  assert [(r["step"], r.get("event")) for r in got] == [(r["step"], r.get("event")) for r in want]
  for w, g in zip(want, got):
    assert g.keys() == w.keys()
    for key, value in w.items():
      if key.startswith("time_") or key.endswith("_per_s"):  # wall-clock seconds, rates
        continue
      if isinstance(value, float):
        np.testing.assert_allclose(g[key], value, rtol=0, atol=1e-5, err_msg=key)
      else:
        assert g[key] == value, key
  assert os.path.exists(os.path.join(sharded, "summary.json"))
  if overrides:  # the RL checkpoint restores into the sharded layout and training goes on
    longer = _config(sharded, 2, 2, 2, dict(overrides, **{"rl.steps": 2,
                                                          "resume.allow_changes": "rl.steps"}))
    assert launcher.run(longer)["steps"] == 3


def test_mesh_config_errors_name_the_fix(tmp_path):
  config = _config(str(tmp_path), 2, 2, 2)
  config.eval.batch_size = 6
  with pytest.raises(ValueError, match="config.eval.batch_size = 6 .* multiple of mesh.data"):
    wiring.build_mesh(wiring.settings(config))
  config = _config(str(tmp_path), 3, 1, 1)
  with pytest.raises(ValueError, match="needs 3 devices but 8"):
    wiring.build_mesh(wiring.settings(config))
