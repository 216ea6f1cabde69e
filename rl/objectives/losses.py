"""Policy objectives under one signature, in one registry (docs/concepts.md, Objectives).

Every objective is

    loss_fn(logp, batch, *, prox_logp=None, config) -> (scalar loss, metrics dict)

where `logp` [B, T] are the log-probs of `batch.tokens` under the parameters being trained,
`batch` is an `rl.types.Rollout`, and `config` is the (frozen) `config.loss` ConfigDict.
Metrics may carry 'lr_scale', which the train step applies to the update.

A built-in objective (`Objective`) is a per-token surrogate plus a chain of corrections (`rl.objectives.corrections`:
small transforms of log-ratios, advantages and masks into weights, masks and clip
widths), plus fixed settings that define the method (DAPO's clip-higher and token-mean
aggregation, GSPO's small sequence-level clip, ...). Those settings override the same
fields of `config.loss`; `config.loss.corrections` appends corrections to any objective
(e.g. `name='dapo', corrections=('m2po',)`). Unset fields take `LOSS_DEFAULTS`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from rl.objectives import corrections as corr
from rl.registry import Registry
from rl.types import Rollout

LossFn = Callable[..., tuple[jax.Array, dict]]
LOSSES: Registry[LossFn] = Registry(
    "loss", "config.loss.name", "register_loss adds one: docs/add_objective.md")

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
PROX_ESTIMATES = ("recompute", "loglinear")

# Defaults of the config.loss fields (experiments/configs/default.py documents each); the
# correction factories of rl.objectives.corrections take the same defaults (a test checks).
# The config.loss fields an objective may fix (`make_objective(..., **overrides)`). The run
# config leaves them unset (None) so that a value a user sets, even one equal to the
# default, is seen, and refused where the objective fixes another (`check_settings_read`).
OBJECTIVE_FIXABLE = ("eps_low", "eps_high", "aggregation")

LOSS_DEFAULTS = dict(
    eps_low=0.2, eps_high=0.2, aggregation="seq_mean_token_mean", kl_coef=0.0,
    # Dr.GRPO's constant normaliser; 0 = the completion budget (`resolve_norm_len`).
    norm_len=0.0,
    corrections=(), prox_estimate="recompute",
    is_cap=5.0, is_floor=0.0,            # TIS truncation / MIS window (decoupled PPO cap 5)
    # M2PO bound on the kept tokens' mean d^2: 0.04 = (0.2)^2, a typical |log-ratio| of 0.2,
    # about PPO's eps = 0.2 trust region in log space (log 1.2 = 0.18); the M2PO paper's value.
    m2_tau=0.04,
    sat_quantile=0.9, sat_bandwidth=0.1,  # SAT tail quantile of |d| and kernel width
    vcpo_rho_ref=1.0, vcpo_is_cap=8.0,    # VCPO reference ESS ratio and IS truncation
    vcpo_is_level="sequence",             # VCPO: one IS weight per sequence, or per token
    # Mu-GRPO's relaxed band [1/2, 2] (|log r| <= log 2, symmetric in log space): its clip
    # interval and its veto's trigger (chosen; the paper's values were not available).
    mu_eps_low=0.5, mu_eps_high=1.0)


# `@register_loss(name)` adds an objective (config.loss.name); `get_loss(name)` finds it.
register_loss = LOSSES.register
get_loss = LOSSES.get


def resolve_norm_len(norm_len: float, max_new_tokens: int) -> float:
  """config.loss.norm_len, with 0 meaning the completion budget (rollout.max_new_tokens):
  Dr.GRPO divides every sequence's token sum by one constant, the generation budget."""
  return float(norm_len) if norm_len else float(max_new_tokens)


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


