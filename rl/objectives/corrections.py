"""Off-policy corrections as composable transforms (docs/concepts.md, Objectives).

A correction is a small pure function `apply(terms) -> (terms, metrics)` that reads the
per-token log-ratios, advantages and masks of a batch (`TokenTerms`) and rewrites the
detached per-token `weight`, the per-token `clip_scale` or the `advantages`. It is built
by a factory whose keyword arguments are its hyperparameters, as optax builds
`scale_by_adam(b1, b2)`: `truncated_is(is_cap=2.0)` returns a correction that truncates at
2, and the factory's defaults are those of the fields of `rl.objectives.losses.LossSettings`
that feed it.

Corrections are selected by name (`config.loss.corrections=('tis',)`) and chained in order
onto any objective of `rl.objectives.losses`, so M2PO masking on top of DAPO is a chain, not a new
objective. The registry records for each name its factory, whether it reads proximal
log-probs, and which `config.loss` field feeds which factory argument (`m2_tau` -> `tau`),
so `chain` builds each correction from the run's `LossSettings` and the config names stay
flat.

Two log-ratios appear. The staleness proxy `d = sg(logp - behav)` (how far the policy being
trained has moved from the sampler) drives M2PO, SAT, VCPO and Mu-GRPO's veto. The
proximal gap `prox - behav` (the sampler against the parameters at the start of this
update) drives TIS / MIS and decoupled PPO; corrections that read it declare
`needs_prox`, and the train step then supplies `prox_logp` (`config.loss.prox_estimate`: a
recomputing forward or the log-linear approximation, see `loglinear_prox`).

Cross-stage IS (CoPRIS): a sequence generated across several parameter versions (partial
rollouts) carries the concatenation of its per-segment sampler log-probs in
`behavior_logp`, and every ratio here is taken per token against exactly that array, so
the sequence ratio `exp(sum_t m * (logp - behav))` is against the concatenation.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Callable, Mapping, Optional

import flax.struct
import jax
import jax.numpy as jnp

from rl.objectives import advantages
from rl.registry import Registry

sg = jax.lax.stop_gradient


@flax.struct.dataclass
class TokenTerms:
  """What objectives and corrections read, per token [B, T] (group, reward: [B]).

  logp: current log-probs (carry the gradient; corrections only read sg(logp), except that
  Mu-GRPO's veto detaches the tokens it drops).
  behav: sampler log-probs (the concatenation across versions for cross-stage sequences).
  prox: proximal log-probs (parameters at the start of this update) or None.
  advantages: per-token advantages. mask: float 0/1 valid completion tokens (the
  normaliser of the aggregation; corrections never change it). weight: detached per-token
  multiplier of the per-token loss (IS weights; 0 masks a token out). clip_scale: per-token
  factor in (0, 1] on the clip widths eps_low / eps_high (SAT).
  head_logp [B, T, K]: the current log-probs of the sampler's top-K tokens at each slot
  (carry the gradient), and behav_head [B, T, K] the sampler's own (`Rollout.behavior_topk`),
  when a correction reads them (score centering), else None. extra [B, T]: a per-token term
  added to the loss after the weights (score centering's), or None. tis_cap: the truncation
  of the 'tis' correction applied earlier in the chain (static), else None.
  """
  logp: jax.Array
  behav: jax.Array
  prox: Optional[jax.Array]
  advantages: jax.Array
  mask: jax.Array
  weight: jax.Array
  clip_scale: jax.Array
  reward: jax.Array
  group: jax.Array
  head_logp: Optional[jax.Array] = None
  behav_head: Optional[jax.Array] = None
  extra: Optional[jax.Array] = None
  tis_cap: Optional[float] = flax.struct.field(pytree_node=False, default=None)

  @property
  def stale_log_ratio(self) -> jax.Array:
    """d = sg(logp - behav), zero on invalid tokens."""
    return sg(self.logp - self.behav) * self.mask

  @property
  def old(self) -> jax.Array:
    """The anchor of PPO-style ratios: prox when supplied, else the sampler's behav."""
    return self.behav if self.prox is None else self.prox


Correction = Callable[[TokenTerms], tuple[TokenTerms, dict]]
CorrectionFactory = Callable[..., Correction]


class Scope(enum.IntEnum):
  """How much of the batch one token's loss term depends on, narrowest first: what an
  objective or a correction declares, and what a batch stage that keeps a subset of the
  tokens must preserve (rl.objectives.token_subsample).

  TOKEN: the token's own log-probs, advantage and weights. ROW_PREFIX: also those of the
  earlier tokens of its row (Mu-GRPO's veto). ROW: every token of its row (a sequence
  ratio). BATCH: statistics over every token of the (micro)batch (M2PO's mask, SAT's
  quantile, VCPO's ESS and baseline).
  """
  TOKEN = 0
  ROW_PREFIX = 1
  ROW = 2
  BATCH = 3


@dataclasses.dataclass(frozen=True)
class CorrectionSpec:
  """A registered correction and what it declares of itself (`register_correction`):

  factory: builds the correction from its hyperparameters. needs_prox: reads `terms.prox`
  (the train step then supplies proximal log-probs). fields: factory argument -> the
  config.loss field that supplies it. reads_logp: reads the staleness proxy d = sg(logp -
  behav). replaces_logp: replaces some tokens' logp (Mu-GRPO's veto gives a dropped token
  the anchor's value, so a later reader of d would count it as on-policy; `check_chain`
  refuses that order). reads_sampler_topk: reads the sampler's top-K record and the current
  log-probs of its tokens (the launcher then records `Rollout.behavior_topk`). scope: the
  widest part of the batch a token's term then depends on (`Scope`). scales_with_advantage:
  scaling a token's advantage by c > 0 scales what the correction makes of its term by c
  (False: it computes advantages of its own, VCPO's baseline). masks_tokens: it takes some
  tokens out of the update (weight 0: MIS, M2PO, the veto).

  Truncated IS built from the run's settings, on three tokens whose proximal-to-sampler
  ratios are 1, 2 and 10: the third is truncated at is_cap = 5.

  >>> import jax.numpy as jnp
  >>> from rl.settings.loss import LossSettings
  >>> ones = jnp.ones((1, 3))
  >>> terms = TokenTerms(logp=jnp.log(ones / 2), behav=jnp.log(jnp.array([[0.5, 0.25, 0.05]])),
  ...                    prox=jnp.log(ones / 2), advantages=ones, mask=ones, weight=ones,
  ...                    clip_scale=ones, reward=jnp.ones(1), group=jnp.zeros(1, jnp.int32))
  >>> spec = get_correction("tis")
  >>> spec.needs_prox, spec.fields
  (True, {'is_cap': 'is_cap'})
  >>> weighted, metrics = spec.build(LossSettings(is_cap=5.0))(terms)
  >>> weighted.weight.round(4).tolist(), round(float(metrics["is_truncated_fraction"]), 4)
  ([[1.0, 2.0, 5.0]], 0.3333)
  """
  factory: CorrectionFactory
  needs_prox: bool = False
  fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
  reads_logp: bool = False
  replaces_logp: bool = False
  reads_sampler_topk: bool = False
  scope: Scope = Scope.TOKEN
  scales_with_advantage: bool = True
  masks_tokens: bool = False

  def build(self, settings) -> Correction:
    """The correction with its hyperparameters read from `settings` (a LossSettings)."""
    return self.factory(**{arg: getattr(settings, field) for arg, field in self.fields.items()})


CORRECTIONS: Registry[CorrectionSpec] = Registry("correction", "config.loss.corrections")


def register_correction(name: str, needs_prox: bool = False,
                        fields: Optional[Mapping[str, str]] = None, *,
                        reads_logp: bool = False, replaces_logp: bool = False,
                        reads_sampler_topk: bool = False, scope: Scope = Scope.TOKEN,
                        scales_with_advantage: bool = True, masks_tokens: bool = False):
  """Decorator adding a correction factory to the registry (`CORRECTIONS`).

  Args:
    name: the correction's name in config.loss.corrections.
    needs_prox: whether it reads `terms.prox` (the train step then supplies proximal
      log-probs).
    fields: factory argument -> the `LossSettings` field that supplies it (each must be an
      argument of the factory).
    reads_logp, replaces_logp, reads_sampler_topk, scope, scales_with_advantage,
      masks_tokens: what it declares of itself (`CorrectionSpec`); the launcher refuses, from
      these, a chain, objective or batch stage it does not compose with.

  Returns:
    A decorator that registers the factory and returns it unchanged.
  """
  def wrap(factory: CorrectionFactory) -> CorrectionFactory:
    unknown = set(fields or {}) - set(inspect.signature(factory).parameters)
    if unknown:
      raise ValueError(f"Correction {name!r}: {sorted(unknown)} are not arguments of "
                       f"{factory.__name__}.")
    CORRECTIONS.register(name, CorrectionSpec(
        factory, needs_prox, dict(fields or {}), reads_logp, replaces_logp,
        reads_sampler_topk, Scope(scope), scales_with_advantage, masks_tokens))
    return factory
  return wrap


get_correction = CORRECTIONS.get  # the CorrectionSpec named in config.loss.corrections


def check_chain(names, objective=None) -> None:
  """Raises ValueError when a correction appears twice in `names`, when one that reads the
  staleness proxy d follows one that replaces logp (after 'mu_veto', a vetoed token's logp
  is its anchor's, so 'm2po', 'sat' or VCPO would count it as exactly on-policy, d = 0, in
  their batch statistics), and when score centering does not compose with the chain or with `objective` (an
  `rl.objectives.losses.Objective`, whose declared `scope` and `ratio_anchor` are read;
  `check_score_centering`)."""
  names = tuple(names)
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"config.loss.corrections: {repeated[0]!r} appears twice in the chain "
                     f"{names} (the objective's own corrections come first), so it would act "
                     f"twice (a weight squared, a metric overwritten); leave it out of "
                     "config.loss.corrections.")
  if "score_centering" in names:
    check_score_centering(names, objective)
  replaced_by = None
  for name in names:
    spec = get_correction(name)
    if replaced_by is not None and spec.reads_logp:
      raise ValueError(
          f"Correction {name!r} after {replaced_by!r} (config.loss.corrections, after the "
          f"objective's own chain): {replaced_by!r} replaces the log-probs of the tokens it "
          f"drops, so {name!r} would read them as on-policy. Put {name!r} before "
          f"{replaced_by!r} (e.g. name='grpo', corrections=({name!r}, {replaced_by!r})) or "
          "leave it out.")
    if spec.replaces_logp:
      replaced_by = name


SCORE_CENTERING_OBJECTIVES = "grpo, dapo, drgrpo, decoupled or sat"


def check_score_centering(names: tuple[str, ...], objective=None) -> None:
  """Score centering's estimator, A [w(y) grad log p(y) - E_q[w grad log p]], subtracts
  the expectation of the very weight w the sampled token carries (`score_centering`). It
  is defined where that weight is the chain's IS weight (1, or 'tis''s min(r, is_cap)) times
  PPO's per-token ratio to the proximal policy, which is 1 at a batch's first update:
  refused after a correction that takes tokens out of the update (MIS, M2PO's mask, the
  veto: the weight of a dropped token has no expectation), with 'tis' after it, and with an
  objective whose sampled weight is another (a sequence ratio: GSPO, VCPO; an IS ratio to
  the sampler: M2PO, VCPO)."""
  masking = [n for n in names if get_correction(n).masks_tokens]
  if masking:
    raise ValueError(
        f"config.loss.corrections: 'score_centering' subtracts the expected score under "
        f"the weight the sampled token carries, and {masking[0]!r} (in the chain "
        f"{names}) takes some tokens out of the update, whose weight has no expectation. "
        "Use ('score_centering',) or ('tis', 'score_centering') with "
        f"{SCORE_CENTERING_OBJECTIVES}.")
  if "tis" in names and names.index("tis") > names.index("score_centering"):
    raise ValueError("config.loss.corrections: put 'tis' before 'score_centering' (it "
                     "weights the expected score with the same truncated ratios).")
  if objective is None:
    return
  if objective.scope != Scope.TOKEN or objective.ratio_anchor != "old":
    weight = ("a sequence's ratio" if objective.scope != Scope.TOKEN
              else "its IS ratio to the sampler, exp(logp - behav)")
    raise ValueError(
        f"config.loss.name = {objective.name!r} with 'score_centering': the centering term "
        "is the expectation of the weight the sampled token carries (1, or min(p / q, "
        f"is_cap) after 'tis'), and {objective.name!r} weights the sampled token by "
        f"{weight}. Use {SCORE_CENTERING_OBJECTIVES}.")


def chain(names, terms: TokenTerms, settings, objective=None) -> tuple[TokenTerms, dict]:
  """Builds the named corrections from `settings` (a LossSettings) and applies them in
  order (refusing what `check_chain` refuses with `objective`); metrics of later ones win
  on name clashes."""
  check_chain(names, objective)
  metrics = {}
  for name in names:
    terms, m = get_correction(name).build(settings)(terms)
    metrics.update(m)
  return terms, metrics


def _masked_mean(x, mask):
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _require_prox(terms: TokenTerms, name: str) -> jax.Array:
  if terms.prox is None:
    raise ValueError(f"Correction {name!r} needs proximal log-probs; the train step supplies "
                     "them when the objective is built with rl.objectives.losses (prox_logp=None here).")
  return sg(terms.prox)


# --- Importance weights against the proximal policy (TIS / MIS, decoupled PPO) ---------


@register_correction("tis", needs_prox=True, fields=dict(is_cap="is_cap"))
def truncated_is(is_cap: float = 5.0) -> Correction:
  """Truncated IS (TIS; also AReaL decoupled PPO's behaviour weight): multiplies each
  token's loss by sg(min(exp(prox - behav), is_cap)), bounding the weight's variance."""
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    log_w = _require_prox(terms, "tis") - terms.behav
    w = jnp.exp(jnp.minimum(log_w, jnp.log(is_cap)))
    truncated = (log_w > jnp.log(is_cap)).astype(jnp.float32)
    return terms.replace(weight=terms.weight * w, tis_cap=is_cap), {
        "is_weight_mean": _masked_mean(w, terms.mask),
        "is_truncated_fraction": _masked_mean(truncated, terms.mask)}
  return apply


@register_correction("mis", needs_prox=True, fields=dict(is_cap="is_cap", is_floor="is_floor"),
                     masks_tokens=True)
def masked_is(is_cap: float = 5.0, is_floor: float = 0.0) -> Correction:
  """Masked IS (MIS): zero tokens whose exp(prox - behav) leaves [is_floor, is_cap]; kept
  tokens are weighted by that ratio (the decoupled-PPO 'mask' mode), so outliers drop out
  instead of being clipped."""
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    log_w = _require_prox(terms, "mis") - terms.behav
    w = jnp.exp(log_w)
    keep = (w >= is_floor) & (w <= is_cap)
    return terms.replace(weight=terms.weight * jnp.where(keep, w, 0.0)), {
        "masked_fraction": _masked_mean(1.0 - keep.astype(jnp.float32), terms.mask)}
  return apply


# --- Score centering ------------------------------------------------------------------


def score_centering_coefficients(head_logp: jax.Array, behav_head: jax.Array,
                                 tis_cap: Optional[float], eps: float
                                 ) -> tuple[jax.Array, jax.Array]:
  """Score centering's detached coefficients c_v [..., K] over the sampler's top-K head H,
  and rho [...] (`score_centering` has the formula).

  head_logp: the trainer's log p(v) for v in H (only its value is read); behav_head: the
  sampler's log q(v) (-inf: a token the sampler's truncation removed). With TIS (tis_cap
  = C) w_v = min(p_v / q_v, C), computed as q_v w_v = min(p_v, C q_v) so that q_v = 0
  needs no division, and alpha = rho f(1 / rho) = min(1, C rho); standalone w = 1 and
  alpha = rho.
  """
  p = jnp.exp(sg(head_logp))
  q = jnp.exp(behav_head)
  rho = jnp.clip(1.0 - q.sum(axis=-1), 0.0, 1.0) / jnp.maximum(1.0 - p.sum(axis=-1), eps)
  if tis_cap is None:
    q_weighted, alpha = q, rho
  else:
    q_weighted, alpha = jnp.minimum(p, tis_cap * q), jnp.minimum(1.0, tis_cap * rho)
  return sg(q_weighted - alpha[..., None] * p), rho


@register_correction("score_centering", needs_prox=True, fields=dict(eps="sc_eps"),
                     reads_sampler_topk=True)
def score_centering(eps: float = 1e-6) -> Correction:
  """Score centering (arXiv 2609.20807; Tunix's agentic GRPO learner): subtract from each
  token's policy gradient the expected score under the distribution that sampled it.

  For a token y drawn from the sampler's q with advantage A, the estimate is

      g = A [w(y) grad log p(y) - E_{v ~ q^}[w^(v) grad log p(v)]]

  with w(v) = f(p(v) / q(v)): standalone f = 1; after 'tis' in the chain f(r) =
  min(r, is_cap), the same truncation as the sampled token's weight. On-policy (q = p) the
  expectation is E_p[grad log p] = 0, so nothing changes; off-policy (a quantised or stale
  sampler) it removes the drift a mismatched sampler adds to the score. After 'tis' the
  expectation is nonzero only where the truncation binds: E_q[(p / q) grad log p] =
  E_p[grad log p] = 0.

  q^ is the sampler's top-K head H (`Rollout.behavior_topk`) with the tail scaled from the
  trainer: q^(v) = q(v) on H, rho p(v) off it, rho = clip(1 - sum_H q, 0, 1) /
  max(1 - sum_H p, eps) (config.loss.sc_eps). Since sum_V p grad log p = 0, the tail's
  expectation is -alpha sum_H p grad log p with alpha = rho f(1 / rho), so the whole
  expectation is the head-only sum sum_H c_v grad log p(v), c_v = sg(q_v w_v - alpha p_v)
  (`score_centering_coefficients`), and the correction adds the per-token loss term
  A * sum_H c_v log p(v): differentiating log p(v) = z_v - logsumexp(z) reaches every
  logit, so the full-vocabulary gradient costs O(K). With K = V (the whole vocabulary,
  config.loss.sc_top_k = 0) the tail is empty and the expectation is exact.

  The sampled token carries exactly w(y): the correction declares `needs_prox`, so the
  train step supplies proximal log-probs and the objective's PPO ratio is taken against
  them, p / prox = 1 at a batch's first update, times the chain's IS weight (1 standalone;
  'tis''s min(prox / q, is_cap)). Taken against the sampler instead, a standalone run
  would weight the sampled token by p / q and its expectation by 1, which is neither
  estimator.

  Choices where the source leaves them open: p(v) in w and in the coefficients is the
  current policy's, detached (the proximal policy's at a batch's first update, the only
  update with the default one update per batch); later updates of the same batch
  (rl.num_minibatches or rl.ppo_epochs > 1) multiply the sampled term by PPO's ratio
  p / prox and clip it, as every PPO objective does, and the term added here is neither
  multiplied by that ratio nor clipped. Refused (`check_score_centering`): corrections
  that take tokens out of the update (mis, m2po, mu_veto), 'tis' after it, and objectives
  whose sampled weight is another (GSPO's and VCPO's sequence ratios, M2PO's ratio to the
  sampler).
  """
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    if terms.head_logp is None or terms.behav_head is None:
      raise ValueError("'score_centering' needs the sampler's top-K record "
                       "(Rollout.behavior_topk) and the trainer's log-probs of its tokens; "
                       "the launcher's train step supplies both (rl.objectives.composite).")
    coef, rho = score_centering_coefficients(terms.head_logp, terms.behav_head,
                                             terms.tis_cap, eps)
    center = jnp.sum(coef * terms.head_logp, axis=-1)
    term = jnp.where(terms.mask > 0, terms.advantages * center, 0.0)
    extra = term if terms.extra is None else terms.extra + term
    return terms.replace(extra=extra), {
        "sc_score_shift": _masked_mean(expected_score_norm(coef, terms.head_logp), terms.mask),
        "sc_head_mass": _masked_mean(jnp.exp(terms.behav_head).sum(axis=-1), terms.mask),
        "sc_rho_mean": _masked_mean(rho, terms.mask)}
  return apply


def expected_score_norm(coef: jax.Array, head_logp: jax.Array) -> jax.Array:
  """The L1 norm, over the logits z, of the expected score score centering subtracts,
  sum_H c_v grad_z log p(v) = sum_H c_v (e_v - p), per token [...] from its head
  coefficients and log-probs: sum_H |c_v - C p_v| + |C| (1 - sum_H p), C = sum_H c. 0
  on-policy (whatever K), so it measures the drift the correction removes."""
  p = jnp.exp(sg(head_logp))
  total = coef.sum(axis=-1)
  tail = jnp.maximum(1.0 - p.sum(axis=-1), 0.0)
  return jnp.abs(coef - total[..., None] * p).sum(axis=-1) + jnp.abs(total) * tail


def loglinear_prox(logp: jax.Array, behav: jax.Array, version: jax.Array,
                   prox_version, current_version) -> jax.Array:
  """Proximal log-probs without a forward pass (log-linear in parameter-version space).

  prox ~ behav + alpha * (sg(logp) - behav), alpha = (v_prox - v_behav) / (v_theta - v_behav)
  clipped to [0, 1] per token; alpha = 0 for fresh tokens (v_behav >= v_prox) and 1 when
  the proximal policy is the current one. [B, T] -> [B, T].
  """
  v_behav = version.astype(jnp.float32)
  gap = jnp.asarray(current_version, jnp.float32) - v_behav
  ahead = jnp.asarray(prox_version, jnp.float32) - v_behav
  alpha = jnp.clip(jnp.where(gap > 0, ahead / jnp.where(gap > 0, gap, 1.0), 0.0), 0.0, 1.0)
  return behav + alpha * (sg(logp) - behav)


# --- M2PO: second-moment trust via minimal masking -----------------------------------


def m2_mask(d: jax.Array, mask: jax.Array, tau: float) -> jax.Array:
  """M2PO's mask (1 keep / 0 drop) [B, T]: drop the tokens with the largest d^2, largest
  first, until the mean d^2 of the valid tokens kept is <= tau.

  Dropping largest-first gives the fewest dropped tokens (for a fixed count, dropping the
  largest values minimises the mean of the rest), and the kept mean is non-increasing in
  the count, so the first count that satisfies the bound is the minimal mask. One sort and
  one cumulative sum; ties break by position (stable sort). If no single token is within
  tau, every token is dropped (the empty set's mean is taken as 0).

  The kept sums are suffix sums of the sorted d^2, accumulated from the smallest value up,
  not the total minus the dropped prefix: that difference cancels catastrophically when
  the dropped tokens dominate, leaving a float residue that made "drop everything" look
  unsatisfiable (so nothing was dropped) or a kept set look within tau when it was not.
  """
  mask = mask.astype(jnp.float32)
  flat_d2 = jnp.where(mask > 0, d * d, -1.0).reshape(-1)  # invalid tokens sort last
  n = mask.sum()
  order = jnp.argsort(-flat_d2, stable=True)
  sorted_d2 = jnp.maximum(flat_d2[order], 0.0)  # invalid tokens: 0, at the end
  # kept_sum[j]: sum of the d^2 kept when the j largest are dropped (j = 0..BT); exactly 0
  # for j >= n, so dropping every valid token always satisfies the bound.
  kept_sum = jnp.concatenate([jnp.cumsum(sorted_d2[::-1])[::-1], jnp.zeros((1,))])
  j = jnp.arange(kept_sum.shape[0], dtype=jnp.float32)
  ok = (kept_sum <= tau * (n - j)) & (j <= n)
  num_drop = jnp.argmax(ok)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  keep = (rank >= num_drop).reshape(mask.shape).astype(jnp.float32)
  return keep * mask + (1.0 - mask)  # invalid tokens are left to the aggregation mask


@register_correction("m2po", fields=dict(tau="m2_tau"), reads_logp=True, scope=Scope.BATCH,
                     masks_tokens=True)
def m2po_mask(tau: float = 0.04) -> Correction:
  """M2PO (second-moment trust policy optimisation): zero the fewest, largest-d^2 tokens so
  that the kept tokens' mean squared log-ratio d = sg(logp - behav) is <= tau
  (config.loss.m2_tau), a trust region on the second moment rather than on each ratio."""
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    d = terms.stale_log_ratio
    keep = m2_mask(d, terms.mask, tau)
    return terms.replace(weight=terms.weight * keep), {
        "m2": _masked_mean(d * d, terms.mask),
        "masked_fraction": _masked_mean(1.0 - keep, terms.mask)}
  return apply


# --- SAT: staleness-adaptive trust region --------------------------------------------


def sat_kernel(abs_d: jax.Array, mask: jax.Array, quantile: float, bandwidth: float) -> jax.Array:
  """SAT's kernel factor k in (0, 1] per token [B, T]: 1 up to the batch `quantile` q of
  |d| over valid tokens, exp(-(|d| - q) / bandwidth) beyond it (the chosen kernel)."""
  q = jnp.nanquantile(jnp.where(mask > 0, abs_d, jnp.nan), quantile)
  q = jnp.where(jnp.isfinite(q), q, 0.0)
  return jnp.exp(-jnp.maximum(abs_d - q, 0.0) / bandwidth)


@register_correction("sat", fields=dict(quantile="sat_quantile", bandwidth="sat_bandwidth"),
                     reads_logp=True, scope=Scope.BATCH)
def staleness_adaptive_trust(quantile: float = 0.9, bandwidth: float = 0.1) -> Correction:
  """SAT (staleness-adaptive trust region): shrink the PPO clip width of high-mismatch
  tokens by `sat_kernel`, 1 up to the batch `quantile` of |d| and decaying over
  `bandwidth` beyond it (config.loss.sat_quantile / sat_bandwidth); the clipped objective
  contracts only the endpoint the advantage sign selects."""
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    k = sat_kernel(jnp.abs(terms.stale_log_ratio), terms.mask, quantile, bandwidth)
    return terms.replace(clip_scale=terms.clip_scale * k), {
        "sat_kernel_mean": _masked_mean(k, terms.mask),
        "sat_contracted_fraction": _masked_mean((k < 1.0).astype(jnp.float32), terms.mask)}
  return apply


# --- VCPO: variance control ----------------------------------------------------------


def sequence_log_weights(terms: TokenTerms) -> jax.Array:
  """log w_i = sum_t m * sg(logp - behav) [B]: the unclipped sequence IS log-weight
  (against the concatenated behaviour log-probs of cross-stage sequences)."""
  return terms.stale_log_ratio.sum(axis=1)


def effective_sample_size_ratio(log_w: jax.Array) -> jax.Array:
  """rho = (sum w)^2 / (B * sum w^2) in (0, 1], computed in log space. [B] -> []."""
  log_b = jnp.log(jnp.asarray(log_w.shape[0], jnp.float32))
  return jnp.exp(2.0 * jax.nn.logsumexp(log_w) - log_b - jax.nn.logsumexp(2.0 * log_w))


def ess_lr_scale(rho: jax.Array, rho_ref: float) -> jax.Array:
  """VCPO's learning-rate multiplier sqrt(min(1, rho / rho_ref)): the authors' reference
  (mit-han-lab/vcpo, `lr_scale = min(1.0, ess_ratio / base_ess_ratio)` then the "sqrt"
  rule) clamps before the square root, so a batch never raises the learning rate (with
  rho_ref < 1 an on-policy batch, rho = 1, keeps the base rate)."""
  return jnp.sqrt(jnp.minimum(1.0, rho / rho_ref))


@register_correction("vcpo_ess", fields=dict(rho_ref="vcpo_rho_ref"), reads_logp=True,
                     scope=Scope.BATCH)
def vcpo_step_scale(rho_ref: float = 1.0) -> Correction:
  """VCPO (a), variance-controlled policy optimisation: ESS step scaling,
  metrics['lr_scale'] = `ess_lr_scale(rho, rho_ref)` (config.loss.vcpo_rho_ref; the train
  step multiplies the update by it), so low-ESS batches take smaller steps; 1 on-policy.
  rho is the ESS ratio of the unclipped sequence weights (the reference's default,
  `use_clipped=False`)."""
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    rho = effective_sample_size_ratio(sequence_log_weights(terms))
    return terms, {"ess_ratio": rho, "lr_scale": ess_lr_scale(rho, rho_ref)}
  return apply


def optimal_baseline(log_w: jax.Array, g: jax.Array, reward: jax.Array,
                     group: jax.Array) -> jax.Array:
  """Off-policy variance-minimising baseline per group, b = sum w^2 g R / sum w^2 g,
  broadcast to rows [B]. log_w: log sequence IS weights, g > 0: squared score norms (or a
  proxy). Computed with per-group max-shifted weights, so large log-weights do not overflow.
  """
  same = group[:, None] == group[None, :]
  log_c = 2.0 * log_w + jnp.log(g)
  shift = jnp.max(jnp.where(same, log_c[None, :], -jnp.inf), axis=1, keepdims=True)
  c = jnp.where(same, jnp.exp(log_c[None, :] - shift), 0.0)
  return c @ reward / c.sum(axis=1)


@register_correction("vcpo_baseline", reads_logp=True, scope=Scope.BATCH,
                     scales_with_advantage=False)
def vcpo_baseline() -> Correction:
  """VCPO (b): advantages (R - b) / (std_group(R) + 1e-6) with the off-policy optimal
  baseline b replacing the group mean (the std keeps GRPO's scale). No hyperparameters.

  As in the authors' reference (mit-han-lab/vcpo `compute_opob_baseline`, scope "group",
  `use_is_weights=True`, `use_clipped_is_ratios=False`, `norm_by_std=True`): per group,
  b = sum_i W_i R_i / sum_i W_i with W_i = ||g_i||^2 w_i^2 and w_i the unclipped sequence
  IS weight; the update is then (R_i - b) / std_group(R) times the score (population std).

  Where it differs: the reference runs one backward per trajectory and takes ||g_i||^2,
  the squared norm of that trajectory's parameter gradient. Here g_i is a forward-only
  proxy: sum_t m (1 - p_t)^2, the sampled-token part of the squared logit gradient summed
  over tokens (cross-token terms, the other logits and the backward through the network
  ignored); a 1e-6 floor keeps confident sequences in play. The proxy preserves what the
  baseline needs (confident, short sequences weigh less) at no extra backward.
  """
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    g = ((1.0 - jnp.exp(sg(terms.logp))) ** 2 * terms.mask).sum(axis=1) + 1e-6
    reward = terms.reward.astype(jnp.float32)
    # Rewards shifted by the group's smallest, so equal rewards give exactly 0 (rl.objectives.advantages).
    shifted = reward - advantages.group_reference(reward, terms.group)
    b = optimal_baseline(sequence_log_weights(terms), g, shifted, terms.group)
    mean = advantages.group_mean(shifted, terms.group)
    adv = advantages.standardise(shifted - b, advantages.group_std(reward, terms.group),
                                 advantages.group_scale(reward, terms.group), 1e-6)
    return terms.replace(advantages=adv[:, None] * terms.mask), {
        "baseline_shift": jnp.mean(jnp.abs(b - mean))}
  return apply


# --- Mu-GRPO: negative-advantage veto ------------------------------------------------


def veto_keep(d: jax.Array, adv: jax.Array, mask: jax.Array, eps_low: float,
              eps_high: float) -> jax.Array:
  """Mu-GRPO's negative-advantage veto, 1 keep / 0 drop [B, T].

  In each row the trigger is the first valid token with A < 0 whose ratio exp(d) leaves
  [1 - eps_low, 1 + eps_high]; the trigger and every later token with A < 0 are dropped.
  Tokens with A >= 0 are always kept, so a GRPO row (one advantage for all its tokens) is
  either untouched or loses its suffix from the trigger on; invalid tokens are left to the
  aggregation mask.
  """
  ratio = jnp.exp(d)
  negative = (adv < 0) & (mask > 0)
  trigger = negative & ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high))
  after_trigger = jnp.cumsum(trigger.astype(jnp.int32), axis=1) > 0
  return 1.0 - (after_trigger & negative).astype(jnp.float32)


