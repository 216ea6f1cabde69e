"""The documented estimator of every objective, correction and token-subsampling scheme the
launcher offers, written independently of rl/ in float64 NumPy from the methods' docs
(docs/concepts.md, "Which estimator a combination computes"), for tests/test_combinations.py.

A combination's loss is a function of the log-probs it reads: the sampled tokens' `logp`
[B, T] and, for score centering, the sampler's top-K tokens' `head_logp` [B, T, K]. Its
documented estimator is written as the gradient of the loss with respect to those,

    dL / dlogp_t = agg_t * a_t,   dL / dhead_logp_{t,v} = agg_t * A_t * c_{t,v},

with agg_t the aggregation's weight of token t (token_mean: 1 / N; seq_mean_token_mean:
1 / (n_i R); seq_mean_token_sum_norm: 1 / (norm_len B)), a_t the objective's per-token
coefficient with the corrections' weight W_t, and c the score-centering coefficients; the
update the train step applies is that gradient times the objective's lr_scale (VCPO's ESS).

`estimator(...)` composes the pieces the way the docs state them: corrections act in
chain order on (W, clip scale, advantages, lr_scale), the objective's surrogate is taken
against the proximal log-probs when a piece that reads them is in the chain (decoupled
PPO, TIS, MIS, score centering), else against the sampler's. A name missing from
`OBJECTIVES` or `CORRECTIONS` has no documented estimator here: the harness fails for it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

# Pieces whose documented estimator takes the PPO ratio against the proximal policy.
PROX_OBJECTIVES = frozenset({"decoupled"})
PROX_CORRECTIONS = frozenset({"tis", "mis", "score_centering"})


@dataclasses.dataclass
class Problem:
  """One batch in float64: logp, prox, behav [B, T] (the sampled tokens' log-probs under
  the current, proximal and sampling policies); head_logp, behav_head [B, T, K] (the
  sampler's top-K tokens under the current policy and the sampler); advantages [B, T];
  mask [B, T] the completion tokens; reward, group [B]."""
  logp: np.ndarray
  prox: np.ndarray
  behav: np.ndarray
  head_logp: np.ndarray
  behav_head: np.ndarray
  advantages: np.ndarray
  mask: np.ndarray
  reward: np.ndarray
  group: np.ndarray


@dataclasses.dataclass
class State:
  """What corrections change, token by token (W: detached weight; clip: clip-width scale;
  A: advantages; kept: 0 where a correction dropped the token), and lr_scale; tis_cap
  remembers an earlier 'tis'; head: score centering's coefficients c [B, T, K] or None,
  and head_advantages the advantages its term multiplies (those of its place in the chain)."""
  W: np.ndarray
  clip: np.ndarray
  A: np.ndarray
  lr_scale: float = 1.0
  tis_cap: Optional[float] = None
  head: Optional[np.ndarray] = None
  head_advantages: Optional[np.ndarray] = None


def _valid(problem: Problem) -> np.ndarray:
  return problem.mask > 0


def _d(problem: Problem) -> np.ndarray:
  """The staleness proxy d = logp - behav, 0 off the mask."""
  return np.where(_valid(problem), problem.logp - problem.behav, 0.0)


# --- Corrections: (problem, state, settings) -> state --------------------------------


def tis(problem, state, s):
  """TIS: W *= min(exp(prox - behav), is_cap)."""
  state.W = state.W * np.minimum(np.exp(problem.prox - problem.behav), s.is_cap)
  state.tis_cap = s.is_cap
  return state


def mis(problem, state, s):
  """MIS: W *= w where is_floor <= w <= is_cap, else 0; w = exp(prox - behav)."""
  w = np.exp(problem.prox - problem.behav)
  state.W = state.W * np.where((w >= s.is_floor) & (w <= s.is_cap), w, 0.0)
  return state


def m2po(problem, state, s):
  """M2PO: drop the fewest valid tokens, largest d^2 first (ties: earlier position
  first), until the kept tokens' mean d^2 is <= m2_tau (none kept: mean 0)."""
  d2 = (_d(problem) ** 2).ravel()
  valid = np.flatnonzero(_valid(problem).ravel())
  order = sorted(valid, key=lambda i: (-d2[i], i))
  dropped = len(order)
  for count in range(len(order) + 1):
    rest = [d2[i] for i in order[count:]]
    if (sum(rest) / len(rest) if rest else 0.0) <= s.m2_tau:
      dropped = count
      break
  keep = np.ones(d2.shape)
  keep[order[:dropped]] = 0.0
  state.W = state.W * keep.reshape(problem.mask.shape)
  return state


def sat(problem, state, s):
  """SAT: clip *= exp(-max(|d| - q, 0) / sat_bandwidth), q the sat_quantile of |d| over
  the valid tokens (linear interpolation)."""
  abs_d = np.abs(_d(problem))
  q = np.quantile(abs_d[_valid(problem)], s.sat_quantile)
  state.clip = state.clip * np.exp(-np.maximum(abs_d - q, 0.0) / s.sat_bandwidth)
  return state


def _sequence_log_weights(problem):
  return _d(problem).sum(axis=1)


def vcpo_ess(problem, state, s):
  """VCPO (a): lr_scale = sqrt(min(1, rho / vcpo_rho_ref)), rho = (sum w)^2 / (B sum w^2)
  over the batch's B sequence weights w_i = exp(sum_t d)."""
  w = np.exp(_sequence_log_weights(problem))
  rho = w.sum() ** 2 / (len(w) * (w ** 2).sum())
  state.lr_scale *= float(np.sqrt(min(1.0, rho / s.vcpo_rho_ref)))
  return state


def vcpo_baseline(problem, state, s):
  """VCPO (b): A_t = (R_i - b_g) / (std_g(R) + 1e-6) on the row's valid tokens (0 where
  the group's rewards are equal), b_g = sum w^2 g R / sum w^2 g over the group, w the
  sequence weights and g = sum_t m (1 - p_t)^2 + 1e-6 (p_t the current probability)."""
  w = np.exp(_sequence_log_weights(problem))
  g = ((1.0 - np.exp(problem.logp)) ** 2 * problem.mask).sum(axis=1) + 1e-6
  reward = problem.reward
  advantages = np.zeros(len(reward))
  for i, group in enumerate(problem.group):
    members = problem.group == group
    c = w[members] ** 2 * g[members]
    baseline = (c * reward[members]).sum() / c.sum()
    std = reward[members].std()
    if std > 1e-6 * np.abs(reward[members]).max():
      advantages[i] = (reward[i] - baseline) / (std + 1e-6)
  state.A = advantages[:, None] * problem.mask
  return state


def mu_veto(problem, state, s):
  """Mu-GRPO's veto: in each row, from the first valid token with A < 0 whose ratio
  exp(d) leaves [1 - mu_eps_low, 1 + mu_eps_high] on, every token with A < 0 is dropped."""
  ratio = np.exp(_d(problem))
  for i in range(problem.mask.shape[0]):
    triggered = False
    for t in range(problem.mask.shape[1]):
      if not problem.mask[i, t] or state.A[i, t] >= 0:
        continue
      triggered |= not (1.0 - s.mu_eps_low <= ratio[i, t] <= 1.0 + s.mu_eps_high)
      if triggered:
        state.W[i, t] = 0.0
  return state


def score_centering(problem, state, s):
  """Score centering: c_v = q_v w_v - alpha p_v over the sampler's head H, with rho =
  clip(1 - sum_H q, 0, 1) / max(1 - sum_H p, sc_eps); standalone w = 1 and alpha = rho;
  after 'tis' (cap C) q_v w_v = min(p_v, C q_v) and alpha = min(1, C rho)."""
  p, q = np.exp(problem.head_logp), np.exp(problem.behav_head)
  rho = np.clip(1.0 - q.sum(-1), 0.0, 1.0) / np.maximum(1.0 - p.sum(-1), s.sc_eps)
  if state.tis_cap is None:
    weighted, alpha = q, rho
  else:
    weighted, alpha = np.minimum(p, state.tis_cap * q), np.minimum(1.0, state.tis_cap * rho)
  coef = weighted - alpha[..., None] * p
  state.head = coef if state.head is None else state.head + coef
  state.head_advantages = state.A.copy()
  return state


CORRECTIONS: dict[str, Callable] = dict(
    tis=tis, mis=mis, m2po=m2po, sat=sat, vcpo_ess=vcpo_ess, vcpo_baseline=vcpo_baseline,
    mu_veto=mu_veto, score_centering=score_centering)


# --- Objectives: (problem, state, anchor, settings) -> per-token coefficient a [B, T],
# before the aggregation's weights; row-level ones also take those weights (`agg`). ----


def _clip_active(ratio, adv, eps_low, eps_high, clip):
  """PPO-clip's clipped branch is the min: r A > clip(r, lo, hi) A, with only the endpoint
  A's sign selects contracted by `clip`."""
  lo = 1.0 - eps_low * np.where(adv < 0, clip, 1.0)
  hi = 1.0 + eps_high * np.where(adv > 0, clip, 1.0)
  return ratio * adv > np.clip(ratio, lo, hi) * adv


def clipped(widths=("eps_low", "eps_high")):
  """PPO-clip: d(-min(r A, clip(r) A)) / dlogp = -r A where unclipped, 0 where clipped;
  times W."""
  def coefficient(problem, state, anchor, s, agg):
    ratio = np.exp(problem.logp - anchor)
    eps_low, eps_high = (getattr(s, w) for w in widths)
    active = _clip_active(ratio, state.A, eps_low, eps_high, state.clip)
    return agg * state.W * np.where(active, 0.0, -ratio * state.A)
  return coefficient


def _row_mean(x, mask):
  return (x * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1.0)


def gspo(problem, state, anchor, s, agg):
  """GSPO: per sequence -min(s A_i, clip(s) A_i), s = exp(mean_t(logp - anchor)), A_i and
  the clip scale their token means; each token's loss is its row's, times W_t, so
  d / dlogp_t = (sum_t' agg_t' W_t') * (-s A_i / n_i) where unclipped."""
  mask = problem.mask
  s_i = np.exp(_row_mean(problem.logp - anchor, mask))
  adv = _row_mean(state.A, mask)
  active = _clip_active(s_i, adv, s.eps_low, s.eps_high, _row_mean(state.clip, mask))
  row_weight = (agg * state.W * mask).sum(axis=1)
  per_row = np.where(active, 0.0, -s_i * adv / np.maximum(mask.sum(axis=1), 1.0))
  return (row_weight * per_row)[:, None] * mask


def gspo_token(problem, state, anchor, s, agg):
  """GSPO-token: per token -min(r A_t, clip(r) A_t) with r of value s_i and gradient
  s_i dlogp_t: -s_i A_t where unclipped, times W."""
  s_i = np.exp(_row_mean(problem.logp - anchor, problem.mask))[:, None]
  ratio = np.broadcast_to(s_i, problem.logp.shape)
  active = _clip_active(ratio, state.A, s.eps_low, s.eps_high, state.clip)
  return agg * state.W * np.where(active, 0.0, -ratio * state.A)


def importance(problem, state, anchor, s, agg):
  """M2PO's surrogate: -exp(logp - behav) A, unclipped; times W."""
  return agg * state.W * -np.exp(problem.logp - problem.behav) * state.A


def vcpo(problem, state, anchor, s, agg):
  """VCPO: sequence level, -min(w_i, vcpo_is_cap) A_t with w_i = exp(sum_t d); token
  level, -min(exp(logp - behav), vcpo_is_cap) A_t; times W."""
  if s.vcpo_is_level == "sequence":
    weight = np.minimum(np.exp(_sequence_log_weights(problem)), s.vcpo_is_cap)[:, None]
  else:
    weight = np.minimum(np.exp(problem.logp - problem.behav), s.vcpo_is_cap)
  return agg * state.W * -weight * state.A


def sft(problem, state, anchor, s, agg):
  """The supervised objective: the completion's negative log-likelihood."""
  return -agg * problem.mask


OBJECTIVES: dict[str, Callable] = dict(
    grpo=clipped(), dapo=clipped(), drgrpo=clipped(), decoupled=clipped(), sat=clipped(),
    mu_grpo=clipped(("mu_eps_low", "mu_eps_high")), gspo=gspo, gspo_token=gspo_token,
    m2po=importance, vcpo=vcpo, sft=sft)


def aggregation_weights(mask: np.ndarray, aggregation: str, norm_len: float) -> np.ndarray:
  """agg [B, T]: each valid token's weight in the aggregated loss."""
  valid = mask > 0
  if aggregation == "token_mean":
    return valid / max(valid.sum(), 1)
  lengths = valid.sum(axis=1, keepdims=True)
  if aggregation == "seq_mean_token_mean":
    return valid / np.maximum(lengths, 1) / max((lengths > 0).sum(), 1)
  if aggregation == "seq_mean_token_sum_norm":
    return valid / (norm_len * mask.shape[0])
  raise KeyError(aggregation)


@dataclasses.dataclass
class Estimate:
  """The documented estimator's update direction: dL/dlogp [B, T], dL/dhead_logp [B, T, K]
  (zeros without score centering), each already times lr_scale."""
  logp: np.ndarray
  head: np.ndarray


def estimator(objective: str, chain: tuple[str, ...], settings, problem: Problem) -> Estimate:
  """The documented estimator of `objective` with the corrections `chain` (the objective's
  own first), under resolved `settings` (a LossSettings: hyperparameters and
  aggregation), on `problem`.

  Raises:
    KeyError: a piece with no documented estimator here.
  """
  for name in chain:
    if name not in CORRECTIONS:
      raise KeyError(f"correction {name!r}")
  if objective not in OBJECTIVES:
    raise KeyError(f"objective {objective!r}")
  state = State(W=np.ones_like(problem.logp), clip=np.ones_like(problem.logp),
                A=np.array(problem.advantages, np.float64))
  for name in chain:
    state = CORRECTIONS[name](problem, state, settings)
  reads_prox = objective in PROX_OBJECTIVES or any(c in PROX_CORRECTIONS for c in chain)
  anchor = problem.prox if reads_prox else problem.behav
  agg = aggregation_weights(problem.mask, settings.aggregation, settings.norm_len)
  coefficient = OBJECTIVES[objective](problem, state, anchor, settings, agg) * problem.mask
  head = np.zeros_like(problem.head_logp)
  if state.head is not None:
    head = (agg * state.head_advantages * problem.mask)[..., None] * state.head
  return Estimate(coefficient * state.lr_scale, head * state.lr_scale)
