"""LoRA (Hu et al. 2021; models/lora.py): the merge against NumPy, gradients against finite
differences, the optimiser state over adapters only, the frozen base, sharding, HF export
and the launcher's validation."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import eval as eval_launcher
from experiments.configs import chain_sum_compact
from models import hf_checkpoint
from models import lora as lora_lib
from models import transformer
from models.tokenizer import CharTokenizer
from rl.objectives import advantages
from rl import checkpoint
from rl import evaluation
from rl import loop
from rl import train
from rl.rollouts import producers
from sampling.sampler import SamplingConfig
from sharding import mesh as mesh_lib
from tests.launcher_config import apply_overrides, refusal, tiny_run_config
from tests.rl_fixtures import GRPO, DigitTask, random_rollout
from rl import wiring
from rl.objectives import losses
from tests import tiny

# Qwen2's biases (LoRA leaves them alone) and 4 query heads over 2 key/value heads; the
# finite-difference check's tolerance was set on these shapes.
CONFIG = tiny.model(n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=48, max_seq_len=16,
                    qkv_bias=True)
LORA = lora_lib.LoraConfig(rank=3, alpha=6.0, targets=lora_lib.TARGETS)


def _base():
  return transformer.init_params(CONFIG, jax.random.PRNGKey(0))


def _nonzero_adapters(seed=1):
  """Adapters with B drawn too (at initialisation B = 0 and the gradient of A is zero)."""
  adapters = lora_lib.init_adapters(CONFIG, LORA, jax.random.PRNGKey(seed))
  keys = iter(jax.random.split(jax.random.PRNGKey(seed + 100), len(LORA.targets)))
  return {"layers": {t: dict(a, b=0.1 * jax.random.normal(next(keys), a["b"].shape))
                     for t, a in adapters["layers"].items()}}


def _logits(params, batch):
  return transformer.forward(params, batch.tokens,
                             transformer.positions_from_mask(batch.token_mask),
                             batch.token_mask, CONFIG)[0]


@pytest.mark.slow
def test_adapted_logits_equal_the_base_exactly_at_init():
  base, batch = _base(), random_rollout(batch=8)
  state = train.init_train_state(base, train.make_optimizer(1e-3), lora=LORA,
                                 model_config=CONFIG, lora_rng=jax.random.PRNGKey(1))
  np.testing.assert_array_equal(np.asarray(_logits(state.policy_params(), batch)),
                                np.asarray(_logits(base, batch)))
  # A is drawn (std 1 / sqrt(D_in)), B is zero.
  q = state.params["layers"]["q"]
  assert float(jnp.abs(q["b"]).max()) == 0.0
  np.testing.assert_allclose(float(jnp.std(q["a"])), 1 / math.sqrt(CONFIG.d_model), rtol=0.2)


def test_merge_matches_numpy():
  base, adapters = _base(), _nonzero_adapters()
  merged = lora_lib.merge(base, adapters, LORA.scale)
  for name, w in base["layers"].items():
    got = np.asarray(merged["layers"][name])
    if name in LORA.targets:
      a = np.asarray(adapters["layers"][name]["a"], np.float64)
      b = np.asarray(adapters["layers"][name]["b"], np.float64)
      want = np.asarray(w, np.float64) + LORA.scale * np.stack(
          [a[i] @ b[i] for i in range(CONFIG.n_layers)])
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)
    else:  # norms and biases pass through
      np.testing.assert_array_equal(got, np.asarray(w), err_msg=name)
  np.testing.assert_array_equal(np.asarray(merged["embed"]), np.asarray(base["embed"]))


def _loss(adapters, base, batch):
  """Mean completion log-prob of the adapted policy: smooth, O(1)."""
  params = lora_lib.merge(base, adapters, LORA.scale)
  logp = transformer.sequence_logprobs(params, batch.tokens, batch.token_mask, CONFIG)
  return jnp.sum(logp * batch.completion_mask) / jnp.sum(batch.completion_mask)


def test_adapter_gradients_match_finite_differences():
  base, adapters, batch = _base(), _nonzero_adapters(), random_rollout(batch=4)
  grads = jax.grad(_loss)(adapters, base, batch)
  rng = np.random.default_rng(0)
  eps = 1e-2
  for target in ("q", "v", "o", "gate", "down"):
    for leaf in ("a", "b"):
      # Central differences along a unit direction in one leaf, half the autodiff gradient's
      # direction and half a random one, so the slope is large (float32: the truncation
      # error is O(eps^2), rounding O(1e-7 / eps)).
      value = adapters["layers"][target][leaf]
      g = np.asarray(grads["layers"][target][leaf])
      noise = rng.normal(size=value.shape)
      direction = g / np.linalg.norm(g) + noise / np.linalg.norm(noise)
      direction = (direction / np.linalg.norm(direction)).astype(np.float32)

      def moved(sign, target=target, leaf=leaf, value=value, direction=direction):
        layers = dict(adapters["layers"])
        layers[target] = dict(layers[target], **{leaf: value + sign * eps * direction})
        return float(_loss({"layers": layers}, base, batch))

      numeric = (moved(1) - moved(-1)) / (2 * eps)
      analytic = float(jnp.vdot(grads["layers"][target][leaf], direction))
      assert abs(analytic) > 1e-3, (target, leaf)  # the check can fail
      np.testing.assert_allclose(analytic, numeric, rtol=2e-2, atol=2e-4,
                                 err_msg=f"{target}/{leaf}")


def test_adapter_gradients_are_the_chain_rule_of_the_dense_gradient():
  """dA = s dW B^T, dB = s A^T dW for the merged weight's gradient dW, in float64 NumPy."""
  base, adapters, batch = _base(), _nonzero_adapters(), random_rollout(batch=4)
  grads = jax.grad(_loss)(adapters, base, batch)
  merged = lora_lib.merge(base, adapters, LORA.scale)
  dense = jax.grad(lambda p: _loss({"layers": {}}, p, batch))(merged)
  for target in LORA.targets:
    d_w = np.asarray(dense["layers"][target], np.float64)
    a = np.asarray(adapters["layers"][target]["a"], np.float64)
    b = np.asarray(adapters["layers"][target]["b"], np.float64)
    want_a = LORA.scale * np.einsum("lio,lro->lir", d_w, b)
    want_b = LORA.scale * np.einsum("lir,lio->lro", a, d_w)
    for leaf, want in (("a", want_a), ("b", want_b)):
      got = np.asarray(grads["layers"][target][leaf])
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                 err_msg=f"{target}/{leaf}")


