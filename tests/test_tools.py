"""Rollouts with turns (rl.environments, docs/tools.md).

- The built-in environments answer exactly and never evaluate policy text; a hostile
  environment (hang, crash, raise, non-text, megabytes) is bounded in time and counted.
- `append_observations` against a NumPy reference of the pool layout.
- Rows with turns: every environment answer is what the environment says to the text before
  it, environment tokens are context with version -1 (never trained), the budgets hold, and
  each policy token's behaviour log-prob equals a recomputed forward over the whole
  multi-turn sequence.
- Environment tokens get exactly zero gradient under every objective and correction, and
  the loss equals the loss of the same batch with those tokens removed.
- Through the launcher: independent, partial and async rollouts with the adder; eval with
  and without tools; a run killed mid-turn resumes to identical metrics; refused settings.
"""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from experiments import train as launcher
from models import transformer
from models.config import get_preset
from models.tokenizer import CharTokenizer
from rl import environments
from rl import scoring
from rl import train
from rl import verdicts
from rl.objectives import corrections
from rl.objectives import losses
from rl.rollouts import batches as rollout_lib
from rl.rollouts import partial as partial_rollout
from rl.environments import turns as turns_lib
from rl.tasks import Example
from rl.tasks import running_sum
from rl.types import Rollout, SamplerTopK
from sampling import partial
from sampling.sampler import SamplingConfig
from tests import tool_environments
from tests.launcher_config import (KILLED_RUN, records, refusal, rl_steps,
                                    tiny_running_sum_config, without_clock)
from tests import tiny

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = CharTokenizer()
# The running_sum testbed's preset, not tests/tiny.py's model: the turn tests rest on how
# often this untrained policy writes a call, resumes silently and is ended.
MODEL = get_preset("tiny2", vocab_size=TOKENIZER.vocab_size, max_seq_len=128)
PROMPT = 16
NEW = 48
SAMPLING = SamplingConfig(max_new_tokens=NEW, temperature=1.0,
                          stop_tokens=(TOKENIZER.eos_id,), pad_id=TOKENIZER.pad_id)
EQUALS = TOKENIZER.encode("=")[0]
T_MAX = PROMPT + NEW


# --- The environments ---

@pytest.mark.parametrize("text,answer", [
    (",2:?1234567+5=", "1234572"), ("?0+0=", "0"),
    ("?999999999999999999+1=", "1000000000000000000"),
    ("+5,1:?12+=", None), ("?1234567+5", None), ("no call at all=", ""),
    ("?1+1=2 and forty more characters of text, then=", ""),
    ("?1234567+5=1234572,1:?1234572+5=", "1234577"),
    # The running form adds to the number before the last comma, by hand or by the adder.
    ("+5,3:1234567,3:1234567,2:?+5=", "1234572"), (",2:?+5=1234572,1:?+5=", "1234577"),
    (",9:1234567,8:1234572,7:?+15=", "1234587"),
    ("3:?+5=", None), ("x,3:?+5=", None),  # no comma, or no number before the last one
    (",1" + "2" * 19 + ",0:?+1=", None),  # a running total of 20 digits is none
    # ... and so is one that starts before the 80 characters searched, not a cut of it.
    ("5" + "1" * 17 + "," + ":" * 70 + "?+1=", None),
    ("5" + "1" * 17 + "," + ":" * 60 + "?+1=", str(5 * 10**17 + int("1" * 17) + 1)),
    ("12,0:?+5+5=", None)])
def test_adder_answers_its_call_and_ends_a_malformed_one(text, answer):
  assert environments.builtins.Adder().step(text) == answer


@pytest.mark.parametrize("text,answer", [
    ("She sold <<48/2=", "24>>"), ("<<(3+4)*2-1=", "13>>"), ("<<7/3=", "2.333333>>"),
    ("<<-2*-3=", "6>>"), ("<<0.1+0.2=", "0.3>>"), ("<<5-7=", "-2>>"), ("<<0.5-0.5=", "0>>"),
    ("<< 12 * 3 =", "36>>"),
    # Refused, never evaluated: division by zero, powers, names, exponents, unbalanced or
    # deep nesting, numbers past 1e30, a call longer than 80 characters.
    ("<<1/0=", "error>>"), ("<<2**10=", "error>>"), ("<<__import__('os').system('ls')=", "error>>"),
    ("<<1e3=", "error>>"), ("<<(1+2=", "error>>"), ("<<" + "(" * 33 + "1" + ")" * 33 + "=", "error>>"),
    ("<<999999999999999*999999999999999*9999999=", "error>>"),
    ("<<" + "1+" * 45 + "1=", "error>>"),
    # Not a call: a "=" in prose, or after a closed annotation.
    ("so x =", ""), ("<<3+4=7>> so y=", "")])
