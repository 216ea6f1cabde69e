"""Benchmark B2 (docs/benchmarks.md): train-step and GRPO-step speed, and the prefix-shared forward.

    python -m experiments.bench_train                 # B1 shapes, Arbor + Tunix + TRL
    python -m experiments.bench_train --peers=        # Arbor only
    python -m experiments.bench_train --smoke         # tiny shapes, one repetition (CI)
    python -m experiments.bench_train --only=lora     # LoRA vs full train step alone
    python -m experiments.bench_train --only=distill  # what a distillation teacher costs
    python -m experiments.bench_train --only=nat      # NAT's train step at 25/50/100% tokens
    python -m experiments.bench_train --checkpoint=smollm2 --peers=torch
                                                      # B8: the GRPO step on SmolLM2, vs TRL

Four measurements, on the B1 decoder (f32) unless stated, best of --repeats after compiling:
  1. train step: forward + backward + AdamW on a [16, 80] batch (GRPO loss), tokens/s and
     model FLOP utilisation against a large f32 matmul timed in this run;
  2. GRPO step: 4 prompts x 4 completions x 64 new tokens (prompt 16, temperature 1, exactly
     64 tokens per row, reward = fraction of even token ids, no KL, one update per batch):
     Arbor's `rl.loop.grpo_iteration` (sample, score, advantages, train step) vs Tunix's
     GRPOLearner and TRL's GRPOTrainer, each peer in its own virtualenv (experiments/peers);
  3. prefix-shared vs replicated loss forward/backward + AdamW (`config.rl.prefix_shared_forward`)
     at G = 8 and 16, prompts 4x longer than responses;
  4. the SwiGLU MLP's gradient: `transformer.swiglu` (hand-written backward) vs autodiff of
     the same expression, at the train step's shape and at the chain_sum run's (tiny model,
     256 rows x 18 tokens; experiments/configs/chain_sum_compact.py), best of --repeats x 3
     calls, alternating the two;
  5. LoRA vs full weights (docs/lora.md): the train step of item 1 training all weights and
     training rank-r adapters on every projection (--lora_ranks), the cases alternated in
     each repetition, best of --repeats; with the bytes of trained parameters, frozen base
     and optimiser state, and XLA's temporary buffer bytes of the compiled step (its peak
     working memory beyond arguments and outputs, available on CPU), plus the device's peak
     bytes in use where the backend reports it (GPU / TPU).
  6. (--only=distill, alone) on-policy distillation's cost in the train step: the testbed's
     policy (preset tiny2, the character vocabulary) on its RL batch (64 rows of 16 prompt +
     101 completion slots): GRPO alone, GRPO + the exact reverse KL to a teacher of the same
     shape, and pure OPD, alternated in each repetition, best of --repeats.
  7. (--checkpoint, alone; B8) the GRPO step of item 2 on real weights (a HF folder, a .gguf
     or "smollm2", float32): 8 prompts x 4 completions x 128 new tokens (temperature 1,
     exactly 128 tokens per row), each prompt the first 64 tokens of a gsm_symbolic word
     problem (as text that re-encodes to those 64 ids), reward = share of digits in the
     completion text (`digit_share`, the same function in the peer). Arbor's
     `rl.loop.grpo_iteration` with the checkpoint's tokenizer vs TRL's GRPOTrainer on the same
     weights, which Arbor writes once as a HF folder under --peer_weights
     (`experiments.peers.export_weights`), with the same prompt texts (the peer checks that its
     tokenizer gives Arbor's ids); the time each side spends sampling is reported beside
     the step. Best of --repeats after a compiling first step.
  8. (--only=nat, alone) NAT token subsampling (config.loss.token_subsample) in the train
     step: the testbed's policy on a batch of its RL shape with every completion slot used
     (64 rows of 16 prompt + 101 completion tokens), cut to the default train length
     buckets (24 and 48 completion slots, as in the budget grid): all tokens, a random
     prefix cut keeping 50% and 25% in expectation, and uniform random tokens at 50% (no
     cut). Each case trains on the same 8 draws per pass (keys 0-7), the cases alternated
     pass by pass, best of --repeats of the mean seconds per step; memory: XLA's temporary
     buffer bytes of the compiled step at each draw's cut length, averaged over the draws.
Peers are skipped when the environment variable CI is set. Writes bench_train.json,
bench_train.md and bench_train.png to --out (--only=lora: bench_train_lora.*, item 5 only;
--only=distill: bench_train_distill.*; --only=nat: bench_train_nat.*; --checkpoint:
bench_train_b8.*).
"""

