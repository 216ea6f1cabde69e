"""Policy objectives under one signature, in one registry (docs/concepts.md, Objectives).

Every objective is

    loss_fn(logp, batch, *, prox_logp=None, settings) -> (scalar loss, metrics dict)

where `logp` [B, T] are the log-probs of `batch.tokens` under the parameters being trained,
`batch` is an `rl.types.Rollout`, and `settings` is the run's `LossSettings` (config.loss,
typed, and resolved: `LossSettings.resolved`, every field a value). Metrics may carry
'lr_scale', which the train step applies to the update. The train step binds the run's
settings once, when it is built (`build(settings)`; `Objective.build` resolves them there).

A built-in objective (`Objective`) is a per-token surrogate plus a chain of corrections (`rl.objectives.corrections`:
small transforms of log-ratios, advantages and masks into weights, masks and clip
widths), plus fixed settings that define the method (DAPO's clip-higher and token-mean
aggregation, GSPO's small sequence-level clip, ...). Those settings override the same
fields of `LossSettings`; `config.loss.corrections` appends corrections to any objective
(e.g. `name='dapo', corrections=('m2po',)`). Every setting of an objective or a correction
is one field of `LossSettings`, with its default, range and documentation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from rl.objectives import corrections as corr
from rl.registry import Registry
from rl.settings import as_tuple
from rl.settings.loss import AGGREGATIONS, LossSettings
from rl.types import Rollout

LossFn = Callable[..., tuple[jax.Array, dict]]
RATIO_ANCHORS = ("old", "behav")
LOSSES: Registry[LossFn] = Registry(
    "loss", "config.loss.name", "register_loss adds one: docs/add_objective.md")


# `@register_loss(name)` adds an objective (config.loss.name); `get_loss(name)` finds it.
register_loss = LOSSES.register
get_loss = LOSSES.get


# --- The run's LossSettings against the registered objectives and corrections ----------


def chain_of(settings: LossSettings) -> tuple[str, ...]:
  """The corrections applied: the objective's own, then config.loss.corrections."""
  return tuple(getattr(get_loss(settings.name), "corrections", ())) + tuple(settings.corrections)


def needs_prox(settings: LossSettings) -> bool:
  """Whether the objective or one of its corrections reads proximal log-probs (the train
  step then supplies them, config.loss.prox_estimate)."""
  return bool(getattr(get_loss(settings.name), "uses_prox", False)) or any(
      corr.get_correction(name).needs_prox for name in chain_of(settings))


def reads_sampler_topk(settings: LossSettings) -> bool:
  """Whether a correction of the chain reads the sampler's top-K record (score centering):
  the launcher then records it with each batch."""
  return any(corr.get_correction(name).reads_sampler_topk for name in chain_of(settings))


def resolve(settings: LossSettings, max_new_tokens: int | None = None) -> LossSettings:
  """What the objective `settings.name` runs with (`LossSettings.resolved` with the fields
  the objective fixes; with `max_new_tokens`, norm_len 0 as the generation budget)."""
  overrides = getattr(get_loss(settings.name), "overrides", None) or {}
  return settings.resolved(max_new_tokens, overrides=overrides)


def fields_read(settings: LossSettings) -> set[str]:
  """The fields the objective reads, with its corrections: name, corrections, kl_coef
  and aggregation, token_subsample (and token_keep when it is on), its surrogate's
  (`Objective.reads`), its corrections', prox_estimate when it needs proximal log-probs,
  sc_top_k when a correction reads the sampler's top-K record, norm_len with
  seq_mean_token_sum_norm."""
  read = {"name", "corrections", "kl_coef", "aggregation", "token_subsample",
          *getattr(get_loss(settings.name), "reads", ())}
  if settings.token_subsample != "none":
    read.add("token_keep")
  for name in chain_of(settings):
    read.update(corr.get_correction(name).fields.values())
  if needs_prox(settings):
    read.add("prox_estimate")
  if reads_sampler_topk(settings):
    read.add("sc_top_k")
  if resolve(settings).aggregation == "seq_mean_token_sum_norm":
    read.add("norm_len")
  return read


