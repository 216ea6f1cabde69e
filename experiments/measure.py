"""How the benchmarks measure: wall time, the machine's matmul peak, its load, and the
random GRPO batch the train-step benchmarks time.

Machines here are shared (docs/benchmarks.md): every number is a best-of-N after compilation,
utilisation is model FLOP/s over a large f32 matmul timed in the same run, and each
result records the load average it was measured under.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments import provenance
from models.config import ModelConfig
from rl.types import Rollout


def timed(fn) -> float:
  """Seconds one call of fn() takes (fn must block until its results are ready)."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def matmul_peak_flops(size: int, repeats: int, dtype=jnp.float32) -> float:
  """Measured FLOP/s of a large square `dtype` matmul: the machine's practical peak (f32 on
  a CPU host; bfloat16 on an accelerator, whose matrix units run it)."""
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), dtype)
  dot = jax.jit(jnp.dot)
  dot(a, a).block_until_ready()
  best = min(timed(lambda: dot(a, a).block_until_ready()) for _ in range(repeats))
  return 2 * size ** 3 / best


def random_rollout(config: ModelConfig, groups: int, group_size: int, prompt_len: int,
                   completion_len: int, seed: int = 0) -> Rollout:
  """Groups of `group_size` rows sharing a random full-length prompt, random completions."""
  rng = np.random.default_rng(seed)
  size, length = groups * group_size, prompt_len + completion_len
  prompts = np.repeat(rng.integers(3, config.vocab_size, (groups, prompt_len)), group_size, 0)
  completions = rng.integers(3, config.vocab_size, (size, completion_len))
  completion_mask = np.arange(length)[None].repeat(size, 0) >= prompt_len
  adv = rng.normal(size=(size, 1)) * completion_mask
  return Rollout(
      tokens=jnp.asarray(np.concatenate([prompts, completions], 1), jnp.int32),
      prompt_mask=jnp.asarray(~completion_mask), completion_mask=jnp.asarray(completion_mask),
      behavior_logp=jnp.asarray(-7.0 * completion_mask, jnp.float32),
      version=jnp.zeros((size, length), jnp.int32),
      group=jnp.repeat(jnp.arange(groups), group_size), reward=jnp.zeros((size,)),
      advantages=jnp.asarray(adv, jnp.float32))


def stream_bandwidth(num_bytes: int, repeats: int) -> float:
  """Measured bytes/s of reading a large f32 array once (its sum): the practical ceiling of
  memory-bound work, such as one-query attention over a KV cache larger than the caches."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = min(timed(lambda: total(x).block_until_ready()) for _ in range(repeats))
  return num_bytes / best


def load() -> str:
  """`uptime`: the load average the benchmark ran under."""
  return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def write_results(out_dir: str, name: str, result: dict, markdown: Callable[[dict], str],
                  plot: Callable[[dict, str], None] | None) -> None:
  """Writes <name>.json, <name>.md and (with `plot`) <name>.png to out_dir and prints the
  table. The JSON records the source it ran as "commit" (`provenance.commit_label` of the
  checkout when the results are written: a commit, "-dirty-<hash>" when code differed)."""
  os.makedirs(out_dir, exist_ok=True)
  result = {"commit": provenance.commit_label(provenance.source_state(os.getcwd())), **result}
  with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(result, f, indent=2)
  table = markdown(result)
  with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
    f.write(table)
  if plot is not None:
    plot(result, os.path.join(out_dir, f"{name}.png"))
  print(table)
  peak = result.get("matmul_peak_flops")  # benchmarks that report no utilisation measure none
  peak_text = f"matmul peak {peak / 1e9:.1f} GFLOP/s; " if peak else ""
  print(f"{peak_text}{result['load_after']}; wrote {out_dir}")
