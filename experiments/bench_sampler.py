"""Benchmark B1 (docs/benchmarks.md): sampler throughput and utilisation, Arbor vs its peers.

    python -m experiments.bench_sampler                 # B1 shapes, Arbor + Tunix + transformers
    python -m experiments.bench_sampler --peers=        # Arbor only
    python -m experiments.bench_sampler --smoke         # tiny shapes, one repetition (CI)
    python -m experiments.bench_sampler --checkpoint=smollm2 --batch_sizes=16,64 --prompt_len=64 \
        --new_tokens=128 --temperatures=1 --peers=torch   # B8: SmolLM2, Arbor vs transformers

Every row of the B1 table decodes exactly `new_tokens` tokens (no stop tokens; the peers
forbid EOS). The long-tailed batch (Arbor only; --long_tail_batch rows) stops each row at
the length of one of the default task's worked solutions (running_sum: 21 to 101 tokens,
median 21) and counts only those real tokens; it is decoded twice, by the decode loop as
configured (phases and live-row compaction, `sampling.sampler.decode`) and as one
full-width, full-length loop (phase_tokens = compact_min_rows = 0, the loop before them).
Arbor's KV-cache bytes per token and the compiled program's peak memory (arguments +
outputs + temporaries) are reported per case, each peer process's peak resident memory
once.
Arbor runs in this process; each peer (Tunix's Qwen2 + sampler, Hugging Face
transformers `generate` on torch CPU) runs the same shapes in its own virtualenv
(experiments/peers, created once under --peer_envs), in the same invocation. Every side
times the same work: a [B, P] token array in, the [B, P + N] token array out, with no
tokenizer, host copy or detokenisation in the timed call (Arbor: its compiled `generate`;
Tunix: its sampler's state init, jitted prefill and decode loop, below `Sampler.__call__`;
transformers: `generate` on token tensors; each peer's docstring says exactly). Reports
generated tokens/s (best of --repeats after a compiling/warm-up call), the compile (or
warm-up) time, Arbor's ratio to each peer, and model FLOP utilisation against a large f32
matmul timed in this run. The machine's streaming read bandwidth is measured too: per batch,
Arbor's greedy tokens/s at the longest completion over the shortest ("flat cost") is shown
next to the ratio that reading each step's extra KV cache at that bandwidth would allow.
Peers are skipped when the environment variable CI is set. With --checkpoint (a Hugging
Face folder, a .gguf file or "smollm2"; B8), Arbor decodes the given shapes with those
weights in float32 (random prompt tokens: throughput does not depend on them), and the
torch peer runs transformers `generate` on the same weights, which Arbor writes once as a
Hugging Face folder under --peer_weights (`experiments.peers.export_weights`) and checks
first: transformers' logits on a fixed token row must match Arbor's (top 8 per position,
reported as `parity_max_abs`). Tunix's peer cannot load weights and is skipped there, as is
the long-tailed batch.
Writes bench_sampler.json, bench_sampler.md and bench_sampler.png to --out.
"""

from __future__ import annotations

