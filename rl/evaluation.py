"""Held-out evaluation of a policy on a task: greedy exact match, and sampled pass@k.

`evaluate` greedy-decodes each example once (the launcher's held-out accuracy), counts the
scorer's failure categories over every example (`rl.verdicts`) and keeps the completions
of a fixed spread of them as samples (`rl.samples`).
`evaluate_sampled` draws n completions per example and reports pass@k with the unbiased
estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code").
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from models.config import ModelConfig
from rl import samples as samples_lib
from rl import verdicts
from rl.rollouts import batches as rollout_lib
from rl.rollouts import samplers
from rl.tasks import Example, Task
from sampling.sampler import SamplingConfig
from sharding import mesh as mesh_lib
from sharding import multihost


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Greedy held-out results. accuracy_stderr is the binomial standard error
  sqrt(acc (1 - acc) / n); accuracy_by_size maps each problem size (`Example.size`, for
  tasks that set it) to (examples, accuracy), so a reader sees where training helps."""
  accuracy: float        # exact-match fraction under greedy decoding
  mean_reward: float     # the task scorer's mean (includes partial credit)
  mean_length: float     # completion tokens per answer
  num_examples: int
  reward_timeouts: int = 0  # answers whose scorer timed out (reward 0; rl.scoring)
  reward_errors: int = 0    # answers whose scorer raised or crashed (reward 0)
  accuracy_stderr: float = 0.0
  accuracy_by_size: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)
  tool_calls: float = 0.0   # environment answers per answer (with turns; 0 without)
  # {category: answers} over every example (rl.verdicts.CATEGORIES, zeros included)
  categories: dict[str, int] = dataclasses.field(default_factory=dict)
  samples: list[dict] = dataclasses.field(default_factory=list)  # rl.samples.eval_samples


def accuracy_stderr(exact: np.ndarray) -> float:
  """Binomial standard error of the mean of the 0/1 array `exact`: sqrt(p (1 - p) / n)."""
  n = len(exact)
  if n == 0:
    return 0.0
  p = float(np.mean(exact))
  return float(np.sqrt(p * (1.0 - p) / n))


def accuracy_by_size(sizes: np.ndarray, exact: np.ndarray) -> dict[int, tuple[int, float]]:
  """{size: (examples, exact-match fraction)} over the examples with a size (> 0)."""
  sizes, exact = np.asarray(sizes), np.asarray(exact, bool)
  return {int(k): (int((sizes == k).sum()), float(exact[sizes == k].mean()))
          for k in np.unique(sizes[sizes > 0])}


@dataclasses.dataclass(frozen=True)
class SampledEvalResult:
  """pass_at_k: {k: mean over examples of the unbiased pass@k}; num_correct [E]: exact
  matches among each example's num_samples completions; mean_reward / mean_length over all
  sampled completions; reward_timeouts / reward_errors: completions whose scorer timed out
  or failed (reward 0, not correct; rl.scoring)."""
  pass_at_k: dict[int, float]
  mean_reward: float
  mean_length: float
  num_examples: int
  num_samples: int
  num_correct: np.ndarray
  reward_timeouts: int = 0
  reward_errors: int = 0


def pass_at_k(num_samples: int, num_correct, k: int) -> np.ndarray:
  """Unbiased pass@k of Chen et al. 2021: 1 - C(n - c, k) / C(n, k), per example.

  The probability that at least one of k completions drawn without replacement from the n
  sampled is correct, when c of the n are. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i),
  which avoids the huge binomials; it is exactly 1 when n - c < k.
  """
  c = np.asarray(num_correct, np.int64)
  if not 1 <= k <= num_samples:
    raise ValueError(f"pass@k needs 1 <= k <= num_samples; got k={k}, num_samples={num_samples}. "
                     "Draw more samples per example or lower k.")
  if np.any((c < 0) | (c > num_samples)):
    raise ValueError(f"num_correct must lie in [0, num_samples={num_samples}]; got {c}.")
  i = np.arange(1, num_samples + 1, dtype=np.float64)            # [n]
  counted = i[None, :] > (num_samples - c.reshape(-1))[:, None]  # i in (n - c, n]
  terms = np.where(counted, 1.0 - k / i[None, :], 1.0)
  return (1.0 - terms.prod(axis=1)).reshape(c.shape)


