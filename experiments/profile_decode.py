"""Where one decode step's time goes (B8, docs/benchmarks.md): a profile of the sampler.

    python -m experiments.profile_decode --checkpoint=smollm2 --batch_sizes=16,64
    python -m experiments.profile_decode --smoke        # tiny shapes, one repetition (CI)
    python -m experiments.bench_low_precision           # float32 | bfloat16 | int8 | fp8

Two views of the decode loop of `sampling.sampler.generate` (prompt --prompt_len tokens,
--new_tokens tokens per row at temperature --temperature, no stop tokens), per batch size:

1. In place. One compiled `generate` call is traced with `jax.profiler` (XLA:CPU emits one
   trace event per executed op with --xla_cpu_enable_xprof_traceme, set below before JAX
   starts). Each op is attributed to a piece through the compiled HLO's source location of
   its root instruction (a fusion counts where its root op was written): the layers' four
   matmuls (q|k|v, o, gate|up, down with the SwiGLU product fused into it), attention (KV
   cache writes, q.k, softmax, p.v), norms / RoPE / residuals, the LM head, sampling
   (sampling/logits.py) and the loop's own bookkeeping (sampling/sampler.py); ops of the
   prefill and of the once-per-call setup (`unstack_layers`' concatenations, the cache
   conversions) are reported per call. Kernel times are summed, divided by the decode steps.
2. Apart. Each piece jitted alone and run for --new_tokens dependent steps in one
   `fori_loop` (so nothing is hoisted and dispatch is paid once), best of --repeats: the
   L layer blocks, the LM head as `forward_decode` computes it (`x @ embed.T`) and against a
   [D, V] copy transposed once outside the loop, the T = 1 token choice over [B, V], the
   prefill, the setup, and the whole `generate` call; the decode step is (call - prefill)
   / steps, and what the pieces leave of it is the loop's overhead.

With --weights the sampler's weights are profiled in each format side by side (float32 as
loaded; bfloat16, int8, fp8 or int4 by `models.quantize.quantize_params`, as
config.rollout.weights publishes them): tokens/s and its ratio to float32, the in-place
time a step spends dequantising the weights (`DEQUANTISE`), and the quantisation's cost
once per publish.

Beside them, the bytes a step must read (the weights once, each row's KV cache up to its
phase's end, `experiments.decode_cost`) and the time a streaming read of that many bytes
takes at the bandwidth measured in the run, and the matmul FLOPs against the measured f32
matmul peak (experiments/measure.py). Writes profile_decode.json and profile_decode.md to
--out.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import linecache
import os
import re
import tempfile

_TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"
if _TRACE_FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX reads it
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _TRACE_FLAG).strip()

# pylint: disable=wrong-import-position
from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments.decode_cost import decode_flops_per_token, kv_read_per_token
from experiments.measure import load, matmul_peak_flops, stream_bandwidth, timed, write_results
from models import quantize
from models import transformer
from models.config import ModelConfig, get_preset
from models.pretrained import load_pretrained
from sampling import sampler
from sampling.logits import sample_with_uniform
from sampling.sampler import SamplingConfig, generate

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes, one repetition (for CI).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "smollm2", "Weights (HF folder, .gguf, name).")
_BATCHES = flags.DEFINE_list("batch_sizes", ["16", "64"], "Batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per row.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "Tokens decoded per row.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (> 0).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions per piece (best is reported).")
_OUT = flags.DEFINE_string("out", "runs/profile_decode", "Output directory.")
_WEIGHTS = flags.DEFINE_list("weights", ["float32"], "Sampler weight formats profiled side "
                             "by side: float32 (as loaded) and models/quantize.py FORMATS "
                             "(bfloat16, int8, fp8, int4).")

# Pieces of a decode step, by what the source line of an op's root instruction computes.
_DECODE_PIECES = [
    ("layers: q|k|v matmul", r'layer\["qkv"\]|qkv\['),
    ("layers: o matmul", r'layer\["o"\]'),
    ("layers: gate|up matmul", r'layer\["gate_up"\]'),
    ("layers: down matmul (+ SwiGLU)", r'layer\["down"\]'),
    ("attention: KV cache writes", r"dynamic_update_slice|transpose\((k|v),"),
    ("attention: q.k, softmax, p.v", r"scores|probs|qg =|attention_mask|mask\["),
    ("LM head matmul", r'output_head\(|btd,dv->btv|lm_head|embed"\]\.T'),
]


def _hlo_table(hlo: str, name: str) -> dict[int, str]:
  match = re.search(r"\n" + name + r"\n(.*?)\n\n", hlo, re.S)
  if not match:
    return {}
  return {int(k): v for k, v in (line.split(" ", 1) for line in match.group(1).splitlines())}


_CONTAINERS = ("while", "conditional", "call")  # their events enclose their bodies' ops
_MINOR = ("layers: norms, RoPE, residuals, embedding", "loop bookkeeping (sampling/sampler.py)")


DEQUANTISE = "weights: dequantise (models/quantize.py)"


def decode_piece(file: str, function: str, text: str) -> str:
  """The piece of a decode step an op belongs to, from where it was written."""
  if file == "logits.py" or function in ("draw_rows", "draw") or "fold_in" in text:
    return "sampling (sampling/logits.py)"
  if file == "quantize.py":
    return DEQUANTISE
  if file == "transformer.py":
    if function == "output_head":
      return "LM head matmul"
    for piece, pattern in _DECODE_PIECES:
      if re.search(pattern, text):
        return piece
    return _MINOR[0]
  return _MINOR[1]


def _combined(pieces: set[str]) -> str:
  """One label for a fusion of ops from several pieces ("a + b"); norms, residuals and loop
  bookkeeping fused into a larger piece are not named."""
  major = pieces - set(_MINOR) or pieces
  return " + ".join(sorted(major))


def hlo_sources(hlo: str) -> dict[str, tuple[str, str]]:
  """Instruction name -> (region, piece) from a compiled HLO module's text. region is
  'decode' (the decode loop), 'prefill' or 'setup', from the instruction's op name; piece
  (`decode_piece`) from the source lines of the ops a fusion holds (all of them: XLA:CPU
  fuses, e.g., attention's p.v reduction into the o projection's matmul). An instruction
  without metadata (a copy XLA inserted) takes the region most of its computation's
  instructions have; control-flow instructions (whose trace events span their bodies) are
  left out."""
  files = {k: v.strip('"') for k, v in _hlo_table(hlo, "FileNames").items()}
  functions = {k: v.strip('"') for k, v in _hlo_table(hlo, "FunctionNames").items()}
  fields = lambda v: {k: int(x) for k, x in re.findall(r"(\w+)=(\d+)", v)}
  locations = {k: fields(v) for k, v in _hlo_table(hlo, "FileLocations").items()}
  frames = {k: fields(v) for k, v in _hlo_table(hlo, "StackFrames").items()}
  instruction = re.compile(r"^\s*(?:ROOT )?%(\S+) = (?:\([^()]*\)|\S+) ([\w-]+)\(")
  metadata = re.compile(r'metadata=\{op_name="([^"]*)"(?:[^}]*?stack_frame_id=(\d+))?')
  calls = re.compile(r"calls=%([^,\s]+)")
  regions, pieces, fusions, computation = {}, {}, {}, None
  members = collections.defaultdict(list)
  computation_pieces = collections.defaultdict(set)
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      computation = line.split(" ", 1)[0].lstrip("%")
      continue
    m = instruction.match(line)
    if not m:
      continue
    name, opcode, meta = m.group(1), m.group(2), metadata.search(line)
    if opcode == "fusion" and calls.search(line):
      fusions[name] = calls.search(line).group(1)
    if meta and opcode != "parameter":
      frame = int(meta.group(2) or 0)
      if frame in frames and frames[frame]["file_location_id"] in locations:
        loc = locations[frames[frame]["file_location_id"]]
        path = files[loc["file_name_id"]]
        pieces[name] = decode_piece(os.path.basename(path), functions[loc["function_name_id"]],
                                    linecache.getline(path, loc["line"]).strip())
        computation_pieces[computation].add(pieces[name])
    if opcode in _CONTAINERS:
      continue
    members[computation].append(name)
    regions[name] = None if not meta else (
        "prefill" if "jit(forward)" in meta.group(1) else
        "decode" if "while/body" in meta.group(1) else "setup")
  out = {}
  for names in members.values():
    counts = collections.Counter(regions[n] for n in names if regions[n])
    default = counts.most_common(1)[0][0] if counts else "setup"
    for n in names:
      inner = computation_pieces.get(fusions.get(n), set())
      piece = _combined(inner) if inner else pieces.get(n, _MINOR[1])
      out[n] = (regions[n] or default, piece)
  return out


def trace_events(log_dir: str) -> list[dict]:
  """The complete ('X') events of the perfetto trace jax.profiler wrote under log_dir."""
  path, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  return [e for e in events if e.get("ph") == "X"]


def in_place_profile(compiled, run, steps: int) -> dict:
  """Traces one call of `run` (the compiled `generate`) and sums its ops' kernel time by
  piece: ms per decode step for the loop's pieces, ms per call for prefill and setup."""
  sources = hlo_sources(compiled.as_text())
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      wall = timed(run)
    events = trace_events(log_dir)
  per_piece = collections.defaultdict(float)
  ops = collections.Counter()
  for event in events:
    if event["name"] not in sources:
      continue
    region, piece = sources[event["name"]]
    piece = piece if region == "decode" else region
    per_piece[piece] += event["dur"] / 1e3  # us -> ms
    ops[piece] += 1
  decode_ms = {k: v / steps for k, v in per_piece.items() if k not in ("prefill", "setup")}
  return dict(traced_call_s=wall, decode_ms_per_step=decode_ms,
              decode_ops_per_step={k: ops[k] / steps for k in decode_ms},
              prefill_ms=per_piece.get("prefill", 0.0), setup_ms=per_piece.get("setup", 0.0),
              decode_total_ms_per_step=sum(decode_ms.values()))


