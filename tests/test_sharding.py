"""Sharded dataflow on 8 virtual CPU devices (conftest): the mesh, the partition rules,
the sharded train step and sampler against their single-device runs, resharding, and a
two-process `jax.distributed` run against the single-process result."""

import os
import socket
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import multihost_worker
from models import transformer
from rl.rollouts import batches as rollout_lib
from rl import train
from tests.rl_fixtures import left_padded_prompts
from rl.types import Rollout
from sampling.sampler import SamplingConfig
from sharding import mesh as mesh_lib
from sharding import multihost
from sharding import reshard
from sharding import rules

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < 8:
    pytest.fail("The sharding tests need 8 devices; tests/conftest.py sets XLA_FLAGS for "
                "8 virtual CPU devices (an explicit smaller device count overrides it).")
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])


@pytest.fixture(scope="module")
def setup():
  return multihost_worker.tiny_setup()


@pytest.fixture(scope="module")
def single_device_run(setup):
  """Losses, gradient norms and parameters of 3 unsharded train steps: the reference."""
  model_config, optimizer, loss_config, host_batch = setup
  state = train.init_train_state(transformer.init_params(model_config, jax.random.PRNGKey(0)),
                                 optimizer)
  step = train.make_train_step(model_config, optimizer, loss_config)
  batch = Rollout(**jax.tree.map(jnp.asarray, host_batch))
  losses = []
  for _ in range(multihost_worker.STEPS):
    state, metrics = step(state, batch)
    losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  return np.asarray(losses), jax.device_get(state.params)


# --- mesh -------------------------------------------------------------------------------

def test_mesh_axes_sizes_auto_types_and_config_errors(mesh):
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert mesh.axis_types == (AxisType.Auto,) * 3
  assert mesh_lib.batch_size_multiple(mesh) == 4
  # MeshConfig fills a -1 axis and names what it refuses.
  assert mesh_lib.MeshConfig(data=-1, tensor=2).resolve(8) == (4, 1, 2)
  assert mesh_lib.MeshConfig().is_single_device
  with pytest.raises(ValueError, match="needs 4 devices but 8"):
    mesh_lib.MeshConfig(data=2, fsdp=2).resolve(8)
  with pytest.raises(ValueError, match="do not divide"):
    mesh_lib.MeshConfig(data=-1, tensor=3).resolve(8)
  with pytest.raises(ValueError, match="at most one may be -1"):
    mesh_lib.MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="must be positive"):
    mesh_lib.MeshConfig(tensor=0)


# --- rules ------------------------------------------------------------------------------

def test_rules_first_match_on_path_suffix():
  assert rules.spec_for("params/layers/q", rules.TRAINER_RULES) == P(None, "fsdp", "tensor")
  assert rules.spec_for("opt_state/1/0/mu/layers/down", rules.TRAINER_RULES) == P(
      None, "tensor", "fsdp")
  assert rules.spec_for("params/layers/q_norm", rules.TRAINER_RULES) == P()  # not `q`
  assert rules.spec_for("params/embed", rules.SAMPLER_RULES) == P("tensor", None)
  assert rules.spec_for("cache/k", rules.SAMPLER_STATE_RULES) == P(
      None, ("data", "fsdp"), None, "tensor", None)
  with pytest.raises(ValueError, match="No partition rule matches 'x'"):
    rules.spec_for("x", ((r"^y$", P()),))


def test_fit_spec_replicates_dimensions_the_mesh_does_not_divide(mesh):
  assert rules.fit_spec(P("tensor", "fsdp"), (6, 8), mesh) == P("tensor", "fsdp")
  assert rules.fit_spec(P("tensor", "fsdp"), (9, 8), mesh) == P(None, "fsdp")
  assert rules.fit_spec(P(("data", "fsdp")), (6, 3), mesh) == P(None)
  with pytest.raises(ValueError, match="fix the rule's rank"):
    rules.fit_spec(P(None, "fsdp", "tensor"), (4, 4), mesh)


def test_optimizer_state_mirrors_parameter_layout(setup, mesh):
  model_config, optimizer, _, _ = setup
  shardings = train.train_state_shardings(model_config, optimizer, mesh)
  params = jax.tree_util.tree_flatten_with_path(shardings.params)[0]
  adam = shardings.opt_state[1][0]
  assert adam.count.spec == P() and shardings.step.spec == P()
  for moment in (adam.mu, adam.nu):
    for (path, expected), got in zip(params, jax.tree.leaves(moment)):
      assert got.spec == expected.spec, rules.path_name(path)
  assert shardings.params["layers"]["gate"].spec == P(None, "fsdp", "tensor")
  assert shardings.params["layers"]["attn_norm"].spec == P()


