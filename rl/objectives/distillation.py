"""On-policy distillation (OPD): a teacher's per-token distribution as the training signal.

The student samples y ~ pi_s (the rollout); a frozen teacher pi_t scores every completion
token inside the train step, and the student moves toward it. Every objective here has one
signature,

    distill_fn(student, teacher, tokens, mask, config) -> (per_token [B, T], metrics)

student / teacher: log-softmax [B, T, V] of the distribution that predicted each token
(`next_token_logprobs`: column t predicts tokens[:, t]; the teacher's carries no
gradient); tokens [B, T]: the batch's tokens; mask [B, T]: the completion tokens. The train step aggregates `per_token` like the policy
objective (its aggregation) and adds `config.coef` times it to the loss
(rl.train.make_train_step, `Distill`).

  reverse_kl       sum_v pi_s(v) (log pi_s(v) - log pi_t(v)) at each position, over the
                   whole vocabulary, differentiated exactly (the OPD objective; its mean is
                   the per-token reverse KL the metrics report).
  k1, k3           sampled per-token estimators of that KL used as dense per-token
                   advantages (the policy-gradient form of OPD): A_t = -sg(k_t), per-token
                   loss -A_t * log pi_s(y_t); k1 = log pi_s(y_t) - log pi_t(y_t), k3 = (r - 1)
                   - log r with r = pi_t(y_t) / pi_s(y_t). No discounting: each token is
                   credited with its own estimate only (as in on-policy distillation
                   recipes); with k1 the gradient's expectation is that of the exact
                   per-position reverse KL, k3 is lower-variance and biased.
  forward_kl_topk  sum_{v in top-k of pi_t} p(v) (log p(v) - log pi_s(v)), p = pi_t
                   renormalised over its top k (config.top_k): mode-covering, and by
                   AsyncOPD's account the staleness-tolerant direction. With k < V its
                   minimum is not pi_s = pi_t (the renormalised teacher is sharper), so a
                   student equal to its teacher still gets a gradient; with k = V it is the
                   exact forward KL and that gradient is zero.

Sampled estimators (k1, k3) are not importance-corrected for stale samples; the exact
forms do not depend on which token was sampled at a position, only on the prefix.
Staleness then shifts the prefixes the KL is measured on, which is what the staleness
grid measures (docs/distillation.md).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from models import transformer
from models.config import ModelConfig
from rl.registry import Registry

# distill_fn(student [B, T, V], teacher [B, T, V], tokens [B, T], mask [B, T], config)
# -> (per_token [B, T], metrics)
DistillFn = Callable[..., tuple[jax.Array, dict]]
DISTILL_OBJECTIVES: Registry[DistillFn] = Registry(
    "distillation objective", "config.distill.objective",
    "register one with DISTILL_OBJECTIVES.register (rl/objectives/distillation.py)")


@dataclasses.dataclass(frozen=True)
class Distill:
  """What the train step needs to distil: objective (a DISTILL_OBJECTIVES name), coef (the
  distillation term's weight), with_reward (keep the policy objective: loss = policy +
  coef * distillation; False: pure OPD, loss = coef * distillation), top_k (forward_kl_topk's
  k) and the teacher's model config (its parameters are the train step's third argument)."""
  objective: str
  coef: float
  with_reward: bool
  top_k: int
  teacher_config: ModelConfig

  @classmethod
  def from_settings(cls, settings, teacher_config: ModelConfig) -> "Distill":
    """config.distill (`rl.settings.distill.DistillSettings`) with the loaded teacher's
    model config."""
    return cls(objective=settings.objective, coef=float(settings.coef),
               with_reward=bool(settings.with_reward), top_k=int(settings.top_k),
               teacher_config=teacher_config)


def next_token_logprobs(logits: jax.Array) -> jax.Array:
  """log-softmax [B, T, V] aligned with the tokens: column t is the distribution that
  predicted tokens[:, t] (logits[:, t - 1]); column 0 predicts nothing (uniform zeros)."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  return jnp.pad(logp, ((0, 0), (1, 0), (0, 0)))


def exact_reverse_kl(student: jax.Array, teacher: jax.Array) -> jax.Array:
  """KL(pi_s || pi_t) [B, T] at each position, over the vocabulary."""
  return jnp.sum(jnp.exp(student) * (student - teacher), axis=-1)


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(mask.sum(), 1)


def _masked_var(x: jax.Array, mask: jax.Array) -> jax.Array:
  mean = _masked_mean(x, mask)
  return _masked_mean((x - mean) ** 2, mask)


def at_tokens(dist: jax.Array, tokens: jax.Array) -> jax.Array:
  """dist [B, T, V] read at tokens [B, T]: the log-prob of each sampled token."""
  return jnp.take_along_axis(dist, tokens[..., None], axis=-1)[..., 0]


