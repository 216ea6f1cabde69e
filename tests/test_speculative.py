"""Speculative decoding (sampling/speculative.py): the drafts by hand, and exactness for
every draft source: greedy outputs identical to plain decoding, sampled completions
distributed as the policy's own (chi-square against the exact distribution), behaviour
log-probs equal to a recomputed forward. Left-padded prompts of different lengths, stop
tokens and top-p are checked against references that run each prompt alone, unpadded
(full forwards, float64 NumPy sampling distributions), and the acceptance rule against
its lossy variant (SPEC-RL's: no residual draw).

Mutants these tests were run against (each on a scratch copy of sampling/speculative.py,
never committed), and the tests that fail:
- padding-blind verify, mask (`_verify_step`'s kv_mask all ones: the verify forward
  attends to the left padding), and padding-blind verify, positions (the verify forward at
  RoPE positions = slot indices, lp.last + j, instead of the row's own positions):
    test_greedy_decoding_of_left_padded_prompts_matches_each_prompt_decoded_alone,
    test_sampled_left_padded_prompts_with_top_p_and_a_stop_token_have_the_policys_distribution;
- residual without the zeroed draft (`residual = final_weights`: after rejecting draft x
  the next token is drawn from p with x kept, SPEC-RL's rule):
    test_chi_square_rejects_the_lossy_residual_rule_and_accepts_the_exact_one,
    test_sampled_left_padded_prompts_with_top_p_and_a_stop_token_have_the_policys_distribution,
    test_sampled_completions_have_the_policys_distribution (all four cases);
- the residual zeroing the first draft token instead of the rejected one:
    test_chi_square_rejects_the_lossy_residual_rule_and_accepts_the_exact_one;
- unshifted bonus token (after every draft is accepted, the final token drawn, and its
  log-prob read, at position accepted - 1 instead of accepted), and the same with only the
  draw shifted:
    test_chi_square_rejects_the_lossy_residual_rule_and_accepts_the_exact_one,
    test_sampled_left_padded_prompts_with_top_p_and_a_stop_token_have_the_policys_distribution,
    test_sampled_completions_have_the_policys_distribution (some cases).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from models import transformer
from sampling import sampler
from sampling import speculative
from sampling.sampler import SamplingConfig
from sampling.logits import inverse_cdf, sampled_weights
from sampling.speculative import DraftConfig
from tests import tiny

CONFIG = tiny.model(vocab_size=8)  # a small vocabulary: drafts are often accepted
PARAMS = transformer.init_params(CONFIG, jax.random.PRNGKey(0), init_std=0.5)
PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive: n-gram lookup finds drafts
SOURCES = {"prompt_lookup": ("prompt_lookup",), "group": ("group",),
           "history": ("history",), "all": ("prompt_lookup", "group", "history")}
GROUP = 4


def _draft_config(name, tokens=3):
  return DraftConfig(tokens=tokens, sources=SOURCES[name], ngram=2, group_size=GROUP)


def _history(generation):
  """Each row's completion in `generation` as its 'history' source (SPEC-RL: the prompt's
  completion from its previous visit)."""
  prompt_len = len(PROMPT)
  return generation.tokens[:, prompt_len:], generation.completion_mask[:, prompt_len:]


def _prompts(rows):
  tokens = jnp.asarray(np.tile(PROMPT, (rows, 1)), jnp.int32)
  return tokens, jnp.ones_like(tokens, bool)


def test_draft_is_the_continuation_of_the_latest_match():
  # Row 0: "... 7 1 2 6 1 2" -> the latest earlier "1 2" (slots 3-4) continues "6 1 2".
  tokens = jnp.asarray([[7, 1, 2, 6, 1, 2, 0, 0]])
  valid = jnp.asarray([[1, 1, 1, 1, 1, 1, 0, 0]], bool)
  config = DraftConfig(tokens=3, sources=("prompt_lookup",), ngram=2)
  drafts, length, source = speculative.draft(tokens, valid, jnp.asarray([5]), config)
  assert drafts[0].tolist() == [6, 1, 2] and int(length[0]) == 3 and int(source[0]) == 0
  # The continuation stops at the first unwritten slot: "1 2 3" ... "1 2" -> "3 1 2"
  tokens = jnp.asarray([[1, 2, 3, 1, 2, 0]])
  valid = jnp.asarray([[1, 1, 1, 1, 1, 0]], bool)
  drafts, length, _ = speculative.draft(tokens, valid, jnp.asarray([4]), config)
  assert drafts[0, :3].tolist() == [3, 1, 2] and int(length[0]) == 3
  # Repeating text: the match's continuation reaches the newest token, the draft repeats
  # the cycle ("5 6 5 6" -> "5 6 5").
  tokens = jnp.asarray([[7, 5, 6, 5, 6, 0, 0, 0]])
  valid = jnp.asarray([[1, 1, 1, 1, 1, 0, 0, 0]], bool)
  drafts, length, _ = speculative.draft(tokens, valid, jnp.asarray([4]), config)
  assert drafts[0].tolist() == [5, 6, 5] and int(length[0]) == 3
  # No match at all: no draft.
  tokens = jnp.asarray([[1, 2, 3, 4, 5, 0]])
  valid = tokens > 0
  _, length, source = speculative.draft(tokens, valid, jnp.asarray([4]), config)
  assert int(length[0]) == 0 and int(source[0]) == -1


def test_group_and_history_sources_and_their_priority():
  """Each row's last token is 4. Row 0's own earlier "4" continues "2 3", row 1's "6 7";
  a sibling's match whose continuation is not written yet (row 1's newest 4) is skipped.
  The first-listed source wins where several match; history drafts from its reference."""
  tokens = jnp.asarray([[1, 4, 2, 3, 4, 0, 0],
                        [5, 4, 6, 7, 4, 0, 0]])
  valid, last = tokens > 0, jnp.asarray([4, 4])
  own_first = DraftConfig(tokens=2, sources=("prompt_lookup", "group"), ngram=1, group_size=2)
  drafts, length, source = speculative.draft(tokens, valid, last, own_first)
  assert drafts.tolist() == [[2, 3], [6, 7]] and length.tolist() == [2, 2]
  assert source.tolist() == [0, 0]
  group_first = DraftConfig(tokens=2, sources=("group", "prompt_lookup"), ngram=1, group_size=2)
  drafts, _, source = speculative.draft(tokens, valid, last, group_first)
  assert drafts.tolist() == [[6, 7], [2, 3]] and source.tolist() == [0, 0]
  history = DraftConfig(tokens=2, sources=("history",), ngram=1)
  drafts, length, source = speculative.draft(
      tokens, valid, last, history, history=jnp.asarray([[9, 4, 2, 3], [0, 0, 0, 0]]),
      history_mask=jnp.asarray([[1, 1, 1, 1], [0, 0, 0, 0]], bool))
  assert drafts[0].tolist() == [2, 3] and source.tolist() == [0, -1] and int(length[1]) == 0


@pytest.mark.parametrize("name, compact", [(name, False) for name in SOURCES]
                         + [pytest.param("all", True, marks=pytest.mark.slow)])
def test_greedy_speculative_decoding_is_plain_greedy_decoding(name, compact):
  """compact: 32 rows in rounds of 2 steps, live rows gathered into 16 or 8 (stop tokens 2
  and 5 end 19 of them at lengths 1 to 14)."""
  rows, new_tokens = (32, 24) if compact else (8, 16)
  prompts, mask = _prompts(rows)
  if compact:  # different prompts, so rows stop at different steps
    prompts = jnp.asarray(np.random.default_rng(4).integers(3, 8, (rows, len(PROMPT))), jnp.int32)
  config = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0,
                          stop_tokens=(2, 5) if compact else (2,),
                          phase_tokens=8 if compact else 64, compact_min_rows=8)
  plain = sampler.generate(PARAMS, prompts, mask, jax.random.PRNGKey(1), CONFIG, config)
  history, history_mask = _history(plain)  # the same policy's output: all accepted
  spec = speculative.speculative_generate(
      PARAMS, prompts, mask, jax.random.PRNGKey(1), CONFIG, config, _draft_config(name),
      history=history, history_mask=history_mask)
  counts = spec.speculative
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.completion_mask, plain.completion_mask)
  np.testing.assert_array_equal(spec.version, plain.version)
  np.testing.assert_array_equal(spec.stopped, plain.stopped)
  np.testing.assert_allclose(spec.behavior_logp, plain.behavior_logp, atol=1e-5)
  assert int(counts.emitted) == int(plain.completion_mask.sum())
  assert int(counts.accepted.sum()) > 0 and int(counts.forwards) < int(counts.emitted)


def _exact_prefix_distribution(temperature, top_k, length=3):
  """P(first `length` completion tokens) under the policy, float64 NumPy from the logits of
  every continuation (the sampled distribution: softmax(logits / T) over the top k)."""
  vocab = CONFIG.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=length)))
  tokens = jnp.asarray(np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], 1), jnp.int32)
  logits, _ = transformer.forward(PARAMS, tokens, transformer.positions_from_mask(
      jnp.ones_like(tokens, bool)), jnp.ones_like(tokens, bool), CONFIG)
  logits = np.asarray(logits, np.float64)[:, len(PROMPT) - 1:-1] / temperature  # [N, len, V]
  if top_k:
    kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
    logits = np.where(logits >= kth, logits, -np.inf)
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  total = np.take_along_axis(logp, seqs[..., None], -1)[..., 0].sum(-1)
  return seqs, np.exp(total)


def _chi_square_p(samples, seqs, probs):
  """Goodness of fit of sampled prefixes [N, len] to `probs`; cells with expected count < 5
  are pooled."""
  index = {tuple(s): i for i, s in enumerate(seqs)}
  counts = np.bincount([index[tuple(s)] for s in samples], minlength=len(seqs))
  expected = probs / probs.sum() * len(samples)
  small = expected < 5
  observed = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  keep = expected > 0
  return scipy_stats.chisquare(observed[keep], expected[keep]).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("name, temperature, top_k", [
    ("all", 0.8, 5), ("prompt_lookup", 1.0, 0), ("group", 1.0, 0), ("history", 1.0, 0)])
def test_sampled_completions_have_the_policys_distribution(name, temperature, top_k):
  """10^4 completions: their first three tokens fit the exact distribution (p > 0.01), the
  drafts are both accepted and rejected, and every behaviour log-prob is the sampled
  distribution's log-prob of its token, recomputed by a full forward."""
  rows, new_tokens = 10240, 4
  prompts, mask = _prompts(rows)
  config = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature, top_k=top_k,
                          compact_min_rows=0)
  earlier = sampler.generate(PARAMS, prompts, mask, jax.random.PRNGKey(3), CONFIG, config)
  history, history_mask = _history(earlier)  # another draw of the same prompts
  spec = speculative.speculative_generate(
      PARAMS, prompts, mask, jax.random.PRNGKey(7), CONFIG, config, _draft_config(name, 2),
      history=history, history_mask=history_mask)
  counts = spec.speculative
  drafted, accepted = int(counts.drafted.sum()), int(counts.accepted.sum())
  assert 0.05 * drafted < accepted < 0.95 * drafted
  seqs, probs = _exact_prefix_distribution(temperature, top_k)
  completions = np.asarray(spec.tokens)[:, len(PROMPT):len(PROMPT) + 3]
  assert _chi_square_p(completions, seqs, probs) > 0.01
  # The same test passes for plain decoding (the reference is right).
  plain = sampler.generate(PARAMS, prompts, mask, jax.random.PRNGKey(7), CONFIG, config)
  assert _chi_square_p(np.asarray(plain.tokens)[:, len(PROMPT):len(PROMPT) + 3], seqs,
                       probs) > 0.01
  # Behaviour log-probs: the recomputed sampled distribution at every completion token.
  real = spec.prompt_mask | spec.completion_mask
  logits, _ = transformer.forward(PARAMS, spec.tokens, transformer.positions_from_mask(real),
                                  real, CONFIG)
  logits = np.asarray(logits, np.float64)[:, :-1] / temperature
  if top_k:
    kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
    logits = np.where(logits >= kth, logits, -np.inf)
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp, np.asarray(spec.tokens)[:, 1:, None], -1)[..., 0]
  completion = np.asarray(spec.completion_mask)[:, 1:]
  np.testing.assert_allclose(np.asarray(spec.behavior_logp)[:, 1:][completion],
                             picked[completion], atol=2e-4)


