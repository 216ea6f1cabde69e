"""What fits where: per-device memory of the real train step and sampler, from XLA's own
memory analysis of the compiled programs, for a model's shapes alone (no weights).

    python -m experiments.memory --model=qwen2_5_0_5b --batch=16 --seq_len=512
    python -m experiments.memory --model=path/to/config.json --batch=64 --seq_len=1024 \\
        --mesh=1,8,1 --logprob_chunk=256 --remat=full --compute_dtype=bfloat16
    python -m experiments.memory --table --out=runs/memory.json   # docs/pod.md's table

The train step is `rl.train.make_train_step` (GRPO, AdamW, one update per batch) and the
sampler `sampling.sampler.generate`, each lowered for abstract arrays of the given shapes
and compiled for this machine's backend (CPU here; on a TPU or GPU host, that target).
Reported per device, in bytes: parameters and optimiser state (from their shapes and
shardings), and XLA's analysis of each compiled program: its arguments, outputs and the
temporaries it allocates (activations kept for the backward, logits, gradients, buffers
of the update). Peak = arguments + temporaries + outputs - what is donated (the train
step updates its state in place). Mixed precision (--compute_dtype=bfloat16) is planned for
the backend it compiles for: XLA:CPU has no bfloat16 matmul and upcasts each operand to a
float32 copy, so on a CPU host its plan is larger than float32's, not the accelerator's. A mesh (data, fsdp, tensor) over N devices needs N
devices: on a CPU host the planner asks XLA for N virtual ones.

Each row also counts the model's parameters, total and active per token
(`parameter_counts`: of a mixture-of-experts model's X experts per block only the k a
token is routed to). The same caveat as for bfloat16 holds for mixtures of experts: on
CPU, JAX lowers `jax.lax.ragged_dot` (the MoE dispatch's grouped matmul) as a masked dense
product that materialises an [X, B * T * k, D] operand, so a CPU host's plan of an MoE
step or sampler holds temporaries a GPU's or TPU's grouped matmul does not (docs/pod.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

GIB = 1024 ** 3
TABLE_MODELS = ("qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_7b", "llama3_1_8b")
# (data, fsdp, tensor) mesh and switches of each row of docs/pod.md's table, per model.
TABLE_CASES = (((1, 1, 1), 0, "none"), ((1, 1, 1), 256, "none"), ((1, 1, 1), 256, "full"),
               ((1, 8, 1), 0, "none"), ((1, 8, 1), 256, "full"),
               ((1, 16, 4), 0, "none"), ((1, 16, 4), 256, "full"))
# Mixture-of-experts presets: the 8- and 64-device rows only (their weights and moments
# alone, 16 bytes per parameter, are 450-700 GiB: no one-device row would fit anything).
TABLE_MOE_MODELS = ("qwen3_30b_a3b", "mixtral_8x7b")
TABLE_MOE_CASES = tuple(case for case in TABLE_CASES if case[0] != (1, 1, 1))
DEVICE_SIZES_GIB = (16, 32, 80, 95)


def model_config(spec: str, dtype: str, remat: str, seq_len: int, compute_dtype: str = ""):
  """The ModelConfig of a preset name or a HF config.json, with the run's switches."""
  from models import config as model_configs  # pylint: disable=import-outside-toplevel
  from models import hf_checkpoint  # pylint: disable=import-outside-toplevel
  if spec.endswith(".json"):
    with open(spec) as f:
      config = hf_checkpoint.config_from_hf(json.load(f), dtype)
  else:
    config = model_configs.get_preset(spec, dtype=dtype)
  return config.replace(remat=remat, compute_dtype=compute_dtype,
                        max_seq_len=max(config.max_seq_len, seq_len))


def parameter_counts(config) -> tuple[int, int]:
  """(total, active) parameters of a ModelConfig, from its parameters' shapes. Active: those
  one token's forward uses, i.e. of a mixture-of-experts model's X experts per block only
  the k it is routed to (the router, a shared expert, attention, embedding and output head
  all count); a dense model's are all of them."""
  import jax  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  params = jax.eval_shape(lambda: transformer.init_params(config, jax.random.PRNGKey(0)))
  total = sum(int(x.size) for x in jax.tree.leaves(params))
  if not config.is_moe:
    return total, total
  experts = sum(int(params["layers"][name].size)
                for name in ("expert_gate", "expert_up", "expert_down"))
  unused = experts // config.num_experts * (config.num_experts - config.experts_per_token)
  return total, total - unused