@register_correction("mu_veto", fields=dict(eps_low="mu_eps_low", eps_high="mu_eps_high"),
                     reads_logp=True, replaces_logp=True, scope=Scope.ROW_PREFIX,
                     masks_tokens=True)
def negative_advantage_veto(eps_low: float = 0.5, eps_high: float = 1.0) -> Correction:
  """Mu-GRPO (Tian, Xie and Wei, "How Off-Policy Can GRPO Be?", arXiv 2605.17570): the
  negative-advantage veto (`veto_keep`) on the staleness ratio exp(d), d = sg(logp - behav),
  with the relaxed band [1 - eps_low, 1 + eps_high] (config.loss.mu_eps_low / mu_eps_high).

  A stale negative-advantage response stops being a sample of the current policy at the
  first token the policy has moved far from; pushing down the tokens from there on is what
  destabilises training under large staleness, so they leave the update. The paper's
  abstract names the veto; the trigger rule (either side of the band, trigger included,
  the band being the clip interval) is our choice. A dropped token gets weight 0 and its
  logp is replaced by the detached anchor (`terms.old`: ratio 1), so it adds exactly zero
  loss and gradient even where exp(logp - old) overflows (a weight of 0 alone gives
  0 * inf = NaN); the surrogate's clip_fraction and ratio_mean count it at ratio 1. The
  aggregation normaliser is unchanged, so a row's kept prefix trains exactly as it would
  without the veto. A KL penalty (config.loss.kl_coef) still applies to dropped tokens.
  """
  def apply(terms: TokenTerms) -> tuple[TokenTerms, dict]:
    keep = veto_keep(terms.stale_log_ratio, terms.advantages, terms.mask, eps_low, eps_high)
    rows = (terms.mask.sum(axis=1) > 0).astype(jnp.float32)
    vetoed_rows = (((1.0 - keep) * terms.mask).sum(axis=1) > 0).astype(jnp.float32)
    return terms.replace(logp=jnp.where(keep > 0, terms.logp, sg(terms.old)),
                         weight=terms.weight * keep), {
        "vetoed_fraction": _masked_mean(1.0 - keep, terms.mask),
        "vetoed_response_fraction": vetoed_rows.sum() / jnp.maximum(rows.sum(), 1.0)}
  return apply