# --- padded prompts, stop tokens, top-p: against references that run each row alone ------

STOP = 2
# Four prompts of 8, 5, 3 and 6 tokens, left-padded to 8 with pad id 0 (the sampler's
# layout): with padding-blind attention or positions, every row but the first changes.
PADDED = ([3, 4, 5, 3, 4, 5, 3, 4], [6, 3, 4, 6, 3], [5, 3, 5], [4, 6, 4, 6, 4, 6])


def _left_padded(prompts, copies):
  """([len(prompts) * copies, P] prompts left-padded with 0, their mask); a prompt's copies
  are adjacent rows (a 'group' of `copies`)."""
  width = max(map(len, prompts))
  tokens = np.zeros((len(prompts) * copies, width), np.int32)
  for i, prompt in enumerate(prompts):
    tokens[i * copies:(i + 1) * copies, width - len(prompt):] = prompt
  return jnp.asarray(tokens), jnp.asarray(tokens > 0)


def _reference_logits(sequences, width=None):
  """float64 logits [N, width, V] of each sequence (token lists, or the rows of an [N,
  width] array) run alone from slot 0: positions 0, 1, ..., no padding mask, no cache
  (slots after a sequence's end cannot reach its positions through causal attention).
  The padding-free computation the sampler's must agree with."""
  if width is None:
    tokens = np.asarray(sequences, np.int32)
    width = tokens.shape[1]
  else:
    tokens = np.zeros((len(sequences), width), np.int32)
    for i, seq in enumerate(sequences):
      tokens[i, :len(seq)] = seq
  positions = jnp.broadcast_to(jnp.arange(width), tokens.shape)
  logits, _ = transformer.forward(PARAMS, jnp.asarray(tokens), positions,
                                  jnp.ones(tokens.shape, bool), CONFIG)
  return np.asarray(logits, np.float64)