from __future__ import annotations

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import peers
from experiments.decode_cost import train_flops_per_token
from experiments.measure import load, matmul_peak_flops, random_rollout, timed, write_results
from experiments.peers import PEER_LABELS, peer_shape
from models import lora as lora_lib
from models import transformer
from models.config import ModelConfig, get_preset
from rl.objectives import advantages
from rl.objectives import losses
from rl import loop
from rl import train
from rl.rollouts import producers
from rl.tasks import Example
from rl.types import Rollout
from sampling.sampler import SamplingConfig

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes, one repetition (for CI).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions per case (best is reported).")
_OUT = flags.DEFINE_string("out", "runs/bench_train", "Output directory.")
_PEERS = flags.DEFINE_list("peers", ["tunix", "torch"], "Peers to run (tunix, torch); empty: none.")
_ONLY = flags.DEFINE_enum("only", "", ["", "lora", "distill", "nat"],
                          "Run one measurement alone (lora: item 5; distill: item 6).")
_LORA_RANKS = flags.DEFINE_list("lora_ranks", ["8", "64"], "Adapter ranks of the LoRA cases.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "B8: time the GRPO step alone on these "
                                  "weights (HF folder, .gguf or 'smollm2'), Arbor vs TRL.")
_PEER_ENVS, _PEER_WEIGHTS = peers.location_flags()
_ROUNDS = flags.DEFINE_integer("rounds", 1, "--checkpoint: rounds of (Arbor, peers), order "
                               "alternating; each side's best round is reported.")

GRPO_LABELS = dict(PEER_LABELS, torch="TRL")  # the torch peer's GRPO step is TRL's trainer
GRPO = losses.LossSettings(name="grpo")


def time_train_step(config: ModelConfig, batch: Rollout, repeats: int,
                    shared_prefix: tuple[int, int] | None = None) -> tuple[float, float]:
  """(best seconds, compile seconds) of the jitted GRPO train step on `batch`."""
  optimizer = train.make_optimizer(1e-5)
  step = train.make_train_step(config, optimizer, GRPO, shared_prefix=shared_prefix)
  state = train.init_train_state(transformer.init_params(config, jax.random.PRNGKey(0)), optimizer)

  def run():
    nonlocal state
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)

  first = timed(run)
  best = min(timed(run) for _ in range(repeats))
  return best, max(first - best, 0.0)


def tree_bytes(tree) -> int:
  """Bytes of a pytree's array leaves (None: 0)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _step_memory(step, state, batch) -> dict:
  """XLA's memory analysis of the compiled step: temporary buffers (its working memory
  beyond arguments and outputs), arguments and outputs, in bytes."""
  analysis = step.lower(state, batch).compile().memory_analysis()
  if analysis is None:
    return {}
  return dict(temp_bytes=int(analysis.temp_size_in_bytes),
              argument_bytes=int(analysis.argument_size_in_bytes),
              output_bytes=int(analysis.output_size_in_bytes))


def _device_peak_bytes() -> int | None:
  """Peak device bytes in use so far, where the backend reports it (not CPU)."""
  stats = jax.devices()[0].memory_stats()
  return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])


def lora_vs_full(config: ModelConfig, batch: Rollout, ranks, repeats: int) -> list[dict]:
  """Train step (GRPO loss, AdamW) on full weights and with rank-r adapters on every
  projection (alpha = 2r), the cases alternated in each repetition; best seconds, first-
  call seconds, state and step memory per case."""
  optimizer = train.make_optimizer(1e-5)
  cases = [("full", None)] + [(f"lora r={r}", lora_lib.LoraConfig(int(r), 2.0 * int(r),
                                                                   lora_lib.TARGETS))
                              for r in ranks]
  rows, runs = [], []
  for name, lora in cases:
    params = transformer.init_params(config, jax.random.PRNGKey(0))
    state = train.init_train_state(params, optimizer, lora=lora, model_config=config,
                                   lora_rng=jax.random.PRNGKey(1))
    step = train.make_train_step(config, optimizer, GRPO)
    row = dict(case=name, rank=0 if lora is None else lora.rank,
               trained_params=int(sum(x.size for x in jax.tree.leaves(state.params))),
               trained_bytes=tree_bytes(state.params), frozen_bytes=tree_bytes(state.frozen),
               opt_state_bytes=tree_bytes(state.opt_state), **_step_memory(step, state, batch))
    holder = {"state": state}

    def run(step=step, holder=holder):
      holder["state"], metrics = step(holder["state"], batch)
      jax.block_until_ready(metrics)

    row["first_call_s"] = timed(run)  # compiles the jitted step
    row["device_peak_bytes"] = _device_peak_bytes()
    rows.append(row)
    runs.append(run)
  best = [float("inf")] * len(cases)
  for _ in range(repeats):
    for i, run in enumerate(runs):
      best[i] = min(best[i], timed(run))
  for row, seconds in zip(rows, best):
    row.update(best_s=seconds, time_ratio=seconds / best[0],
               state_bytes=row["trained_bytes"] + row["frozen_bytes"] + row["opt_state_bytes"])
    row["state_ratio"] = row["state_bytes"] / rows[0]["state_bytes"]
  return rows


def distill_overhead(repeats: int, smoke: bool) -> dict:
  """Item 6: seconds per train step of GRPO alone, GRPO + reverse KL to a teacher and pure
  OPD on the testbed's batch shape, the three alternated in each repetition."""
  from models.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  from rl.objectives import distillation  # pylint: disable=import-outside-toplevel
  config = get_preset("tiny2", vocab_size=CharTokenizer().vocab_size, max_seq_len=128)
  groups, completion = (2, 8) if smoke else (8, 101)
  batch = random_rollout(config, groups, 8, 16, completion)
  teacher = transformer.init_params(config, jax.random.PRNGKey(1))
  optimizer = train.make_optimizer(1e-5)
  cases = {"grpo": {}, "grpo + reverse KL": dict(with_reward=True),
           "pure OPD": dict(with_reward=False)}
  steps, states = {}, {}
  for name, setting in cases.items():
    extra = {} if not setting else dict(
        distill=distillation.Distill("reverse_kl", 1.0, setting["with_reward"], 16, config),
        teacher_params=teacher)
    steps[name] = train.make_train_step(config, optimizer, GRPO, **extra)
    states[name] = train.init_train_state(
        transformer.init_params(config, jax.random.PRNGKey(0)), optimizer)
  best = dict.fromkeys(cases, float("inf"))
  for rep in range(repeats + 1):  # the first round compiles
    for name in cases:
      def run(name=name):
        states[name], metrics = steps[name](states[name], batch)
        jax.block_until_ready(metrics)
      seconds = timed(run)
      if rep:
        best[name] = min(best[name], seconds)
  return dict(shape=[groups * 8, 16 + completion], best_s=best,
              vs_grpo={name: best[name] / best["grpo"] for name in cases})