def best_of(fn, repeats: int) -> float:
  """Best seconds of `repeats` calls of fn (blocking) after one untimed call."""
  fn()
  return min(timed(fn) for _ in range(repeats))


def apart_profile(config: ModelConfig, params, batch: int, prompt_len: int, steps: int,
                  temperature: float, repeats: int, run_generate, prompts, mask) -> dict:
  """Seconds of each piece jitted alone (see the module docstring), per step or per call."""
  c = config
  sampling_config = SamplingConfig(max_new_tokens=steps, temperature=temperature)
  slots = prompt_len + steps
  layers = jax.jit(lambda p: transformer.unstack_layers(p, c, slots))(params)
  state = jax.jit(lambda p, t, m: sampler.prefill(p, t, m, jax.random.PRNGKey(0), c,
                                                  sampling_config))(params, prompts, mask)
  cache = transformer.to_decode_cache(state.cache)
  kv_mask = jnp.ones((batch, slots), bool)
  x0 = jax.random.normal(jax.random.PRNGKey(3), (batch, 1, c.d_model), c.jnp_dtype)

  @jax.jit
  def blocks(layers, cache, x):
    cos = layers["rope_cos"][prompt_len][None, None, None]
    sin = layers["rope_sin"][prompt_len][None, None, None]

    def body(i, carry):
      x, cache = carry
      mask = transformer.attention_mask(kv_mask, 1, prompt_len + i)
      new = []
      for layer, layer_cache in zip(layers["layers"], cache):
        x, layer_cache = transformer._decode_block(x, layer, cos, sin, layer_cache, mask,  # pylint: disable=protected-access
                                                   prompt_len + i, c)
        new.append(layer_cache)
      return x, tuple(new)
    return jax.lax.fori_loop(0, steps, body, (x, cache))[0]

  def head_loop(head_of):
    @jax.jit
    def run(p, x):
      def body(_, x):
        logits = jnp.einsum("btd,dv->btv", x, head_of(p), preferred_element_type=jnp.float32)
        return x + 1e-6 * logits[..., :c.d_model].astype(x.dtype)  # the next step depends on it
      return jax.lax.fori_loop(0, steps, body, x)
    return run

  head = transformer.output_head(params, c)
  tied = lambda p: p["embed"].T if c.tie_embeddings else p["lm_head"]
  copy = jax.block_until_ready(jnp.asarray(head) + 0)  # a [D, V] array of its own

  @jax.jit
  def choose(logits, key):
    rows = jnp.arange(batch)

    def body(i, carry):
      total, logits = carry
      uniform = jax.vmap(lambda r: jax.random.uniform(
          jax.random.fold_in(jax.random.fold_in(key, i), r)))(rows)
      tokens, logp = sample_with_uniform(uniform, logits, temperature)
      shift = (jnp.sum(logp) + jnp.sum(tokens).astype(jnp.float32)) * 1e-12
      return total + shift, logits + shift
    return jax.lax.fori_loop(0, steps, body, (jnp.zeros(()), logits))[0]

  logits0 = 4.0 * jax.random.normal(jax.random.PRNGKey(4), (batch, c.vocab_size), jnp.float32)
  prefill = jax.jit(lambda p, t, m: sampler.prefill(p, t, m, jax.random.PRNGKey(0), c,
                                                    sampling_config).next_logits)
  setup = jax.jit(lambda p, cache: (transformer.unstack_layers(p, c, slots),
                                    transformer.to_decode_cache(cache)))
  head_tied, head_copy = head_loop(tied), head_loop(lambda p: p)
  seconds = dict(
      blocks=best_of(lambda: blocks(layers, cache, x0).block_until_ready(), repeats) / steps,
      head_as_in_decode=best_of(lambda: head_tied(params, x0).block_until_ready(),
                                repeats) / steps,
      head_transposed_copy=best_of(lambda: head_copy(copy, x0).block_until_ready(),
                                   repeats) / steps,
      sampling=best_of(lambda: choose(logits0, jax.random.PRNGKey(5)).block_until_ready(),
                       repeats) / steps,
      prefill_call=best_of(lambda: prefill(params, prompts, mask).block_until_ready(), repeats),
      setup_call=best_of(lambda: jax.block_until_ready(setup(params, state.cache)), repeats),
      generate_call=best_of(run_generate, repeats))
  seconds["decode_step"] = (seconds["generate_call"] - seconds["prefill_call"]) / steps
  seconds["loop_overhead"] = seconds["decode_step"] - (
      seconds["blocks"] + seconds["head_as_in_decode"] + seconds["sampling"]
      + seconds["setup_call"] / steps)
  return seconds