def _sampled_logp(logits, temperature, top_p=1.0):
  """float64 log-probs [..., V] of the distribution a sampler draws from: softmax(logits /
  T) cut to its top-p nucleus (the most likely tokens, in order, while the mass before a
  token is below top_p) and renormalised; -inf outside the nucleus."""
  z = logits / temperature
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  order = np.argsort(-p, axis=-1, kind="stable")
  sorted_p = np.take_along_axis(p, order, -1)
  kept = np.zeros(p.shape, bool)
  np.put_along_axis(kept, order, np.cumsum(sorted_p, -1) - sorted_p < top_p, -1)
  p = np.where(kept | (top_p >= 1.0), p, 0.0)
  with np.errstate(divide="ignore"):
    return np.log(p / p.sum(-1, keepdims=True))


def _reference_greedy(prompts, new_tokens, stop_tokens):
  """Greedy decoding of each prompt alone, one full forward per token (no cache, no
  drafts): (completions, their temperature-1 log-probs, stopped)."""
  seqs, logps, done = [list(p) for p in prompts], [[] for _ in prompts], [False] * len(prompts)
  width = max(map(len, prompts)) + new_tokens
  for _ in range(new_tokens):
    logits = _reference_logits(seqs, width)
    for r, seq in enumerate(seqs):
      if not done[r]:
        row = logits[r, len(seq) - 1]
        token = int(np.argmax(row))
        logps[r].append(_sampled_logp(row, 1.0)[token])
        seq.append(token)
        done[r] = token in stop_tokens
  return [s[len(p):] for s, p in zip(seqs, prompts)], logps, done


