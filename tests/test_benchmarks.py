"""The benchmark scripts run end to end in smoke mode (tiny shapes, one repetition, no peers)
so they cannot rot; their timings are not checked here (docs/benchmarks.md: timed claims are
benchmarks, not tests)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from experiments import decode_cost
from experiments import peers
from models import hf_checkpoint
from models import transformer
from models.config import get_preset

_REPO = pathlib.Path(__file__).resolve().parent.parent
_TINY = get_preset("tiny").replace(d_model=48, n_heads=2, n_kv_heads=1, head_dim=24, mlp_dim=96,
                                   max_seq_len=64)


def _run(module, *args, timeout=300, ci=False):
  """Runs `python -m experiments.<module> <args>` from the repository root, which must
  succeed; `ci` sets CI=1, which skips the peers."""
  env = dict(os.environ, PYTHONPATH=str(_REPO), **({"CI": "1"} if ci else {}))
  subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=_REPO, env=env,
                 check=True, timeout=timeout)


@pytest.mark.parametrize("module, outputs", [
    ("bench_sampler", ("bench_sampler.json", "bench_sampler.md", "bench_sampler.png")),
    ("bench_train", ("bench_train.json", "bench_train.md", "bench_train.png")),
])
@pytest.mark.slow
def test_benchmark_smoke_run_writes_its_results(module, outputs, tmp_path):
  _run(module, "--smoke", f"--out={tmp_path}", timeout=900, ci=True)
  for name in outputs:
    assert (tmp_path / name).stat().st_size > 0
  result = json.loads((tmp_path / outputs[0]).read_text())
  assert result["frameworks"] == ["arbor"]
  assert result["matmul_peak_flops"] > 0


@pytest.mark.slow
def test_sampler_benchmark_times_a_loaded_checkpoint_alone(tmp_path):
  """--checkpoint decodes with the folder's weights and shape (not the B1 decoder); with
  --peers= Arbor alone (no folder is exported for peers)."""
  config = _TINY
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  hf_checkpoint.save_hf(str(tmp_path / "ckpt"), params, config)
  _run("bench_sampler", "--smoke", "--peers=", f"--checkpoint={tmp_path / 'ckpt'}",
       f"--out={tmp_path / 'out'}", f"--peer_weights={tmp_path / 'peer_weights'}")
  result = json.loads((tmp_path / "out" / "bench_sampler.json").read_text())
  assert result["frameworks"] == ["arbor"] and result["long_tail"] == []
  assert result["checkpoint"] == str(tmp_path / "ckpt") and result["peer_weights"] is None
  assert "d_model=48" in result["config"]
  assert result["kv_bytes_per_token"] == decode_cost.kv_bytes_per_token(config)
  assert not (tmp_path / "peer_weights").exists()


def _byte_tokenizer():
  """A byte-level tokenizer (id 0 = EOS, then the 256 byte symbols, no merges): every text
  decodes and encodes back exactly, as B8's prompts need."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from models.hf_tokenizer import HFTokenizer  # pylint: disable=import-outside-toplevel
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  vocab = {"<eos>": 0, **{symbol: i + 1 for i, symbol in enumerate(alphabet)}}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
  return HFTokenizer(tok, eos_id=0)


def _exported_tiny_model(folder):
  """A tiny tied-embedding Llama with the byte tokenizer, exported for the peers (B8)."""
  tokenizer = _byte_tokenizer()
  config = _TINY.replace(vocab_size=tokenizer.vocab_size, tie_embeddings=True)
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  peers.export_weights(str(folder), params, config, tokenizer, "tiny")
  return config, params, tokenizer


def test_exported_weights_load_back_with_their_tokenizer(tmp_path):
  # B8: the folder the peers load holds the same weights and tokenizer as Arbor's policy,
  # and it is written once per source.
  import numpy as np  # pylint: disable=import-outside-toplevel
  from models.pretrained import load_pretrained  # pylint: disable=import-outside-toplevel
  config, params, tokenizer = _exported_tiny_model(tmp_path / "w")
  loaded_config, loaded, loaded_tokenizer = load_pretrained(str(tmp_path / "w"))
  assert loaded_config == config
  jax.tree.map(np.testing.assert_array_equal, params, loaded)
  text = "Charlotte writes 0.25 of it, then 28 letters: \\boxed{}"
  assert loaded_tokenizer.encode(text, add_bos=True) == tokenizer.encode(text, add_bos=True)
  assert (loaded_tokenizer.eos_id, loaded_tokenizer.pad_id) == (0, 0)
  weights = tmp_path / "w" / "model.safetensors"
  stamp = weights.stat().st_mtime_ns
  peers.export_weights(str(tmp_path / "w"), params, config, tokenizer, "tiny")
  assert weights.stat().st_mtime_ns == stamp  # same source: not rewritten
  assert peers.weights_folder("runs/pw", "smollm2") == os.path.join("runs/pw", "smollm2")
  assert peers.weights_folder("runs/pw", "/a/b/model.gguf") == os.path.join("runs/pw", "model_gguf")