def step_bytes(config: ModelConfig, params, batch: int, prompt_len: int, steps: int) -> dict:
  """Bytes one decode step must read: every weight once, as stored (a quantised sampler's
  int8 / fp8 values and their scales; the tied head counted once, as the embedding rows a
  step gathers are negligible) and the rows' KV cache."""
  return dict(weights=quantize.weight_bytes(params),
              kv=batch * kv_read_per_token(config, prompt_len, steps))


def profile_batch(config, params, batch, prompt_len, steps, temperature, repeats, bandwidth,
                  peak) -> dict:
  prompts = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 3, config.vocab_size)
  mask = jnp.ones((batch, prompt_len), bool)
  sampling_config = SamplingConfig(max_new_tokens=steps, temperature=temperature)
  compiled = generate.lower(params, prompts, mask, jax.random.PRNGKey(0), config,
                            sampling_config).compile()
  run = lambda: compiled(params, prompts, mask, jax.random.PRNGKey(7)).tokens.block_until_ready()
  run()
  apart = apart_profile(config, params, batch, prompt_len, steps, temperature, repeats, run,
                        prompts, mask)
  in_place = in_place_profile(compiled, run, steps)
  moved = step_bytes(config, params, batch, prompt_len, steps)
  flops = decode_flops_per_token(config, prompt_len + steps / 2) * batch
  return dict(batch=batch, prompt_len=prompt_len, new_tokens=steps, temperature=temperature,
              in_place=in_place, apart_s=apart, step_bytes=moved,
              bandwidth_floor_s=(moved["weights"] + moved["kv"]) / bandwidth,
              step_flops=flops, peak_floor_s=flops / peak)


