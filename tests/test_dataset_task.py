"""The dataset task (rl/tasks/dataset.py): local JSONL / Parquet files read with errors that
name the file, the line and the field; the split rule (disjoint, deterministic, resumable);
scoring of GSM8K-style, bare-number and LaTeX answers through the scoring worker; its config
fields (refused for another task); a run through the launcher; the Qwen2.5 GSM8K recipe
(experiments/configs/qwen2_5_gsm8k.py) validated on tiny files; docs/datasets.md's example."""

import importlib.util
import json
import os
import pathlib
import pickle
import re
import runpy
import time

import ml_collections
import pytest

from experiments import config_flag
from experiments import train as launcher
from experiments.configs import default
from experiments.configs import qwen2_5_gsm8k
from rl import scoring
from rl import tasks
from rl import wiring
from rl.settings import dataset as dataset_settings
from rl.tasks import dataset
from rl.tasks import gsm
from rl.tasks import math_answer
from tests import scoring_tasks
from tests.launcher_config import default_run_config, refusal

_REPO = pathlib.Path(__file__).resolve().parent.parent
_DOCS = _REPO / "docs"
_HAS_PARQUET = importlib.util.find_spec("pyarrow") is not None


def _jsonl(path, rows) -> str:
  """Writes `rows` (dicts, or raw strings written as they are) one per line; the path."""
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def _gsm_rows(n: int, offset: int = 0) -> list[dict]:
  """GSM8K-format rows: a question, and a worked solution ending in '#### answer'."""
  return [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples now?",
           "answer": f"He has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n"
                     f"#### {2 * i + 3}"} for i in range(offset, offset + n)]


def _task(path, **settings) -> dataset.DatasetTask:
  settings.setdefault("eval_size", 2)
  eval_size = settings.pop("eval_size")
  return tasks.make_task("dataset", "full", eval_size=eval_size, path=str(path), **settings)


# --- Reading files ---------------------------------------------------------------------------

MIXED_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},                          # GSM8K
    {"question": "What is 6 times 7?", "answer": 42},                  # a bare number (JSON)
    {"question": "What is 3 divided by 4?", "answer": "\\frac{3}{4}"},  # LaTeX (MATH-500)
    {"question": "What is the square root of 2?",
     "answer": "Since $x^2 = 2$, $x = \\boxed{\\sqrt{2}}$."},           # a boxed solution
    {"question": "Name the point.", "answer": "(3, \\frac{\\pi}{2})"},
]