# --- train step -------------------------------------------------------------------------

@pytest.mark.slow
def test_sharded_train_step_matches_single_device(setup, mesh, single_device_run):
  model_config, optimizer, loss_config, host_batch = setup
  state = train.init_train_state(transformer.init_params(model_config, jax.random.PRNGKey(0)),
                                 optimizer)
  state = train.shard_train_state(state, model_config, optimizer, mesh)
  step = train.make_train_step(model_config, optimizer, loss_config, mesh=mesh)
  batch = Rollout(**jax.tree.map(jnp.asarray, host_batch))
  losses = []
  for _ in range(multihost_worker.STEPS):
    state, metrics = step(state, batch)
    losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  want_losses, want_params = single_device_run
  # The gradient norm catches gradients scaled by a wrong reduction, which Adam would hide.
  np.testing.assert_allclose(losses, want_losses, rtol=0, atol=1e-5)
  assert np.all(np.abs(np.diff(want_losses[:, 0])) > 1e-3)  # the parameters really moved
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_params)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
  # The step keeps the layout: the next call needs no relayout.
  assert state.params["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor")
  assert state.opt_state[1][0].mu["embed"].sharding.spec == P(("tensor", "fsdp"), None)


def test_parameter_leaves_are_really_sharded(setup, mesh):
  model_config, optimizer, _, _ = setup
  state = train.init_train_state(transformer.init_params(model_config, jax.random.PRNGKey(0)),
                                 optimizer)
  state = train.shard_train_state(state, model_config, optimizer, mesh)
  split = mesh.shape["fsdp"] * mesh.shape["tensor"]
  checked = 0
  leaves = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state[1][0].mu))[0]
  for path, leaf in leaves:
    name = rules.path_name(path)
    per_device = {shard.data.nbytes for shard in leaf.addressable_shards}
    assert len(leaf.addressable_shards) == 8
    if name.endswith(("norm",)):
      assert per_device == {leaf.nbytes}, name  # replicated
    else:
      assert per_device == {leaf.nbytes // split}, name
      checked += 1
  assert checked == 2 * 8  # embed + 7 layer matrices, for params and Adam's mu


# --- sampler and resharding ---------------------------------------------------------------

@pytest.mark.slow
def test_sharded_greedy_sampling_gives_single_device_tokens(setup, mesh):
  model_config = setup[0]
  params = transformer.init_params(model_config, jax.random.PRNGKey(3), init_std=0.3)
  sampling_config = SamplingConfig(max_new_tokens=8, temperature=0.0, stop_tokens=(2,))
  tokens, mask = left_padded_prompts()
  want = rollout_lib.make_generate(model_config, sampling_config)(
      params, tokens, mask, jax.random.PRNGKey(0), 5)
  trainer_params = jax.device_put(params, rules.tree_shardings(params, mesh, rules.TRAINER_RULES))
  publish = reshard.make_publish(mesh, params)
  generate = rollout_lib.make_generate(model_config, sampling_config, mesh)
  got = generate(publish(trainer_params), tokens, mask, jax.random.PRNGKey(0), 5)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.completion_mask), np.asarray(want.completion_mask))
  np.testing.assert_array_equal(np.asarray(got.version), np.asarray(want.version))
  np.testing.assert_allclose(np.asarray(got.behavior_logp), np.asarray(want.behavior_logp),
                             atol=1e-5)
  assert int(got.decode_steps) == int(want.decode_steps)
  assert len(set(np.asarray(want.tokens)[:, 8:].ravel().tolist())) > 3  # not a constant policy
  assert got.tokens.sharding.spec == P(("data", "fsdp"))
  assert got.decode_steps.sharding.spec == P()


def test_sharded_sampling_pads_rows_that_do_not_split_over_the_mesh(setup, mesh):
  """6 rows over data x fsdp = 4 shards (a selection refill): padded, then cut back."""
  model_config = setup[0]
  params = transformer.init_params(model_config, jax.random.PRNGKey(3), init_std=0.3)
  sampling_config = SamplingConfig(max_new_tokens=8, temperature=0.0, stop_tokens=(2,))
  tokens, mask = (x[:6] for x in left_padded_prompts())
  want = rollout_lib.make_generate(model_config, sampling_config)(
      params, tokens, mask, jax.random.PRNGKey(0), 5)
  got = rollout_lib.make_generate(model_config, sampling_config, mesh)(
      params, tokens, mask, jax.random.PRNGKey(0), 5)
  assert got.tokens.shape == want.tokens.shape
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.completion_mask), np.asarray(want.completion_mask))


