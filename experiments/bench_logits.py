"""One decode step's token choice: Arbor's sampling against the standard JAX formulations.

    python -m experiments.bench_logits                  # batch 64, vocabularies 1024 and 49152
    python -m experiments.bench_logits --smoke          # tiny shapes, one repetition (CI)

Greedy: `sampling.logits.greedy_tokens` (row maximum, then the first index holding it, as
two plain reductions) against `jnp.argmax` + `take_along_axis` - `logsumexp`. Temperature 1:
`sampling.logits.sample_with_uniform` (inverse CDF with one uniform per row) against
`jax.random.categorical` (B x V Gumbel numbers) + `log_softmax`. Both sides return tokens and
their log-probs. Each is timed as a loop of --steps dependent steps in one jitted
`fori_loop` (the logits of a step depend on the previous step's result, so nothing is
hoisted and the per-call overhead is shared), best of --repeats; reported per step, with
Arbor's speed-up. Writes bench_logits.json, bench_logits.md and bench_logits.png to --out.
"""

from __future__ import annotations

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from experiments.measure import load, timed, write_results
from sampling.logits import greedy_tokens, sample_with_uniform

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes, one repetition (for CI).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed repetitions (best is reported).")
_STEPS = flags.DEFINE_integer("steps", 50, "Dependent sampling steps per timed call.")
_BATCH = flags.DEFINE_integer("batch", 64, "Rows per step.")
_VOCABS = flags.DEFINE_list("vocab_sizes", ["1024", "49152"], "Vocabulary sizes.")
_OUT = flags.DEFINE_string("out", "runs/bench_logits", "Output directory.")


def argmax_greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The textbook greedy step: argmax, and log softmax picked at it."""
  tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
  return tokens, picked - jax.nn.logsumexp(logits, axis=-1)


def gumbel_sample(key: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The textbook temperature-1 step: `jax.random.categorical`, and log softmax at the draw."""
  tokens = jax.random.categorical(key, logits).astype(jnp.int32)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], axis=-1)[:, 0]
  return tokens, logp


def arbor_sample(key: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Arbor's temperature-1 step: one uniform per row, inverse CDF."""
  uniform = jax.random.uniform(key, logits.shape[:1])
  return sample_with_uniform(uniform, logits, 1.0)


def step_loop(choose, steps: int):
  """A jitted loop of `steps` dependent token choices; choose(key, logits) -> (tokens, logp)."""

  def run(logits, key):
    def body(i, carry):
      total, logits = carry
      tokens, logp = choose(jax.random.fold_in(key, i), logits)
      # The next step's logits depend on this step's choice: nothing can be hoisted.
      shift = (jnp.sum(logp) + jnp.sum(tokens).astype(jnp.float32)) * 1e-12
      return total + shift, logits + shift
    return jax.lax.fori_loop(0, steps, body, (jnp.zeros(()), logits))[0]

  return jax.jit(run)


def bench_pair(batch: int, vocab: int, steps: int, repeats: int) -> list[dict]:
  logits = 4.0 * jax.random.normal(jax.random.PRNGKey(0), (batch, vocab), jnp.float32)
  key = jax.random.PRNGKey(1)
  pairs = [("greedy", lambda k, x: greedy_tokens(x), lambda k, x: argmax_greedy(x)),
           ("T = 1", arbor_sample, gumbel_sample)]
  rows = []
  for mode, arbor, reference in pairs:
    per_step = {}
    for name, choose in (("arbor", arbor), ("reference", reference)):
      run = step_loop(choose, steps)
      run(logits, key).block_until_ready()
      per_step[name] = min(timed(lambda: run(logits, key).block_until_ready())
                           for _ in range(repeats)) / steps
    rows.append(dict(mode=mode, batch=batch, vocab=vocab, arbor_s=per_step["arbor"],
                     reference_s=per_step["reference"],
                     speedup=per_step["reference"] / per_step["arbor"]))
  return rows


def markdown(result: dict) -> str:
  lines = ["| mode | batch | vocab | Arbor us/step | reference us/step | reference / Arbor |",
           "|---|---|---|---|---|---|"]
  for r in result["cases"]:
    lines.append(f"| {r['mode']} | {r['batch']} | {r['vocab']} | {r['arbor_s'] * 1e6:.0f} | "
                 f"{r['reference_s'] * 1e6:.0f} | {r['speedup']:.2f}x |")
  lines.append("")
  lines.append("Reference: greedy = jnp.argmax + logsumexp; T = 1 = jax.random.categorical + "
               f"log_softmax. Load: {result['load_before']} -> {result['load_after']}")
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  cases = result["cases"]
  fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cases)), 4))
  xs = range(len(cases))
  ax.bar([x - 0.2 for x in xs], [c["arbor_s"] * 1e6 for c in cases], 0.4, label="Arbor")
  ax.bar([x + 0.2 for x in xs], [c["reference_s"] * 1e6 for c in cases], 0.4, label="reference")
  ax.set_xticks(list(xs))
  ax.set_xticklabels([f"{c['mode']}\nV={c['vocab']}" for c in cases])
  ax.set_yscale("log")
  ax.set_ylabel("us per sampling step")
  ax.set_title(f"Token choice, batch {cases[0]['batch']} (best of N, same run)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  if _SMOKE.value:
    batch, vocabs, steps, repeats = 2, [16], 2, 1
  else:
    batch, vocabs = _BATCH.value, [int(v) for v in _VOCABS.value]
    steps, repeats = _STEPS.value, _REPEATS.value
  load_before = load()
  cases = [row for vocab in vocabs for row in bench_pair(batch, vocab, steps, repeats)]
  result = dict(cases=cases, steps=steps, repeats=repeats, load_before=load_before,
                load_after=load(), jax_version=jax.__version__)
  write_results(_OUT.value, "bench_logits", result, markdown, plot)


if __name__ == "__main__":
  app.run(main)