def test_rows_give_prompts_gold_answers_and_reference_solutions(tmp_path):
  path = _jsonl(tmp_path / "mixed.jsonl", MIXED_ROWS[:2] + [""] + MIXED_ROWS[2:])  # a blank line
  task = _task(path, eval_size=1, instruction="Box it.", template="Q: {question}\n{instruction}")
  by_question = {e.entry["question"]: e for e in task.examples("eval", 1) +
                 task.examples("train", 4)}
  assert len(by_question) == 5
  golds = {q: e.entry["answer"] for q, e in by_question.items()}
  assert [golds[r["question"]] for r in MIXED_ROWS] == [
      "7", "42", "\\frac{3}{4}", "\\sqrt{2}", "(3, \\frac{\\pi}{2})"]
  assert [by_question[r["question"]].entry["line"] for r in MIXED_ROWS] == [1, 2, 4, 5, 6]
  example = by_question[MIXED_ROWS[0]["question"]]
  assert example.prompt == f"Q: {MIXED_ROWS[0]['question']}\nBox it."
  # What a warm start imitates: GSM8K's '####' line boxed, a boxed solution as it is, a
  # bare answer boxed.
  assert example.answer == "3 + 4 = <<3+4=7>>7\n\\boxed{7}"
  assert by_question["What is 6 times 7?"].answer == "\\boxed{42}"
  assert by_question["What is the square root of 2?"].answer == MIXED_ROWS[3]["answer"]
  for e in by_question.values():
    assert task.reward(e.answer, e) == 1.0, e
  # The default prompt is gsm_symbolic's: the question, a space, DEFAULT_INSTRUCTION.
  plain = _task(path, eval_size=1).examples("train", 1)[0]
  assert plain.prompt == f"{plain.entry['question']} {gsm.DEFAULT_INSTRUCTION}"
  assert _task(path, eval_size=1, instruction="").examples("train", 1)[0].prompt == (
      plain.entry["question"])


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("", "holds no rows"),
    ("\n  \n", "holds no rows"),
    ('{"question": "a", "answer": "1"}\n{"question": "b", "answer": 2\n',
     r", line 2: not valid JSON \(Expecting ',' delimiter at column 30\); each line must be "
     "one JSON object"),
    ('[\n{"question": "a", "answer": "1"}\n]\n',
     r", line 1: not valid JSON .*\(a JSON array file\? convert it to one object per line\)"),
    ('{"question": "a", "answer": "1"}\n["a", 1]\n',
     r", line 2: a JSON list where a JSON object \(one row"),
    ('{"question": "a", "answer": "1"}\n\n{"problem": "b", "answer": "2", "level": 3}\n',
     r", line 3: no field 'question' \(config.task.prompt_field\); the row has the fields "
     r"'problem', 'answer', 'level'"),
    ('{"question": "a", "solution": "1"}\n',
     r", line 1: no field 'answer' \(config.task.answer_field\); the row has the fields "
     r"'question', 'solution'"),
    ('{"question": "a", "answer": "1"}\n{"question": " ", "answer": "1"}\n',
     r", line 2: field 'question' \(config.task.prompt_field\) is ' '; it must be non-empty"),
    ('{"question": "a", "answer": true}\n',
     r", line 1: field 'answer' \(config.task.answer_field\) is True; it must be non-empty "
     "text or a number"),
    ('{"question": "a", "answer": "' + "no box and no hashes, " * 6 + '"}\n',
     r", line 1: field 'answer' \(config.task.answer_field\) gives a final answer of 131 "
     r"characters"),
    (b'{"question": "a", "answer": "1"}\n{"question": "\xff", "answer": "1"}\n',
     ", line 2: not UTF-8 text"),
])
def test_unreadable_files_name_the_file_the_line_and_the_field(tmp_path, content, message):
  path = tmp_path / "rows.jsonl"
  if isinstance(content, bytes):
    path.write_bytes(content)
  elif content is not None:
    path.write_text(content)
  with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + message):
    _task(path, eval_size=1)


def test_parquet_without_pyarrow_or_pandas_says_what_to_install(tmp_path, monkeypatch):
  path = tmp_path / "train.parquet"
  path.write_bytes(b"PAR1" + b"\0" * 8 + b"PAR1")  # never parsed: no library to parse it
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in ("pyarrow", "pandas") else real(name, *a))
  with pytest.raises(ValueError, match=re.escape(f"{path} is a Parquet file; reading it needs "
                                                 "pyarrow") + ".*pip install pyarrow"):
    _task(path)
  renamed = tmp_path / "train.data"  # Parquet's magic bytes count, whatever the name
  path.rename(renamed)
  with pytest.raises(ValueError, match="is a Parquet file.*pip install pyarrow"):
    _task(renamed)


@pytest.mark.skipif(not _HAS_PARQUET, reason="pyarrow is not installed (JSONL only here)")
def test_parquet_rows_read_as_jsonl_rows_do(tmp_path):
  import pyarrow  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet  # pylint: disable=import-outside-toplevel
  rows = _gsm_rows(6)
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "train.parquet")
  jsonl = _jsonl(tmp_path / "train.jsonl", rows)
  from_parquet = _task(tmp_path / "train.parquet")
  assert from_parquet.examples("train", 9) == _task(jsonl).examples("train", 9)
  assert from_parquet.examples("eval", 2) == _task(jsonl).examples("eval", 2)
  broken = [dict(r) for r in rows]
  del broken[3]["answer"]
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist(broken), tmp_path / "broken.parquet")
  with pytest.raises(ValueError, match=r"broken.parquet, row 4: .*'answer'"):
    _task(tmp_path / "broken.parquet")


