"""The benchmark scripts run end to end in smoke mode (tiny shapes, one repetition, no peers)
so they cannot rot; their timings are not checked here (docs/benchmarks.md: timed claims are
benchmarks, not tests)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import decode_cost
from experiments import peers
from models.config import get_preset

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


def test_token_choice_benchmark_smoke_run_times_both_sides(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(_REPO))
  subprocess.run([sys.executable, "-m", "experiments.bench_logits", "--smoke", f"--out={tmp_path}"],
                 cwd=_REPO, env=env, check=True, timeout=300)
  for suffix in ("json", "md", "png"):
    assert (tmp_path / f"bench_logits.{suffix}").stat().st_size > 0
  cases = json.loads((tmp_path / "bench_logits.json").read_text())["cases"]
  assert [c["mode"] for c in cases] == ["greedy", "T = 1"]
  assert all(c["arbor_s"] > 0 and c["reference_s"] > 0 for c in cases)


def test_peers_are_skipped_under_ci_and_unknown_peers_rejected(monkeypatch):
  monkeypatch.delenv("CI", raising=False)
  assert peers.peers_enabled(["tunix", "torch"]) == ["tunix", "torch"]
  monkeypatch.setenv("CI", "1")
  assert peers.peers_enabled(["tunix"]) == []
  with pytest.raises(ValueError, match="Unknown peers"):
    peers.peers_enabled(["vllm"])


def test_kv_read_per_token_follows_the_phase_schedule():
  config = get_preset("b1")
  per_slot = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads, head_dim 64, f32
  assert decode_cost.kv_bytes_per_token(config) == per_slot
  # 256 new tokens after a 16-token prompt, 64-token phases: steps 0-63 attend over
  # 16 + 64 slots, 64-127 over 16 + 128, 128-255 over 16 + 256.
  mean_slots = (64 * 80 + 64 * 144 + 128 * 272) / 256
  assert decode_cost.kv_read_per_token(config, 16, 256) == per_slot * mean_slots
  assert decode_cost.kv_read_per_token(config, 16, 64) == per_slot * 80


def test_flat_cost_ratio_and_its_bandwidth_ceiling():
  case = lambda n, tps, kv, t=0.0: dict(batch=64, new_tokens=n, temperature=t,
                                         kv_read_per_token=kv, arbor=dict(tokens_per_s=tps))
  result = dict(stream_bandwidth=1e9, cases=[
      case(64, 1000.0, 1e5), case(1024, 250.0, 2e6), case(1024, 1.0, 2e6, t=1.0)])
  flat = decode_cost.flat_cost(result, 64)
  assert (flat["short"], flat["long"]) == (64, 1024)
  assert flat["measured"] == pytest.approx(0.25)  # greedy rows only
  # 1 ms per token plus (2e6 - 1e5) bytes at 1 GB/s = 1.9 ms: 1 / 2.9.
  assert flat["bandwidth_floor"] == pytest.approx(1 / 2.9)
  assert decode_cost.flat_cost(result, 16) is None


def test_peer_reports_its_own_peak_memory_not_its_parents():
  # A child's ru_maxrss starts at its parent's peak (Linux keeps it across fork + exec);
  # the peers' VmHWM is their own, far below this test process's.
  import resource  # pylint: disable=import-outside-toplevel
  parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  code = "import peer_memory; print(peer_memory.peak_rss_bytes())"
  own = int(subprocess.run([sys.executable, "-c", code], cwd=_REPO / "experiments" / "peers",
                           capture_output=True, text=True, check=True).stdout)
  assert 0 < 4 * own < parent
