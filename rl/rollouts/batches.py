"""From task examples to a scored `Rollout` batch: encode, sample groups, score. (Advantages
are a batch stage, computed once on the final batch:
rl.objectives.advantages.advantage_stage.)"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import transformer
from models.config import ModelConfig
from rl import environments
from rl import scoring
from rl import timing
from rl import verdicts
from rl.samples import ScoredRow
from rl.tasks import Example, Task
from rl.types import Rollout, TreeRows
from sampling import sampler
from sampling.sampler import DraftStats, Generation, SamplingConfig, ToolRows, generate
from sampling.speculative import DraftConfig, speculative_generate
from sampling.tree import ForkPolicy, tree_generate
from sharding import multihost
from sharding import reshard
from sharding import rules as sharding_rules

# generate_fn(params, prompt_tokens [B, P], prompt_mask [B, P], rng, version) -> Generation;
# a speculative one (make_generate(draft_config=...)) also takes history=(tokens, mask).
GenerateFn = Callable[[Any, jax.Array, jax.Array, jax.Array, Any], Generation]


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


def answer_segments(tokenizer: Tokenizer, example: Example, environment=None
                    ) -> tuple[list[int], list[bool]]:
  """(ids, written by the environment) of a reference answer + EOS: with an environment
  (rl.environments), the answer's tool answers are found by running it on the answer
  (`rl.environments.split_demonstration`) and flagged, so the warm start keeps them as
  context and trains only what the policy would write."""
  segments = ([(example.answer, False)] if environment is None else
              environments.split_demonstration(example.prompt, example.answer, environment))
  ids, by_environment = [], []
  for text, written in segments:
    piece = tokenizer.encode(text)
    ids += piece
    by_environment += [written] * len(piece)
  return ids + [tokenizer.eos_id], by_environment + [False]


def supervised_batch(tokenizer: Tokenizer, examples: Sequence[Example], prompt_len: int,
                     completion_len: int, environment=None) -> Rollout:
  """A batch of (prompt, reference answer + EOS) in the sampler's layout, for the warm
  start; with an environment, its answers inside the reference answer are context
  (prompt_mask, env_mask), not trained (`answer_segments`)."""
  prompt_tokens, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in examples], prompt_len)
  completion = np.full((len(examples), completion_len), tokenizer.pad_id, np.int32)
  completion_mask = np.zeros((len(examples), completion_len), bool)
  env_mask = np.zeros((len(examples), completion_len), bool)
  for row, example in enumerate(examples):
    ids, by_environment = answer_segments(tokenizer, example, environment)
    if len(ids) > completion_len:
      raise ValueError(f"Answer {example.answer!r} needs {len(ids)} tokens with EOS but "
                       f"max_new_tokens is {completion_len}; raise config.rollout.max_new_tokens.")
    completion[row, :len(ids)] = ids
    env_mask[row, :len(ids)] = by_environment
    completion_mask[row, :len(ids)] = ~np.asarray(by_environment, bool)
  n = len(examples)
  zeros = np.zeros((n, prompt_len + completion_len), np.float32)
  no_prompt = np.zeros_like(prompt_mask)
  return Rollout(
      tokens=jnp.asarray(np.concatenate([prompt_tokens, completion], axis=1)),
      prompt_mask=jnp.asarray(np.concatenate([prompt_mask, env_mask], axis=1)),
      completion_mask=jnp.asarray(np.concatenate([no_prompt, completion_mask], axis=1)),
      behavior_logp=jnp.asarray(zeros), version=jnp.full(zeros.shape, -1, jnp.int32),
      group=jnp.arange(n, dtype=jnp.int32), reward=jnp.ones((n,), jnp.float32),
      advantages=jnp.asarray(zeros),
      env_mask=None if environment is None else jnp.asarray(
          np.concatenate([no_prompt, env_mask], axis=1)))


# One compiled sampler per (model, sampling, mesh, rules); rules must be a tuple (hashable).
@functools.lru_cache(maxsize=32)
def make_generate(model_config: ModelConfig, sampling_config: SamplingConfig,
                  mesh: jax.sharding.Mesh | None = None,
                  rules: sharding_rules.Rules = sharding_rules.SAMPLER_RULES,
                  draft_config: DraftConfig | None = None) -> GenerateFn:
  """The sampler as `generate_fn(params, prompt_tokens, prompt_mask, rng, version)`, with
  `generate_fn.lower(...)` (the same arguments) lowering its compiled program.

  Without `mesh`: `sampling.sampler.generate`. With a mesh: the same `sampler.sample`
  jitted with `in_shardings` (parameters by `rules`, default tensor-parallel and replicated
  over data / fsdp; prompts split by rows over data x fsdp; RNG and version replicated),
  `out_shardings` (the Generation split by rows), and a sharding constraint on the state
  after prefill (KV cache rows over data x fsdp, KV heads over tensor), so the cache the
  decode loop carries never gathers onto one device. B must be a multiple of data x fsdp.
  Parameters in another layout (the trainer's) are first resharded on device; the loop
  publishes them in the sampler layout once per update (`sharding.reshard.make_publish`)
  so repeated calls skip that. In a multi-process run host prompts are placed row-wise.
  A batch whose rows do not split over data x fsdp (a selection refill, say) is padded
  with copies of its last row, and the padding rows are dropped from the result.

  draft_config: decode speculatively with these model-free drafts
  (`sampling.speculative`; the same distribution, fewer forwards; the Generation carries
  its draft counters). Single-device only.
  """
  if draft_config is not None:
    if mesh is not None:
      raise ValueError("Speculative decoding runs on one device; drop the mesh or the drafts.")

    def speculative(params, prompt_tokens, prompt_mask, rng, version=0, history=None):
      tokens, mask = (None, None) if history is None else history
      return speculative_generate(params, prompt_tokens, prompt_mask, rng, model_config,
                                  sampling_config, draft_config, version, tokens, mask)
    speculative.lower = lambda params, prompt_tokens, prompt_mask, rng, version=0: (
        speculative_generate.lower(params, prompt_tokens, prompt_mask, rng, model_config,
                                   sampling_config, draft_config, version))
    return speculative
  if mesh is None:
    def unsharded(params, prompt_tokens, prompt_mask, rng, version=0):
      return generate(params, prompt_tokens, prompt_mask, rng, model_config, sampling_config,
                      version)
    unsharded.lower = lambda params, prompt_tokens, prompt_mask, rng, version=0: generate.lower(
        params, prompt_tokens, prompt_mask, rng, model_config, sampling_config, version)
    return unsharded
  abstract_params = jax.eval_shape(
      lambda: transformer.init_params(model_config, jax.random.PRNGKey(0)))
  param_shardings = sharding_rules.tree_shardings(abstract_params, mesh, rules)
  rows, replicated = sharding_rules.batch_sharding(mesh), sharding_rules.replicated(mesh)
  plain = {f.name: 0 for f in dataclasses.fields(Generation) if f.default is dataclasses.MISSING}
  if model_config.is_moe:
    plain["experts"] = 0  # the routing record, split by rows like the rest
  out_shardings = sharding_rules.tree_shardings(  # the tree fields stay None: no leaves
      Generation(**plain), mesh, sharding_rules.BATCH_RULES)

  def constrain(state: sampler.SamplerState) -> sampler.SamplerState:
    shardings = sharding_rules.tree_shardings(state, mesh, sharding_rules.SAMPLER_STATE_RULES)
    return jax.lax.with_sharding_constraint(state, shardings)

  def sharded(params, prompt_tokens, prompt_mask, rng, version):
    return sampler.sample(params, prompt_tokens, prompt_mask, rng, model_config,
                          sampling_config, version, constrain=constrain)

  jitted = jax.jit(sharded, in_shardings=(param_shardings, rows, rows, replicated, replicated),
                   out_shardings=out_shardings)
  to_sampler_layout = reshard.make_reshard(param_shardings)

  shards = math.prod(mesh.shape[axis] for axis in sharding_rules.BATCH_AXES)

  def generate_fn(params, prompt_tokens, prompt_mask, rng, version=0):
    if any(getattr(leaf, "sharding", None) != want for leaf, want in
           zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings))):
      params = to_sampler_layout(params)
    num_rows = prompt_tokens.shape[0]
    prompt_tokens, prompt_mask = (_pad_rows(x, -num_rows % shards)
                                  for x in (prompt_tokens, prompt_mask))
    if jax.process_count() > 1:  # host values -> global arrays, each process giving its rows
      prompt_tokens, prompt_mask = multihost.place_rows((prompt_tokens, prompt_mask), rows)
      rng = np.asarray(jax.device_get(rng))
    generation = jitted(params, prompt_tokens, prompt_mask, rng, np.asarray(version, np.int32))
    if prompt_tokens.shape[0] == num_rows:
      return generation
    return jax.tree.map(lambda x: x[:num_rows] if x.ndim else x, generation)
  # The compiled program for given shapes, for memory analysis (experiments/memory.py).
  generate_fn.lower = lambda params, prompt_tokens, prompt_mask, rng, version=0: jitted.lower(
      params, prompt_tokens, prompt_mask, rng, np.asarray(version, np.int32))
  return generate_fn


def _pad_rows(x, count: int):
  """x with its last row repeated `count` more times (rows the caller then drops)."""
  if not count:
    return x
  x = np.asarray(x)
  return np.concatenate([x, np.repeat(x[-1:], count, axis=0)])


@dataclasses.dataclass
class ScoredSamples:
  """A sampled, scored batch: the Rollout plus host-side texts, exact-match flags and each
  row's `ScoredRow` (prompt, completion, verdict: what training samples show), and how
  many rows got reward 0 because their scorer timed out or failed (rl.scoring);
  draft_stats / tools: speculative decoding's and the environment's counters (None when
  not used)."""
  rollout: Rollout
  completions: list[str]
  exact: np.ndarray
  rows: list[ScoredRow]
  decode_steps: int
  reward_timeouts: int = 0
  reward_errors: int = 0
  draft_stats: DraftStats | None = None
  tools: ToolRows | None = None


def decode_completions(tokenizer: Tokenizer, tokens: np.ndarray, completion_mask: np.ndarray) -> list[str]:
  """Text of each row's completion slots (up to EOS)."""
  return [tokenizer.decode(row[m]) for row, m in zip(tokens, completion_mask)]


def completion_texts(tokenizer: Tokenizer, generation: Generation) -> list[str]:
  """What each row's scorer reads: its completion, environment answers included (with
  turns, `Generation.tools`), up to EOS."""
  mask = generation.completion_mask
  if generation.tools is not None:
    mask = mask | generation.tools.env_mask
  tokens, mask = multihost.fetch((generation.tokens, mask))
  return decode_completions(tokenizer, tokens, mask)


def with_rollout_failures(scores: scoring.Scores, stopped: np.ndarray,
                          tool_failed: np.ndarray | None = None) -> scoring.Scores:
  """`scores` with what the rollout adds to the scorer's view, from host arrays [N] of the
  rows' `Generation.stopped` and, with turns, `ToolRows.failed`: reward 0 (and no exact
  match) for rows whose environment failed, and each row's verdict from
  `rl.verdicts.after_rollout` (tool_error; truncated for a row that did not stop)."""
  failed = np.zeros(len(stopped), bool) if tool_failed is None else np.asarray(tool_failed)
  judged = tuple(verdicts.after_rollout(v, stopped=bool(s), tool_failed=bool(f))
                 for v, s, f in zip(scores.verdicts, np.asarray(stopped), failed))
  return dataclasses.replace(scores, rewards=np.where(failed, 0.0, scores.rewards).astype(np.float32),
                             exact=scores.exact & ~failed, verdicts=judged)


def scored_rows(examples: Sequence[Example], completions: Sequence[str],
                judged: Sequence[verdicts.Verdict]) -> list[ScoredRow]:
  """Each row's prompt, completion, verdict and example, in row order."""
  return [ScoredRow(e.prompt, c, v, e) for e, c, v in zip(examples, completions, judged)]


def score(task: Task, examples: Sequence[Example], completions: Sequence[str]) -> scoring.Scores:
  """Rewards and exact-match flags from the task's scorer, run in rl.scoring's worker
  process under a time limit: a completion whose scorer hangs, raises, crashes or returns
  a non-finite value gets reward 0 and is counted (Scores.timeouts / Scores.errors). Its
  wall time counts as the "score" phase (rl.timing), whichever producer calls it."""
  with timing.phase("score"):
    return scoring.score(task, completions, examples)


def sample_and_score(params, examples: Sequence[Example], *, task: Task, tokenizer: Tokenizer,
                     rng: jax.Array, group_size: int, prompt_len: int,
                     model_config: ModelConfig, sampling_config: SamplingConfig,
                     version: int = 0, generate_fn: GenerateFn | None = None,
                     history=None) -> ScoredSamples:
  """Samples `group_size` completions per example and scores them.

  Rows are grouped contiguously: rows [i*G, (i+1)*G) answer examples[i] (group id i).
  `generate_fn` (default: unsharded `generate`) is the sampler; see `make_generate`.
  history: (tokens, mask) [rows, N], each row's reference completion for a speculative
  sampler's 'history' draft source.
  """
  if generate_fn is None:
    generate_fn = make_generate(model_config, sampling_config)
  prompt_tokens, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in examples], prompt_len)
  prompt_tokens = np.repeat(prompt_tokens, group_size, axis=0)
  prompt_mask = np.repeat(prompt_mask, group_size, axis=0)
  extra = {} if history is None else {"history": tuple(
      jnp.asarray(np.repeat(np.asarray(h), group_size, axis=0)) for h in history)}
  generation = generate_fn(params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), rng,
                           version, **extra)
  return score_generation(generation, examples, group_size, task=task, tokenizer=tokenizer)