def test_bad_settings_are_refused_with_the_fix(tmp_path):
  path = _jsonl(tmp_path / "train.jsonl", _gsm_rows(4))
  with pytest.raises(ValueError, match="needs prompt_style='full'.*config.model.checkpoint"):
    tasks.make_task("dataset", "compact", eval_size=1, path=path)
  with pytest.raises(ValueError, match=r"no difficulty fields \(got \['digits'\]\)"):
    _task(path, digits=7)
  with pytest.raises(ValueError, match=r"template = 'Answer: \{instruction\}' must be text "
                                       r"holding \{question\}"):
    _task(path, template="Answer: {instruction}")
  with pytest.raises(ValueError, match=r"config.task.path is empty"):
    tasks.make_task("dataset", "full", eval_size=1)
  with pytest.raises(ValueError, match=r"eval_size = 4 rows held out of config.task.path = "
                                       r".* which has 4 distinct prompts: none would be left"):
    _task(path, eval_size=4)
  held = _jsonl(tmp_path / "test.jsonl", _gsm_rows(2, offset=100))
  with pytest.raises(ValueError, match=r"eval_size = 3, but config.task.eval_path = .* has 2 "
                                       r"rows: set config.task.eval_size <= 2"):
    _task(path, eval_path=held, eval_size=3)
  same = _jsonl(tmp_path / "same.jsonl", _gsm_rows(4))
  with pytest.raises(ValueError, match="Every row of config.task.path .* has the prompt of a "
                                       "held-out row"):
    _task(path, eval_path=same)
  # The held-out file is named in its errors too.
  broken = tmp_path / "broken.jsonl"
  broken.write_text('{"question": "a", "answer": "1"}\n{"question": "b"}\n')
  with pytest.raises(ValueError, match=re.escape(f"{broken}, line 2: no field 'answer'")):
    _task(path, eval_path=str(broken))
  with pytest.raises(ValueError, match=re.escape(f"config.task.eval_path = "
                                                 f"'{tmp_path / 'nowhere.jsonl'}': no such")):
    _task(path, eval_path=str(tmp_path / "nowhere.jsonl"))


# --- The split rule ----------------------------------------------------------------------------

def test_held_out_rows_are_disjoint_deterministic_and_resumable(tmp_path):
  rows = _gsm_rows(30)
  path = _jsonl(tmp_path / "train.jsonl", rows)
  task = _task(path, eval_size=6)
  held = task.examples("eval", 6)
  held_keys = {gsm.question_key(e.entry) for e in held}
  assert len(held_keys) == 6
  train = task.examples("train", 24 * 3)  # three passes over the 24 train rows
  assert not held_keys & {gsm.question_key(e.entry) for e in train}
  passes = [[e.entry["line"] for e in train[i:i + 24]] for i in (0, 24, 48)]
  assert all(sorted(p) == sorted(passes[0]) for p in passes)  # each pass: every train row once
  assert len({tuple(p) for p in passes}) == 3  # each in its own seeded order
  # A pure function of (split, n, start): slices agree, a fresh task agrees, so does a
  # pickled one, and resuming at any cursor gives the same stream.
  assert task.examples("train", 30, 17) == train[17:47]
  assert _task(path, eval_size=6).examples("train", 72) == train
  assert pickle.loads(pickle.dumps(task)).examples("train", 5, 40) == train[40:45]
  assert task.examples("eval", 2, 3) == held[3:5]
  with pytest.raises(ValueError, match="exceed eval_size=6"):
    task.examples("eval", 2, 5)
  # The held-out rows are those whose prompt hashes lowest: not the file's order or the
  # seed's business, and a smaller eval_size holds out a prefix of them.
  questions = [e.entry["question"] for e in held]
  shuffled = _jsonl(tmp_path / "shuffled.jsonl", rows[::-1])
  assert [e.entry["question"] for e in _task(shuffled, eval_size=6).examples("eval", 6)] == (
      questions)
  other_seed = tasks.make_task("dataset", "full", seed=1, eval_size=6, path=path)
  assert other_seed.examples("eval", 6) == held
  assert other_seed.examples("train", 24) != train[:24]
  assert _task(path, eval_size=3).examples("eval", 3) == held[:3]


