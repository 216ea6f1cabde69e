"""arrol: online rollout pruning with a learned quality head (config.rollout.kind='pruned').

Accelerating RLVR via online Rollout Pruning (arrol, Xu et al. 2026, arXiv 2603.24840)
"trains a lightweight quality head on-the-fly to predict the success probability of partial
rollouts and uses it to make early pruning decisions", "while explicitly steering the
surviving ones more correctness-balanced" (a target positive-reward ratio rho, 0.5 by
default). Here, for each of the next prompts_per_step prompts:

  1. `candidates` = N rollouts start (one prefill, one decode loop) and decode
     `prefix_tokens` = L completion tokens;
  2. the quality head, a logistic regression on the policy's final-normed hidden state at
     each candidate's last token (`prefix_features`), predicts its success probability q;
  3. `select_survivors` keeps group_size = G of the N: the round(G rho) with the highest q
     and the rest with the lowest, so the survivors' predicted successes are balanced; the
     other N - G rows are dropped from the sampler state and never decoded again;
  4. the survivors decode to the end, each drawing exactly the tokens it would have drawn
     in the N-wide batch (`sampling.sampler.decode(row_ids=...)`), and are scored; GRPO
     trains on them as one group per prompt;
  5. the head takes `head_steps` Adam steps on the binary cross-entropy between its
     predictions for the survivors and their exact-match outcome (the paper's online
     training on the run's own rollouts; pruned rows have no outcome).

The head's parameters and Adam state are the producer's state (`PruningState`, in
`LoopState.producer`), so a resumed run continues with the head it had. Choices the
abstract leaves open, made here: the features (final hidden state at the prefix's last
token), the label (the task's exact match), the selection rule (top and bottom of q), and
that rows which stop before L tokens stay candidates like the others. Decoding runs on one
device, independent samples only (any selection rule but uniform, a mesh, tools and
speculative decoding are refused).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import transformer
from models.config import ModelConfig
from rl.rollouts import batches
from rl.rollouts import producers
from rl.rollouts import statistics
from rl.settings.rollout import PruningSettings
from sampling import sampler as sampler_lib
from sampling.sampler import Generation, SamplerState, SamplingConfig


@flax.struct.dataclass
class QualityHead:
  """Logistic regression on a hidden state: q = sigmoid(features . weight + bias)."""
  weight: jax.Array  # [D]
  bias: jax.Array  # []


def init_head(d_model: int) -> QualityHead:
  """A head that predicts 0.5 for everything (zero weights)."""
  return QualityHead(weight=jnp.zeros((d_model,), jnp.float32), bias=jnp.zeros((), jnp.float32))


def head_logits(head: QualityHead, features: jax.Array) -> jax.Array:
  """[B] logits of success for features [B, D]."""
  return features.astype(jnp.float32) @ head.weight + head.bias


def head_loss(head: QualityHead, features: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean binary cross-entropy of the head's predictions against labels [B] in {0, 1}."""
  return optax.sigmoid_binary_cross_entropy(head_logits(head, features), labels).mean()


@functools.partial(jax.jit, static_argnames=("learning_rate", "steps"))
def fit_head(head: QualityHead, opt_state, features: jax.Array, labels: jax.Array, *,
             learning_rate: float, steps: int) -> tuple[QualityHead, Any, jax.Array]:
  """`steps` Adam steps on `head_loss`; (head, Adam state, the loss before the first)."""
  optimizer = optax.adam(learning_rate)

  def one(carry, _):
    head, opt_state = carry
    loss, grads = jax.value_and_grad(head_loss)(head, features, labels)
    updates, opt_state = optimizer.update(grads, opt_state, head)
    return (optax.apply_updates(head, updates), opt_state), loss

  (head, opt_state), losses = jax.lax.scan(one, (head, opt_state), None, length=steps)
  return head, opt_state, losses[0] if steps else head_loss(head, features, labels)


