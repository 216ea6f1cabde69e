"""Peer benchmark run in its own virtualenv: Tunix's Qwen2 model, its sampler and its GRPO
learner on CPU (docs/benchmarks_perf.md).

Started by experiments/bench_sampler.py and experiments/bench_train.py as

    <venv>/bin/python experiments/peers/tunix_peer.py '<json spec>'

and prints one JSON line (the results) last on stdout. Never imported by Arbor.

What B1 times here (`bench_sampler`): token arrays in, token arrays out, the same work as
Arbor's side (a compiled `generate` on a [B, P] token array, returning [B, P + N] tokens).
Each timed call is `generate_tokens`: `Sampler.init_sample_state`, the sampler's jitted
prefill and decode loop on a pre-built [B, P] int32 prompt array, and a wait for the
[B, P + N] token buffer. No tokenizer call, no host copy and no detokenisation is timed.
Until issue #31 (item 9) the peer timed `Sampler.__call__` on prompt strings instead,
which also tokenises, pads on the host, copies the result to the host, cuts rows and
detokenises.
T = 1 draws with `jax.random.categorical` over the full vocabulary (Tunix's top_p mode
with top_p = 1, top_k = None, which skips the sort in 0.1.7); T = 0 is its greedy mode.
The GRPO learner (`bench_grpo`, B2) still takes prompt strings: that is its interface.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time

from flax import nnx
import jax
import jax.numpy as jnp
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
      norm_eps=shape["norm_eps"], use_tied_embedding=shape.get("tie_embeddings", False))
  return qwen2.Qwen2(config, rngs=nnx.Rngs(0))


def mesh() -> jax.sharding.Mesh:
  # Auto axes (jax.make_mesh's Explicit axes break Tunix's embedding lookup).
  return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def prompts(n: int, prompt_len: int, vocab_size: int, seed: int) -> list[str]:
  """Prompt strings for the GRPO learner (bench_grpo), which takes text."""
  rng = np.random.default_rng(seed)
  return [" ".join(f"t{i}" for i in rng.integers(3, vocab_size, prompt_len - 1)) for _ in range(n)]


def prompt_ids(batch: int, prompt_len: int, vocab_size: int, seed: int) -> np.ndarray:
  """[batch, prompt_len] int32 prompt tokens in [3, vocab_size): no pad, BOS or EOS, as
  Arbor's side of B1 draws them."""
  return np.random.default_rng(seed).integers(3, vocab_size, (batch, prompt_len)).astype(np.int32)


def generate_tokens(sampler, ids, new_tokens: int, temperature: float, seed: int):
  """Tunix's sampling below `Sampler.__call__`: token array in, token array out.

  What `Sampler.__call__` does between its tokenizer calls, for prompts that need no
  padding: `init_sample_state` (token buffer, positions, zeroed KV cache; eager), the
  jitted prefill (which samples the first new token), the jitted decode loop, and a wait
  for the result. Returns the [B, P + N] token buffer on the device (prompt, then N new
  tokens), as Arbor's timed call returns its token array. Left out, as on Arbor's side:
  tokenising the prompt strings, padding them on the host, copying the buffer to the host,
  cutting each row at EOS and detokenising (all done by `Sampler.__call__`).

  T > 0 is Tunix's "top_p" mode with top_p = 1 and top_k = None: in Tunix 0.1.7
  `sample_top_p` then draws with `jax.random.categorical` over the whole vocabulary
  (no sort, no softmax); T = 0 is its "greedy" mode (argmax). Pad and EOS are forbidden,
  so every row decodes exactly N tokens. Tunix's decode loop runs N steps after the prefill
  (the last step's token falls outside the [B, P + N] buffer), as in `Sampler.__call__`:
  its own work, counted. Uses the sampler's `_compiled_prefill_fn` / `_compiled_decode_fn`
  (private; google-tunix is pinned to 0.1.7).

  Why token arrays rather than strings on both sides: Arbor's sampler has no string
  interface (its RL loop samples token arrays), and this prefill + decode is what Tunix's
  own rollout runs inside `Sampler.__call__`; the string handling around it is a host cost
  set by the tokenizer (here a toy word tokenizer), not by the sampler.
  """
  batch, prompt_len = ids.shape
  _, params = sampler.model_def_and_state()
  state = sampler.init_sample_state(
      jnp.asarray(ids), total_sampling_steps=prompt_len + new_tokens, include_logits=False,
      forbidden_token_ids=(PAD, EOS), temperature=temperature,
      top_p=1.0 if temperature else None, top_k=None, seed=jax.random.PRNGKey(seed),
      beam_size=None)
  # pylint: disable=protected-access
  state = sampler._compiled_prefill_fn(params, state, None, echo=False)
  state = sampler._compiled_decode_fn(params, state)
  # pylint: enable=protected-access
  tokens = state.token_buffer.block_until_ready()
  assert tokens.shape == (batch, prompt_len + new_tokens), tokens.shape
  return tokens


def bench_sampler(spec: dict) -> list[dict]:
  """B1's Tunix side: for each case, the best of `repeats` timed `generate_tokens` calls
  (token array in, token array out; see its docstring) after one untimed call that
  compiles. The prompt tokens are built before the timer, as Arbor's are."""
  shape = spec["shape"]
  model = qwen2_model(shape)
  rows = []
  for case in spec["cases"]:
    batch, prompt_len, new_tokens, temperature = (case["batch"], case["prompt_len"],
                                                  case["new_tokens"], case["temperature"])
    sampler = sampler_lib.Sampler(model, WordTokenizer(), sampler_lib.CacheConfig(
        cache_size=prompt_len + new_tokens, num_layers=shape["n_layers"],
        num_kv_heads=shape["n_kv_heads"], head_dim=shape["head_dim"]))
    # What Sampler.__call__ sets from its eos_tokens argument (the prefill and the decode
    # step read it); EOS is forbidden, so no row stops.
    sampler.eos_ids = jnp.array([EOS])
    ids = prompt_ids(batch, prompt_len, shape["vocab_size"], 1)

    def run(seed):
      return generate_tokens(sampler, ids, new_tokens, temperature, seed)

    def check(tokens):
      new = np.asarray(tokens)[:, prompt_len:]
      assert np.array_equal(np.asarray(tokens)[:, :prompt_len], ids)
      assert not np.isin(new, (PAD, EOS)).any(), "a pad or EOS among the new tokens"

    start = time.perf_counter()
    tokens = run(0)
    first = time.perf_counter() - start
    check(tokens)
    times = []
    for seed in range(1, spec["repeats"] + 1):
      start = time.perf_counter()
      tokens = run(seed)
      times.append(time.perf_counter() - start)
      check(tokens)
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