def test_a_train_row_with_a_held_out_prompt_is_skipped(tmp_path):
  rows = _gsm_rows(10)
  held_out = _task(_jsonl(tmp_path / "a.jsonl", rows), eval_size=3).examples("eval", 3)
  # The same question again, spaced differently: compared without whitespace, so held out.
  copy = {"question": "  " + held_out[0].entry["question"].replace(" ", "  "), "answer": "1"}
  task = _task(_jsonl(tmp_path / "b.jsonl", rows + [copy]), eval_size=3)
  assert task.examples("eval", 3) == held_out
  train_lines = {e.entry["line"] for e in task.examples("train", 20)}
  assert train_lines == set(range(1, 11)) - {e.entry["line"] for e in held_out}


def test_a_held_out_file_is_held_out_whole(tmp_path):
  train_rows = _gsm_rows(6)
  test_rows = _gsm_rows(3, offset=100) + [train_rows[4]]  # a test question in train too
  task = _task(_jsonl(tmp_path / "train.jsonl", train_rows),
               eval_path=_jsonl(tmp_path / "test.jsonl", test_rows), eval_size=2)
  assert [e.entry["line"] for e in task.examples("eval", 2)] == [1, 2]  # file order
  assert [e.entry["question"] for e in task.examples("eval", 2)] == [
      r["question"] for r in test_rows[:2]]
  # Every row of the held-out file is kept out of train, beyond the first eval_size.
  assert {e.entry["line"] for e in task.examples("train", 10)} == {1, 2, 3, 4, 6}


# --- Scoring -----------------------------------------------------------------------------------

def test_gsm8k_bare_number_and_latex_answers_score_through_the_worker(tmp_path):
  path = _jsonl(tmp_path / "mixed.jsonl", MIXED_ROWS + [
      {"question": "How many dollars?", "answer": "Total: 1,234 dollars.\n#### 1,234"}])
  task = _task(path, eval_size=1)
  by_gold = {e.entry["answer"]: e for e in task.examples("train", 5) + task.examples("eval", 1)}
  cases = [  # (gold, completion, correct)
      ("7", "3 + 4 = 7 apples.\n\\boxed{7}", True),
      ("7", "So the answer is 7.", True),
      ("7", "... #### 7", True),
      ("7", "\\boxed{8}", False),
      ("7", "\\boxed{7}<|im_end|>then \\boxed{8}", True),   # text after EOS is ignored
      ("42", "6 * 7 = \\boxed{42.0}", True),
      ("42", "\\boxed{41}", False),
      ("\\frac{3}{4}", "\\boxed{0.75}", True),
      ("\\frac{3}{4}", "It is 3/4", True),
      ("\\frac{3}{4}", "\\boxed{\\frac{4}{3}}", False),
      ("\\sqrt{2}", "\\boxed{\\sqrt{2}}", True),
      ("\\sqrt{2}", "\\boxed{2^{1/2}}", True),
      ("\\sqrt{2}", "\\boxed{1.414}", False),
      ("\\sqrt{2}", "the answer is 2", False),
      ("(3, \\frac{\\pi}{2})", "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", True),
      ("(3, \\frac{\\pi}{2})", "\\boxed{(3, \\pi)}", False),
      ("1,234", "\\boxed{1234}", True),
      ("1,234", "\\boxed{\\$1,234}", True),
      ("1,234", "\\boxed{1243}", False),
      ("7", "no answer at all", False),
  ]
  examples = [by_gold[gold] for gold, _, _ in cases]
  scores = scoring.score(task, [c for _, c, _ in cases], examples)
  assert scores.timeouts == scores.errors == 0
  assert scores.exact.tolist() == [correct for _, _, correct in cases]
  assert scores.rewards.tolist() == [float(correct) for _, _, correct in cases]