def score_generation(generation: Generation, examples: Sequence[Example], group_size: int, *,
                     task: Task, tokenizer: Tokenizer) -> ScoredSamples:
  """Scores a generation whose rows [i*G, (i+1)*G) answer examples[i] (group id i)."""
  if jax.process_count() > 1:  # every process scores every row; the train step re-splits rows
    generation = multihost.fetch(generation)
  completions = completion_texts(tokenizer, generation)
  repeated = [e for e in examples for _ in range(group_size)]
  tools = jax.device_get(generation.tools)
  scores = with_rollout_failures(score(task, repeated, completions),
                                 jax.device_get(generation.stopped),
                                 None if tools is None else tools.failed)
  group = jnp.repeat(jnp.arange(len(examples), dtype=jnp.int32), group_size)
  rollout = Rollout(tokens=generation.tokens, prompt_mask=generation.prompt_mask,
                    completion_mask=generation.completion_mask,
                    behavior_logp=generation.behavior_logp, version=generation.version,
                    group=group, reward=jnp.asarray(scores.rewards),
                    env_mask=None if tools is None else generation.tools.env_mask,
                    experts=generation.experts)
  return ScoredSamples(rollout=rollout, completions=completions, exact=scores.exact,
                       rows=scored_rows(repeated, completions, scores.verdicts),
                       decode_steps=int(generation.decode_steps),
                       reward_timeouts=scores.timeouts, reward_errors=scores.errors,
                       draft_stats=jax.device_get(generation.speculative), tools=tools)