def token_estimators(student: jax.Array, teacher: jax.Array,
                     tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(k1, k3) [B, T] at the sampled tokens, without gradient: k1 = log pi_s(y) -
  log pi_t(y); k3 = (r - 1) - log r with r = pi_t(y) / pi_s(y)."""
  log_ratio = jax.lax.stop_gradient(at_tokens(student, tokens) - at_tokens(teacher, tokens))
  return log_ratio, jnp.expm1(-log_ratio) + log_ratio


def token_terms(student: jax.Array, teacher: jax.Array, tokens: jax.Array, mask: jax.Array,
                config: Distill) -> dict:
  """Every per-token quantity the train step reads from the two distributions [B, T, V]:
  the objective's per-token term (`per_token`, with gradient), the student's log-prob of
  each token (`logp`, with gradient) and, detached, the exact reverse KL and the k1 / k3
  estimators (`exact`, `k1`, `k3`) that `metrics_of` summarises. All [B, T]."""
  per_token, metrics = DISTILL_OBJECTIVES.get(config.objective)(student, teacher, tokens, mask,
                                                                 config)
  if metrics:
    raise ValueError(f"Distillation objective {config.objective!r} returned batch metrics "
                     f"{sorted(metrics)}: objectives return per-token terms only (the train "
                     "step may compute them a chunk of positions at a time).")
  k1, k3 = token_estimators(student, teacher, tokens)
  return dict(per_token=per_token, logp=at_tokens(student, tokens),
              exact=jax.lax.stop_gradient(exact_reverse_kl(student, teacher)), k1=k1, k3=k3)


def metrics_of(terms: dict, mask: jax.Array) -> dict:
  """The distillation metrics over completion tokens (`mask`) from `token_terms`: the mean
  exact reverse KL and the mean and variance of its two sampled estimators."""
  return dict(distill_reverse_kl=_masked_mean(terms["exact"], mask),
              distill_k1_mean=_masked_mean(terms["k1"], mask),
              distill_k1_var=_masked_var(terms["k1"], mask),
              distill_k3_mean=_masked_mean(terms["k3"], mask),
              distill_k3_var=_masked_var(terms["k3"], mask))


def chunked_token_terms(student_x: jax.Array, student_head: jax.Array, teacher_x: jax.Array,
                        teacher_head: jax.Array, tokens: jax.Array, mask: jax.Array,
                        config: Distill, chunk: int, temperature: float = 1.0) -> dict:
  """`token_terms` of the two policies' next-token distributions without their [B, T, V]
  buffers: x [B, T, D] are each policy's final-normed residual streams
  (`models.transformer.hidden_states`), heads [D, V] their output projections (the
  teacher's carry no gradient). Positions are taken `chunk` at a time under `lax.scan`; a
  chunk's logits and log-softmaxes exist only inside its step, which `jax.checkpoint`
  recomputes in the backward, so the largest buffers are [B, chunk, V]. The values are the
  dense path's (column 0 predicts nothing and is 0, as `next_token_logprobs` has it)."""

  def dists(x, head):
    logits = jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)
    if temperature not in (0.0, 1.0):
      logits = logits / temperature
    return jax.nn.log_softmax(logits, axis=-1)

  @jax.checkpoint
  def one(_, pieces):
    sx, tx, tok, m = pieces
    return None, token_terms(dists(sx, student_head), dists(tx, teacher_head), tok, m, config)

  # Column t + 1 is predicted from position t (column 0 predicts nothing).
  pieces = tuple(transformer.chunk_positions(a, chunk) for a in (
      student_x[:, :-1], teacher_x[:, :-1], tokens[:, 1:], mask[:, 1:]))
  _, terms = jax.lax.scan(one, None, pieces)
  n = tokens.shape[1] - 1
  return jax.tree.map(lambda a: jnp.pad(transformer.unchunk_positions(a, n), ((0, 0), (1, 0))),
                      terms)


@DISTILL_OBJECTIVES.register("reverse_kl")
def reverse_kl(student, teacher, tokens, mask, config):
  del tokens, mask, config
  return exact_reverse_kl(student, jax.lax.stop_gradient(teacher)), {}


def _estimator_objective(index: int) -> DistillFn:
  """Policy gradient with the per-token advantage -k (k1 or k3): loss sg(k) log pi_s(y)."""
  def objective(student, teacher, tokens, mask, config):
    del mask, config
    estimate = token_estimators(student, teacher, tokens)[index]
    return estimate * at_tokens(student, tokens), {}
  return objective


DISTILL_OBJECTIVES.register("k1", _estimator_objective(0))
DISTILL_OBJECTIVES.register("k3", _estimator_objective(1))


@DISTILL_OBJECTIVES.register("forward_kl_topk")
def forward_kl_topk(student, teacher, tokens, mask, config):
  del tokens, mask
  teacher = jax.lax.stop_gradient(teacher)
  top_logp, top = jax.lax.top_k(teacher, config.top_k)  # [B, T, k]
  top_logp = jax.nn.log_softmax(top_logp, axis=-1)       # renormalised over the top k
  student_top = jnp.take_along_axis(student, top, axis=-1)
  return jnp.sum(jnp.exp(top_logp) * (top_logp - student_top), axis=-1), {}
