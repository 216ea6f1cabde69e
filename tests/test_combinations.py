"""Every combination the launcher accepts computes its documented estimator, or is refused.

The axes come from the registries, so a newly registered objective, correction, advantage
estimator, token-subsampling scheme, reward stage or rollout kind joins the enumeration by
being registered: objective x correction chain x advantage estimator x token subsampling x
reward stage, and in the slow tier x rollout kind and chains of two appended corrections,
and the quick tier's losses under every rollout kind x selection rule.
Each combination goes through `RunSettings.check`, the launcher's own validation. Every
accepted one is compared with its documented estimator (tests/combination_reference.py,
float64 NumPy written from the methods' docs); a piece without one there fails the test, so
a method added without saying how it composes breaks the build.

The quick tier enumerates 11 objectives x 10 chains (none, each correction, TIS then score
centering) x 3 subsampling schemes x 6 advantage estimators x 4 reward stages = 7920
combinations, of which 2620 are accepted, which reduce to 120 distinct losses (the
estimator and the reward stage reach the loss only through the batch's advantages and
rewards: each loss is checked with per-row advantages and with per-token ones, as a
process estimator's or a tree's). docs/concepts.md gives the same counts.

The exact problem: 6 rows in 3 groups (one group of equal rewards, fractional rewards),
completions of 3, 1, 2, 2, 0 and 1 tokens (one after a context prefix, as a tree's row;
one empty), a vocabulary of 5 and the sampler's top-3 record at each slot; current, proximal
and sampling distributions far enough apart that clipping, truncation, M2PO's mask, SAT's
contraction and the veto all act. The gradient is taken with respect to the log-probs the
loss reads (the sampled tokens' and the top-3's): the policy's parameters reach the loss
only through them, so equal gradients there are equal gradients for any model
(`test_the_train_step_applies_the_checked_loss` checks it on a transformer through
rl.train). It is checked at a batch's first update (current = proximal parameters) and at
a later one (they differ). Under token subsampling the expected gradient is exact: a sum
over every subset urs can keep (2^9) and every cut rpc can make, each with its
probability.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import transformer
from rl import composition
from rl import train
from rl.objectives import advantages as advantage_estimators
from rl.objectives import composite
from rl.objectives import corrections
from rl.objectives import losses
from rl.objectives import token_subsample
from rl.rollouts import kinds
from rl.rollouts import selection as selection_rules
from rl.settings import reward as reward_settings
from rl.settings.loss import LossSettings, TOKEN_SUBSAMPLES
from rl.settings.rollout import RolloutSettings
from rl.settings.run import AdvantageSettings, RunSettings, TaskSettings
from rl.settings.selection import SelectionSettings
from rl.types import Rollout, SamplerTopK
from tests import combination_reference as reference
from tests import tiny

jax.config.update("jax_enable_x64", False)

# --- The axes ------------------------------------------------------------------------

OBJECTIVES = losses.LOSSES.names()
CORRECTIONS = corrections.CORRECTIONS.names()
QUICK_CHAINS = ((),) + tuple((c,) for c in CORRECTIONS) + (("tis", "score_centering"),)
PAIR_CHAINS = tuple(itertools.permutations(CORRECTIONS, 2))
SCHEMES = TOKEN_SUBSAMPLES
ADVANTAGES = (advantage_estimators.ADVANTAGES.names()
              + advantage_estimators.PROCESS_ADVANTAGES.names())
# Each reward kind, and the verifier's noise and second opinion.
REWARD_STAGES = {"task": {}, "noisy_verifier": dict(false_negative=0.1, false_positive=0.1),
                 "second_opinion": dict(false_negative=0.1, second_opinion=True),
                 **{kind: dict(kind=kind) for kind in reward_settings.REWARD_KINDS
                    if kind != "verifier"}}
ROLLOUT_KINDS = kinds.ROLLOUT_KINDS.names()
SELECTION_KINDS = selection_rules.SELECTION_RULES.names()
SELECTION_POOL = 64  # a finite prompt pool, which GRESO needs (the others ignore it)
KEEP = 0.5  # NAT's kept fraction in the checks
LATER_UPDATE_SHIFT = 0.35  # how far the proximal policy is from the current one


@dataclasses.dataclass(frozen=True)
class Combination:
  objective: str
  chain: tuple[str, ...]
  scheme: str
  advantage: str
  reward: str
  kind: str = "independent"
  selection: str = "uniform"

  def run_settings(self) -> RunSettings:
    return RunSettings(
        loss=LossSettings(name=self.objective, corrections=self.chain,
                          token_subsample=self.scheme),
        advantage=AdvantageSettings(name=self.advantage),
        reward=reward_settings.RewardSettings(**REWARD_STAGES[self.reward]),
        rollout=RolloutSettings(kind=self.kind),
        selection=SelectionSettings(kind=self.selection),
        task=TaskSettings(train_pool=SELECTION_POOL))

  @property
  def loss(self) -> tuple[str, tuple[str, ...], str]:
    """What the loss depends on: the estimator and the reward stage reach it through the
    batch's advantages and rewards alone, which every loss is checked with in each shape
    (per-row, and per-token as a process estimator's or a tree's)."""
    return (self.objective, self.chain, self.scheme)


def launcher_accepts(settings: RunSettings) -> bool:
  """Whether the launcher's check (`RunSettings.check`, then `rl.composition.check`)
  accepts `settings`."""
  try:
    settings.check()
    composition.check(settings)
  except ValueError:
    return False
  return True


def accepted(combinations) -> list[Combination]:
  """The combinations the launcher's check accepts (a loss the loss check refuses is
  refused whatever the other axes, so those are tried once)."""
  out, refused_losses = [], set()
  for c in combinations:
    loss = (c.objective, c.chain, c.scheme)
    if loss in refused_losses:
      continue
    if launcher_accepts(c.run_settings()):
      out.append(c)
      continue
    try:
      losses.check(LossSettings(name=c.objective, corrections=c.chain, token_subsample=c.scheme))
    except ValueError:
      refused_losses.add(loss)
  return out


def quick_combinations() -> list[Combination]:
  return [Combination(*axes) for axes in itertools.product(
      OBJECTIVES, QUICK_CHAINS, SCHEMES, ADVANTAGES, REWARD_STAGES)]


def slow_combinations() -> list[Combination]:
  """The quick tier's axes with every rollout kind and the ordered pairs of appended
  corrections, and the quick tier's losses under every rollout kind x selection rule
  (whose reused responses and re-weighted groups reach the loss as batch values)."""
  return ([Combination(*axes) for axes in itertools.product(
      OBJECTIVES, QUICK_CHAINS + PAIR_CHAINS, SCHEMES, ADVANTAGES, REWARD_STAGES,
      ROLLOUT_KINDS)]
          + [Combination(objective, chain, scheme, "grpo", "task", kind, selection)
             for objective, chain, scheme, kind, selection in itertools.product(
                 OBJECTIVES, QUICK_CHAINS, SCHEMES, ROLLOUT_KINDS, SELECTION_KINDS)])


# --- The exact problem ---------------------------------------------------------------

VOCAB, HEAD, PROMPT = 5, 3, 2
# (first completion slot, completion length) per row; row 2 starts after a context slot.
ROWS = ((2, 3), (2, 1), (3, 2), (2, 2), (2, 0), (2, 1))
SLOTS = 6
REWARDS = np.array([1.0, 0.0, 0.5, 0.5, 1.0, 0.25], np.float32)
GROUPS = np.array([0, 0, 1, 1, 2, 2], np.int32)


def _log_softmax(z):
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@functools.lru_cache(maxsize=None)
def problem_arrays(later_update: bool) -> dict:
  """The batch's float32 arrays (module docstring): log-probs of the sampled tokens under
  the current, proximal and sampling policies and of the sampler's top-3, the mask, and
  per-row and per-token advantages. At the first update prox = logp."""
  rng = np.random.default_rng(7)
  shape = (len(ROWS), SLOTS)
  mask = np.zeros(shape, np.float32)
  for row, (start, length) in enumerate(ROWS):
    mask[row, start:start + length] = 1.0
  current = rng.normal(0, 1.0, shape + (VOCAB,))
  proximal = current + (LATER_UPDATE_SHIFT * rng.normal(0, 1, current.shape)
                        if later_update else 0.0)
  # Per-slot gaps of three sizes: within PPO's band, beyond it, and far beyond.
  gap = rng.choice([0.1, 0.4, 3.0], size=shape + (1,), p=[0.3, 0.4, 0.3])
  sampler = proximal + gap * rng.normal(0, 1, current.shape)
  p, q = _log_softmax(current), _log_softmax(sampler)
  # The check is of the estimator on a given batch, so the tokens need not be q's draws:
  # uniform, except that at a wide gap the token q most under- or over-weights is taken,
  # so that both tails of p / q (beyond the IS cap and the veto's band) are present.
  tokens = rng.integers(0, VOCAB, shape)
  wide = gap[..., 0] > 1.0
  log_ratio = _log_softmax(proximal) - q
  extreme = np.where(rng.random(shape) < 0.5, log_ratio.argmax(-1), log_ratio.argmin(-1))
  tokens = np.where(wide, extreme, tokens)
  pick = lambda lp: np.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0] * mask
  head = np.argsort(-q, axis=-1, kind="stable")[..., :HEAD]
  row_advantages = np.array([1.3, -0.7, 0.4, -1.1, 0.8, -0.5])[:, None] * mask
  token_advantages = np.round(rng.normal(0, 1, shape), 3) * mask
  f32 = lambda x: np.asarray(x, np.float32)
  return dict(tokens=tokens.astype(np.int32), mask=mask, logp=f32(pick(p)),
              prox=f32(pick(_log_softmax(proximal))), behav=f32(pick(q)),
              head_ids=head.astype(np.int32),
              head_logp=f32(np.take_along_axis(p, head, axis=-1)),
              behav_head=f32(np.take_along_axis(q, head, axis=-1)),
              row_advantages=f32(row_advantages), token_advantages=f32(token_advantages))


def rollout(arrays: dict, per_token: bool) -> Rollout:
  """The problem as the train step's batch (prox_logp: the recomputed proximal log-probs)."""
  mask = arrays["mask"] > 0
  prompt = np.zeros_like(mask)
  for row, (start, _) in enumerate(ROWS):
    prompt[row, :start] = True
  return Rollout(
      tokens=jnp.asarray(arrays["tokens"]), prompt_mask=jnp.asarray(prompt),
      completion_mask=jnp.asarray(mask), behavior_logp=jnp.asarray(arrays["behav"]),
      version=jnp.asarray(np.where(mask, 0, -1).astype(np.int32)),
      group=jnp.asarray(GROUPS), reward=jnp.asarray(REWARDS),
      advantages=jnp.asarray(arrays["token_advantages" if per_token else "row_advantages"]),
      prox_logp=jnp.asarray(arrays["prox"]),
      behavior_topk=SamplerTopK(ids=jnp.asarray(arrays["head_ids"]),
                                logp=jnp.asarray(arrays["behav_head"])))


