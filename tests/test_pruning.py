"""Tests for rl.rollouts.pruning (arrol): the survivor rule, survivors that are exactly the
unpruned sampler's rows while the pruned ones stop at the prefix, the quality head's loss
and gradient against NumPy, its online fit, the head's state across a checkpoint, and the
launcher."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import train as launcher
from models import transformer
from rl import checkpoint
from rl.rollouts import pruning
from sampling import sampler as sampler_lib
from sampling.sampler import SamplingConfig
from tests.launcher_config import rl_steps, tiny_run_config
from tests import tiny

CONFIG = tiny.model(vocab_size=32, max_seq_len=64)


def test_select_survivors_takes_the_top_and_the_bottom_of_each_prompt():
  scores = jnp.array([[0.1, 0.9, 0.5, 0.7, 0.2, 0.3],
                      [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],   # ties: the lowest indices first
                      [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
  np.testing.assert_array_equal(pruning.select_survivors(scores, 4, 0.5),
                                [[0, 1, 3, 4], [0, 1, 4, 5], [0, 1, 4, 5]])
  # rho = 0.75: the 3 highest (0.9, 0.7, 0.5) and the lowest (0.1); rho = 0: the 4 lowest.
  np.testing.assert_array_equal(pruning.select_survivors(scores[:1], 4, 0.75), [[0, 1, 2, 3]])
  np.testing.assert_array_equal(pruning.select_survivors(scores[:1], 4, 0.0), [[0, 2, 4, 5]])


def _prompts(prompts, candidates, seed=0):
  rng = np.random.default_rng(seed)
  tokens = np.repeat(rng.integers(3, CONFIG.vocab_size, (prompts, 5)), candidates, axis=0)
  mask = np.ones_like(tokens, bool)
  mask[:, 0] = False  # left padding in the first slot
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


@pytest.mark.parametrize("positive_share", [0.5, pytest.param(1.0, marks=pytest.mark.slow)])
def test_survivors_are_the_unpruned_rows_and_pruned_rows_stop_at_the_prefix(positive_share):
  """A random head (so the choice is not the identity): each survivor's tokens, log-probs
  and versions equal that row of one unpruned generate with the same key; the tokens
  decoded are every candidate's prefix plus the survivors' rest, counted from the unpruned
  rows; stop tokens (id 2) end rows before and after the prefix."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  sampling = SamplingConfig(max_new_tokens=20, temperature=1.0, stop_tokens=(2,))
  prompts, candidates, group, prefix = 3, 6, 4, 5
  tokens, mask = _prompts(prompts, candidates)
  head = pruning.QualityHead(
      weight=jax.random.normal(jax.random.PRNGKey(7), (CONFIG.d_model,)), bias=jnp.zeros(()))
  rng = jax.random.PRNGKey(3)
  out = pruning.pruned_generate(params, head, tokens, mask, rng, 4, model_config=CONFIG,
                                sampling_config=sampling, candidates=candidates,
                                group_size=group, prefix_tokens=prefix,
                                positive_share=positive_share)
  full = sampler_lib.generate(params, tokens, mask, rng, CONFIG, sampling, 4)
  chosen = np.asarray(out.survivors)
  assert len(chosen) == prompts * group and sorted(set(chosen)) == list(chosen)
  assert chosen.tolist() != list(range(prompts * group))
  for field in ("tokens", "completion_mask", "behavior_logp", "version"):
    np.testing.assert_array_equal(np.asarray(getattr(out.generation, field)),
                                  np.asarray(getattr(full, field))[chosen], err_msg=field)
  lengths = np.asarray(full.completion_len)
  decoded = np.minimum(lengths, prefix).sum() + (lengths[chosen] - np.minimum(
      lengths[chosen], prefix)).sum()
  assert int(out.decoded_tokens) == decoded < lengths.sum()
  assert (lengths < prefix).any() and (lengths > prefix).any()  # both kinds of row occur
  # The survivors are the head's choice: top and bottom of its predictions per prompt.
  expected = pruning.select_survivors(out.predicted.reshape(prompts, candidates), group,
                                      positive_share) + candidates * np.arange(prompts)[:, None]
  np.testing.assert_array_equal(chosen, np.asarray(expected).reshape(-1))


