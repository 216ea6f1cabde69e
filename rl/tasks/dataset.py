"""dataset: math problems from a local JSONL or Parquet file (GSM8K, MATH-500, your own).

Select it with `config.task.name = "dataset"` and name the file and its fields:
`config.task.path` (one row per problem), `config.task.prompt_field` (the question text) and
`config.task.answer_field` (the reference answer). The held-out rows come from
`config.task.eval_path` when it is set, else from `path` by the split rule below. docs/datasets.md
has the whole story; `DatasetSettings` declares the config fields.

Files. A file whose name ends in `.parquet` / `.pq` (or whose bytes start with Parquet's
`PAR1`) is read with pyarrow (else pandas), which Arbor does not depend on: without either
it is a ValueError saying `pip install pyarrow`. Any other file is JSON Lines: one JSON
object per line, blank lines skipped. A missing or empty file, a line that is not a JSON
object, and a row without the prompt or answer field (or with an empty one) are
ValueErrors naming the file, the line (JSONL; the row, counted from 1, for Parquet) and the
field, with the fields the row has.

Answers. The answer field may be a GSM8K worked solution ending in "#### 42", a solution
with a final `\\boxed{...}` (MATH), a bare number (`42`, also as a JSON number) or a bare
LaTeX answer (`\\frac{3}{4}`, `\\sqrt{2}`): the gold answer is the rest of the last '####'
line, else the last box's content, else the whole text (`rl.tasks.math_answer.
reference_answer`). A gold of more than `math_answer.MAX_ANSWER_CHARS` characters is refused
(no completion's answer can be that long). `Example.answer`, what a supervised warm start
imitates, is the solution with its '####' line replaced by `\\boxed{gold}` (as gsm_symbolic's),
a boxed solution as it is, or `\\boxed{gold}` for a bare answer.

Prompt. `config.task.template` with `{question}` (the prompt field's text) and
`{instruction}` (`config.task.instruction`; unset: gsm_symbolic's DEFAULT_INSTRUCTION, ""
for none) filled in, without leading or trailing spaces. The default template,
"{question} {instruction}", is gsm_symbolic's prompt. With `config.model.chat_template` the
prompt is one user turn of the checkpoint's template.

Scoring: exactly gsm_symbolic's (rl/tasks/gsm.py, docs/math.md). The completion is cut at an
end-of-sequence marker, `math_answer.extract_answer` takes its final answer (last box, else
last '####' line, else last number) and math-verify decides whether it equals the gold
(`math_answer.matches_reference`: a numeral gold exactly as gsm_symbolic compares it, a LaTeX
gold through math-verify's LaTeX parser), bounded by math_answer's 1 s alarm (a TimeoutError
the scoring worker counts in `reward_timeouts`). Reward 1 when correct, else 0; `exact_match`
is the same test.

Split rule. Rows are compared by their prompt field's text without whitespace (gsm_symbolic's
`question_key`). With `eval_path`: the held-out split is that file's first `eval_size` rows,
in file order, and no row of that file (all of it, not only the first `eval_size`) is
trained on. Without it: the held-out split is the `eval_size` distinct prompts of `path`
whose SHA-256 digest (of the prompt without whitespace, UTF-8) is smallest, each as its first
row, in digest order, so a smaller `eval_size` holds out a prefix of a larger one's rows and
the split depends neither on the file's order nor on `seed`. Either way a train row whose
prompt equals a held-out prompt is skipped. The train rows (the rest, in file order) are
visited in passes: train position p is row `order(p // M)[p % M]` of the M train rows,
where `order(e)` is the permutation that `random.Random(f"{seed}:{e}").shuffle` makes of
them, so each pass is a fresh, seeded shuffle and `examples(split, n, start)` is a pure
function of its arguments.

Only `prompt_style = "full"` (a pretrained checkpoint's tokenizer). The task pickles as its
settings; the scoring worker never reads the files (an example carries its gold answer).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.util
import json
import numbers
import os
import random
import re

from rl import verdicts
from rl.settings.dataset import DEFAULT_TEMPLATE, NAME
from rl.tasks import gsm
from rl.tasks import math_answer
from rl.tasks.base import TASKS, Example

PROMPT_STYLES = ("full",)
_PARQUET_SUFFIXES = (".parquet", ".pq")
_PLACEHOLDER = re.compile(r"\{(question|instruction)\}")
_CACHED_FILES = 8  # files kept read in this process (validate, then the run, build the task)


@dataclasses.dataclass(frozen=True)
class Row:
  """One problem of a file: the prompt field's text, the gold answer, the reference
  solution a warm start imitates, and where it is (the line, or the Parquet row from 1)."""
  question: str
  gold: str
  solution: str
  line: int


def _is_parquet(path: str) -> bool:
  if path.lower().endswith(_PARQUET_SUFFIXES):
    return True
  with open(path, "rb") as f:
    return f.read(4) == b"PAR1"


def _jsonl_records(path: str):
  """(line number, record) of each non-blank line of a JSON Lines file."""
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError as error:
        raise ValueError(f"{path}, line {number}: not UTF-8 text ({error.reason} at byte "
                         f"{error.start}).") from None
      if number == 1:
        text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
      if not text.strip():
        continue
      text = text.rstrip("\r\n")
      try:
        record = json.loads(text)
      except json.JSONDecodeError as error:
        hint = (" (a JSON array file? convert it to one object per line)"
                if number == 1 and text.lstrip().startswith("[") else "")
        raise ValueError(f"{path}, line {number}: not valid JSON ({error.msg} at column "
                         f"{error.colno}){hint}; each line must be one JSON object "
                         "(JSON Lines).") from None
      if not isinstance(record, dict):
        hint = (" (a JSON array file? convert it to one object per line)"
                if number == 1 and isinstance(record, list) else "")
        raise ValueError(f"{path}, line {number}: a JSON {type(record).__name__} where a JSON "
                         f"object (one row: field -> value) was expected{hint}.")
      yield number, record


def _parquet_records(path: str):
  """(row number from 1, record) of each row of a Parquet file, read by pyarrow or pandas."""
  if importlib.util.find_spec("pyarrow") is not None:
    import pyarrow.parquet  # pylint: disable=import-outside-toplevel
    try:
      records = pyarrow.parquet.read_table(path).to_pylist()
    except Exception as error:  # pylint: disable=broad-except  (pyarrow's own errors)
      raise ValueError(f"{path}: pyarrow cannot read it as Parquet ({error}).") from None
  elif importlib.util.find_spec("pandas") is not None:
    import pandas  # pylint: disable=import-outside-toplevel
    try:
      records = pandas.read_parquet(path).to_dict("records")
    except ImportError as error:  # pandas without a Parquet engine
      raise ValueError(f"{path} is a Parquet file and pandas cannot read it ({error}); "
                       "pip install pyarrow, or convert the file to JSON Lines (one JSON "
                       "object per line).") from None
  else:
    raise ValueError(f"{path} is a Parquet file; reading it needs pyarrow, which Arbor does "
                     "not install: pip install pyarrow (or convert the file to JSON Lines, "
                     "one JSON object per line, which Arbor reads itself).")
  return enumerate(records, start=1)


def _text(path: str, where: str, record: dict, field: str, setting: str,
          allow_numbers: bool) -> str:
  """The row's `field` as non-empty text (a number too, when `allow_numbers`), or a ValueError
  naming the file, the row, the field and the fields the row has."""
  if field not in record:
    raise ValueError(f"{path}, {where}: no field {field!r} (config.task.{setting}); the row "
                     f"has the fields {', '.join(map(repr, record)) or 'none'}.")
  value = record[field]
  if (allow_numbers and isinstance(value, numbers.Real) and not isinstance(value, bool)
      and value == value):  # NaN (a missing Parquet value) is no answer
    value = str(value)
  if not isinstance(value, str) or not value.strip():
    kind = "text or a number" if allow_numbers else "text"
    raise ValueError(f"{path}, {where}: field {field!r} (config.task.{setting}) is "
                     f"{value!r}; it must be non-empty {kind}.")
  return value


def _row(path: str, where: str, line: int, record: dict, prompt_field: str,
         answer_field: str) -> Row:
  question = _text(path, where, record, prompt_field, "prompt_field", allow_numbers=False)
  answer = _text(path, where, record, answer_field, "answer_field", allow_numbers=True)
  gold = math_answer.reference_answer(answer)
  if gold is None or len(gold) > math_answer.MAX_ANSWER_CHARS:
    raise ValueError(
        f"{path}, {where}: field {answer_field!r} (config.task.answer_field) gives a final "
        f"answer of {len(gold or '')} characters ({(gold or '')[:60]!r}...); a final answer is "
        f"the rest of its last '####' line, else its last \\boxed{{}}, else the whole text, "
        f"and must have 1 to {math_answer.MAX_ANSWER_CHARS} characters (completions' answers "
        "are bounded so). Name the answer field, or remove the row.")
  hashes = answer.rfind("####")
  if hashes >= 0 and answer[hashes + 4:].split("\n", 1)[0].strip():  # GSM8K: box the answer
    solution = math_answer.solution_with_box(answer, gold)
  elif gold != answer.strip():  # the gold is a box's content: the solution as it is
    solution = answer.strip()
  else:  # a bare answer
    solution = f"\\boxed{{{gold}}}"
  return Row(question=question, gold=gold, solution=solution, line=line)


def _read(path: str, prompt_field: str, answer_field: str, setting: str) -> tuple[Row, ...]:
  if not path:
    raise ValueError(f"config.task.{setting} is empty: name a JSON Lines (.jsonl) or Parquet "
                     "file of rows (config.task.prompt_field, config.task.answer_field).")
  if not os.path.exists(path):
    where = "" if os.path.isabs(path) else f" (a relative path, read from {os.getcwd()})"
    raise ValueError(f"config.task.{setting} = {path!r}: no such file{where}.")
  if os.path.isdir(path):
    raise ValueError(f"config.task.{setting} = {path!r} is a folder; name a JSON Lines or "
                     "Parquet file.")
  parquet = _is_parquet(path)
  records = _parquet_records(path) if parquet else _jsonl_records(path)
  rows = tuple(_row(path, f"row {number}" if parquet else f"line {number}", number, record,
                    prompt_field, answer_field) for number, record in records)
  if not rows:
    raise ValueError(f"config.task.{setting} = {path!r} holds no rows (the file is empty or "
                     "has only blank lines).")
  return rows


_cache: collections.OrderedDict = collections.OrderedDict()


def read_rows(path: str, prompt_field: str = "question", answer_field: str = "answer",
              setting: str = "path") -> tuple[Row, ...]:
  """The rows of a JSONL or Parquet file (cached while the file is unchanged); `setting`
  names the config field in messages. ValueError for anything unreadable (module docstring)."""
  try:
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, prompt_field, answer_field)
  except OSError:
    key = None
  if key is not None and key in _cache:
    _cache.move_to_end(key)
    return _cache[key]
  rows = _read(path, prompt_field, answer_field, setting)
  if key is not None:
    _cache[key] = rows
    while len(_cache) > _CACHED_FILES:
      _cache.popitem(last=False)
  return rows


def _key(question: str) -> str:
  return gsm.question_key({"question": question})


def _digest(question: str) -> bytes:
  return hashlib.sha256(_key(question).encode("utf-8")).digest()


@functools.lru_cache(maxsize=64)  # the worker asks reward, then exact_match, of each completion
def score(completion: str, gold: str) -> tuple[float, bool]:
  """(reward, correct) of a completion against the trusted reference `gold` (a numeral or
  LaTeX). TimeoutError when math-verify runs past rl.tasks.math_answer's bound (the scoring
  worker counts it)."""
  answer = math_answer.extract_answer(math_answer.until_eos(completion))
  correct = answer is not None and math_answer.matches_reference(answer, gold)
  return float(correct), correct


def _unpickle(arguments: dict) -> "DatasetTask":
  """The task from its settings, without reading the files (the scoring worker never needs
  them; they are read when examples are first asked for)."""
  task = DatasetTask.__new__(DatasetTask)
  task._configure(**arguments)  # pylint: disable=protected-access
  return task


class DatasetTask:
  """The dataset task: train and held-out rows of local files, scored like gsm_symbolic.

  The rl.tasks.base.Task interface (name, prompt_style, seed, eval_size, difficulty,
  examples, reward, exact_match, verdict). Build with `rl.tasks.make_task("dataset", "full",
  eval_size=..., path=..., eval_path=..., prompt_field=..., answer_field=...)` or
  config.task.name = "dataset" (rl.wiring.build_task).
  """

  name = NAME
  reward_timeout_s = 5.0  # math_answer's 1 s bound ends math-verify first; this is the backstop

  def __init__(self, prompt_style: str = "full", seed: int = 0, eval_size: int = 100, *,
               path: str = "", eval_path: str = "", prompt_field: str = "question",
               answer_field: str = "answer", instruction: str | None = None,
               template: str = DEFAULT_TEMPLATE, **difficulty):
    if prompt_style not in PROMPT_STYLES:
      raise ValueError(f"Task {NAME!r} needs prompt_style='full' (got {prompt_style!r}): a "
                       "file's questions need a pretrained checkpoint's tokenizer. Set "
                       "config.task.prompt_style='full' and config.model.checkpoint (e.g. "
                       "experiments/configs/qwen2_5_gsm8k.py).")
    if difficulty:
      raise ValueError(f"Task {NAME!r} has no difficulty fields (got {sorted(difficulty)}); "
                       "its settings are path, eval_path, prompt_field, answer_field, "
                       "instruction and template.")
    if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 1:
      raise ValueError(f"Task {NAME!r}: eval_size={eval_size!r} must be an integer >= 1.")
    for field, value in (("prompt_field", prompt_field), ("answer_field", answer_field)):
      if not isinstance(value, str) or not value:
        raise ValueError(f"config.task.{field} = {value!r} must name a field of the rows.")
    if instruction is not None and not isinstance(instruction, str):
      raise ValueError(f"config.task.instruction = {instruction!r} must be text (\"\" for "
                       "none; unset for rl/tasks/gsm.py's DEFAULT_INSTRUCTION).")
    if not isinstance(template, str) or "{question}" not in template:
      raise ValueError(f"config.task.template = {template!r} must be text holding "
                       "{question} (where the prompt field's text goes) and optionally "
                       "{instruction}, e.g. the default " f"{DEFAULT_TEMPLATE!r}.")
    if not isinstance(path, str) or not isinstance(eval_path, str):
      raise ValueError(f"config.task.path = {path!r} and eval_path = {eval_path!r} must be "
                       "text (file paths).")
    self._configure(prompt_style=prompt_style, seed=seed, eval_size=eval_size, path=path,
                    eval_path=eval_path, prompt_field=prompt_field, answer_field=answer_field,
                    instruction=instruction, template=template)
    self._splits()  # every file error surfaces now, before a run starts

  def _configure(self, *, prompt_style, seed, eval_size, path, eval_path, prompt_field,
                 answer_field, instruction, template) -> None:
    self.prompt_style = prompt_style
    self.seed = seed
    self.eval_size = eval_size
    self.difficulty = {}
    self.settings = dict(path=path, eval_path=eval_path, prompt_field=prompt_field,
                         answer_field=answer_field, instruction=instruction, template=template)
    self.instruction = gsm.DEFAULT_INSTRUCTION if instruction is None else instruction
    self._split = None
    self._orders: collections.OrderedDict = collections.OrderedDict()

  def _arguments(self) -> dict:
    return dict(prompt_style=self.prompt_style, seed=self.seed, eval_size=self.eval_size,
                **self.settings)

  def __reduce__(self):
    """Pickles as its settings (for rl.scoring's worker, which never reads the files)."""
    return (_unpickle, (self._arguments(),))

  def __repr__(self) -> str:
    settings = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
    return (f"DatasetTask(prompt_style={self.prompt_style!r}, seed={self.seed}, "
            f"eval_size={self.eval_size}, {settings})")

  def _splits(self) -> tuple[tuple[Row, ...], tuple[Row, ...]]:
    """(held-out rows, train rows) by the module docstring's split rule."""
    if self._split is not None:
      return self._split
    s = self.settings
    rows = read_rows(s["path"], s["prompt_field"], s["answer_field"], "path")
    if s["eval_path"]:
      held_file = read_rows(s["eval_path"], s["prompt_field"], s["answer_field"], "eval_path")
      if len(held_file) < self.eval_size:
        raise ValueError(f"config.task.eval_size = {self.eval_size}, but config.task.eval_path "
                         f"= {s['eval_path']!r} has {len(held_file)} rows: set "
                         f"config.task.eval_size <= {len(held_file)}.")
      held = held_file[:self.eval_size]
      held_keys = {_key(row.question) for row in held_file}
    else:
      first = {}  # each distinct prompt's first row
      for row in rows:
        first.setdefault(_key(row.question), row)
      if len(first) <= self.eval_size:
        raise ValueError(f"config.task.eval_size = {self.eval_size} rows held out of "
                         f"config.task.path = {s['path']!r}, which has {len(first)} distinct "
                         "prompts: none would be left to train on. Lower config.task.eval_size, "
                         "or name a held-out file in config.task.eval_path.")
      held = tuple(sorted(first.values(), key=lambda row: (_digest(row.question), row.line)))
      held = held[:self.eval_size]
      held_keys = {_key(row.question) for row in held}
    train = tuple(row for row in rows if _key(row.question) not in held_keys)
    if not train:
      raise ValueError(f"Every row of config.task.path = {s['path']!r} has the prompt of a "
                       "held-out row (prompts are compared without whitespace): nothing is "
                       "left to train on. Name another train file or held-out file.")
    self._split = held, train
    return self._split

  def _order(self, epoch: int) -> list[int]:
    """The seeded permutation of the train rows for pass `epoch` over them."""
    order = self._orders.get(epoch)
    if order is None:
      order = list(range(len(self._splits()[1])))
      random.Random(f"{self.seed}:{epoch}").shuffle(order)
      self._orders[epoch] = order
      while len(self._orders) > 2:  # the pass being read and the one before it
        try:
          self._orders.popitem(last=False)
        except KeyError:  # another thread emptied it first
          break
    return order

  def prompt(self, question: str) -> str:
    """The template with the question and the instruction filled in, spaces stripped."""
    values = {"question": question, "instruction": self.instruction}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.settings["template"]).strip(" ")

  def _example(self, row: Row, split: str) -> Example:
    return Example(prompt=self.prompt(row.question), answer=row.solution,
                   entry={"question": row.question, "answer": row.gold, "line": row.line,
                          "split": split})

  def examples(self, split: str, n: int, start: int = 0) -> list[Example]:
    """Examples at positions start, ..., start + n - 1 of 'train' (unbounded: passes over the
    train rows, each in a fresh seeded order) or 'eval' (`eval_size` rows, none of whose
    prompts is trained on). A pure function of its arguments (and the files)."""
    if n < 0 or start < 0:
      raise ValueError(f"Task {NAME!r}: n={n} and start={start} must be >= 0.")
    held, train = self._splits()
    if split == "eval":
      if start + n > self.eval_size:
        raise ValueError(f"Task {NAME!r}: eval positions {start}..{start + n - 1} exceed "
                         f"eval_size={self.eval_size}; pass a larger eval_size.")
      return [self._example(row, "eval") for row in held[start:start + n]]
    if split == "train":
      size = len(train)
      return [self._example(train[self._order(p // size)[p % size]], "train")
              for p in range(start, start + n)]
    raise ValueError(f"Task {NAME!r}: unknown split {split!r}; use 'train' or 'eval'.")

  def reward(self, completion: str, example: Example) -> float:
    """1 when the completion's final answer equals the row's gold answer, else 0."""
    return score(completion, example.entry["answer"])[0]

  def exact_match(self, completion: str, example: Example) -> bool:
    """True when the final answer equals the gold answer."""
    return score(completion, example.entry["answer"])[1]

  def verdict(self, completion: str, example: Example) -> verdicts.Verdict:
    """The final answer read and why it failed (`rl.tasks.math_answer.verdict`: malformed
    only against a numeric gold; any answer to a LaTeX gold is well-formed)."""
    gold = example.entry["answer"]
    return math_answer.verdict(completion, gold, score(completion, gold)[1])


TASKS.register(NAME, DatasetTask)