def check(settings: LossSettings) -> None:
  """Refuses, before any training, settings the objective cannot run with
  (`check_runnable`) and a field that is set and that the objective overrides (DAPO fixes
  eps_high = 0.28) or never reads (M2PO has no clip widths): a setting accepted and then
  ignored would silently change what a run means. An objective registered as a plain
  function (no `reads`) is not checked for unread fields.

  >>> check(LossSettings(name="m2po", eps_high=0.3))
  Traceback (most recent call last):
  ...
  ValueError: config.loss.eps_high = 0.3: objective 'm2po' (with corrections ('m2po',)) never reads eps_high, so this setting would be ignored. Leave config.loss.eps_high at its default, or choose an objective or correction that uses it.
  """
  check_runnable(settings)
  loss_fn = get_loss(settings.name)
  if not hasattr(loss_fn, "reads"):
    return
  overrides, read = loss_fn.overrides, fields_read(settings)
  for field in settings.changed_fields():
    value = getattr(settings, field)
    if field in overrides and as_tuple(value) != as_tuple(overrides[field]):
      raise ValueError(
          f"config.loss.{field} = {value!r}: objective {settings.name!r} fixes {field} = "
          f"{overrides[field]!r} (it defines the method), so this setting would be ignored. "
          f"Leave config.loss.{field} unset, or use an objective that reads it "
          "(e.g. 'grpo', whose clip widths and aggregation are the config's).")
    if field not in overrides and field not in read:
      raise ValueError(
          f"config.loss.{field} = {value!r}: objective {settings.name!r} (with corrections "
          f"{chain_of(settings)}) never reads {field}, so this setting would be ignored. "
          f"Leave config.loss.{field} at its default, or choose an objective or correction "
          "that uses it.")


def check_runnable(settings: LossSettings) -> None:
  """`check` without refusing unread settings: what the train step checks of the
  resolved settings it is given (resolving sets fields the objective may not read)."""
  settings.check_ranges()
  loss_fn = get_loss(settings.name)
  if isinstance(settings.corrections, str):
    raise ValueError(f"config.loss.corrections = {settings.corrections!r} must be a tuple of "
                     f"names, e.g. ({settings.corrections!r},); known: "
                     f"{list(corr.CORRECTIONS.names())}.")
  aggregation = resolve(settings).aggregation
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"Unknown config.loss.aggregation {aggregation!r}; known: {AGGREGATIONS}.")
  if settings.corrections and not hasattr(loss_fn, "corrections"):
    raise ValueError(f"config.loss.corrections = {tuple(settings.corrections)} with "
                     f"config.loss.name = {settings.name!r}, a loss function that applies no "
                     "corrections (register it with make_objective to give it a chain, "
                     "docs/add_objective.md); set config.loss.corrections=().")
  chain = chain_of(settings)
  corr.check_chain(chain, loss_fn if hasattr(loss_fn, "scope") else None)
  from rl.objectives import token_subsample  # pylint: disable=import-outside-toplevel
  token_subsample.check_composes(settings.token_subsample, loss_fn, chain, settings.kl_coef)
  if (any(corr.get_correction(n).replaces_logp for n in chain)
      and getattr(loss_fn, "scope", corr.Scope.TOKEN) != corr.Scope.TOKEN):
    raise ValueError(f"config.loss.name = {settings.name!r} takes sequence-level ratios, which "
                     f"would count the tokens a correction in {chain} drops (their "
                     "logp replaced by the anchor) as on-policy; use a per-token objective "
                     "(grpo, dapo, mu_grpo, ...) with that correction.")


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, norm_len: float = 1.0) -> jax.Array:
  """Reduces a per-token loss [B, T] over valid tokens to a scalar.

  token_mean: sum over all tokens / number of tokens (DAPO).
  seq_mean_token_mean: mean over sequences of each sequence's token mean (original GRPO);
    sequences with no valid token are left out.
  seq_mean_token_sum_norm: mean over sequences of token sum / norm_len (Dr.GRPO).
  """
  mask = mask.astype(jnp.float32)
  per_token = per_token * mask
  if mode == "token_mean":
    return per_token.sum() / jnp.maximum(mask.sum(), 1.0)
  if mode == "seq_mean_token_mean":
    lengths = mask.sum(axis=1)
    has_tokens = (lengths > 0).astype(jnp.float32)
    seq_means = per_token.sum(axis=1) / jnp.maximum(lengths, 1.0)
    return (seq_means * has_tokens).sum() / jnp.maximum(has_tokens.sum(), 1.0)
  if mode == "seq_mean_token_sum_norm":
    if isinstance(norm_len, (int, float)) and norm_len <= 0:
      raise ValueError(f"seq_mean_token_sum_norm needs norm_len > 0, got {norm_len} (the "
                       "launcher turns config.loss.norm_len=0 into rollout.max_new_tokens; "
                       "resolve_norm_len).")
    return (per_token.sum(axis=1) / norm_len).mean()
  raise ValueError(f"Unknown aggregation {mode!r} (config.loss.aggregation); known: {AGGREGATIONS}.")