def test_greedy_decoding_of_left_padded_prompts_matches_each_prompt_decoded_alone():
  """Prompts of 8, 5, 3 and 6 tokens left-padded into one batch, stop token 2 (three of the
  four prompts stop, after 3 to 8 tokens): every row's tokens, stop flag and behaviour
  log-probs are those of its prompt decoded alone without padding by full forwards."""
  copies, new_tokens = 2, 16
  prompts, mask = _left_padded(PADDED, copies)
  config = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop_tokens=(STOP,))
  spec = speculative.speculative_generate(
      PARAMS, prompts, mask, jax.random.PRNGKey(1), CONFIG, config,
      DraftConfig(tokens=3, sources=("prompt_lookup", "group"), ngram=2, group_size=copies))
  rows = [p for p in PADDED for _ in range(copies)]
  completions, logps, stopped = _reference_greedy(rows, new_tokens, (STOP,))
  assert 0 < sum(stopped) < len(rows)  # stopped and unstopped rows
  width = prompts.shape[1]
  for r, (completion, logp) in enumerate(zip(completions, logps)):
    n = int(spec.completion_len[r])
    assert np.asarray(spec.tokens[r, width:width + n]).tolist() == completion, r
    np.testing.assert_allclose(np.asarray(spec.behavior_logp[r, width:width + n]), logp,
                               atol=1e-5, err_msg=f"row {r}")
  np.testing.assert_array_equal(spec.stopped, stopped)
  np.testing.assert_array_equal(spec.prompt_mask[:, :width], mask)
  counts = spec.speculative
  assert 0 < int(counts.accepted.sum()) < int(counts.drafted.sum())  # accepted and rejected


