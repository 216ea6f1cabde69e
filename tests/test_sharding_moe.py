"""Mixture-of-experts models on 8 virtual CPU devices (tests/conftest.py), data = fsdp =
tensor = 2: the partition rules of the expert leaves (and of AdamW's moments of them),
that those leaves really are split, and the sharded forward, train step and sampler
against their single-device runs, for tiny2_moe (softmax-then-top-k routing) and a variant
with Mixtral's top-k-then-softmax routing and a shared expert. The sharded computations run
the same dispatch as the single-device ones (`ModelConfig.moe_dispatch`, 'ragged' unless
a test says otherwise), so they are compared at the dense model's tolerance
(tests/test_sharding.py): 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multihost_worker
from models import transformer
from models.config import get_preset
from rl import train
from tests.rl_fixtures import left_padded_prompts
from rl.objectives import composite
from rl.rollouts import batches as rollout_lib
from rl.types import Rollout
from sampling.sampler import SamplingConfig
from sharding import mesh as mesh_lib
from sharding import reshard
from sharding import rules

# tiny2_moe: D = 128, 8 experts of F = 256, top 2; every split dimension divides 2.
CONFIGS = {
    "softmax_topk": get_preset("tiny2_moe", max_seq_len=16),
    "topk_softmax_shared": get_preset("tiny2_moe", max_seq_len=16, routing="topk_softmax",
                                      shared_expert_dim=64),
}
SHARED = CONFIGS["topk_softmax_shared"]
# The mesh axes each MoE leaf's dimensions are split over, trainer and sampler.
TRAINER_LAYOUT = {
    "router": P(None, "fsdp", None),
    "expert_gate": P(None, None, "fsdp", "tensor"),
    "expert_up": P(None, None, "fsdp", "tensor"),
    "expert_down": P(None, None, "tensor", "fsdp"),
    "shared_gate": P(None, "fsdp", "tensor"),
    "shared_up": P(None, "fsdp", "tensor"),
    "shared_down": P(None, "tensor", "fsdp"),
    "shared_scale": P(None, "fsdp", None),
}
SAMPLER_LAYOUT = {
    "router": P(),
    "expert_gate": P(None, None, None, "tensor"),
    "expert_up": P(None, None, None, "tensor"),
    "expert_down": P(None, None, "tensor", None),
    "shared_gate": P(None, None, "tensor"),
    "shared_up": P(None, None, "tensor"),
    "shared_down": P(None, "tensor", None),
    "shared_scale": P(),
}


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < 8:
    pytest.fail("The sharding tests need 8 devices; tests/conftest.py sets XLA_FLAGS for "
                "8 virtual CPU devices (an explicit smaller device count overrides it).")
  return mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])


def _split(spec: P, mesh) -> int:
  """Into how many pieces `spec` splits a leaf on `mesh`."""
  count = 1
  for axes in spec:
    for axis in (axes,) if isinstance(axes, str) else (axes or ()):
      count *= mesh.shape[axis]
  return count


def _setup(config):
  """(optimizer, loss, batch) of the dense sharding tests, the batch's tokens in range."""
  _, optimizer, loss, host = multihost_worker.tiny_setup()
  host["tokens"] = host["tokens"] % config.vocab_size
  return optimizer, loss, Rollout(**jax.tree.map(jnp.asarray, host))


# --- rules ----------------------------------------------------------------------------------

def test_moe_rules_cover_every_expert_leaf_and_adam_mirrors_them(mesh):
  """Every MoE leaf (shared expert included) gets its layout in the trainer and sampler
  tables; Adam's mu and nu of each get the parameter's; the routing record in the
  sampler's cache is split by rows like the KV cache."""
  optimizer, _, _ = _setup(SHARED)
  shardings = train.train_state_shardings(SHARED, optimizer, mesh)
  layers = shardings.params["layers"]
  assert set(TRAINER_LAYOUT) <= set(layers)
  for name, spec in TRAINER_LAYOUT.items():
    assert layers[name].spec == spec, name
    assert _split(spec, mesh) > 1, name  # not replicated
  adam = shardings.opt_state[1][0]
  params = jax.tree_util.tree_flatten_with_path(shardings.params)[0]
  for moment in (adam.mu, adam.nu):
    assert len(jax.tree.leaves(moment)) == len(params)
    for (path, want), got in zip(params, jax.tree.leaves(moment)):
      assert got.spec == want.spec, rules.path_name(path)
  for name in TRAINER_LAYOUT:
    assert rules.spec_for(f"opt_state/1/0/nu/layers/{name}", rules.TRAINER_RULES) == \
        TRAINER_LAYOUT[name]
  abstract = jax.eval_shape(lambda: transformer.init_params(SHARED, jax.random.PRNGKey(0)))
  sampler_specs = rules.tree_specs(abstract, rules.SAMPLER_RULES, mesh)["layers"]
  for name, spec in SAMPLER_LAYOUT.items():
    assert sampler_specs[name] == spec, name
  # The dense rules are untouched by the new ones: `gate` is not `expert_gate`.
  assert rules.spec_for("params/layers/gate", rules.TRAINER_RULES) == P(None, "fsdp", "tensor")
  cache = jax.eval_shape(lambda: transformer.init_cache(SHARED, 8, 16))
  assert cache["experts"].shape == (2, 8, 16, 2)
  specs = rules.tree_specs({"cache": cache}, rules.SAMPLER_STATE_RULES, mesh)["cache"]
  assert specs["experts"] == P(None, ("data", "fsdp"), None, None)
  assert specs["k"] == P(None, ("data", "fsdp"), None, "tensor", None)