@pytest.mark.slow
def test_torch_peer_runs_the_exported_weights(tmp_path, monkeypatch):
  # transformers loads Arbor's exported folder and computes Arbor's logits; its `generate`
  # benchmark runs on those weights with the spec's special ids.
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  config, params, _ = _exported_tiny_model(tmp_path / "w")
  peer = _load_peer("torch", monkeypatch)
  spec = dict(weights=str(tmp_path / "w"), repeats=1, pad_id=0, eos_id=0,
              cases=[dict(batch=2, prompt_len=4, new_tokens=3, temperature=1.0)])
  model = peer.load_model(spec)
  assert type(model).__name__ == "LlamaForCausalLM" and not model.training
  tokens = [[5, 9, 200, 17, 3, 3, 250, 1]]
  assert peers.parity_max_abs(config, params, tokens, peer.parity(model, tokens)) < 1e-4
  rows = peer.bench_generate(spec, model)
  assert len(rows) == 1 and rows[0]["tokens_per_s"] > 0


@pytest.mark.slow
def test_b8_grpo_step_smoke_run_on_a_checkpoint(tmp_path):
  # --checkpoint: the GRPO step alone on the folder's weights with its tokenizer and text
  # prompts of exactly prompt_len tokens (peers skipped under CI).
  _exported_tiny_model(tmp_path / "w")
  _run("bench_train", "--smoke", f"--checkpoint={tmp_path / 'w'}", f"--out={tmp_path / 'out'}",
       timeout=600, ci=True)
  result = json.loads((tmp_path / "out" / "bench_train_b8.json").read_text())
  assert result["frameworks"] == ["arbor"] and result["peer_weights"] is None
  step = result["grpo_step"]
  assert (step["prompts"], step["group_size"], step["prompt_len"]) == (2, 2, 8)
  assert step["arbor"]["best_step_s"] > 0 and step["arbor"]["best_split"]["time_sample_s"] > 0
  assert len(result["prompts"]) == 2 and len(set(result["prompts"])) == 2
  assert result["prompt_lens"] == [8]  # every prompt (of every step) is exactly 8 tokens
  assert (tmp_path / "out" / "bench_train_b8.md").stat().st_size > 0


@pytest.mark.slow
def test_decode_profile_smoke_run_attributes_the_step(tmp_path):
  # B8's profile: the traced call's ops land in the decode step's pieces (layers' matmuls,
  # attention, LM head, sampling), and each piece is also timed apart.
  _run("profile_decode", "--smoke", f"--out={tmp_path}")
  row, = json.loads((tmp_path / "profile_decode.json").read_text())["batches"]
  pieces = " ".join(row["in_place"]["decode_ms_per_step"])
  for piece in ("q|k|v matmul", "gate|up matmul", "LM head", "sampling", "attention"):
    assert piece in pieces, (piece, pieces)
  assert row["in_place"]["decode_total_ms_per_step"] > 0 and row["in_place"]["prefill_ms"] > 0
  assert all(row["apart_s"][k] > 0 for k in ("blocks", "head_as_in_decode", "sampling",
                                             "generate_call", "prefill_call"))
  assert (tmp_path / "profile_decode.md").stat().st_size > 0


@pytest.mark.slow
def test_low_precision_benchmark_profiles_each_weight_format_side_by_side(tmp_path):
  """bench_low_precision: every format at every batch, the quantised ones reading fewer
  weight bytes per step (a quarter for int8 / fp8, plus the float embedding and scales),
  dequantising them inside the step (their own piece of the in-place profile), and
  paying a quantisation per publish; float32 neither."""
  _run("bench_low_precision", "--smoke", f"--out={tmp_path}", timeout=600)
  result = json.loads((tmp_path / "profile_decode.json").read_text())
  rows = {row["weights"]: row for row in result["batches"]}
  assert sorted(rows) == ["bfloat16", "float32", "fp8", "int8"]
  read = {name: row["step_bytes"]["weights"] for name, row in rows.items()}
  assert read["int8"] == read["fp8"] < read["bfloat16"] < read["float32"]
  dequantise = {name: row["in_place"]["decode_ms_per_step"].get(
      "weights: dequantise (models/quantize.py)", 0.0) for name, row in rows.items()}
  assert dequantise["float32"] == 0.0 and dequantise["int8"] > 0 and dequantise["fp8"] > 0
  assert result["publish_s"]["float32"] == 0.0 and result["publish_s"]["int8"] > 0
  assert "| int8 | 2 |" in (tmp_path / "profile_decode.md").read_text()


