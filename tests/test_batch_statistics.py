"""Tests for rl.rollouts.statistics: the one record every producer reports."""

import numpy as np

from rl.rollouts import statistics


class _Scored:
  """A scoring result as batch_stats reads it."""

  def __init__(self, timeouts, errors):
    self.reward_timeouts, self.reward_errors = timeouts, errors


def test_batch_stats_by_hand():
  # Two groups of 3 scored rows (one all-equal), 4 of the rows trained.
  stats = statistics.batch_stats(
      [np.array([1.0, 0.0, 0.5]), np.array([0.25, 0.25, 0.25])],
      np.array([True, False, False, False, False, False]),
      scored_lengths=np.array([3, 5, 1, 2, 2, 2]), trained_lengths=np.array([3, 5, 2, 2]),
      decoded_tokens=15, scored=[_Scored(1, 0), _Scored(0, 2)], decode_steps=5)
  assert stats.reward_mean == (1.5 + 0.75) / 6
  assert stats.exact_match == 1 / 6
  assert stats.informative_groups == 0.5
  assert stats.completion_len == 15 / 6
  np.testing.assert_array_equal(stats.completion_length_counts, [0, 0, 2, 1, 0, 1])
  assert (stats.reward_timeouts, stats.reward_errors) == (1, 2)
  metrics = stats.metrics()
  assert metrics["decode_steps"] == 5 and metrics["decoded_tokens"] == 15.0
  assert "counters" not in metrics and stats.sampled_tokens == 15


def test_a_partial_pools_generated_tokens_are_what_it_sampled():
  stats = statistics.batch_stats([np.array([1.0, 0.0])], np.array([True, False]),
                                 np.array([4, 6]), np.array([4, 6]), decoded_tokens=10,
                                 scored=[_Scored(0, 0)], generated_tokens=17)
  assert stats.sampled_tokens == 17 and stats.decoded_tokens == 10.0


def test_fractional_equal_rewards_are_not_informative():
  # 0.1 sums with rounding: a variance test could call a constant group informative; the
  # max != min test cannot (its advantage is exactly zero).
  rewards = np.full((3, 7), 0.1, np.float32)
  rewards[1, 3] = 0.1000001
  np.testing.assert_array_equal(statistics.informative(rewards), [False, True, False])


def test_ragged_and_empty_groups():
  # A tree prompt with no leaves is an empty group: counted, never informative.
  stats = statistics.batch_stats([np.array([]), np.array([0.0, 1.0, 1.0])],
                                 np.array([False, True, True]), np.array([2, 3, 3]),
                                 np.array([2, 3, 3]), decoded_tokens=6, scored=[])
  assert stats.informative_groups == 0.5 and stats.reward_mean == 2 / 3
  assert (stats.reward_timeouts, stats.reward_errors) == (0, 0)