def reference_problem(arrays: dict, per_token: bool) -> reference.Problem:
  f64 = lambda name: np.asarray(arrays[name], np.float64)
  return reference.Problem(
      logp=f64("logp"), prox=f64("prox"), behav=f64("behav"), head_logp=f64("head_logp"),
      behav_head=f64("behav_head"),
      advantages=f64("token_advantages" if per_token else "row_advantages"),
      mask=f64("mask"), reward=REWARDS.astype(np.float64), group=GROUPS)


# --- What the train step differentiates ----------------------------------------------

# The smallest transformer: the check differentiates one step per objective and chain.
_MODEL = tiny.model(vocab_size=VOCAB, d_model=8, n_layers=1, n_heads=1, head_dim=8, mlp_dim=8,
                    max_seq_len=SLOTS)


def step_objective(loss: LossSettings) -> composite.StepObjective:
  """The train step's objective for `loss`, resolved as rl.wiring resolves it."""
  return composite.StepObjective(_MODEL, losses.resolve(loss, max_new_tokens=SLOTS - PROMPT))


def loss_gradient(objective: composite.StepObjective, batch: Rollout, logp, head_logp):
  """(dL/dlogp, dL/dhead_logp) times the objective's lr_scale, where L is the loss
  `StepObjective` computes from the policy's log-probs: proximal log-probs reach it when
  the train step recomputes them (`prox_estimate`), the top-K log-probs when a correction
  reads them."""
  if objective.prox_estimate != "recompute":
    batch = batch.replace(prox_logp=None)
  extra = lambda head: {"head_logp": head} if objective.reads_sampler_topk else {}
  loss_fn = losses.get_loss(objective.loss.name)

  def loss(lp, head):
    value, metrics = loss_fn(lp, batch, prox_logp=batch.prox_logp,
                             settings=objective.settings, **extra(head))
    return value, metrics.get("lr_scale", jnp.ones(()))

  (_, lr_scale), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
      logp, head_logp)
  return grads[0] * lr_scale, grads[1] * lr_scale