def aggregation_denominator(mask: jax.Array, mode: str) -> jax.Array:
  """What `aggregate(..., mode)` divides by for this mask: the valid tokens (token_mean),
  the sequences with a valid token (seq_mean_token_mean) or the rows
  (seq_mean_token_sum_norm). Gradient accumulation weights each microbatch's loss by its
  share of the whole batch's denominator (rl.train), so that the accumulated gradient is
  the whole batch's: a token_mean over microbatches of 20 and 4 tokens is the mean over
  the 24, not the mean of two means (which weighted those tokens 0.6x and 3x)."""
  mask = mask.astype(jnp.float32)
  if mode == "token_mean":
    return mask.sum()
  if mode == "seq_mean_token_mean":
    return (mask.sum(axis=1) > 0).astype(jnp.float32).sum()
  if mode == "seq_mean_token_sum_norm":
    return jnp.asarray(mask.shape[0], jnp.float32)
  raise ValueError(f"Unknown aggregation {mode!r} (config.loss.aggregation); known: {AGGREGATIONS}.")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of x over mask (0 when the mask is empty)."""
  mask = mask.astype(jnp.float32)
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
  delta = ref_logp - logp
  return jnp.exp(delta) - delta - 1.0


# --- Per-token surrogates: (TokenTerms, resolved LossSettings) -> (per-token loss, metrics) ---


def clip_interval(adv: jax.Array, eps_low, eps_high,
                  clip_scale: jax.Array | float = 1.0) -> tuple[jax.Array, jax.Array]:
  """The ratio interval (lo, hi) = (1 - eps_low * k_lo, 1 + eps_high * k_hi) per token.

  Only the endpoint the advantage sign selects is contracted by `clip_scale` (SAT):
  A > 0 -> k_hi = clip_scale, A < 0 -> k_lo = clip_scale; the other endpoint never binds
  for that sign, so contracting it too would not change the objective.
  """
  hi = 1.0 + eps_high * jnp.where(adv > 0, clip_scale, 1.0)
  lo = 1.0 - eps_low * jnp.where(adv < 0, clip_scale, 1.0)
  return lo, hi


def clip_objective(ratio: jax.Array, adv: jax.Array, eps_low, eps_high,
                   clip_scale: jax.Array | float = 1.0) -> tuple[jax.Array, jax.Array]:
  """PPO-clip per token: (-min(r A, clip(r, lo, hi) A), clipping-active indicator), with
  the interval of `clip_interval`.

  The min is taken as a choice of branch, so that its gradient is -A dr wherever the
  unclipped branch is the min, ties included (r on an endpoint: SAT contracts the interval
  to [1 - eps_low, 1] at a batch's first update, where r = 1); `jnp.minimum` would split a
  tie's gradient between the branches, and the clip's own between its bound and r."""
  lo, hi = clip_interval(adv, eps_low, eps_high, clip_scale)
  clipped = jnp.clip(ratio, lo, hi)
  active = ratio * adv > clipped * adv
  return -jnp.where(active, clipped * adv, ratio * adv), active


def clipped_surrogate(terms: corr.TokenTerms, cfg, widths: tuple[str, str] = ("eps_low", "eps_high")
                      ) -> tuple[jax.Array, dict]:
  """PPO-clip / GRPO: token ratio against prox when supplied (decoupled PPO), else behav,
  clipped with the widths in the LossSettings fields `widths` (Mu-GRPO: its relaxed band)."""
  log_ratio = terms.logp - terms.old
  ratio = jnp.exp(log_ratio)
  eps_low, eps_high = (getattr(cfg, field) for field in widths)
  per_token, active = clip_objective(ratio, terms.advantages, eps_low, eps_high,
                                     terms.clip_scale)
  return per_token, {"clip_fraction": masked_mean(active.astype(jnp.float32), terms.mask),
                     "ratio_mean": masked_mean(ratio, terms.mask)}


def _sequence_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  return (x * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)


def gspo_surrogate(terms: corr.TokenTerms, cfg) -> tuple[jax.Array, dict]:
  """GSPO: sequence ratio s_i = exp(mean_t(logp - old)) clipped at sequence level with the
  sequence advantage (token mean of the advantages), broadcast to the sequence's tokens."""
  s = jnp.exp(_sequence_mean(terms.logp - terms.old, terms.mask))
  adv = _sequence_mean(terms.advantages, terms.mask)
  per_seq, active = clip_objective(s, adv, cfg.eps_low, cfg.eps_high,
                                   _sequence_mean(terms.clip_scale, terms.mask))
  per_token = per_seq[:, None] * terms.mask
  active = jnp.broadcast_to(active[:, None], terms.mask.shape).astype(jnp.float32)
  return per_token, {"clip_fraction": masked_mean(active, terms.mask), "ratio_mean": s.mean()}


def gspo_token_surrogate(terms: corr.TokenTerms, cfg) -> tuple[jax.Array, dict]:
  """GSPO-token: per-token ratio sg(s_i) * exp(logp - sg(logp)) (value s_i, token-wise
  gradient), clipped per token with the token's advantage."""
  s = jnp.exp(_sequence_mean(corr.sg(terms.logp) - terms.old, terms.mask))
  ratio = s[:, None] * jnp.exp(terms.logp - corr.sg(terms.logp))
  per_token, active = clip_objective(ratio, terms.advantages, cfg.eps_low, cfg.eps_high,
                                     terms.clip_scale)
  return per_token, {"clip_fraction": masked_mean(active.astype(jnp.float32), terms.mask),
                     "ratio_mean": s.mean()}


def vcpo_surrogate(terms: corr.TokenTerms, cfg) -> tuple[jax.Array, dict]:
  """VCPO's policy gradient with detached truncated importance sampling, at the level
  config.loss.vcpo_is_level names.

  "sequence" (default; the authors' reference: verl `rollout_is="sequence"`, threshold 8):
  one weight per response, sg(min(w_i, vcpo_is_cap)) with w_i = exp(sum_t m (logp -
  behav)), broadcast over its tokens: per-token loss -sg(min(w_i, C)) exp(logp - sg(logp))
  A, whose gradient is min(w_i, C) A grad logp_t. "token": a different estimator, each
  token's own ratio truncated (`importance_pg_surrogate("vcpo_is_cap")`).
  """
  if cfg.vcpo_is_level == "token":
    return importance_pg_surrogate("vcpo_is_cap")(terms, cfg)
  log_cap = jnp.log(cfg.vcpo_is_cap)
  log_w = corr.sequence_log_weights(terms)
  weight = jnp.exp(jnp.minimum(log_w, log_cap))[:, None]
  truncated = jnp.broadcast_to((log_w > log_cap)[:, None], terms.mask.shape)
  score = jnp.exp(terms.logp - corr.sg(terms.logp))  # value 1, gradient grad logp
  return -corr.sg(weight) * score * terms.advantages, {
      "ratio_mean": masked_mean(jnp.exp(terms.stale_log_ratio), terms.mask),
      "clip_fraction": masked_mean(truncated.astype(jnp.float32), terms.mask)}


def importance_pg_surrogate(cap: Optional[str]) -> Callable:
  """Unclipped IS policy gradient against behav, -w A with w = exp(logp - behav) (M2PO), or
  with the weight truncated at the LossSettings field `cap` (VCPO): value min(r, C), gradient
  min(r, C) * A * grad logp (the truncation is detached)."""
  def surrogate(terms: corr.TokenTerms, cfg) -> tuple[jax.Array, dict]:
    log_ratio = terms.logp - terms.behav
    if cap is None:
      weighted = jnp.exp(log_ratio)
      truncated = jnp.zeros_like(log_ratio)
    else:
      log_cap = jnp.log(getattr(cfg, cap))
      weighted = jnp.exp(log_ratio - corr.sg(jnp.maximum(log_ratio - log_cap, 0.0)))
      truncated = (log_ratio > log_cap).astype(jnp.float32)
    return -weighted * terms.advantages, {
        "ratio_mean": masked_mean(jnp.exp(corr.sg(log_ratio)), terms.mask),
        "clip_fraction": masked_mean(truncated, terms.mask)}
  return surrogate


@dataclasses.dataclass(frozen=True)
class Objective:
  """A built-in objective, callable with the loss signature: terms from the batch ->
  corrections chain -> surrogate * weight (+ a correction's extra term) -> (+KL) ->
  aggregation.

  surrogate: (TokenTerms, resolved LossSettings) -> (per-token loss, metrics).
  corrections: the method's own `rl.objectives.corrections` chain (config.loss.corrections follow).
  uses_prox: whether the method needs proximal log-probs (decoupled PPO).
  overrides: LossSettings fields that define the method (e.g. DAPO's eps_high=0.28).
  reads: the LossSettings fields the surrogate reads (`LossSettings.check` refuses a
  setting no part of the objective reads).
  scope: the widest part of the batch one token's surrogate term depends on
  (`corrections.Scope`: TOKEN for per-token ratios, ROW for GSPO's and VCPO's sequence
  ratios); token subsampling and score centering read it.
  ratio_anchor: what the sampled token's ratio is taken against: "old" (the proximal
  log-probs when the train step supplies them, else the sampler's: PPO-clip) or "behav"
  (always the sampler's: M2PO's and VCPO's importance weights).
  """
  name: str
  doc: str
  surrogate: Callable
  corrections: tuple[str, ...] = ()
  uses_prox: bool = False
  overrides: Mapping[str, object] = dataclasses.field(default_factory=dict)
  reads: tuple[str, ...] = ()
  scope: corr.Scope = corr.Scope.TOKEN
  ratio_anchor: str = "old"

  def __post_init__(self):
    if self.ratio_anchor not in RATIO_ANCHORS:
      raise ValueError(f"Objective {self.name!r}: ratio_anchor {self.ratio_anchor!r}; "
                       f"known: {RATIO_ANCHORS}.")

  def __call__(self, logp: jax.Array, batch: Rollout, *, prox_logp=None,
               settings: LossSettings, head_logp=None) -> tuple[jax.Array, dict]:
    """The loss signature (module docstring): `self.build(settings)` applied once."""
    return self.build(settings)(logp, batch, prox_logp=prox_logp, head_logp=head_logp)

  def build(self, settings: LossSettings) -> Callable[..., tuple[jax.Array, dict]]:
    """This objective bound to `settings`, resolved once (with the fields the method
    fixes, `overrides`): `(logp, batch, *, prox_logp=None, head_logp=None) -> (loss,
    metrics)`; `head_logp` [B, T, K] are the current log-probs of the sampler's top-K
    tokens (`batch.behavior_topk`), for score centering. The train step builds it once
    (`rl.objectives.losses.build`)."""
    cfg = settings.resolved(overrides=self.overrides)
    chain = self.corrections + cfg.corrections
    return functools.partial(self._loss, cfg, chain)

  def _loss(self, cfg: LossSettings, chain: tuple[str, ...], logp: jax.Array, batch: Rollout,
            *, prox_logp=None, head_logp=None) -> tuple[jax.Array, dict]:
    """The objective under the resolved settings `cfg` and correction chain `chain`."""
    mask = batch.completion_mask.astype(jnp.float32)
    terms = corr.TokenTerms(
        logp=logp, behav=batch.behavior_logp,
        prox=None if prox_logp is None else corr.sg(prox_logp),
        advantages=batch.advantages, mask=mask, weight=jnp.ones_like(logp),
        clip_scale=jnp.ones_like(logp), reward=batch.reward, group=batch.group,
        head_logp=head_logp,
        behav_head=None if batch.behavior_topk is None else batch.behavior_topk.logp)
    if self.uses_prox and terms.prox is None:
      raise ValueError("This objective needs prox_logp; build the train step with rl.train, "
                       "which supplies it (config.loss.prox_estimate).")
    terms, metrics = corr.chain(chain, terms, cfg, objective=self)
    per_token, surrogate_metrics = self.surrogate(terms, cfg)
    per_token = per_token * corr.sg(terms.weight)
    if terms.extra is not None:
      per_token = per_token + terms.extra
    metrics.update(surrogate_metrics)
    metrics["approx_kl_behavior"] = masked_mean(k3_kl(logp, batch.behavior_logp), mask)
    if cfg.kl_coef:
      if batch.ref_logp is None:
        raise ValueError("config.loss.kl_coef > 0 needs reference log-probs (batch.ref_logp); "
                         "set config.loss.kl_coef=0 or provide a reference policy.")
      kl = k3_kl(logp, batch.ref_logp)
      per_token = per_token + cfg.kl_coef * kl
      metrics["kl_ref"] = masked_mean(kl, mask)
    return aggregate(per_token, mask, cfg.aggregation, cfg.norm_len), metrics


def build(settings: LossSettings) -> Callable[..., tuple[jax.Array, dict]]:
  """The objective config.loss.name names, bound to `settings` once:
  `(logp, batch, *, prox_logp=None, **extra) -> (loss, metrics)`. A built-in `Objective`
  resolves its settings here (`Objective.build`); a plain registered function receives
  `settings` on each call, as its signature says."""
  loss_fn = get_loss(settings.name)
  if isinstance(loss_fn, Objective):
    return loss_fn.build(settings)
  return functools.partial(loss_fn, settings=settings)


def make_objective(surrogate: Callable, corrections: tuple[str, ...] = (),
                   uses_prox: bool = False, *, name: str = "", doc: str = "",
                   reads: tuple[str, ...] = (), scope: corr.Scope = corr.Scope.TOKEN,
                   ratio_anchor: str = "old", **overrides) -> Objective:
  """An objective from a per-token surrogate (docs/add_objective.md).

  Args:
    surrogate: `(TokenTerms, resolved LossSettings) -> (per-token loss [B, T], metrics)`.
    corrections: the method's own correction chain (config.loss.corrections follow it).
    uses_prox: whether the method needs proximal log-probs (decoupled PPO).
    name, doc: the registry's name and description (default: the surrogate's).
    reads: the `LossSettings` fields the surrogate reads (`LossSettings.check` refuses a set
      field nothing reads).
    scope: the widest part of the batch one token's term depends on (`corrections.Scope`;
      TOKEN when it reads its own log-ratio alone, ROW for a sequence ratio).
    ratio_anchor: "old" (PPO: prox when supplied, else behav) or "behav" (an IS weight to
      the sampler).
    **overrides: `LossSettings` fields that define the method (DAPO's eps_high = 0.28).

  Returns:
    An `Objective`, callable as `(logp, batch, *, prox_logp=None, settings) -> (loss,
    metrics)`; `register_loss(name)(objective)` makes it config.loss.name.

  >>> tight = make_objective(clipped_surrogate, name="tight", reads=_EPS, eps_high=0.1)
  >>> resolved = LossSettings().resolved(overrides=tight.overrides)
  >>> resolved.eps_low, resolved.eps_high, tight.uses_prox
  (0.2, 0.1, False)
  """
  return Objective(name=name or getattr(surrogate, "__name__", "objective"),
                   doc=doc or (surrogate.__doc__ or ""), surrogate=surrogate,
                   corrections=tuple(corrections), uses_prox=uses_prox,
                   overrides=dict(overrides), reads=tuple(reads), scope=corr.Scope(scope),
                   ratio_anchor=ratio_anchor)


_EPS = ("eps_low", "eps_high")  # the PPO clip widths clipped_surrogate reads by default


def _register(name: str, doc: str, *args, **kwargs) -> Objective:
  return register_loss(name)(make_objective(*args, name=name, doc=doc, **kwargs))


ppo_clip_loss = _register(
    "grpo", "PPO-clip / GRPO (DeepSeekMath): -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r "
    "against prox when supplied, else behav; optional k3 KL (kl_coef).", clipped_surrogate,
    reads=_EPS)
_register("dapo", "DAPO: PPO-clip with clip-higher (0.2 / 0.28) and token-mean aggregation. "
          "(Dynamic sampling and overlong shaping act on the data and rewards, not the loss.)",
          clipped_surrogate, reads=_EPS, eps_low=0.2, eps_high=0.28, aggregation="token_mean")
_register("drgrpo", "Dr.GRPO: PPO-clip with a constant normaliser (seq_mean_token_sum_norm, "
          "norm_len); pair with config.advantage.name='drgrpo' (no std division).",
          clipped_surrogate, reads=_EPS, aggregation="seq_mean_token_sum_norm")
_register("gspo", "GSPO: sequence-level ratio exp(mean_t(logp - old)), clipped at sequence level "
          "(eps 3e-4 / 4e-4); one loss per sequence.",
          gspo_surrogate, reads=_EPS, scope=corr.Scope.ROW, eps_low=3e-4, eps_high=4e-4,
          aggregation="seq_mean_token_mean")
_register("gspo_token", "GSPO-token: per-token ratio sg(s_i) exp(logp - sg(logp)), clipped at "
          "eps 3e-4 / 4e-4; equals GSPO when a sequence's tokens share an advantage.",
          gspo_token_surrogate, reads=_EPS, scope=corr.Scope.ROW, eps_low=3e-4, eps_high=4e-4,
          aggregation="seq_mean_token_mean")
_register("decoupled", "Decoupled PPO (AReaL): clip exp(logp - prox) and weight by "
          "sg(min(exp(prox - behav), is_cap)) (the 'tis' correction; cap 5 by default; use "
          "name='grpo', corrections=('mis',) for the masking variant).",
          clipped_surrogate, corrections=("tis",), uses_prox=True, reads=_EPS)
_register("m2po", "M2PO: unclipped -(1/N) sum m M exp(logp - behav) A with the second-moment "
          "mask M (the 'm2po' correction), N = valid tokens.",
          importance_pg_surrogate(None), corrections=("m2po",), ratio_anchor="behav",
          aggregation="token_mean")
_register("sat", "SAT: PPO-clip against behav whose high-mismatch tokens get a contracted "
          "interval (the 'sat' correction).", clipped_surrogate, corrections=("sat",),
          reads=_EPS)
_register("vcpo", "VCPO: policy gradient with one truncated IS weight per sequence "
          "(min(w_i, vcpo_is_cap = 8); vcpo_is_level='token' truncates per token), the "
          "off-policy optimal baseline per group, and the ESS learning-rate scale "
          "sqrt(min(1, rho / vcpo_rho_ref)) (metrics['lr_scale']).",
          vcpo_surrogate, corrections=("vcpo_baseline", "vcpo_ess"),
          reads=("vcpo_is_cap", "vcpo_is_level"), scope=corr.Scope.ROW, ratio_anchor="behav")
_register("mu_grpo", "Mu-GRPO (arXiv 2605.17570): PPO-clip with the relaxed interval "
          "[1 - mu_eps_low, 1 + mu_eps_high] (default [1/2, 2]: keeps the gradients of stale "
          "tokens that eps 0.2 would clip) and the negative-advantage veto (the 'mu_veto' "
          "correction: a response with A < 0 loses its tokens from the first one whose ratio "
          "leaves that interval). The paper trains in a few large stages: many updates per "
          "rollout batch (rl.num_minibatches; docs/concepts.md).",
          functools.partial(clipped_surrogate, widths=("mu_eps_low", "mu_eps_high")),
          corrections=("mu_veto",), reads=("mu_eps_low", "mu_eps_high"))

@register_loss("sft")
def sft_loss(logp: jax.Array, batch: Rollout, *, prox_logp=None,
             settings: LossSettings) -> tuple[jax.Array, dict]:
  """Supervised warm start: negative log-likelihood of the completion tokens."""
  del prox_logp
  nll = aggregate(-logp, batch.completion_mask, settings.aggregation, settings.norm_len)
  return nll, {"nll": nll}
