"""NAT: train on a random subset of each batch's completion tokens, reweighted so that the
loss stays an unbiased estimate of the full-token loss (config.loss.token_subsample).

Not All Tokens Are Needed (NAT, arXiv 2603.06619) updates the policy "using only a selected
subset of generated tokens", with "an unbiased partial-token policy-gradient estimator via
Horvitz-Thompson reweighting": a kept token's term is divided by its probability of being
kept, pi_t, so that E[sum_t s_t l_t / pi_t] = sum_t l_t. Rewards, rollouts and advantages
are untouched. Two selection schemes:

  urs  Uniform Random Sampling: every completion token is kept independently with
       probability `keep` (pi_t = keep). A dropped token stays context for the tokens
       after it (it moves from the completion mask to the prompt mask, as a tree's shared
       prefix does), so the kept tokens' log-probs are exactly the full batch's; no
       forward work is saved on a padded batch. It is the estimator's baseline.
  rpc  Random Prefix Cutting: each row keeps its first c completion tokens and drops the
       rest, which then need no forward at all (causal attention: no kept token sees them),
       so the batch is shorter and the train step cheaper (with
       config.rollout.train_length_buckets, which cut the padded batch to the bucket of its
       longest kept row).

Choices the paper's abstract leaves open, made here:
  - RPC's cut: c_i = ceil(n_i * u^a) for a row with n_i completion tokens, u ~ U(0, 1] and
    a = 1 / keep - 1, so token j (1-based) is kept with pi_j = 1 - ((j - 1) / n_i)^(1 / a)
    (pi_1 = 1: a row always keeps its first token) and the kept fraction is keep in
    expectation (1/(a + 1) = keep, the integral of pi over the row; a little more on short
    rows). keep = 1 keeps everything.
  - One u per batch, shared by its rows: on a padded [B, T] batch a cut saves compute only
    if every row is cut, so the batch's forward length shrinks by u^a. Each row's
    inclusion probabilities are the same as with a u per row, so the estimator is
    still unbiased; its rows are correlated (a higher variance than independent cuts).
  - The reweighting is applied to the advantages: a term that scales with its token's
    advantage (PPO-clip picks the clip side by A's sign; IS and truncated-IS gradients
    and score centering's term are linear in A) is then scaled by w_t > 0. w_t also
    carries the aggregation's denominators, so that the objective aggregated over the
    kept tokens equals the Horvitz-Thompson estimate of the full-token loss aggregated
    over all of them (`horvitz_thompson_weights`), per PPO minibatch (the unit one update
    aggregates over).
  - That estimate is unbiased only for terms that scale with the advantage and read no
    token the scheme may drop (`check_composes`, from what each objective and correction
    declares, `corrections.Scope`): urs keeps tokens independently, so a term may read
    its own token only; rpc keeps a prefix of every row, so a term may also read the
    tokens before it (Mu-GRPO's veto: a kept token's trigger lies in the kept prefix).
    Refused: sequence ratios (GSPO, VCPO: a ratio over a subset of a row's tokens is
    another quantity), batch statistics (M2PO's mask, SAT's quantile, VCPO's ESS and
    baseline: over the kept tokens they are other statistics), Mu-GRPO's veto under urs
    (a dropped token cannot trigger it), a correction that computes its own advantages
    (VCPO's baseline discards the weights), and a KL penalty (not scaled by the advantage).

The subsample is a batch stage (`TokenSubsample.stage`, rl/stages.py) after the advantage
stage, drawn on the host from the iteration's key, so a resumed run draws the same subsets.

Composes with every rollout kind (independent, tree, partial and pruned batches are cut
alike; tests/test_token_subsample.py runs it through the launcher on independent, tree and
partial rollouts), with the async loop and simulated staleness (the stage runs where the
batch is made), with speculative decoding (it acts after sampling) and with tools (under
rpc an environment's answers after the cut leave the batch with the tokens they follow),
and with PPO minibatches (the weights are per minibatch). Refused: what `check_composes`
refuses (above) and on-policy distillation, whose term would be taken over the kept tokens
unweighted.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rl import stages
from rl.objectives.corrections import Scope, get_correction
from rl.settings.loss import AGGREGATIONS, TOKEN_SUBSAMPLES as SCHEMES
from rl.types import Rollout

STREAM = 0x4E4154  # folded into an iteration's key for the subsample's draws

# The widest part of the batch a term may read and stay unbiased under each scheme.
PRESERVED_SCOPE = {"urs": Scope.TOKEN, "rpc": Scope.ROW_PREFIX}
_SCOPE_WORDS = {Scope.TOKEN: "its own token", Scope.ROW_PREFIX: "the earlier tokens of its row",
                Scope.ROW: "every token of its row", Scope.BATCH: "statistics of the whole batch"}


def declaration(scheme: str) -> stages.Declaration:
  """What the subsample does to a batch: it rewrites the masks and the advantages, trains a
  subset of the completion tokens, and under urs makes the dropped tokens context after the
  prompt."""
  breaks = {stages.EVERY_COMPLETION_TOKEN} | (
      {stages.CONTEXT_IS_THE_PROMPT} if scheme == "urs" else set())
  return stages.Declaration(writes=frozenset({"completion_mask", "advantages", "prompt_mask"}),
                            breaks=frozenset(breaks))


def check_composes(scheme: str, objective, chain: tuple[str, ...], kl_coef: float = 0.0) -> None:
  """Raises ValueError, naming the piece and why, when token subsampling `scheme` would
  bias the loss of `objective` (a registered objective) with the corrections `chain`
  (module docstring): every term must scale with its advantage and read nothing beyond
  `PRESERVED_SCOPE[scheme]`; a KL penalty (`kl_coef` > 0) is refused."""
  if scheme == "none":
    return
  preserved = PRESERVED_SCOPE[scheme]
  prefix = f"config.loss.token_subsample = {scheme!r}"
  name = getattr(objective, "name", getattr(objective, "__name__", "objective"))
  scope = getattr(objective, "scope", None)
  if scope is None:
    raise ValueError(f"{prefix} with objective {name!r}, which declares no scope (register it "
                     "with make_objective(..., scope=...), docs/add_objective.md): NAT cannot "
                     "tell whether a subset of the tokens keeps its loss unbiased.")
  if scope > preserved:
    raise ValueError(f"{prefix} with config.loss.name = {name!r}: its term for a token reads "
                     f"{_SCOPE_WORDS[scope]}, which the subsample changes, so the "
                     "reweighted loss is another quantity; use a per-token objective (grpo, "
                     "dapo, drgrpo, decoupled) or token_subsample='none'.")
  for correction in chain:
    spec = get_correction(correction)
    if not spec.scales_with_advantage:
      raise ValueError(f"{prefix} with the correction {correction!r}: it computes advantages "
                       "of its own and discards NAT's Horvitz-Thompson weights; remove it or "
                       "set token_subsample='none'.")
    if spec.scope > preserved:
      other = [s for s, p in PRESERVED_SCOPE.items() if p >= spec.scope]
      hint = f"token_subsample={other[0]!r}" if other else "token_subsample='none'"
      raise ValueError(f"{prefix} with the correction {correction!r}: a token's term reads "
                       f"{_SCOPE_WORDS[spec.scope]}, which the subsample changes (a dropped "
                       "token no longer counts), so the reweighted loss is biased; use "
                       f"{hint} or leave {correction!r} out.")
  if kl_coef:
    raise ValueError(f"{prefix} with config.loss.kl_coef = {kl_coef}: the KL penalty is not "
                     "scaled by the advantage, so NAT's weights do not reach it; set one of "
                     "them off.")


def completion_positions(completion_mask: np.ndarray) -> np.ndarray:
  """[B, T] 1-based index of each completion token among its row's completion tokens (0
  elsewhere)."""
  mask = np.asarray(completion_mask, bool)
  return np.where(mask, np.cumsum(mask, axis=1), 0)


def rpc_exponent(keep: float) -> float:
  """RPC's a = 1 / keep - 1: the cut c = ceil(n u^a) keeps the fraction `keep` in
  expectation."""
  return 1.0 / keep - 1.0


def inclusion_probabilities(completion_mask: np.ndarray, scheme: str,
                            keep: float) -> np.ndarray:
  """pi [B, T]: the probability that each completion token is kept (0 off the mask).

  urs: keep. rpc: 1 - ((j - 1) / n)^(1 / a), j the token's position in its row's
  completion, n the row's completion length, a = `rpc_exponent(keep)` (1 when keep = 1).
  """
  mask = np.asarray(completion_mask, bool)
  if scheme == "urs":
    return np.where(mask, keep, 0.0)
  if scheme != "rpc":
    raise ValueError(f"Unknown config.loss.token_subsample {scheme!r}; known: {SCHEMES}.")
  if keep >= 1.0:
    return mask.astype(np.float64)
  position = completion_positions(mask)
  lengths = np.maximum(mask.sum(axis=1, keepdims=True), 1)
  before = np.maximum(position - 1, 0) / lengths
  return np.where(mask, 1.0 - before ** (1.0 / rpc_exponent(keep)), 0.0)


def draw_kept(completion_mask: np.ndarray, scheme: str, keep: float,
              uniforms: np.ndarray) -> np.ndarray:
  """The kept tokens [B, T] bool for the uniform draws `uniforms` in (0, 1]: one per token
  ([B, T]) for urs, kept where u <= keep; one for the batch (shape [], or any array whose
  first element is used) for rpc, each row keeping its first ceil(n u^a) tokens."""
  mask = np.asarray(completion_mask, bool)
  if scheme == "urs":
    return mask & (uniforms <= keep)
  if keep >= 1.0:
    return mask
  u = float(np.ravel(uniforms)[0])
  cut = np.ceil(mask.sum(axis=1, keepdims=True) * u ** rpc_exponent(keep))
  return mask & (completion_positions(mask) <= cut)


def horvitz_thompson_weights(completion_mask: np.ndarray, kept: np.ndarray, pi: np.ndarray,
                             aggregation: str, num_minibatches: int = 1) -> np.ndarray:
  """w [B, T] with aggregate(w * l, kept) = sum over kept of l / pi, under the full mask's
  aggregation denominators, in each of `num_minibatches` contiguous row blocks.

  token_mean: w = K / (N pi), K and N the block's kept and full token counts.
  seq_mean_token_mean: w = (k_i / (n_i pi)) * (R_kept / R_full), k_i and n_i the row's
    kept and full counts, R the block's rows with a kept / any token (`losses.aggregate`
    leaves empty rows out of the mean).
  seq_mean_token_sum_norm: w = 1 / pi (the normaliser is a constant).
  0 off `kept`.
  """
  mask, kept = np.asarray(completion_mask, bool), np.asarray(kept, bool)
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"Unknown aggregation {aggregation!r}; known: {AGGREGATIONS}.")
  rows = mask.shape[0]
  if rows % num_minibatches:
    raise ValueError(f"{rows} rows do not split into {num_minibatches} minibatches.")
  inverse = np.where(kept, 1.0 / np.where(kept, pi, 1.0), 0.0)
  blocks = []
  for block in np.split(np.arange(rows), num_minibatches):
    m, s, w = mask[block], kept[block], inverse[block]
    if aggregation == "token_mean":
      w = w * s.sum() / max(m.sum(), 1)
    elif aggregation == "seq_mean_token_mean":
      n, k = m.sum(axis=1, keepdims=True), s.sum(axis=1, keepdims=True)
      rows_ratio = (k > 0).sum() / max((n > 0).sum(), 1)
      w = w * k / np.maximum(n, 1) * rows_ratio
    blocks.append(w)
  return np.concatenate(blocks, axis=0)


@dataclasses.dataclass(frozen=True)
class TokenSubsample:
  """The NAT stage: `(batch, key) -> (batch on the kept tokens, metrics)`.

  scheme: 'urs' or 'rpc' (module docstring); keep: the expected kept fraction, in (0, 1];
  aggregation: the objective's (`LossSettings.resolved().aggregation`); num_minibatches:
  config.rl.num_minibatches (the rows one update aggregates over).
  """
  scheme: str
  keep: float
  aggregation: str
  num_minibatches: int = 1

  def __post_init__(self):
    if self.scheme not in SCHEMES[1:]:
      raise ValueError(f"TokenSubsample scheme {self.scheme!r}; known: {SCHEMES[1:]}.")
    if not 0.0 < self.keep <= 1.0:
      raise ValueError(f"config.loss.token_keep = {self.keep} must be in (0, 1].")

  def __call__(self, batch: Rollout, key: jax.Array) -> tuple[Rollout, dict]:
    """The batch restricted to a subset drawn from `key` (`restrict`).
    Metrics: token_subsample_kept_fraction, the kept share of the completion tokens."""
    mask = np.asarray(jax.device_get(batch.completion_mask), bool)
    shape = mask.shape if self.scheme == "urs" else (1,)
    uniforms = 1.0 - np.asarray(jax.random.uniform(key, shape), np.float64)  # (0, 1]
    kept = draw_kept(mask, self.scheme, self.keep, uniforms)
    fraction = float(kept.sum()) / max(int(mask.sum()), 1)
    return self.restrict(batch, kept), {"token_subsample_kept_fraction": fraction}

  def stage(self) -> stages.Stage:
    """This subsample as a batch stage (`rl.stages`), drawn from the iteration's key with
    `STREAM` folded in (a resumed run draws the same subsets); its kept share joins the
    batch's counters."""
    def apply(rollout, stats, state, *, rng, **extras):
      del extras
      rollout, metrics = self(rollout, jax.random.fold_in(rng, STREAM))
      return rollout, stats.with_counters(**metrics), state

    return stages.Stage(init=lambda: None, apply=apply, name=f"token subsample ({self.scheme})",
                        declares=declaration(self.scheme))

  def restrict(self, batch: Rollout, kept: np.ndarray) -> Rollout:
    """The batch with completion_mask the `kept` tokens [B, T] (a subset of its completion
    tokens) and the advantages reweighted (`horvitz_thompson_weights`). Under urs a
    dropped token joins the prompt mask (still context, never trained); under rpc the
    slots after a row's last kept token are masked out of it altogether (nothing kept
    attends to them; an environment's answers there are no longer context either)."""
    mask = np.asarray(jax.device_get(batch.completion_mask), bool)
    kept = np.asarray(kept, bool)
    pi = inclusion_probabilities(mask, self.scheme, self.keep)
    weights = horvitz_thompson_weights(mask, kept, pi, self.aggregation, self.num_minibatches)
    advantages = np.asarray(jax.device_get(batch.advantages), np.float32)
    new = dict(completion_mask=kept, advantages=(advantages * weights).astype(np.float32))
    prompt_mask = np.asarray(jax.device_get(batch.prompt_mask), bool)
    if self.scheme == "urs":
      new["prompt_mask"] = prompt_mask | (mask & ~kept)
    else:
      slots = np.arange(mask.shape[1])
      last_kept = np.where(kept, slots, -1).max(axis=1, keepdims=True)
      cut_rows = mask.any(axis=1, keepdims=True)
      before_cut = ~cut_rows | (slots <= last_kept)
      new["prompt_mask"] = prompt_mask & before_cut
      if batch.env_mask is not None:
        new["env_mask"] = np.asarray(jax.device_get(batch.env_mask), bool) & before_cut
    return batch.replace(**new)