NAT_CASES = (("all tokens", "none", 1.0), ("rpc 50%", "rpc", 0.5), ("rpc 25%", "rpc", 0.25),
             ("urs 50%", "urs", 0.5))
NAT_DRAWS = 8


def nat_cost(repeats: int, smoke: bool) -> dict:
  """Item 8: seconds and working memory of the train step under NAT's token subsampling
  (module docstring), per case: the kept share of tokens, the mean trained length."""
  from rl.settings.rollout import RolloutSettings  # pylint: disable=import-outside-toplevel
  from models.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  from rl.objectives import token_subsample  # pylint: disable=import-outside-toplevel
  config = get_preset("tiny2", vocab_size=CharTokenizer().vocab_size, max_seq_len=128)
  groups, prompt_len, completion = (2, 4, 60) if smoke else (8, 16, 101)
  batch = random_rollout(config, groups, 8, prompt_len, completion)
  buckets = [prompt_len + b for b in RolloutSettings().train_length_buckets if b < completion]
  optimizer = train.make_optimizer(1e-5)
  plain = train.make_train_step(config, optimizer, GRPO)
  step = train.make_train_step(config, optimizer, GRPO, length_buckets=buckets)
  state = train.init_train_state(transformer.init_params(config, jax.random.PRNGKey(0)),
                                 optimizer)
  rows, draws = [], {}
  for name, scheme, keep in NAT_CASES:
    if scheme == "none":
      cases = [batch] * NAT_DRAWS
    else:
      stage = token_subsample.TokenSubsample(scheme, keep, "seq_mean_token_mean")
      cases = [stage(batch, jax.random.PRNGKey(i))[0] for i in range(NAT_DRAWS)]
    draws[name] = cases
    trimmed = [train.trim_to_bucket(b, buckets) for b in cases]
    memory = [_step_memory(plain, state, b).get("temp_bytes", 0) for b in trimmed]
    rows.append(dict(case=name, scheme=scheme, keep=keep,
                     kept_fraction=float(np.mean([np.asarray(b.completion_mask).sum()
                                                  / np.asarray(batch.completion_mask).sum()
                                                  for b in cases])),
                     mean_length=float(np.mean([b.tokens.shape[1] for b in trimmed])),
                     temp_bytes=float(np.mean(memory))))
  holder = {"state": state}

  def one_pass(cases):
    for b in cases:
      holder["state"], metrics = step(holder["state"], b)
      jax.block_until_ready(metrics)

  best = dict.fromkeys(draws, float("inf"))
  for rep in range(repeats + 1):  # the first pass compiles every bucket
    for name, cases in draws.items():
      seconds = timed(lambda cases=cases: one_pass(cases)) / NAT_DRAWS
      if rep:
        best[name] = min(best[name], seconds)
  for row in rows:
    row.update(step_s=best[row["case"]], time_ratio=best[row["case"]] / best[rows[0]["case"]],
               memory_ratio=row["temp_bytes"] / max(rows[0]["temp_bytes"], 1.0))
  return dict(shape=[groups * 8, prompt_len + completion], buckets=buckets, rows=rows)