def _decode_and_score(generate_fn: Callable, params, chunk: Sequence[Example], repeats: int,
                      rows: int, rng: jax.Array, *, task: Task, tokenizer, prompt_len: int):
  """Decodes `repeats` completions of each example in one batch of `rows` (padded with
  copies of the last example); (scores, lengths [len(chunk) * repeats], environment
  answers per row or None without turns, each row's `ScoredRow`). A row whose
  environment failed scores 0; verdicts include the rollout's (truncated, tool_error)."""
  repeated = [e for e in chunk for _ in range(repeats)]
  used = len(repeated)
  prompts = [e.prompt for e in repeated] + [repeated[-1].prompt] * (rows - used)
  tokens, mask = rollout_lib.encode_prompts(tokenizer, prompts, prompt_len)
  gen = generate_fn(params, jnp.asarray(tokens), jnp.asarray(mask), rng)
  completions = rollout_lib.completion_texts(tokenizer, gen)[:used]
  completion_mask, stopped = multihost.fetch((gen.completion_mask, gen.stopped))
  tools = jax.device_get(gen.tools)  # turns run on one device
  scores = rollout_lib.with_rollout_failures(
      rollout_lib.score(task, repeated, completions), stopped[:used],
      None if tools is None else tools.failed[:used])
  calls = None if tools is None else np.asarray(tools.calls)[:used]
  return (scores, completion_mask.sum(axis=1)[:used], calls,
          rollout_lib.scored_rows(repeated, completions, scores.verdicts))