def test_token_choice_benchmark_smoke_run_times_both_sides(tmp_path):
  _run("bench_logits", "--smoke", f"--out={tmp_path}")
  for suffix in ("json", "md", "png"):
    assert (tmp_path / f"bench_logits.{suffix}").stat().st_size > 0
  cases = json.loads((tmp_path / "bench_logits.json").read_text())["cases"]
  assert [c["mode"] for c in cases] == ["greedy", "T = 1"]
  assert all(c["arbor_s"] > 0 and c["reference_s"] > 0 for c in cases)


def test_scoring_benchmark_smoke_run_times_both_sides_on_equal_rewards(tmp_path):
  _run("bench_scoring", "--smoke", f"--out={tmp_path}")
  case, = json.loads((tmp_path / "bench_scoring.json").read_text())["cases"]
  assert case["task"] == "running_sum" and case["batch"] == 8
  assert 0 < case["rewarded"] < 8  # both scorer paths ran (the worker agreed, or it fails)
  assert case["in_process_s"] > 0 and case["worker_s"] > 0


def test_peers_are_skipped_under_ci_and_unknown_peers_rejected(monkeypatch):
  monkeypatch.delenv("CI", raising=False)
  assert peers.peers_enabled(["tunix", "torch"]) == ["tunix", "torch"]
  assert peers.weight_peers(["tunix", "torch"]) == (["torch"], ["tunix"])  # torch loads weights
  monkeypatch.setenv("CI", "1")
  assert peers.peers_enabled(["tunix"]) == []
  assert peers.weight_peers(["tunix", "torch"]) == ([], [])
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


