"""What the train step differentiates, composed in one place: the policy's log-probs of a
microbatch, the policy objective with its corrections (`losses`, `corrections`), the
on-policy distillation term (`distillation`) and the sampler-trainer mismatch sums.

    objective = composite.StepObjective(model_config, losses.LossSettings(), temperature=1.0)
    loss, metrics = objective(policy_params, micro, version, prox_version, teacher_params)

`rl.train.make_train_step` builds one and differentiates it with respect to the trained
parameters; everything else of the step (microbatches, minibatches, the optimiser, the
non-finite skip, sharding) is update mechanics and stays there. A new input of the loss
(a teacher, a reference policy) is a field of `StepObjective`, not a closure of the step.

Log-probs are taken at the sampling temperature. `logprob_chunk` = C > 0 computes them C
positions at a time (`transformer.chunked_token_logprobs`): the [B, T, V] logits never
exist, in the forward or the backward. `shared_prefix` = (group_size G, prompt_len P) runs
each group's prompt once (`transformer.forward_shared_prefix`; `check_shared_prefix`
validates a batch). `residual_hook` goes to `transformer.forward` (a sharding constraint on
a mesh). Distillation (`distill`, with the teacher's parameters an argument of the call)
adds distill.coef x the distillation term aggregated like the objective, or replaces the
policy objective with it (distill.with_reward = False); the student's and the teacher's
[B, T, V] log-softmax exist per microbatch, or [B, C, V] at a time with logprob_chunk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models import transformer
from models.config import ModelConfig
from rl.objectives import corrections
from rl.objectives import distillation
from rl.objectives import losses
from rl.types import Rollout

sg = jax.lax.stop_gradient


def policy_logprobs(params, batch: Rollout, model_config: ModelConfig,
                    temperature: float = 1.0,
                    residual_hook: Callable[[jax.Array], jax.Array] | None = None, *,
                    shared_prefix: tuple[int, int] | None = None,
                    logprob_chunk: int = 0) -> jax.Array:
  """log-probs [B, T] of the batch's tokens at the sampling temperature.

  Args:
    params: the policy's parameters.
    batch: the rows (tokens and their mask).
    model_config: the policy's shapes.
    temperature: the sampling temperature the log-probs are taken at (0 and 1: none).
    residual_hook: applied to the residual stream (`transformer.forward`).
    shared_prefix: (G, P): each group of G contiguous rows shares its first P slots, run
      once per group; equal to the replicated forward at every column whose predicting
      slot holds a real token. Takes no residual hook.
    logprob_chunk: > 0: C positions at a time, no [B, T, V] buffer (same values and
      gradients up to float rounding).

  Returns:
    [B, T] float32: log p(token_t | tokens_<t) (position 0 and padding: arbitrary).
  """
  if shared_prefix is not None:
    return _shared_prefix_logprobs(params, batch, model_config, temperature, *shared_prefix)
  if logprob_chunk:
    x, _ = transformer.hidden_states(params, batch.tokens,
                                     transformer.positions_from_mask(batch.token_mask),
                                     batch.token_mask, model_config, residual_hook=residual_hook)
    return transformer.chunked_token_logprobs(x, transformer.output_head(params, model_config),
                                              batch.tokens, logprob_chunk, temperature)
  logits, _ = transformer.forward(params, batch.tokens,
                                  transformer.positions_from_mask(batch.token_mask),
                                  batch.token_mask, model_config, residual_hook=residual_hook)
  if temperature not in (0.0, 1.0):
    logits = logits / temperature
  return transformer.token_logprobs(logits, batch.tokens)


def _shared_prefix_logprobs(params, batch: Rollout, model_config: ModelConfig, temperature: float,
                            group_size: int, prompt_len: int) -> jax.Array:
  size, length = batch.tokens.shape
  groups = size // group_size
  grouped = lambda x: x.reshape(groups, group_size, length)
  tokens, mask = grouped(batch.tokens), grouped(batch.token_mask)
  positions = grouped(transformer.positions_from_mask(batch.token_mask))
  suffix_tokens = tokens[:, :, prompt_len:]
  prefix_logits, suffix_logits = transformer.forward_shared_prefix(
      params, tokens[:, 0, :prompt_len], positions[:, 0, :prompt_len], mask[:, 0, :prompt_len],
      suffix_tokens, positions[:, :, prompt_len:], mask[:, :, prompt_len:], model_config)
  if temperature not in (0.0, 1.0):
    prefix_logits, suffix_logits = prefix_logits / temperature, suffix_logits / temperature
  prompt_logp = transformer.token_logprobs(prefix_logits, tokens[:, 0, :prompt_len])  # [N, P]
  # The first completion token is predicted by the prompt's last slot.
  first = jnp.take_along_axis(jax.nn.log_softmax(prefix_logits[:, -1], axis=-1),
                              suffix_tokens[:, :, 0], axis=-1)  # [N, G]
  rest = jnp.take_along_axis(jax.nn.log_softmax(suffix_logits[:, :, :-1], axis=-1),
                             suffix_tokens[:, :, 1:, None], axis=-1)[..., 0]  # [N, G, C - 1]
  logp = jnp.concatenate([
      jnp.broadcast_to(prompt_logp[:, None], (groups, group_size, prompt_len)),
      first[..., None], rest], axis=-1)
  return logp.reshape(size, length)


def check_shared_prefix(batch: Rollout, group_size: int, prompt_len: int,
                        num_microbatches: int = 1) -> None:
  """Raises ValueError unless `batch` fits `policy_logprobs(shared_prefix=(G, P))`.

  Rows must come in contiguous groups of G (whole groups per microbatch) with identical
  prompt tokens and masks in slots [0, P), and completions only in slots [P, T).
  """
  tokens = np.asarray(batch.tokens)
  prompt_mask, completion_mask = np.asarray(batch.prompt_mask), np.asarray(batch.completion_mask)
  size, length = tokens.shape
  if group_size < 1 or not 0 < prompt_len < length:
    raise ValueError(f"shared_prefix=(group_size={group_size}, prompt_len={prompt_len}) needs "
                     f"group_size >= 1 and 0 < prompt_len < sequence length {length}.")
  if size % (group_size * num_microbatches):
    raise ValueError(f"Batch of {size} rows does not split into whole groups of {group_size} per "
                     f"microbatch (num_microbatches={num_microbatches}); set the group size to "
                     "config.rollout.group_size or turn config.rl.prefix_shared_forward off.")
  if prompt_mask[:, prompt_len:].any() or completion_mask[:, :prompt_len].any():
    raise ValueError(f"Prompts must occupy slots [0, {prompt_len}) and completions slots "
                     f"[{prompt_len}, {length}) for the prefix-shared forward.")
  prompts = np.where(prompt_mask, tokens, -1)[:, :prompt_len].reshape(-1, group_size, prompt_len)
  if (prompts != prompts[:, :1]).any():
    raise ValueError(f"Rows of a group (contiguous blocks of {group_size}) have different prompts; "
                     "the prefix-shared forward needs groups sampled from one prompt "
                     "(rl.rollouts.batches.sample_and_score) or config.rl.prefix_shared_forward=False.")


def mismatch_terms(logp: jax.Array, batch: Rollout, version, prox_version) -> dict:
  """The sums behind `rollout_train_mismatch_kl`, for one microbatch of one update.

  The tokens counted are the fresh ones at the batch's first update: completion tokens the
  sampler drew with the very parameter version the trainer evaluates (version ==
  prox_version == the update's step). On them the log-ratio d = logp - behav is the gap
  between the sampler's numerics and the trainer's (bfloat16 against float32, a decode
  step against a full forward, top-k / top-p truncation), not staleness. Per token the k3
  estimator of KL(sampler || trainer) from the sampler's draws: exp(d) - 1 - d >= 0.
  """
  fresh = ((batch.completion_mask > 0) & (batch.version == prox_version)
           & (version == prox_version))
  d = sg(logp - batch.behavior_logp)
  k3 = jnp.where(fresh, jnp.expm1(jnp.where(fresh, d, 0.0)) - d, 0.0)
  return {"_mismatch_k3_sum": k3.sum(), "_mismatch_tokens": fresh.sum(dtype=jnp.float32)}


def with_mismatch_kl(metrics: dict) -> dict:
  """metrics with `mismatch_terms`' sums (means over microbatches and updates, so their
  ratio is the ratio of the sums) replaced by `rollout_train_mismatch_kl`, the mean k3 per
  fresh token (0 when no token is fresh, e.g. under simulated staleness)."""
  metrics = dict(metrics)
  total, tokens = metrics.pop("_mismatch_k3_sum"), metrics.pop("_mismatch_tokens")
  metrics["rollout_train_mismatch_kl"] = total / jnp.maximum(tokens, 1e-9)
  return metrics


@dataclasses.dataclass(frozen=True)
class StepObjective:
  """The loss of one microbatch as the train step differentiates it (module docstring).

  Fields:
    model_config: the policy's shapes.
    loss: the objective `loss.name` with its corrections and their settings (checked
      here; resolved by `LossSettings.resolved`).
    temperature: the sampling temperature the log-probs are taken at.
    shared_prefix: (G, P) for the prefix-shared forward, or None.
    logprob_chunk: positions per log-prob chunk (0: dense).
    residual_hook: a constraint on the residual stream (a mesh's row sharding), or None.
    distill: on-policy distillation's settings (the teacher's parameters come with each
      call), or None.
  """
  model_config: ModelConfig
  loss: losses.LossSettings
  temperature: float = 1.0
  shared_prefix: tuple[int, int] | None = None
  logprob_chunk: int = 0
  residual_hook: Callable[[jax.Array], jax.Array] | None = None
  distill: distillation.Distill | None = None

  def __post_init__(self):
    self.loss.check_runnable()

  @functools.cached_property
  def settings(self) -> losses.LossSettings:
    """The loss settings the objective runs with (`LossSettings.resolved`)."""
    return self.loss.resolved()

  @functools.cached_property
  def aggregation(self) -> str:
    """The objective's aggregation (its own fixed one, or config.loss.aggregation): the
    distillation term's too, and what microbatches are weighted by."""
    return self.settings.aggregation

  @functools.cached_property
  def prox_estimate(self) -> str | None:
    """How proximal log-probs are supplied when the objective reads them ('recompute' or
    'loglinear'), else None."""
    return self.loss.prox_estimate if self.loss.needs_prox else None

  def logprobs(self, policy, rollout: Rollout) -> jax.Array:
    """`policy_logprobs` of `rollout` with this objective's layout and temperature."""
    return policy_logprobs(policy, rollout, self.model_config, self.temperature,
                           self.residual_hook, shared_prefix=self.shared_prefix,
                           logprob_chunk=self.logprob_chunk)

  def __call__(self, policy, micro: Rollout, version, prox_version,
               teacher=None) -> tuple[jax.Array, dict]:
    """The scalar loss of `micro` under `policy` and its metrics.

    Args:
      policy: the policy's full parameters (LoRA adapters already merged).
      micro: one microbatch, with advantages.
      version: the parameter version this update trains (TrainState.step).
      prox_version: the version before the batch's first update (the proximal policy).
      teacher: the distillation teacher's parameters (with `distill`), else None.

    Returns:
      (loss, metrics): the policy objective (+ distill.coef x the distillation term), and
      the objective's, the distillation's and the mismatch sums' metrics.
    """
    terms = None if self.distill is None else self._distill_terms(policy, teacher, micro)
    logp = self.logprobs(policy, micro) if terms is None else terms["logp"]
    loss, metrics = jnp.zeros(()), mismatch_terms(logp, micro, version, prox_version)
    if self.distill is None or self.distill.with_reward:
      prox = micro.prox_logp
      if prox is None and self.prox_estimate == "loglinear":
        prox = corrections.loglinear_prox(logp, micro.behavior_logp, micro.version,
                                          prox_version, version)
      loss, objective_metrics = losses.get_loss(self.loss.name)(
          logp, micro, prox_logp=prox, settings=self.settings)
      metrics = dict(metrics, **objective_metrics)
    if terms is not None:
      mask = micro.completion_mask
      term = losses.aggregate(terms["per_token"], mask, self.aggregation,
                              self.settings.norm_len)
      loss = loss + self.distill.coef * term
      metrics = dict(metrics, distill_loss=term, **distillation.metrics_of(terms, mask))
    return loss, metrics

  def _hidden(self, params, config: ModelConfig, rollout: Rollout) -> jax.Array:
    return transformer.hidden_states(params, rollout.tokens,
                                     transformer.positions_from_mask(rollout.token_mask),
                                     rollout.token_mask, config,
                                     residual_hook=self.residual_hook)[0]

  def _next_token_dists(self, params, config: ModelConfig, rollout: Rollout) -> jax.Array:
    """log-softmax [B, T, V] of the distributions that predicted each token."""
    logits = jnp.einsum("btd,dv->btv", self._hidden(params, config, rollout),
                        transformer.output_head(params, config),
                        preferred_element_type=jnp.float32)
    if self.temperature not in (0.0, 1.0):
      logits = logits / self.temperature
    return distillation.next_token_logprobs(logits)

  def _distill_terms(self, policy, teacher, micro: Rollout) -> dict:
    """`distillation.token_terms` of the student and the frozen teacher on `micro`; with
    logprob_chunk, a chunk of positions at a time (no [B, T, V] buffer)."""
    student, teacher_config = self.model_config, self.distill.teacher_config
    if self.logprob_chunk:
      return distillation.chunked_token_terms(
          self._hidden(policy, student, micro), transformer.output_head(policy, student),
          sg(self._hidden(teacher, teacher_config, micro)),
          sg(transformer.output_head(teacher, teacher_config)),
          micro.tokens, micro.completion_mask, self.distill, self.logprob_chunk,
          self.temperature)
    return distillation.token_terms(
        self._next_token_dists(policy, student, micro),
        sg(self._next_token_dists(teacher, teacher_config, micro)),
        micro.tokens, micro.completion_mask, self.distill)