def batch_rows(batch_size: int, examples: int, repeats: int = 1, multiple: int = 1) -> int:
  """Rows of an evaluation batch: `batch_size`, but never more than the work, `examples`
  problems of `repeats` rows each (a held-out set of 16 is not padded to 250 rows), in
  whole groups of `repeats`, rounded up to a multiple of `multiple` (a mesh's data x fsdp
  rows).

  >>> batch_rows(250, 16), batch_rows(250, 500), batch_rows(250, 16, repeats=8)
  (16, 250, 128)
  >>> batch_rows(250, 200, repeats=8), batch_rows(250, 5, multiple=4)
  (248, 8)
  """
  groups = max(min(batch_size, examples * repeats) // repeats, 1)
  rows = groups * repeats
  return -(-rows // multiple) * multiple


def evaluate(params, examples: Sequence[Example], *, task: Task, tokenizer, prompt_len: int,
             max_new_tokens: int, model_config: ModelConfig, batch_size: int = 256,
             progress: bool = False, mesh: jax.sharding.Mesh | None = None,
             turns=None, samples: int = 0) -> EvalResult:
  """Greedy-decodes every example (fixed batch shape, last batch padded) and scores it, in
  batches of `batch_rows(batch_size, len(examples), multiple=data x fsdp)` rows.

  The sampler is `rl.rollouts.samplers.make_sampler`'s: with `mesh`, the sharded one. With `turns` (rl.environments.turns.Turns)
  an environment answers the policy's tool calls (one device). `samples`: how many
  examples' completions to keep as samples (`rl.samples.eval_samples`: the same spread
  of examples every time).
  """
  sampling_config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0,
                                   stop_tokens=(tokenizer.eos_id,), pad_id=tokenizer.pad_id)
  generate_fn = samplers.make_sampler(model_config, sampling_config, mesh=mesh, turns=turns)
  multiple = 1 if mesh is None else mesh_lib.batch_size_multiple(mesh)
  batch_size = batch_rows(batch_size, len(examples), multiple=multiple)
  scores, lengths, calls, rows = [], [], [], []
  starts = range(0, len(examples), batch_size)
  for start in tqdm.tqdm(starts, desc="greedy eval", disable=not progress, leave=False):
    s, n, c, r = _decode_and_score(generate_fn, params, examples[start:start + batch_size], 1,
                                   batch_size, jax.random.PRNGKey(0), task=task,
                                   tokenizer=tokenizer, prompt_len=prompt_len)
    scores.append(s)
    lengths.append(n)
    calls.append(np.zeros_like(n) if c is None else c)
    rows += r
  rewards, exact, lengths = _joined(scores, lengths)
  sizes = np.array([e.size for e in examples])
  return EvalResult(accuracy=float(exact.mean()), mean_reward=float(rewards.mean()),
                    mean_length=float(lengths.mean()), num_examples=len(examples),
                    accuracy_stderr=accuracy_stderr(exact),
                    accuracy_by_size=accuracy_by_size(sizes, exact),
                    tool_calls=float(np.concatenate(calls).mean()),
                    categories=verdicts.counts(row.verdict for row in rows),
                    samples=samples_lib.eval_samples(rows, rewards, lengths, samples),
                    **_failures(scores))


def evaluate_sampled(params, examples: Sequence[Example], *, task: Task, tokenizer,
                     prompt_len: int, model_config: ModelConfig, sampling_config: SamplingConfig,
                     num_samples: int, ks: Sequence[int], rng: jax.Array,
                     batch_size: int = 256, progress: bool = False,
                     turns=None) -> SampledEvalResult:
  """Samples `num_samples` completions per example and reports the unbiased pass@k (with
  `turns`, an environment answers the tool calls, as in `evaluate`).

  Rows of one batch are whole groups: `batch_rows(batch_size, len(examples), num_samples)`
  rows (at least one group, no more than the work), the last batch padded, so the sampler
  compiles once. Batch b uses `fold_in(rng, b)`. pass@1 is the mean exact-match rate of the
  samples.
  """
  if num_samples < 1:
    raise ValueError(f"num_samples={num_samples} must be >= 1.")
  for k in ks:
    if not 1 <= k <= num_samples:
      raise ValueError(f"pass@{k} needs 1 <= k <= num_samples={num_samples}; raise "
                       "num_samples or drop that k.")
  rows = batch_rows(batch_size, len(examples), num_samples)
  per_batch = rows // num_samples
  generate_fn = samplers.make_sampler(model_config, sampling_config, turns=turns)
  scores, lengths = [], []
  starts = range(0, len(examples), per_batch)
  for b, start in enumerate(tqdm.tqdm(starts, desc=f"sampled eval (n={num_samples})",
                                      disable=not progress, leave=False)):
    s, n, _, _ = _decode_and_score(generate_fn, params, examples[start:start + per_batch],
                                   num_samples, rows, jax.random.fold_in(rng, b), task=task,
                                   tokenizer=tokenizer, prompt_len=prompt_len)
    scores.append(s)
    lengths.append(n)
  rewards, exact, lengths = _joined(scores, lengths)
  num_correct = exact.reshape(len(examples), num_samples).sum(axis=1)
  return SampledEvalResult(
      pass_at_k={k: float(pass_at_k(num_samples, num_correct, k).mean()) for k in ks},
      mean_reward=float(rewards.mean()), mean_length=float(lengths.mean()),
      num_examples=len(examples), num_samples=num_samples, num_correct=num_correct,
      **_failures(scores))


def _joined(scores, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(rewards, exact, lengths) of a list of per-batch Scores and lengths."""
  return (np.concatenate([s.rewards for s in scores]), np.concatenate([s.exact for s in scores]),
          np.concatenate(lengths))


def _failures(scores) -> dict[str, int]:
  return dict(reward_timeouts=sum(s.timeouts for s in scores),
              reward_errors=sum(s.errors for s in scores))