def effective_aggregation(config) -> str:
  """The aggregation the objective `config.name` uses: its own fixed one (DAPO and M2PO:
  token_mean) or config.aggregation."""
  return resolve_config(config, getattr(get_loss(config.name), "overrides", None)).aggregation


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of x over mask (0 when the mask is empty)."""
  mask = mask.astype(jnp.float32)
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
  delta = ref_logp - logp
  return jnp.exp(delta) - delta - 1.0


def resolve_config(config, overrides=None) -> types.SimpleNamespace:
  """LOSS_DEFAULTS, updated by the fields `config` sets (a ConfigDict, dict or None; a None
  field is unset), then by `overrides`."""
  values = dict(LOSS_DEFAULTS)
  if config is not None:
    items = config.items() if hasattr(config, "items") else vars(config).items()
    values.update((field, value) for field, value in items if value is not None)
  values.update(overrides or {})
  if isinstance(values["corrections"], str):
    raise ValueError(f"config.loss.corrections = {values['corrections']!r} must be a tuple of "
                     f"names, e.g. ({values['corrections']!r},); known: {list(corr.CORRECTIONS.names())}.")
  values["corrections"] = tuple(values["corrections"])
  if values["prox_estimate"] not in PROX_ESTIMATES:
    raise ValueError(f"Unknown config.loss.prox_estimate {values['prox_estimate']!r}; known: "
                     f"{PROX_ESTIMATES}.")
  return types.SimpleNamespace(**values)


def check_config(config) -> None:
  """Raises ValueError unless `config` (config.loss) names a registered objective, a known
  aggregation, registered corrections and a known prox_estimate. The train step checks
  this when it is built, so a bad name fails before any training, not at the first trace."""
  loss_fn = get_loss(config.name)
  aggregation = effective_aggregation(config)
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"Unknown config.loss.aggregation {aggregation!r}; known: {AGGREGATIONS}.")
  names = correction_chain(loss_fn, config)
  corr.check_chain(names)
  if any(corr.get_correction(n).replaces_logp for n in names) and not getattr(
      loss_fn, "per_token", True):
    raise ValueError(f"config.loss.name = {config.name!r} takes sequence-level ratios, which "
                     f"would count the tokens a correction in {names} drops (their logp "
                     "replaced by the anchor) as on-policy; use a per-token objective "
                     "(grpo, dapo, mu_grpo, ...) with that correction.")
  level = resolve_config(config).vcpo_is_level
  if level not in VCPO_IS_LEVELS:
    raise ValueError(f"Unknown config.loss.vcpo_is_level {level!r}; known: {VCPO_IS_LEVELS}.")


def fields_read(config) -> set[str]:
  """The config.loss fields the objective `config.name` reads, with its corrections: its
  name, corrections, kl_coef and aggregation, the fields its surrogate reads (`Objective.
  reads`), its corrections' fields, prox_estimate when it needs proximal log-probs, and
  norm_len when it aggregates with seq_mean_token_sum_norm."""
  loss_fn = get_loss(config.name)
  read = {"name", "corrections", "kl_coef", "aggregation", *getattr(loss_fn, "reads", ())}
  for name in correction_chain(loss_fn, config):
    read.update(corr.get_correction(name).fields.values())
  if needs_prox(config):
    read.add("prox_estimate")
  if effective_aggregation(config) == "seq_mean_token_sum_norm":
    read.add("norm_len")
  return read


def check_settings_read(config) -> None:
  """Raises ValueError for a config.loss field that is set and that the objective would
  override (DAPO fixes eps_high = 0.28) or never read (M2PO has no clip widths), naming the
  objective and the field: a setting that is accepted and then ignored would silently
  change what a run means. A field of OBJECTIVE_FIXABLE counts as set when it is not None
  (so an explicit eps_high = 0.2 with DAPO is refused); any other when it differs from its
  default (`LOSS_DEFAULTS`). The launcher checks this before step 1; an objective
  registered as a plain function (no `reads`) is not checked."""
  loss_fn = get_loss(config.name)
  if not hasattr(loss_fn, "reads"):
    return
  overrides = loss_fn.overrides
  read = fields_read(config)
  for field, default in LOSS_DEFAULTS.items():
    value = config.get(field, None if field in OBJECTIVE_FIXABLE else default)
    if value is None or (field not in OBJECTIVE_FIXABLE and _same(value, default)):
      continue
    if field in overrides and not _same(value, overrides[field]):
      raise ValueError(
          f"config.loss.{field} = {value!r}: objective {config.name!r} fixes {field} = "
          f"{overrides[field]!r} (it defines the method), so this setting would be ignored. "
          f"Leave config.loss.{field} unset, or use an objective that reads it "
          "(e.g. 'grpo', whose clip widths and aggregation are the config's).")
    if field not in overrides and field not in read:
      raise ValueError(
          f"config.loss.{field} = {value!r}: objective {config.name!r} (with corrections "
          f"{correction_chain(loss_fn, config)}) never reads {field}, so this setting would "
          f"be ignored. Leave config.loss.{field} at its default, or choose an objective or "
          "correction that uses it.")


def _same(a, b) -> bool:
  """Config values equal, tuples and lists alike (a flag gives a tuple as a list)."""
  as_tuple = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
  return as_tuple(a) == as_tuple(b)


def correction_chain(loss_fn: LossFn, config) -> tuple[str, ...]:
  """The corrections an objective applies: its own (an `Objective`'s; a plain function
  registered with `register_loss` has none), then config.loss.corrections."""
  return tuple(getattr(loss_fn, "corrections", ())) + resolve_config(config).corrections


def needs_prox(config) -> bool:
  """Whether the objective `config.name` (with its corrections) reads proximal log-probs."""
  loss_fn = get_loss(config.name)
  return bool(getattr(loss_fn, "uses_prox", False)) or any(
      corr.get_correction(n).needs_prox for n in correction_chain(loss_fn, config))


# --- Per-token surrogates: (TokenTerms, resolved config) -> (per-token loss, metrics) ---


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
  the interval of `clip_interval`."""
  lo, hi = clip_interval(adv, eps_low, eps_high, clip_scale)
  clipped = jnp.clip(ratio, lo, hi)
  return -jnp.minimum(ratio * adv, clipped * adv), (ratio * adv > clipped * adv)