def select_survivors(scores: jax.Array, group_size: int, positive_share: float) -> jax.Array:
  """Indices [P, G] (ascending) of the survivors among each prompt's N candidates (scores
  [P, N]): the round(G * positive_share) highest scores and the G - that lowest (ties to
  the lower index). N >= G.

  >>> select_survivors(jnp.array([[0.1, 0.9, 0.5, 0.7, 0.2, 0.3]]), 4, 0.5).tolist()
  [[0, 1, 3, 4]]
  """
  candidates = scores.shape[1]
  top = int(round(group_size * positive_share))
  order = jnp.argsort(-scores, axis=1, stable=True)
  chosen = jnp.concatenate([order[:, :top], order[:, candidates - (group_size - top):]], axis=1)
  return jnp.sort(chosen, axis=1)


def prefix_features(params, state: SamplerState, model_config: ModelConfig,
                    prefix_tokens: int) -> jax.Array:
  """[B, D]: the final-normed hidden state at each row's last token (prompt and at most
  `prefix_tokens` completion tokens), from one forward of those slots."""
  slots = state.prompt_len + prefix_tokens
  mask = state.token_mask[:, :slots]
  hidden, _ = transformer.hidden_states(params, state.tokens[:, :slots],
                                        transformer.positions_from_mask(mask), mask,
                                        model_config)
  last = slots - 1 - jnp.argmax(mask[:, ::-1], axis=1)
  return jax.lax.stop_gradient(hidden[jnp.arange(hidden.shape[0]), last])


def _take_survivors(state: SamplerState, index: jax.Array) -> SamplerState:
  """The sampler state of rows `index` (its KV cache is [layers, rows, ...])."""
  cache = {name: value[:, index] for name, value in state.cache.items()}
  return sampler_lib.take_rows(state.replace(cache=None), index).replace(cache=cache)


@flax.struct.dataclass
class PrunedGeneration:
  """`pruned_generate`'s result: the survivors' Generation [P * G rows], their features
  [P * G, D], every candidate's predicted success [P * N], the survivors' candidate
  indices [P * G], and the completion tokens decoded in all (candidates' prefixes plus
  the survivors' continuations)."""
  generation: Generation
  features: jax.Array
  predicted: jax.Array
  survivors: jax.Array
  decoded_tokens: jax.Array


@functools.partial(jax.jit, static_argnames=("model_config", "sampling_config", "candidates",
                                             "group_size", "prefix_tokens", "positive_share"))
def pruned_generate(params, head: QualityHead, prompt_tokens: jax.Array,
                    prompt_mask: jax.Array, rng: jax.Array, version, *,
                    model_config: ModelConfig, sampling_config: SamplingConfig,
                    candidates: int, group_size: int, prefix_tokens: int,
                    positive_share: float) -> PrunedGeneration:
  """Steps 1-4 of the module docstring for prompts [P * N, S] (each prompt repeated N
  times, contiguously)."""
  version = jnp.asarray(version, jnp.int32)
  state = sampler_lib.prefill(params, prompt_tokens, prompt_mask, rng, model_config,
                              sampling_config)
  state = sampler_lib.decode(params, state, version, model_config, sampling_config,
                             max_steps=prefix_tokens)
  features = prefix_features(params, state, model_config, prefix_tokens)
  predicted = jax.nn.sigmoid(head_logits(head, features))
  prompts = prompt_tokens.shape[0] // candidates
  chosen = (select_survivors(predicted.reshape(prompts, candidates), group_size,
                             positive_share)
            + candidates * jnp.arange(prompts)[:, None]).reshape(-1)
  prefix_counts = state.token_mask[:, state.prompt_len:].sum(axis=1)
  survivors = sampler_lib.decode(params, _take_survivors(state, chosen), version,
                                 model_config, sampling_config, row_ids=chosen)
  generation = sampler_lib.to_generation(survivors)
  decoded = prefix_counts.sum() + (generation.completion_len - prefix_counts[chosen]).sum()
  return PrunedGeneration(generation=generation, features=features[chosen],
                          predicted=predicted, survivors=chosen, decoded_tokens=decoded)


