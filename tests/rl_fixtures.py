"""Fixtures shared by the train-step tests (tests/test_train.py, tests/test_lora.py): a GRPO
loss config, a random rollout batch, and a trivially learnable task (in a module, so the
scoring worker can import it).
"""

import jax.numpy as jnp
import numpy as np

from rl.tasks import Example
from rl.types import Rollout
from rl.objectives import losses

GRPO = losses.LossSettings(
    name="grpo", eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean", norm_len=4.0,
    kl_coef=0.0)


def left_padded_prompts(batch_size=8, prompt_len=8, vocab=64):
  """Random prompts [batch_size, prompt_len] (ids 3..vocab-1), row r left-padded by r % 4
  slots (pad id 0), and their mask: the sharded-sampler tests' prompts."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(3, vocab, (batch_size, prompt_len)).astype(np.int32)
  mask = np.zeros((batch_size, prompt_len), bool)
  for row in range(batch_size):
    mask[row, row % 4:] = True
  return jnp.asarray(np.where(mask, tokens, 0)), jnp.asarray(mask)


def random_rollout(seed=0, batch=4, length=8):
  """A [batch, length] rollout of random tokens (vocabulary 51): 3 prompt slots, the rest
  completion, one random advantage per row, groups of two rows."""
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(3, 51, (batch, length)), jnp.int32)
  completion = jnp.asarray(np.arange(length)[None] >= 3).repeat(batch, 0)
  adv = jnp.asarray(rng.normal(size=(batch, 1)), jnp.float32) * completion
  return Rollout(tokens=tokens, prompt_mask=~completion, completion_mask=completion,
                 behavior_logp=jnp.full((batch, length), -3.0) * completion,
                 version=jnp.zeros((batch, length), jnp.int32), group=jnp.arange(batch) // 2,
                 reward=jnp.zeros((batch,)), advantages=adv)


class DigitTask:
  """Reward = fraction of completion characters that are digits; every prompt is "a"."""
  name = "digits"

  def examples(self, split, n, start=0):
    return [Example(prompt="a", answer="1", entry={}) for _ in range(n)]

  def reward(self, completion, example):
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1) if completion else 0.0

  def exact_match(self, completion, example):
    return bool(completion) and completion.isdigit()


def digit_share_reward(answer: str, entry: dict) -> float:
  """The share of digits among the answer's characters: an untrained policy's completions
  score different fractions, so a group of a few of them has reward variance (advantages
  that are not all zero) with overwhelming probability, for any seed."""
  del entry
  return sum(ch.isdigit() for ch in answer) / len(answer) if answer else 0.0


def products_key(entry: dict) -> str:
  return entry["question"]


def products_prompt(entry: dict) -> str:
  """reasoning-gym products' numbers in the character tokenizer's alphabet: "12*7="."""
  return entry["metadata"]["expression"].replace(" ", "") + "="


def products_answer(entry: dict) -> str:
  return str(entry["answer"])


DIGIT_TASK = "products"  # the reasoning-gym dataset `register_digit_task` makes a task


def register_digit_task():
  """Registers reasoning-gym's products questions as a launcher task rewarded by
  `digit_share_reward`; returns a function that unregisters it."""
  from rl import tasks  # pylint: disable=import-outside-toplevel
  tasks.register_task(DIGIT_TASK, key=products_key, compact_prompt=products_prompt,
                      compact_answer=products_answer, default_eval_size=8,
                      reward=digit_share_reward)
  return lambda: tasks.TASKS.unregister(DIGIT_TASK)
