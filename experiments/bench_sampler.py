"""Benchmark B1 (BENCHMARKS.md): Arbor's jitted sampler throughput and utilisation.

    python -m experiments.bench_sampler                 # B1 shapes, best of 3
    python -m experiments.bench_sampler --smoke         # tiny shapes, one repetition (CI)

Every row decodes exactly `new_tokens` tokens (no stop tokens). Reports generated tokens/s,
compile time, and model FLOP utilisation against a large f32 matmul timed in the same run.
Writes JSON and a markdown table to --out (default runs/bench_sampler).
"""

from __future__ import annotations

import itertools
import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from models import transformer
from models.config import ModelConfig, get_preset
from sampling.sampler import SamplingConfig, generate

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes, one repetition (for CI).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions per case (best is reported).")
_OUT = flags.DEFINE_string("out", "runs/bench_sampler", "Output directory.")


def matmul_peak_flops(size: int, repeats: int) -> float:
  """Measured f32 FLOP/s of a large square matmul: the machine's practical peak."""
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  best = min(_timed(lambda: dot(a, a).block_until_ready()) for _ in range(repeats))
  return 2 * size ** 3 / best


def decode_flops_per_token(config: ModelConfig, context: float) -> float:
  """Matmul FLOPs to generate one token with `context` tokens already in the cache."""
  c = config
  attn_proj = c.d_model * (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim
  mlp = 3 * c.d_model * c.mlp_dim
  attention = 2 * c.n_heads * c.head_dim * context
  return 2 * (c.n_layers * (attn_proj + mlp + attention) + c.d_model * c.vocab_size)


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def bench_case(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int,
               temperature: float, repeats: int) -> dict:
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  prompts = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 3, config.vocab_size)
  mask = jnp.ones((batch, prompt_len), bool)
  sampling_config = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature)
  run = lambda seed: generate(params, prompts, mask, jax.random.PRNGKey(seed), config,
                              sampling_config).tokens.block_until_ready()
  compile_s = _timed(lambda: run(0))
  best = min(_timed(lambda: run(seed)) for seed in range(1, repeats + 1))
  tokens_per_s = batch * new_tokens / best
  flops = decode_flops_per_token(config, prompt_len + new_tokens / 2) * tokens_per_s
  return dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
              temperature=temperature, tokens_per_s=tokens_per_s, best_s=best,
              compile_s=compile_s - best, model_flops_per_s=flops)


def main(argv):
  del argv
  if _SMOKE.value:
    config = get_preset("b1").replace(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                      head_dim=16, mlp_dim=64, vocab_size=64)
    cases = [(2, 4, 4, 0.0), (2, 4, 4, 1.0)]
    repeats, peak_size = 1, 256
  else:
    config = get_preset("b1")
    cases = list(itertools.product((16, 64), (16,), (64, 256), (0.0, 1.0)))
    repeats, peak_size = _REPEATS.value, 2048
  peak = matmul_peak_flops(peak_size, repeats)
  rows = []
  for batch, prompt_len, new_tokens, temperature in cases:
    row = bench_case(config, batch, prompt_len, new_tokens, temperature, repeats)
    row["utilisation"] = row["model_flops_per_s"] / peak
    rows.append(row)
    print(f"batch {batch:3d} new {new_tokens:3d} T={temperature}: "
          f"{row['tokens_per_s']:9.0f} tok/s  compile {row['compile_s']:.1f} s  "
          f"util {100 * row['utilisation']:.1f}%", flush=True)
  os.makedirs(_OUT.value, exist_ok=True)
  result = {"device": str(jax.devices()[0]), "matmul_peak_flops": peak, "config": str(config),
            "rows": rows}
  with open(os.path.join(_OUT.value, "bench_sampler.json"), "w") as f:
    json.dump(result, f, indent=2)
  table = ["| batch | new tokens | temperature | tokens/s | compile s | utilisation |",
           "|---|---|---|---|---|---|"]
  table += [f"| {r['batch']} | {r['new_tokens']} | {r['temperature']} | {r['tokens_per_s']:.0f} | "
            f"{r['compile_s']:.1f} | {100 * r['utilisation']:.1f}% |" for r in rows]
  with open(os.path.join(_OUT.value, "bench_sampler.md"), "w") as f:
    f.write("\n".join(table) + "\n")
  print(f"matmul peak {peak / 1e9:.1f} GFLOP/s; wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