def test_expert_leaves_are_really_sharded_in_both_layouts(mesh):
  """On the devices: each MoE leaf of the trainer state (parameters and Adam's mu) holds
  1/split of its bytes per device, and so does the published sampler copy."""
  optimizer, _, _ = _setup(SHARED)
  params = transformer.init_params(SHARED, jax.random.PRNGKey(0))
  state = train.shard_train_state(train.init_train_state(params, optimizer), SHARED,
                                  optimizer, mesh)
  published = reshard.make_publish(mesh, params)(state.params)
  for tree, layout in ((state.params, TRAINER_LAYOUT), (state.opt_state[1][0].mu, TRAINER_LAYOUT),
                       (published, SAMPLER_LAYOUT)):
    for name, spec in layout.items():
      leaf = tree["layers"][name]
      assert len(leaf.addressable_shards) == 8
      assert {s.data.nbytes for s in leaf.addressable_shards} == {
          leaf.nbytes // _split(spec, mesh)}, name
  # tensor-split experts in the sampler: [L, X, D, F / 2] on every device.
  assert {s.data.shape for s in published["layers"]["expert_up"].addressable_shards} == {
      (2, 8, 128, 128)}
  np.testing.assert_array_equal(np.asarray(published["layers"]["expert_down"]),
                                np.asarray(params["layers"]["expert_down"]))


# --- forward --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,dispatch", [
    ("softmax_topk", "ragged"),
    pytest.param("topk_softmax_shared", "ragged", marks=pytest.mark.slow),
    pytest.param("softmax_topk", "dense", marks=pytest.mark.slow)])
def test_sharded_moe_forward_matches_single_device(mesh, name, dispatch):
  """The training forward in the trainer layout (residual stream pinned to rows, as the
  train step pins it): logits, and with replayed experts (R3) the hidden states and the
  router statistics, equal the single-device ones."""
  config = CONFIGS[name].replace(moe_dispatch=dispatch)
  params = transformer.init_params(config, jax.random.PRNGKey(1), init_std=0.1)
  _, _, batch = _setup(config)
  tokens, mask = batch.tokens, batch.prompt_mask | batch.completion_mask
  positions = transformer.positions_from_mask(mask)
  b, t = tokens.shape
  rng = np.random.default_rng(2)  # k distinct experts per token and layer
  replay = jnp.asarray(np.argsort(rng.random((b, t, config.n_layers, config.num_experts)),
                                  axis=-1)[..., :config.experts_per_token], jnp.int32)

  def run(params, tokens, positions, mask, replay, hook=None):
    logits, _ = transformer.forward(params, tokens, positions, mask, config, residual_hook=hook)
    hidden, stats = transformer.hidden_states_with_routing(
        params, tokens, positions, mask, config, residual_hook=hook, experts=replay)
    return logits, hidden, stats

  want = jax.jit(run)(params, tokens, positions, mask, replay)
  rows = rules.batch_sharding(mesh)
  shardings = rules.tree_shardings(params, mesh, rules.TRAINER_RULES)
  sharded = jax.jit(
      lambda *args: run(*args, hook=lambda x: jax.lax.with_sharding_constraint(x, rows)),
      in_shardings=(shardings, rows, rows, rows, rows))
  sharded_params = jax.device_put(params, shardings)
  for leaf in ("expert_gate", "expert_down"):
    assert not sharded_params["layers"][leaf].sharding.is_fully_replicated
  got = sharded(sharded_params, tokens, positions, mask, replay)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=0, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got[2].experts), np.asarray(want[2].experts))
  for field in ("load_balancing", "z_loss"):
    np.testing.assert_allclose(np.asarray(getattr(got[2], field)),
                               np.asarray(getattr(want[2], field)), rtol=0, atol=1e-5)
  # Not vacuous: several experts chosen, and the replay changed the output.
  assert len(np.unique(np.asarray(want[2].experts))) == config.num_experts
  plain, _ = transformer.hidden_states(params, tokens, positions, mask, config)
  assert np.abs(np.asarray(plain) - np.asarray(want[1])).max() > 1e-3


# --- train step -----------------------------------------------------------------------------

