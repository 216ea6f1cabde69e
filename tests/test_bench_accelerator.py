"""Benchmark B10 (experiments/bench_accelerator.py) in its smallest mode, on this host: every
section runs in its own process, records what it measured, and a failing or late section
leaves the others standing."""

import json
import os
import subprocess
import sys

import pytest

from experiments import decode_cost
from experiments import peers
from models.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(out, *flags, timeout=600) -> dict:
  done = subprocess.run([sys.executable, "-m", "experiments.bench_accelerator", "--smoke",
                         f"--out={out}", *flags], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(out, "bench_accelerator.json")) as f:
    return json.load(f)


def section(result: dict, name: str, model: str) -> dict:
  (found,) = [r for r in result["sections"] if r["section"] == name and r["model"] == model]
  return found


def test_flops_per_token_by_hand():
  config = ModelConfig(vocab_size=10, d_model=4, n_layers=2, n_heads=2, n_kv_heads=1,
                       head_dim=2, mlp_dim=5, max_seq_len=16)
  # Per layer: q, o, k, v projections 4 * (2 + 2 + 1 + 1) * 2 = 48 weights; MLP 3 * 4 * 5 =
  # 60; attention at context 6: 2 * 2 heads * 2 * 6 = 48 (scores and values); head 4 * 10.
  per_token_forward = 2 * (2 * (48 + 60 + 48) + 40)
  assert decode_cost.decode_flops_per_token(config, 6.0) == per_token_forward
  assert decode_cost.train_flops_per_token(config, 6.0) == 3 * per_token_forward


@pytest.mark.slow
def test_a_failing_model_leaves_the_other_sections_measured(tmp_path):
  result = run_bench(tmp_path, "--sections=sampler", "--models=b1,no_such_preset",
                     "--batch_sizes=2,4")
  assert section(result, "peak", "")["status"] == "ok"
  assert section(result, "peak", "")["cases"][0]["bf16_flops"] > 0
  good = section(result, "sampler", "b1")
  assert good["status"] == "ok"
  assert [c["batch"] for c in good["cases"]] == [2, 4]
  for case in good["cases"]:
    assert case["tokens_per_s"] == pytest.approx(case["batch"] * 8 / case["best_s"])
    assert 0 < case["mfu"] < 1
    # The planner's prediction holds at least the bfloat16 weights the program reads.
    assert case["predicted_peak_bytes"] > 1_500_000
    assert case["measured_peak_bytes"] is None  # the CPU backend keeps no such count
  bad = section(result, "sampler", "no_such_preset")
  assert bad["status"].startswith("failed") and "Unknown model preset 'no_such_preset'" in bad["status"]
  assert bad["cases"] == []
  with open(tmp_path / "bench_accelerator.md") as f:
    table = f.read()
  assert "| b1 | 4 |" in table and "| sampler | no_such_preset | failed" in table


def test_sections_that_would_start_too_late_are_skipped(tmp_path):
  result = run_bench(tmp_path, "--budget_s=5", "--min_section_s=10")
  assert [r["section"] for r in result["sections"]] == ["peak", "sampler", "train", "peer",
                                                        "speculative", "quantized"]
  assert all(r["status"].startswith("skipped: ") and r["cases"] == []
             for r in result["sections"])


@pytest.mark.slow
def test_every_section_in_the_smallest_mode(tmp_path):
  """The whole benchmark at tiny shapes; the transformers + TRL peer in its virtualenv
  (not under CI, where peers are off)."""
  flags = []
  if peers.peers_enabled(["torch"]):
    flags.append("--torch_python=" + peers.ensure_env("torch", os.path.join(ROOT, "runs",
                                                                          "peer_envs")))
  else:
    flags.append("--sections=sampler,train,speculative,quantized")
  result = run_bench(tmp_path, *flags)
  assert all(r["status"] == "ok" for r in result["sections"]), result["sections"]
  (train,) = section(result, "train", "b1")["cases"]
  assert train["rows"] == 8 and train["length"] == 16
  assert train["predicted_peak_bytes"] > 0 and 0 < train["mfu"] < 1
  spec = {c["temperature"]: c for c in section(result, "speculative", "b1")["cases"]
          if c["batch"] == 4}
  # Greedy, the history is the plain run's own output: every draft is accepted; at T = 1
  # the random policy does not repeat an earlier sample.
  assert spec[0.0]["acceptance"] == 1.0
  assert spec[1.0]["acceptance"] < 0.5
  quantized = section(result, "quantized", "b1")["cases"]
  assert [c["batch"] for c in quantized] == [2, 4]
  assert all(c["int8_tokens_per_s"] > 0 and c["fp8_tokens_per_s"] > 0 for c in quantized)
  stored = quantized[0]["weight_bytes"]
  assert stored["int8"] == stored["fp8"] < stored["bfloat16"]
  if peers.peers_enabled(["torch"]):
    peer = section(result, "peer", "b1")["cases"]
    assert [c["batch"] for c in peer if c["kind"] == "generate"] == [2, 4]
    (step,) = [c for c in peer if c["kind"] == "grpo_step"]
    assert 0 < step["score_s"] < step["step_s"]
    assert step["tokens_per_s"] == pytest.approx(8 * 16 / step["train_s"])
    assert step["mfu"] > 0
