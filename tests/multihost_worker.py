"""One process of the two-process sharded train step test (tests/test_sharding.py).

Run as `python tests/multihost_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT.npz`
with XLA_FLAGS giving each process some virtual CPU devices. Every process loads only its
rows of the batch; process 0 writes the losses and final parameters to OUT.npz.
Also importable: `tiny_setup()` is the model, optimiser, loss and batch both sides use.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax

from models.config import get_preset
from rl import train
from rl.types import Rollout
from rl.objectives import losses

STEPS = 3


def tiny_setup(batch_size: int = 8, seq_len: int = 16):
  """(model_config, optimizer, loss_config, host batch as a dict of numpy arrays).

  Head counts divide a tensor axis of 2 (n_heads=4, n_kv_heads=2). The optimiser is
  train.make_optimizer's clip + AdamW with Adam's epsilon raised from 1e-8 to 1e-6: Adam
  normalises each update by |g|, so for gradients near 1e-8 a last-bit difference in g (a
  different summation order across devices) moves the update by a sizeable fraction of
  the learning rate, which would hide the comparison under optimiser noise.
  """
  model_config = get_preset("tiny", n_layers=2, max_seq_len=seq_len)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-6))
  loss_config = losses.LossSettings(
      name="grpo", eps_low=0.2, eps_high=0.2, aggregation="token_mean", norm_len=1.0,
      kl_coef=0.0)
  rng = np.random.default_rng(0)
  b, t = batch_size, seq_len
  tokens = rng.integers(3, model_config.vocab_size, (b, t)).astype(np.int32)
  prompt_mask = np.zeros((b, t), bool)
  completion_mask = np.zeros((b, t), bool)
  for row in range(b):  # left-padded prompts of varying length, completions after them
    prompt_mask[row, 1 + row % 3:t // 2] = True
    completion_mask[row, t // 2:t - row % 4] = True
  batch = dict(
      tokens=tokens, prompt_mask=prompt_mask, completion_mask=completion_mask,
      behavior_logp=(-rng.random((b, t)) * completion_mask).astype(np.float32),
      version=np.zeros((b, t), np.int32), group=(np.arange(b) // 4).astype(np.int32),
      reward=rng.random(b).astype(np.float32),
      advantages=(rng.standard_normal((b, t)) * completion_mask).astype(np.float32))
  return model_config, optimizer, loss_config, batch


def main(coordinator: str, num_processes: int, process_id: int, out_path: str) -> None:
  # pylint: disable=g-import-not-at-top  (jax.distributed must start before any device use)
  from models import transformer
  from sharding import mesh as mesh_lib
  from sharding import multihost
  from sharding import rules

  multihost.initialize(coordinator, num_processes, process_id)
  model_config, optimizer, loss_config, host_batch = tiny_setup()
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2))
  rows = rules.batch_sharding(mesh)
  global_rows = host_batch["tokens"].shape[0]
  start, stop = multihost.host_rows(rows, global_rows)
  local = {k: v[start:stop] for k, v in host_batch.items()}  # per-host data loading
  batch = Rollout(**multihost.global_batch(local, rows, global_rows))

  shardings = train.train_state_shardings(model_config, optimizer, mesh)
  init = jax.jit(lambda key: train.init_train_state(
      transformer.init_params(model_config, key), optimizer), out_shardings=shardings)
  state = init(jax.random.PRNGKey(0))
  step = train.make_train_step(model_config, optimizer, loss_config, mesh=mesh)
  losses, grad_norms = [], []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(multihost.fetch(metrics["loss"])))
    grad_norms.append(float(multihost.fetch(metrics["grad_norm"])))
  params = multihost.fetch(state.params)
  if multihost.is_primary():
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(out_path, losses=np.asarray(losses), grad_norms=np.asarray(grad_norms), rows=np.asarray([start, stop]), **flat)
  print(f"process {process_id}: rows [{start}, {stop}), losses {losses}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
