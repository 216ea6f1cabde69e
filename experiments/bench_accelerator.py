"""Benchmark B10 (docs/accelerator.md): Arbor on one accelerator, against transformers and
TRL on the same chip, at Qwen2.5-0.5B and 1.5B shapes with random weights.

    python -m experiments.bench_accelerator --out=runs/accelerator     # a GPU / TPU host, ~8 min
    python -m experiments.bench_accelerator --smoke --out=/tmp/b10     # tiny shapes, any host

Sections, run in this order for each model of --models (presets; random weights, since
throughput does not depend on their values):

  peak         the chip's bfloat16 matmul FLOP/s (an 8192^3 product, best of 5): the
               denominator of every model FLOP utilisation (MFU) below.
  sampler      Arbor's compiled sampler (`sampling.sampler.generate`, bfloat16 weights and
               KV cache), --prompt_len random prompt tokens, exactly --new_tokens new tokens
               per row (no stop token), T = 1, at each of --batch_sizes: generated tokens/s
               (best of --repeats), compile seconds, decode MFU, and the memory planner's
               prediction for the program (XLA's analysis, `experiments.memory`) beside the
               device's measured peak.
  train        Arbor's GRPO train step (`rl.train.make_train_step`: forward, backward,
               AdamW; float32 master weights, bfloat16 compute, full remat, log-probs in
               chunks of --logprob_chunk positions) on --train_rows rows (groups of 8) of
               prompt + completion: tokens/s over every position, MFU (forward + backward
               matmul FLOPs, `decode_cost.train_flops_per_token`), compile seconds, the
               planner's prediction vs the measured peak.
  peer         the same work in transformers + TRL on the same chip
               (experiments/peers/accelerator_peer.py, run by --torch_python): `generate` at
               each batch, and TRL's GRPOTrainer step on fixed completions of the train
               shape (bf16 autocast over float32 weights, gradient checkpointing, AdamW).
  speculative  Arbor's speculative decoding (`sampling.speculative`, 'history' drafts, k = 4)
               on a repetitive prompt at each batch: greedy, with the plain greedy run's own
               output as the history (every draft right: the most drafts can buy at that
               batch), and T = 1 with an earlier T = 1 sample as the history (random weights
               rarely repeat themselves: the least); tokens/s, speed-up over plain decoding
               of the same temperature, acceptance.
  quantized    the sampler section's work with int8 and fp8 weights
               (config.rollout.weights: weight-only, per-channel scales, dequantised inside
               each decode step; bfloat16 activations and KV cache), side by side with
               bfloat16 weights in one process at each batch: tokens/s and the speed-up
               fewer weight bytes buy where decoding is bound by reading them.

Each (section, model) runs in its own process, so a failure, an out-of-memory or a timeout
in one is recorded and the others still run, and each process's peak memory is its own.
All of them share --budget_s: a section is skipped (and says so) when less than
--min_section_s is left, and stopped at the budget. Every case is written the moment it is
measured. Writes bench_accelerator.json and bench_accelerator.md to --out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from experiments.peers.results_file import Part

_OUT = flags.DEFINE_string("out", "runs/accelerator", "Output directory.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes (preset b1), one repetition, for any "
                           "host: replaces the shape flags not given.")
_MODELS = flags.DEFINE_list("models", ["qwen2_5_0_5b", "qwen2_5_1_5b"], "Model presets.")
_SECTIONS = flags.DEFINE_list("sections", ["sampler", "train", "peer", "speculative",
                                           "quantized"],
                              "Sections to run after 'peak' (which always runs).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["8", "64", "256"], "Sampler batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 256, "Prompt tokens per row.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 512, "Generated tokens per row.")
_TRAIN_ROWS = flags.DEFINE_integer("train_rows", 64, "Rows of the train step's batch.")
_LOGPROB_CHUNK = flags.DEFINE_integer("logprob_chunk", 256, "Train step: log-prob chunk.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed repetitions per case (best is reported).")
_BUDGET_S = flags.DEFINE_float("budget_s", 450.0, "Seconds for everything.")
_MIN_SECTION_S = flags.DEFINE_float("min_section_s", 30.0, "Skip a section with less left.")
_TORCH_PYTHON = flags.DEFINE_string("torch_python", sys.executable,
                                    "The python with torch, transformers and trl (the peer).")
_CHILD = flags.DEFINE_string("child", "", "Internal: the section this process runs.")
_CHILD_MODEL = flags.DEFINE_string("child_model", "", "Internal: the model it runs.")
_PART = flags.DEFINE_string("part", "", "Internal: where it writes its results.")

GROUP_SIZE = 8  # completions per prompt in the train batch
DRAFT_TOKENS = 4
PEAK_SIZE, SMOKE_PEAK_SIZE = 8192, 256
SMOKE_SETTINGS = dict(models=["b1"], batch_sizes=[2, 4], prompt_len=8, new_tokens=8,
                      train_rows=8, logprob_chunk=4, repeats=1)


def settings() -> dict:
  """The run's shapes and switches, from the flags; --smoke replaces those not given."""
  s = dict(models=list(_MODELS.value), batch_sizes=[int(b) for b in _BATCH_SIZES.value],
           prompt_len=_PROMPT_LEN.value, new_tokens=_NEW_TOKENS.value,
           train_rows=_TRAIN_ROWS.value, logprob_chunk=_LOGPROB_CHUNK.value,
           repeats=_REPEATS.value)
  if _SMOKE.value:
    s.update({k: v for k, v in SMOKE_SETTINGS.items() if not flags.FLAGS[k].present})
  if s["train_rows"] % min(GROUP_SIZE, s["train_rows"]):
    raise ValueError(f"--train_rows={s['train_rows']} must be a multiple of {GROUP_SIZE}.")
  return s


