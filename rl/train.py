"""The train step: one jitted pure function `(TrainState, Rollout) -> (TrainState, metrics)`.

It is the only place parameters change. Gradients are accumulated over microbatches
under `lax.scan`; a non-finite loss or gradient skips the update and is counted, never
applied; an objective's `metrics['lr_scale']` (VCPO) scales the update.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models import lora as lora_lib
from models import transformer
from models.config import ModelConfig
from rl.objectives import corrections
from rl.objectives import distillation
from rl.objectives import losses
from rl.types import Rollout
from sharding import multihost
from sharding import rules as sharding_rules


@flax.struct.dataclass
class TrainState:
  """step: updates applied; params: the trained parameters; opt_state; nonfinite_updates:
  updates skipped.

  With LoRA (Hu et al. 2021; models/lora.py) `params` holds only the adapters, `frozen` the
  base weights they adapt (no gradient, no optimiser state) and `lora_scale` alpha / r;
  `policy_params()` is the policy either way. Without LoRA, frozen is None.
  """
  step: jax.Array
  params: Any
  opt_state: Any
  nonfinite_updates: jax.Array
  frozen: Any = None
  lora_scale: float = flax.struct.field(pytree_node=False, default=0.0)

  def policy_params(self, params=None):
    """The policy's full parameters: `params` (default self.params) merged into the frozen
    base under LoRA, else `params` itself."""
    params = self.params if params is None else params
    return params if self.frozen is None else lora_lib.merge(self.frozen, params,
                                                             self.lora_scale)


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, decay_steps: int = 0,
                   end_lr_fraction: float = 1.0, weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.999, max_grad_norm: float = 1.0) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and the `learning_rate_schedule` of the same arguments.

  A decaying rate keeps the supervised warm start from swinging between checkpoints
  (docs/benchmarks.md).
  """
  schedule = learning_rate_schedule(learning_rate, warmup_steps=warmup_steps,
                                    decay_steps=decay_steps, end_lr_fraction=end_lr_fraction)
  return optax.chain(
      optax.clip_by_global_norm(max_grad_norm) if max_grad_norm else optax.identity(),
      optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay))


def learning_rate_schedule(learning_rate: float, *, warmup_steps: int = 0, decay_steps: int = 0,
                           end_lr_fraction: float = 1.0) -> optax.Schedule:
  """The optax schedule of `make_optimizer`: the rate rises linearly over `warmup_steps`,
  then decays linearly to `end_lr_fraction * learning_rate` over `decay_steps` (0:
  constant). Pass it to `make_train_step` to log the rate each update applies."""
  return optax.join_schedules(
      [optax.linear_schedule(0.0 if warmup_steps else learning_rate, learning_rate,
                             max(warmup_steps, 1)),
       optax.linear_schedule(learning_rate, learning_rate * end_lr_fraction,
                             max(decay_steps, 1))],
      boundaries=[warmup_steps])


def init_train_state(params, optimizer: optax.GradientTransformation, *,
                     lora: lora_lib.LoraConfig | None = None,
                     model_config: ModelConfig | None = None,
                     lora_rng: jax.Array | None = None) -> TrainState:
  """A fresh TrainState training `params`; with `lora` (which needs `model_config` and
  `lora_rng`) `params` become the frozen base and only new adapters are trained."""
  frozen, scale = None, 0.0
  if lora is not None:
    if model_config is None or lora_rng is None:
      raise ValueError("init_train_state(lora=...) needs model_config and lora_rng.")
    frozen, scale = params, lora.scale
    params = lora_lib.init_adapters(model_config, lora, lora_rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params),
                    nonfinite_updates=jnp.zeros((), jnp.int32), frozen=frozen, lora_scale=scale)


