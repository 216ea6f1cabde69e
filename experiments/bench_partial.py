"""Benchmark B4 (docs/benchmarks.md): partial rollouts vs synchronous batches, long-tailed lengths.

    python -m experiments.bench_partial --out=runs/bench_partial

A random-init decoder with several stop tokens has a long-tailed completion length (median
~12 of 64 tokens, ~5% truncated at 64; printed). Both methods deliver the same number of
complete groups (`--batches` batches of `--groups` groups of `--group_size`):
  sync: each batch is one `generate` call over groups * group_size fresh rows, which runs
    until its longest row ends;
  partial: a pool of `--slots_ratio` times as many rows; each round stops when `--groups`
    groups are complete and takes them (APRIL); unfinished rows continue next round. At the
    end the pool is drained (every started group finished), so both sides count all work.
The parameters are fixed (a stationary length distribution) but each round records a new
version, as under training. Reported per method: decode steps, completed sequences per
decode step, completed sequences per second (best of `--repeats`, after compilation), idle
slot-steps (row x step slots that generated nothing), prefill tokens, and the conservation
count of the partial pool (started = finished + discarded + in flight). Writes
`b4.json` and `b4.md` to --out. Shared machines are noisy: ratios are measured side by
side in one process.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from models import transformer
from models.config import get_preset
from rl.rollouts import partial as partial_rollout
from sampling.partial import PartialConfig
from sampling.sampler import SamplingConfig, generate

_OUT = flags.DEFINE_string("out", "runs/bench_partial", "Output directory.")
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset (models/config.py).")
_INIT_STD = flags.DEFINE_float("init_std", 0.4, "Init scale: larger is peakier, per-prompt "
                               "stop rates vary more (heavier tail).")
_STOPS = flags.DEFINE_list("stop_tokens", ["2", "3", "4"], "Stop token ids.")
_PROMPT = flags.DEFINE_integer("prompt_len", 8, "Prompt tokens.")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Completion budget N.")
_GROUPS = flags.DEFINE_integer("groups", 8, "Groups per batch.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 4, "Completions per prompt.")
_RATIO = flags.DEFINE_float("slots_ratio", 2.0, "Partial pool rows / batch rows (APRIL "
                            "over-provisioning; rounded to whole groups).")
_WINDOW = flags.DEFINE_integer("decode_window", 16, "Partial: most decode steps per round "
                               "(the pool's KV cache has P + N + window slots).")
_BATCHES = flags.DEFINE_integer("batches", 40, "Batches delivered per method.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (best is reported).")


def _prompts(ids, prompt_len, vocab):
  """Deterministic random prompt of data position i (same for both methods)."""
  tokens = np.stack([np.random.default_rng(int(i)).integers(5, vocab, prompt_len)
                     for i in ids]).astype(np.int32)
  return tokens, np.ones(tokens.shape, bool)


def run_sync(params, model_config, sampling_config, batches, groups, group_size, prompt_len):
  steps = generated = 0
  rng = jax.random.PRNGKey(1)
  lengths = []
  started = time.perf_counter()
  for b in range(batches):
    tokens, mask = _prompts(range(b * groups, (b + 1) * groups), prompt_len,
                            model_config.vocab_size)
    rng, key = jax.random.split(rng)
    gen = generate(params, jnp.asarray(np.repeat(tokens, group_size, 0)),
                   jnp.asarray(np.repeat(mask, group_size, 0)), key, model_config,
                   sampling_config, b)
    length = np.asarray(gen.completion_len)
    steps += int(gen.decode_steps)
    generated += int(length.sum())
    lengths.append(length)
  seconds = time.perf_counter() - started
  rows = groups * group_size
  return dict(decode_steps=steps, sequences=batches * rows, seconds=seconds,
              generated_tokens=generated, idle_slot_steps=rows * steps - generated,
              prefill_tokens=batches * rows * prompt_len, lengths=np.concatenate(lengths))


def run_partial(params, model_config, sampling_config, batches, groups, group_size, prompt_len,
                slots_ratio, resume, decode_window):
  config = PartialConfig(num_slots=round(slots_ratio * groups) * group_size,
                         group_size=group_size, resume=resume, decode_window=decode_window)
  rollouts = partial_rollout.PartialRollouts(
      config, model_config, sampling_config, prompt_len, groups,
      lambda ids: _prompts(ids, prompt_len, model_config.vocab_size))
  steps = generated = idle = rounds = 0
  finished = []
  rng, state = jax.random.PRNGKey(1), rollouts.init()
  started = time.perf_counter()
  for b in range(batches):
    rng, key = jax.random.split(rng)
    gen, ids, stats, state = rollouts.next_batch(state, params, b, key)
    jax.block_until_ready(gen.tokens)
    steps, generated = steps + stats.decode_steps, generated + stats.generated_tokens
    idle += stats.idle_slot_steps
    rounds += stats.rounds
    finished += list(ids)
  delivered_seconds = time.perf_counter() - started
  delivered_steps = steps
  ledger_before_drain = state.ledger.as_dict()
  gen, ids, stats, state = rollouts.drain(state, params, batches, rng)
  seconds = time.perf_counter() - started
  finished += list(ids)
  steps, generated = steps + stats.decode_steps, generated + stats.generated_tokens
  idle += stats.idle_slot_steps
  rounds += stats.rounds
  ledger = state.ledger.as_dict()
  in_flight = len(rollouts.in_flight_ids(state))
  assert len(finished) == len(set(finished)) == ledger["started"], "conservation broken"
  # Prefill cost per round: every row's resume window (P + N for re-prefill, P for kept KV).
  window = prompt_len + sampling_config.max_new_tokens if resume == "reprefill" else prompt_len
  return dict(decode_steps=steps, sequences=len(finished) * group_size, seconds=seconds,
              delivered_sequences=batches * groups * group_size,
              delivered_decode_steps=delivered_steps, delivered_seconds=delivered_seconds,
              generated_tokens=generated, idle_slot_steps=idle,
              prefill_tokens=rounds * config.num_slots * window, rounds=rounds,
              ledger_before_drain=ledger_before_drain, ledger=ledger, in_flight=in_flight)


def main(argv):
  del argv
  model_config = get_preset(_PRESET.value, max_seq_len=_PROMPT.value + 2 * _NEW.value)
  params = transformer.init_params(model_config, jax.random.PRNGKey(0), init_std=_INIT_STD.value)
  sampling_config = SamplingConfig(max_new_tokens=_NEW.value, temperature=1.0,
                                   stop_tokens=tuple(int(s) for s in _STOPS.value))
  common = (params, model_config, sampling_config, _BATCHES.value, _GROUPS.value,
            _GROUP_SIZE.value, _PROMPT.value)
  pool = (_RATIO.value, _WINDOW.value)
  methods = {"sync": lambda: run_sync(*common),
             "partial (reprefill)": lambda: run_partial(*common, pool[0], "reprefill", pool[1]),
             "partial (kept_kv)": lambda: run_partial(*common, pool[0], "kept_kv", pool[1])}
  for fn in methods.values():  # compile everything first
    fn()
  results = {}
  for _ in range(_REPEATS.value):
    for name, fn in methods.items():  # interleaved, so load changes hit every method
      result = fn()
      if name not in results or result["seconds"] < results[name]["seconds"]:
        results[name] = result
  lengths = results["sync"].pop("lengths")
  sync = results["sync"]
  lines = [
      f"B4 partial rollouts: preset {_PRESET.value}, init_std {_INIT_STD.value}, stop tokens "
      f"{_STOPS.value}, prompt {_PROMPT.value}, N = {_NEW.value}, {_GROUPS.value} groups x "
      f"{_GROUP_SIZE.value} per batch, {_BATCHES.value} batches, partial pool "
      f"{_RATIO.value}x rows, decode window {_WINDOW.value}; best of {_REPEATS.value}.",
      f"Completion length: mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, "
      f"p90 {np.percentile(lengths, 90):.0f}, truncated at N {np.mean(lengths == _NEW.value):.1%}.",
      "",
      "| method | sequences | decode steps | seq / decode step | vs sync | seq / s | vs sync "
      "| idle slot-steps | prefill tokens | conservation (started = finished + discarded + "
      "in flight) |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for name, r in results.items():
    per_step = r["sequences"] / r["decode_steps"]
    per_s = r["sequences"] / r["seconds"]
    sync_step = sync["sequences"] / sync["decode_steps"]
    sync_s = sync["sequences"] / sync["seconds"]
    idle_fraction = r["idle_slot_steps"] / (r["idle_slot_steps"] + r["generated_tokens"])
    if "ledger" in r:
      led = r["ledger"]
      conservation = (f"{led['started']} = {led['finished']} + {led['discarded']} + "
                      f"{r['in_flight']} groups")
    else:
      conservation = "n/a (every batch runs to completion)"
    lines.append(f"| {name} | {r['sequences']} | {r['decode_steps']} | {per_step:.3f} | "
                 f"{per_step / sync_step:.2f}x | {per_s:.0f} | {per_s / sync_s:.2f}x | "
                 f"{r['idle_slot_steps']} ({idle_fraction:.0%}) | "
                 f"{r['prefill_tokens']} | {conservation} |")
  for name, r in results.items():
    if "ledger" in r:
      lines.append(
          f"\n{name}, before the final drain: {r['delivered_sequences']} sequences delivered in "
          f"{r['delivered_decode_steps']} decode steps "
          f"({r['delivered_sequences'] / r['delivered_decode_steps']:.3f} / step, "
          f"{r['delivered_sequences'] / r['delivered_seconds']:.0f} / s); ledger "
          f"{r['ledger_before_drain']}.")
  table = "\n".join(lines)
  print(table)
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "b4.json"), "w") as f:
    json.dump({k: {kk: vv for kk, vv in v.items()} for k, v in results.items()}, f, indent=2)
  with open(os.path.join(_OUT.value, "b4.md"), "w") as f:
    f.write(table + "\n")


if __name__ == "__main__":
  app.run(main)
