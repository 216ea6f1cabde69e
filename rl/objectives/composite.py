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

A mixture-of-experts policy (`RouterTerms`, config.moe) adds its router's auxiliary losses
and routing metrics, and with routing replay (R3) its forward runs the experts recorded in
the batch (`Rollout.experts`) instead of its router's choice.
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
                    logprob_chunk: int = 0, replay: bool = False,
                    head_ids: jax.Array | None = None):
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
    replay: an MoE policy runs the experts of the batch's routing record
      (`Rollout.experts`, R3) instead of its router's choice.
    head_ids: [B, T, K] token ids whose log-probs at each slot are wanted too (the
      sampler's top-K record, for score centering); needs the dense log-prob path (no
      shared prefix, no logprob_chunk).

  Returns:
    [B, T] float32: log p(token_t | tokens_<t) (position 0 and padding: arbitrary); with
    head_ids, (that, [B, T, K] log p(head_ids[:, t, k] | tokens_<t)).
  """
  if shared_prefix is not None:
    if replay or head_ids is not None:
      raise ValueError("Routing replay and score centering run the full forward; turn "
                       "config.rl.prefix_shared_forward off.")
    return _shared_prefix_logprobs(params, batch, model_config, temperature, *shared_prefix)
  x, _ = transformer.hidden_states(params, batch.tokens,
                                   transformer.positions_from_mask(batch.token_mask),
                                   batch.token_mask, model_config, residual_hook=residual_hook,
                                   experts=replayed_experts(batch, replay))
  return _head_logprobs(params, x, batch.tokens, model_config, temperature, logprob_chunk,
                        head_ids)


def policy_logprobs_with_routing(params, batch: Rollout, model_config: ModelConfig,
                                 temperature: float = 1.0,
                                 residual_hook: Callable[[jax.Array], jax.Array] | None = None,
                                 *, logprob_chunk: int = 0, replay: bool = False,
                                 head_ids: jax.Array | None = None):
  """An MoE policy's `policy_logprobs` (no prefix sharing) and its forward's
  `transformer.RouterStats`."""
  x, stats = transformer.hidden_states_with_routing(
      params, batch.tokens, transformer.positions_from_mask(batch.token_mask),
      batch.token_mask, model_config, residual_hook=residual_hook,
      experts=replayed_experts(batch, replay))
  return _head_logprobs(params, x, batch.tokens, model_config, temperature,
                        logprob_chunk, head_ids), stats


def replayed_experts(batch: Rollout, replay: bool) -> jax.Array | None:
  """The batch's routing record when `replay`, else None; a batch without one is refused."""
  if not replay:
    return None
  if batch.experts is None:
    raise ValueError("config.moe.routing_replay needs the sampler's routing record "
                     "(Rollout.experts): the batch has none (a dense policy, or rows no "
                     "sampler wrote).")
  return batch.experts


def _head_logprobs(params, x, tokens, model_config: ModelConfig, temperature: float,
                   logprob_chunk: int, head_ids: jax.Array | None = None):
  """Token log-probs [B, T] from the final-normed residual stream x [B, T, D]; with
  `head_ids` [B, T, K] also theirs (`policy_logprobs`)."""
  head = transformer.output_head(params, model_config)
  if logprob_chunk:
    if head_ids is not None:
      raise ValueError("Score centering reads the log-probs of the sampler's top-K tokens "
                       "from the dense log-softmax; set config.rl.logprob_chunk=0.")
    return transformer.chunked_token_logprobs(x, head, tokens, logprob_chunk, temperature)
  logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
  if temperature not in (0.0, 1.0):
    logits = logits / temperature
  logp = transformer.token_logprobs(logits, tokens)
  if head_ids is None:
    return logp
  # Slot t's head was recorded from the distribution of slot t - 1 (`rl.rollouts.sampler_topk`).
  dists = jax.nn.log_softmax(jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1), axis=-1)
  return logp, jnp.take_along_axis(dists, head_ids, axis=-1)


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
  """The sums behind the sampler-trainer mismatch metrics, for one microbatch of one update.

  The tokens counted are the fresh ones at the batch's first update: completion tokens the
  sampler drew with the very parameter version the trainer evaluates (version ==
  prox_version == the update's step). On them the log-ratio d = logp - behav is the gap
  between the sampler's numerics and the trainer's (quantised or bfloat16 sampler weights
  against float32, a decode step against a full forward, top-k / top-p truncation), not
  staleness. Per token, from the sampler's draws: the k3 estimator of KL(sampler ||
  trainer), exp(d) - 1 - d >= 0 (`rollout_train_mismatch_kl`); the k1 estimator -d
  (unbiased, but of either sign per token); whether |d| exceeds 0.1 and 1.0; and the
  largest |d| (`rollout_train_log_ratio_max`, 0 without fresh tokens).
  """
  fresh = ((batch.completion_mask > 0) & (batch.version == prox_version)
           & (version == prox_version))
  d = jnp.where(fresh, sg(logp - batch.behavior_logp), 0.0)
  k3 = jnp.where(fresh, jnp.expm1(d) - d, 0.0)
  return {"_mismatch_k3_sum": k3.sum(), "_mismatch_k1_sum": -d.sum(),
          "_mismatch_over_0p1": jnp.sum(jnp.abs(d) > 0.1, dtype=jnp.float32),
          "_mismatch_over_1": jnp.sum(jnp.abs(d) > 1.0, dtype=jnp.float32),
          "rollout_train_log_ratio_max": jnp.max(jnp.abs(d)),
          "_mismatch_tokens": fresh.sum(dtype=jnp.float32)}