@dataclasses.dataclass
class ScoredTree:
  """A sampled, scored tree batch: the Rollout (tree fields set), the leaves' texts,
  exact-match flags and `ScoredRow`s (unused rows: '', False and None), the leaf mask, the
  decode counters and the leaves whose scorer timed out or failed (rl.scoring)."""
  rollout: Rollout
  completions: list[str]
  exact: np.ndarray
  rows: list[ScoredRow | None]
  leaf: np.ndarray
  decoded_tokens: int
  refed_tokens: int
  pruned_tokens: int
  reward_timeouts: int = 0
  reward_errors: int = 0


def tree_rollout(generation: Generation, reward: jax.Array, group: jax.Array) -> Rollout:
  """The training batch of a tree: every shared-prefix token is trained once.

  Row r keeps its whole root-to-leaf sequence as context, but its first prefix_len[r]
  completion tokens (decoded by an ancestor row, which trains them) move from
  completion_mask to prompt_mask: the loss sees each tree token once, in the row that
  decoded it, with its node's advantage (rl.objectives.advantages.per_tree, the loop's
  advantage stage).
  """
  paths = generation.tree
  prompt_len = generation.tokens.shape[1] - paths.entropy.shape[1]
  full = generation.completion_mask[:, prompt_len:]
  pos = jnp.arange(full.shape[1])[None, :]
  shared = full & (pos < paths.prefix_len[:, None])
  pad = lambda x: jnp.pad(x, ((0, 0), (prompt_len, 0)))
  shared, own = pad(shared), pad(full & ~(pos < paths.prefix_len[:, None]))
  return Rollout(
      tokens=generation.tokens, prompt_mask=generation.prompt_mask | shared,
      completion_mask=own, behavior_logp=generation.behavior_logp,
      version=generation.version, group=group, reward=reward, experts=generation.experts,
      tree=TreeRows(node=paths.node, parent=paths.parent, depth=paths.depth,
                    prefix_len=paths.prefix_len))