def _load_peer(name: str, monkeypatch):
  """experiments/peers/<name>_peer.py as a module (the peers import `peer_memory` from
  their own folder, as when run as scripts)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  folder = _REPO / "experiments" / "peers"
  monkeypatch.syspath_prepend(str(folder))
  spec = importlib.util.spec_from_file_location(f"{name}_peer_under_test",
                                                folder / f"{name}_peer.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_tunix_peer_times_token_arrays_without_its_tokenizer(monkeypatch):
  # B1 must time the same work on both sides: token arrays in, token arrays out. A fake
  # `tunix` (the real one lives only in the peer's virtualenv) records what the peer's
  # sampler benchmark calls: never Sampler.__call__ (strings, tokenise, detokenise),
  # never the tokenizer; init_sample_state gets the [B, P] token array.
  import types  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  log = []

  class RecordingTokenizer:
    def __init__(self, inner):
      self.inner = inner

    def __getattr__(self, name):
      log.append(("tokenizer", name))
      return getattr(self.inner, name)

  class FakeSampler:
    def __init__(self, model, tokenizer, cache_config):
      del model
      self.tokenizer, self.cache_config = RecordingTokenizer(tokenizer), cache_config

    def __call__(self, input_strings, *args, **kwargs):
      raise AssertionError(f"B1 timed Sampler.__call__ on {type(input_strings[0]).__name__}s")

    def model_def_and_state(self):
      return None, ["params"]

    def init_sample_state(self, all_input_ids, total_sampling_steps, include_logits,
                          forbidden_token_ids, temperature, top_p, top_k, seed, beam_size,
                          include_logprobs=False):
      del include_logits, seed, include_logprobs
      log.append(("init", all_input_ids, total_sampling_steps, tuple(forbidden_token_ids),
                  temperature, top_p, top_k, beam_size))
      buffer = np.full((all_input_ids.shape[0], total_sampling_steps), 7, np.int32)
      buffer[:, :all_input_ids.shape[1]] = np.asarray(all_input_ids)
      return types.SimpleNamespace(token_buffer=jnp.asarray(buffer))

    def _compiled_prefill_fn(self, params, state, images, echo):
      log.append(("prefill", echo))
      assert params == ["params"] and images is None
      return state

    def _compiled_decode_fn(self, params, state):
      log.append(("decode",))
      assert params == ["params"]
      return state

  sampler_module = types.SimpleNamespace(Sampler=FakeSampler, CacheConfig=dict)
  qwen2_module = types.SimpleNamespace(ModelConfig=dict, Qwen2=lambda config, rngs: object())
  fakes = {"tunix": {}, "tunix.generate": {"sampler": sampler_module},
           "tunix.generate.sampler": sampler_module, "tunix.models": {},
           "tunix.models.qwen2": {"model": qwen2_module}, "tunix.models.qwen2.model": qwen2_module}
  for name, attrs in fakes.items():
    module = attrs if isinstance(attrs, types.SimpleNamespace) else types.SimpleNamespace(**attrs)
    monkeypatch.setitem(sys.modules, name, module)
  peer = _load_peer("tunix", monkeypatch)

  shape = peers.peer_shape(get_preset("b1").replace(vocab_size=64))
  cases = [dict(batch=3, prompt_len=5, new_tokens=4, temperature=t) for t in (0.0, 1.0)]
  rows = peer.bench_sampler(dict(shape=shape, repeats=2, cases=cases))
  assert [r["temperature"] for r in rows] == [0.0, 1.0] and all(r["tokens_per_s"] > 0 for r in rows)
  assert not [e for e in log if e[0] == "tokenizer"], log
  inits = [e for e in log if e[0] == "init"]
  assert len(inits) == 2 * 3  # per case: one compiling call and two timed ones
  for _, ids, total, forbidden, temperature, top_p, top_k, beam_size in inits:
    assert not isinstance(ids, (str, list)) and ids.shape == (3, 5) and ids.dtype == np.int32
    assert total == 5 + 4 and forbidden == (peer.PAD, peer.EOS) and beam_size is None
    # T = 1: Tunix's top_p mode with p = 1 and no top-k, which samples without a sort.
    assert (top_p, top_k) == ((None, None) if temperature == 0.0 else (1.0, None))
  assert [e[0] for e in log].count("decode") == 6 and ("prefill", False) in log


def test_torch_peer_times_generate_on_token_tensors(monkeypatch):
  # transformers' side of B1: `generate` gets the [B, P] token tensor and returns the
  # [B, P + N] tensor; no tokenizer is involved, and T = 1 adds no top-k / top-p warper.
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peer = _load_peer("torch", monkeypatch)
  calls = []
  original = transformers.Qwen2ForCausalLM.generate

  def recording_generate(self, *args, **kwargs):
    calls.append((args, kwargs))
    return original(self, *args, **kwargs)

  monkeypatch.setattr(transformers.Qwen2ForCausalLM, "generate", recording_generate)
  monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__init__",
                      lambda *a, **k: pytest.fail("the torch peer built a tokenizer"))
  config = get_preset("b1").replace(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                    head_dim=16, mlp_dim=64, vocab_size=64, max_seq_len=8)
  cases = [dict(batch=2, prompt_len=4, new_tokens=4, temperature=t) for t in (0.0, 1.0)]
  rows = peer.bench_generate(dict(shape=peers.peer_shape(config), repeats=1, cases=cases))
  assert len(rows) == 2 and len(calls) == 4
  for args, kwargs in calls:
    assert not args and kwargs["input_ids"].dtype == torch.int64
    assert kwargs["input_ids"].shape == (2, 4)
    assert kwargs["min_new_tokens"] == kwargs["max_new_tokens"] == 4
    if kwargs.get("do_sample"):
      assert (kwargs["top_k"], kwargs["top_p"]) == (0, 1.0)


@pytest.mark.slow
def test_distillation_cost_benchmark_times_the_three_train_steps(tmp_path):
  _run("bench_train", "--only=distill", "--smoke", f"--out={tmp_path}")
  result = json.loads((tmp_path / "bench_train_distill.json").read_text())
  assert set(result["distill"]["best_s"]) == {"grpo", "grpo + reverse KL", "pure OPD"}
  assert result["distill"]["vs_grpo"]["grpo"] == 1.0
  assert (tmp_path / "bench_train_distill.md").stat().st_size > 0


@pytest.mark.slow
def test_nat_cost_benchmark_cuts_the_batch_for_the_prefix_cases(tmp_path):
  """--only=nat: the random prefix cut trains fewer tokens on shorter batches than all
  tokens; uniform random tokens train fewer tokens at the full length."""
  _run("bench_train", "--only=nat", "--smoke", f"--out={tmp_path}")
  rows = {r["case"]: r for r in json.loads(
      (tmp_path / "bench_train_nat.json").read_text())["nat"]["rows"]}
  full = rows["all tokens"]
  assert full["kept_fraction"] == 1.0 and full["time_ratio"] == 1.0
  assert rows["rpc 25%"]["kept_fraction"] < rows["rpc 50%"]["kept_fraction"] < 1.0
  assert rows["rpc 25%"]["mean_length"] < full["mean_length"]
  assert rows["urs 50%"]["kept_fraction"] < 1.0
  assert rows["urs 50%"]["mean_length"] == full["mean_length"]