# ----------------------------------------------------------------------------------------
# The sections (each runs in its own process: `run_child`).


def device_peak_bytes() -> int | None:
  """The device's peak bytes in use so far in this process (None where the backend keeps
  no such count: CPU)."""
  import jax  # pylint: disable=import-outside-toplevel
  stats = jax.devices()[0].memory_stats()
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def best_of(fn, repeats: int) -> float:
  """Seconds of the fastest of `repeats` calls of fn (which blocks until done)."""
  from experiments.measure import timed  # pylint: disable=import-outside-toplevel
  return min(timed(fn) for _ in range(repeats))


def compile_timed(jitted, *args, **static) -> tuple:
  """(the compiled program, seconds to lower and compile it)."""
  start = time.perf_counter()
  compiled = jitted.lower(*args, **static).compile()
  return compiled, time.perf_counter() - start


def random_prompts(config, batch: int, prompt_len: int, seed: int):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  tokens = np.random.default_rng(seed).integers(3, config.vocab_size, (batch, prompt_len))
  return jnp.asarray(tokens, jnp.int32), jnp.ones((batch, prompt_len), bool)


def peak_section(part: Part, s: dict) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from experiments.measure import matmul_peak_flops  # pylint: disable=import-outside-toplevel
  size = SMOKE_PEAK_SIZE if _SMOKE.value else PEAK_SIZE
  part.data.update(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                   jax=jax.__version__)
  part.add(dict(size=size, bf16_flops=matmul_peak_flops(size, 5, jnp.bfloat16)))
  del s


