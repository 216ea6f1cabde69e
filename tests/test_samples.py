"""What the policy writes, visible (rl/samples.py): sample records of held-out and training
completions, their tables, the files and writers that receive them (experiments/metrics.py),
held-out evaluation's category counts on the SmolLM2 configs' tasks (a stub tokenizer and
sampler: no model), and a launcher run that writes them at every evaluation and every N
training steps, with experiments.eval's --show table of the same problems."""

import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import eval as eval_launcher
from experiments import metrics
from experiments import run_records
from experiments import train as train_launcher
from experiments.configs import smollm2_basic_arithmetic
from experiments.configs import smollm2_countdown
from experiments.configs import smollm2_gsm
from rl import evaluation
from rl import samples
from rl import verdicts
from rl import wiring
from rl.rollouts import batches as rollout_lib
from rl.samples import ScoredRow
from rl.types import Rollout
from rl.verdicts import Verdict
from sampling.sampler import Generation
from tests.launcher_config import tiny_run_config
from tests.metrics_fixtures import FakeWandb, read_events, texts

CORRECT, NO_ANSWER, MALFORMED, WRONG, TRUNCATED = (
    verdicts.CORRECT, verdicts.NO_ANSWER, verdicts.MALFORMED, verdicts.WRONG_VALUE,
    verdicts.TRUNCATED)


def test_eval_samples_are_the_spread_problems_with_their_verdicts():
  # The spread is fixed and covers the set.
  assert samples.spread_indices(10, 4) == [0, 2, 5, 7]
  assert samples.spread_indices(3, 16) == [0, 1, 2]
  assert samples.spread_indices(500, 16) == samples.spread_indices(500, 16)
  assert samples.spread_indices(500, 16)[-1] == 468 and samples.spread_indices(5, 0) == []
  rows = [ScoredRow(f"q{i}", f"c{i}", Verdict(WRONG if i % 2 else CORRECT, f"a{i}", f"t{i}"))
          for i in range(8)]
  rewards, lengths = np.arange(8) / 8, np.arange(8) + 1
  got = samples.eval_samples(rows, rewards, lengths, 3)
  assert [s["example"] for s in got] == [0, 2, 5]
  assert got[2] == {"example": 5, "category": WRONG, "reward": 0.625, "answer": "a5",
                    "target": "t5", "length": 6, "prompt": "q5", "completion": "c5"}
  assert list(got[0]) == list(samples.EVAL_FIELDS)


def test_train_samples_are_the_first_trained_rows_with_advantage_and_logp_sum():
  """Rows without a scored row (a tree's unused rows) or without trained tokens (a rejected
  group) are passed over; the advantage is the mean over the row's trained tokens, the
  log-prob sum the sampler's over them."""
  mask = np.array([[0, 1, 1, 0], [0, 0, 0, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]], bool)
  advantages = np.where(mask, np.array([[0, 1.0, 3.0, 9]] * 5), 7.0).astype(np.float32)
  logp = np.where(mask, -0.5, -9.0).astype(np.float32)
  rollout = Rollout(tokens=jnp.zeros((5, 4), jnp.int32), prompt_mask=jnp.asarray(~mask),
                    completion_mask=jnp.asarray(mask), behavior_logp=jnp.asarray(logp),
                    version=jnp.zeros((5, 4), jnp.int32),
                    group=jnp.asarray([0, 0, 1, 1, 2], jnp.int32),
                    reward=jnp.asarray([0.0, 1.0, 1.0, 0.5, 0.0]),
                    advantages=jnp.asarray(advantages))
  row = lambda i: ScoredRow(f"q{i}", f"c{i}", Verdict(CORRECT, str(i), "t"))
  got = samples.train_samples(rollout, [row(0), row(1), row(2), None, row(4)], 3)
  assert [s["row"] for s in got] == [0, 2, 4]
  assert got[1] == {"row": 2, "group": 1, "category": CORRECT, "reward": 1.0,
                    "advantage": pytest.approx((1 + 3 + 9) / 3), "behavior_logp_sum": -1.5,
                    "answer": "2", "target": "t", "length": 3, "prompt": "q2",
                    "completion": "c2"}
  assert got[0]["advantage"] == 2.0 and list(got[0]) == list(samples.TRAIN_FIELDS)