def _exact_stopped_prefixes(prompt, temperature, top_p, length=3):
  """{first `length` completion tokens, cut after a stop token: probability} under the
  policy, from the logits of every continuation of `prompt` run alone (float64)."""
  continuations = list(itertools.product(range(CONFIG.vocab_size), repeat=length))
  logits = _reference_logits([list(prompt) + list(c) for c in continuations],
                             len(prompt) + length)
  logp = _sampled_logp(logits[:, len(prompt) - 1:-1], temperature, top_p)  # [N, length, V]
  probs = {}
  for logp_row, continuation in zip(logp, continuations):
    total, prefix = 0.0, []
    for position, token in enumerate(continuation):
      total += logp_row[position, token]
      prefix.append(token)
      if token == STOP:
        break
    probs[tuple(prefix)] = np.exp(total)
  return probs


def _chi_square_cells_p(counts, probs):
  """Goodness of fit of observed counts to cell probabilities (1-D arrays); cells with an
  expected count < 5 are pooled; an observation in a cell of probability 0 gives p = 0."""
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  if counts[probs == 0].sum() > 0:
    return 0.0
  expected = probs / probs.sum() * counts.sum()
  small = expected < 5
  observed = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  keep = expected > 0
  return scipy_stats.chisquare(observed[keep], expected[keep]).pvalue