def test_calculator_computes_exactly_and_refuses_what_is_not_arithmetic(text, answer):
  assert environments.builtins.Calculator().step(text) == answer


def test_a_tool_demonstration_trains_only_what_the_policy_writes():
  problem = running_sum.Problem(1234567, 5, 3)
  answer = running_sum.worked_solution(problem, tools=[True, False, True])
  assert answer == ",3:1234567,2:?+5=1234572,1:1234577,0:?+5=1234582"
  prompt = running_sum.question(problem)
  adder = environments.builtins.Adder()
  assert environments.split_demonstration(prompt, answer, adder) == [
      (",3:1234567,2:?+5=", False), ("1234572", True), (",1:1234577,0:?+5=", False),
      ("1234582", True)]
  # The warm start's batch: the tool's answers are context (prompt_mask, env_mask).
  batch = rollout_lib.supervised_batch(TOKENIZER, [Example(prompt=prompt, answer=answer, entry={})],
                                       PROMPT, 80, environment=adder)
  tokens, env = np.asarray(batch.tokens[0]), np.asarray(batch.env_mask[0])
  assert TOKENIZER.decode(tokens[env]) == "12345721234582"
  assert not (env & np.asarray(batch.completion_mask[0])).any()
  assert (env <= np.asarray(batch.prompt_mask[0])).all()
  trained = TOKENIZER.decode(tokens[np.asarray(batch.completion_mask[0])])
  assert trained == ",3:1234567,2:?+5=,1:1234577,0:?+5="  # + EOS
  # A demonstration must say what the tool says.
  with pytest.raises(ValueError, match=r"environment 'adder' answers '1234572'"):
    environments.split_demonstration(prompt, answer.replace("=1234572", "=1234562"), adder)
  # The scorer reads tool states: the final total, and each leading state.
  task = running_sum.RunningSumTask(eval_size=1)
  example = Example(prompt=prompt, answer=answer, entry={"problem": problem, "total": problem.total,
                                                         "solution": ""})
  assert running_sum.parse_final_answer(answer) == problem.total
  assert running_sum.correct_leading_states(answer, problem) == 3
  assert task.exact_match(answer, example)
  wrong = answer.replace("?+5=1234582", "?+5=1234581")
  assert running_sum.correct_leading_states(wrong, problem) == 2
  named = answer.replace("?+5=1234572", "?1234567+5=1234572")  # the call's long form
  assert running_sum.correct_leading_states(named, problem) == 3
  assert running_sum.parse_final_answer(named.replace("?+5=1234582", "?1234577+5=1234582")) \
      == problem.total


def test_tool_share_changes_only_the_demonstrations():
  plain = running_sum.RunningSumTask(eval_size=4).examples("train", 64)
  tools = running_sum.RunningSumTask(eval_size=4, tool_share=0.5).examples("train", 64)
  assert [e.prompt for e in plain] == [e.prompt for e in tools]
  assert not any("?" in e.answer for e in plain)
  calls = sum(e.answer.count("?") for e in tools)
  steps = sum(e.size for e in tools)
  assert 0.35 < calls / steps < 0.65
  adder = environments.builtins.Adder()
  for e in tools:  # every tool step is exact, so the adder agrees with each demonstration
    environments.split_demonstration(e.prompt, e.answer, adder)


def test_a_hostile_environment_is_bounded_and_counted():
  texts = ["fine=", "hang=", "crash=", "raise=", "number=", "huge=", "fine again="]
  started = time.perf_counter()
  out = scoring.observe(tool_environments.Hostile(), texts)
  elapsed = time.perf_counter() - started
  assert out.texts[0] == out.texts[6] == "ok"
  assert list(out.failed) == [False, True, True, True, True, False, False]
  assert out.timeouts == 1 and out.errors == 3  # crash, raise and a non-text answer
  assert out.cut[5] and out.texts[5] == "9" * scoring.MAX_OBSERVATION_BYTES
  assert not out.cut[[0, 1, 2, 3, 4, 6]].any()
  assert elapsed < 30, elapsed  # 0.5 s for the hang, plus worker restarts


# --- The pool ---