def test_resharding_preserves_values_and_yields_requested_shardings(setup, mesh):
  model_config = setup[0]
  params = transformer.init_params(model_config, jax.random.PRNGKey(4))
  trainer_shardings = rules.tree_shardings(params, mesh, rules.TRAINER_RULES)
  trainer_params = jax.device_put(params, trainer_shardings)
  published = reshard.make_publish(mesh, params)(trainer_params)
  sampler_shardings = rules.tree_shardings(params, mesh, rules.SAMPLER_RULES)
  for got, want, sharding in zip(jax.tree.leaves(published), jax.tree.leaves(params),
                                 jax.tree.leaves(sampler_shardings)):
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  q = published["layers"]["q"]  # [L, D, H*E]: tensor-split, replicated over data and fsdp
  assert {s.data.shape for s in q.addressable_shards} == {(2, 128, 64)}
  # The trainer keeps its copy (not donated), and the way back restores the trainer layout.
  back = reshard.make_reshard(trainer_shardings)(published)
  for got, want, orig in zip(jax.tree.leaves(back), jax.tree.leaves(params),
                             jax.tree.leaves(trainer_params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding == orig.sharding and not orig.is_deleted()


def test_residual_hook_sees_every_layer_boundary(setup):
  """The hook through which sharding pins activations is applied to the residual stream
  after the embedding and after each block, and only there."""
  model_config = setup[0]
  params = transformer.init_params(model_config, jax.random.PRNGKey(5))
  tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) + 3)
  mask = jnp.ones((2, 6), bool)
  positions = transformer.positions_from_mask(mask)
  seen = []
  hook = lambda x: seen.append(x.shape) or x
  plain, _ = transformer.forward(params, tokens, positions, mask, model_config)
  hooked, _ = transformer.forward(params, tokens, positions, mask, model_config,
                                  residual_hook=hook)
  np.testing.assert_array_equal(np.asarray(hooked), np.asarray(plain))
  # Traced once outside the layer scan (embedding) and once inside its body.
  assert seen == [(2, 6, model_config.d_model)] * 2
  scaled, _ = transformer.forward(params, tokens, positions, mask, model_config,
                                  residual_hook=lambda x: 0.0 * x)
  np.testing.assert_allclose(np.asarray(scaled), 0.0, atol=1e-6)  # zero stream, zero logits


def test_initialize_without_coordinator_is_single_process_holding_every_row(monkeypatch, mesh):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  assert not multihost.initialize()
  assert multihost.is_primary()
  with pytest.raises(ValueError, match="give both"):
    multihost.initialize("127.0.0.1:1", num_processes=2)
  # One process holds every row of the batch.
  sharding = rules.batch_sharding(mesh)
  assert multihost.host_rows(sharding, 8) == (0, 8)
  batch = multihost.global_batch({"x": np.arange(16).reshape(8, 2)}, sharding, 8)
  assert batch["x"].sharding == sharding
  np.testing.assert_array_equal(np.asarray(batch["x"]), np.arange(16).reshape(8, 2))


# --- two processes ------------------------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(out) -> tuple[list[int], list[str]]:
  """Runs the two worker processes to completion; (return codes, output logs)."""
  # The scheduler flag as tests/conftest.py sets it: the workers share the compilation cache.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 "
             "--xla_cpu_enable_concurrency_optimized_scheduler=false", JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([_REPO, os.path.join(_REPO, "tests")]))
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, os.path.join(_REPO, "tests", "multihost_worker.py"), coordinator, "2",
       str(i), out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [p.returncode for p in procs], logs


@pytest.mark.slow
def test_two_processes_agree_with_single_process(single_device_run):
  """Two `jax.distributed` processes of 4 CPU devices each (gloo collectives) run the
  data=2, fsdp=2, tensor=2 train step, each loading only its half of the batch."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "result.npz")
    # Gloo gives a peer 30 s to reach a collective's set-up. On a loaded machine one process
    # can still be compiling by then; a second attempt, made once that load has passed, can
    # start in step. Only that failure is retried.
    for _ in range(2):
      returncodes, logs = _run_workers(out)
      if returncodes == [0, 0] or not any("DEADLINE_EXCEEDED" in log for log in logs):
        break
    for returncode, log in zip(returncodes, logs):
      assert returncode == 0, log[-3000:]
    assert "rows [0, 4)" in logs[0] and "rows [4, 8)" in logs[1]
    result = np.load(out)
    want_losses, want_params = single_device_run
    np.testing.assert_allclose(np.stack([result["losses"], result["grad_norms"]], axis=1),
                               want_losses, rtol=0, atol=1e-5)
    for path, want in jax.tree_util.tree_flatten_with_path(want_params)[0]:
      name = "/".join(str(getattr(k, "key", k)) for k in path)
      np.testing.assert_allclose(result[name], want, rtol=0, atol=1e-5, err_msg=name)
