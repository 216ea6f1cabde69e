"""Prefix-shared training forward: equal to the replicated forward in log-probs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from experiments.configs import default
from models import transformer
from rl.objectives import losses
from rl import train
from rl.objectives import composite
from rl.types import Rollout
from rl import wiring
from tests import tiny

QWEN2 = tiny.model(qkv_bias=True, tie_embeddings=False)
QWEN3 = tiny.model(qk_norm=True)
GRPO = losses.LossSettings(
    name="grpo", eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean", norm_len=4.0,
    kl_coef=0.0)
GROUPS, GROUP_SIZE, PROMPT_LEN, COMPLETION_LEN = 3, 4, 7, 5


def grouped_rollout(seed=0):
  """3 groups of 4 rows: left-padded prompts (a different padding per group) shared within a
  group, completions of different lengths (padding after an early stop)."""
  rng = np.random.default_rng(seed)
  size, length = GROUPS * GROUP_SIZE, PROMPT_LEN + COMPLETION_LEN
  prompt_real = np.array([7, 4, 1])  # real prompt tokens per group
  prompts = rng.integers(3, QWEN2.vocab_size, (GROUPS, PROMPT_LEN))
  prompt_mask = np.arange(PROMPT_LEN)[None] >= PROMPT_LEN - prompt_real[:, None]
  prompts = np.where(prompt_mask, prompts, 0)
  completion_len = rng.integers(1, COMPLETION_LEN + 1, size)
  completions = rng.integers(3, QWEN2.vocab_size, (size, COMPLETION_LEN))
  completion_mask = np.arange(COMPLETION_LEN)[None] < completion_len[:, None]
  completions = np.where(completion_mask, completions, 0)
  tokens = np.concatenate([np.repeat(prompts, GROUP_SIZE, 0), completions], axis=1)
  full_prompt_mask = np.pad(np.repeat(prompt_mask, GROUP_SIZE, 0), ((0, 0), (0, COMPLETION_LEN)))
  full_completion_mask = np.pad(completion_mask, ((0, 0), (PROMPT_LEN, 0)))
  advantages = rng.normal(size=(size, 1)) * full_completion_mask
  behavior = -rng.uniform(1.0, 4.0, (size, length)) * full_completion_mask
  return Rollout(tokens=jnp.asarray(tokens, jnp.int32), prompt_mask=jnp.asarray(full_prompt_mask),
                 completion_mask=jnp.asarray(full_completion_mask),
                 behavior_logp=jnp.asarray(behavior, jnp.float32),
                 version=jnp.zeros((size, length), jnp.int32),
                 group=jnp.arange(size) // GROUP_SIZE, reward=jnp.zeros((size,)),
                 advantages=jnp.asarray(advantages, jnp.float32))


def predicted_from_real_slot(batch):
  """Columns t >= 1 whose predicting slot t - 1 holds a real token (where the two forwards
  must agree; a left-padding query has no visible key and its output is unused)."""
  mask = np.asarray(batch.token_mask)
  return np.pad(mask[:, :-1], ((0, 0), (1, 0)))


@pytest.mark.parametrize("config", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.slow
def test_logprobs_equal_replicated_forward(config, temperature):
  params = transformer.init_params(config, jax.random.PRNGKey(0), init_std=0.3)
  batch = grouped_rollout()
  composite.check_shared_prefix(batch, GROUP_SIZE, PROMPT_LEN)
  replicated = composite.policy_logprobs(params, batch, config, temperature)
  shared = composite.policy_logprobs(params, batch, config, temperature,
                                 shared_prefix=(GROUP_SIZE, PROMPT_LEN))
  where = predicted_from_real_slot(batch)
  assert where[np.asarray(batch.completion_mask)].all()  # every completion token is compared
  np.testing.assert_allclose(np.asarray(shared)[where], np.asarray(replicated)[where],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.slow
def test_parameter_gradients_equal_replicated_forward(config):
  params = transformer.init_params(config, jax.random.PRNGKey(1), init_std=0.3)
  batch = grouped_rollout(seed=1)
  loss_fn = losses.get_loss("grpo")

  def loss(params, shared_prefix):
    logp = composite.policy_logprobs(params, batch, config, shared_prefix=shared_prefix)
    return loss_fn(logp, batch, settings=GRPO)[0]

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  replicated = grad(params, None)
  shared = grad(params, (GROUP_SIZE, PROMPT_LEN))
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(replicated))
  assert scale > 1e-3  # the comparison is not vacuous
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(replicated), jax.tree.leaves(shared)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path))


@pytest.mark.slow
def test_train_step_with_shared_prefix_equals_replicated():
  params = transformer.init_params(QWEN2, jax.random.PRNGKey(2), init_std=0.3)
  # Plain SGD: Adam's first step is ~lr * sign(g), which flips on float noise where g ~ 0.
  optimizer = optax.sgd(0.1)
  batch = grouped_rollout(seed=2)
  results = []
  for shared_prefix in (None, (GROUP_SIZE, PROMPT_LEN)):
    step = train.make_train_step(QWEN2, optimizer, GRPO, shared_prefix=shared_prefix)
    state, metrics = step(train.init_train_state(jax.tree.map(jnp.copy, params), optimizer), batch)
    results.append((state, metrics))
  (a, ma), (b, mb) = results
  np.testing.assert_allclose(mb["loss"], ma["loss"], rtol=1e-5, atol=1e-7)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(y, x, atol=1e-6)
  assert not np.allclose(a.params["embed"], params["embed"])  # the step moved the parameters


def test_check_shared_prefix_rejects_ungrouped_batches():
  batch = grouped_rollout()
  mixed = batch.replace(tokens=batch.tokens.at[1, PROMPT_LEN - 1].add(1))
  with pytest.raises(ValueError, match="different prompts"):
    composite.check_shared_prefix(mixed, GROUP_SIZE, PROMPT_LEN)
  with pytest.raises(ValueError, match="whole groups"):
    composite.check_shared_prefix(batch, 5, PROMPT_LEN)
  with pytest.raises(ValueError, match="whole groups"):
    composite.check_shared_prefix(batch, GROUP_SIZE, PROMPT_LEN, num_microbatches=2)
  with pytest.raises(ValueError, match="slots"):
    composite.check_shared_prefix(batch, GROUP_SIZE, PROMPT_LEN + 1)
  step = train.make_train_step(QWEN2, train.make_optimizer(1e-2), GRPO,
                               shared_prefix=(GROUP_SIZE, PROMPT_LEN))
  params = transformer.init_params(QWEN2, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="different prompts"):
    step(train.init_train_state(params, train.make_optimizer(1e-2)), mixed)


def test_launcher_rejects_microbatches_that_split_groups():
  config = default.get_config()
  config.rl.prefix_shared_forward = True
  config.rollout.prompts_per_step, config.rl.num_microbatches = 6, 4  # 48 rows, 12 per micro
  with pytest.raises(ValueError, match="whole groups per microbatch"):
    wiring.validate(config)
  config.rl.prefix_shared_forward = False
  wiring.validate(config)