def test_tables_show_policy_text_on_one_line_as_text():
  hostile = "__import__('os').system('x') | `rm`\n" + "7" * 300 + " so \\boxed{42}"
  sample = {"example": 0, "category": WRONG, "reward": 0.5, "answer": None,
            "completion": hostile}
  assert samples.elide("abcdefghij", 7) == "ab...ij" and samples.elide("a\nb", 9) == "a\\nb"
  table = samples.markdown_table([sample], width=80).splitlines()
  assert table[0] == "| example | category | reward | answer | completion |"
  assert table[2].startswith("| 0 | wrong_value | 0.500 |  | __import__('os').system('x') "
                             "\\| `rm`\\n7")
  assert table[2].endswith("so \\boxed{42} |") and len(table) == 3
  text = samples.text_table([sample, dict(sample, example=12)], completion_width=30).splitlines()
  assert text[0].split() == ["example", "category", "reward", "answer", "completion"]
  assert text[2].index("wrong_value") == text[0].index("category")
  assert text[3].startswith("12 ") and text[3].endswith("\\boxed{42}")
  assert all(len(line) <= len(text[1]) for line in text)


def test_an_evaluation_reports_its_failures_most_frequent_first():
  counted = {**dict.fromkeys(verdicts.CATEGORIES, 0), CORRECT: 85, WRONG: 12, TRUNCATED: 3}
  assert run_records.failures_line(counted) == ", failures: wrong_value 12, truncated 3"
  assert run_records.failures_line({CORRECT: 16}) == ""
  record = run_records.eval_record(
      evaluation.EvalResult(accuracy=0.85, mean_reward=0.85, mean_length=5.0,
                            num_examples=100, categories=counted), 30, "rl", "eval", 0)
  assert record["eval_category_wrong_value"] == 12
  assert run_records.categories_of(record) == counted
  assert run_records.categories_summary({}, record) == {"warm_start": {}, "final": counted}


def _some_samples(step):
  return [{"example": i, "category": CORRECT, "reward": 1.0, "completion": f"{step}:{i}"}
          for i in range(2)]


def test_samples_go_to_their_files_tensorboard_and_wandb_and_a_resume_drops_later_ones(
    tmp_path, monkeypatch):
  fake = FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  writers = metrics.make_writers(str(tmp_path), wandb_project="arbor")
  log = metrics.MetricsLog(str(tmp_path / "metrics.jsonl"), writers=writers)
  log.truncate_after(-1)
  for step, kind in ((3, "eval"), (4, "train"), (6, "eval"), (6, "train")):
    assert log.write_samples(step, kind, _some_samples(step)) == str(
        tmp_path / "samples" / f"{kind}_{step}.jsonl")
  assert log.write_samples(7, "eval", []) is None
  log.flush()
  lines = (tmp_path / "samples" / "eval_6.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [{"step": 6, **s} for s in _some_samples(6)]
  shown = [(step, tag) for step, tag, _ in texts(read_events(tmp_path))]
  assert shown == [(3, "samples/eval/text_summary"), (4, "samples/train/text_summary"),
                   (6, "samples/eval/text_summary"), (6, "samples/train/text_summary")]
  (run,) = fake.runs
  step, logged = run.logged[0]
  assert step == 3 and logged["samples/eval"].columns == ["example", "category", "reward",
                                                          "completion"]
  assert logged["samples/eval"].data == [[0, CORRECT, 1.0, "3:0"], [1, CORRECT, 1.0, "3:1"]]
  # A resume from the checkpoint at step 4 drops what later steps wrote; the files it keeps
  # are rewritten only when their steps come again.
  (tmp_path / "samples" / "notes.jsonl").write_text("{}\n")  # not a sample file: kept
  log.truncate_to(0, 4)
  assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
      "eval_3.jsonl", "notes.jsonl", "train_4.jsonl"]
  log.close()