# Metrics reported as a ratio of two sums (numerator, denominator): the step's metrics are
# means over microbatches and updates, so the ratio of the means is the ratio of the sums.
_RATIOS = {
    "rollout_train_mismatch_kl": ("_mismatch_k3_sum", "_mismatch_tokens"),
    "rollout_train_mismatch_k1": ("_mismatch_k1_sum", "_mismatch_tokens"),
    "rollout_train_log_ratio_over_0p1": ("_mismatch_over_0p1", "_mismatch_tokens"),
    "rollout_train_log_ratio_over_1": ("_mismatch_over_1", "_mismatch_tokens"),
    "behavior_train_kl": ("_behavior_k3_sum", "_behavior_tokens"),
    "moe_unreplayed_kl": ("_unreplayed_k3_sum", "_behavior_tokens"),
    "moe_routing_mismatch": ("_routing_differs", "_routing_slots"),
}
# Metrics reduced over microbatches and updates by their maximum, not their mean.
MAXIMA = frozenset({"rollout_train_log_ratio_max"})


def reduce_metrics(metrics: dict) -> dict:
  """Metrics stacked over microbatches or updates, reduced: `MAXIMA` by their maximum,
  every other by its mean."""
  return {name: (jnp.max if name in MAXIMA else jnp.mean)(value)
          for name, value in metrics.items()}


def with_mismatch_kl(metrics: dict) -> dict:
  """metrics with the sums of `mismatch_terms` and `RouterTerms.metrics` replaced by their
  ratios (`_RATIOS`): `rollout_train_mismatch_kl`, the mean k3 per fresh token (0 when no
  token is fresh, e.g. under simulated staleness), the mean k1 and the fractions of fresh
  tokens with |d| > 0.1 and > 1.0, and an MoE policy's
  `behavior_train_kl`, `moe_unreplayed_kl` and `moe_routing_mismatch`."""
  metrics = dict(metrics)
  for name, (numerator, denominator) in _RATIOS.items():
    if numerator in metrics:
      total = metrics.pop(numerator)
      metrics[name] = total / jnp.maximum(metrics[denominator], 1e-9)
  for _, denominator in _RATIOS.values():
    metrics.pop(denominator, None)
  return metrics


def k3(logp: jax.Array, behavior_logp: jax.Array, mask: jax.Array) -> jax.Array:
  """The k3 estimator of KL(sampler || trainer) per token, exp(d) - 1 - d with
  d = logp - behavior_logp (0 outside `mask`)."""
  d = sg(jnp.where(mask, logp - behavior_logp, 0.0))
  return jnp.where(mask, jnp.expm1(d) - d, 0.0)


