"""The benchmark scripts run end to end in smoke mode (tiny shapes, one repetition, no peers)
so they cannot rot; their timings are not checked here (docs/benchmarks.md: timed claims are
benchmarks, not tests)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import peers

_REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module, outputs", [
    ("bench_sampler", ("bench_sampler.json", "bench_sampler.md", "bench_sampler.png")),
    ("bench_train", ("bench_train.json", "bench_train.md", "bench_train.png")),
])
def test_benchmark_smoke_run_writes_its_results(module, outputs, tmp_path):
  env = dict(os.environ, CI="1", PYTHONPATH=str(_REPO))  # CI: the peers are skipped
  subprocess.run([sys.executable, "-m", f"experiments.{module}", "--smoke", f"--out={tmp_path}"],
                 cwd=_REPO, env=env, check=True, timeout=900)
  for name in outputs:
    assert (tmp_path / name).stat().st_size > 0
  result = json.loads((tmp_path / outputs[0]).read_text())
  assert result["frameworks"] == ["arbor"]
  assert result["matmul_peak_flops"] > 0


def test_peers_are_skipped_under_ci_and_unknown_peers_rejected(monkeypatch):
  monkeypatch.delenv("CI", raising=False)
  assert peers.peers_enabled(["tunix", "torch"]) == ["tunix", "torch"]
  monkeypatch.setenv("CI", "1")
  assert peers.peers_enabled(["tunix"]) == []
  with pytest.raises(ValueError, match="Unknown peers"):
    peers.peers_enabled(["vllm"])