def subsample_outcomes(mask: np.ndarray, scheme: str, keep: float):
  """Every kept-token mask the scheme can draw on `mask`, with its probability: urs, each
  subset of the completion tokens; rpc, each distinct cut over the intervals of the
  batch's uniform draw u on which every row's cut ceil(n u^a) is constant."""
  mask = mask > 0
  if scheme == "urs":
    cells = np.argwhere(mask)
    for bits in itertools.product((False, True), repeat=len(cells)):
      kept = np.zeros_like(mask)
      for (row, col), bit in zip(cells, bits):
        kept[row, col] = bit
      count = sum(bits)
      yield kept, keep ** count * (1 - keep) ** (len(cells) - count)
    return
  exponent = token_subsample.rpc_exponent(keep)
  lengths = mask.sum(axis=1)
  bounds = sorted({0.0, 1.0} | {(k / n) ** (1 / exponent) for n in lengths if n
                                for k in range(1, n)})
  for low, high in zip(bounds[:-1], bounds[1:]):
    yield token_subsample.draw_kept(mask, "rpc", keep, np.array([high])), high - low


# The batches each loss is checked on: (later update, per-token advantages).
VARIANTS = tuple(itertools.product((False, True), (False, True)))


def _entries(objective: composite.StepObjective, scheme: str):
  """(variant index, probability, host batch, logp, head_logp) for every batch the loss
  is evaluated on: each variant's batch, or under a subsampling scheme every restriction
  of it the scheme can draw (later updates only: the first is a special case of it)."""
  stage = (None if scheme == "none" else
           token_subsample.TokenSubsample(scheme, KEEP, objective.settings.aggregation))
  for index, (later, per_token) in enumerate(VARIANTS):
    if stage is not None and not later:
      continue
    arrays = problem_arrays(later)
    host = jax.tree.map(np.asarray, rollout(arrays, per_token))  # as rl.loop's stage reads it
    outcomes = ([(None, 1.0)] if stage is None else
                subsample_outcomes(host.completion_mask, scheme, KEEP))
    for kept, probability in outcomes:
      batch = host if kept is None else stage.restrict(host, kept)
      yield index, probability, batch, arrays["logp"], arrays["head_logp"]