def _grpo_rewards(base, lora, steps=25):
  """Reward means of `steps` GRPO iterations on DigitTask from `base`, training LoRA
  adapters (`lora`) or, with lora None, full weights; and the final train state."""
  tokenizer = CharTokenizer()
  optimizer = train.make_optimizer(1e-2)
  sampling_config = SamplingConfig(max_new_tokens=4, temperature=1.0,
                                   stop_tokens=(tokenizer.eos_id,))
  ctx = loop.LoopContext(
      batch=producers.BatchContext(
          task=DigitTask(), tokenizer=tokenizer, model_config=CONFIG,
          sampling_config=sampling_config, prompt_len=2, prompts_per_step=8, group_size=8),
      train_step=train.make_train_step(CONFIG, optimizer, GRPO),
      stages=advantages.advantage_stage(advantages.group_relative(advantages.grpo_advantages)))
  producer = producers.independent(ctx.batch)
  state = loop.LoopState(train=train.init_train_state(base, optimizer, lora=lora,
                                                      model_config=CONFIG,
                                                      lora_rng=jax.random.PRNGKey(3)),
                         rng=jax.random.PRNGKey(2), producer=producer.init(0))
  rewards = []
  for _ in range(steps):
    state, metrics = loop.grpo_iteration(state, ctx, producer)
    rewards.append(metrics["reward_mean"])
  return rewards, state


_LORA = lora_lib.LoraConfig(rank=4, alpha=8.0, targets=lora_lib.TARGETS)


@pytest.mark.slow
def test_short_lora_grpo_run_improves_reward():
  """GRPO through the loop with adapters only: the digit reward rises well above chance,
  from a base whose embedding is scaled up tenfold (std 0.2, the size a trained model's
  embeddings have; see the next test for why)."""
  base = _base()
  base = dict(base, embed=10.0 * base["embed"])
  base_before = jax.device_get(base)  # the train state takes (and may donate) base's buffers
  rewards, state = _grpo_rewards(base, _LORA)
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  assert last > first + 0.3 and last > 0.6, rewards
  jax.tree.map(np.testing.assert_array_equal, state.train.frozen, base_before)


