"""The mixture-of-experts MLP (models/moe.py): routing against a NumPy reference of each
family's convention, ragged dispatch against the dense reference (values and gradients),
the replay rule and the auxiliary losses against hand computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe


def _numpy_route(logits, k, routing, normalize):
  weights, experts = [], []
  for z in np.asarray(logits, np.float64):
    order = sorted(range(len(z)), key=lambda e: (-z[e], e))[:k]
    if routing == "topk_softmax":
      w = np.exp(z[order] - z[order].max())
      w = w / w.sum()
    else:
      p = np.exp(z - z.max())
      p = p / p.sum()
      w = p[order]
      if normalize:
        w = w / w.sum()
    weights.append(w)
    experts.append(order)
  return np.array(weights), np.array(experts)


@pytest.mark.parametrize("routing,normalize", [("softmax_topk", True), ("softmax_topk", False),
                                               ("topk_softmax", True)])
def test_routing_follows_each_familys_convention(routing, normalize):
  logits = jax.random.normal(jax.random.PRNGKey(0), (64, 8)) * 3
  weights, experts = moe.route(logits, 2, routing, normalize)
  want_w, want_e = _numpy_route(logits, 2, routing, normalize)
  np.testing.assert_array_equal(experts, want_e)
  np.testing.assert_allclose(weights, want_w, rtol=1e-5, atol=1e-7)
  if not normalize:  # Qwen2-MoE: the raw probabilities, which sum to less than 1
    assert float(weights.sum(axis=-1).max()) < 1.0


def test_the_two_normalised_conventions_agree():
  logits = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
  a = moe.route(logits, 4, "softmax_topk", True)
  b = moe.route(logits, 4, "topk_softmax")
  np.testing.assert_array_equal(a[1], b[1])
  np.testing.assert_allclose(a[0], b[0], rtol=1e-5)


def _experts(key, num_experts=8, d=16, f=24, tokens=40, k=2):
  keys = jax.random.split(key, 5)
  h = jax.random.normal(keys[0], (tokens, d))
  gate, up = (jax.random.normal(x, (num_experts, d, f)) * 0.2 for x in keys[1:3])
  down = jax.random.normal(keys[3], (num_experts, f, d)) * 0.2
  logits = jax.random.normal(keys[4], (tokens, num_experts))
  weights, experts = moe.route(logits, k, "softmax_topk")
  return h, weights, experts, gate, up, down


@pytest.mark.parametrize("num_experts,k,tokens", [
    (8, 2, 40), pytest.param(4, 1, 7, marks=pytest.mark.slow),
    pytest.param(16, 4, 300, marks=pytest.mark.slow)])
def test_ragged_dispatch_equals_the_dense_reference(num_experts, k, tokens):
  h, weights, experts, gate, up, down = _experts(jax.random.PRNGKey(num_experts), num_experts,
                                                 tokens=tokens, k=k)
  dense = moe.experts_dense(h, weights, experts, gate, up, down)
  ragged = moe.experts_ragged(h, weights, experts, gate, up, down)
  np.testing.assert_allclose(ragged, dense, rtol=1e-5, atol=1e-5)


def test_ragged_dispatch_has_the_dense_references_gradients():
  h, weights, experts, gate, up, down = _experts(jax.random.PRNGKey(8))

  def loss(fn):
    return lambda *args: jnp.sum(jnp.sin(fn(args[0], args[1], experts, *args[2:])))
  grads_dense = jax.grad(loss(moe.experts_dense), argnums=range(5))(h, weights, gate, up, down)
  grads_ragged = jax.grad(loss(moe.experts_ragged), argnums=range(5))(h, weights, gate, up, down)
  for g_ragged, g_dense in zip(grads_ragged, grads_dense):
    np.testing.assert_allclose(g_ragged, g_dense, rtol=1e-4, atol=1e-5)


def test_an_expert_no_token_chose_gets_no_gradient_and_nothing_is_dropped():
  h, weights, experts, gate, up, down = _experts(jax.random.PRNGKey(3), tokens=12)
  experts = jnp.where(experts == 5, 6, experts)  # nobody routes to expert 5
  experts = experts.at[:, 1].set(jnp.where(experts[:, 0] == experts[:, 1], 7, experts[:, 1]))
  grad_gate = jax.grad(lambda g: moe.experts_ragged(h, weights, experts, g, up, down).sum())(gate)
  assert float(jnp.abs(grad_gate[5]).max()) == 0.0
  # Every token's output is its own chosen experts' weighted sum (capacity-free).
  for n in range(12):
    want = sum(float(weights[n, j]) * moe._swiglu(h[n], gate[e], up[e], down[e])
               for j, e in enumerate(np.asarray(experts[n])))
    np.testing.assert_allclose(moe.experts_ragged(h, weights, experts, gate, up, down)[n],
                               want, rtol=1e-5, atol=1e-6)


def test_replay_renormalises_the_routers_probabilities_over_the_recorded_experts():
  logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
  np.testing.assert_allclose(moe.replay_weights(logits, jnp.array([[0, 2]])),
                             [[0.25, 0.75]], rtol=1e-6)
  # Replaying the router's own choice gives its own normalised weights.
  logits = jax.random.normal(jax.random.PRNGKey(4), (50, 8))
  weights, experts = moe.route(logits, 2, "softmax_topk", True)
  np.testing.assert_allclose(moe.replay_weights(logits, experts), weights, rtol=1e-5)
  # The router still gets a gradient through the replayed weights.
  grad = jax.grad(lambda z: moe.replay_weights(z, experts)[:, 0].sum())(logits)
  assert float(jnp.abs(grad).max()) > 0


def test_auxiliary_losses_equal_hand_computations():
  # Uniform router probabilities and perfectly balanced choices: E * sum(1/E * 1/E) = 1.
  logits = jnp.zeros((4, 4))
  experts = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]])
  assert float(moe.load_balancing_loss(logits, experts)) == pytest.approx(1.0)
  # Every token to expert 0 with probability p0: E * 1 * p0.
  logits = jnp.log(jnp.array([[0.7, 0.1, 0.1, 0.1]] * 3))
  experts = jnp.array([[0], [0], [0]])
  assert float(moe.load_balancing_loss(logits, experts)) == pytest.approx(4 * 0.7, rel=1e-6)
  # Masked tokens do not count; the z-loss is the mean squared logsumexp.
  logits = jnp.array([[0.0, 0.0], [5.0, -1.0]])
  mask = jnp.array([True, False])
  assert float(moe.router_z_loss(logits, mask)) == pytest.approx(np.log(2) ** 2, rel=1e-6)
  assert float(moe.router_z_loss(logits)) == pytest.approx(
      (np.log(2) ** 2 + np.log(np.exp(5) + np.exp(-1)) ** 2) / 2, rel=1e-6)
  assert float(moe.load_balancing_loss(logits, jnp.array([[0], [1]]), mask)) == pytest.approx(
      2 * (1.0 * 0.5), rel=1e-6)


# --- The MoE decoder (models/transformer.py with ModelConfig.num_experts > 0). ---

from models import transformer  # pylint: disable=wrong-import-position
from tests import tiny


def _moe_config(**changes):
  return tiny.model(mlp_dim=16, num_experts=6, experts_per_token=2, **changes)


def _batch(config, rows=3, length=12, seed=1):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (rows, length), 0, config.vocab_size)
  mask = jnp.ones((rows, length), bool).at[0, :4].set(False)  # one left-padded row
  return tokens, transformer.positions_from_mask(mask), mask


def _params(config, seed=0):
  # A wider router init than the default: routing that differs between tokens.
  params = transformer.init_params(config, jax.random.PRNGKey(seed), init_std=0.3)
  return params


def _numpy_moe_mlp(h, layer, config, experts=None):
  """One MoE MLP per token in float64 NumPy: routing by the family's rule (or the replay
  rule over given experts), each chosen expert's SwiGLU, the shared expert's sigmoid gate."""
  silu = lambda a: a / (1 + np.exp(-a))
  swiglu = lambda x, g, u, d: (silu(x @ g) * (x @ u)) @ d
  f64 = {k: np.asarray(v, np.float64) for k, v in layer.items()}
  out = []
  for n, x in enumerate(np.asarray(h, np.float64)):
    z = x @ f64["router"]
    if experts is None:
      w, chosen = _numpy_route(z[None], config.experts_per_token, config.routing,
                               config.normalize_routing)
      w, chosen = w[0], chosen[0]
    else:
      chosen = np.asarray(experts[n])
      if config.routing == "softmax_topk" and not config.normalize_routing:
        p = np.exp(z - z.max())
        w = (p / p.sum())[chosen]
      else:
        w = np.exp(z[chosen] - z[chosen].max())
        w = w / w.sum()
    y = sum(wj * swiglu(x, f64["expert_gate"][e], f64["expert_up"][e], f64["expert_down"][e])
            for wj, e in zip(w, chosen))
    if config.shared_expert_dim:
      scale = 1 / (1 + np.exp(-(x @ f64["shared_scale"])[0]))
      y = y + scale * swiglu(x, f64["shared_gate"], f64["shared_up"], f64["shared_down"])
    out.append(y)
  return np.array(out)


@pytest.mark.parametrize("changes", [  # the quick tier: the default
    {}, pytest.param({"routing": "topk_softmax"}, marks=pytest.mark.slow),
    pytest.param({"normalize_routing": False}, marks=pytest.mark.slow),
    pytest.param({"shared_expert_dim": 12}, marks=pytest.mark.slow),
    pytest.param({"moe_dispatch": "dense", "shared_expert_dim": 12}, marks=pytest.mark.slow)])
@pytest.mark.parametrize("replay", [pytest.param(False, marks=pytest.mark.slow), True])
def test_moe_mlp_equals_a_numpy_reference(changes, replay):
  config = _moe_config(**changes)
  params = _params(config)
  layer = jax.tree.map(lambda a: a[0], params["layers"])
  h = jax.random.normal(jax.random.PRNGKey(2), (2, 9, config.d_model))
  experts = None
  if replay:  # random distinct experts, not the router's choice
    keys = jax.random.split(jax.random.PRNGKey(3), 18)
    experts = jnp.stack([jax.random.permutation(k, config.num_experts)[:2] for k in keys])
  out, routed = transformer._moe_mlp(h, layer, config,
                                     None if experts is None else experts.reshape(2, 9, 2))
  want = _numpy_moe_mlp(h.reshape(18, -1), layer, config, experts)
  np.testing.assert_allclose(out.reshape(18, -1), want, rtol=2e-5, atol=2e-6)
  if replay:
    np.testing.assert_array_equal(routed.used.reshape(18, 2), experts)
    assert (routed.own.reshape(18, 2) != experts).any()  # the replay overrode the router
  assert len(np.unique(np.asarray(routed.own))) >= 4  # the routing is not degenerate


@pytest.mark.slow
def test_moe_decoder_dispatches_ragged_as_dense_values_and_gradients():
  config = _moe_config(shared_expert_dim=8)
  params = _params(config)
  tokens, positions, mask = _batch(config)

  def loss(p, dispatch):
    logits, _ = transformer.forward(p, tokens, positions, mask, config.replace(moe_dispatch=dispatch))
    return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0) ** 2) / 1e3, logits

  (l_r, logits_r), g_r = jax.value_and_grad(loss, has_aux=True)(params, "ragged")
  (l_d, logits_d), g_d = jax.value_and_grad(loss, has_aux=True)(params, "dense")
  np.testing.assert_allclose(logits_r, logits_d, rtol=1e-5, atol=1e-5)
  for name in ("router", "expert_gate", "expert_down", "shared_gate", "q"):
    np.testing.assert_allclose(g_r["layers"][name], g_d["layers"][name], rtol=1e-4, atol=1e-6)
  assert float(jnp.abs(g_r["layers"]["router"]).max()) > 0  # the router learns


@pytest.mark.slow
def test_replaying_the_routers_own_choice_is_the_plain_forward_and_remat_changes_nothing():
  config = _moe_config(normalize_routing=False)
  params = _params(config)
  tokens, positions, mask = _batch(config)
  _, stats = transformer.hidden_states_with_routing(params, tokens, positions, mask, config)
  assert stats.experts.shape == (3, 12, 2, 2)

  def loss(p, experts, remat="none"):
    logits, _ = transformer.forward(p, tokens, positions, mask, config.replace(remat=remat),
                                    experts=experts)
    return jnp.sum(jnp.sin(logits)), logits

  (_, plain), g_plain = jax.value_and_grad(loss, has_aux=True)(params, None)
  (_, replayed), g_replayed = jax.value_and_grad(loss, has_aux=True)(params, stats.experts)
  (_, _), g_remat = jax.value_and_grad(loss, has_aux=True)(params, stats.experts, "full")
  np.testing.assert_allclose(replayed, plain, rtol=1e-6, atol=1e-6)
  for g in (g_replayed, g_remat):
    np.testing.assert_allclose(g["layers"]["router"], g_plain["layers"]["router"], rtol=1e-4,
                               atol=1e-7)
    np.testing.assert_allclose(g["layers"]["expert_up"], g_plain["layers"]["expert_up"],
                               rtol=1e-4, atol=1e-7)
  # Other experts change the logits from the replayed token on, and not before it.
  other = stats.experts.at[1, 6, 0].set((stats.experts[1, 6, 0] + 1) % config.num_experts)
  other = other.at[1, 6, 0].set(jnp.where(other[1, 6, 0] == other[1, 6, 1],
                                          (other[1, 6, 0] + 1) % config.num_experts,
                                          other[1, 6, 0]))
  changed, _ = transformer.forward(params, tokens, positions, mask, config, experts=other)
  differs = np.abs(np.asarray(changed - plain)).max(axis=-1) > 1e-5
  assert differs[1, 6] and not differs[1, :6].any() and not differs[[0, 2]].any()


@pytest.mark.slow
def test_router_stats_count_only_real_tokens():
  config = _moe_config()
  params = _params(config)
  tokens, positions, mask = _batch(config)
  _, stats = transformer.hidden_states_with_routing(params, tokens, positions, mask, config)
  # Row 0's four left-padding slots do not count: its real suffix alone gives the same
  # per-layer losses as the real tokens gathered from the batch.
  h_layers = []
  x = params["embed"][tokens]
  mask_attn = transformer.attention_mask(mask, tokens.shape[1], 0)
  for i in range(config.n_layers):
    layer = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    x, routed = transformer._block(x, layer, positions, mask_attn, config)
    h_layers.append(routed)
  for i, routed in enumerate(h_layers):
    real = np.asarray(mask).reshape(-1)
    logits = routed.logits.reshape(-1, config.num_experts)[real]
    used = routed.used.reshape(-1, 2)[real]
    assert float(stats.load_balancing[i]) == pytest.approx(
        float(moe.load_balancing_loss(logits, used)), rel=1e-5)
    assert float(stats.z_loss[i]) == pytest.approx(float(moe.router_z_loss(logits)), rel=1e-5)
  np.testing.assert_array_equal(stats.experts[:, :, 1], h_layers[1].own)


@pytest.mark.slow
def test_verification_forward_writes_each_rows_routing_at_its_own_slots():
  # Speculative decoding's forward: row b runs 3 tokens at slots [starts[b], starts[b] + 3).
  config = _moe_config()
  params = _params(config)
  tokens, positions, mask = _batch(config)
  _, stats = transformer.hidden_states_with_routing(params, tokens, positions, mask, config)
  _, cache = transformer.forward(params, tokens, positions, mask, config,
                                 cache=transformer.init_cache(config, 3, 12), cache_index=0)
  cache = dict(cache, experts=jnp.zeros_like(cache["experts"]))  # forget the prefill's record
  starts = jnp.array([5, 6, 8])
  window = starts[:, None] + jnp.arange(3)[None, :]  # [B, 3]
  pick = lambda a: jnp.take_along_axis(a, window, axis=1)
  layers = transformer.unstack_layers(params, config, 12)
  _, written = transformer.forward_verify(layers, pick(tokens), pick(positions), mask, config,
                                          transformer.to_decode_cache(cache), starts)
  record = np.asarray(transformer.from_decode_cache(written)["experts"])  # [L, B, S, k]
  own = np.sort(np.asarray(stats.experts), axis=-1)  # [B, T, L, k]
  for b, start in enumerate(np.asarray(starts)):
    for slot in range(12):
      got = np.sort(record[:, b, slot], axis=-1)
      if start <= slot < start + 3:
        np.testing.assert_array_equal(got, own[b, slot])
      else:
        assert not got.any(), f"row {b} slot {slot} was written"