def expected_loss_gradients(objective_name: str, chain: tuple[str, ...],
                            schemes: tuple[str, ...]) -> dict:
  """{(scheme, variant index): (dL/dlogp, dL/dhead_logp)}: `loss_gradient` on each
  variant, in expectation over what each token-subsampling scheme draws (exact), all in
  one vectorised call (the loss is the same function whatever the scheme: only its batches
  differ)."""
  objectives = {scheme: step_objective(LossSettings(name=objective_name, corrections=chain,
                                                    token_subsample=scheme))
                for scheme in schemes}
  entries = [(scheme, *entry) for scheme in schemes
             for entry in _entries(objectives[scheme], scheme)]
  stack = lambda *xs: jnp.asarray(np.stack(xs))
  batches = jax.tree.map(stack, *[e[3] for e in entries])
  grads = jax.vmap(functools.partial(loss_gradient, objectives[schemes[0]]))(
      batches, stack(*[e[4] for e in entries]), stack(*[e[5] for e in entries]))
  out = {}
  for key in dict.fromkeys((e[0], e[1]) for e in entries):
    weights = np.array([e[2] if (e[0], e[1]) == key else 0.0 for e in entries])
    out[key] = tuple(np.tensordot(weights, np.asarray(g, np.float64), axes=1) for g in grads)
  return out


def check_losses(objective_name: str, chain: tuple[str, ...],
                 schemes: tuple[str, ...]) -> list[str]:
  """The failures of the losses of `objective_name` with `chain` under each scheme (empty:
  each computes its documented estimator on every variant of the problem: a first and a
  later update, per-row and per-token advantages)."""
  full_chain = tuple(getattr(losses.get_loss(objective_name), "corrections", ())) + chain
  settings = step_objective(LossSettings(name=objective_name, corrections=chain)).settings
  failures = []
  for (scheme, index), got in expected_loss_gradients(objective_name, chain, schemes).items():
    later, per_token = VARIANTS[index]
    try:
      want = reference.estimator(objective_name, full_chain, settings,
                                 reference_problem(problem_arrays(later), per_token))
    except KeyError as missing:
      return [f"{missing.args[0]} has no documented estimator in "
              "tests/combination_reference.py"]
    for name, a, b in (("dlogp", got[0], want.logp), ("dhead", got[1], want.head)):
      # float32 against float64: 1e-4 of each entry, and 1e-6 of the largest one.
      error = np.abs(a - b)
      bound = 1e-4 * np.abs(b) + 1e-6 * max(float(np.max(np.abs(b))), 1e-3)
      if not np.all(error <= bound):
        worst = np.unravel_index(np.argmax(error - bound), error.shape)
        failures.append(f"{objective_name} {chain} {scheme} "
                        f"{'later' if later else 'first'} update, "
                        f"{'per-token' if per_token else 'per-row'} advantages: "
                        f"{name}{[int(i) for i in worst]} is {a[worst]:.6g}, "
                        f"documented {b[worst]:.6g}")
  return failures