def grpo_loss():
  """The objective the plan, the check and benchmark B10 compile: GRPO, token mean, no KL."""
  from rl.objectives import losses  # pylint: disable=import-outside-toplevel
  return losses.LossSettings(name="grpo", aggregation="token_mean")


def _bytes(tree) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _per_device(tree, shardings) -> int:
  """Bytes one device holds of `tree` laid out by `shardings` (None: all of it)."""
  import jax  # pylint: disable=import-outside-toplevel
  if shardings is None:
    return _bytes(tree)
  total = 0
  for x, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shard = sharding.shard_shape(x.shape)
    count = 1
    for n in shard:
      count *= n
    total += count * x.dtype.itemsize
  return total


def program_memory(compiled) -> dict:
  """XLA's memory analysis of a compiled program, in bytes: its arguments, outputs,
  temporaries and donated (aliased) buffers, and the peak they add up to."""
  m = compiled.memory_analysis()
  result = dict(argument_bytes=int(m.argument_size_in_bytes),
                output_bytes=int(m.output_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
                alias_bytes=int(m.alias_size_in_bytes))
  result["peak_bytes"] = (result["argument_bytes"] + result["temp_bytes"]
                          + result["output_bytes"] - result["alias_bytes"])
  return result


def plan(model: str, batch: int, seq_len: int, new_tokens: int, mesh_sizes, logprob_chunk: int,
         remat: str, dtype: str, compute_dtype: str = "") -> dict:
  """Per-device bytes of the GRPO train step and of the sampler (see the module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  from rl import train  # pylint: disable=import-outside-toplevel
  from rl.rollouts import batches  # pylint: disable=import-outside-toplevel
  from rl.types import Rollout  # pylint: disable=import-outside-toplevel
  from sampling import sampler  # pylint: disable=import-outside-toplevel
  from sharding import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from sharding import rules as sharding_rules  # pylint: disable=import-outside-toplevel

  config = model_config(model, dtype, remat, seq_len, compute_dtype)
  counts = parameter_counts(config)
  data, fsdp, tensor = (int(n) for n in mesh_sizes)
  devices = data * fsdp * tensor
  mesh = None if devices == 1 else mesh_lib.make_mesh(
      mesh_lib.MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:devices])
  optimizer = train.make_optimizer(1e-6)
  step = train.make_train_step(config, optimizer, grpo_loss(), mesh=mesh, logprob_chunk=logprob_chunk)
  params = jax.eval_shape(lambda: transformer.init_params(config, jax.random.PRNGKey(0)))
  state = jax.eval_shape(lambda p: train.init_train_state(p, optimizer), params)
  shape = lambda dt: jax.ShapeDtypeStruct((batch, seq_len), dt)
  rollout = Rollout(tokens=shape(jnp.int32), prompt_mask=shape(bool), completion_mask=shape(bool),
                    behavior_logp=shape(jnp.float32), version=shape(jnp.int32),
                    group=jax.ShapeDtypeStruct((batch,), jnp.int32),
                    reward=jax.ShapeDtypeStruct((batch,), jnp.float32),
                    advantages=shape(jnp.float32))
  shardings = (None if mesh is None else
               train.train_state_shardings(config, optimizer, mesh))
  train_memory = program_memory(step.lower(state, rollout).compile())
  sampling_config = sampler.SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
  prompt_len = max(seq_len - new_tokens, 1)
  generate = batches.make_generate(config, sampling_config, mesh)
  sampler_params = (params if mesh is None else jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
      sharding_rules.tree_shardings(params, mesh, sharding_rules.SAMPLER_RULES)))
  sample_memory = program_memory(generate.lower(
      sampler_params, jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
      jax.ShapeDtypeStruct((batch, prompt_len), bool),
      jax.ShapeDtypeStruct((2,), jnp.uint32)).compile())
  return dict(
      model=model, dtype=dtype, compute_dtype=compute_dtype, batch=batch, seq_len=seq_len, new_tokens=new_tokens,
      mesh=[data, fsdp, tensor], logprob_chunk=logprob_chunk, remat=remat,
      backend=jax.default_backend(), parameters=_bytes(params),
      parameter_count=counts[0], active_parameter_count=counts[1],
      parameter_bytes_per_device=_per_device(state.params, None if shardings is None
                                             else shardings.params),
      optimizer_bytes_per_device=_per_device(state.opt_state, None if shardings is None
                                             else shardings.opt_state),
      logits_buffer_bytes=batch * seq_len * config.vocab_size * 4,
      train_step=train_memory, sampler=sample_memory)


def _resident_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measured_step_bytes(model: str, batch: int, seq_len: int, logprob_chunk: int, remat: str,
                        dtype: str, compute_dtype: str = "") -> dict:
  """Runs the planned train step once on this host (random weights, one device) and
  measures what its execution adds to the process's resident memory: the high-water mark
  (VmHWM, reset just before, Linux) minus the resident size before. On a CPU host that is
  the step's temporaries and outputs, which `plan` predicts as temp + output - alias."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from models import transformer  # pylint: disable=import-outside-toplevel
  from rl import train  # pylint: disable=import-outside-toplevel
  from rl.types import Rollout  # pylint: disable=import-outside-toplevel

  config = model_config(model, dtype, remat, seq_len, compute_dtype)
  optimizer = train.make_optimizer(1e-6)
  step = train.make_train_step(config, optimizer, grpo_loss(), logprob_chunk=logprob_chunk)
  state = train.init_train_state(transformer.init_params(config, jax.random.PRNGKey(0)),
                                 optimizer)
  rng = np.random.default_rng(0)
  completion = jnp.asarray(np.arange(seq_len)[None] >= seq_len // 2).repeat(batch, 0)
  rollout = Rollout(
      tokens=jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq_len)), jnp.int32),
      prompt_mask=~completion, completion_mask=completion,
      behavior_logp=jnp.full((batch, seq_len), -2.0) * completion,
      version=jnp.zeros((batch, seq_len), jnp.int32), group=jnp.arange(batch) // 2,
      reward=jnp.zeros((batch,)), advantages=jnp.ones((batch, seq_len)) * completion)
  compiled = step.lower(state, rollout).compile()
  jax.block_until_ready((state, rollout))
  before = _resident_kib("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark to the current resident size
  state, metrics = compiled(state, rollout, None)
  jax.block_until_ready((state, metrics))
  return dict(measured_bytes=(_resident_kib("VmHWM") - before) * 1024)


def _gib(n: int) -> str:
  return f"{n / GIB:.1f}"


def table(rows: list[dict]) -> str:
  """docs/pod.md's table: per-device GiB of each part and where the train step fits."""
  head = ("| model | devices (data, fsdp, tensor) | log-prob chunk | remat | compute | params | "
          "optimiser | train temporaries | train peak | sampler peak | fits (train peak) |")
  lines = [head, "|" + "---|" * 11]
  for r in rows:
    t = r["train_step"]
    fits = ", ".join(f"{size}" for size in DEVICE_SIZES_GIB if t["peak_bytes"] <= size * GIB)
    lines.append(
        f"| {r['model']} | {r['mesh'][0] * r['mesh'][1] * r['mesh'][2]} ({', '.join(map(str, r['mesh']))}) "
        f"| {r['logprob_chunk'] or 'dense'} | {r['remat']} "
        f"| {r.get('compute_dtype') or r['dtype']} | {_gib(r['parameter_bytes_per_device'])} "
        f"| {_gib(r['optimizer_bytes_per_device'])} | {_gib(t['temp_bytes'])} "
        f"| {_gib(t['peak_bytes'])} | {_gib(r['sampler']['peak_bytes'])} "
        f"| {fits or 'none'} GB |")
  return "\n".join(lines)


def table_rows(out: str) -> list[dict]:
  """docs/pod.md's rows (TABLE_MODELS x TABLE_CASES, then TABLE_MOE_MODELS x
  TABLE_MOE_CASES, at this run's --batch, --seq_len, --new_tokens, --dtype), each planned
  in its own process (a process that compiles many large programs keeps them and runs out
  of memory) and kept as <out's folder>/rows/<row>.json, so an interrupted table resumes;
  the rows are also written to `out`."""
  folder = os.path.join(os.path.dirname(os.path.abspath(out)), "rows")
  os.makedirs(folder, exist_ok=True)
  rows = []
  grid = ([(model, case) for model in TABLE_MODELS for case in TABLE_CASES]
          + [(model, case) for model in TABLE_MOE_MODELS for case in TABLE_MOE_CASES])
  for model, (mesh, chunk, remat) in grid:
    name = f"{model}_{'-'.join(map(str, mesh))}_c{chunk}_{remat}"
    path = os.path.join(folder, name + (f"_{_COMPUTE.value}" if _COMPUTE.value else "") + ".json")
    if not os.path.exists(path):
      subprocess.run([sys.executable, "-m", "experiments.memory", f"--model={model}",
                      f"--batch={_BATCH.value}", f"--seq_len={_SEQ_LEN.value}",
                      f"--new_tokens={_NEW_TOKENS.value}", f"--dtype={_DTYPE.value}",
                      f"--mesh={','.join(map(str, mesh))}", f"--logprob_chunk={chunk}",
                      f"--remat={remat}", f"--compute_dtype={_COMPUTE.value}", f"--out={path}"],
                     check=True)
    with open(path) as f:
      rows += json.load(f)
  with open(out, "w") as f:
    json.dump(rows, f, indent=1)
  return rows


def _define_flags() -> None:
  """The command line (defined only when run as a script: other experiments modules define
  flags of the same names, and tests import several into one process)."""
  global _MODEL, _BATCH, _SEQ_LEN, _NEW_TOKENS, _MESH, _CHUNK, _REMAT, _DTYPE, _COMPUTE  # pylint: disable=global-statement
  global _TABLE, _CHECK, _OUT  # pylint: disable=global-statement
  _MODEL = flags.DEFINE_string("model", "qwen2_5_0_5b", "A models/config.py preset or a HF "
                               "config.json path.")
  _BATCH = flags.DEFINE_integer("batch", 16, "Sequences per train step (and per sampler call).")
  _SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "Tokens per sequence (prompt + completion).")
  _NEW_TOKENS = flags.DEFINE_integer("new_tokens", 256, "Sampler: tokens generated per row.")
  _MESH = flags.DEFINE_list("mesh", ["1", "1", "1"], "data,fsdp,tensor mesh sizes.")
  _CHUNK = flags.DEFINE_integer("logprob_chunk", 0, "config.rl.logprob_chunk (0 = dense).")
  _REMAT = flags.DEFINE_enum("remat", "none", ["none", "full", "dots"], "config.model.remat.")
  _DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "config.model.dtype: "
                             "the parameters' (and AdamW moments') dtype.")
  _COMPUTE = flags.DEFINE_enum("compute_dtype", "", ["", "float32", "bfloat16"],
                               "config.model.compute_dtype: matmuls, activations, KV cache "
                               "('' = --dtype; bfloat16 over float32 is mixed precision).")
  _TABLE = flags.DEFINE_bool("table", False, "Run docs/pod.md's grid of models and switches.")
  _CHECK = flags.DEFINE_bool("check", False, "Also run the train step once (random weights, "
                             "one device) and compare its measured peak memory with the plan.")
  _OUT = flags.DEFINE_string("out", "", "Also write the results as JSON here.")