def tokens_per_s(row: dict) -> float:
  """Generated tokens per second of a row's `generate` call (prefill included)."""
  return row["batch"] * row["new_tokens"] / row["apart_s"]["generate_call"]


def weights_table(result: dict) -> list[str]:
  """The weight formats side by side: tokens/s and its ratio to float32 at each batch, the
  decode step against its bounds (the bytes it reads at the measured streaming read, its
  FLOPs at the matmul peak), the in-place time of dequantising the weights, and the
  quantisation's cost once per publish."""
  reference = {r["batch"]: tokens_per_s(r) for r in result["batches"]
               if r.get("weights", "float32") == "float32"}
  lines = ["| weights | batch | tokens/s | vs float32 | decode step ms | weights MB per step | "
           "read floor ms | FLOP floor ms | dequantise ms per step | quantise per publish s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in result["batches"]:
    weights, rate = r.get("weights", "float32"), tokens_per_s(r)
    ratio = f"{rate / reference[r['batch']]:.2f}" if r["batch"] in reference else "-"
    dequantise = r["in_place"]["decode_ms_per_step"].get(DEQUANTISE, 0.0)
    lines.append(f"| {weights} | {r['batch']} | {rate:.0f} | {ratio} | "
                 f"{1e3 * r['apart_s']['decode_step']:.1f} | "
                 f"{r['step_bytes']['weights'] / 1e6:.0f} | {1e3 * r['bandwidth_floor_s']:.1f} | "
                 f"{1e3 * r['peak_floor_s']:.1f} | {dequantise:.2f} | "
                 f"{result.get('publish_s', {}).get(weights, 0.0):.3f} |")
  return lines


def markdown(result: dict) -> str:
  lines = [f"Weights: {result['checkpoint']} ({result['config']})", "",
           f"f32 matmul peak {result['matmul_peak_flops'] / 1e9:.1f} GFLOP/s, streaming read "
           f"{result['stream_bandwidth'] / 1e9:.1f} GB/s; load before: {result['load_before']}; "
           f"after: {result['load_after']}", ""]
  if len({r.get("weights", "float32") for r in result["batches"]}) > 1:
    lines += weights_table(result) + [""]
  for r in result["batches"]:
    place, apart = r["in_place"], r["apart_s"]
    step_ms = 1e3 * apart["decode_step"]
    lines += [f"**{r.get('weights', 'float32')} weights, batch {r['batch']}**, prompt "
              f"{r['prompt_len']}, {r['new_tokens']} new tokens, "
              f"T = {r['temperature']}: `generate` {apart['generate_call']:.2f} s per call "
              f"({r['batch'] * r['new_tokens'] / apart['generate_call']:.0f} tok/s), prefill "
              f"{apart['prefill_call']:.2f} s, so a decode step takes {step_ms:.1f} ms; the "
              f"traced call took {place['traced_call_s']:.2f} s.", "",
              "In place (kernel time of the traced call, by piece):", "",
              "| piece | ms per step | share | ops per step |", "|---|---|---|---|"]
    total = place["decode_total_ms_per_step"]
    for piece, ms in sorted(place["decode_ms_per_step"].items(), key=lambda kv: -kv[1]):
      lines.append(f"| {piece} | {ms:.2f} | {100 * ms / total:.1f}% | "
                   f"{place['decode_ops_per_step'][piece]:.0f} |")
    lines += [f"| **decode step, all ops** | **{total:.2f}** | 100% | |",
              f"| prefill (per call) | {place['prefill_ms']:.0f} | | |",
              f"| setup: unstack_layers, cache conversion (per call) | {place['setup_ms']:.0f} | | |",
              "", "Apart (each piece jitted alone, in a loop of the same steps, best of "
              f"{result['repeats']}):", "", "| piece | ms per step | share of the step |",
              "|---|---|---|"]
    pieces = [("layer blocks", apart["blocks"]),
              ("LM head, x @ embed.T (as in forward_decode)", apart["head_as_in_decode"]),
              ("LM head against a [D, V] copy transposed once", apart["head_transposed_copy"]),
              ("sampling (T = 1 token choice over the vocabulary)", apart["sampling"]),
              ("setup per call / steps", apart["setup_call"] / r["new_tokens"]),
              ("loop overhead (step - blocks - head - sampling - setup)", apart["loop_overhead"]),
              ("**decode step** ((generate - prefill) / steps)", apart["decode_step"])]
    for name, seconds in pieces:
      lines.append(f"| {name} | {1e3 * seconds:.2f} | {100 * seconds / apart['decode_step']:.0f}% |")
    b = r["step_bytes"]
    lines += ["", f"A step reads {b['weights'] / 1e6:.0f} MB of weights and {b['kv'] / 1e6:.0f} MB "
              f"of KV cache: {1e3 * r['bandwidth_floor_s']:.1f} ms at the measured streaming "
              f"read; its {r['step_flops'] / 1e9:.2f} GFLOP take {1e3 * r['peak_floor_s']:.1f} ms "
              "at the matmul peak.", ""]
  return "\n".join(lines) + "\n"


def publish_seconds(params, weights: str, repeats: int) -> float:
  """Best seconds of quantising `params` to `weights` (the jitted `quantize_params`, as the
  launcher runs it once per parameter publish; 0 for float32)."""
  if weights == "float32":
    return 0.0
  quantized = jax.jit(lambda p: quantize.quantize_params(p, weights))
  return best_of(lambda: jax.block_until_ready(quantized(params)), repeats)


def sampler_weights(params, weights: str):
  """The sampler's parameters in format `weights` (float32: as loaded)."""
  if weights == "float32":
    return params
  return jax.block_until_ready(jax.jit(lambda p: quantize.quantize_params(p, weights))(params))


def main(argv):
  del argv
  # The attribution reads source lines from the compiled HLO's metadata, which the
  # persistent cache's key leaves out: an executable cached by an earlier version of the
  # code would carry that version's line numbers. Compile afresh.
  jax.config.update("jax_enable_compilation_cache", False)
  if _SMOKE.value:
    config = get_preset("b1").replace(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                                      head_dim=16, mlp_dim=64, vocab_size=256, max_seq_len=64,
                                      tie_embeddings=True)
    params = transformer.init_params(config, jax.random.PRNGKey(0))
    batches, prompt_len, steps, repeats, checkpoint = [2], 4, 4, 1, "(smoke: random tiny)"
  else:
    config, params, _ = load_pretrained(_CHECKPOINT.value)
    batches, prompt_len, steps = map(int, _BATCHES.value), _PROMPT_LEN.value, _NEW_TOKENS.value
    repeats, checkpoint = _REPEATS.value, _CHECKPOINT.value
  batches = list(batches)
  for weights in _WEIGHTS.value:
    if weights != "float32":
      quantize.get_format(weights)  # an unknown name fails before any work
  load_before = load()
  peak = matmul_peak_flops(256 if _SMOKE.value else 2048, repeats)
  bandwidth = stream_bandwidth(2 ** 20 if _SMOKE.value else 2 ** 28, repeats)
  rows, publish = [], {}
  for weights in _WEIGHTS.value:
    publish[weights] = publish_seconds(params, weights, repeats)
    sampler_params = sampler_weights(params, weights)
    for batch in batches:
      rows.append(dict(profile_batch(config, sampler_params, batch, prompt_len, steps,
                                     _TEMPERATURE.value, repeats, bandwidth, peak),
                       weights=weights))
      print(f"{weights}, batch {batch}: decode step "
            f"{1e3 * rows[-1]['apart_s']['decode_step']:.1f} ms", flush=True)
  result = {"device": str(jax.devices()[0]), "checkpoint": checkpoint, "config": str(config),
            "repeats": repeats, "matmul_peak_flops": peak, "stream_bandwidth": bandwidth,
            "load_before": load_before, "load_after": load(), "batches": rows,
            "publish_s": publish, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  write_results(_OUT.value, "profile_decode", result, markdown, None)


if __name__ == "__main__":
  app.run(main)