@pytest.mark.slow
def test_sampled_left_padded_prompts_with_top_p_and_a_stop_token_have_the_policys_distribution():
  """Two prompts (8 and 5 tokens, the second left-padded by 3), 4096 rows each,
  temperature 0.9, top-p 0.9, stop token 2, k = 2 drafts. Against each prompt decoded alone
  (float64 from full forwards): the first three completion tokens (cut at the stop token)
  fit the exact distribution (chi-square p > 0.01 per prompt); every completion token lies
  in the nucleus and its behaviour log-prob is the nucleus distribution's; rows end at
  their first stop token, and only there."""
  copies, new_tokens, temperature, top_p = 4096, 6, 0.9, 0.9
  chosen = (PADDED[0], PADDED[1])
  prompts, mask = _left_padded(chosen, copies)
  width = prompts.shape[1]
  config = SamplingConfig(max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                          stop_tokens=(STOP,), compact_min_rows=0)
  spec = speculative.speculative_generate(
      PARAMS, prompts, mask, jax.random.PRNGKey(7), CONFIG, config,
      DraftConfig(tokens=2, sources=("prompt_lookup",), ngram=2))
  counts = spec.speculative
  drafted, accepted = int(counts.drafted.sum()), int(counts.accepted.sum())
  assert 0.05 * drafted < accepted < 0.95 * drafted
  tokens, completion = np.asarray(spec.tokens), np.asarray(spec.completion_mask)
  for i, prompt in enumerate(chosen):
    rows = slice(i * copies, (i + 1) * copies)
    probs = _exact_stopped_prefixes(prompt, temperature, top_p)
    cells = {prefix: j for j, prefix in enumerate(probs)}
    observed = np.zeros(len(cells))
    for toks, ok in zip(tokens[rows, width:width + 3], completion[rows, width:width + 3]):
      observed[cells[tuple(int(t) for t in toks[ok])]] += 1  # KeyError: not a prefix
    assert _chi_square_cells_p(observed, list(probs.values())) > 0.01, prompt
  # Every completion token against its row run alone: in the nucleus, with its log-prob.
  real = np.asarray(spec.prompt_mask | spec.completion_mask)
  alone = np.take_along_axis(tokens, np.argsort(~real, axis=1, kind="stable"), 1)  # unpadded
  starts = real.sum(1) - completion.sum(1)  # each row's prompt length
  at = starts[:, None] - 1 + np.arange(new_tokens)[None]  # the positions predicting it
  logits = np.take_along_axis(_reference_logits(alone), at[..., None], 1)
  logp = _sampled_logp(logits, temperature, top_p)
  picked = np.take_along_axis(logp, tokens[:, width:, None], -1)[..., 0]
  written = completion[:, width:]
  assert np.all(np.isfinite(picked[written]))  # no token outside the nucleus
  np.testing.assert_allclose(np.asarray(spec.behavior_logp)[:, width:][written],
                             picked[written], atol=1e-4)
  # Rows end at their first stop token (the only one they write) or at the slots' end.
  is_stop = (tokens[:, width:] == STOP) & written
  lengths = written.sum(1)
  np.testing.assert_array_equal(is_stop.sum(1), np.asarray(spec.stopped))
  np.testing.assert_array_equal(is_stop[np.arange(len(lengths)), lengths - 1],
                                np.asarray(spec.stopped))
  assert np.all(np.asarray(spec.stopped) | (lengths == new_tokens))
  assert 0.1 < np.mean(np.asarray(spec.stopped)) < 0.9


def _lossy_accept(logits, drafts, length, uniforms, sampling_config):
  """SPEC-RL's reference rule, a variant for the test below: as `speculative._accept`, but
  after a rejection the token is drawn from p itself (the rejected draft included) rather
  than from the residual p with the draft removed, renormalised."""
  accepted, final, draft_logp, final_logp = speculative._accept(  # pylint: disable=protected-access
      logits, drafts, length, uniforms, sampling_config)
  c, k = sampling_config, drafts.shape[1]
  weights, shifted = sampled_weights(logits, c.temperature, c.top_k, c.top_p)
  at = lambda x: jnp.take_along_axis(x, accepted[:, None, None], 1)[:, 0]  # [B, V]
  redrawn = inverse_cdf(at(weights), uniforms[:, k])
  redrawn_logp = (jnp.take_along_axis(at(shifted), redrawn[:, None], 1)[:, 0]
                  - jnp.log(at(weights).sum(-1)))
  rejected = accepted < length
  return (accepted, jnp.where(rejected, redrawn, final), draft_logp,
          jnp.where(rejected, redrawn_logp, final_logp))


def _verify_step_tokens(rule, logits, drafts, length, rows, seed, config):
  """Each of `rows` verify steps of one draft under `rule`: [rows, k + 1] emitted tokens
  (the accepted drafts, then the final token; -1 after it)."""
  k = drafts.shape[0]
  uniforms = jax.random.uniform(jax.random.PRNGKey(seed), (rows, k + 1))
  accepted, final, _, _ = jax.jit(rule, static_argnums=4)(
      jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (rows,) + logits.shape),
      jnp.broadcast_to(drafts, (rows, k)), jnp.full((rows,), length, jnp.int32), uniforms,
      config)
  accepted, final = np.asarray(accepted), np.asarray(final)
  emitted = np.where(np.arange(k + 1)[None] < accepted[:, None], np.append(drafts, 0)[None], -1)
  emitted[np.arange(rows), accepted] = final
  return emitted