# --- held-out evaluation on the SmolLM2 configs' tasks, with a stub tokenizer and sampler ---

class ByteTokenizer:
  """UTF-8 bytes as ids 3..258; 0 pad, 1 EOS, 2 BOS. Decoding stops at EOS."""
  pad_id, eos_id, bos_id = 0, 1, 2

  def encode(self, text, add_bos=False):
    return [self.bos_id] * add_bos + [b + 3 for b in text.encode("utf-8")]

  def decode(self, ids):
    ids = [int(i) for i in ids]
    ids = ids[:ids.index(self.eos_id)] if self.eos_id in ids else ids
    return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")


def _stub_generate(replies: dict, max_new_tokens: int):
  """A greedy sampler that answers each prompt with replies[prompt] = (text, stopped)."""
  tokenizer = ByteTokenizer()

  def generate_fn(params, prompt_tokens, prompt_mask, rng, version=0):
    del params, rng, version
    prompt_tokens, prompt_mask = np.asarray(prompt_tokens), np.asarray(prompt_mask)
    rows = len(prompt_tokens)
    completion = np.full((rows, max_new_tokens), tokenizer.pad_id, np.int32)
    stopped = np.zeros(rows, bool)
    for r in range(rows):
      text, stopped[r] = replies[tokenizer.decode(prompt_tokens[r][prompt_mask[r]])]
      ids = (tokenizer.encode(text) + [tokenizer.eos_id] * int(stopped[r]))[:max_new_tokens]
      completion[r, :len(ids)] = ids
    completion_mask = completion != tokenizer.pad_id
    zeros = np.zeros((rows, prompt_tokens.shape[1] + max_new_tokens))
    return Generation(
        tokens=jnp.asarray(np.concatenate([prompt_tokens, completion], 1)),
        prompt_mask=jnp.asarray(np.concatenate([prompt_mask, 0 * completion_mask], 1) > 0),
        completion_mask=jnp.asarray(np.concatenate([0 * prompt_mask, completion_mask], 1) > 0),
        behavior_logp=jnp.asarray(zeros, jnp.float32), version=jnp.asarray(zeros, jnp.int32),
        completion_len=jnp.asarray(completion_mask.sum(1)), stopped=jnp.asarray(stopped),
        decode_steps=jnp.asarray(max_new_tokens))
  return generate_fn


def _math_replies(gold):
  return {CORRECT: (f"5 + 3 = 8, so the answer is \\boxed{{{gold}}}.", True),
          NO_ANSWER: ("I cannot solve this problem.", True),
          MALFORMED: ("The final answer is \\boxed{answer}.", True),
          WRONG: (f"Therefore \\boxed{{{gold}1}}", True),
          # The SmolLM2 reply: prose that never states a final number, cut off.
          TRUNCATED: ("To calculate 5 * -3, we need to perform the operation of "
                      "multiplication followed by subtraction", False)}


def _countdown_replies(example):
  return {CORRECT: (example.answer, True), NO_ANSWER: ("\n\n", True),
          MALFORMED: ("Let me think step by step.", True), WRONG: ("1 + 2", True),
          TRUNCATED: ("(1 + 2 * (3", False)}


@pytest.mark.parametrize("config_module", [smollm2_basic_arithmetic, smollm2_countdown,
                                           smollm2_gsm], ids=lambda m: m.__name__.split(".")[-1])