import functools
import itertools
import resource
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import peers
from experiments.decode_cost import decode_flops_per_token, flat_cost, kv_bytes_per_token
from experiments.decode_cost import kv_read_per_token
from experiments.measure import load, matmul_peak_flops, stream_bandwidth, timed, write_results
from experiments.peers import PEER_LABELS, peer_shape
from models import transformer
from models.config import ModelConfig, get_preset
from models.pretrained import load_pretrained
from sampling import sampler
from sampling.sampler import SamplingConfig, generate

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes, one repetition (for CI).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions per case (best is reported).")
_OUT = flags.DEFINE_string("out", "runs/bench_sampler", "Output directory.")
_PEERS = flags.DEFINE_list("peers", ["tunix", "torch"], "Peers to run (tunix, torch); empty: none.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["16", "64"], "B1 batch sizes.")
_NEW_TOKENS = flags.DEFINE_list("new_tokens", ["64", "256", "1024"], "B1 completion lengths.")
_LONG_TAIL = flags.DEFINE_integer("long_tail_batch", 64, "Rows of the long-tailed batch (0: skip).")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Rounds of (Arbor, peers), order alternating.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "Time these weights (HF folder, .gguf or "
                                  "'smollm2'; Arbor and the torch peer) instead of the B1 "
                                  "decoder.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per row.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "1"], "Sampling temperatures (0: greedy).")
_PEER_ENVS, _PEER_WEIGHTS = peers.location_flags()


def peak_bytes(compiled) -> int:
  """A compiled program's peak memory: arguments + outputs + temporaries - aliased."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)


def bench_case(config: ModelConfig, params, batch: int, prompt_len: int, new_tokens: int,
               temperature: float, repeats: int) -> dict:
  prompts = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 3, config.vocab_size)
  mask = jnp.ones((batch, prompt_len), bool)
  sampling_config = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature)
  # Compiled once, explicitly: the same executable is timed and its memory analysed.
  start = time.perf_counter()
  compiled = generate.lower(params, prompts, mask, jax.random.PRNGKey(0), config,
                            sampling_config).compile()
  compile_s = time.perf_counter() - start
  run = lambda seed: compiled(params, prompts, mask, jax.random.PRNGKey(seed)
                              ).tokens.block_until_ready()
  run(0)
  best = min(timed(lambda: run(seed)) for seed in range(1, repeats + 1))
  return dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
              temperature=temperature, tokens_per_s=batch * new_tokens / best, best_s=best,
              compile_s=compile_s,
              kv_bytes=kv_bytes_per_token(config) * batch * (prompt_len + new_tokens),
              peak_bytes=peak_bytes(compiled))


def task_lengths(rows: int) -> tuple[list[int], int]:
  """Completion lengths (EOS included) of the default task's first `rows` training items'
  worked solutions, and the default completion budget."""
  from experiments.configs import default  # pylint: disable=import-outside-toplevel
  from rl.tasks import make_task  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  task = make_task(config.task.name, **config.task.difficulty)
  return ([len(e.entry["solution"]) + 1 for e in task.examples("train", rows)],
          config.rollout.max_new_tokens)


@functools.partial(jax.jit, static_argnames=("model_config", "sampling_config"))
def _generate_lengths(params, prompts, mask, rng, lengths, model_config, sampling_config):
  """Prefill + decode where row r stops after lengths[r] tokens (a per-row budget)."""
  state = sampler.prefill(params, prompts, mask, rng, model_config, sampling_config)
  budget = state.next_position + lengths
  return sampler.decode(params, state, jnp.int32(0), model_config, sampling_config,
                        position_limit=budget).token_mask


def long_tail_case(config: ModelConfig, params, batch: int, prompt_len: int, temperature: float,
                   repeats: int) -> dict:
  """Real tokens/s on a batch whose rows stop at the default task's solution lengths:
  the decode loop as configured vs one full-width, full-length loop."""
  lengths, new_tokens = task_lengths(batch)
  prompts = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 3, config.vocab_size)
  mask = jnp.ones((batch, prompt_len), bool)
  lengths_array = jnp.asarray(lengths, jnp.int32)
  row = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, temperature=temperature,
             real_tokens=sum(lengths), median_len=float(np.median(lengths)), max_len=max(lengths))
  loops = {"phased": SamplingConfig(max_new_tokens=new_tokens, temperature=temperature),
           "one_loop": SamplingConfig(max_new_tokens=new_tokens, temperature=temperature,
                                      phase_tokens=0, compact_min_rows=0)}
  for name, sampling_config in loops.items():
    run = lambda seed, c=sampling_config: _generate_lengths(
        params, prompts, mask, jax.random.PRNGKey(seed), lengths_array, config,
        c).block_until_ready()
    generated = int(run(0)[:, prompt_len:].sum())
    assert generated == sum(lengths), (generated, sum(lengths))
    best = min(timed(lambda: run(seed)) for seed in range(1, repeats + 1))
    row[name] = dict(real_tokens_per_s=sum(lengths) / best, best_s=best)
  row["phased_over_one_loop"] = (row["phased"]["real_tokens_per_s"]
                                 / row["one_loop"]["real_tokens_per_s"])
  return row


def markdown(result: dict) -> str:
  names = result["frameworks"]
  head = ["batch", "new tokens", "T"] + [f"{PEER_LABELS[n]} tok/s" for n in names]
  head += [f"Arbor / {PEER_LABELS[n]}" for n in names[1:]]
  head += [f"{PEER_LABELS[n]} compile s" for n in names]
  head += [f"{PEER_LABELS[n]} util" for n in names]
  head += ["Arbor KV MiB", "Arbor peak MiB"]
  lines = []
  if result["checkpoint"]:
    weights = f"Weights: {result['checkpoint']} (float32)"
    if result.get("peer_weights"):
      weights += f"; the peers load the same weights from {result['peer_weights']}"
    for name, diff in result.get("parity_max_abs", {}).items():
      weights += (f"; {PEER_LABELS[name]}'s logits differ from Arbor's by at most {diff:.1e} "
                  "(top 8 of 16 positions)")
    lines.append(weights + ".\n")
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for case in result["cases"]:
    cells = [str(case["batch"]), str(case["new_tokens"]), str(case["temperature"])]
    cells += [f"{case[n]['tokens_per_s']:.0f}" for n in names]
    cells += [f"{case['arbor']['tokens_per_s'] / case[n]['tokens_per_s']:.2f}x" for n in names[1:]]
    cells += [f"{case[n]['compile_s']:.1f}" for n in names]
    cells += [f"{100 * case[n]['utilisation']:.1f}%" for n in names]
    cells += [f"{case['arbor']['kv_bytes'] / 2**20:.1f}", f"{case['arbor']['peak_bytes'] / 2**20:.1f}"]
    lines.append("| " + " | ".join(cells) + " |")
  memory = [f"KV cache {result['kv_bytes_per_token']} bytes per token (Arbor, "
            f"{result['kv_dtype']}); peak resident memory per process:"]
  memory += [f"{PEER_LABELS[n]} {result['max_rss_bytes'][n] / 2**20:.0f} MiB" for n in names
             if n in result["max_rss_bytes"]]
  text = "\n".join(lines) + "\n\n" + " ".join(memory) + "\n"
  text += (f"\nMemory: a streaming read runs at {result['stream_bandwidth'] / 1e9:.1f} GB/s; "
           f"f32 matmul peak {result['matmul_peak_flops'] / 1e9:.1f} GFLOP/s.")
  for f in result["flat_cost"]:
    text += (f" Batch {f['batch']}, greedy: tokens/s at {f['long']} new tokens is "
             f"{f['measured']:.2f}x that at {f['short']}; reading each step's extra KV cache at "
             f"that bandwidth alone would allow {f['bandwidth_floor']:.2f}x.")
  text += f"\n\nLoad before: {result['load_before']}\nLoad after: {result['load_after']}\n"
  for tail in result["long_tail"]:
    text += (f"\nLong-tailed batch ({tail['batch']} rows, T = {tail['temperature']}, "
             f"{tail['new_tokens']} slots, rows stop at the default task's solution lengths: "
             f"median {tail['median_len']:.0f}, max {tail['max_len']}; "
             f"{tail['real_tokens']} real tokens): real tokens/s "
             f"{tail['phased']['real_tokens_per_s']:.0f} with phases and compaction, "
             f"{tail['one_loop']['real_tokens_per_s']:.0f} as one full-width loop "
             f"({tail['phased_over_one_loop']:.2f}x).\n")
  return text


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  names, cases = result["frameworks"], result["cases"]
  fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cases)), 4))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    ax.bar([j + i * width for j in range(len(cases))], [c[name]["tokens_per_s"] for c in cases],
           width, label=PEER_LABELS[name])
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
  ax.set_xticklabels([f"B{c['batch']} N{c['new_tokens']}\nT={c['temperature']:g}" for c in cases])
  ax.set_ylabel("generated tokens / s")
  ax.set_title("B1 sampler throughput (best of N, same machine, same run)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  if _SMOKE.value:
    config = get_preset("b1").replace(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                      head_dim=16, mlp_dim=64, vocab_size=64)
    cases = [(2, 4, 4, 0.0), (2, 4, 4, 1.0)]
    repeats, peak_size, tail_rows = 1, 256, 4
  else:
    config = get_preset("b1")
    cases = list(itertools.product(map(int, _BATCHES.value), (_PROMPT_LEN.value,),
                                   map(int, _NEW_TOKENS.value), map(float, _TEMPERATURES.value)))
    repeats, peak_size, tail_rows = _REPEATS.value, 2048, _LONG_TAIL.value
  max_seq_len = max(p + n for _, p, n, _ in cases)
  spec = dict(repeats=repeats, cases=[dict(batch=b, prompt_len=p, new_tokens=n, temperature=t)
                                      for b, p, n, t in cases])
  skipped, parity_tokens = [], None
  if _CHECKPOINT.value:
    config, params, tokenizer = load_pretrained(_CHECKPOINT.value)
    if max_seq_len > config.max_seq_len:
      raise ValueError(f"--new_tokens needs {max_seq_len} positions; {_CHECKPOINT.value!r} has "
                       f"{config.max_seq_len}.")
    peer_names, skipped = peers.weight_peers(_PEERS.value)
    tail_rows = 0
    for name in skipped:
      print(f"{PEER_LABELS[name]} skipped: its peer cannot load {_CHECKPOINT.value!r}.", flush=True)
    if peer_names:
      if tokenizer is None:
        raise ValueError(f"{_CHECKPOINT.value!r} has no tokenizer to hand the peers.")
      folder = peers.weights_folder(_PEER_WEIGHTS.value, _CHECKPOINT.value)
      spec.update(weights=peers.export_weights(folder, params, config, tokenizer,
                                               _CHECKPOINT.value),
                  pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
      parity_tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (1, 16), 3,
                                                    config.vocab_size)).tolist()
      spec["parity_tokens"] = parity_tokens
  else:
    config = config.replace(max_seq_len=max_seq_len)
    params = transformer.init_params(config, jax.random.PRNGKey(0))
    peer_names = peers.peers_enabled(_PEERS.value)
  spec["shape"] = peer_shape(config)
  load_before = load()
  peak = matmul_peak_flops(peak_size, repeats)
  bandwidth = stream_bandwidth(2 ** 28 if not _SMOKE.value else 2 ** 20, repeats)

  def run(name: str) -> list[dict]:
    if name == "arbor":
      return [bench_case(config, params, *case, repeats) for case in cases]
    out = peers.run_peer(name, spec, _PEER_ENVS.value)
    if "parity" in out:
      parity[name] = peers.parity_max_abs(config, params, parity_tokens, out.pop("parity"))
      print(f"{PEER_LABELS[name]} logits vs Arbor's, max abs difference over the top 8: "
            f"{parity[name]:.2e}", flush=True)
    versions[name] = {k: v for k, v in out.items() if k != "generate"}
    return out["generate"]

  # Rounds alternate the order (Arbor first, then last) so that a drifting machine load
  # favours no one; each case keeps its best round, and the first round's compile time.
  versions, by_framework, parity = {}, {}, {}
  order = ["arbor"] + peer_names
  for round_index in range(_ROUNDS.value):
    for name in order if round_index % 2 == 0 else order[::-1]:
      rows = run(name)
      for row in rows:
        print(f"{PEER_LABELS[name]} batch {row['batch']:3d} new {row['new_tokens']:3d} "
              f"T={row['temperature']}: {row['tokens_per_s']:9.0f} tok/s  "
              f"compile {row['compile_s']:.1f} s", flush=True)
      if name in by_framework:
        rows = [dict(new, compile_s=old["compile_s"]) if new["best_s"] < old["best_s"] else old
                for old, new in zip(by_framework[name], rows)]
      by_framework[name] = rows
  frameworks = ["arbor"] + peer_names
  rows = []
  for i, (batch, prompt_len, new_tokens, temperature) in enumerate(cases):
    row = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, temperature=temperature,
               kv_read_per_token=kv_read_per_token(config, prompt_len, new_tokens))
    flops_per_token = decode_flops_per_token(config, prompt_len + new_tokens / 2)
    for name in frameworks:
      r = dict(by_framework[name][i])
      r["utilisation"] = flops_per_token * r["tokens_per_s"] / peak
      row[name] = {k: r[k] for k in ("tokens_per_s", "best_s", "compile_s", "utilisation",
                                     "kv_bytes", "peak_bytes") if k in r}
    for name in peer_names:
      row[f"arbor_over_{name}"] = row["arbor"]["tokens_per_s"] / row[name]["tokens_per_s"]
    rows.append(row)
  long_tail = [long_tail_case(config, params, tail_rows, 16, temperature, repeats)
                for temperature in (0.0, 1.0)] if tail_rows else []
  max_rss = {name: v.pop("max_rss_bytes") for name, v in versions.items()
             if "max_rss_bytes" in v}
  max_rss["arbor"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  result = {"device": str(jax.devices()[0]), "checkpoint": _CHECKPOINT.value,
            "peer_weights": spec.get("weights"), "peers_skipped": skipped,
            "parity_max_abs": parity, "matmul_peak_flops": peak,
            "stream_bandwidth": bandwidth, "config": str(config),
            "repeats": repeats, "rounds": _ROUNDS.value, "frameworks": frameworks,
            "peer_versions": versions, "kv_bytes_per_token": kv_bytes_per_token(config),
            "kv_dtype": jnp.dtype(config.jnp_dtype).name,
            "max_rss_bytes": max_rss, "long_tail": long_tail,
            "load_before": load_before, "load_after": load(), "cases": rows}
  result["flat_cost"] = [f for f in (flat_cost(result, b) for b in sorted({c[0] for c in cases}))
                         if f]
  write_results(_OUT.value, "bench_sampler", result, markdown, plot)


if __name__ == "__main__":
  app.run(main)