@pytest.mark.slow
def test_lora_from_an_init_scale_base_stays_at_chance_where_full_weights_learn():
  """docs/lora.md's claim. At init_params' std 0.02 the embedding is tied to the output
  head and every logit is at most |e| * sqrt(d) ~ 0.6 in size after the final norm, so no
  change to the projections makes the output much sharper: only the embedding (which LoRA
  does not adapt) can raise the reward. The same 25 steps with full weights learn the task
  (measured: LoRA 0.22 -> 0.25, full 0.28 -> 1.00 over the first and last five steps)."""
  lora_rewards, _ = _grpo_rewards(_base(), _LORA)
  full_rewards, _ = _grpo_rewards(_base(), None)
  assert np.mean(lora_rewards[-5:]) < min(np.mean(lora_rewards[:5]) + 0.1, 0.4), lora_rewards
  assert np.mean(full_rewards[-5:]) > 0.9, full_rewards


def test_adapter_count_and_optimiser_state_cover_adapters_only():
  lora = lora_lib.LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down"))
  # By hand: L * r * (D_in + D_out); q [32, 32], v [32, 16], down [48, 32].
  want = 2 * 2 * ((32 + 32) + (32 + 16) + (48 + 32))
  assert lora_lib.adapter_count(CONFIG, lora) == want == 768
  state = train.init_train_state(_base(), train.make_optimizer(1e-3), lora=lora,
                                 model_config=CONFIG, lora_rng=jax.random.PRNGKey(1))
  assert sum(x.size for x in jax.tree.leaves(state.params)) == want
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert sum(x.size for x in moments) == 2 * want  # Adam's mu and nu, nothing else
  names = {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(state.opt_state)
           if x.ndim > 0}
  assert all(n.endswith(("['a']", "['b']")) for n in names), names
  full = train.init_train_state(_base(), train.make_optimizer(1e-3))
  full_moments = sum(x.size for x in jax.tree.leaves(full.opt_state) if x.ndim > 0)
  assert full_moments == 2 * sum(x.size for x in jax.tree.leaves(_base()))


def _lora_state(optimizer, base=None):
  return train.init_train_state(jax.tree.map(jnp.copy, base or _base()), optimizer, lora=LORA,
                                model_config=CONFIG, lora_rng=jax.random.PRNGKey(1))


@pytest.mark.slow
def test_train_step_updates_adapters_and_leaves_the_base_unchanged():
  optimizer = train.make_optimizer(1e-2)
  step = train.make_train_step(CONFIG, optimizer, GRPO)
  base, batch = _base(), random_rollout(batch=8)
  state = _lora_state(optimizer, base)
  before = jax.device_get(state.params)
  for _ in range(2):  # the first update moves B only (A's gradient is zero while B = 0)
    state, metrics = step(state, batch)
  assert float(metrics["update_skipped"]) == 0.0 and int(state.step) == 2
  jax.tree.map(np.testing.assert_array_equal, state.frozen, base)
  for target in LORA.targets:
    for leaf in ("a", "b"):
      assert not np.array_equal(np.asarray(state.params["layers"][target][leaf]),
                                before["layers"][target][leaf]), (target, leaf)
  assert not np.allclose(np.asarray(_logits(state.policy_params(), batch)),
                         np.asarray(_logits(base, batch)))