# The objective's MoE terms per config: the auxiliary losses, and routing replay (R3) of a
# recorded routing for the shared-expert config.
ROUTER_TERMS = {
    "softmax_topk": composite.RouterTerms(load_balancing_coef=0.01),
    "topk_softmax_shared": composite.RouterTerms(routing_replay=True, load_balancing_coef=0.01,
                                                 router_z_coef=0.001),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_moe_train_step_matches_single_device(mesh, name):
  """Three GRPO steps on the mesh against three on one device: losses, gradient norms, the
  routing metrics and the parameters after them (tests/test_sharding.py's dense check, for
  an MoE model), with the auxiliary losses on and, for the shared-expert config, the
  batch's recorded experts replayed."""
  config, router = CONFIGS[name], ROUTER_TERMS[name]
  optimizer, loss, batch = _setup(config)
  if router.routing_replay:
    b, t = batch.tokens.shape
    rng = np.random.default_rng(4)  # k distinct experts per token and layer
    batch = batch.replace(experts=jnp.asarray(np.argsort(
        rng.random((b, t, config.n_layers, config.num_experts)), axis=-1)[
            ..., :config.experts_per_token], config.expert_id_dtype))
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  initial = jax.device_get(params)  # the steps donate their state
  reference = train.init_train_state(params, optimizer)
  sharded = train.shard_train_state(jax.tree.map(jnp.copy, reference), config, optimizer, mesh)
  step = train.make_train_step(config, optimizer, loss, router=router)
  sharded_step = train.make_train_step(config, optimizer, loss, mesh=mesh, router=router)
  want, got = [], []
  for _ in range(multihost_worker.STEPS):
    reference, metrics = step(reference, batch)
    want.append(metrics)
    sharded, metrics = sharded_step(sharded, batch)
    got.append(metrics)
  names = ["loss", "grad_norm"] + sorted(k for k in want[0] if k.startswith("moe_"))
  assert "moe_load_balancing" in names and "moe_expert_load_max_l1" in names
  if router.routing_replay:
    assert "moe_routing_mismatch" in names
  got, want = ([[float(m[k]) for k in names] for m in ms] for ms in (got, want))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  want = np.asarray(want)[:, :2]
  assert np.all(np.abs(np.diff(np.asarray(want)[:, 0])) > 1e-3)  # the parameters moved
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(sharded.params)[0],
                          jax.tree.leaves(reference.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5,
                               err_msg=rules.path_name(path))
  # The step keeps the layout, and the experts moved.
  layers = sharded.params["layers"]
  for leaf in ("router", "expert_gate", "expert_up", "expert_down"):
    assert layers[leaf].sharding.spec == TRAINER_LAYOUT[leaf], leaf
    assert not layers[leaf].sharding.is_fully_replicated
    assert sharded.opt_state[1][0].nu["layers"][leaf].sharding.spec == TRAINER_LAYOUT[leaf]
    assert np.abs(np.asarray(layers[leaf]) - initial["layers"][leaf]).max() > 1e-4


# --- sampler --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_moe_greedy_sampling_gives_single_device_tokens(mesh, name):
  """The sampler on the mesh (parameters published from the trainer layout to the
  sampler's) generates the single-device tokens, log-probs and stop steps.

  Weights drawn with std 0.1 (the dense test's 0.3 gives logits up to ~14, where float32
  summation order alone moves these models' log-probs by up to 2.3e-5 on the mesh, and by
  1e-5 between the ragged and dense dispatch on one device: measured); at 0.1 the mesh
  moves them by ~2.5e-6, under the dense test's 1e-5, with ~20 distinct tokens drawn."""
  config = CONFIGS[name]
  params = transformer.init_params(config, jax.random.PRNGKey(3), init_std=0.1)
  sampling_config = SamplingConfig(max_new_tokens=8, temperature=0.0, stop_tokens=(2,))
  tokens, mask = left_padded_prompts()
  want = rollout_lib.make_generate(config, sampling_config)(
      params, tokens, mask, jax.random.PRNGKey(0), 5)
  trainer_params = jax.device_put(params, rules.tree_shardings(params, mesh, rules.TRAINER_RULES))
  published = reshard.make_publish(mesh, params)(trainer_params)
  for leaf in ("expert_gate", "expert_up", "expert_down"):
    assert published["layers"][leaf].sharding.spec == SAMPLER_LAYOUT[leaf]
    assert not published["layers"][leaf].sharding.is_fully_replicated
  got = rollout_lib.make_generate(config, sampling_config, mesh)(
      published, tokens, mask, jax.random.PRNGKey(0), 5)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.completion_mask), np.asarray(want.completion_mask))
  np.testing.assert_allclose(np.asarray(got.behavior_logp), np.asarray(want.behavior_logp),
                             atol=1e-5)
  assert int(got.decode_steps) == int(want.decode_steps)
  assert len(set(np.asarray(want.tokens)[:, 8:].ravel().tolist())) > 3  # not a constant policy
  assert got.tokens.sharding.spec == P(("data", "fsdp"))
  # The routing record [B, S, L, k], written by prefill and every decode step, split by rows.
  assert want.experts.shape == (8, 16, config.n_layers, config.experts_per_token)
  np.testing.assert_array_equal(np.asarray(got.experts), np.asarray(want.experts))
  assert got.experts.sharding.spec == P(("data", "fsdp"))
  assert len(np.unique(np.asarray(want.experts)[:, 8:])) == config.num_experts
