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


@pytest.mark.parametrize("num_experts,k,tokens", [(8, 2, 40), (4, 1, 7), (16, 4, 300)])
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