def check_combinations(combinations) -> tuple[int, int, list[str]]:
  """(accepted combinations, distinct losses checked, failures)."""
  accepted_ones = accepted(combinations)
  cases = sorted({c.loss for c in accepted_ones}, key=repr)
  schemes = {}  # (objective, chain) -> its accepted schemes: one vectorised check each
  for objective_name, chain, scheme in cases:
    schemes.setdefault((objective_name, chain), []).append(scheme)
  failures = [f for (objective_name, chain), group in schemes.items()
              for f in check_losses(objective_name, chain, tuple(group))]
  return len(accepted_ones), len(cases), failures


# --- The tests -----------------------------------------------------------------------


def test_every_accepted_combination_computes_its_documented_estimator():
  """Quick tier: 7920 combinations, 2620 accepted, 120 distinct losses, each its documented
  estimator at a first and a later update, with per-row and per-token advantages."""
  combinations = quick_combinations()
  count, cases, failures = check_combinations(combinations)
  assert not failures, "\n".join(failures)
  assert (len(combinations), count, cases) == (7920, 2620, 120)


@pytest.mark.slow
def test_every_accepted_combination_with_rollout_kinds_and_correction_pairs():
  """Slow tier: with every rollout kind and every ordered pair of appended corrections, and
  every selection rule: 217008 combinations, 19776 accepted, 444 distinct losses."""
  combinations = slow_combinations()
  count, cases, failures = check_combinations(combinations)
  assert not failures, "\n".join(failures)
  assert (len(combinations), count, cases) == (217008, 19776, 444)


# --- The harness catches what it is for ----------------------------------------------


def _mutate(monkeypatch, name: str, **declared):
  """Replaces correction `name`'s registry entry by one with other declarations."""
  spec = corrections.get_correction(name)
  monkeypatch.setitem(corrections.CORRECTIONS._entries, name,  # pylint: disable=protected-access
                      dataclasses.replace(spec, **declared))


@pytest.mark.parametrize("mutant,combinations", [
    # Score centering without its anchor: the sampled token weighted by p / q.
    (("score_centering", dict(needs_prox=False)),
     [Combination("grpo", ("score_centering",), "none", "grpo", "task")]),
    # A correction that drops NAT's weights: VCPO's baseline declared as composing.
    (("vcpo_baseline", dict(scope=corrections.Scope.TOKEN, scales_with_advantage=True)),
     [Combination("grpo", ("vcpo_baseline",), scheme, "grpo", "task")
      for scheme in ("urs", "rpc")]),
    # M2PO's mask taken over the kept tokens only (the unclipped M2PO objective: under
    # PPO's clip the tokens the mask decides on are clipped anyway; under rpc the rows'
    # first tokens, always kept, carry this problem's largest d^2, so urs shows it).
    (("m2po", dict(scope=corrections.Scope.TOKEN)),
     [Combination("m2po", (), "urs", "grpo", "task")]),
], ids=["score-centering-unanchored", "vcpo-baseline-drops-nat-weights",
        "m2po-mask-over-kept-tokens"])
def test_the_harness_fails_for_each_mutant(monkeypatch, mutant, combinations):
  """Each mutant is accepted by the launcher (its declarations say it composes) and
  differs from its documented estimator; unmutated, the same combinations are refused or
  exact."""
  count, _, failures = check_combinations(combinations)
  assert not failures
  _mutate(monkeypatch, mutant[0], **mutant[1])
  count, _, failures = check_combinations(combinations)
  assert count == len(combinations) and failures


