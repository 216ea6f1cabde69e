"""Benchmark: the sampler's speed with low-precision weights (docs/low_precision.md).

    python -m experiments.bench_low_precision            # SmolLM2-135M, batch 1, 16, 64
    python -m experiments.bench_low_precision --smoke    # tiny shapes, one repetition (CI)

`experiments.profile_decode` with the sampler's weights in float32, bfloat16, int8 and fp8
(config.rollout.weights; models/quantize.py) side by side in one run, at batch 1, 16 and
64 (64-token prompts, 64 new tokens, best of 2 after a compiling call): tokens/s and its
ratio to float32, each decode step against its bounds (the bytes it
reads at the measured streaming read, its FLOPs at the matmul peak), where a step's time
goes (the in-place profile, with the weights' dequantisation as its own piece) and the
quantisation's cost once per parameter publish. Every flag of profile_decode applies; the
defaults here are the ones above. Writes profile_decode.json / .md to --out
(runs/bench_low_precision).
"""

from absl import app
from absl import flags

from experiments import profile_decode

DEFAULTS = {"weights": ["float32", "bfloat16", "int8", "fp8"], "batch_sizes": ["1", "16", "64"],
            "new_tokens": 64, "repeats": 2, "out": "runs/bench_low_precision"}


def main() -> None:
  for name, value in DEFAULTS.items():
    flags.FLAGS.set_default(name, value)
  app.run(profile_decode.main)


if __name__ == "__main__":
  main()
