"""Peer benchmark run in its own virtualenv: Tunix's Qwen2 model, its sampler and its GRPO
learner on CPU (docs/benchmarks_perf.md).

Started by experiments/bench_sampler.py and experiments/bench_train.py as

    <venv>/bin/python experiments/peers/tunix_peer.py '<json spec>'

and prints one JSON line (the results) last on stdout. Never imported by Arbor.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time

from flax import nnx
import jax
import numpy as np
import optax
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen2 import model as qwen2

import peer_memory  # this folder (see peer_memory's docstring)


PAD, BOS, EOS = 0, 1, 2


class WordTokenizer:
  """Token id i <-> word 't{i}'; Tunix prepends BOS, so a prompt of P tokens is P-1 words."""

  def encode(self, text: str, **kwargs) -> list[int]:
    del kwargs
    return [int(w[1:]) for w in text.split()]

  def decode(self, ids, **kwargs) -> str:
    del kwargs
    return " ".join(f"t{int(i)}" for i in ids)

  def bos_id(self) -> int:
    return BOS

  def eos_id(self) -> int:
    return EOS

  def pad_id(self) -> int:
    return PAD


def qwen2_model(shape: dict) -> qwen2.Qwen2:
  config = qwen2.ModelConfig(
      num_layers=shape["n_layers"], vocab_size=shape["vocab_size"], embed_dim=shape["d_model"],
      hidden_dim=shape["mlp_dim"], num_heads=shape["n_heads"], head_dim=shape["head_dim"],
      num_kv_heads=shape["n_kv_heads"], rope_theta=int(shape["rope_theta"]),
      norm_eps=shape["norm_eps"], use_tied_embedding=False)
  return qwen2.Qwen2(config, rngs=nnx.Rngs(0))


def mesh() -> jax.sharding.Mesh:
  # Auto axes (jax.make_mesh's Explicit axes break Tunix's embedding lookup).
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def prompts(n: int, prompt_len: int, vocab_size: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(f"t{i}" for i in rng.integers(3, vocab_size, prompt_len - 1)) for _ in range(n)]


def bench_sampler(spec: dict) -> list[dict]:
  shape = spec["shape"]
  model = qwen2_model(shape)
  rows = []
  for case in spec["cases"]:
    batch, prompt_len, new_tokens, temperature = (case["batch"], case["prompt_len"],
                                                  case["new_tokens"], case["temperature"])
    sampler = sampler_lib.Sampler(model, WordTokenizer(), sampler_lib.CacheConfig(
        cache_size=prompt_len + new_tokens, num_layers=shape["n_layers"],
        num_kv_heads=shape["n_kv_heads"], head_dim=shape["head_dim"]))
    inputs = prompts(batch, prompt_len, shape["vocab_size"], 1)
    # Temperature sampling is Tunix's top_p mode (p = 1: no truncation); greedy otherwise.
    kwargs = dict(temperature=temperature, top_p=1.0) if temperature else {}

    def run(seed):
      out = sampler(inputs, max_generation_steps=new_tokens, max_prompt_length=prompt_len,
                    eos_tokens=[EOS], forbidden_tokens=[PAD, EOS], seed=seed, **kwargs)
      assert all(len(t) == new_tokens for t in out.tokens), [len(t) for t in out.tokens]
      return out

    start = time.perf_counter()
    run(0)
    first = time.perf_counter() - start
    times = []
    for seed in range(1, spec["repeats"] + 1):
      start = time.perf_counter()
      run(seed)
      times.append(time.perf_counter() - start)
    best = min(times)
    rows.append(dict(case, tokens_per_s=batch * new_tokens / best, best_s=best,
                     compile_s=max(first - best, 0.0)))
    print(f"tunix {case}: {batch * new_tokens / best:.0f} tok/s", file=sys.stderr, flush=True)
  return rows


def bench_grpo(spec: dict) -> dict:
  """Tunix GRPOLearner steps: P prompts x G completions x N tokens, f32, beta = 0."""
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=import-outside-toplevel
  from tunix.rl.grpo import grpo_learner  # pylint: disable=import-outside-toplevel
  from tunix.rl.rollout import base_rollout  # pylint: disable=import-outside-toplevel

  g, shape = spec["grpo"], spec["shape"]
  # Exactly N new tokens per row, as in Arbor's step: the rollout forbids pad and EOS.
  # A fresh integer seed per call: the sampler donates its state, so a key array held by
  # the rollout config is deleted after the first step.
  original_call = sampler_lib.Sampler.__call__
  calls = iter(range(10 ** 9))

  def forced_length_call(self, *args, **kwargs):
    kwargs.update(forbidden_tokens=[PAD, EOS], seed=next(calls))
    return original_call(self, *args, **kwargs)

  sampler_lib.Sampler.__call__ = forced_length_call
  m = mesh()
  model = qwen2_model(shape)
  steps = g["repeats"] + 2
  rollout_config = base_rollout.RolloutConfig(
      max_tokens_to_generate=g["new_tokens"], max_prompt_length=g["prompt_len"], temperature=1.0,
      top_p=1.0, top_k=None, kv_cache_size=g["prompt_len"] + g["new_tokens"],
      eos_tokens=[EOS])
  training_config = rl_cluster_lib.RLTrainingConfig(
      actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10 ** 6, max_steps=steps,
      mini_batch_size=g["prompts"], train_micro_batch_size=g["prompts"],
      checkpoint_root_directory=None)  # no checkpoints: Arbor's step writes none either
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: m, rl_cluster_lib.Role.REFERENCE: m,
                    rl_cluster_lib.Role.ROLLOUT: m},
      rollout_engine="vanilla", offload_to_cpu=False, training_config=training_config,
      rollout_config=rollout_config)
  cluster = rl_cluster_lib.RLCluster(actor=model, reference=model, tokenizer=WordTokenizer(),
                                     cluster_config=cluster_config)
  algo = grpo_learner.GRPOConfig(num_generations=g["group_size"], num_iterations=1, beta=0.0,
                                 epsilon=0.2)
  stamps = []

  def reward(prompts, completions, **kwargs):
    del prompts, kwargs  # fraction of even token ids, the same rule as Arbor's step
    stamps.append(time.perf_counter())
    return [float(np.mean([int(w[1:]) % 2 == 0 for w in c.split()] or [0.0])) for c in completions]

  learner = grpo_learner.GRPOLearner(cluster, algo, reward_fns=[reward])
  data = [{"prompts": np.array(prompts(g["prompts"], g["prompt_len"], shape["vocab_size"], s))}
          for s in range(steps)]
  start = time.perf_counter()
  learner.train(data)
  total = time.perf_counter() - start
  # The reward runs once per step, so the gaps between its calls are step times
  # (Tunix overlaps a step's rollout with the previous update: the gap is the period).
  gaps = np.diff(stamps)
  return dict(first_step_s=stamps[1] - stamps[0] if len(stamps) > 1 else total,
              best_step_s=float(gaps[1:].min()) if len(gaps) > 1 else float("nan"),
              steps=len(stamps), total_s=total)


def main():
  spec = json.loads(sys.argv[1])
  result = {"tunix": importlib.metadata.version("google-tunix"), "jax": jax.__version__}
  with mesh():
    if spec.get("cases"):
      result["generate"] = bench_sampler(spec)
    if spec.get("grpo"):
      result["grpo"] = bench_grpo(spec)
  result["max_rss_bytes"] = peer_memory.peak_rss_bytes()
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