def test_a_piece_without_a_documented_estimator_fails(monkeypatch):
  """An objective registered without a reference here is a failure, not a pass."""
  objective = losses.make_objective(losses.clipped_surrogate, name="unreferenced",
                                    reads=("eps_low", "eps_high"))
  monkeypatch.setitem(losses.LOSSES._entries, "unreferenced",  # pylint: disable=protected-access
                      objective)
  _, _, failures = check_combinations(
      [Combination("unreferenced", (), "none", "grpo", "task")])
  assert failures == ["objective 'unreferenced' has no documented estimator in "
                      "tests/combination_reference.py"]


# --- The train step differentiates the loss the harness checks -----------------------


def _train_step_batch(params) -> tuple[Rollout, dict]:
  """A batch on the problem's layout for a one-layer transformer: random tokens, the
  sampler's log-probs and top-3 record a perturbation of the policy's own, per-token
  advantages; and the policy's log-probs of it (`composite.policy_logprobs`)."""
  rng = np.random.default_rng(3)
  arrays = problem_arrays(False)
  mask = arrays["mask"] > 0
  batch = rollout(arrays, per_token=True).replace(
      tokens=jnp.asarray(rng.integers(0, VOCAB, mask.shape), jnp.int32), prox_logp=None)
  ids = jnp.asarray(np.argsort(rng.random(mask.shape + (VOCAB,)), axis=-1)[..., :HEAD],
                    jnp.int32)
  logp, head_logp = composite.policy_logprobs(params, batch, _MODEL, head_ids=ids)
  shift = lambda x, scale: np.asarray(x) + rng.normal(0, scale, np.shape(x))
  behav_head = np.asarray(jnp.log(jax.nn.softmax(jnp.asarray(shift(head_logp, 1.0)), -1) * 0.9))
  batch = batch.replace(behavior_logp=jnp.asarray(shift(logp, 0.5) * mask, jnp.float32),
                        behavior_topk=SamplerTopK(ids=ids, logp=jnp.asarray(behav_head)))
  return batch, dict(logp=np.asarray(logp), head_logp=np.asarray(head_logp))


@pytest.mark.parametrize("objective,chain", [
    ("grpo", ("score_centering",)), ("grpo", ("tis", "score_centering")),
    ("decoupled", ()), ("vcpo", ())])
def test_the_train_step_applies_the_checked_loss(objective, chain):
  """rl.train's step on a one-layer transformer (SGD at learning rate 1, no clipping, so
  the update is minus lr_scale times the gradient) moves the parameters by the documented
  estimator pulled back through the policy: -(J_logp^T a + J_head^T c), with the proximal
  log-probs the step recomputes (the batch's first update). Score centering alone weights
  the sampled token by 1 (its ratio to the recomputed proximal policy), like the
  expectation it subtracts."""
  params = transformer.init_params(_MODEL, jax.random.PRNGKey(0))
  batch, policy = _train_step_batch(params)
  loss = losses.resolve(LossSettings(name=objective, corrections=chain),
                        max_new_tokens=SLOTS - PROMPT)
  step = train.make_train_step(_MODEL, optax.sgd(1.0), loss)
  state, _ = step(train.init_train_state(jax.tree.map(jnp.copy, params), optax.sgd(1.0)),
                 batch)  # the step donates the state
  problem = reference.Problem(
      logp=policy["logp"].astype(np.float64), prox=policy["logp"].astype(np.float64),
      behav=np.asarray(batch.behavior_logp, np.float64),
      head_logp=policy["head_logp"].astype(np.float64),
      behav_head=np.asarray(batch.behavior_topk.logp, np.float64),
      advantages=np.asarray(batch.advantages, np.float64),
      mask=np.asarray(batch.completion_mask, np.float64), reward=REWARDS.astype(np.float64),
      group=GROUPS)
  full_chain = tuple(getattr(losses.get_loss(objective), "corrections", ())) + chain
  want = reference.estimator(objective, full_chain, loss, problem)
  _, pull_back = jax.vjp(lambda p: composite.policy_logprobs(
      p, batch, _MODEL, head_ids=batch.behavior_topk.ids), params)
  (gradient,) = pull_back((jnp.asarray(want.logp, jnp.float32),
                           jnp.asarray(want.head, jnp.float32)))
  for moved, start, g in zip(jax.tree.leaves(state.params), jax.tree.leaves(params),
                             jax.tree.leaves(gradient)):
    np.testing.assert_allclose(np.asarray(moved - start), -np.asarray(g), rtol=2e-3,
                               atol=2e-6 * max(float(jnp.abs(g).max()), 1.0))