@pytest.mark.slow
def test_first_update_is_adam_on_the_hand_computed_gradient_of_b():
  """One step from B = 0 (A's gradient is zero there): B moves by -lr * sign(dB) (Adam's
  first step, no clipping at this gradient norm), dB = s A^T dW from the dense gradient."""
  lr = 1e-3
  optimizer = train.make_optimizer(lr, max_grad_norm=0.0)
  loss_config = losses.LossSettings(name="sft", aggregation="token_mean", norm_len=1.0)
  step = train.make_train_step(CONFIG, optimizer, loss_config)
  base, batch = _base(), random_rollout(batch=8)
  state = _lora_state(optimizer, base)
  adapters = jax.device_get(state.params)
  new_state, _ = step(state, batch)

  def sft_loss(params):
    logp = transformer.sequence_logprobs(params, batch.tokens, batch.token_mask, CONFIG)
    return -jnp.sum(logp * batch.completion_mask) / jnp.sum(batch.completion_mask)

  dense = jax.grad(sft_loss)(base)
  for target in LORA.targets:
    d_b = LORA.scale * np.einsum("lir,lio->lro", adapters["layers"][target]["a"],
                                 np.asarray(dense["layers"][target], np.float64))
    want = -lr * d_b / (np.abs(d_b) + 1e-8)  # Adam, step 1: m / sqrt(v) = sign(g)
    np.testing.assert_allclose(np.asarray(new_state.params["layers"][target]["b"]), want,
                               rtol=1e-3, atol=1e-3 * lr, err_msg=target)
    np.testing.assert_array_equal(np.asarray(new_state.params["layers"][target]["a"]),
                                  adapters["layers"][target]["a"])


@pytest.mark.slow
def test_microbatched_lora_step_equals_the_full_batch_step():
  optimizer = train.make_optimizer(1e-2)
  batch = random_rollout(batch=8)
  states = {}
  for micro in (1, 4):
    step = train.make_train_step(CONFIG, optimizer, GRPO, num_microbatches=micro)
    states[micro], _ = step(_lora_state(optimizer), batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
               states[1].params, states[4].params)


@pytest.mark.slow
def test_sharded_lora_step_matches_the_single_device_step():
  if jax.device_count() < 8:
    pytest.fail("Needs the 8 virtual CPU devices tests/conftest.py configures.")
  optimizer = train.make_optimizer(1e-2)
  batch = random_rollout(batch=8)
  single, _ = train.make_train_step(CONFIG, optimizer, GRPO)(_lora_state(optimizer), batch)
  mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=2, fsdp=2, tensor=2))
  sharded_step = train.make_train_step(CONFIG, optimizer, GRPO, mesh=mesh, lora=LORA)
  state = train.shard_train_state(_lora_state(optimizer), CONFIG, optimizer, mesh, lora=LORA)
  assert state.frozen["layers"]["q"].sharding.spec == jax.sharding.PartitionSpec(
      None, "fsdp", "tensor")  # the frozen base is laid out like the parameters
  assert state.params["layers"]["q"]["a"].sharding.is_fully_replicated
  sharded, _ = sharded_step(state, batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), single, sharded)


def test_merged_export_loads_as_the_adapted_policy(tmp_path):
  base, adapters, batch = _base(), _nonzero_adapters(), random_rollout(batch=8)
  state = _lora_state(train.make_optimizer(1e-3), base).replace(params=adapters)
  hf_checkpoint.save_hf(str(tmp_path), state.policy_params(), CONFIG)
  config, loaded = hf_checkpoint.load_hf(str(tmp_path))
  assert config.qkv_bias and config.n_layers == CONFIG.n_layers
  adapted = np.asarray(_logits(state.policy_params(), batch))
  np.testing.assert_array_equal(np.asarray(_logits(loaded, batch)), adapted)
  assert np.abs(adapted - np.asarray(_logits(base, batch))).max() > 1e-3


@pytest.mark.parametrize("overrides, message", [
    ({"lora.rank": -1}, r"config.lora.rank = -1 must be >= 0"),
    ({"lora.rank": 4, "lora.alpha": 0.0}, r"config.lora.alpha = 0.0 must be > 0"),
    ({"lora.rank": 4, "lora.targets": ("q", "qq")}, r"config.lora.targets"),
    ({"lora.rank": 4, "lora.targets": ()}, r"config.lora.targets"),
    ({"lora.alpha": 8.0}, r"config.lora.alpha = 8.0 has no effect with config.lora.rank = 0"),
    ({"lora.targets": ("q",)}, r"config.lora.targets .* has no effect"),
])
def test_launcher_refuses_inconsistent_lora_settings(overrides, message, tmp_path):
  with pytest.raises(ValueError, match=message):
    wiring.validate(tiny_run_config(tmp_path, overrides))


def test_launcher_refuses_a_rank_above_a_projection_before_the_warm_start(tmp_path):
  # The micro preset's k / v projections are [32, 16].
  config = tiny_run_config(tmp_path / "run", {"lora.rank": 17, "lora.targets": ("v",)})
  assert refusal(config).startswith("LoRA rank 17 exceeds min(D_in, D_out) = 16 of "
                                    "projection 'v'")  # and no workdir was made


