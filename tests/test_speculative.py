"""Speculative decoding (sampling/speculative.py): the drafts by hand, and exactness for
every draft source: greedy outputs identical to plain decoding, sampled completions
distributed as the policy's own (chi-square against the exact distribution), behaviour
log-probs equal to a recomputed forward."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from models import transformer
from models.config import ModelConfig
from sampling import sampler
from sampling import speculative
from sampling.sampler import SamplingConfig
from sampling.speculative import DraftConfig

CONFIG = ModelConfig(vocab_size=8, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=16, mlp_dim=64, max_seq_len=32)
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
                         + [("all", True)])
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


@pytest.mark.parametrize("name, temperature, top_k", [
    ("prompt_lookup", 1.0, 0), ("group", 1.0, 0), ("history", 1.0, 0), ("all", 0.8, 5)])
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
  launcher.run(tiny_run_config(tmp_path / "resumed", {**flags, "rl.steps": 4}))
  resumed = steps(tmp_path / "resumed")
  assert [r["spec_drafted"] for r in resumed] == [r["spec_drafted"] for r in whole]
  np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in whole],
                             rtol=1e-6)


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
