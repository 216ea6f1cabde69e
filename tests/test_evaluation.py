"""Sampled evaluation: the unbiased pass@k estimator against hand-computed cases and exact
binomials, and evaluate_sampled's bookkeeping on a task whose scorer is known."""

import fractions
import math
import re

import jax
import numpy as np
import pytest

from models import transformer
from models.tokenizer import CharTokenizer
from rl import evaluation
from rl.environments import turns as turns_lib
from rl.tasks import Example
from sampling.sampler import SamplingConfig
from tests import tool_environments
from tests import tiny


def exact_pass_at_k(n: int, c: int, k: int) -> fractions.Fraction:
  """1 - C(n-c, k) / C(n, k) in exact rational arithmetic (math.comb is 0 when k > n - c)."""
  return 1 - fractions.Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 0, 1, 0.0),          # nothing correct
    (5, 5, 3, 1.0),          # everything correct
    (4, 1, 1, 0.25),         # pass@1 = c / n
    (4, 1, 2, 0.5),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 4, 1.0),          # k = n: any correct sample is drawn
    (10, 3, 5, 11 / 12),     # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (6, 2, 5, 1.0),          # n - c < k: every draw of 5 holds a correct one
    (20, 1, 10, 0.5),        # one correct of 20, half of them drawn
])
def test_pass_at_k_hand_computed(n, c, k, expected):
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_exact_binomials_and_is_vectorised():
  cases = [(n, c, k) for n in range(1, 13) for c in range(n + 1) for k in range(1, n + 1)]
  for n in range(1, 13):
    for k in range(1, n + 1):
      got = evaluation.pass_at_k(n, np.arange(n + 1), k)
      want = [float(exact_pass_at_k(n, c, k)) for c in range(n + 1)]
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  assert len(cases) > 300
  # Large n, where C(n, k) overflows float64: the product form stays exact to rounding.
  for c in (1, 7, 100):
    assert evaluation.pass_at_k(2000, c, 900) == pytest.approx(
        float(exact_pass_at_k(2000, c, 900)), abs=1e-12)


@pytest.mark.parametrize("n,c,k,message", [
    (4, 1, 5, "1 <= k <= num_samples"),
    (4, 1, 0, "1 <= k <= num_samples"),
    (4, 5, 1, "num_correct must lie in"),
    (4, -1, 1, "num_correct must lie in"),
])
def test_pass_at_k_rejects_bad_input(n, c, k, message):
  with pytest.raises(ValueError, match=message):
    evaluation.pass_at_k(n, c, k)


class FirstDigitEvenTask:
  """A scorer with known behaviour: a completion is correct iff it starts with 0, 2, 4, 6 or 8."""
  name = "first_digit_even"

  def reward(self, completion, example):
    del example
    return float(completion[:1] in tuple("02468"))

  def exact_match(self, completion, example):
    return self.reward(completion, example) == 1.0


@pytest.mark.slow
def test_evaluate_sampled_counts_and_identities():
  tokenizer = CharTokenizer()
  model_config = tiny.model(vocab_size=tokenizer.vocab_size, max_seq_len=16)
  params = transformer.init_params(model_config, jax.random.PRNGKey(0))
  examples = [Example(prompt=f"{i}+1=", answer=str(i + 1), entry={}) for i in range(5)]
  sampling_config = SamplingConfig(max_new_tokens=3, temperature=3.0,
                                   stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  n = 8
  kwargs = dict(task=FirstDigitEvenTask(), tokenizer=tokenizer, prompt_len=6,
                model_config=model_config, sampling_config=sampling_config, num_samples=n,
                ks=(1, 2, n), rng=jax.random.PRNGKey(1))
  # 16 rows per batch: 2 examples per batch, the third batch padded.
  result = evaluation.evaluate_sampled(params, examples, batch_size=16, **kwargs)
  c = result.num_correct
  assert c.shape == (5,) and result.num_samples == n and result.num_examples == 5
  assert 0 < c.sum() < 5 * n, "the case should hold both correct and wrong samples"
  assert result.pass_at_k[1] == pytest.approx(c.mean() / n)        # pass@1 = c / n
  assert result.pass_at_k[n] == pytest.approx(np.mean(c > 0))      # pass@n = any correct
  assert result.pass_at_k[2] == pytest.approx(np.mean(
      [float(exact_pass_at_k(n, int(ci), 2)) for ci in c]))
  assert result.mean_reward == pytest.approx(c.sum() / (5 * n))     # reward is 0/1 here
  assert 1.0 <= result.mean_length <= 3.0
  # Batch composition changes the random draws but not the bookkeeping: one example per batch.
  single = evaluation.evaluate_sampled(params, examples, batch_size=n, **kwargs)
  assert single.num_correct.shape == (5,)
  with pytest.raises(ValueError, match="pass@9 needs"):
    evaluation.evaluate_sampled(params, examples, **dict(kwargs, ks=(9,)))


class EveryCallAnsweredZeroTask:
  """Correct iff every "=" in the completion is followed by "0" (or ends it)."""
  name = "every_call_answered_zero"

  def reward(self, completion, example):
    del example
    return float(re.search(r"=(?!0|\Z)", completion) is None)

  def exact_match(self, completion, example):
    return self.reward(completion, example) == 1.0


@pytest.mark.slow
def test_evaluate_sampled_with_turns_lets_the_environment_answer_every_call():
  """pass@k of a tool run samples with its environment: an environment that answers every
  "=" with "0" makes every sample correct under a scorer that wants exactly that, while
  the same samples without it are not (the random policy writes "=" often enough)."""
  tokenizer = CharTokenizer()
  model_config = tiny.model(vocab_size=tokenizer.vocab_size, max_seq_len=40)
  params = transformer.init_params(model_config, jax.random.PRNGKey(0))
  examples = [Example(prompt=f"{i}=", answer="", entry={}) for i in range(16)]
  sampling_config = SamplingConfig(max_new_tokens=24, temperature=3.0,
                                   stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  kwargs = dict(task=EveryCallAnsweredZeroTask(), tokenizer=tokenizer, prompt_len=4,
                model_config=model_config, sampling_config=sampling_config, num_samples=8,
                ks=(1,), rng=jax.random.PRNGKey(1), batch_size=64)
  turns = turns_lib.Turns(tool_environments.AnswersZero(), tokenizer, turns_lib.ToolSettings())
  with_tool = evaluation.evaluate_sampled(params, examples, turns=turns, **kwargs)
  without = evaluation.evaluate_sampled(params, examples, **kwargs)
  assert with_tool.pass_at_k[1] == 1.0
  assert without.pass_at_k[1] < 0.9, "too few '=' for the test to mean anything"


def test_accuracy_stderr_and_by_size_by_hand():
  exact = np.array([1, 0, 1, 1, 0, 0, 1, 1], bool)
  sizes = np.array([2, 2, 3, 3, 3, 0, 5, 5])
  assert evaluation.accuracy_stderr(exact) == pytest.approx(math.sqrt(0.625 * 0.375 / 8))
  assert evaluation.accuracy_stderr(np.zeros(0, bool)) == 0.0
  # size 0 means "unsized" and is left out.
  assert evaluation.accuracy_by_size(sizes, exact) == {2: (2, 0.5), 3: (3, 2 / 3), 5: (2, 1.0)}
