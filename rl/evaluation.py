"""Held-out evaluation: greedy exact-match accuracy and mean reward of a policy on a task."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from rl import rollout as rollout_lib
from rl.tasks import Example, Task
from sampling.sampler import SamplingConfig, generate


@dataclasses.dataclass(frozen=True)
class EvalResult:
  accuracy: float        # exact-match fraction under greedy decoding
  mean_reward: float     # the task scorer's mean (includes partial credit)
  mean_length: float     # completion tokens per answer
  num_examples: int


def evaluate(params, examples: Sequence[Example], *, task: Task, tokenizer, prompt_len: int,
             max_new_tokens: int, model_config: ModelConfig, batch_size: int = 256) -> EvalResult:
  """Greedy-decodes every example (fixed batch shape, last batch padded) and scores it."""
  sampling_config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0,
                                   stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  rewards, exact, lengths = [], [], []
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start:start + batch_size])
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
    tokens, mask = rollout_lib.encode_prompts(tokenizer, [e.prompt for e in padded], prompt_len)
    gen = generate(params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.PRNGKey(0),
                   model_config, sampling_config)
    out_tokens, completion_mask = jax.device_get((gen.tokens, gen.completion_mask))
    completions = rollout_lib.decode_completions(tokenizer, out_tokens, completion_mask)[:len(chunk)]
    r, e = rollout_lib.score(task, chunk, completions)
    rewards.append(r)
    exact.append(e)
    lengths.append(completion_mask.sum(axis=1)[:len(chunk)])
  rewards, exact, lengths = map(np.concatenate, (rewards, exact, lengths))
  return EvalResult(accuracy=float(exact.mean()), mean_reward=float(rewards.mean()),
                    mean_length=float(lengths.mean()), num_examples=len(examples))