def nat_markdown(result: dict) -> str:
  rows, length = result["nat"]["shape"]
  lines = [f"Train step on {rows} x {length} tokens (every completion slot used), length "
           f"buckets {result['nat']['buckets']}; mean over {NAT_DRAWS} draws, best of "
           f"{result['repeats']}; load {result['load_before']} before, "
           f"{result['load_after']} after.", "",
           "| case | tokens trained | mean length (slots) | seconds per step | vs all | "
           "XLA temp MiB | vs all |", "|---|---|---|---|---|---|---|"]
  for r in result["nat"]["rows"]:
    lines.append(f"| {r['case']} | {r['kept_fraction']:.2f} | {r['mean_length']:.1f} | "
                 f"{r['step_s']:.4f} | {r['time_ratio']:.2f}x | {r['temp_bytes'] / 2**20:.1f} | "
                 f"{r['memory_ratio']:.2f}x |")
  return "\n".join(lines) + "\n"


def distill_markdown(result: dict) -> str:
  rows, length = result["distill"]["shape"]
  lines = [f"Train step on {rows} x {length} tokens (testbed shape), best of "
           f"{result['repeats']}; load {result['load_before']} before, {result['load_after']} "
           "after.", "", "| case | seconds | vs GRPO |", "|---|---|---|"]
  for name, seconds in result["distill"]["best_s"].items():
    lines.append(f"| {name} | {seconds:.4f} | {result['distill']['vs_grpo'][name]:.2f}x |")
  return "\n".join(lines) + "\n"


def lora_markdown(rows: list[dict], batch: int, length: int) -> list[str]:
  lines = [f"**LoRA vs full weights** (train step, {batch} x {length} tokens, adapters on "
           "every projection, best of the alternated repetitions)", "",
           "| case | trained params | trained MiB | frozen MiB | optimiser MiB | state vs full "
           "| step temp MiB | step s | vs full |", "|---|---|---|---|---|---|---|---|---|"]
  mib = lambda b: f"{b / 2 ** 20:.2f}" if b is not None else "-"
  for r in rows:
    lines.append(f"| {r['case']} | {r['trained_params']} | {mib(r['trained_bytes'])} | "
                 f"{mib(r['frozen_bytes'])} | {mib(r['opt_state_bytes'])} | "
                 f"{r['state_ratio']:.2f}x | {mib(r.get('temp_bytes'))} | {r['best_s']:.4f} | "
                 f"{r['time_ratio']:.2f}x |")
  return lines + [""]


class WordTokenizer:
  """Token id i <-> word 't{i}' (0 pad, 1 bos, 2 eos): the peers' tokenizer, for Arbor."""
  pad_id, bos_id, eos_id = 0, 1, 2

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    return [self.bos_id] * add_bos + [int(w[1:]) for w in text.split()]

  def decode(self, ids) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


class EvenTokensTask:
  """Random prompts; reward = fraction of even token ids in the completion (as the peers)."""
  name = "even_tokens"

  def __init__(self, vocab_size: int, prompt_len: int):
    self.vocab_size, self.prompt_len = vocab_size, prompt_len

  def examples(self, split, n, start=0):
    del split
    rng = np.random.default_rng(start)
    return [Example(prompt=" ".join(f"t{i}" for i in rng.integers(3, self.vocab_size,
                                                                  self.prompt_len - 1)),
                    answer="", entry={}) for _ in range(n)]

  def reward(self, completion, example):
    del example
    words = completion.split()
    return float(np.mean([int(w[1:]) % 2 == 0 for w in words])) if words else 0.0

  def exact_match(self, completion, example):
    del completion, example
    return False


def digit_share(text: str) -> float:
  """The share of a completion's characters that are digits (0 for an empty one): B8's reward,
  computed the same way by the torch peer (experiments/peers/torch_peer.py)."""
  return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


class TextPromptsTask:
  """Given prompt texts (cycled); reward = `digit_share` of the completion (B8, as the peer)."""
  name = "text_prompts"

  def __init__(self, prompts):
    self.prompts = list(prompts)

  def examples(self, split, n, start=0):
    del split
    return [Example(prompt=self.prompts[(start + i) % len(self.prompts)], answer="", entry={})
            for i in range(n)]

  def reward(self, completion, example):
    del example
    return digit_share(completion)

  def exact_match(self, completion, example):
    del completion, example
    return False