def sampler_section(part: Part, s: dict, model: str, peak: float | None) -> None:
  """Plain sampling at T = 1 at each batch size (module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  from experiments import memory  # pylint: disable=import-outside-toplevel
  from experiments.decode_cost import decode_flops_per_token  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  from models.config import get_preset  # pylint: disable=import-outside-toplevel
  from sampling import sampler  # pylint: disable=import-outside-toplevel

  config = get_preset(model, dtype="bfloat16")
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  sampling_config = sampler.SamplingConfig(max_new_tokens=s["new_tokens"], temperature=1.0)
  flops = decode_flops_per_token(config, s["prompt_len"] + s["new_tokens"] / 2)
  for batch in s["batch_sizes"]:
    prompts, mask = random_prompts(config, batch, s["prompt_len"], seed=batch)
    compiled, compile_s = compile_timed(sampler.generate, params, prompts, mask,
                                        jax.random.PRNGKey(0), model_config=config,
                                        sampling_config=sampling_config)
    calls = iter(range(1, s["repeats"] + 2))
    run = lambda: compiled(params, prompts, mask, jax.random.PRNGKey(next(calls))
                           ).tokens.block_until_ready()
    run()  # the first call of a compiled program also loads it onto the device
    seconds = best_of(run, s["repeats"])
    tokens_per_s = batch * s["new_tokens"] / seconds
    part.add(dict(batch=batch, tokens_per_s=tokens_per_s, best_s=seconds, compile_s=compile_s,
                  mfu=flops * tokens_per_s / peak if peak else None,
                  predicted_peak_bytes=memory.program_memory(compiled)["peak_bytes"],
                  measured_peak_bytes=device_peak_bytes()))


def train_section(part: Part, s: dict, model: str, peak: float | None) -> None:
  """Arbor's GRPO train step on the train shape (module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  from experiments import memory  # pylint: disable=import-outside-toplevel
  from experiments.decode_cost import train_flops_per_token  # pylint: disable=import-outside-toplevel
  from experiments.measure import random_rollout  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  from rl import train  # pylint: disable=import-outside-toplevel

  length = s["prompt_len"] + s["new_tokens"]
  config = memory.model_config(model, "float32", "full", length, compute_dtype="bfloat16")
  optimizer = train.make_optimizer(1e-6)
  step = train.make_train_step(config, optimizer, memory.grpo_loss(),
                               logprob_chunk=s["logprob_chunk"])
  state = train.init_train_state(transformer.init_params(config, jax.random.PRNGKey(0)),
                                 optimizer)
  group = min(GROUP_SIZE, s["train_rows"])
  batch = random_rollout(config, s["train_rows"] // group, group, s["prompt_len"],
                         s["new_tokens"])
  compiled, compile_s = compile_timed(step, state, batch)
  holder = [state]

  def run():  # the compiled step's third argument: no distillation teacher
    holder[0], metrics = compiled(holder[0], batch, None)
    jax.block_until_ready(metrics)

  run()
  seconds = best_of(run, s["repeats"])
  tokens_per_s = s["train_rows"] * length / seconds
  flops = train_flops_per_token(config, length / 2)
  part.add(dict(rows=s["train_rows"], length=length, tokens_per_s=tokens_per_s,
                best_s=seconds, compile_s=compile_s,
                mfu=flops * tokens_per_s / peak if peak else None,
                predicted_peak_bytes=memory.program_memory(compiled)["peak_bytes"],
                measured_peak_bytes=device_peak_bytes()))