@dataclasses.dataclass(frozen=True)
class RouterTerms:
  """What a mixture-of-experts policy adds to the objective (config.moe).

  Fields:
    routing_replay: R3 (arXiv 2510.11370): the forward runs the batch's recorded experts
      (`Rollout.experts`), weighted by the trainer's router renormalised over them
      (`models.moe.replay_weights`).
    load_balancing_coef, router_z_coef: weights of the auxiliary losses (each the mean
      over layers of `transformer.RouterStats`' per-layer value) added to the objective.
  """
  routing_replay: bool = False
  load_balancing_coef: float = 0.0
  router_z_coef: float = 0.0

  @classmethod
  def from_settings(cls, moe, model_config: ModelConfig, rl_phase: bool,
                    source: str) -> "RouterTerms | None":
    """config.moe (`rl.settings.moe.MoeSettings`) as the RL train step reads it: None for a
    dense policy, which refuses an active config.moe (`source` names the preset or
    checkpoint), and for the warm start (teacher-forced rows: no routing record, and no
    router losses in supervised training)."""
    if not model_config.is_moe:
      if moe.active:
        raise ValueError(f"config.moe = {moe} needs a mixture-of-experts policy; {source} "
                         "is dense (use preset 'tiny2_moe' or a Qwen3-MoE / Mixtral "
                         "checkpoint).")
      return None
    if not rl_phase:
      return None
    return cls(routing_replay=moe.routing_replay, load_balancing_coef=moe.load_balancing_coef,
               router_z_coef=moe.router_z_coef)

  def loss(self, stats: transformer.RouterStats) -> jax.Array:
    """The auxiliary losses' weighted sum."""
    return (self.load_balancing_coef * stats.load_balancing.mean()
            + self.router_z_coef * stats.z_loss.mean())

  @staticmethod
  def metrics(stats: transformer.RouterStats, micro: Rollout, first_update: jax.Array,
              num_experts: int) -> dict:
    """Routing metrics of one microbatch (docs/metrics.md): the auxiliary losses,
    `moe_expert_load_max_l{i}` (layer i's busiest expert's share of the routed
    (token, choice) pairs times the expert count: 1 when balanced, num_experts when one
    expert takes all), and at the batch's first update the sums behind
    `moe_routing_mismatch`: token-layers whose recorded expert set differs from the set
    the trainer's router picks (none without a record), over the real tokens followed by a
    real token. A row's last token is left out: its routing reaches no log-prob (nothing
    follows it), and speculative decoding never runs a final token it stopped on, so that
    token has no record."""
    mask = micro.token_mask
    chosen = jax.nn.one_hot(stats.experts, num_experts, dtype=jnp.float32).sum(axis=3)
    counts = (chosen * mask[..., None, None]).sum(axis=(0, 1))  # [L, X]
    share = counts / jnp.maximum(counts.sum(axis=1, keepdims=True), 1.0)
    out = {"moe_load_balancing": stats.load_balancing.mean(),
           "moe_router_z": stats.z_loss.mean(),
           **{f"moe_expert_load_max_l{i}": num_experts * share[i].max()
              for i in range(share.shape[0])}}
    if micro.experts is not None:
      recorded = jnp.sort(micro.experts.astype(jnp.int32), axis=-1)
      differs = jnp.any(recorded != jnp.sort(stats.experts, axis=-1), axis=-1)  # [B, T, L]
      predicting = mask & jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
      slots = predicting[..., None] & first_update
      out["_routing_differs"] = jnp.sum(differs & slots, dtype=jnp.float32)
      out["_routing_slots"] = jnp.sum(jnp.broadcast_to(slots, differs.shape),
                                      dtype=jnp.float32)
    return out


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
    router: a mixture-of-experts policy's `RouterTerms` (None: the defaults); a dense
      policy takes none.
  """
  model_config: ModelConfig
  loss: losses.LossSettings
  temperature: float = 1.0
  shared_prefix: tuple[int, int] | None = None
  logprob_chunk: int = 0
  residual_hook: Callable[[jax.Array], jax.Array] | None = None
  distill: distillation.Distill | None = None
  router: RouterTerms | None = None

  def __post_init__(self):
    losses.check_runnable(self.loss)
    if self.router is not None and not self.model_config.is_moe:
      raise ValueError("RouterTerms (config.moe) need a mixture-of-experts policy; this "
                       "model's MLPs are dense (ModelConfig.num_experts = 0).")
    if self.router not in (None, RouterTerms()) and (self.distill or self.shared_prefix):
      raise ValueError("config.moe (routing replay, router losses) runs in the full "
                       "forward; config.distill and config.rl.prefix_shared_forward use "
                       "their own: turn one off.")
    if self.reads_sampler_topk and (self.distill or self.shared_prefix or self.logprob_chunk):
      raise ValueError("Score centering (config.loss.corrections) reads the trainer's "
                       "log-probs of the sampler's top-K tokens from the full forward's "
                       "dense log-softmax; turn off config.distill, config.rl."
                       "prefix_shared_forward and config.rl.logprob_chunk.")

  @property
  def reads_sampler_topk(self) -> bool:
    """Whether a correction reads the sampler's top-K record (`Rollout.behavior_topk`)."""
    return losses.reads_sampler_topk(self.loss)

  @property
  def replay(self) -> bool:
    """Whether the forward replays the batch's recorded experts (R3)."""
    return self.router is not None and self.router.routing_replay

  @functools.cached_property
  def settings(self) -> losses.LossSettings:
    """The loss settings the objective runs with (`LossSettings.resolved`)."""
    return losses.resolve(self.loss)

  @functools.cached_property
  def objective(self):
    """config.loss.name's objective bound to `settings` once (`losses.build`)."""
    return losses.build(self.settings)

  @functools.cached_property
  def aggregation(self) -> str:
    """The objective's aggregation (its own fixed one, or config.loss.aggregation): the
    distillation term's too, and what microbatches are weighted by."""
    return self.settings.aggregation

  @functools.cached_property
  def prox_estimate(self) -> str | None:
    """How proximal log-probs are supplied when the objective reads them ('recompute' or
    'loglinear'), else None."""
    return self.loss.prox_estimate if losses.needs_prox(self.loss) else None

  def logprobs(self, policy, rollout: Rollout) -> jax.Array:
    """`policy_logprobs` of `rollout` with this objective's layout and temperature."""
    return policy_logprobs(policy, rollout, self.model_config, self.temperature,
                           self.residual_hook, shared_prefix=self.shared_prefix,
                           logprob_chunk=self.logprob_chunk, replay=self.replay)

  def _routed_terms(self, policy, micro: Rollout, version, prox_version, head_ids=None):
    """An MoE policy's log-probs (with head_ids: and theirs, `policy_logprobs`), auxiliary
    loss and routing metrics: `behavior_train_kl`'s
    sums over every completion token at the batch's first update (staleness and numerics
    together) and, under replay, the same KL for the router's own choice (one more
    forward, at the first update only: `moe_unreplayed_kl`)."""
    router = self.router or RouterTerms()
    logp, stats = policy_logprobs_with_routing(
        policy, micro, self.model_config, self.temperature, self.residual_hook,
        logprob_chunk=self.logprob_chunk, replay=self.replay, head_ids=head_ids)
    if head_ids is not None:
      logp, head_logp = logp
    first = version == prox_version
    completion = (micro.completion_mask > 0) & (micro.version >= 0) & first
    metrics = dict(router.metrics(stats, micro, first, self.model_config.num_experts),
                   _behavior_k3_sum=k3(logp, micro.behavior_logp, completion).sum(),
                   _behavior_tokens=completion.sum(dtype=jnp.float32))
    if self.replay:
      unreplayed = lambda: k3(sg(policy_logprobs(
          policy, micro, self.model_config, self.temperature, self.residual_hook,
          logprob_chunk=self.logprob_chunk)), micro.behavior_logp, completion).sum()
      metrics["_unreplayed_k3_sum"] = jax.lax.cond(first, unreplayed, lambda: jnp.zeros(()))
    if head_ids is not None:
      logp = (logp, head_logp)
    return logp, router.loss(stats), metrics

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
    loss, routed, head_logp = jnp.zeros(()), {}, None
    head_ids = self._sampler_head(micro)
    if terms is not None:
      logp = terms["logp"]
    elif self.model_config.is_moe and self.shared_prefix is None:
      logp, loss, routed = self._routed_terms(policy, micro, version, prox_version, head_ids)
    elif head_ids is not None:
      logp = policy_logprobs(policy, micro, self.model_config, self.temperature,
                             self.residual_hook, replay=self.replay, head_ids=head_ids)
    else:
      logp = self.logprobs(policy, micro)
    if head_ids is not None:
      logp, head_logp = logp
    metrics = dict(mismatch_terms(logp, micro, version, prox_version), **routed)
    if self.distill is None or self.distill.with_reward:
      prox = micro.prox_logp
      if prox is None and self.prox_estimate == "loglinear":
        prox = corrections.loglinear_prox(logp, micro.behavior_logp, micro.version,
                                          prox_version, version)
      extra = {} if head_logp is None else {"head_logp": head_logp}
      objective, objective_metrics = self.objective(logp, micro, prox_logp=prox, **extra)
      loss, metrics = loss + objective, dict(metrics, **objective_metrics)
    if terms is not None:
      mask = micro.completion_mask
      term = losses.aggregate(terms["per_token"], mask, self.aggregation,
                              self.settings.norm_len)
      loss = loss + self.distill.coef * term
      metrics = dict(metrics, distill_loss=term, **distillation.metrics_of(terms, mask))
    return loss, metrics

  def _sampler_head(self, micro: Rollout) -> jax.Array | None:
    """The token ids of the sampler's top-K record when a correction reads it, else None;
    a batch without the record is refused."""
    if not self.reads_sampler_topk:
      return None
    if micro.behavior_topk is None:
      raise ValueError("Score centering needs the sampler's top-K record "
                       "(Rollout.behavior_topk); the loop records it after sampling "
                       "(rl.rollouts.sampler_topk.record_stage, a batch stage the launcher "
                       "wires).")
    return micro.behavior_topk.ids

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
