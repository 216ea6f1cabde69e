"""How the benchmarks measure: wall time, the machine's f32 matmul peak, and its load.

Machines here are shared (BENCHMARKS.md): every number is a best-of-N after compilation,
utilisation is model FLOP/s over a large f32 matmul timed in the same run, and each
result records the load average it was measured under.
"""

from __future__ import annotations

import subprocess
import time

import jax
import jax.numpy as jnp


def timed(fn) -> float:
  """Seconds one call of fn() takes (fn must block until its results are ready)."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def matmul_peak_flops(size: int, repeats: int) -> float:
  """Measured f32 FLOP/s of a large square matmul: the machine's practical peak."""
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  best = min(timed(lambda: dot(a, a).block_until_ready()) for _ in range(repeats))
  return 2 * size ** 3 / best


def load() -> str:
  """`uptime`: the load average the benchmark ran under."""
  return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