def test_the_worker_scores_without_the_files(tmp_path):
  path = tmp_path / "train.jsonl"
  task = _task(_jsonl(path, _gsm_rows(4)))
  example = task.examples("eval", 1)[0]
  blob = pickle.dumps(task)
  path.unlink()  # an example carries its gold answer: the unpickled task never reads a file
  rebuilt = pickle.loads(blob)
  assert rebuilt.reward(example.answer, example) == 1.0
  assert rebuilt.exact_match("\\boxed{-1}", example) is False
  assert scoring.score(task, [example.answer], [example]).rewards.tolist() == [1.0]


def test_hostile_completions_against_a_latex_answer_are_bounded(tmp_path, monkeypatch):
  # The numeric path is gsm_symbolic's (tests/test_math_task.py); a LaTeX gold goes through
  # math-verify's parser and comparison, under the same 1 s bound.
  monkeypatch.chdir(tmp_path)
  task = _task(_jsonl(tmp_path / "math.jsonl", MIXED_ROWS), eval_size=1)
  example = next(e for e in task.examples("train", 4) if e.entry["answer"] == "\\sqrt{2}")
  completions = scoring_tasks.MATH_HOSTILE + [example.answer]
  start = time.perf_counter()
  scores = scoring.score(task, completions, [example] * len(completions))
  elapsed = time.perf_counter() - start
  assert scores.rewards.tolist() == [0.0] * len(scoring_tasks.MATH_HOSTILE) + [1.0]
  assert not (tmp_path / "PWNED").exists()
  # The unfinishable ones are ended by the 1 s bound and counted; none hangs the worker.
  assert scores.errors == 0 and scores.timeouts == scoring_tasks.MATH_UNFINISHABLE
  assert elapsed < len(completions) * (task.reward_timeout_s + 2), elapsed


def test_reference_answers_are_read_as_gsm8k_box_or_text():
  assert math_answer.reference_answer("work\n#### 1,234 \nmore") == "1,234"
  assert math_answer.reference_answer("#### 3\n#### \\frac{1}{2}") == "\\frac{1}{2}"
  assert math_answer.reference_answer("\\boxed{1} then \\boxed{\\frac{a}{b}}.") == "\\frac{a}{b}"
  long_box = "\\boxed{" + "x+" * 80 + "1}"  # a trusted reference's box has no length bound
  assert math_answer.reference_answer(long_box) == "x+" * 80 + "1"
  assert math_answer.reference_answer("  42 ") == "42"
  assert math_answer.reference_answer("#### \n 5") == "#### \n 5"  # no answer on the line
  assert math_answer.reference_answer(" ") is None


# --- Config fields -----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("path", "data/train.jsonl"), ("eval_path", "data/test.jsonl"), ("prompt_field", "problem"),
    ("answer_field", "solution"), ("instruction", "Box it."), ("template", "{question}"),
])
def test_dataset_fields_are_refused_for_another_task(field, value):
  c = default.get_config()
  c.task[field] = value
  with pytest.raises(ValueError, match=re.escape(
      f"config.task.{field} = {value!r} is a setting of the dataset task; config.task.name = "
      "'running_sum' never reads it")):
    wiring.validate(c)