def test_lora_config_reads_targets_in_canonical_order(tmp_path):
  config = tiny_run_config(tmp_path, {"lora.rank": 2, "lora.targets": ("down", "q")})
  assert wiring.lora_config(wiring.settings(config)) == lora_lib.LoraConfig(2, 16.0,
                                                                          ("q", "down"))
  comma = tiny_run_config(tmp_path, {"lora.rank": 2, "lora.targets": ("v,q", " up")})
  assert wiring.lora_config(wiring.settings(comma)).targets == ("q", "v", "up")  # --config.lora.targets=v,q
  assert wiring.lora_config(wiring.settings(tiny_run_config(tmp_path))) is None
  assert wiring.phase_lora(wiring.settings(config), wiring.WARM_START) is None


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A short chain_sum run whose RL phase trains rank-4 adapters, through the command line.
_LAUNCHER_RUN = {
    "lora.rank": 4, "warm_start.steps": 4, "warm_start.batch_size": 8, "rl.steps": 3,
    "rollout.prompts_per_step": 4, "rollout.group_size": 4, "task.eval_size": 16,
    "eval.batch_size": 16, "eval.every": 3, "checkpoint.every": 1000}


def _restore_rl_state(config, policy, step):
  """The LoopState of RL checkpoint `step` (adapters, their AdamW state, frozen base)."""
  manager = checkpoint.make_manager(os.path.join(config.workdir, "checkpoints"))
  ctx, optimizer = wiring.make_context(policy.run, policy.task, policy.tokenizer,
                                       policy.model_config, wiring.RL)
  like = wiring.loop_state_like(policy.run, policy.model_config, policy.params_like, wiring.RL,
                                optimizer, wiring.make_rl_producer(policy.run, ctx), ctx.stages)
  return checkpoint.restore(manager, step, like)[0]


@pytest.mark.slow
def test_launcher_lora_run_trains_adapters_only_and_eval_merges_them(tmp_path):
  flags = [f"--config.{path}={value}" for path, value in _LAUNCHER_RUN.items()]
  subprocess.run([sys.executable, "-m", "experiments.train",
                  "--config=experiments/configs/chain_sum_compact.py",
                  f"--config.workdir={tmp_path}", *flags],
                 cwd=_REPO, env=dict(os.environ, PYTHONPATH=_REPO), check=True, timeout=1800,
                 capture_output=True)
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert len([r for r in records if r["phase"] == "rl" and "reward_mean" in r]) == 3
  summary = json.loads((tmp_path / "summary.json").read_text())

  config = apply_overrides(chain_sum_compact.get_config(),
                           {"workdir": str(tmp_path), **_LAUNCHER_RUN})
  policy = eval_launcher.build_policy(wiring.settings(config))
  base = eval_launcher.load_params(config, policy, 4)  # the hand-over: B = 0, merged = base
  final = _restore_rl_state(config, policy, 7).train
  jax.tree.map(np.testing.assert_array_equal, final.frozen, base)  # the base is frozen
  count = lora_lib.adapter_count(policy.model_config, wiring.lora_config(policy.run))
  assert sum(x.size for x in jax.tree.leaves(final.params)) == count
  assert sum(x.size for x in jax.tree.leaves(final.opt_state) if x.ndim > 0) == 2 * count
  # eval's merged policy of the last checkpoint is trained and reproduces the run's final
  # evaluation.
  merged = eval_launcher.load_params(config, policy, 7)
  assert not np.array_equal(np.asarray(merged["layers"]["q"]), np.asarray(base["layers"]["q"]))
  result = evaluation.evaluate(
      merged, policy.task.examples("eval", config.task.eval_size), task=policy.task,
      tokenizer=policy.tokenizer, prompt_len=config.rollout.prompt_len,
      max_new_tokens=config.rollout.max_new_tokens, model_config=policy.model_config,
      batch_size=config.eval.batch_size)
  assert result.accuracy == summary["final_accuracy"]
  assert result.mean_length == pytest.approx(
      [r for r in records if r.get("event") == "eval"][-1]["eval_length"])
