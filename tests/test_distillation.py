"""Tests for on-policy distillation: the objectives against references, the train step with a
teacher, and the launcher's `config.distill` switches."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from experiments import train as launcher
from models import transformer
from models.config import get_preset
from rl import train
from rl import wiring
from rl.objectives import distillation
from tests.launcher_config import tiny_run_config
from tests.rl_fixtures import GRPO, random_rollout

CONFIG = get_preset("tiny", vocab_size=64, max_seq_len=32)


def _log_softmax64(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_sampled_estimators_average_to_the_exact_reverse_kl():
  rng = np.random.default_rng(0)
  student = _log_softmax64(rng.normal(size=7) * 1.5)
  teacher = _log_softmax64(rng.normal(size=7) * 1.5)
  exact = float(np.sum(np.exp(student) * (student - teacher)))
  n = 200_000
  tokens = rng.choice(7, size=n, p=np.exp(student))
  k1, k3 = distillation.token_estimators(
      jnp.broadcast_to(jnp.asarray(student, jnp.float32), (1, n, 7)),
      jnp.broadcast_to(jnp.asarray(teacher, jnp.float32), (1, n, 7)), jnp.asarray(tokens)[None])
  for k in (np.asarray(k1, np.float64), np.asarray(k3, np.float64)):
    assert abs(k.mean() - exact) < 4 * k.std() / np.sqrt(n), (k.mean(), exact)
  assert np.all(np.asarray(k3) >= -1e-6)  # k3 is non-negative, k1 is not
  np.testing.assert_allclose(
      float(distillation.exact_reverse_kl(jnp.asarray(student[None, None], jnp.float32),
                                          jnp.asarray(teacher[None, None], jnp.float32))[0, 0]),
      exact, rtol=1e-5)


def test_exact_reverse_kl_gradient_matches_float64_numpy():
  rng = np.random.default_rng(1)
  z = rng.normal(size=(2, 5, 11)) * 2.0  # student logits; the teacher's are fixed
  teacher = _log_softmax64(rng.normal(size=(2, 5, 11)) * 2.0)

  def loss(logits):
    return distillation.exact_reverse_kl(jax.nn.log_softmax(logits, axis=-1),
                                         jnp.asarray(teacher, jnp.float32)).sum()

  grad = np.asarray(jax.grad(loss)(jnp.asarray(z, jnp.float32)))
  # d/dz_k sum_j p_j (log p_j - log q_j) = p_k (log p_k - log q_k - KL).
  p = _log_softmax64(z)
  kl = np.sum(np.exp(p) * (p - teacher), axis=-1, keepdims=True)
  np.testing.assert_allclose(grad, np.exp(p) * (p - teacher - kl), atol=2e-6)


def test_forward_kl_topk_renormalises_the_teachers_top_tokens():
  rng = np.random.default_rng(2)
  student = _log_softmax64(rng.normal(size=(1, 1, 9)))
  teacher = _log_softmax64(rng.normal(size=(1, 1, 9)) * 3)
  config = distillation.Distill("forward_kl_topk", 1.0, True, 3, CONFIG)
  value, _ = distillation.forward_kl_topk(jnp.asarray(student, jnp.float32),
                                          jnp.asarray(teacher, jnp.float32), None, None, config)
  top = np.argsort(-teacher[0, 0])[:3]
  p = np.exp(teacher[0, 0, top]) / np.exp(teacher[0, 0, top]).sum()
  np.testing.assert_allclose(float(value[0, 0]),
                             np.sum(p * (np.log(p) - student[0, 0, top])), rtol=1e-5)


def _step(objective, teacher_params, top_k=4, with_reward=False):
  optimizer = train.make_optimizer(1e-2)
  distill = distillation.Distill(objective, 1.0, with_reward, top_k, CONFIG)
  return train.make_train_step(CONFIG, optimizer, GRPO, distill=distill,
                               teacher_params=teacher_params), optimizer


@pytest.mark.parametrize("objective", ["reverse_kl", "k1", "k3"])
def test_pure_opd_with_the_student_as_teacher_has_zero_gradient(objective):
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  step, optimizer = _step(objective, jax.tree.map(jnp.copy, params))
  batch = random_rollout(seed=3, batch=4, length=12)
  _, metrics = step(train.init_train_state(jax.tree.map(jnp.copy, params), optimizer), batch)
  # Zero up to float32 rounding: the student's and the teacher's forwards compile apart.
  # (A random student's gradient norm on this batch is ~1: the next test.)
  assert float(metrics["grad_norm"]) < 1e-5
  assert abs(float(metrics["distill_reverse_kl"])) < 1e-6
  assert float(metrics["distill_k1_var"]) < 1e-10


def test_forward_kl_over_the_whole_vocabulary_is_zero_at_the_teacher():
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  step, optimizer = _step("forward_kl_topk", jax.tree.map(jnp.copy, params),
                          top_k=CONFIG.vocab_size)
  batch = random_rollout(seed=3, batch=4, length=12)
  _, metrics = step(train.init_train_state(params, optimizer), batch)
  assert float(metrics["grad_norm"]) < 1e-5


def test_distillation_pulls_the_student_toward_another_teacher():
  student = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  teacher = transformer.init_params(CONFIG, jax.random.PRNGKey(1), init_std=0.5)
  step, optimizer = _step("reverse_kl", teacher, with_reward=True)
  batch = random_rollout(seed=4, batch=4, length=12)
  state = train.init_train_state(student, optimizer)
  kls = []
  for _ in range(15):
    state, metrics = step(state, batch)
    kls.append(float(metrics["distill_reverse_kl"]))
    if len(kls) == 1:
      assert float(metrics["grad_norm"]) > 0.1  # what "zero" is measured against above
  assert kls[-1] < 0.7 * kls[0], kls
  assert "clip_fraction" in metrics  # with_reward keeps the policy objective


# --- the launcher ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
  """A tiny warm start alone (another seed than the students'), the launcher tests' teacher."""
  workdir = tmp_path_factory.mktemp("teacher")
  launcher.run(tiny_run_config(workdir, {"rl.steps": 0, "seed": 1}))
  return str(workdir)


@pytest.mark.parametrize("objective", ["reverse_kl", "k1", "k3", "forward_kl_topk"])
def test_each_objective_trains_through_the_launcher(tmp_path, teacher_run, objective):
  config = tiny_run_config(tmp_path, {"distill.teacher": teacher_run, "distill.coef": 1.0,
                                      "distill.objective": objective,
                                      "distill.with_reward": objective != "k1"})
  summary = launcher.run(config)
  records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  steps = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert len(steps) == 2 and summary["steps"] == 5
  assert all(np.isfinite(r["distill_loss"]) and r["distill_reverse_kl"] > 0 for r in steps)
  assert all(("clip_fraction" in r) == (objective != "k1") for r in steps)


def test_the_teacher_is_sharded_like_the_policy_on_a_mesh_and_chunks(tmp_path, teacher_run):
  """A 2 x 4 (data x fsdp) mesh: the teacher's parameters are laid out by the trainer's
  rules inside the sharded step, and the run trains as on one device; so does the run
  with --config.rl.logprob_chunk=3 (the distillation term a chunk of positions at a time)."""
  flags_ = {"distill.teacher": teacher_run, "distill.coef": 1.0}
  one = launcher.run(tiny_run_config(tmp_path / "one", flags_))
  mesh = launcher.run(tiny_run_config(tmp_path / "mesh", {**flags_, "mesh.data": 2,
                                                          "mesh.fsdp": -1}))
  launcher.run(tiny_run_config(tmp_path / "chunked", {**flags_, "rl.logprob_chunk": 3}))
  field = lambda workdir, name: [json.loads(line)[name]
                                 for line in open(os.path.join(workdir, "metrics.jsonl"))
                                 if f'"{name}"' in line and '"distill_loss"' in line]
  assert len(field(tmp_path / "one", "distill_reverse_kl")) == 2
  for name in ("distill_reverse_kl", "distill_loss", "loss"):
    np.testing.assert_allclose(field(tmp_path / "mesh", name), field(tmp_path / "one", name),
                               rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(field(tmp_path / "chunked", name), field(tmp_path / "one", name),
                               rtol=1e-4, err_msg=name)
  assert mesh["final_accuracy"] == one["final_accuracy"]


def test_a_teacher_with_another_tokenizer_is_refused_before_step_one(tmp_path):
  config = tiny_run_config(tmp_path, {"distill.teacher": "smollm2", "distill.coef": 1.0})
  with pytest.raises(ValueError, match="another tokenizer than the student"):
    launcher.run(config)
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints", "3"))  # no step ran


@pytest.mark.parametrize("overrides, message", [
    ({"distill.coef": 1.0}, "needs both a teacher and a coefficient"),
    ({"distill.teacher": "somewhere"}, "needs both a teacher and a coefficient"),
    ({"distill.with_reward": False}, "drops the policy objective"),
    ({"distill.teacher": "somewhere", "distill.coef": 1.0, "distill.objective": "js"},
     r"Unknown distillation objective 'js' \(config.distill.objective\)"),
    ({"distill.teacher": "somewhere", "distill.coef": 1.0,
      "rl.prefix_shared_forward": True}, "prefix_shared_forward off"),
])
def test_inconsistent_distillation_settings_are_refused(tmp_path, overrides, message):
  with pytest.raises(ValueError, match=message):
    wiring.validate(tiny_run_config(tmp_path, overrides))


def test_the_opd_recipe_config_is_a_valid_pure_opd_run():
  from experiments.configs import opd_running_sum  # pylint: disable=import-outside-toplevel
  config = opd_running_sum.get_config()
  config.warm_start.init_from = ""  # its folder exists once the documented command has run
  wiring.validate(config)
  assert config.distill.coef > 0 and not config.distill.with_reward
  assert config.distill.teacher.endswith("teacher")


def test_distill_term_is_aggregated_like_the_objective():
  """A hand-built batch: the step's distill_loss is the token mean of the exact KL."""
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  teacher = transformer.init_params(CONFIG, jax.random.PRNGKey(5), init_std=0.5)
  batch = random_rollout(seed=6, batch=2, length=10)
  config = ml_collections.FrozenConfigDict(dict(GRPO, aggregation="token_mean"))
  optimizer = train.make_optimizer(0.0)
  step = train.make_train_step(CONFIG, optimizer, config, distill=distillation.Distill(
      "reverse_kl", 1.0, False, 4, CONFIG), teacher_params=teacher)
  _, metrics = step(train.init_train_state(jax.tree.map(jnp.copy, params), optimizer), batch)
  dist = lambda p: distillation.next_token_logprobs(transformer.forward(
      p, batch.tokens, transformer.positions_from_mask(batch.token_mask), batch.token_mask,
      CONFIG)[0])
  kl = np.asarray(distillation.exact_reverse_kl(dist(params), dist(teacher)))
  mask = np.asarray(batch.completion_mask)
  np.testing.assert_allclose(float(metrics["distill_loss"]), kl[mask].mean(), rtol=1e-5)


@pytest.mark.parametrize("objective", ["reverse_kl", "k1", "k3", "forward_kl_topk"])
def test_chunked_distillation_equals_the_dense_step(objective):
  """rl.logprob_chunk with a teacher: the distributions a chunk of 7 positions at a time
  (11 predicting positions: the last chunk padded) give the dense step's loss, metrics and
  gradient (read off one SGD step of rate 1), at a vocabulary of 4099, temperature 0.8."""
  config = get_preset("tiny", vocab_size=4099, max_seq_len=32)
  student = transformer.init_params(config, jax.random.PRNGKey(0))
  teacher = transformer.init_params(config, jax.random.PRNGKey(5), init_std=0.3)
  batch = random_rollout(seed=7, batch=4, length=12)
  batch = batch.replace(tokens=batch.tokens * 80 % 4099)  # tokens across the vocabulary
  metrics, grads = {}, {}
  for chunk in (0, 7):
    distill = distillation.Distill(objective, 0.7, True, 16, config)
    step = train.make_train_step(config, optax.sgd(1.0), GRPO, distill=distill,
                                 teacher_params=teacher, logprob_chunk=chunk, temperature=0.8)
    state, out = step(train.init_train_state(jax.tree.map(jnp.copy, student), optax.sgd(1.0)),
                      batch)
    metrics[chunk] = {k: float(v) for k, v in out.items()}
    grads[chunk] = jax.tree.map(lambda old, new: np.asarray(old) - np.asarray(new), student,
                                state.params)
  for name, value in metrics[0].items():
    np.testing.assert_allclose(metrics[7][name], value, rtol=2e-5, atol=1e-6, err_msg=name)
  for dense, chunked in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[7])):
    np.testing.assert_allclose(chunked, dense, rtol=1e-4, atol=1e-6)
  assert metrics[0]["grad_norm"] > 0 and metrics[0]["distill_reverse_kl"] > 0.01


def test_chunked_distillation_never_holds_the_full_distributions():
  """XLA's memory analysis of the compiled step: chunking drops at least the student's and
  the teacher's [B, T, V] float32 log-softmax (2 x 8 x 64 x 8192 x 4 bytes)."""
  config = get_preset("tiny", vocab_size=8192, max_seq_len=64)
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  batch = random_rollout(seed=1, batch=8, length=64)
  temps = {}
  for chunk in (0, 8):
    distill = distillation.Distill("reverse_kl", 1.0, True, 4, config)
    step = train.make_train_step(config, train.make_optimizer(1e-3), GRPO, distill=distill,
                                 teacher_params=params, logprob_chunk=chunk)
    state = train.init_train_state(params, train.make_optimizer(1e-3))
    temps[chunk] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  assert temps[0] - temps[8] >= 2 * 8 * 64 * 8192 * 4
