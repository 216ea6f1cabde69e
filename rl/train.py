"""The train step: one jitted pure function `(TrainState, Rollout) -> (TrainState, metrics)`.

It is the only place parameters change. What it differentiates, the loss of a microbatch
(log-probs, the policy objective with its corrections, distillation), is
`rl.objectives.composite.StepObjective`; this module is the update mechanics around it.

One call of `make_train_step`'s step is one rollout batch. The batch is split into
`num_minibatches` contiguous minibatches, and the step takes `ppo_epochs *
num_minibatches` optimiser updates, in order, minibatch after minibatch, epoch after epoch
(PPO's / GRPO's inner iterations, the "mu" of the GRPO paper; a fixed order, no shuffling,
so the step stays a pure function of its inputs). Every update counts as one
`TrainState.step`, so parameter versions (and staleness) are counted in optimiser updates.
Gradients are accumulated over `num_microbatches` under `lax.scan`, each weighted by its
share of the minibatch's aggregation denominator, so the accumulated gradient equals the
whole minibatch's for every aggregation; batch-level statistics inside an objective
(quantiles, M2 masks, ESS) are per microbatch. A non-finite loss or gradient skips the
update and is counted, never applied; an objective's `metrics['lr_scale']` (VCPO) scales
the update.

Proximal log-probs: when the objective reads them (decoupled PPO, TIS / MIS) and the batch
carries none, the step supplies them (config.loss.prox_estimate): 'recompute' runs one
forward over the batch with the parameters from before the batch's first update (the
proximal policy pi_prox of decoupled PPO, which later updates of the same batch clip
against); 'loglinear' interpolates between behav and the current log-probs
(`rl.objectives.corrections.loglinear_prox`) at that same version, with no forward. With one
update per batch the proximal policy is the current one: both estimates equal sg(logp) on
stale tokens and behav on fresh ones.

On a mesh the step is jitted with `in_shardings` / `out_shardings`: the TrainState
(parameters, and the optimiser state that mirrors them) laid out by `rules` (default:
FSDP + tensor parallel), the batch split by rows over data x fsdp (its size must be a
multiple of data x fsdp), metrics replicated (`train_state_shardings`). In a multi-process
run a host-built batch is placed row-wise (`sharding.multihost.place_rows`). The residual
stream is constrained to rows over data x fsdp: otherwise XLA may keep the FSDP-split
weights in place and gather the activations instead, moving activations rather than
weights and doing each matmul on twice the rows per device.

length_buckets (sequence lengths, e.g. (28, 44, 76)): each batch is first cut to the
smallest bucket that holds its last prompt or completion token (`trim_to_bucket`), so a
batch of short sequences does not pay for the longest allowed one; the step compiles once
per bucket used. The cut slots are masked everywhere, so the results are the same.
Single-process runs only (a multi-process batch is a global array; it is not cut).

learning_rate: the optimiser's schedule (`learning_rate_schedule` with the arguments given
to `make_optimizer`); when set, the metrics include `learning_rate`, the rate each update
applied (the schedule at the update's step times the objective's lr_scale; 0 for a skipped
update), averaged over the updates.

LoRA (a TrainState from `init_train_state(..., lora=...)`): the step differentiates the
loss of the merged policy with respect to the adapters only, so the optimiser state and
updates cover the adapters and the frozen base passes through unchanged. The step reads
LoRA from the state; `lora` is needed only with a mesh, to lay out that state (the frozen
base like the parameters it replaces, the adapters and their moments replicated).

On-policy distillation: the frozen teacher's parameters are an argument of the jitted
step, laid out by `rules` on a mesh like the policy's.

Every step reports `rollout_train_mismatch_kl` (`composite.mismatch_terms`): the
sampler-trainer numerics gap on the batch's fresh tokens, e.g. under mixed precision
(model_config.compute_dtype = 'bfloat16' over float32 parameters, where the gradients,
the accumulator and the optimiser state stay in the parameters' dtype).
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
from rl.objectives import composite
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


def _split_rows(batch: Rollout, parts: int) -> Rollout:
  """Reshapes every [B, ...] leaf to [parts, B / parts, ...] (contiguous row blocks)."""
  size = batch.tokens.shape[0]
  if size % parts:
    raise ValueError(f"Batch of {size} sequences does not split into {parts} equal parts "
                     "(config.rl.num_minibatches x config.rl.num_microbatches); make their "
                     "product a divisor of the batch size.")
  return jax.tree.map(lambda x: x.reshape(parts, size // parts, *x.shape[1:]), batch)


def make_batch_size_check(model_config: ModelConfig, temperature: float = 1.0, *,
                          logprob_chunk: int = 0, replay: bool = False
                          ) -> Callable[[Any, Rollout], dict]:
  """The trainer's log-prob batch-size check: (params, batch) -> metrics.

  Scores the batch's rows twice with the same parameters, all rows in one forward and one
  row at a time, and reports how far the two sets of log-probs are apart over the
  completion tokens: `trainer_logp_batch_gap` (mean |difference|) and
  `trainer_logp_batch_gap_max`. Identical data gives different log-probs when the
  kernels a batch size selects round differently (Tunix measured its JAX trainer's
  mismatch moving 6.2x between micro-batch 1 and 4 in bfloat16), a gap no correction
  knows about; the loop runs it every config.metrics.logprob_check_every RL steps.

  Args:
    model_config, temperature, logprob_chunk, replay: as the train step scores a batch
      (`composite.policy_logprobs`; the prefix-shared forward is not used here).

  Returns:
    A jitted check(params, batch) -> {name: scalar}.
  """
  score = lambda params, rows: composite.policy_logprobs(
      params, rows, model_config, temperature, logprob_chunk=logprob_chunk, replay=replay)

  @jax.jit
  def check(params, batch: Rollout) -> dict:
    whole = score(params, batch)
    one_row = jax.lax.map(lambda row: score(params, row),
                          _split_rows(batch, batch.tokens.shape[0])).reshape(whole.shape)
    mask = batch.completion_mask
    gap = jnp.where(mask, jnp.abs(whole - one_row), 0.0)
    return {"trainer_logp_batch_gap": gap.sum() / jnp.maximum(mask.sum(), 1),
            "trainer_logp_batch_gap_max": gap.max()}

  return check


def make_train_step(model_config: ModelConfig, optimizer: optax.GradientTransformation,
                    loss: losses.LossSettings, *, num_microbatches: int = 1, num_minibatches: int = 1,
                    ppo_epochs: int = 1, temperature: float = 1.0,
                    shared_prefix: tuple[int, int] | None = None,
                    mesh: jax.sharding.Mesh | None = None,
                    rules: sharding_rules.Rules = sharding_rules.TRAINER_RULES,
                    length_buckets: Sequence[int] = (),
                    learning_rate: optax.Schedule | None = None,
                    lora: lora_lib.LoraConfig | None = None,
                    distill: distillation.Distill | None = None, teacher_params=None,
                    logprob_chunk: int = 0, router: composite.RouterTerms | None = None,
                    ) -> Callable[[TrainState, Rollout], tuple[TrainState, dict]]:
  """Builds the jitted train step of the objective `loss.name` (module docstring).

  Args:
    model_config: the policy's shapes.
    optimizer: `make_optimizer`'s AdamW (or any optax transformation).
    loss: the objective and its settings (`LossSettings.resolved`: the run's).
    num_microbatches: gradient accumulation slices of each update.
    num_minibatches, ppo_epochs: updates per batch, minibatch after minibatch, epoch after
      epoch.
    temperature, shared_prefix, logprob_chunk, distill, router: the loss's
      (`rl.objectives.composite.StepObjective`); `teacher_params` go with `distill`.
    mesh, rules: shard the state by `rules` and the batch by rows over data x fsdp.
    length_buckets: sequence lengths a batch may be cut to (`trim_to_bucket`).
    learning_rate: the optimiser's schedule, to report the rate each update applied.
    lora: the adapters' settings, to lay out a LoRA state on a mesh.

  Returns:
    step(state, batch) -> (state, metrics): `state` is donated; metrics are means over the
    updates (`update_skipped`: the fraction skipped), maxima for `composite.MAXIMA`. With shared_prefix every batch is
    checked on the host first (`composite.check_shared_prefix`).
  """
  if num_minibatches < 1 or ppo_epochs < 1:
    raise ValueError(f"num_minibatches = {num_minibatches} and ppo_epochs = {ppo_epochs} must "
                     "be >= 1 (config.rl.num_minibatches, config.rl.ppo_epochs).")
  if (distill is None) != (teacher_params is None):
    raise ValueError("make_train_step: distill and teacher_params go together.")
  rows = None if mesh is None else sharding_rules.batch_sharding(mesh)
  objective = composite.StepObjective(
      model_config, loss, temperature=temperature, shared_prefix=shared_prefix,
      logprob_chunk=logprob_chunk, distill=distill, router=router,
      residual_hook=None if mesh is None else (
          lambda x: jax.lax.with_sharding_constraint(x, rows)))
  update = _make_update(objective, optimizer, num_microbatches, learning_rate)

  def step(state: TrainState, batch: Rollout, teacher) -> tuple[TrainState, dict]:
    if batch.advantages is None:  # checked when traced: a batch without them has no leaf
      raise ValueError("The batch has no advantages (Rollout.advantages is None): the loop "
                       "computes them on the final batch (rl.objectives.advantages."
                       "advantage_stage) before the train step.")
    prox_version = state.step  # the version before this batch's first update
    if batch.prox_logp is None and objective.prox_estimate == "recompute":
      batch = _recompute_prox(objective, state.policy_params(), batch,
                              num_minibatches * num_microbatches)
    minibatches = _split_rows(batch, num_minibatches)

    def one_update(state, index):
      minibatch = jax.tree.map(lambda x: x[index % num_minibatches], minibatches)
      return update(state, minibatch, prox_version, teacher)

    state, metrics = jax.lax.scan(one_update, state, jnp.arange(num_minibatches * ppo_epochs))
    return state, composite.with_mismatch_kl(composite.reduce_metrics(metrics))

  jitted = _jit_step(step, teacher_params, model_config, optimizer, mesh, rules, rows, lora)
  return _host_checks(jitted, length_buckets, shared_prefix,
                      num_minibatches * num_microbatches)


def _recompute_prox(objective: composite.StepObjective, policy, batch: Rollout,
                    pieces: int) -> Rollout:
  """The batch with prox_logp = log-probs under `policy`, one microbatch at a time."""
  prox = jax.lax.map(lambda piece: objective.logprobs(policy, piece),
                     _split_rows(batch, pieces))
  return batch.replace(prox_logp=jax.lax.stop_gradient(prox.reshape(batch.tokens.shape)))


def _make_update(objective: composite.StepObjective, optimizer: optax.GradientTransformation,
                 num_microbatches: int, learning_rate: optax.Schedule | None):
  """update(state, minibatch, prox_version, teacher) -> (state, metrics): one optimiser
  update, gradients accumulated over microbatches, each weighted by its share of the
  minibatch's aggregation denominator (`losses.aggregation_denominator`: valid tokens for
  token_mean, non-empty sequences for seq_mean_token_mean, rows for the constant
  normaliser), so the accumulated gradient is the whole minibatch's; other metrics are
  averaged. A non-finite loss, gradient norm or lr_scale skips the update and is counted.
  Under LoRA the adapters are merged inside the differentiated function, so gradients
  reach the adapters only."""
  grad_fn = jax.value_and_grad(
      lambda params, state, *args: objective(state.policy_params(params), *args), has_aux=True)

  def update(state: TrainState, minibatch: Rollout, prox_version,
             teacher) -> tuple[TrainState, dict]:
    micro = _split_rows(minibatch, num_microbatches)
    denominators = jax.vmap(
        lambda m: losses.aggregation_denominator(m.completion_mask, objective.aggregation))(micro)
    shares = denominators / jnp.maximum(denominators.sum(), 1.0)  # [num_microbatches]

    def accumulate(grads, one_and_share):
      one, share = one_and_share
      (loss, metrics), g = grad_fn(state.params, state, one, state.step, prox_version, teacher)
      grads = jax.tree.map(lambda a, b: a + (b * share).astype(a.dtype), grads, g)
      return grads, (loss * share, metrics)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (loss, metrics) = jax.lax.scan(accumulate, zeros, (micro, shares))
    loss = loss.sum()
    metrics = composite.reduce_metrics(metrics)
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

  return update


def _jit_step(step, teacher_params, model_config: ModelConfig,
              optimizer: optax.GradientTransformation, mesh, rules, rows, lora):
  """step(state, batch, teacher) jitted with the state donated (on a mesh: the state laid
  out by `rules`, the batch by `rows`, metrics replicated; a multi-process host batch
  placed row-wise), as (state, batch) -> (state, metrics) with the teacher bound; its
  `lower(state, batch)` lowers the compiled program (experiments/memory.py)."""
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
  if hasattr(with_teacher, "lower"):
    jitted.lower = lambda state, batch: with_teacher.lower(state, batch, teacher_params)
  return jitted


def _host_checks(jitted, length_buckets: Sequence[int], shared_prefix, parts: int):
  """The step with the host-side work before it: the batch cut to its length bucket
  (single-process runs), and the prefix-shared layout checked."""
  if length_buckets and jax.process_count() == 1:
    unbucketed = jitted
    jitted = lambda state, batch: unbucketed(state, trim_to_bucket(batch, length_buckets))
  if shared_prefix is None:
    return jitted

  def checked_step(state: TrainState, batch: Rollout) -> tuple[TrainState, dict]:
    composite.check_shared_prefix(batch, *shared_prefix, num_microbatches=parts)
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
  return jax.tree.map(lambda x: x[:, :cut] if x.ndim >= 2 else x, batch)  # [B, T, ...] leaves


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