def test_the_default_config_switched_to_the_dataset_names_the_fix(tmp_path):
  c = default.get_config()
  defaults = dataset_settings.DatasetSettings.defaults()  # held at their defaults
  assert {field: c.task[field] for field in defaults} == defaults
  c.task.name = "dataset"
  c.task.path = _jsonl(tmp_path / "train.jsonl", _gsm_rows(600))
  with pytest.raises(ValueError, match=r"config.task.difficulty = .*'digits': 7.* holds another "
                                       r"task's settings.*Pass --config.task.difficulty=\{\}"):
    wiring.validate(c)
  c.task.difficulty = ml_collections.ConfigDict()  # what --config.task.difficulty={} does
  with pytest.raises(ValueError, match="needs prompt_style='full'"):
    wiring.validate(c)
  c.task.prompt_style = "full"
  wiring.validate(c)
  assert wiring.build_task(wiring.settings(c)).examples("eval", 500)[0].entry["answer"].isdigit()


@pytest.mark.parametrize("overrides,message", [
    # Switching task.name drops the default config's running_sum fields, but one set on the
    # command line is still refused.
    ({"task.difficulty.max_steps": 3},
     "holds another task's settings (the default config's are running_sum's); the dataset "
     "task has none"),
    ({"task.difficulty": {}, "task.prompt_field": "problem"},
     ", line 1: no field 'problem' (config.task.prompt_field); the row has the fields "
     "'question', 'answer'"),
])
def test_the_launcher_reads_the_dataset_flags_and_refuses_before_any_work(tmp_path, overrides,
                                                                          message):
  path = _jsonl(tmp_path / "train.jsonl", _gsm_rows(3))
  given = {"task.name": "dataset", "task.path": str(path), "task.prompt_style": "full",
           **overrides}
  # What the command line gives: the config file's task fields resolved for the new task.
  config = config_flag.task_defaults(default_run_config(tmp_path / "run", given),
                                     list(given), file_task="running_sum")
  assert message in refusal(config)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
  """A tiny random Qwen2 model with a byte-level BPE tokenizer, as Hugging Face saves it."""
  from tests.hf_reference import save_tiny_hf_model  # pylint: disable=import-outside-toplevel
  # Qwen prepends no BOS.
  return save_tiny_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", add_bos=False,
                            max_position_embeddings=512)


def test_a_dataset_run_from_the_default_config_needs_no_other_tasks_settings(tmp_path):
  """`--config.task.name=dataset` on the default config: the running_sum difficulty fields
  and prompt style it holds are the task's own defaults again (no --config.task.difficulty={}
  or --config.task.prompt_style=full), which the settings accept; a run with those values
  trains (test_a_local_jsonl_dataset_trains_through_the_launcher)."""
  given = {"task.name": "dataset", "task.path": _jsonl(tmp_path / "train.jsonl", _gsm_rows(8)),
           "task.eval_path": _jsonl(tmp_path / "test.jsonl", _gsm_rows(4, offset=50)),
           "task.eval_size": 4}
  # What the command line gives: the config file's task fields resolved for the new task.
  config = config_flag.task_defaults(default_run_config(tmp_path / "run", given), list(given),
                                     file_task="running_sum")
  assert dict(config.task.difficulty) == {} and config.task.prompt_style == "full"
  wiring.validate(config)


def test_the_qwen_recipe_validates_and_reads_gsm8k_files(tmp_path, qwen2_folder):
  c = qwen2_5_gsm8k.get_config()
  assert (c.task.name, c.model.checkpoint, c.rollout.group_size) == (
      "dataset", "checkpoints/Qwen2.5-0.5B", 8)
  train = _jsonl(tmp_path / "train.jsonl", _gsm_rows(12))
  test = _jsonl(tmp_path / "test.jsonl", _gsm_rows(4, offset=50))
  # The recipe as written, but for the model, the files and the held-out count: validating
  # builds no model, so its real sizes are checked as they are.
  c.model.checkpoint = str(qwen2_folder)
  c.task.path, c.task.eval_path, c.task.eval_size = train, test, 4
  c.workdir = str(tmp_path / "run")
  run = wiring.validate(c)
  task = wiring.build_task(run)
  held = task.examples("eval", 4)
  assert [e.entry["answer"] for e in held] == [str(2 * i + 3) for i in range(50, 54)]
  example = task.examples("train", 1)[0]
  question = example.entry["question"]
  assert example.prompt == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
      f"{question}\nPlease reason step by step, and put your final answer within "
      "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
  assert task.reward(f"... so he has \\boxed{{{example.entry['answer']}}}", example) == 1.0
  tokenizer, model_config, _ = wiring.load_policy(run, None)
  assert model_config.qkv_bias and not tokenizer.chat  # Qwen2, the template in the prompt
  # The tiny tokenizer spells the ChatML markers out in bytes, and still fits prompt_len.
  assert len(tokenizer.encode(example.prompt, add_bos=True)) <= c.rollout.prompt_len