def _chi_square_along_the_draft(emitted, drafts, length, probs):
  """The chi-square test of verify steps' emitted tokens [N, k + 1] against the policy's
  distributions probs [k + 1, V] (probs[j]: of the token after draft tokens 0..j-1):
  position by position, the steps that accepted drafts 0..j-1 must emit at j a token
  distributed as probs[j] (the accepted draft j or, after its rejection, the residual
  draw; at j = length the bonus draw). Cells (j, token) pooled into one statistic."""
  counts, cell_probs = [], []
  for j in range(length + 1):
    reached = np.all(emitted[:, :j] == np.asarray(drafts)[None, :j], axis=1) & (emitted[:, j] >= 0)
    n = reached.sum()
    counts.append(np.bincount(emitted[reached, j], minlength=probs.shape[1]))
    cell_probs.append(probs[j] * n)
  counts, expected = np.concatenate(counts), np.concatenate(cell_probs)
  if counts[expected == 0].sum() > 0:
    return 0.0
  small = expected < 5
  observed = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  keep = expected > 0
  return scipy_stats.chisquare(observed[keep], expected[keep],
                               ddof=length).pvalue  # one constraint per position


def test_chi_square_rejects_the_lossy_residual_rule_and_accepts_the_exact_one():
  """20000 verify steps of the draft [2, 6] after PROMPT (temperature 0.9, top-p 0.9: p(2)
  = 0.43 at the first position, p(6 | 2) = 0.51 at the second), by the library's rule and
  by SPEC-RL's (`_lossy_accept`), each with all drafts tested and with only the first
  (whose next token is then the bonus draw). The emitted tokens, position by position along
  the draft, against the policy's distributions computed apart (float64, the prompt and
  draft run alone): the library's rule fits (p > 0.01), the lossy one, which over-weights
  the rejected draft token, does not (p < 1e-6)."""
  temperature, top_p, drafts = 0.9, 0.9, np.asarray([2, 6], np.int32)
  config = SamplingConfig(max_new_tokens=4, temperature=temperature, top_p=top_p)
  logits = _reference_logits([PROMPT + drafts.tolist()], len(PROMPT) + 2)[0, len(PROMPT) - 1:]
  probs = np.exp(_sampled_logp(logits, temperature, top_p))  # [3, V]
  assert 0.2 < probs[0, 2] < 0.8 and 0.2 < probs[1, 6] < 0.8  # both outcomes are frequent
  p_values = {}
  exact = speculative._accept  # pylint: disable=protected-access
  for name, rule in (("exact", exact), ("lossy", _lossy_accept)):
    for length in (2, 1):
      emitted = _verify_step_tokens(rule, logits, drafts, length, 20000, 10 + length, config)
      p_values[name, length] = _chi_square_along_the_draft(emitted, drafts, length, probs)
  assert min(p_values["exact", 2], p_values["exact", 1]) > 0.01, p_values
  assert max(p_values["lossy", 2], p_values["lossy", 1]) < 1e-6, p_values