def policy_logprobs(params, batch: Rollout, model_config: ModelConfig,
                    temperature: float = 1.0,
                    residual_hook: Callable[[jax.Array], jax.Array] | None = None, *,
                    shared_prefix: tuple[int, int] | None = None,
                    logprob_chunk: int = 0) -> jax.Array:
  """log-probs [B, T] of the batch's tokens at the sampling temperature.

  logprob_chunk = C > 0 computes them C positions at a time
  (`transformer.chunked_token_logprobs`): the [B, T, V] logits never exist, in the forward
  or the backward; the values and gradients are the dense path's (up to float rounding).

  `residual_hook` goes to `transformer.forward` (e.g. an activation sharding constraint).
  shared_prefix=(group_size G, prompt_len P): rows come in contiguous groups of G that
  share their first P slots (a GRPO group's prompt); the prompt is run once per group
  (`transformer.forward_shared_prefix`), which equals the replicated forward at every
  column whose predicting slot holds a real token (`check_shared_prefix` validates a batch).
  The prefix-shared forward takes no residual hook: on a mesh its activations follow
  GSPMD's propagation.
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
  d = jax.lax.stop_gradient(logp - batch.behavior_logp)
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


def _split_rows(batch: Rollout, parts: int) -> Rollout:
  """Reshapes every [B, ...] leaf to [parts, B / parts, ...] (contiguous row blocks)."""
  size = batch.tokens.shape[0]
  if size % parts:
    raise ValueError(f"Batch of {size} sequences does not split into {parts} equal parts "
                     "(config.rl.num_minibatches x config.rl.num_microbatches); make their "
                     "product a divisor of the batch size.")
  return jax.tree.map(lambda x: x.reshape(parts, size // parts, *x.shape[1:]), batch)


def make_train_step(model_config: ModelConfig, optimizer: optax.GradientTransformation,
                    loss_config, *, num_microbatches: int = 1, num_minibatches: int = 1,
                    ppo_epochs: int = 1, temperature: float = 1.0,
                    shared_prefix: tuple[int, int] | None = None,
                    mesh: jax.sharding.Mesh | None = None,
                    rules: sharding_rules.Rules = sharding_rules.TRAINER_RULES,
                    length_buckets: Sequence[int] = (),
                    learning_rate: optax.Schedule | None = None,
                    lora: lora_lib.LoraConfig | None = None,
                    distill: distillation.Distill | None = None, teacher_params=None,
                    logprob_chunk: int = 0,
                    ) -> Callable[[TrainState, Rollout], tuple[TrainState, dict]]:
  """Builds the jitted train step for the objective `loss_config.name`.

  One call is one rollout batch. The batch is split into `num_minibatches` contiguous
  minibatches, and the step takes `ppo_epochs * num_minibatches` optimiser updates, in
  order, minibatch after minibatch, epoch after epoch (PPO's / GRPO's inner iterations,
  the "mu" of the GRPO paper; a fixed order, no shuffling, so the step stays a pure
  function of its inputs). With the defaults (1, 1) the step is one full-batch update.
  Every update counts as one `TrainState.step`, so parameter versions (and staleness)
  are counted in optimiser updates. Each update skips itself if non-finite.

  Within an update, each microbatch's gradient and loss are weighted by its share of the
  minibatch's aggregation denominator (`losses.aggregation_denominator`: valid tokens for
  token_mean, non-empty sequences for seq_mean_token_mean, rows for the constant
  normaliser), so the accumulated gradient equals the whole minibatch's for every
  aggregation; other metrics are averaged. Batch-level statistics inside an objective
  (quantiles, M2 masks, ESS) are per microbatch. Returned metrics are means over
  the updates (`update_skipped`: the fraction skipped). shared_prefix=(group_size,
  prompt_len) runs each group's prompt once in the loss forward/backward
  (`policy_logprobs`); the returned step then checks every batch on the host first
  (`check_shared_prefix`).

  When the objective reads proximal log-probs (decoupled PPO, TIS / MIS) and the batch
  carries none, the step supplies them (config.loss.prox_estimate): 'recompute' runs one
  forward over the batch with the parameters from before the batch's first update (the
  proximal policy pi_prox of decoupled PPO, which later updates of the same batch clip
  against); 'loglinear' interpolates between behav and the current log-probs
  (`rl.objectives.corrections.loglinear_prox`) at that same version, with no forward. With one
  update per batch the proximal policy is the current one: both estimates equal
  sg(logp) on stale tokens and behav on fresh ones.

  Without `mesh` the step runs on the default device. With a mesh the same step is jitted
  with `in_shardings` / `out_shardings`: the TrainState (parameters, and the optimiser
  state that mirrors them) laid out by `rules` (default: FSDP + tensor parallel), the batch
  split by rows over data x fsdp (its size must be a multiple of data x fsdp), metrics
  replicated; see `train_state_shardings`. In a multi-process run a host-built batch is
  placed row-wise (`sharding.multihost.place_rows`). The residual stream is also
  constrained to rows over data x fsdp: otherwise XLA may keep the FSDP-split weights in
  place and gather the activations instead, moving activations rather than weights and
  doing each matmul on twice the rows per device.

  length_buckets (sequence lengths, e.g. (28, 44, 76)): each batch is first cut to the
  smallest bucket that holds its last prompt or completion token (`trim_to_bucket`), so a
  batch of short sequences does not pay for the longest allowed one; the step compiles
  once per bucket used. The cut slots are masked everywhere, so the results are the same.
  Single-process runs only (a multi-process batch is a global array; it is not cut).

  learning_rate: the optimiser's schedule (`learning_rate_schedule` with the arguments
  given to `make_optimizer`); when set, the metrics include `learning_rate`, the rate each
  update applied (the schedule at the update's step, which is the optimiser's count, times
  the objective's lr_scale; 0 for a skipped update), averaged over the updates.

  LoRA (a TrainState from `init_train_state(..., lora=...)`): the step differentiates the
  loss of the merged policy with respect to the adapters only, so the optimiser state and
  updates cover the adapters and the frozen base passes through unchanged. The step reads
  LoRA from the state; `lora` is needed only with a mesh, to lay out that state (the
  frozen base like the parameters it replaces, the adapters and their moments replicated).

  On-policy distillation (`distill`, rl/objectives/distillation.py): the frozen teacher
  (`teacher_params`, of `distill.teacher_config`) runs on every microbatch's tokens inside
  the step, at the sampling temperature like the student, and the loss becomes the policy
  objective + distill.coef * the distillation term (aggregated like the objective), or
  the distillation term alone with distill.with_reward = False. Its metrics: the
  per-token reverse KL to the teacher and the mean and variance of its sampled estimators.
  The teacher's parameters are an argument of the jitted step, laid out by `rules` on a
  mesh like the policy's. The student's and the teacher's [B, T, V] log-softmax are
  materialised per microbatch (num_microbatches bounds them), or with logprob_chunk only
  [B, C, V] of them at a time (`distillation.chunked_token_terms`).

  Every step reports `rollout_train_mismatch_kl` (`mismatch_terms`): the sampler-trainer
  numerics gap on the batch's fresh tokens, e.g. under mixed precision
  (model_config.compute_dtype = 'bfloat16' over float32 parameters, where the gradients,
  the accumulator and the optimiser state stay in the parameters' dtype).

  logprob_chunk = C > 0: the policy's log-probs (loss forward, proximal recompute and the
  distillation term) are computed C positions at a time, so no [B, T, V] logits buffer is
  kept for the backward (`policy_logprobs`); the model's `remat` policy decides which layer
  activations are.
  """
  if num_minibatches < 1 or ppo_epochs < 1:
    raise ValueError(f"num_minibatches = {num_minibatches} and ppo_epochs = {ppo_epochs} must "
                     "be >= 1 (config.rl.num_minibatches, config.rl.ppo_epochs).")
  losses.check_config(loss_config)
  loss_fn = losses.get_loss(loss_config.name)
  aggregation = losses.effective_aggregation(loss_config)
  prox_estimate = (losses.resolve_config(loss_config).prox_estimate
                   if losses.needs_prox(loss_config) else None)
  rows = None if mesh is None else sharding_rules.batch_sharding(mesh)
  residual_hook = None if mesh is None else (
      lambda x: jax.lax.with_sharding_constraint(x, rows))
  num_updates = num_minibatches * ppo_epochs

  def logprobs(policy, rollout: Rollout) -> jax.Array:
    return policy_logprobs(policy, rollout, model_config, temperature, residual_hook,
                           shared_prefix=shared_prefix, logprob_chunk=logprob_chunk)

  def hidden(policy, config: ModelConfig, rollout: Rollout) -> jax.Array:
    return transformer.hidden_states(policy, rollout.tokens,
                                     transformer.positions_from_mask(rollout.token_mask),
                                     rollout.token_mask, config, residual_hook=residual_hook)[0]

  def next_token_dists(policy, config: ModelConfig, rollout: Rollout) -> jax.Array:
    """log-softmax [B, T, V] of the distributions that predicted each token."""
    logits = jnp.einsum("btd,dv->btv", hidden(policy, config, rollout),
                        transformer.output_head(policy, config),
                        preferred_element_type=jnp.float32)
    if temperature not in (0.0, 1.0):
      logits = logits / temperature
    return distillation.next_token_logprobs(logits)

  def distill_terms(policy, teacher, micro: Rollout) -> dict:
    """`distillation.token_terms` of the student and the frozen teacher on `micro`; with
    logprob_chunk, a chunk of positions at a time (no [B, T, V] buffer)."""
    sg = jax.lax.stop_gradient
    if logprob_chunk:
      return distillation.chunked_token_terms(
          hidden(policy, model_config, micro), transformer.output_head(policy, model_config),
          sg(hidden(teacher, distill.teacher_config, micro)),
          sg(transformer.output_head(teacher, distill.teacher_config)),
          micro.tokens, micro.completion_mask, distill, logprob_chunk, temperature)
    return distillation.token_terms(
        next_token_dists(policy, model_config, micro),
        sg(next_token_dists(teacher, distill.teacher_config, micro)),
        micro.tokens, micro.completion_mask, distill)

  def objective(params, state: TrainState, micro: Rollout, version, prox_version, teacher):
    # Under LoRA the adapters are merged inside the differentiated function, so gradients
    # reach A and B only; the frozen base is a constant here.
    policy = state.policy_params(params)
    terms = None if distill is None else distill_terms(policy, teacher, micro)
    logp = logprobs(policy, micro) if terms is None else terms["logp"]
    loss, metrics = jnp.zeros(()), mismatch_terms(logp, micro, version, prox_version)
    if distill is None or distill.with_reward:
      prox = micro.prox_logp
      if prox is None and prox_estimate == "loglinear":
        prox = corrections.loglinear_prox(logp, micro.behavior_logp, micro.version,
                                          prox_version, version)
      loss, objective_metrics = loss_fn(logp, micro, prox_logp=prox, config=loss_config)
      metrics = dict(metrics, **objective_metrics)
    if terms is not None:
      mask = micro.completion_mask
      term = losses.aggregate(terms["per_token"], mask, aggregation, resolved_norm_len)
      loss = loss + distill.coef * term
      metrics = dict(metrics, distill_loss=term, **distillation.metrics_of(terms, mask))
    return loss, metrics

  grad_fn = jax.value_and_grad(objective, has_aux=True)
  resolved_norm_len = losses.resolve_config(loss_config).norm_len

  def recompute_prox(policy, batch: Rollout) -> Rollout:
    """The batch with prox_logp = log-probs under `policy`, one microbatch at a time."""
    pieces = _split_rows(batch, num_minibatches * num_microbatches)
    prox = jax.lax.map(lambda piece: logprobs(policy, piece), pieces)
    return batch.replace(prox_logp=jax.lax.stop_gradient(prox.reshape(batch.tokens.shape)))

  def update(state: TrainState, minibatch: Rollout, prox_version,
             teacher) -> tuple[TrainState, dict]:
    """One optimiser update on `minibatch` (gradients accumulated over microbatches)."""
    micro = _split_rows(minibatch, num_microbatches)
    denominators = jax.vmap(
        lambda m: losses.aggregation_denominator(m.completion_mask, aggregation))(micro)
    shares = denominators / jnp.maximum(denominators.sum(), 1.0)  # [num_microbatches]

    def accumulate(grads, one_and_share):
      one, share = one_and_share
      (loss, metrics), g = grad_fn(state.params, state, one, state.step, prox_version, teacher)
      grads = jax.tree.map(lambda a, b: a + (b * share).astype(a.dtype), grads, g)
      return grads, (loss * share, metrics)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (loss, metrics) = jax.lax.scan(accumulate, zeros, (micro, shares))
    loss = loss.sum()
    metrics = jax.tree.map(jnp.mean, metrics)
    lr_scale = metrics.get("lr_scale", jnp.ones(()))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(lr_scale)

    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u: u * lr_scale, updates)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(
        step=state.step + finite.astype(jnp.int32),
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        nonfinite_updates=state.nonfinite_updates + (~finite).astype(jnp.int32))
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, lr_scale=lr_scale,
                   update_skipped=(~finite).astype(jnp.float32))
    if learning_rate is not None:
      metrics["learning_rate"] = jnp.where(finite, learning_rate(state.step) * lr_scale, 0.0)
    return new_state, metrics

  def step(state: TrainState, batch: Rollout, teacher) -> tuple[TrainState, dict]:
    if batch.advantages is None:  # checked when traced: a batch without them has no leaf
      raise ValueError("The batch has no advantages (Rollout.advantages is None): the loop "
                       "computes them on the final batch (rl.loop.with_advantages) before "
                       "the train step.")
    prox_version = state.step  # the version before this batch's first update
    if batch.prox_logp is None and prox_estimate == "recompute":
      batch = recompute_prox(state.policy_params(), batch)
    minibatches = _split_rows(batch, num_minibatches)

    def one_update(state, index):
      minibatch = jax.tree.map(lambda x: x[index % num_minibatches], minibatches)
      return update(state, minibatch, prox_version, teacher)

    state, metrics = jax.lax.scan(one_update, state, jnp.arange(num_updates))
    return state, with_mismatch_kl(jax.tree.map(jnp.mean, metrics))

  if (distill is None) != (teacher_params is None):
    raise ValueError("make_train_step: distill and teacher_params go together.")
  if mesh is None:
    with_teacher = jax.jit(step, donate_argnums=0)
  else:
    state_shardings = train_state_shardings(model_config, optimizer, mesh, rules, lora=lora)
    teacher_shardings = (None if teacher_params is None else
                         sharding_rules.tree_shardings(teacher_params, mesh, rules))
    if teacher_params is not None:
      teacher_params = jax.device_put(teacher_params, teacher_shardings)
    sharded_step = jax.jit(
        step, donate_argnums=0, in_shardings=(state_shardings, rows, teacher_shardings),
        out_shardings=(state_shardings, sharding_rules.replicated(mesh)))
    # Several processes: a host-built batch becomes a global array, each process giving
    # only its rows (batches already global pass through).
    with_teacher = sharded_step if jax.process_count() == 1 else (
        lambda state, batch, teacher: sharded_step(state, multihost.place_rows(batch, rows),
                                                   teacher))
  jitted = lambda state, batch: with_teacher(state, batch, teacher_params)
  if hasattr(with_teacher, "lower"):  # for memory analysis (experiments/memory.py)
    jitted.lower = lambda state, batch: with_teacher.lower(state, batch, teacher_params)
  if length_buckets and jax.process_count() == 1:
    unbucketed = jitted
    jitted = lambda state, batch: unbucketed(state, trim_to_bucket(batch, length_buckets))
  if shared_prefix is None:
    return jitted

  def checked_step(state: TrainState, batch: Rollout) -> tuple[TrainState, dict]:
    check_shared_prefix(batch, *shared_prefix,
                        num_microbatches=num_minibatches * num_microbatches)
    return jitted(state, batch)

  return checked_step


def trim_to_bucket(batch: Rollout, buckets: Sequence[int]) -> Rollout:
  """`batch` with its [B, T] fields cut to T' slots: the smallest bucket >= the last slot
  any row uses (prompt or completion), or T when no bucket is that large or none is
  smaller than T. Slots past every row's last token are masked out of every loss term and,
  under causal attention, change no earlier log-prob, so the step's results are the same.
  """
  length = batch.tokens.shape[1]
  used = np.asarray(jax.device_get(batch.token_mask)).any(axis=0)
  last = int(np.flatnonzero(used)[-1]) + 1 if used.any() else 1
  cut = min([b for b in buckets if last <= b < length], default=length)
  if cut == length:
    return batch
  return jax.tree.map(lambda x: x[:, :cut] if x.ndim == 2 else x, batch)


def train_state_shardings(model_config: ModelConfig, optimizer: optax.GradientTransformation,
                          mesh: jax.sharding.Mesh,
                          rules: sharding_rules.Rules = sharding_rules.TRAINER_RULES, *,
                          lora: lora_lib.LoraConfig | None = None) -> TrainState:
  """NamedShardings of a TrainState of this model and optimiser (computed from shapes).

  Under LoRA the frozen base (`frozen/layers/q`, ...) matches the parameters' rules; the
  adapters (`params/layers/q/a`, ...) fall to the catch-all and are replicated.
  """
  abstract = jax.eval_shape(
      lambda: init_train_state(transformer.init_params(model_config, jax.random.PRNGKey(0)),
                               optimizer, lora=lora, model_config=model_config,
                               lora_rng=jax.random.PRNGKey(0)))
  return sharding_rules.tree_shardings(abstract, mesh, rules)


def shard_train_state(state: TrainState, model_config: ModelConfig,
                      optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                      rules: sharding_rules.Rules = sharding_rules.TRAINER_RULES, *,
                      lora: lora_lib.LoraConfig | None = None) -> TrainState:
  """`state` (host or single-device values) moved to its sharded layout on `mesh`; each
  device keeps only its shards. The result may share buffers with `state` (jax.device_put
  reuses a buffer already on the right device), and the train step donates its input, so
  do not use `state` afterwards. Multi-process runs build the state inside a jit with
  `out_shardings=train_state_shardings(...)` instead, so no process holds all of it."""
  return jax.device_put(state, train_state_shardings(model_config, optimizer, mesh, rules,
                                                     lora=lora))