def b8_prompts(tokenizer, prompt_len: int, count: int) -> tuple[list[str], list[list[int]]]:
  """`count` prompt texts of exactly `prompt_len` tokens (as Arbor encodes a prompt) and their
  ids: the first prompt_len tokens of gsm_symbolic's training word problems, decoded, kept
  where the text encodes back to those ids."""
  from rl.tasks import make_task  # pylint: disable=import-outside-toplevel
  task = make_task("gsm_symbolic", prompt_style="full")
  texts, ids, start = [], [], 0
  while len(texts) < count:
    for example in task.examples("train", 64, start):
      tokens = tokenizer.encode(example.prompt, add_bos=True)[:prompt_len]
      text = tokenizer.decode(tokens)
      if len(tokens) == prompt_len and tokenizer.encode(text, add_bos=True) == tokens:
        texts.append(text)
        ids.append(tokens)
    start += 64
  return texts[:count], ids[:count]


def bench_grpo_step(config: ModelConfig, g: dict, repeats: int, params=None, task=None,
                    tokenizer=None) -> dict:
  """Arbor's GRPO iteration: sample G completions per prompt, score, advantages, update.
  Default: random B1 weights on the even-token task (item 2); B8 passes real weights, their
  tokenizer and a task."""
  optimizer = train.make_optimizer(1e-5)
  # No stop tokens: every row decodes exactly new_tokens tokens, as the peers are forced to.
  sampling_config = SamplingConfig(max_new_tokens=g["new_tokens"], temperature=1.0)
  ctx = loop.LoopContext(
      batch=producers.BatchContext(
          task=task or EvenTokensTask(config.vocab_size, g["prompt_len"]),
          tokenizer=tokenizer or WordTokenizer(),
          model_config=config, sampling_config=sampling_config, prompt_len=g["prompt_len"],
          prompts_per_step=g["prompts"], group_size=g["group_size"]),
      train_step=train.make_train_step(config, optimizer, GRPO),
      stages=advantages.advantage_stage(advantages.group_relative(advantages.grpo_advantages)))
  producer = producers.independent(ctx.batch)
  if params is None:
    params = transformer.init_params(config, jax.random.PRNGKey(0))
  state = loop.LoopState(train=train.init_train_state(params, optimizer),
                         rng=jax.random.PRNGKey(1), producer=producer.init(0))
  steps = []

  def run():
    nonlocal state
    state, metrics = loop.grpo_iteration(state, ctx, producer)
    steps.append({k: float(metrics[k]) for k in ("time_sample_s", "time_score_s",
                                                  "time_train_s", "reward_mean")
                  if k in metrics})

  first = timed(run)
  times = [timed(run) for _ in range(repeats)]
  best = int(np.argmin(times))
  return dict(first_step_s=first, best_step_s=times[best], step_s=times, best_split=steps[1 + best],
              first_split=steps[0])


def b8_grpo(checkpoint: str, repeats: int, smoke: bool) -> dict:
  """Item 7 (B8): the GRPO step on `checkpoint`'s weights, Arbor then each weight-loading peer,
  with the load average before and after each side."""
  from models.pretrained import load_pretrained  # pylint: disable=import-outside-toplevel
  config, params, tokenizer = load_pretrained(checkpoint)
  if tokenizer is None:
    raise ValueError(f"{checkpoint!r} has no tokenizer.json: B8 needs text prompts.")
  g = (dict(prompts=2, group_size=2, prompt_len=8, new_tokens=4) if smoke else
       dict(prompts=8, group_size=4, prompt_len=64, new_tokens=128))
  texts, ids = b8_prompts(tokenizer, g["prompt_len"], g["prompts"] * (repeats + 1))
  peer_names, skipped = peers.weight_peers(_PEERS.value)
  for name in skipped:
    print(f"{GRPO_LABELS[name]} skipped: its peer cannot load {checkpoint!r}.", flush=True)
  result = {"device": str(jax.devices()[0]), "checkpoint": checkpoint, "config": str(config),
            "repeats": repeats, "frameworks": ["arbor"] + peer_names, "peers_skipped": skipped,
            "load_before": load(), "matmul_peak_flops": matmul_peak_flops(
                256 if smoke else 2048, repeats), "prompts": texts[:g["prompts"]],
            "prompt_lens": sorted({len(i) for i in ids})}
  folder = None
  if peer_names:  # written before Arbor's steps, whose train state donates the parameters
    folder = peers.export_weights(peers.weights_folder(_PEER_WEIGHTS.value, checkpoint), params,
                                  config, tokenizer, checkpoint)
  grpo_step, versions, rounds = dict(g), {}, {}
  host_params = jax.device_get(params)  # each round's train state donates its own copy

  def run(name: str) -> dict:
    before = load()
    if name == "arbor":
      fresh = jax.tree.map(lambda x: jnp.array(x, copy=True), host_params)
      row = bench_grpo_step(config, g, repeats, params=fresh,
                            task=TextPromptsTask(texts), tokenizer=tokenizer)
    else:
      spec = dict(shape=peer_shape(config), weights=folder,
                  grpo=dict(g, repeats=repeats, prompt_texts=texts, prompt_ids=ids))
      out = peers.run_peer(name, spec, _PEER_ENVS.value)
      row = out.pop("grpo")
      versions[name] = out
    print(f"{GRPO_LABELS[name]} GRPO step: {row['best_step_s']:.3f} s", flush=True)
    return dict(row, load_before=before, load_after=load())

  # Rounds alternate the order (Arbor first, then last); each side keeps its best round.
  order = ["arbor"] + peer_names
  for index in range(_ROUNDS.value):
    for name in order if index % 2 == 0 else order[::-1]:
      row = run(name)
      rounds.setdefault(name, []).append(row["best_step_s"])
      if name not in grpo_step or row["best_step_s"] < grpo_step[name]["best_step_s"]:
        grpo_step[name] = row
  result.update(peer_versions=versions, grpo_step=grpo_step, round_best_s=rounds,
                rounds=_ROUNDS.value, load_after=load(), peer_weights=folder)
  return result