def test_speculative_rollouts_through_the_launcher(tmp_path):
  """--config.rollout.speculative.tokens=3 with prompt-lookup and group drafts: the RL steps
  log the draft counters, fewer target forwards than tokens, and behaviour log-probs that
  the train step's own forward reproduces (rollout_train_mismatch_kl at float32 rounding)."""
  import json  # pylint: disable=import-outside-toplevel
  from experiments import train as launcher  # pylint: disable=import-outside-toplevel
  from tests.launcher_config import tiny_run_config  # pylint: disable=import-outside-toplevel
  launcher.run(tiny_run_config(tmp_path, {"rollout.speculative.tokens": 3,
                                          "rollout.speculative.sources": ("prompt_lookup",
                                                                          "group")}))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert len(steps) == 2
  for r in steps:
    assert r["spec_drafted"] == r["spec_drafted_prompt_lookup"] + r["spec_drafted_group"] > 0
    assert r["spec_accepted"] == r["spec_accepted_prompt_lookup"] + r["spec_accepted_group"]
    for source in ("prompt_lookup", "group"):
      assert r[f"spec_acceptance_{source}"] == pytest.approx(
          r[f"spec_accepted_{source}"] / max(r[f"spec_drafted_{source}"], 1))
    assert 0 < r["spec_forwards_per_token"] < 1
    assert r["rollout_train_mismatch_kl"] < 1e-6


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.kind": "tree"}, "has its own decode loop"),
    ({"mesh.data": 2, "mesh.fsdp": 4}, "runs on one device"),
    ({"rollout.speculative.sources": ("history",)}, "config.task.train_pool > 0"),
    ({"rollout.speculative.sources": ("group",), "selection.kind": "adaptive"},
     "sizes them per prompt"),
    ({"rollout.speculative.sources": ("lookup",)}, "use one or more of"),
])
def test_speculative_settings_the_launcher_cannot_run_are_refused(tmp_path, overrides, message):
  from rl import wiring  # pylint: disable=import-outside-toplevel
  from tests.launcher_config import tiny_run_config  # pylint: disable=import-outside-toplevel
  config = tiny_run_config(tmp_path, {"rollout.speculative.tokens": 3, **overrides})
  with pytest.raises(ValueError, match=message):
    wiring.validate(config)


@pytest.mark.slow
def test_history_drafts_from_the_previous_visit_and_resumes(tmp_path):
  """sources=('history',) with a pool of 2 prompts: step 1 visits both (nothing to draft
  from yet), step 2 drafts from step 1's completions; the kept completions are part of
  the checkpoint, so a run resumed after step 2 logs what the uninterrupted run logs."""
  import json  # pylint: disable=import-outside-toplevel
  from experiments import train as launcher  # pylint: disable=import-outside-toplevel
  from tests.launcher_config import tiny_run_config  # pylint: disable=import-outside-toplevel
  flags = {"rollout.speculative.tokens": 3, "rollout.speculative.sources": ("history",),
           "task.train_pool": 2}
  steps = lambda workdir: [json.loads(line) for line in open(workdir / "metrics.jsonl")
                           if '"spec_drafted"' in line]
  launcher.run(tiny_run_config(tmp_path / "whole", {**flags, "rl.steps": 4}))
  whole = steps(tmp_path / "whole")
  assert len(whole) == 4 and whole[0]["spec_drafted"] == 0 and whole[1]["spec_drafted_history"] > 0
  launcher.run(tiny_run_config(tmp_path / "resumed", {**flags, "rl.steps": 2}))
  launcher.run(tiny_run_config(tmp_path / "resumed", {**flags, "rl.steps": 4,
                                                      "resume.allow_changes": "rl.steps"}))
  resumed = steps(tmp_path / "resumed")
  assert [r["spec_drafted"] for r in resumed] == [r["spec_drafted"] for r in whole]
  np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in whole],
                             rtol=1e-6)


@pytest.mark.slow
def test_speculative_benchmark_smoke_run_compares_with_plain(tmp_path):
  """experiments.bench_speculative --smoke: every case times plain and speculative decoding
  of the same prompts; with the plain run's own output as history every draft is right."""
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  repo = pathlib.Path(__file__).resolve().parent.parent
  subprocess.run([sys.executable, "-m", "experiments.bench_speculative", "--smoke",
                  f"--out={tmp_path}"], cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)),
                 check=True, timeout=600)
  rows = json.loads((tmp_path / "bench_speculative.json").read_text())["rows"]
  assert {(r["temperature"], tuple(r["results"])) for r in rows} == {
      (0.0, ("plain", "prompt_lookup", "history_all_right")), (1.0, ("plain", "prompt_lookup"))}
  greedy = next(r["results"] for r in rows if r["temperature"] == 0.0)
  assert greedy["history_all_right"]["acceptance"] == 1.0
  assert greedy["history_all_right"]["forwards_per_token"] < 0.5
  assert greedy["history_all_right"]["tokens"] == greedy["plain"]["tokens"]
  assert all(r["results"][name]["tokens_per_s"] > 0 for r in rows for name in r["results"])
  assert (tmp_path / "bench_speculative.md").stat().st_size > 0
