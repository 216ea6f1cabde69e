"""experiments/trl_parity.py's pieces that need no TRL: the fixed rewards and the comparison
of two updates (the PEFT names of adapters: tests/test_peft_adapter.py). (The parity
itself runs TRL in the torch peer's virtualenv; its result is docs/results/b9/.)"""

import numpy as np
import optax
import pytest

from experiments import trl_parity


def test_fixed_rewards_are_fractional_and_the_last_group_is_flat():
  rewards = trl_parity.fixed_rewards(3, 4)
  assert rewards.shape == (12,) and rewards.dtype == np.float32
  assert np.all(rewards[-4:] == 0.5)
  assert len(set(rewards[:8].tolist())) == 8 and np.all((rewards >= 0) & (rewards < 1))
  assert np.array_equal(rewards, trl_parity.fixed_rewards(3, 4))  # a fixed seed


def test_update_difference_separates_rounding_in_tiny_gradients():
  before = {"w": np.zeros(4)}
  lr = 0.1
  # Adam's first step: lr * g / (|g| + eps). Element 3's gradient is near eps, where the
  # two sides' rounding moves the update by a large fraction of lr.
  trl_m = {"w": 0.1 * np.array([1.0, -2.0, 0.5, 1e-8])}
  arbor_m = {"w": 0.1 * np.array([1.0, -2.0, 0.5, 3e-8])}
  update = lambda m: -lr * (m / 0.1) / (np.abs(m / 0.1) + 1e-8)
  result = trl_parity.update_difference(before, {"w": update(arbor_m["w"])},
                                        {"w": update(trl_m["w"])}, arbor_m, trl_m, lr, 1e-8)
  assert result["tensors"] == 1 and result["elements"] == 4
  assert result["small_g_share"] == pytest.approx(0.25)
  assert result["update_max_abs_in_lr"] == pytest.approx(0.75 - 0.5, rel=1e-6)
  assert result["update_max_abs_in_lr_large_g"] < 1e-6
  assert result["update_relative_l2_large_g"] < 1e-6
  assert result["gradient_relative_l2"] == pytest.approx(
      np.linalg.norm(arbor_m["w"] - trl_m["w"]) / np.linalg.norm(trl_m["w"]))


def test_first_moment_is_found_in_the_launchers_optimizer_state():
  params = {"w": np.ones(3, np.float32)}
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  state = optimizer.init(params)
  _, state = optimizer.update({"w": np.full(3, 2.0, np.float32)}, state, params)
  mu = trl_parity.first_moment(state)
  # clipped to norm 1 (each element 1/sqrt(3)), times 1 - beta1
  np.testing.assert_allclose(mu["w"], 0.1 / np.sqrt(3), rtol=1e-6)
  with pytest.raises(ValueError, match="first moment"):
    trl_parity.first_moment(optax.sgd(0.1).init(params))


def test_relative_is_scaled_by_the_reference():
  assert trl_parity.relative([1.0, 2.0], [1.0, 2.5]) == pytest.approx(0.5 / 2.5)
  assert trl_parity.relative(0.0, 0.0) == 0.0
  assert trl_parity.relative(1e-7, 0.0) == pytest.approx(1e-7)  # absolute when b is 0