def main(argv):
  del argv
  if _TABLE.value:
    rows = table_rows(_OUT.value or "runs/memory/table.json")
    print(table(rows))
    return
  mesh_sizes = [int(n) for n in _MESH.value]
  devices = mesh_sizes[0] * mesh_sizes[1] * mesh_sizes[2]
  if devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}")
  rows = [plan(_MODEL.value, batch=_BATCH.value, seq_len=_SEQ_LEN.value,
               new_tokens=_NEW_TOKENS.value, dtype=_DTYPE.value, mesh_sizes=mesh_sizes,
               logprob_chunk=_CHUNK.value, remat=_REMAT.value,
               compute_dtype=_COMPUTE.value)]
  print(table(rows))
  for row in rows:
    if row["active_parameter_count"] != row["parameter_count"]:
      print(f"{row['model']}: {row['parameter_count'] / 1e9:.2f}B parameters, "
            f"{row['active_parameter_count'] / 1e9:.2f}B active per token")
  if _CHECK.value:
    for row in rows:
      t = row["train_step"]
      row["check"] = measured_step_bytes(row["model"], row["batch"], row["seq_len"],
                                         row["logprob_chunk"], row["remat"], row["dtype"],
                                         row["compute_dtype"])
      predicted = t["temp_bytes"] + t["output_bytes"] - t["alias_bytes"]
      print(f"{row['model']}: the step's execution added {_gib(row['check']['measured_bytes'])} "
            f"GiB to the resident memory; planned temporaries + outputs - donated: "
            f"{_gib(predicted)} GiB")
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