@flax.struct.dataclass
class PruningState:
  """The pruned producer's state: the next data cursor, the quality head and its Adam
  state."""
  cursor: np.ndarray
  head: QualityHead
  head_opt: Any

  def summary(self) -> dict:
    """What the run's summary.json reports of this state: nothing."""
    return {}


def producer(ctx: producers.BatchContext, settings: PruningSettings) -> producers.Producer:
  """arrol's producer (module docstring) with resolved `settings`
  (`PruningSettings.resolved`)."""
  n, g = settings.candidates, ctx.group_size

  def init(start: int) -> PruningState:
    head = init_head(ctx.model_config.d_model)
    return PruningState(cursor=producers.cursor_array(start), head=head,
                        head_opt=optax.adam(settings.head_lr).init(head))

  def produce(state: PruningState, params, version, rng, trains_at=None):
    del trains_at
    cursor = int(state.cursor)
    examples = [ctx.example(c) for c in range(cursor, cursor + ctx.prompts_per_step)]
    tokens, mask = batches.encode_prompts(ctx.tokenizer, [e.prompt for e in examples],
                                          ctx.prompt_len)
    out = pruned_generate(
        params, state.head, jnp.asarray(np.repeat(tokens, n, 0)),
        jnp.asarray(np.repeat(mask, n, 0)), rng, version, model_config=ctx.model_config,
        sampling_config=ctx.sampling_config, candidates=n, group_size=g,
        prefix_tokens=settings.prefix_tokens, positive_share=settings.positive_share)
    scored = batches.score_generation(out.generation, examples, g, task=ctx.task,
                                      tokenizer=ctx.tokenizer)
    labels = jnp.asarray(scored.exact, jnp.float32)
    predicted = np.asarray(out.predicted)[np.asarray(out.survivors)]
    started = time.perf_counter()
    head, head_opt, loss = fit_head(state.head, state.head_opt, out.features, labels,
                                    learning_rate=settings.head_lr, steps=settings.head_steps)
    loss = float(loss)
    head_s = time.perf_counter() - started
    reward = np.asarray(scored.rollout.reward).reshape(ctx.prompts_per_step, g)
    lengths = np.asarray(scored.rollout.completion_mask).sum(axis=1)
    informative = statistics.informative(reward)
    stats = statistics.batch_stats(
        list(reward), scored.exact, lengths, lengths,
        decoded_tokens=int(out.decoded_tokens), scored=[scored], rows=scored.rows,
        decode_steps=scored.decode_steps, rollouts=ctx.prompts_per_step * n,
        pruned_rows=ctx.prompts_per_step * (n - g),
        batch_informative_groups=float(np.mean(informative)),
        informative_rows=int(g * np.sum(informative)),
        head_loss=loss, head_accuracy=float(np.mean((predicted > 0.5) == scored.exact)),
        head_predicted=float(predicted.mean()), time_head_s=head_s)
    return scored.rollout, stats, PruningState(
        cursor=producers.cursor_array(cursor + ctx.prompts_per_step), head=head,
        head_opt=head_opt)

  return producers.Producer(init, produce)


def check(settings: PruningSettings, group_size: int, max_new_tokens: int) -> None:
  """Raises ValueError for pruning settings that cannot run with these sizes."""
  resolved = settings.resolved(group_size, max_new_tokens)
  if resolved.candidates <= group_size:
    raise ValueError(f"config.rollout.pruning.candidates = {settings.candidates}: arrol starts "
                     f"more rollouts than it keeps (config.rollout.group_size = {group_size}); "
                     "set it above group_size (0 = 2 * group_size).")
  if resolved.prefix_tokens >= max_new_tokens:
    raise ValueError(f"config.rollout.pruning.prefix_tokens = {settings.prefix_tokens} must be "
                     f"below config.rollout.max_new_tokens = {max_new_tokens} (the head decides "
                     "part-way; 0 = max_new_tokens // 4).")