def tree_sample_and_score(params, examples: Sequence[Example], *, task: Task,
                          tokenizer: Tokenizer, rng: jax.Array, prompt_len: int,
                          model_config: ModelConfig, sampling_config: SamplingConfig,
                          policy: ForkPolicy, version: int = 0) -> ScoredTree:
  """Samples one tree per example (policy.leaves rows each, contiguous) and scores the
  leaves. Unused rows get reward 0 and no tokens."""
  prompt_tokens, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in examples], prompt_len)
  generation = tree_generate(params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), rng,
                             model_config, sampling_config, policy, version)
  tokens, completion_mask, leaf, stopped = jax.device_get(
      (generation.tokens, generation.completion_mask, generation.tree.leaf, generation.stopped))
  completions = decode_completions(tokenizer, tokens, completion_mask)
  repeated = [e for e in examples for _ in range(policy.leaves)]
  rows = np.flatnonzero(leaf)  # unused rows are not scored
  scores = score(task, [repeated[r] for r in rows], [completions[r] for r in rows])
  rewards, exact = np.zeros(len(leaf), np.float32), np.zeros(len(leaf), bool)
  rewards[rows], exact[rows] = scores.rewards, scores.exact
  scored = [None] * len(leaf)
  for r, verdict in zip(rows, scores.verdicts):
    judged = verdicts.after_rollout(verdict, stopped=bool(stopped[r]), tool_failed=False)
    scored[r] = ScoredRow(repeated[r].prompt, completions[r], judged, repeated[r])
  group = jnp.repeat(jnp.arange(len(examples), dtype=jnp.int32), policy.leaves)
  rollout = tree_rollout(generation, jnp.asarray(rewards, jnp.float32), group)
  return ScoredTree(rollout=rollout, completions=completions, exact=exact, rows=scored,
                    leaf=leaf,
                    decoded_tokens=int(generation.tree.decoded_tokens),
                    refed_tokens=int(generation.tree.refed_tokens),
                    pruned_tokens=int(generation.tree.pruned_tokens),
                    reward_timeouts=scores.timeouts, reward_errors=scores.errors)