def b8_markdown(result: dict) -> str:
  g = result["grpo_step"]
  lines = [f"**B8 GRPO step on {result['checkpoint']}** (float32; {g['prompts']} prompts x "
           f"{g['group_size']} completions x {g['new_tokens']} new tokens, prompts of "
           f"{g['prompt_len']} tokens: sample + score + advantages + update; best of "
           f"{result['repeats']} after a first step)", "",
           "| framework | step s (best) | of which sampling s | first step s | steps s | "
           "Arbor speed-up |", "|---|---|---|---|---|---|"]
  for name in result["frameworks"]:
    r = g[name]
    sampling = r["best_split"]["time_sample_s"] if name == "arbor" else r.get("best_generate_s")
    lines.append(f"| {GRPO_LABELS[name]} | {r['best_step_s']:.2f} | {sampling:.2f} | "
                 f"{r['first_step_s']:.2f} | {', '.join(f'{t:.2f}' for t in r['step_s'])} | "
                 f"{r['best_step_s'] / g['arbor']['best_step_s']:.2f}x |")
  lines += ["", "Best step per round (s): " + "; ".join(
      f"{GRPO_LABELS[n]} {', '.join(f'{t:.2f}' for t in result['round_best_s'][n])}"
      for n in result["frameworks"]), "", f"Load before: {result['load_before']}"]
  for name in result["frameworks"]:
    lines.append(f"{GRPO_LABELS[name]}: before {g[name]['load_before']}; after "
                 f"{g[name]['load_after']}")
  for name in result["frameworks"][1:]:
    r = g[name]
    lines.append(f"{GRPO_LABELS[name]} checks: {r.get('prompt_ids_equal')} of "
                 f"{g['prompts'] * (result['repeats'] + 1)} prompts "
                 f"tokenised to Arbor's ids; prompt lengths {r.get('prompt_lens')}; model "
                 f"{r.get('model_dtype')}, gradient checkpointing "
                 f"{r.get('gradient_checkpointing')}")
  return "\n".join(lines) + "\n"


def autodiff_swiglu(h, gate, up, down):
  """The SwiGLU MLP differentiated by JAX's autodiff: the reference `transformer.swiglu`'s
  hand-written backward is timed against (and tested against in test_transformer.py)."""
  return (jax.nn.silu(h @ gate) * (h @ up)) @ down