def speculative_section(part: Part, s: dict, model: str) -> None:
  """Plain vs speculative ('history' drafts) on a repetitive prompt (module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  from models.config import get_preset  # pylint: disable=import-outside-toplevel
  from sampling import sampler  # pylint: disable=import-outside-toplevel
  from sampling import speculative  # pylint: disable=import-outside-toplevel

  config = get_preset(model, dtype="bfloat16")
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  drafts = speculative.DraftConfig(tokens=DRAFT_TOKENS, sources=("history",), ngram=3)
  for batch in s["batch_sizes"]:
    pattern = np.resize(np.arange(3, 3 + 7) * 997 % config.vocab_size, s["prompt_len"])
    prompts = jnp.asarray(np.tile(pattern, (batch, 1)), jnp.int32)
    mask = jnp.ones_like(prompts, bool)
    for temperature in (0.0, 1.0):
      sampling_config = sampler.SamplingConfig(max_new_tokens=s["new_tokens"],
                                               temperature=temperature)
      plain, _ = compile_timed(sampler.generate, params, prompts, mask,
                                             jax.random.PRNGKey(0), model_config=config,
                                             sampling_config=sampling_config)
      # The history: greedy, this very output (all drafts right); T = 1, another sample.
      reference = plain(params, prompts, mask, jax.random.PRNGKey(0))
      history = dict(version=0, history=reference.tokens[:, s["prompt_len"]:],
                     history_mask=reference.completion_mask[:, s["prompt_len"]:])
      spec, spec_compile_s = compile_timed(
          speculative.speculative_generate, params, prompts, mask, jax.random.PRNGKey(1),
          model_config=config, sampling_config=sampling_config, draft_config=drafts, **history)
      seeds = iter(range(1, 2 * s["repeats"] + 3))
      plain_run = lambda: plain(params, prompts, mask, jax.random.PRNGKey(next(seeds))
                                ).tokens.block_until_ready()
      spec_run = lambda: spec(params, prompts, mask, jax.random.PRNGKey(next(seeds)),
                              **history).tokens.block_until_ready()
      spec_run()
      plain_s, spec_s = best_of(plain_run, s["repeats"]), best_of(spec_run, s["repeats"])
      stats = spec(params, prompts, mask, jax.random.PRNGKey(1), **history).speculative
      tokens = batch * s["new_tokens"]
      part.add(dict(batch=batch, temperature=temperature, plain_tokens_per_s=tokens / plain_s,
                    speculative_tokens_per_s=tokens / spec_s, speedup=plain_s / spec_s,
                    acceptance=float(np.sum(stats.accepted)) / max(float(np.sum(stats.drafted)), 1.0),
                    forwards_per_token=int(stats.forwards) / max(int(stats.emitted), 1),
                    speculative_compile_s=spec_compile_s))


QUANTIZED_WEIGHTS = ("bfloat16", "int8", "fp8")  # bfloat16: the reference


def quantized_section(part: Part, s: dict, model: str) -> None:
  """The sampler with each of `QUANTIZED_WEIGHTS` at each batch (module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  from models import quantize  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  from models.config import get_preset  # pylint: disable=import-outside-toplevel
  from sampling import sampler  # pylint: disable=import-outside-toplevel

  config = get_preset(model, dtype="bfloat16")
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  weights = {name: params if name == "bfloat16" else jax.block_until_ready(
      jax.jit(lambda p, name=name: quantize.quantize_params(p, name))(params))
             for name in QUANTIZED_WEIGHTS}
  sampling_config = sampler.SamplingConfig(max_new_tokens=s["new_tokens"], temperature=1.0)
  for batch in s["batch_sizes"]:
    prompts, mask = random_prompts(config, batch, s["prompt_len"], seed=batch)
    case = dict(batch=batch)
    for name, sampler_params in weights.items():
      compiled, _ = compile_timed(sampler.generate, sampler_params, prompts, mask,
                                  jax.random.PRNGKey(0), model_config=config,
                                  sampling_config=sampling_config)
      calls = iter(range(1, s["repeats"] + 2))
      run = lambda compiled=compiled, p=sampler_params: compiled(
          p, prompts, mask, jax.random.PRNGKey(next(calls))).tokens.block_until_ready()
      run()
      case[f"{name}_tokens_per_s"] = batch * s["new_tokens"] / best_of(run, s["repeats"])
    for name in QUANTIZED_WEIGHTS[1:]:
      case[f"{name}_speedup"] = case[f"{name}_tokens_per_s"] / case["bfloat16_tokens_per_s"]
    case["weight_bytes"] = {name: quantize.weight_bytes(p) for name, p in weights.items()}
    part.add(case)


def peer_spec(s: dict, model: str, part: str) -> dict:
  """What experiments/peers/accelerator_peer.py runs: the model's shape, the sampler cases
  and the train shape of this run."""
  from experiments.peers import peer_shape  # pylint: disable=import-outside-toplevel
  from models.config import get_preset  # pylint: disable=import-outside-toplevel
  return dict(shape=peer_shape(get_preset(model)), batch_sizes=s["batch_sizes"],
              prompt_len=s["prompt_len"], new_tokens=s["new_tokens"],
              train_rows=s["train_rows"], group_size=min(GROUP_SIZE, s["train_rows"]),
              repeats=s["repeats"], part=part)


def run_child() -> None:
  """This process is one (section, model): runs it into --part."""
  s = settings()
  section, model = _CHILD.value, _CHILD_MODEL.value
  part = Part(_PART.value, dict(section=section, model=model))
  if section == "peak":
    peak_section(part, s)
    return
  peak = read_part(os.path.join(os.path.dirname(_PART.value), "peak.json"))
  peak_flops = peak["cases"][0]["bf16_flops"] if peak and peak["cases"] else None
  if section == "sampler":
    sampler_section(part, s, model, peak_flops)
  elif section == "train":
    train_section(part, s, model, peak_flops)
  elif section == "speculative":
    speculative_section(part, s, model)
  elif section == "quantized":
    quantized_section(part, s, model)
  else:
    raise ValueError(f"Unknown section {section!r}.")


# ----------------------------------------------------------------------------------------
# The driver: one process per (section, model), within the budget.


def read_part(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def child_command(section: str, model: str, part: str, s: dict) -> list[str]:
  if section == "peer":
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers",
                          "accelerator_peer.py")
    return [_TORCH_PYTHON.value, script, json.dumps(peer_spec(s, model, part))]
  return [sys.executable, "-m", "experiments.bench_accelerator", *sys.argv[1:],
          f"--child={section}", f"--child_model={model}", f"--part={part}"]


def run_section(section: str, model: str, work: str, s: dict, deadline: float) -> dict:
  """Runs one (section, model) in its own process until it ends or the deadline; returns
  its results with how it ended ('ok', 'failed: ...', 'timed out ...', 'skipped ...')."""
  name = section if section == "peak" else f"{section}_{model}"
  left = deadline - time.monotonic()
  if left < _MIN_SECTION_S.value:
    return dict(section=section, model=model, cases=[],
                status=f"skipped: {left:.0f} s of the budget left")
  part = os.path.join(work, f"{name}.json")
  # One compilation cache for the run: the speculative section's plain programs are the
  # sampler section's (T = 1) and load instead of compiling again.
  env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
             PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=os.path.join(work, "xla_cache"))
  start = time.monotonic()
  print(f"[{name}] starting with {left:.0f} s left", flush=True)
  try:
    done = subprocess.run(child_command(section, model, part, s), env=env, timeout=left,
                          capture_output=True, text=True, check=False)
    status = "ok" if done.returncode == 0 else (
        f"failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
  except subprocess.TimeoutExpired:
    status = f"timed out after {left:.0f} s (the budget)"
  result = read_part(part) or dict(cases=[])
  result.update(section=section, model=model, status=status, wall_s=time.monotonic() - start)
  print(f"[{name}] {status[:300]} ({result['wall_s']:.0f} s, {len(result['cases'])} cases)",
        flush=True)
  return result


def add_peer_utilisation(outcome: dict, peak: float | None, s: dict) -> None:
  """The peer's MFU, by the FLOP counts Arbor's sections use (the peer imports no Arbor)."""
  from experiments.decode_cost import decode_flops_per_token, train_flops_per_token  # pylint: disable=import-outside-toplevel
  from models.config import get_preset  # pylint: disable=import-outside-toplevel
  config = get_preset(outcome["model"])
  length = s["prompt_len"] + s["new_tokens"]
  for case in outcome["cases"]:
    flops = (decode_flops_per_token(config, s["prompt_len"] + s["new_tokens"] / 2)
             if case["kind"] == "generate" else train_flops_per_token(config, length / 2))
    case["mfu"] = flops * case["tokens_per_s"] / peak if peak else None


def jobs(s: dict) -> list[tuple[str, str]]:
  """(section, model) in the order they run: every model's section before the next."""
  return [("peak", "")] + [(section, model) for section in _SECTIONS.value
                           for model in s["models"]]


# ----------------------------------------------------------------------------------------
# The report.


def _gib(n) -> str:
  return "-" if n is None else f"{n / 1024 ** 3:.2f}"


def _pct(x) -> str:
  return "-" if x is None else f"{100 * x:.1f}%"


def _cases(result: dict, section: str, model: str) -> list[dict]:
  found = [r for r in result["sections"] if r["section"] == section and r["model"] == model]
  return found[0]["cases"] if found else []


def markdown(result: dict) -> str:
  """The B10 tables: sampler, train step and speculative decoding, Arbor beside the peer."""
  peak = _cases(result, "peak", "")
  lines = [f"Device: {result['device']} ({result['backend']}, JAX {result['jax']}); "
           f"measured bf16 matmul peak "
           + (f"{peak[0]['bf16_flops'] / 1e12:.1f} TFLOP/s." if peak else "not measured."), "",
           "| model | batch | Arbor tokens/s | transformers tokens/s | Arbor / transformers | "
           "Arbor decode MFU | Arbor compile s | planned peak GiB | measured peak GiB |",
           "|---|---|---|---|---|---|---|---|---|"]
  for model in result["settings"]["models"]:
    peer = {c["batch"]: c for c in _cases(result, "peer", model) if c.get("kind") == "generate"}
    for c in _cases(result, "sampler", model):
      p = peer.get(c["batch"])
      cells = [model, c["batch"], f"{c['tokens_per_s']:.0f}",
               f"{p['tokens_per_s']:.0f}" if p else "-",
               f"{c['tokens_per_s'] / p['tokens_per_s']:.2f}" if p else "-", _pct(c["mfu"]),
               f"{c['compile_s']:.1f}", _gib(c["predicted_peak_bytes"]),
               _gib(c["measured_peak_bytes"])]
      lines.append("| " + " | ".join(map(str, cells)) + " |")
  lines += ["", "| model | rows x tokens | Arbor tokens/s | TRL tokens/s | Arbor / TRL | "
            "Arbor MFU | TRL MFU | Arbor compile s | planned peak GiB | measured peak GiB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for model in result["settings"]["models"]:
    trl = [c for c in _cases(result, "peer", model) if c.get("kind") == "grpo_step"]
    t = trl[0] if trl else None
    for c in _cases(result, "train", model):
      cells = [model, f"{c['rows']} x {c['length']}", f"{c['tokens_per_s']:.0f}",
               f"{t['tokens_per_s']:.0f}" if t else "-",
               f"{c['tokens_per_s'] / t['tokens_per_s']:.2f}" if t else "-", _pct(c["mfu"]),
               _pct(t["mfu"]) if t else "-", f"{c['compile_s']:.1f}",
               _gib(c["predicted_peak_bytes"]), _gib(c["measured_peak_bytes"])]
      lines.append("| " + " | ".join(map(str, cells)) + " |")
  lines += ["", "| model | batch | T | plain tokens/s | speculative tokens/s | speed-up | "
            "acceptance | forwards per token |", "|---|---|---|---|---|---|---|---|"]
  for model in result["settings"]["models"]:
    for c in _cases(result, "speculative", model):
      lines.append(f"| {model} | {c['batch']} | {c['temperature']:g} | "
                   f"{c['plain_tokens_per_s']:.0f} | {c['speculative_tokens_per_s']:.0f} | "
                   f"{c['speedup']:.2f} | {c['acceptance']:.2f} | "
                   f"{c['forwards_per_token']:.2f} |")
  lines += ["", "| model | batch | bfloat16 weights tokens/s | int8 tokens/s | fp8 tokens/s | "
            "int8 speed-up | fp8 speed-up |", "|---|---|---|---|---|---|---|"]
  for model in result["settings"]["models"]:
    for c in _cases(result, "quantized", model):
      lines.append(f"| {model} | {c['batch']} | {c['bfloat16_tokens_per_s']:.0f} | "
                   f"{c['int8_tokens_per_s']:.0f} | {c['fp8_tokens_per_s']:.0f} | "
                   f"{c['int8_speedup']:.2f} | {c['fp8_speedup']:.2f} |")
  lines += ["", "| section | model | status | wall s |", "|---|---|---|---|"]
  for r in result["sections"]:
    status = r["status"].splitlines()[0][:120] if r["status"] else ""
    wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "-"
    lines.append(f"| {r['section']} | {r['model'] or '-'} | {status} | {wall} |")
  return "\n".join(lines) + "\n"


def write(out: str, result: dict) -> None:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "bench_accelerator.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, "bench_accelerator.md"), "w") as f:
    f.write(markdown(result))


def main(argv):
  del argv
  if _CHILD.value:
    run_child()
    return
  from experiments import provenance  # pylint: disable=import-outside-toplevel
  from experiments.measure import load  # pylint: disable=import-outside-toplevel
  s = settings()
  work = tempfile.mkdtemp(prefix="arbor_b10_")
  source = provenance.source_state(os.getcwd())
  result = dict(settings=s, command=" ".join(["python -m experiments.bench_accelerator",
                                              *sys.argv[1:]]),
                commit=provenance.commit_label(source), load_before=load(), sections=[],
                device="", backend="", jax="")
  peak = None
  deadline = time.monotonic() + _BUDGET_S.value
  for section, model in jobs(s):
    outcome = run_section(section, model, work, s, deadline)
    if section == "peak":
      result.update({k: outcome.get(k, "") for k in ("device", "backend", "jax")})
      peak = outcome["cases"][0]["bf16_flops"] if outcome["cases"] else None
    if section == "peer":
      add_peer_utilisation(outcome, peak, s)
    result["sections"].append(outcome)
    result["load_after"] = load()
    write(_OUT.value, result)
  print(markdown(result))
  print(f"Wrote {_OUT.value}/bench_accelerator.json and .md", flush=True)


if __name__ == "__main__":
  app.run(main)
