"""Tests for on-policy distillation: the objectives against references, the train step with a
teacher, and the launcher's `config.distill` switches.

The train-step tests run on padded, ragged batches (prompts of different lengths
left-padded, completions of different lengths right-padded; `padded_rollout`) and compare
the step with each row run alone, unpadded, through the student and the teacher
(`reference_terms`, `reference_gradient`), which share no code with rl/train.py or
rl/objectives/distillation.py.

Mutants run against (on a scratch copy of rl/train.py, never committed), and what fails:
- padding-blind teacher (`distill_terms` hands the teacher the batch with every slot marked
  real: it attends to the padding, at slot-index positions), in both the dense and the
  chunked path: test_pure_opd_with_the_student_as_teacher_has_zero_gradient (all three),
  test_forward_kl_over_the_whole_vocabulary_is_zero_at_the_teacher,
  test_distillation_pulls_the_student_toward_another_teacher and every
  test_distillation_on_a_padded_ragged_batch_is_each_row_run_alone case;
- the same in the dense path only: those dense tests and every
  test_chunked_distillation_equals_the_dense_step case.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import train as launcher
from models import transformer
from rl import train
from rl import wiring
from rl.objectives import distillation
from rl.types import Rollout
from tests.launcher_config import tiny_run_config
from tests.rl_fixtures import GRPO, random_rollout
from tests import tiny

CONFIG = tiny.model(vocab_size=64, max_seq_len=32)


def _log_softmax64(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def padded_rollout(seed=0, prompt_lens=(3, 6, 2, 4), completion_lens=(8, 3, 5, 6), vocab=51):
  """A ragged batch in the sampler's layout: prompts of different lengths left-padded to
  the longest (pad id 0), each followed by a completion of its own length, then right
  padding; one random advantage per row, groups of two rows."""
  rng = np.random.default_rng(seed)
  rows, prompt_len = len(prompt_lens), max(prompt_lens)
  width = prompt_len + max(completion_lens)
  tokens = np.zeros((rows, width), np.int32)
  prompt, completion = np.zeros((rows, width), bool), np.zeros((rows, width), bool)
  for r, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
    tokens[r, prompt_len - p:prompt_len + c] = rng.integers(3, vocab, p + c)
    prompt[r, prompt_len - p:prompt_len] = True
    completion[r, prompt_len:prompt_len + c] = True
  adv = rng.normal(size=(rows, 1)) * completion
  return Rollout(tokens=jnp.asarray(tokens), prompt_mask=jnp.asarray(prompt),
                 completion_mask=jnp.asarray(completion),
                 behavior_logp=jnp.asarray(-3.0 * completion, jnp.float32),
                 version=jnp.zeros((rows, width), jnp.int32), group=jnp.arange(rows) // 2,
                 reward=jnp.zeros((rows,)), advantages=jnp.asarray(adv, jnp.float32))


def _rows_alone(batch):
  """Each row's real tokens moved to the front, without padding ([B, T], zeros after);
  where each row's predicting positions for its completion tokens are ([B, C] indices into
  that layout), the completion tokens [B, C] and which of the C columns are real."""
  tokens, real = np.asarray(batch.tokens), np.asarray(batch.token_mask)
  alone = np.take_along_axis(tokens, np.argsort(~real, axis=1, kind="stable"), 1)
  completion = np.asarray(batch.completion_mask)
  lengths = completion.sum(1)
  starts = real.sum(1) - lengths  # each row's prompt length
  columns = np.arange(lengths.max())
  valid = columns[None] < lengths[:, None]
  at = np.minimum(starts[:, None] + columns[None], real.sum(1)[:, None] - 1)
  targets = np.take_along_axis(alone, at, 1)
  return alone, at - 1, targets, valid


def _alone_logits(params, alone, config=CONFIG):
  """Logits [B, T, V] of rows run without padding: positions 0, 1, ..., no padding mask
  (causal attention keeps the zeros after a row's end away from its positions)."""
  positions = jnp.broadcast_to(jnp.arange(alone.shape[1]), alone.shape)
  return transformer.forward(params, jnp.asarray(alone), positions,
                             jnp.ones(alone.shape, bool), config)[0]


def reference_terms(student, teacher, batch, objective="reverse_kl", top_k=4,
                    temperature=1.0, config=CONFIG):
  """The distillation metrics and the objective's per-row means (float64 NumPy) with
  every row run alone, unpadded, through the student and the teacher: the independent
  computation the train step's batched, padded one must agree with."""
  alone, at, targets, valid = _rows_alone(batch)
  dist = lambda p: _log_softmax64(np.take_along_axis(
      np.asarray(_alone_logits(p, alone, config), np.float64), at[..., None], 1) / temperature)
  s, t = dist(student), dist(teacher)  # [B, C, V]
  exact = np.sum(np.exp(s) * (s - t), axis=-1)
  s_y = np.take_along_axis(s, targets[..., None], -1)[..., 0]
  t_y = np.take_along_axis(t, targets[..., None], -1)[..., 0]
  k1 = s_y - t_y
  k3 = np.expm1(-k1) + k1
  top = np.argsort(-t, axis=-1, kind="stable")[..., :top_k]
  p = np.take_along_axis(t, top, -1)
  p = p - np.log(np.exp(p).sum(-1, keepdims=True))
  forward = np.sum(np.exp(p) * (p - np.take_along_axis(s, top, -1)), axis=-1)
  per_token = dict(reverse_kl=exact, k1=k1 * s_y, k3=k3 * s_y, forward_kl_topk=forward)[objective]
  row_means = np.where(valid, per_token, 0).sum(1) / valid.sum(1)
  return dict(distill_reverse_kl=exact[valid].mean(), distill_k1_mean=k1[valid].mean(),
              distill_k1_var=k1[valid].var(), distill_k3_mean=k3[valid].mean(),
              distill_k3_var=k3[valid].var(), seq_mean_token_mean=row_means.mean())


def reference_gradient(student, teacher, batch, objective, top_k, temperature, coef,
                       config=CONFIG):
  """d/d student of coef * (the objective's seq_mean_token_mean over the batch), the rows
  run alone (JAX: the objectives written out again, per row, from their definitions)."""
  alone, at, targets, valid = _rows_alone(batch)
  at, targets, valid = jnp.asarray(at), jnp.asarray(targets), jnp.asarray(valid)
  dist = lambda p: jax.nn.log_softmax(jnp.take_along_axis(
      _alone_logits(p, alone, config), at[..., None], 1) / temperature, axis=-1)
  t = jax.lax.stop_gradient(dist(teacher))

  def loss(params):
    s = dist(params)
    s_y = jnp.take_along_axis(s, targets[..., None], -1)[..., 0]
    t_y = jnp.take_along_axis(t, targets[..., None], -1)[..., 0]
    k1 = jax.lax.stop_gradient(s_y - t_y)
    if objective == "reverse_kl":
      per_token = jnp.sum(jnp.exp(s) * (s - t), -1)
    elif objective == "k1":
      per_token = k1 * s_y
    elif objective == "k3":
      per_token = (jnp.expm1(-k1) + k1) * s_y
    else:
      p, top = jax.lax.top_k(t, top_k)
      p = jax.nn.log_softmax(p, -1)
      per_token = jnp.sum(jnp.exp(p) * (p - jnp.take_along_axis(s, top, -1)), -1)
    rows = jnp.where(valid, per_token, 0).sum(1) / valid.sum(1)
    return coef * rows.mean()
  return jax.grad(loss)(student)


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
  batch = padded_rollout(seed=3)  # left padding: a teacher that attended to it would differ
  _, metrics = step(train.init_train_state(jax.tree.map(jnp.copy, params), optimizer), batch)
  # Zero up to float32 rounding: the student's and the teacher's forwards compile apart.
  # (A random student's is above 0.1: test_distillation_pulls_the_student_toward_...)
  assert float(metrics["grad_norm"]) < 1e-5
  assert abs(float(metrics["distill_reverse_kl"])) < 1e-6
  assert float(metrics["distill_k1_var"]) < 1e-10


def test_forward_kl_over_the_whole_vocabulary_is_zero_at_the_teacher():
  params = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  step, optimizer = _step("forward_kl_topk", jax.tree.map(jnp.copy, params),
                          top_k=CONFIG.vocab_size)
  batch = padded_rollout(seed=3)
  _, metrics = step(train.init_train_state(params, optimizer), batch)
  assert float(metrics["grad_norm"]) < 1e-5


def test_distillation_pulls_the_student_toward_another_teacher():
  """15 steps on a padded, ragged batch: every step reports the reverse KL of the
  parameters it started from, as each row run alone measures it, and the KL falls."""
  student = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  teacher = transformer.init_params(CONFIG, jax.random.PRNGKey(1), init_std=0.5)
  step, optimizer = _step("reverse_kl", teacher, with_reward=True)
  batch = padded_rollout(seed=4)
  state = train.init_train_state(student, optimizer)
  kls = []
  for _ in range(15):
    before = reference_terms(state.params, teacher, batch)["distill_reverse_kl"]
    state, metrics = step(state, batch)
    kls.append(float(metrics["distill_reverse_kl"]))
    np.testing.assert_allclose(kls[-1], before, rtol=1e-4)
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


@pytest.mark.parametrize("objective", ["reverse_kl"] + [
    pytest.param(name, marks=pytest.mark.slow) for name in ("k1", "k3", "forward_kl_topk")])
def test_each_objective_trains_through_the_launcher(tmp_path, teacher_run, objective):
  """config.distill.objective reaches the step (token_mean aggregation, so that a
  distillation loss and the token-mean metrics average the same tokens): reverse_kl's loss
  is the reported reverse KL; k3's, sg(k3) log pi_s(y) with k3 >= 0, is negative; the
  forward top-k KL is another number than the reverse KL; pure OPD (k1 without reward) has
  no other loss term and no policy-objective metrics."""
  config = tiny_run_config(tmp_path, {"distill.teacher": teacher_run, "distill.coef": 1.0,
                                      "distill.objective": objective,
                                      "distill.with_reward": objective != "k1",
                                      "loss.aggregation": "token_mean"})
  summary = launcher.run(config)
  records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  steps = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert len(steps) == 2 and summary["steps"] == 5
  for r in steps:
    loss, kl = r["distill_loss"], r["distill_reverse_kl"]
    assert kl > 1e-3  # a teacher from another seed
    if objective == "reverse_kl":
      assert loss == pytest.approx(kl, rel=1e-5)
    elif objective == "k1":
      assert r["loss"] == pytest.approx(loss, rel=1e-6)  # coef 1, nothing else
    elif objective == "k3":
      assert loss < 0
    else:
      assert loss > 0 and abs(loss - kl) > 1e-3 * kl
    assert ("clip_fraction" in r) == (objective != "k1")


@pytest.mark.slow
def test_the_teacher_is_sharded_like_the_policy_on_a_mesh_and_chunks(tmp_path, teacher_run):
  """A 2 x 4 (data x fsdp) mesh: the teacher's parameters are laid out by the trainer's
  rules inside the sharded step, and the run trains as on one device; so does the run
  with --config.rl.logprob_chunk=3 (the distillation term a chunk of positions at a time):
  the same logged losses and KLs and the same final parameters, up to float32 rounding."""
  flags_ = {"distill.teacher": teacher_run, "distill.coef": 1.0}
  launcher.run(tiny_run_config(tmp_path / "one", flags_))
  launcher.run(tiny_run_config(tmp_path / "mesh", {**flags_, "mesh.data": 2, "mesh.fsdp": -1}))
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
  # The final parameters, rather than the final accuracies (0 in all three tiny runs, and
  # a near-tie in greedy evaluation could flip with float32 rounding). Two RL steps of Adam
  # move each weight by about 2 x the learning rate (1e-4 here); the runs must agree to 1%
  # of that, but for the rare weight whose gradient is at float32 rounding level, which
  # Adam's normalisation amplifies (a slow-tier run saw 1 of 262144 at 1.3e-6): those may
  # differ by up to 10% of the movement, and at most 1 in 10^4 weights may. (A step that
  # distils differently moves most weights differently at the scale of the movement.)
  movement = 2 * tiny_run_config(tmp_path / "one").rl.learning_rate
  one = _final_params(tmp_path / "one")
  for other in ("mesh", "chunked"):
    for (path, expected), actual in zip(jax.tree_util.tree_leaves_with_path(one),
                                        jax.tree.leaves(_final_params(tmp_path / other))):
      where = f"{other} {jax.tree_util.keystr(path)}"
      np.testing.assert_allclose(actual, expected, rtol=0, atol=0.1 * movement, err_msg=where)
      beyond = np.mean(np.abs(actual - expected) > 0.01 * movement)
      assert beyond <= 1e-4, f"{where}: {beyond:.2e} of the weights differ by > 1% of a step"


def _final_params(workdir):
  from rl import checkpoint  # pylint: disable=import-outside-toplevel
  manager = checkpoint.make_manager(str(workdir / "checkpoints"))
  assert manager.latest_step() == 5
  tree, _ = checkpoint.restore_tree(manager, manager.latest_step())
  return jax.tree.map(np.asarray, tree["train"]["params"])


@pytest.mark.slow  # loads SmolLM2; the other refusals stay in the quick tier
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


@pytest.mark.parametrize("objective, chunk", [
    ("reverse_kl", 0), ("k3", 0), ("forward_kl_topk", 3)])
def test_distillation_on_a_padded_ragged_batch_is_each_row_run_alone(objective, chunk):
  """Prompts of 3, 6, 2 and 4 tokens left-padded, completions of 8, 3, 5 and 6 tokens
  right-padded, temperature 0.8 (chunk: rl.logprob_chunk=3): the step's metrics,
  its distillation loss (seq_mean_token_mean) and its gradient (one SGD step of rate 1,
  pure OPD) are those computed with every row run alone, unpadded, through both models."""
  student = transformer.init_params(CONFIG, jax.random.PRNGKey(0))
  teacher = transformer.init_params(CONFIG, jax.random.PRNGKey(5), init_std=0.5)
  batch, coef, top_k, temperature = padded_rollout(seed=6), 0.7, 4, 0.8
  step = train.make_train_step(
      CONFIG, optax.sgd(1.0), GRPO, temperature=temperature, logprob_chunk=chunk,
      distill=distillation.Distill(objective, coef, False, top_k, CONFIG),
      teacher_params=teacher)
  state, metrics = step(train.init_train_state(jax.tree.map(jnp.copy, student),
                                               optax.sgd(1.0)), batch)
  reference = reference_terms(student, teacher, batch, objective, top_k, temperature)
  for name in ("distill_reverse_kl", "distill_k1_mean", "distill_k1_var", "distill_k3_mean",
               "distill_k3_var"):
    np.testing.assert_allclose(float(metrics[name]), reference[name], rtol=1e-4, atol=1e-7,
                               err_msg=name)
  np.testing.assert_allclose(float(metrics["distill_loss"]), reference["seq_mean_token_mean"],
                             rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(float(metrics["loss"]), coef * reference["seq_mean_token_mean"],
                             rtol=1e-4, atol=1e-7)  # pure OPD: nothing else in the loss
  assert reference["distill_reverse_kl"] > 0.05  # two different models
  expected = reference_gradient(student, teacher, batch, objective, top_k, temperature, coef)
  for old, new, grad in zip(jax.tree.leaves(student), jax.tree.leaves(state.params),
                            jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(old) - np.asarray(new), np.asarray(grad),
                               rtol=2e-3, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["reverse_kl", "k1", "k3", "forward_kl_topk"])
def test_chunked_distillation_equals_the_dense_step(objective):
  """rl.logprob_chunk with a teacher: the distributions a chunk of 7 positions at a time
  (13 predicting positions of a padded, ragged batch: the last chunk padded) give the dense
  step's loss, metrics and gradient (read off one SGD step of rate 1), at a vocabulary of
  4099, temperature 0.8."""
  config = tiny.model(vocab_size=4099, max_seq_len=32)
  student = transformer.init_params(config, jax.random.PRNGKey(0))
  teacher = transformer.init_params(config, jax.random.PRNGKey(5), init_std=0.3)
  batch = padded_rollout(seed=7)
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


@pytest.mark.slow
def test_chunked_distillation_never_holds_the_full_distributions():
  """XLA's memory analysis of the compiled step: chunking drops at least the student's and
  the teacher's [B, T, V] float32 log-softmax (2 x 8 x 64 x 8192 x 4 bytes)."""
  config = tiny.model(vocab_size=8192, max_seq_len=64)
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
