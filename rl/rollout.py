"""From task examples to a scored `Rollout` batch: encode, sample groups, score, advantage."""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from rl.tasks import Example, Task
from rl.types import Rollout
from sampling.sampler import SamplingConfig, generate


class Tokenizer(Protocol):
  pad_id: int
  bos_id: int
  eos_id: int

  def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids) -> str: ...


def encode_prompts(tokenizer: Tokenizer, texts: Sequence[str], prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads the BOS-prefixed prompts to `prompt_len` slots: (tokens, mask) [N, P]."""
  tokens = np.full((len(texts), prompt_len), tokenizer.pad_id, np.int32)
  mask = np.zeros((len(texts), prompt_len), bool)
  for row, text in enumerate(texts):
    ids = tokenizer.encode(text, add_bos=True)
    if len(ids) > prompt_len:
      raise ValueError(f"Prompt {text!r} has {len(ids)} tokens (with BOS) but prompt_len is "
                       f"{prompt_len}; raise config.rollout.prompt_len or shorten the prompts.")
    tokens[row, prompt_len - len(ids):] = ids
    mask[row, prompt_len - len(ids):] = True
  return tokens, mask


def supervised_batch(tokenizer: Tokenizer, examples: Sequence[Example], prompt_len: int,
                     completion_len: int) -> Rollout:
  """A batch of (prompt, reference answer + EOS) in the sampler's layout, for the warm start."""
  prompt_tokens, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in examples], prompt_len)
  completion = np.full((len(examples), completion_len), tokenizer.pad_id, np.int32)
  completion_mask = np.zeros((len(examples), completion_len), bool)
  for row, example in enumerate(examples):
    ids = tokenizer.encode(example.answer) + [tokenizer.eos_id]
    if len(ids) > completion_len:
      raise ValueError(f"Answer {example.answer!r} needs {len(ids)} tokens with EOS but "
                       f"max_new_tokens is {completion_len}; raise config.rollout.max_new_tokens.")
    completion[row, :len(ids)] = ids
    completion_mask[row, :len(ids)] = True
  n = len(examples)
  zeros = np.zeros((n, prompt_len + completion_len), np.float32)
  return Rollout(
      tokens=jnp.asarray(np.concatenate([prompt_tokens, completion], axis=1)),
      prompt_mask=jnp.asarray(np.concatenate([prompt_mask, np.zeros_like(completion_mask)], axis=1)),
      completion_mask=jnp.asarray(np.concatenate([np.zeros_like(prompt_mask), completion_mask], axis=1)),
      behavior_logp=jnp.asarray(zeros), version=jnp.full(zeros.shape, -1, jnp.int32),
      group=jnp.arange(n, dtype=jnp.int32), reward=jnp.ones((n,), jnp.float32),
      advantages=jnp.asarray(zeros))


@dataclasses.dataclass
class ScoredSamples:
  """A sampled, scored batch: the Rollout plus host-side texts and exact-match flags."""
  rollout: Rollout
  completions: list[str]
  exact: np.ndarray
  decode_steps: int


def decode_completions(tokenizer: Tokenizer, tokens: np.ndarray, completion_mask: np.ndarray) -> list[str]:
  """Text of each row's completion slots (up to EOS)."""
  return [tokenizer.decode(row[m]) for row, m in zip(tokens, completion_mask)]


def score(task: Task, examples: Sequence[Example], completions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """(rewards, exact-match flags) from the task's own scorer; a NaN reward is an error."""
  rewards = np.array([task.reward(c, e) for c, e in zip(completions, examples)], np.float32)
  if not np.all(np.isfinite(rewards)):
    bad = int(np.flatnonzero(~np.isfinite(rewards))[0])
    raise ValueError(f"Task {task.name!r} returned reward {rewards[bad]} for completion "
                     f"{completions[bad]!r} of prompt {examples[bad].prompt!r}; rewards must be "
                     "finite: fix the task's scorer.")
  exact = np.array([task.exact_match(c, e) for c, e in zip(completions, examples)], bool)
  return rewards, exact


def sample_and_score(params, examples: Sequence[Example], *, task: Task, tokenizer: Tokenizer,
                     rng: jax.Array, group_size: int, prompt_len: int,
                     model_config: ModelConfig, sampling_config: SamplingConfig,
                     advantage_fn: Callable[[jax.Array, jax.Array], jax.Array],
                     version: int = 0) -> ScoredSamples:
  """Samples `group_size` completions per example, scores them and computes advantages.

  Rows are grouped contiguously: rows [i*G, (i+1)*G) answer examples[i] (group id i).
  """
  prompt_tokens, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in examples], prompt_len)
  prompt_tokens = np.repeat(prompt_tokens, group_size, axis=0)
  prompt_mask = np.repeat(prompt_mask, group_size, axis=0)
  generation = generate(params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), rng,
                        model_config, sampling_config, version)
  tokens, completion_mask = jax.device_get((generation.tokens, generation.completion_mask))
  completions = decode_completions(tokenizer, tokens, completion_mask)
  repeated = [e for e in examples for _ in range(group_size)]
  rewards, exact = score(task, repeated, completions)
  group = jnp.repeat(jnp.arange(len(examples), dtype=jnp.int32), group_size)
  reward = jnp.asarray(rewards)
  advantages = advantage_fn(reward, group)[:, None] * generation.completion_mask
  rollout = Rollout(tokens=generation.tokens, prompt_mask=generation.prompt_mask,
                    completion_mask=generation.completion_mask,
                    behavior_logp=generation.behavior_logp, version=generation.version,
                    group=group, reward=reward, advantages=advantages)
  return ScoredSamples(rollout=rollout, completions=completions, exact=exact,
                       decode_steps=int(generation.decode_steps))
