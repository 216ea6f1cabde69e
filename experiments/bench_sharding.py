"""Time of the sharded train step, sampler and parameter publish against one device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python -m experiments.bench_sharding --data=2 --fsdp=2 --tensor=2

Both variants run side by side in one process, best of --repeats, after a compile call.
On virtual CPU devices the sharded step is expected to be slower (the 'devices' share the
host's cores and the collectives are memory copies): this measures overhead, and the point
of the sharded path there is correctness. On a GPU/TPU mesh it measures scaling.
"""

from __future__ import annotations

import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from models import transformer
from models.config import get_preset
from rl.objectives import losses
from rl.rollouts import batches as rollout_lib
from rl import train
from rl.types import Rollout
from sampling.sampler import SamplingConfig
from sharding import mesh as mesh_lib
from sharding import reshard

_DATA = flags.DEFINE_integer("data", 2, "Mesh data axis.")
_FSDP = flags.DEFINE_integer("fsdp", 2, "Mesh fsdp axis.")
_TENSOR = flags.DEFINE_integer("tensor", 2, "Mesh tensor axis.")
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset (models/config.py).")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per train step / sampler call.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt slots.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 16, "Completion slots.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per variant (best is reported).")


def _best_time(fn, repeats):
  """Best wall time of fn() over `repeats` calls, after one untimed (compiling) call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def main(argv):
  del argv
  seq = _PROMPT_LEN.value + _NEW_TOKENS.value
  model_config = get_preset(_PRESET.value, max_seq_len=seq)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(_DATA.value, _FSDP.value, _TENSOR.value))
  optimizer = train.make_optimizer(1e-4)
  loss_config = losses.LossSettings(name="grpo", aggregation="token_mean")
  rng = np.random.default_rng(0)
  b, p = _BATCH.value, _PROMPT_LEN.value
  completion = np.zeros((b, seq), bool)
  completion[:, p:] = True
  batch = Rollout(
      tokens=jnp.asarray(rng.integers(3, model_config.vocab_size, (b, seq)), jnp.int32),
      prompt_mask=jnp.asarray(~completion), completion_mask=jnp.asarray(completion),
      behavior_logp=jnp.zeros((b, seq)), version=jnp.zeros((b, seq), jnp.int32),
      group=jnp.arange(b) // 4, reward=jnp.asarray(rng.random(b), jnp.float32),
      advantages=jnp.asarray(rng.standard_normal((b, seq)) * completion, jnp.float32))
  params = transformer.init_params(model_config, jax.random.PRNGKey(0))

  results = {"devices": jax.device_count(), "mesh": dict(mesh.shape), "preset": _PRESET.value,
             "batch": b, "seq": seq}
  fresh = lambda: jax.tree.map(jnp.copy, params)  # the train steps donate their input
  states = {"single": train.init_train_state(fresh(), optimizer)}
  states["sharded"] = train.shard_train_state(train.init_train_state(fresh(), optimizer),
                                              model_config, optimizer, mesh)
  steps = {"single": train.make_train_step(model_config, optimizer, loss_config),
           "sharded": train.make_train_step(model_config, optimizer, loss_config, mesh=mesh)}
  for name in ("single", "sharded"):
    def call(name=name):
      states[name], metrics = steps[name](states[name], batch)
      return metrics["loss"]
    results[f"train_step_s_{name}"] = _best_time(call, _REPEATS.value)

  sampling_config = SamplingConfig(max_new_tokens=_NEW_TOKENS.value, temperature=1.0)
  prompts, prompt_mask = batch.tokens[:, :p], batch.prompt_mask[:, :p]
  publish = reshard.make_publish(mesh, params)
  sampler_params = {"single": params, "sharded": publish(states["sharded"].params)}
  for name, m in (("single", None), ("sharded", mesh)):
    generate = rollout_lib.make_generate(model_config, sampling_config, m)
    results[f"generate_s_{name}"] = _best_time(
        lambda g=generate, n=name: g(sampler_params[n], prompts, prompt_mask,
                                     jax.random.PRNGKey(1)).tokens, _REPEATS.value)
  results["publish_s"] = _best_time(lambda: publish(states["sharded"].params), _REPEATS.value)
  results["train_step_ratio"] = results["train_step_s_sharded"] / results["train_step_s_single"]
  results["generate_ratio"] = results["generate_s_sharded"] / results["generate_s_single"]
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  app.run(main)