def test_head_loss_and_gradient_equal_numpy():
  rng = np.random.default_rng(0)
  features = rng.normal(size=(50, 8)).astype(np.float32)
  labels = (rng.random(50) < 0.4).astype(np.float32)
  head = pruning.QualityHead(weight=jnp.asarray(rng.normal(size=8), jnp.float32),
                             bias=jnp.asarray(0.3, jnp.float32))
  z = features @ np.asarray(head.weight, np.float64) + 0.3
  p = 1 / (1 + np.exp(-z))
  loss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
  np.testing.assert_allclose(float(pruning.head_loss(head, features, labels)), loss, rtol=1e-5)
  grads = jax.grad(pruning.head_loss)(head, features, labels)
  np.testing.assert_allclose(grads.weight, features.T @ (p - labels) / 50, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(grads.bias, np.mean(p - labels), rtol=1e-4, atol=1e-6)


def test_fit_head_learns_a_separable_outcome_online():
  """Batch after batch of features whose first coordinate decides the label: the fitted
  head's loss falls and it ranks the batch's successes above its failures."""
  rng = np.random.default_rng(1)
  head = pruning.init_head(8)
  opt_state = optax.adam(0.05).init(head)
  losses = []
  for _ in range(30):
    features = rng.normal(size=(32, 8)).astype(np.float32)
    labels = (features[:, 0] > 0.3).astype(np.float32)
    head, opt_state, loss = pruning.fit_head(head, opt_state, jnp.asarray(features),
                                             jnp.asarray(labels), learning_rate=0.05, steps=4)
    losses.append(float(loss))
  assert losses[0] == pytest.approx(np.log(2), rel=1e-5)  # the zero head predicts 0.5
  assert losses[-1] < 0.35
  logits = np.asarray(pruning.head_logits(head, features))
  assert logits[labels == 1].min() > np.median(logits[labels == 0])



@pytest.mark.slow  # the quick tier runs pruned rollouts through the launcher in test_feature_matrix
def test_pruned_rollouts_through_the_launcher_and_their_head_resumes(tmp_path):
  """--config.rollout.kind=pruned: each step starts prompts x candidates rollouts, trains on
  prompts x group_size, and fits the head; a run stopped after its first RL step and
  relaunched restores the head from its checkpoint and ends where the uninterrupted run
  does."""
  overrides = {"rollout.kind": "pruned", "rollout.pruning.candidates": 6,
               "rollout.pruning.prefix_tokens": 2, "rl.steps": 2, "checkpoint.every": 1,
               "eval.every": 1}
  launcher.run(tiny_run_config(tmp_path / "full", overrides))
  records = rl_steps(tmp_path / "full")
  assert len(records) == 2
  for r in records:
    assert r["rollouts"] == 2 * 6 and r["pruned_rows"] == 2 * (6 - 4)
    assert r["trained_tokens"] <= r["sampled_tokens"] and r["time_head_s"] > 0
    assert np.isfinite(r["head_loss"])
  assert records[0]["head_loss"] == pytest.approx(np.log(2), rel=1e-5)  # before any fit
  assert records[1]["head_loss"] != records[0]["head_loss"]

  launcher.run(tiny_run_config(tmp_path / "stopped", {**overrides, "rl.steps": 1}))
  config = tiny_run_config(tmp_path / "stopped", overrides)
  config.resume.allow_changes = "rl.steps"
  launcher.run(config)
  resumed = rl_steps(tmp_path / "stopped")
  assert resumed[-1]["head_loss"] == records[1]["head_loss"]
  manager = lambda name: checkpoint.make_manager(str(tmp_path / name / "checkpoints"))
  full_tree, _ = checkpoint.restore_tree(manager("full"), manager("full").latest_step())
  stopped_tree, _ = checkpoint.restore_tree(manager("stopped"), manager("stopped").latest_step())
  jax.tree.map(np.testing.assert_array_equal, stopped_tree["producer"]["head"],
               full_tree["producer"]["head"])
  jax.tree.map(np.testing.assert_array_equal, stopped_tree["train"]["params"],
               full_tree["train"]["params"])


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.pruning.candidates": 4}, r"pruning.candidates = 4: arrol starts more rollouts"),
    ({"rollout.pruning.prefix_tokens": 50}, r"pruning.prefix_tokens = 50 must be below"),
    ({"selection.kind": "dynamic", "task.train_pool": 4}, r"config.selection.kind"),
    ({"mesh.data": 2, "mesh.fsdp": -1}, r"decodes on one device"),
])
def test_pruned_rollouts_refuse_what_they_cannot_do(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    launcher.run(tiny_run_config(tmp_path / "run", {"rollout.kind": "pruned", **overrides}))
  assert not (tmp_path / "run").exists()