def _pool_after_one_round(seed=0, rows=8):
  config = partial.PartialConfig(num_slots=rows, group_size=2, resume="reprefill")
  stops = SamplingConfig(max_new_tokens=NEW, temperature=1.0, stop_tokens=tuple(range(2, 20)))
  pool = partial.init_pool(config, MODEL, stops, PROMPT, jax.random.PRNGKey(seed), turns=True)
  tokens, mask = rollout_lib.encode_prompts(TOKENIZER, ["+5,3:1234567"] * (rows // 2), PROMPT)
  pool = partial.fill(pool, jnp.ones(rows // 2, bool), jnp.asarray(tokens), jnp.asarray(mask),
                      jnp.arange(rows // 2, dtype=jnp.int32))
  params = transformer.init_params(MODEL, jax.random.PRNGKey(seed))
  return partial.run_round(params, pool, 0, rows // 2, MODEL, stops, config)


def test_append_observations_matches_a_numpy_reference():
  pool = _pool_after_one_round()
  s = jax.device_get(pool.sampler)
  rows, slots = s.tokens.shape
  c = pool.resume_slot
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 6, rows).astype(np.int32)
  lengths[0], lengths[1] = 0, 5
  appended = rng.integers(3, 40, (rows, 5)).astype(np.int32)
  status = rng.integers(0, 3, rows).astype(np.int32)
  live = (lengths > 0) | (rng.random(rows) < 0.5)  # some rows resume with nothing appended
  live[0] = True
  new = partial.append_observations(pool, jnp.asarray(appended), jnp.asarray(lengths),
                                    jnp.asarray(live), jnp.asarray(status))
  for r in range(rows):
    n = lengths[r]
    tokens, mask = np.array(s.tokens[r]), np.array(s.token_mask[r])
    logp, version = np.array(s.behavior_logp[r]), np.array(s.version[r])
    if n:
      tokens = np.concatenate([tokens[n:c], appended[r, :n], np.zeros(slots - c, np.int32)])
      mask = np.concatenate([mask[n:c], np.ones(n, bool), np.zeros(slots - c, bool)])
      logp = np.concatenate([logp[n:c], np.zeros(n), np.zeros(slots - c)])
      version = np.concatenate([version[n:c], -np.ones(n, np.int32), -np.ones(slots - c, np.int32)])
    np.testing.assert_array_equal(np.asarray(new.sampler.tokens[r]), tokens)
    np.testing.assert_array_equal(np.asarray(new.sampler.token_mask[r]), mask)
    np.testing.assert_array_equal(np.asarray(new.sampler.behavior_logp[r]), logp)
    np.testing.assert_array_equal(np.asarray(new.sampler.version[r]), version)
    assert bool(new.sampler.done[r]) == (bool(s.done[r]) and not live[r])
    assert int(new.start[r]) == int(pool.start[r]) - n
  np.testing.assert_array_equal(np.asarray(new.env_status), status)


# --- Rows with turns ---

def _prompts(texts):
  tokens, mask = rollout_lib.encode_prompts(TOKENIZER, texts, PROMPT)
  return jnp.asarray(tokens), jnp.asarray(mask)


def _generate(environment, tool_config, texts, seed=0):
  turns = turns_lib.Turns(environment, TOKENIZER, tool_config)
  generate = partial_rollout.make_turns_generate(MODEL, SAMPLING, turns)
  params = transformer.init_params(MODEL, jax.random.PRNGKey(seed))
  tokens, mask = _prompts(texts)
  return params, jax.device_get(generate(params, tokens, mask, jax.random.PRNGKey(seed + 1), 3))


def _runs(mask_row):
  """(start, end) of each run of True in a 1-D mask."""
  edges = np.diff(np.concatenate([[0], mask_row.astype(np.int8), [0]]))
  return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.slow
def test_turns_answer_each_call_and_logp_equals_a_recomputed_forward():
  # An environment whose answer depends on the text, so a random policy's rows are
  # answered, resumed silently ("") and ended (None), all often.
  environment = tool_environments.ByLastCharacter()
  params, gen = _generate(environment, turns_lib.ToolSettings(max_turns=2), ["+5,3:1234567"] * 64)
  env, completion = np.asarray(gen.tools.env_mask), np.asarray(gen.completion_mask)
  tokens, version = np.asarray(gen.tokens), np.asarray(gen.version)
  assert gen.tools.calls.sum() >= 10, "too few calls for the test to mean anything"
  assert not (env & completion).any() and (env <= np.asarray(gen.prompt_mask)).all()
  assert (version[env] == -1).all() and (np.asarray(gen.behavior_logp)[env] == 0).all()
  assert (version[completion] == 3).all()
  np.testing.assert_array_equal(gen.completion_len, completion.sum(axis=1))
  token_mask = np.asarray(gen.prompt_mask) | completion
  resumed_silently = ended = 0
  for r in range(tokens.shape[0]):
    runs = _runs(env[r])
    assert len(runs) == gen.tools.calls[r] <= 2
    for start, end in runs:  # what the environment says to the text before it
      assert tokens[r, start - 1] == EQUALS and completion[r, start - 1]
      before = TOKENIZER.decode(tokens[r, :start][token_mask[r, :start]])
      observed, expected = TOKENIZER.decode(tokens[r, start:end]), environment.step(before)
      at_budget = (env[r] | completion[r]).sum() == NEW  # cut to the row's last slots
      assert observed == expected or (at_budget and expected.startswith(observed))
    # A "=" the environment does not take for a call ("") is followed by the policy's next
    # token.
    equals = np.flatnonzero(completion[r] & (tokens[r] == EQUALS))
    last = np.flatnonzero(token_mask[r])[-1]
    starts = {start for start, _ in runs}
    for j in equals[(equals < last) & (equals < (runs[1][1] if len(runs) == 2 else T_MAX))]:
      silent = environment.step(TOKENIZER.decode(tokens[r, :j + 1][token_mask[r, :j + 1]])) == ""
      assert (j + 1 in starts) != silent
      resumed_silently += silent
    if len(runs) == 2:  # after max_turns answers, the next pause ends the row
      later = equals[equals > runs[1][1]]
      assert later.size == 0 or later[0] == last
    elif tokens[r, last] == EQUALS and completion[r, last] and last < T_MAX - 1:
      # A row that ends on its own "=" was ended by the environment (None).
      assert environment.step(TOKENIZER.decode(tokens[r, :last + 1][token_mask[r, :last + 1]])) is None
      ended += 1
  assert resumed_silently > 0 and ended > 0
  # Behaviour log-probs of the policy tokens: one uncached forward over the whole sequence
  # (prompt, policy tokens and environment tokens).
  logits, _ = transformer.forward(params, jnp.asarray(tokens),
                                  transformer.positions_from_mask(jnp.asarray(token_mask)),
                                  jnp.asarray(token_mask), MODEL)
  reference = np.asarray(transformer.token_logprobs(logits, jnp.asarray(tokens)))
  np.testing.assert_allclose(np.asarray(gen.behavior_logp)[completion], reference[completion],
                             atol=2e-5)
  # Every "=" sent to the environment was answered, resumed silently or ended its row.
  assert gen.tools.steps == gen.tools.calls.sum() + resumed_silently + ended
  assert gen.tools.errors == 0


@pytest.mark.slow
def test_observations_are_cut_to_their_cap_and_an_environment_can_end_a_row():
  _, gen = _generate(tool_environments.Verbose(),
                     turns_lib.ToolSettings(max_turns=16, max_observation_tokens=3),
                     ["+5,3:1234567"] * 16)
  env, completion = np.asarray(gen.tools.env_mask), np.asarray(gen.completion_mask)
  lengths = [[end - start for start, end in _runs(env[r])] for r in range(env.shape[0])]
  assert sum(map(len, lengths)) >= 5
  for r, row in enumerate(lengths):  # cut to 3 ('aaa'), the last one maybe to the budget
    assert all(n == 3 for n in row[:-1]) and all(0 < n <= 3 for n in row[-1:])
    if row and row[-1] < 3:
      assert (env[r] | completion[r]).sum() == NEW
  assert int(gen.tools.cut) == sum(n == 3 for row in lengths for n in row)
  # Policy and environment tokens share each row's N-token budget.
  assert ((env | completion).sum(axis=1) <= NEW).all()

  _, gen = _generate(tool_environments.EndsAtSecondCall(), turns_lib.ToolSettings(),
                     ["+5,3:1234567"] * 32, seed=1)
  env, completion = np.asarray(gen.tools.env_mask), np.asarray(gen.completion_mask)
  tokens = np.asarray(gen.tokens)
  calls = (completion & (tokens == EQUALS)).sum(axis=1)
  assert (calls >= 2).any()
  for r in np.flatnonzero(calls >= 2):  # answered once, then ended at the second call
    assert len(_runs(env[r])) == 1
    last = np.flatnonzero(completion[r] | env[r])[-1]
    assert tokens[r, last] == EQUALS
    assert calls[r] == 2


def test_a_failing_environment_ends_its_row_with_reward_zero_and_the_batch_goes_on():
  texts = ["hang"] * 4 + ["raise"] * 8 + ["fine"] * 8
  started = time.perf_counter()
  _, gen = _generate(tool_environments.Hostile(), turns_lib.ToolSettings(), texts)
  elapsed = time.perf_counter() - started
  completion, tokens = np.asarray(gen.completion_mask), np.asarray(gen.tokens)
  called = (completion & (tokens == EQUALS)).any(axis=1)
  failed = np.asarray(gen.tools.failed)
  assert called[:12].any() and called[12:].any()
  np.testing.assert_array_equal(failed, called & (np.arange(20) < 12))
  assert int(gen.tools.timeouts) == called[:4].sum()
  assert int(gen.tools.errors) == called[4:12].sum()
  for r in np.flatnonzero(failed):  # a failed row ends at its first call
    assert (completion[r] & (tokens[r] == EQUALS)).sum() == 1
  # It scores 0 whatever its text, and its verdict says why.
  scores = scoring.Scores(rewards=np.ones(20, np.float32), exact=np.ones(20, bool),
                          verdicts=(verdicts.Verdict(verdicts.CORRECT),) * 20)
  kept = rollout_lib.with_rollout_failures(scores, np.asarray(gen.stopped), failed)
  np.testing.assert_array_equal(kept.rewards, np.where(failed, 0.0, 1.0))
  np.testing.assert_array_equal(kept.exact, ~failed)
  assert [v.category for v in kept.verdicts] == [
      verdicts.TOOL_ERROR if f else verdicts.CORRECT for f in failed]
  assert elapsed < 120, elapsed


# --- The loss never sees environment tokens ---

B, T, P, K = 6, 24, 3, 4


def _batch_with_environment_tokens(seed=0):
  """A [B, T] batch whose completions hold runs of environment tokens (context), and the
  same batch with those tokens removed (policy tokens moved left), with their logp."""
  rng = np.random.default_rng(seed)
  completion, env = np.zeros((B, T), bool), np.zeros((B, T), bool)
  for r in range(B):
    n = rng.integers(6, T - P + 1)
    completion[r, P:P + n] = True
    for start in rng.choice(np.arange(P + 1, P + n - 2), size=2, replace=False):
      env[r, start:start + rng.integers(1, 3)] = True
  completion &= ~env
  completion[:, P] = True
  prompt = np.zeros((B, T), bool)
  prompt[:, :P] = True
  logp = -rng.uniform(0.05, 3.0, (B, T)).astype(np.float32)
  garbage = lambda: rng.normal(size=(B, T)).astype(np.float32) * 5
  behav = np.where(completion, logp + 0.3 * rng.normal(size=(B, T)), garbage()).astype(np.float32)
  prox = np.where(completion, logp + 0.1 * rng.normal(size=(B, T)), garbage()).astype(np.float32)
  ref = np.where(completion, logp + 0.2 * rng.normal(size=(B, T)), garbage()).astype(np.float32)
  reward = np.array([1.0, 0.0, 0.25, 0.0, 1.0, 0.5], np.float32)
  group = np.repeat(np.arange(B // 3), 3).astype(np.int32)
  adv = np.zeros(B, np.float32)
  for g in np.unique(group):
    r = reward[group == g]
    adv[group == g] = (r - r.mean()) / (r.std() + 1e-6)
  advantages = np.where(completion, adv[:, None], garbage()).astype(np.float32)
  version = np.where(completion, 0, rng.integers(-1, 9, (B, T))).astype(np.int32)
  # The sampler's top-K record and the trainer's log-probs of its tokens (score centering):
  # K = 4 tokens holding 0.9 of q and 0.8 of p at each slot.
  weights = rng.uniform(0.1, 1.0, (B, T, K))
  head_q = np.log(0.9 * weights / weights.sum(-1, keepdims=True)).astype(np.float32)
  weights = rng.uniform(0.1, 1.0, (B, T, K))
  head_p = np.log(0.8 * weights / weights.sum(-1, keepdims=True)).astype(np.float32)
  head_ids = rng.integers(0, 50, (B, T, K)).astype(np.int32)

  def pick(x, fill, keep):
    """The rows' slots `keep` (per row, in order), left-aligned, padded at the end."""
    out = np.full_like(x, fill)
    for r in range(B):
      out[r, :keep[r].sum()] = x[r, keep[r]]
    return jnp.asarray(out)

  def rollout(keep, env_mask):
    take = lambda x, fill: pick(x, fill, keep)
    return Rollout(tokens=take(np.arange(B * T).reshape(B, T) % 50, 0),
                   prompt_mask=take(prompt | env, False), completion_mask=take(completion, False),
                   behavior_logp=take(behav, 0.0), version=take(version, -1),
                   group=jnp.asarray(group), reward=jnp.asarray(reward),
                   advantages=take(advantages, 0.0), prox_logp=take(prox, 0.0),
                   ref_logp=take(ref, 0.0), env_mask=env_mask,
                   behavior_topk=SamplerTopK(ids=take(head_ids, 0), logp=take(head_q, 0.0)))

  without = lambda x, fill: pick(x, fill, ~env)
  full = rollout(np.ones((B, T), bool), jnp.asarray(env))
  absent = rollout(~env, None)
  return (full, (jnp.asarray(logp), jnp.asarray(head_p)), absent,
          (without(logp, 0.0), without(head_p, 0.0)), env, without)


_SETTINGS = ([dict(name=name) for name in losses.LOSSES.names()]
             + [dict(name="grpo", corrections=(c,)) for c in corrections.CORRECTIONS.names()]
             + [dict(name="grpo", kl_coef=0.1), dict(name="grpo", aggregation="token_mean"),
                dict(name="grpo", aggregation="seq_mean_token_sum_norm", norm_len=12.0)])


@pytest.mark.parametrize("setting", _SETTINGS, ids=lambda s: "-".join(
    str(v) if not isinstance(v, tuple) else "+".join(v) for v in s.values()))
def test_environment_tokens_get_exactly_zero_gradient(setting):
  full, logps, absent, absent_logps, env, pick = _batch_with_environment_tokens()
  config = losses.resolve(losses.LossSettings(**{"norm_len": float(T), **setting}))
  loss_fn = losses.get_loss(setting["name"])
  needs_prox, reads_head = losses.needs_prox(config), losses.reads_sampler_topk(config)

  def value(lps, batch):
    lp, head = lps
    prox = batch.prox_logp if needs_prox else None
    extra = {"head_logp": head} if reads_head else {}
    return loss_fn(lp, batch, prox_logp=prox, settings=config, **extra)[0]

  loss_full, grads_full = jax.value_and_grad(value)(logps, full)
  loss_absent, grads_absent = jax.value_and_grad(value)(absent_logps, absent)
  assert np.isfinite(float(loss_full))
  np.testing.assert_allclose(float(loss_full), float(loss_absent), rtol=1e-5, atol=1e-7)
  for grad_full, grad_absent in zip(grads_full, grads_absent):  # token and head log-probs
    grad_full = np.asarray(grad_full)
    assert (grad_full[env] == 0.0).all()  # exactly zero, not small
    np.testing.assert_allclose(np.asarray(pick(grad_full, 0.0)), np.asarray(grad_absent),
                               rtol=1e-5, atol=1e-8)
  assert np.abs(np.asarray(grads_full[0])).max() > 0  # the batch trains its policy tokens
  if reads_head:
    assert np.abs(np.asarray(grads_full[1])).max() > 0  # and score centering's term


@pytest.mark.slow
def test_train_step_ignores_every_field_at_environment_positions():
  """Scrambling the behaviour log-probs, versions and advantages at environment positions
  changes nothing in the update (the tokens themselves stay: they are context)."""
  config = tiny.model(vocab_size=64, max_seq_len=T)
  params = transformer.init_params(config, jax.random.PRNGKey(0))
  optimizer = train.make_optimizer(1e-2)
  full = _batch_with_environment_tokens()[0].replace(prox_logp=None, ref_logp=None)
  env = np.asarray(full.env_mask)
  rng = np.random.default_rng(1)
  scrambled = full.replace(
      behavior_logp=jnp.where(env, rng.normal(size=(B, T)) * 9, full.behavior_logp),
      version=jnp.where(env, 7, full.version),
      advantages=jnp.where(env, rng.normal(size=(B, T)) * 9, full.advantages))
  grpo = losses.LossSettings(name="grpo", eps_low=0.2, eps_high=0.2, norm_len=4.0,
                             aggregation="seq_mean_token_mean", kl_coef=0.0, corrections=("tis",))
  step = train.make_train_step(config, optimizer, grpo)
  results = [step(train.init_train_state(jax.tree.map(jnp.copy, params), optimizer), b)
             for b in (full, scrambled, full.replace(env_mask=None))]
  (reference, metrics), rest = results[0], results[1:]
  for state, other in rest:
    jax.tree.map(np.testing.assert_array_equal, reference.params, state.params)
    assert float(other["loss"]) == float(metrics["loss"])
  moved = max(float(jnp.abs(a - b).max()) for a, b in
              zip(jax.tree.leaves(reference.params), jax.tree.leaves(params)))
  assert moved > 1e-4


# --- Through the launcher ---

def _tool_run_config(workdir, overrides=None):
  """The running_sum testbed with the adder, shrunk to seconds: problems of 1-3 additions,
  every one demonstrated with the tool (tool_share 1), 40 warm-start steps, 2 RL steps of 2
  prompts x 4 completions, 16 held-out problems; the default config's policy (tiny2), which
  learns to call the tool in those 40 steps, where the tests' micro preset does not."""
  return tiny_running_sum_config(workdir, {
      "model.preset": "tiny2",
      "task.difficulty.tool_share": 1.0, "tools.name": "adder", "rollout.max_new_tokens": 80,
      "rollout.train_length_buckets": (), "warm_start.steps": 40, "warm_start.batch_size": 16,
      "warm_start.learning_rate": 3e-3, **(overrides or {})})


@pytest.mark.parametrize("overrides", [
    {}, {"rollout.kind": "partial", "rollout.resume": "reprefill", "rollout.num_slots": 16,
         "rl.async_": True}],
    ids=["independent", "partial-async"])
@pytest.mark.slow
def test_launcher_trains_with_the_adder(tmp_path, overrides):
  launcher.run(_tool_run_config(tmp_path, overrides))
  steps = rl_steps(tmp_path)
  assert len(steps) == 2
  for record in steps:
    assert record["tool_steps"] > 0 and record["tool_calls_per_rollout"] > 0
    assert record["env_tokens_per_rollout"] >= record["tool_calls_per_rollout"]
    assert record["tool_errors"] == record["tool_timeouts"] == 0
    assert record["time_env_s"] > 0
  evals = [r for r in records(tmp_path) if "eval_accuracy" in r]
  assert evals and all("eval_accuracy_no_tools" in r and r["eval_tool_calls"] > 0 for r in evals)


def _final_producer(workdir):
  manager = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")))
  return manager.restore(manager.latest_step())["state"]["producer"]


@pytest.mark.slow
def test_a_run_killed_mid_turn_resumes_to_identical_metrics(tmp_path):
  overrides = {"rollout.kind": "partial", "rollout.resume": "reprefill",
               "rollout.num_slots": 32, "rollout.decode_window": 8, "rl.steps": 4,
               "warm_start.steps": 50,
               "checkpoint.every": 2, "checkpoint.max_to_keep": 4, "eval.every": 4}
  reference = _tool_run_config(tmp_path / "reference", overrides)
  launcher.run(reference)
  total = reference.warm_start.steps + reference.rl.steps
  kill_step = total  # dies saving the last step: resumes from total - 2, mid-RL
  resumed = _tool_run_config(tmp_path / "resumed", overrides)
  env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  child = subprocess.run([sys.executable, "-c", KILLED_RUN, resumed.to_json(), str(kill_step)],
                         cwd=_REPO, env=env, capture_output=True, text=True, timeout=600)
  assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
  manager = ocp.CheckpointManager(os.path.abspath(tmp_path / "resumed" / "checkpoints"))
  assert manager.latest_step() == total - 2
  # The checkpoint it resumes from holds rows mid-turn: in flight, with an environment
  # answer appended and more to decode (50 warm-start steps make the policy call the
  # adder; small decode rounds and a deep pool keep rows in flight).
  pool = manager.restore(total - 2)["state"]["producer"]["pool"]
  sampler = pool["sampler"]
  group_size = len(sampler["done"]) // len(pool["group_id"])
  rows_in_flight = np.repeat(np.asarray(pool["group_id"]) >= 0, group_size)
  answered = ((np.asarray(sampler["version"]) == -1) & np.asarray(sampler["token_mask"])
              & (np.arange(sampler["tokens"].shape[1])[None, :]
                 >= (np.asarray(pool["start"]) + reference.rollout.prompt_len)[:, None]))
  assert (rows_in_flight & answered.any(axis=1) & ~np.asarray(sampler["done"])).any()

  launcher.run(resumed)
  log_a, log_b = records(tmp_path / "reference"), records(tmp_path / "resumed")
  assert [without_clock(r) for r in log_a] == [without_clock(r) for r in log_b]
  assert _final_producer(tmp_path / "reference")["ledger"] == _final_producer(
      tmp_path / "resumed")["ledger"]


@pytest.mark.parametrize("overrides,message", [
    ({"tools.name": "abacus"}, r"Unknown environment 'abacus' \(config.tools.name\)"),
    ({"tools.name": "", "tools.max_turns": 4}, r"config.tools.max_turns = 4 has no effect"),
    ({"tools.name": "", "task.difficulty.tool_share": 0.5},
     r"tool_share = 0.5 demonstrates the adder.*config.tools.name='adder'"),
    ({"rollout.kind": "tree"}, r"config.tools.name with config.rollout.kind='tree'"),
    ({"rollout.kind": "partial", "rollout.resume": "kept_kv"}, r"use config.rollout.resume='reprefill'|set config.rollout.resume='reprefill'"),
    ({"rollout.speculative.tokens": 4}, r"config.tools.name with config.rollout.speculative"),
    ({"rl.prefix_shared_forward": True},
     r"config.rl.prefix_shared_forward needs that a row's context before its completion is its "
     r"prompt alone, and config.tools.name = 'adder' does not keep that"),
    ({"mesh.data": 2}, r"config.tools.name runs turns on one device"),
    ({"tools.max_observation_tokens": 0}, r"config.tools.max_observation_tokens = 0 must be >= 1"),
])
def test_settings_tools_do_not_compose_with_are_refused(tmp_path, overrides, message):
  assert re.search(message, refusal(_tool_run_config(tmp_path / "run", overrides)))


# --- SmolLM2's tokenizer and the calculator (gsm_symbolic's plumbing) ---

def test_gsm_symbolic_on_smollm2_with_the_calculator_validates():
  from experiments.configs import smollm2_gsm  # pylint: disable=import-outside-toplevel
  from rl import wiring  # pylint: disable=import-outside-toplevel
  config = smollm2_gsm.get_config()
  config.tools.name = "calculator"
  wiring.validate(config)
  assert wiring.settings(config).tools.max_turns == 16


@pytest.mark.slow
def test_calculator_round_trip_with_the_smollm2_chat_tokenizer():
  from models import gguf_checkpoint
  tokenizer = gguf_checkpoint.tokenizer_from_gguf(gguf_checkpoint.smollm2_path(), chat=True)
  calculator = environments.builtins.Calculator()
  ids = turns_lib.call_tokens(tokenizer, calculator.call_end)
  assert tokenizer.encode("=")[0] in ids and len(ids) > 10
  assert all(tokenizer.decode([i]).endswith("=") for i in ids)
  # A chat-templated prompt, then a completion that ends in a calculator call.
  prompt = tokenizer.encode("Natalia sold 48 clips. How many is half?", add_bos=True)
  assert len(prompt) > len(tokenizer.encode("Natalia sold 48 clips. How many is half?")) + 8
  written = tokenizer.encode("Half of 48 is <<48/2=")
  assert written[-1] in ids  # the row would pause here
  config = partial.PartialConfig(num_slots=1, group_size=1, resume="reprefill")
  smol = tiny.model(vocab_size=tokenizer.vocab_size, max_seq_len=256)
  sampling = SamplingConfig(max_new_tokens=32, temperature=1.0, stop_tokens=(tokenizer.eos_id,),
                            pad_id=tokenizer.pad_id or 0)
  pool = partial.init_pool(config, smol, sampling, len(prompt), jax.random.PRNGKey(0), turns=True)
  c = pool.resume_slot
  row = prompt + written
  s = pool.sampler
  tokens = s.tokens.at[0, c - len(row):c].set(jnp.asarray(row))
  mask = s.token_mask.at[0, c - len(row):c].set(True)
  version = s.version.at[0, c - len(written):c].set(0)
  pool = pool.replace(sampler=s.replace(tokens=tokens, token_mask=mask, version=version,
                                        done=jnp.ones((1,), bool)),
                      start=jnp.asarray([c - len(row)], jnp.int32))
  turns = turns_lib.Turns(calculator, tokenizer)
  pool, counters = turns.answer(pool)
  assert counters.steps == 1 and counters.errors == 0
  s = jax.device_get(pool.sampler)
  assert not s.done[0] and int(pool.env_status[0]) == partial.ENV_RUNNING
  observation = tokenizer.encode("24>>")
  np.testing.assert_array_equal(s.tokens[0, c - len(observation):c], observation)
  assert (s.version[0, c - len(observation):c] == -1).all()
  completion = s.tokens[0, c - len(written) - len(observation):c]
  assert tokenizer.decode(completion) == "Half of 48 is <<48/2=24>>"
  # The template's turn markers (<|im_end|> is the EOS id) did not cut what the calculator
  # read: it found the call after them.
  assert tokenizer.eos_id in prompt