def test_a_local_jsonl_dataset_trains_through_the_launcher(tmp_path, qwen2_folder):
  # Every train answer is 7; a short supervised warm start teaches the policy to write
  # "\boxed{7}" whatever the question. Of the two held-out rows (worded like the train rows),
  # one's answer is 7 and the other's is 45, which that policy never writes: held-out accuracy
  # 1/2 shows both rows were scored, each against its own answer from the file.
  train = [{"question": f"Question {i}: what is {i} + {7 - i}?", "answer": "#### 7"}
           for i in range(8)]
  held = [{"question": "Question 3: what is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
          {"question": "Question 9: what is 9 * 5?", "answer": "#### 45"}]
  warm_start_steps = 120
  c = default_run_config(tmp_path / "run", {
      "task.name": "dataset", "task.prompt_style": "full",
      "task.difficulty": ml_collections.ConfigDict(),
      "task.path": _jsonl(tmp_path / "train.jsonl", train),
      "task.eval_path": _jsonl(tmp_path / "test.jsonl", held), "task.eval_size": 2,
      "task.instruction": "", "model.checkpoint": str(qwen2_folder), "rollout.prompt_len": 24,
      "rollout.max_new_tokens": 12, "rollout.train_length_buckets": (),
      "rollout.prompts_per_step": 2, "rollout.group_size": 2,
      "warm_start.steps": warm_start_steps, "warm_start.batch_size": 4,
      "warm_start.learning_rate": 1e-2, "warm_start.warmup_steps": 0, "rl.steps": 1,
      "rl.learning_rate": 1e-6, "rl.warmup_steps": 0, "eval.batch_size": 2, "eval.every": 1,
      "checkpoint.every": 100})
  summary = launcher.run(c)
  assert summary["steps"] == warm_start_steps + 1
  assert launcher.report(c, summary)[0] == "Warm-start held-out accuracy: 0.500 +- 0.354"
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  evals = [r for r in records if "eval_accuracy" in r]
  assert [r["step"] for r in evals] == [warm_start_steps, warm_start_steps + 1]
  samples = [json.loads(line) for line in open(tmp_path / "run" / "samples" / "eval_121.jsonl")]
  assert all(r["eval_accuracy"] == 0.5 for r in evals), [
      (r["completion"], r["category"]) for r in samples]
  (step,) = [r for r in records if "reward_mean" in r]
  assert step["reward_mean"] > 0.5 and step["reward_timeouts"] == step["reward_errors"] == 0
  config = json.load(open(tmp_path / "run" / "config.json"))
  assert config["task"]["path"] == c.task.path and config["task"]["eval_path"] == c.task.eval_path


# --- Docs ---------------------------------------------------------------------------------------

def test_the_datasets_page_example_runs(tmp_path, monkeypatch):
  blocks = re.findall(r"```python\n(.*?)```", (_DOCS / "datasets.md").read_text(), re.S)
  assert [b.splitlines()[0] for b in blocks] == ["# check_dataset.py"]
  monkeypatch.chdir(tmp_path)
  (tmp_path / "check_dataset.py").write_text(blocks[0])
  runpy.run_path(str(tmp_path / "check_dataset.py"))  # its asserts are the check