def clipped_surrogate(terms: corr.TokenTerms, cfg, widths: tuple[str, str] = ("eps_low", "eps_high")
                      ) -> tuple[jax.Array, dict]:
  """PPO-clip / GRPO: token ratio against prox when supplied (decoupled PPO), else behav,
  clipped with the widths in the config.loss fields `widths` (Mu-GRPO: its relaxed band)."""
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


VCPO_IS_LEVELS = ("sequence", "token")


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
  with the weight truncated at config field `cap` (VCPO): value min(r, C), gradient
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
  corrections chain -> surrogate * weight -> (+KL) -> aggregation.

  surrogate: (TokenTerms, resolved config) -> (per-token loss, metrics).
  corrections: the method's own `rl.objectives.corrections` chain (config.loss.corrections follow).
  uses_prox: whether the method needs proximal log-probs (decoupled PPO).
  overrides: config.loss fields that define the method (e.g. DAPO's eps_high=0.28).
  reads: the config.loss fields the surrogate reads (`check_settings_read` refuses a
  setting no part of the objective reads).
  per_token: whether each token's loss depends on its own log-ratio alone (False for
  sequence-level ratios and weights: GSPO, VCPO).
  """
  name: str
  doc: str
  surrogate: Callable
  corrections: tuple[str, ...] = ()
  uses_prox: bool = False
  overrides: Mapping[str, object] = dataclasses.field(default_factory=dict)
  reads: tuple[str, ...] = ()
  per_token: bool = True

  def __call__(self, logp: jax.Array, batch: Rollout, *, prox_logp=None,
               config) -> tuple[jax.Array, dict]:
    corrections, uses_prox, surrogate = self.corrections, self.uses_prox, self.surrogate
    cfg = resolve_config(config, self.overrides)
    mask = batch.completion_mask.astype(jnp.float32)
    terms = corr.TokenTerms(
        logp=logp, behav=batch.behavior_logp,
        prox=None if prox_logp is None else corr.sg(prox_logp),
        advantages=batch.advantages, mask=mask, weight=jnp.ones_like(logp),
        clip_scale=jnp.ones_like(logp), reward=batch.reward, group=batch.group)
    if uses_prox and terms.prox is None:
      raise ValueError("This objective needs prox_logp; build the train step with rl.train, "
                       "which supplies it (config.loss.prox_estimate).")
    terms, metrics = corr.chain(corrections + cfg.corrections, terms, cfg)
    per_token, surrogate_metrics = surrogate(terms, cfg)
    per_token = per_token * corr.sg(terms.weight)
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


def make_objective(surrogate: Callable, corrections: tuple[str, ...] = (),
                   uses_prox: bool = False, *, name: str = "", doc: str = "",
                   reads: tuple[str, ...] = (), per_token: bool = True,
                   **overrides) -> Objective:
  """An `Objective` from a surrogate; `reads` names the config.loss fields it reads and
  `overrides` fix the config.loss fields that define the method."""
  return Objective(name=name or getattr(surrogate, "__name__", "objective"),
                   doc=doc or (surrogate.__doc__ or ""), surrogate=surrogate,
                   corrections=tuple(corrections), uses_prox=uses_prox,
                   overrides=dict(overrides), reads=tuple(reads), per_token=per_token)


_EPS = ("eps_low", "eps_high")  # the PPO clip widths clipped_surrogate reads by default


def _register(name: str, doc: str, *args, **kwargs) -> Objective:
  return register_loss(name)(make_objective(*args, name=name, doc=doc, **kwargs))


ppo_clip_loss = _register(
    "grpo", "PPO-clip / GRPO (DeepSeekMath): -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r "
    "against prox when supplied, else behav; optional k3 KL (config.kl_coef).", clipped_surrogate,
    reads=_EPS)
_register("dapo", "DAPO: PPO-clip with clip-higher (0.2 / 0.28) and token-mean aggregation. "
          "(Dynamic sampling and overlong shaping act on the data and rewards, not the loss.)",
          clipped_surrogate, reads=_EPS, eps_low=0.2, eps_high=0.28, aggregation="token_mean")
_register("drgrpo", "Dr.GRPO: PPO-clip with a constant normaliser (seq_mean_token_sum_norm, "
          "norm_len); pair with config.advantage.name='drgrpo' (no std division).",
          clipped_surrogate, reads=_EPS, aggregation="seq_mean_token_sum_norm")
_register("gspo", "GSPO: sequence-level ratio exp(mean_t(logp - old)), clipped at sequence level "
          "(eps 3e-4 / 4e-4); one loss per sequence.",
          gspo_surrogate, reads=_EPS, per_token=False, eps_low=3e-4, eps_high=4e-4,
          aggregation="seq_mean_token_mean")
_register("gspo_token", "GSPO-token: per-token ratio sg(s_i) exp(logp - sg(logp)), clipped at "
          "eps 3e-4 / 4e-4; equals GSPO when a sequence's tokens share an advantage.",
          gspo_token_surrogate, reads=_EPS, per_token=False, eps_low=3e-4, eps_high=4e-4,
          aggregation="seq_mean_token_mean")
_register("decoupled", "Decoupled PPO (AReaL): clip exp(logp - prox) and weight by "
          "sg(min(exp(prox - behav), is_cap)) (the 'tis' correction; cap 5 by default; use "
          "name='grpo', corrections=('mis',) for the masking variant).",
          clipped_surrogate, corrections=("tis",), uses_prox=True, reads=_EPS)
_register("m2po", "M2PO: unclipped -(1/N) sum m M exp(logp - behav) A with the second-moment "
          "mask M (the 'm2po' correction), N = valid tokens.",
          importance_pg_surrogate(None), corrections=("m2po",), aggregation="token_mean")
_register("sat", "SAT: PPO-clip against behav whose high-mismatch tokens get a contracted "
          "interval (the 'sat' correction).", clipped_surrogate, corrections=("sat",),
          reads=_EPS)
_register("vcpo", "VCPO: policy gradient with one truncated IS weight per sequence "
          "(min(w_i, vcpo_is_cap = 8); vcpo_is_level='token' truncates per token), the "
          "off-policy optimal baseline per group, and the ESS learning-rate scale "
          "sqrt(min(1, rho / vcpo_rho_ref)) (metrics['lr_scale']).",
          vcpo_surrogate, corrections=("vcpo_baseline", "vcpo_ess"),
          reads=("vcpo_is_cap", "vcpo_is_level"), per_token=False)
_register("mu_grpo", "Mu-GRPO (arXiv 2605.17570): PPO-clip with the relaxed interval "
          "[1 - mu_eps_low, 1 + mu_eps_high] (default [1/2, 2]: keeps the gradients of stale "
          "tokens that eps 0.2 would clip) and the negative-advantage veto (the 'mu_veto' "
          "correction: a response with A < 0 loses its tokens from the first one whose ratio "
          "leaves that interval). The paper trains in a few large stages: many updates per "
          "rollout batch (rl.num_minibatches; docs/concepts.md).",
          functools.partial(clipped_surrogate, widths=("mu_eps_low", "mu_eps_high")),
          corrections=("mu_veto",), reads=("mu_eps_low", "mu_eps_high"))

@register_loss("sft")
def sft_loss(logp: jax.Array, batch: Rollout, *, prox_logp=None, config) -> tuple[jax.Array, dict]:
  """Supervised warm start: negative log-likelihood of the completion tokens."""
  del prox_logp
  nll = aggregate(-logp, batch.completion_mask, config.aggregation, config.norm_len)
  return nll, {"nll": nll}