def time_mlp_backward(rows: int, length: int, d_model: int, mlp_dim: int,
                      repeats: int) -> dict:
  """Seconds per gradient of sum(MLP(h)) for both backward passes, alternated per repeat."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  h = jax.random.normal(keys[0], (rows, length, d_model))
  gate, up = (0.05 * jax.random.normal(k, (d_model, mlp_dim)) for k in keys[1:3])
  down = 0.05 * jax.random.normal(keys[3], (mlp_dim, d_model))
  grads = {name: jax.jit(jax.grad(lambda *a, f=fn: f(*a).sum(), argnums=(0, 1, 2, 3)))
           for name, fn in (("autodiff", autodiff_swiglu), ("custom", transformer.swiglu))}
  best = {name: float("inf") for name in grads}
  for name, grad in grads.items():
    jax.block_until_ready(grad(h, gate, up, down))
  for _ in range(repeats):
    for name, grad in grads.items():
      seconds = timed(lambda g=grad: [jax.block_until_ready(g(h, gate, up, down))
                                      for _ in range(3)]) / 3
      best[name] = min(best[name], seconds)
  return dict(rows=rows, length=length, d_model=d_model, mlp_dim=mlp_dim,
              autodiff_s=best["autodiff"], custom_s=best["custom"],
              speedup=best["autodiff"] / best["custom"])


def markdown(result: dict) -> str:
  t = result["train_step"]
  lines = ["**Train step** (forward + backward + AdamW, GRPO loss)", "",
           "| batch x tokens | tokens/s | step s | compile s | utilisation |",
           "|---|---|---|---|---|",
           f"| {t['batch']} x {t['length']} | {t['tokens_per_s']:.0f} | {t['best_s']:.4f} | "
           f"{t['compile_s']:.1f} | {100 * t['utilisation']:.1f}% |", ""]
  g = result["grpo_step"]
  lines += [f"**GRPO step** ({g['prompts']} prompts x {g['group_size']} completions x "
            f"{g['new_tokens']} tokens, prompt {g['prompt_len']}: sample + score + update)", "",
            "| framework | step s (best) | first step s | Arbor speed-up |", "|---|---|---|---|"]
  for name in result["frameworks"]:
    r = g[name]
    lines.append(f"| {GRPO_LABELS[name]} | {r['best_step_s']:.3f} | {r['first_step_s']:.2f} | "
                 f"{r['best_step_s'] / g['arbor']['best_step_s']:.2f}x |")
  lines += ["", "**Prefix-shared loss forward/backward** (train step, prompt = 4 x response)", "",
            "| G | groups | prompt | response | replicated s | shared s | speed-up |",
            "|---|---|---|---|---|---|---|"]
  for r in result["prefix_shared"]:
    lines.append(f"| {r['group_size']} | {r['groups']} | {r['prompt_len']} | "
                 f"{r['completion_len']} | {r['replicated_s']:.4f} | {r['shared_s']:.4f} | "
                 f"{r['speedup']:.2f}x |")
  lines += ["", "**SwiGLU MLP gradient** (`transformer.swiglu` vs autodiff of the same expression)",
            "", "| rows x tokens | d_model | mlp_dim | autodiff s | hand-written s | speed-up |",
            "|---|---|---|---|---|---|"]
  for r in result["mlp_backward"]:
    lines.append(f"| {r['rows']} x {r['length']} | {r['d_model']} | {r['mlp_dim']} | "
                 f"{r['autodiff_s']:.4f} | {r['custom_s']:.4f} | {r['speedup']:.2f}x |")
  if "lora" in result:
    lines += [""] + lora_markdown(result["lora"], *result["lora_shape"])
  return "\n".join(lines) + "\n"


def lora_only_markdown(result: dict) -> str:
  return "\n".join(lora_markdown(result["lora"], *result["lora_shape"]))


def lora_plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = result["lora"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  names = [r["case"] for r in rows]
  left.bar(names, [r["best_s"] for r in rows], color="C0")
  left.set_ylabel("seconds per train step (best)")
  left.set_title("Train step: LoRA vs full")
  right.bar(names, [r["state_bytes"] / 2 ** 20 for r in rows], color="C1")
  right.set_ylabel("MiB (trained + frozen + optimiser state)")
  right.set_title("Train state memory")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  names = result["frameworks"]
  left.bar([GRPO_LABELS[n] for n in names],
           [result["grpo_step"][n]["best_step_s"] for n in names], color="C0")
  left.set_ylabel("seconds per GRPO step (best)")
  left.set_title("GRPO step, 4 prompts x 4 x 64 tokens")
  shared = result["prefix_shared"]
  x = np.arange(len(shared))
  right.bar(x - 0.2, [r["replicated_s"] for r in shared], 0.4, label="replicated")
  right.bar(x + 0.2, [r["shared_s"] for r in shared], 0.4, label="prefix-shared")
  right.set_xticks(x)
  right.set_xticklabels([f"G={r['group_size']}" for r in shared])
  right.set_ylabel("seconds per train step")
  right.set_title("Prefix-shared loss forward/backward")
  right.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  if _SMOKE.value:
    config = get_preset("b1").replace(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1,
                                      head_dim=16, mlp_dim=64, vocab_size=64)
    repeats, peak_size = 1, 256
    step_shape = (2, 8)
    g = dict(prompts=2, group_size=2, prompt_len=4, new_tokens=4)
    shared_cases = [(2, 2, 8, 2)]
    mlp_cases = [(4, 8, 32, 64)]
    lora_ranks = ["2"]
  else:
    config = get_preset("b1")
    repeats, peak_size = _REPEATS.value, 2048
    step_shape = (16, 80)
    g = dict(prompts=4, group_size=4, prompt_len=16, new_tokens=64)
    # (groups, G, prompt, response): prompts 4x longer than responses.
    shared_cases = [(2, 8, 256, 64), (2, 16, 256, 64)]
    tiny = get_preset("tiny")
    # (rows, tokens, d_model, mlp_dim): the train step's shape, the chain_sum run's GRPO batch.
    mlp_cases = [(*step_shape, config.d_model, config.mlp_dim),
                 (256, 18, tiny.d_model, tiny.mlp_dim)]
    lora_ranks = _LORA_RANKS.value
  if _CHECKPOINT.value:
    result = b8_grpo(_CHECKPOINT.value, repeats, _SMOKE.value)
    write_results(_OUT.value, "bench_train_b8", result, b8_markdown, None)
    return
  batch, length = step_shape
  step_batch = random_rollout(config, batch, 1, length // 5, length - length // 5)
  alone = {"distill": (distill_overhead, distill_markdown), "nat": (nat_cost, nat_markdown)}
  if _ONLY.value in alone:
    measure, render = alone[_ONLY.value]
    load_before = load()
    measured = measure(repeats, _SMOKE.value)
    result = {"device": str(jax.devices()[0]), "repeats": repeats, "load_before": load_before,
              "load_after": load(), _ONLY.value: measured}
    write_results(_OUT.value, f"bench_train_{_ONLY.value}", result, render, None)
    return
  if _ONLY.value == "lora":
    load_before = load()
    lora = lora_vs_full(config, step_batch, lora_ranks, repeats)
    result = {"device": str(jax.devices()[0]), "config": str(config), "repeats": repeats,
              "load_before": load_before, "load_after": load(),
              "matmul_peak_flops": matmul_peak_flops(peak_size, repeats), "lora": lora,
              "lora_shape": [batch, length]}
    write_results(_OUT.value, "bench_train_lora", result, lora_only_markdown, lora_plot)
    return
  peer_names = peers.peers_enabled(_PEERS.value)
  load_before = load()
  peak = matmul_peak_flops(peak_size, repeats)

  best, compile_s = time_train_step(config, step_batch, repeats)
  train_step = dict(batch=batch, length=length, best_s=best, compile_s=compile_s,
                    tokens_per_s=batch * length / best)
  train_step["utilisation"] = (train_flops_per_token(config, length / 2)
                               * train_step["tokens_per_s"] / peak)
  print(f"train step {batch}x{length}: {train_step['tokens_per_s']:.0f} tok/s, "
        f"util {100 * train_step['utilisation']:.1f}%", flush=True)

  grpo_step = dict(g, arbor=bench_grpo_step(config, g, repeats))
  print(f"Arbor GRPO step: {grpo_step['arbor']['best_step_s']:.3f} s", flush=True)
  versions = {}
  for name in peer_names:
    out = peers.run_peer(name, dict(shape=peer_shape(config), grpo=dict(g, repeats=repeats)),
                         _PEER_ENVS.value)
    grpo_step[name] = out.pop("grpo")
    versions[name] = out
    print(f"{GRPO_LABELS[name]} GRPO step: {grpo_step[name]['best_step_s']:.3f} s", flush=True)

  prefix_shared = []
  for groups, group_size, prompt_len, completion_len in shared_cases:
    rollout = random_rollout(config, groups, group_size, prompt_len, completion_len)
    replicated_s, _ = time_train_step(config, rollout, repeats)
    shared_s, _ = time_train_step(config, rollout, repeats, shared_prefix=(group_size, prompt_len))
    prefix_shared.append(dict(groups=groups, group_size=group_size, prompt_len=prompt_len,
                              completion_len=completion_len, replicated_s=replicated_s,
                              shared_s=shared_s, speedup=replicated_s / shared_s))
    print(f"prefix-shared G={group_size}: {replicated_s / shared_s:.2f}x", flush=True)

  mlp_backward = [time_mlp_backward(*case, repeats) for case in mlp_cases]
  for r in mlp_backward:
    print(f"SwiGLU gradient {r['rows']}x{r['length']}: {r['speedup']:.2f}x", flush=True)

  lora = lora_vs_full(config, step_batch, lora_ranks, repeats)
  for r in lora[1:]:
    print(f"LoRA {r['case']}: step {r['time_ratio']:.2f}x full, state {r['state_ratio']:.2f}x",
          flush=True)

  result = {"device": str(jax.devices()[0]), "matmul_peak_flops": peak, "config": str(config),
            "repeats": repeats, "frameworks": ["arbor"] + peer_names, "peer_versions": versions,
            "load_before": load_before, "load_after": load(), "train_step": train_step,
            "grpo_step": grpo_step, "prefix_shared": prefix_shared,
            "mlp_backward": mlp_backward, "lora": lora, "lora_shape": [batch, length]}
  write_results(_OUT.value, "bench_train", result, markdown, plot)


if __name__ == "__main__":
  app.run(main)