def test_smollm2_configs_evaluation_counts_every_category_and_keeps_fixed_samples(
    config_module, monkeypatch):
  """Held-out problem i gets a reply of category i % 5: the evaluation counts each category
  over all problems, and its samples are the spread problems with their verdicts."""
  config = config_module.get_config()
  task = wiring.build_task(wiring.settings(config))
  examples = task.examples("eval", 10)
  kinds = [CORRECT, NO_ANSWER, MALFORMED, WRONG, TRUNCATED]
  replies = {}
  for i, example in enumerate(examples):
    options = (_countdown_replies(example) if config.task.name == "countdown"
               else _math_replies(example.entry["answer"]))
    replies[example.prompt] = options[kinds[i % 5]]
  monkeypatch.setattr(rollout_lib, "make_generate",
                      lambda *args, **kwargs: _stub_generate(replies, 200))
  result = evaluation.evaluate(None, examples, task=task, tokenizer=ByteTokenizer(),
                               prompt_len=2048, max_new_tokens=200, model_config=None,
                               batch_size=4, samples=4)
  assert result.categories == {**dict.fromkeys(verdicts.CATEGORIES, 0),
                               **dict.fromkeys(kinds, 2)}
  assert result.accuracy == 0.2
  assert [s["example"] for s in result.samples] == [0, 2, 5, 7]
  assert [s["category"] for s in result.samples] == [kinds[i % 5] for i in (0, 2, 5, 7)]
  for sample in result.samples:
    example = examples[sample["example"]]
    assert sample["prompt"] == example.prompt
    assert sample["completion"] == replies[example.prompt][0]
    assert (sample["reward"] == 1.0) == (sample["category"] == CORRECT)
  assert result.samples[0]["answer"] is not None and result.samples[0]["target"]


# --- through the launcher and experiments.eval ----------------------------------------------

@pytest.mark.slow
def test_a_run_writes_samples_at_every_evaluation_and_every_n_steps_and_eval_shows_them(
    tmp_path, capsys):
  """The tiny launcher run (3 warm-start steps, evaluations at steps 3 and 5) with the
  sample settings as command-line overrides would set them: eval samples at both
  evaluations (the same problems), train samples every step of RL, the categories in the
  evaluation records, the summary and TensorBoard; experiments.eval's --show reprints the
  final evaluation's samples, greedy completion for completion."""
  config = tiny_run_config(tmp_path, {"metrics.eval_samples": 3, "metrics.train_samples": 2,
                                      "metrics.train_samples_every": 1,
                                      "checkpoint.max_to_keep": 5})
  summary = train_launcher.run(config)
  read = lambda name: [json.loads(line) for line in
                       (tmp_path / "samples" / name).read_text().splitlines()]
  assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [
      "eval_3.jsonl", "eval_5.jsonl", "train_4.jsonl", "train_5.jsonl"]
  evals = {step: read(f"eval_{step}.jsonl") for step in (3, 5)}
  assert [s["example"] for s in evals[3]] == [s["example"] for s in evals[5]] == [0, 5, 10]
  assert all(list(s)[1:] == list(samples.EVAL_FIELDS) for s in evals[5])
  train = read("train_4.jsonl")
  assert [s["step"] for s in train] == [4, 4] and list(train[0])[1:] == list(samples.TRAIN_FIELDS)
  assert all(s["category"] in verdicts.CATEGORIES for s in train + evals[3] + evals[5])

  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  final = [r for r in records if "eval_accuracy" in r][-1]
  counted = {c: final[f"eval_category_{c}"] for c in verdicts.CATEGORIES}
  assert sum(counted.values()) == config.task.eval_size
  assert counted[CORRECT] == round(final["eval_accuracy"] * config.task.eval_size)
  assert summary["categories"]["final"] == counted
  assert not any("samples" in r for r in records)  # records keep numbers only
  tags = {tag for _, tag, _ in texts(read_events(tmp_path))}
  assert {"samples/eval/text_summary", "samples/train/text_summary"} <= tags

  capsys.readouterr()
  [row] = eval_launcher.run(config, num_samples=2, ks=(1,), progress=False, show=2)
  assert row["greedy_categories"] == counted
  assert read("eval_5.jsonl") == [json.loads(line) for line in
                                  (tmp_path / "eval" / "samples_5.jsonl").read_text().splitlines()]
  shown = capsys.readouterr().out.splitlines()
  assert shown[0].startswith("step 5: greedy answers by category: ")
  assert shown[1].split()[:3] == ["example", "category", "reward"]
  assert [line.split()[0] for line in shown[3:5]] == ["0", "5"]
