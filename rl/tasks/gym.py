"""Procedural tasks from reasoning-gym, each with its own scorer.

A `ReasoningGymTask` turns a reasoning-gym dataset into prompts for the policy and scores completions
with the dataset's own `score_answer` (which gives partial credit, e.g. 0.5 for a sign
error in chain_sum), except countdown, whose `score_answer` evaluates the text with sympy
(it runs Python): countdown is scored by `rl.tasks.countdown`'s safe verifier, on the same scale.
Training and evaluation call the scorer through `rl.scoring`, in a worker process under a
time limit; a Task pickles as the arguments that rebuild it, for that worker.

Data position. `Task.examples(split, n, start)` is a pure function of
(split, n, start) for a given task configuration, so a training loop resumes from one
integer cursor. reasoning-gym items are index-addressable and cheap to regenerate
(`Random(seed + index)` per item), so nothing is materialised up front.

Split disjointness. The eval split is the first `eval_size` items of a dataset seeded at
`seed + 2**62`. Because reasoning-gym seeds each item with `seed + index`, two seeds alone
do not guarantee different questions (and small difficulty settings repeat questions by
chance), so the train split filters them out explicitly: train position `p` takes item
`p` of the dataset seeded at `seed + k * 2**40` for the smallest `k` whose question is not
in the eval set (questions are compared by a per-task key: the expression without spaces,
or the countdown numbers and target). If `_MAX_TRAIN_DRAWS` draws all collide, the
difficulty leaves too few questions for `eval_size`, and a ValueError says so.

Prompt styles. `compact` fits the character tokenizer (`models.tokenizer.CharTokenizer`):
chain_sum / basic_arithmetic become "4-1=" with answer "3"; countdown becomes
"67,50,20,82:119=" with answer "82+20+67-50". `full` uses reasoning-gym's question and
answer text verbatim, for subword tokenizers, and scores the reply's first line with the
dataset's scorer. `reasoned` (datasets with numeric answers, not countdown) suits a chat
model that reasons before it answers: the prompt is the question followed by
`REASONED_INSTRUCTION` (reason step by step, then box the answer), and the whole reply up to
an end-of-sequence marker is scored as rl.tasks.gsm scores it (`rl.tasks.math_answer`: last
box, else last '####' line, else last number, compared with the dataset's answer by
math-verify): reward 1 when equal, else 0. The reference for a warm start is the answer in a
box.

chain_sum, basic_arithmetic, leg_counting and countdown are registered here (`rl.tasks.TASKS`);
`register_task` adds another reasoning-gym dataset.
"""

import dataclasses
import functools
import re
from collections.abc import Callable, Hashable
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS as _RG_DATASETS

from rl import verdicts
from rl.tasks import countdown
from rl.tasks import gsm
from rl.tasks import math_answer
from rl.tasks.base import PROMPT_STYLES, TASKS, Example

_EVAL_SEED_OFFSET = 2**62
_TRAIN_SEED_STRIDE = 2**40  # train positions must stay below this (they do: ~1e12)
_MAX_TRAIN_DRAWS = 64
_VIRTUAL_SIZE = 2**31  # reasoning-gym needs a size; items are addressed by index anyway
# A completion is cut at the first of these: a newline, or an end-of-sequence marker left
# in text decoded by a subword tokenizer (SmolLM2 / Qwen / Llama families).
_STOP_STRINGS = ("\n", "<|endoftext|>", "<|im_end|>", "</s>")
REASONED = "reasoned"
REASONED_INSTRUCTION = gsm.DEFAULT_INSTRUCTION  # appended to each question in `reasoned` style
_NUMBER = re.compile(r"[+-]?[0-9]+(?:\.[0-9]+)?")  # a numeric answer, as the datasets write one


def _nospace(text: str) -> str:
  return text.replace(" ", "")


@dataclasses.dataclass(frozen=True)
class _TaskSpec:
  """How one reasoning-gym dataset becomes a Task."""

  key: Callable[[dict], Hashable]  # question identity, for split disjointness
  compact_prompt: Callable[[dict], str]
  compact_answer: Callable[[dict], str]
  default_eval_size: int
  # (parsed answer, entry) -> score; None: the dataset's own `score_answer`.
  reward: Callable[[str, dict], float] | None = None
  # (parsed answer, entry) -> why an answer that is not correct failed (rl.verdicts);
  # None: `default_category`.
  category: Callable[[str, dict], str] | None = None


def _expression_key(entry: dict) -> Hashable:
  return _nospace(entry["metadata"]["expression"])


def _countdown_key(entry: dict) -> Hashable:
  meta = entry["metadata"]
  return (tuple(sorted(meta["numbers"])), meta["target"])


def _countdown_prompt(entry: dict) -> str:
  meta = entry["metadata"]
  return ",".join(str(x) for x in meta["numbers"]) + f":{meta['target']}="


def _animals_key(entry: dict) -> Hashable:
  return tuple(sorted(entry["metadata"]["animals"].items()))


def _animals_prompt(entry: dict) -> str:
  return ",".join(f"{n}{animal}" for animal, n in entry["metadata"]["animals"].items()) + "="


# Module-level functions, not lambdas: a Task pickles with its spec (see Task.__reduce__).
def _expression_prompt(entry: dict) -> str:
  return _nospace(entry["metadata"]["expression"]) + "="


def reference_answer(entry: dict) -> str:
  """The dataset's own answer text (a `compact_answer` for `register_task`)."""
  return entry["answer"]


def _reference_answer_nospace(entry: dict) -> str:
  return _nospace(entry["answer"])


def default_category(answer: str, entry: dict) -> str:
  """The category of a parsed answer that is not correct, for a dataset that names none:
  no_answer when it is empty, else wrong_value."""
  del entry
  return verdicts.WRONG_VALUE if answer else verdicts.NO_ANSWER


def numeric_category(answer: str, entry: dict) -> str:
  """The category of a parsed answer that is not correct, for a dataset whose answers are
  numbers (a `category` for `register_task`): no_answer when it is empty, malformed when it
  is not a plain decimal number ('12a', 'x = 3', a sentence), else wrong_value (partial
  credit, such as chain_sum's for a sign error, included)."""
  del entry
  if not answer:
    return verdicts.NO_ANSWER
  return verdicts.WRONG_VALUE if _NUMBER.fullmatch(answer) else verdicts.MALFORMED


_BUILT_IN = {
  "chain_sum": _TaskSpec(
    key=_expression_key,
    compact_prompt=_expression_prompt,
    compact_answer=reference_answer,
    default_eval_size=1000,
    category=numeric_category,
  ),
  "basic_arithmetic": _TaskSpec(
    key=_expression_key,
    compact_prompt=_expression_prompt,
    compact_answer=reference_answer,
    default_eval_size=1000,
    category=numeric_category,
  ),
  # "3 chickens, 1 spider": count the legs (the policy must know each animal's number).
  "leg_counting": _TaskSpec(
    key=_animals_key,
    compact_prompt=_animals_prompt,
    compact_answer=reference_answer,
    default_eval_size=1000,
    category=numeric_category,
  ),
  # Countdown items cost ~10 ms each to generate (the generator searches for a
  # solvable target), hence the smaller default eval set. Scored by rl.tasks.countdown, never
  # by reasoning-gym's score_answer (sympy parse_expr executes the text).
  "countdown": _TaskSpec(
    key=_countdown_key,
    compact_prompt=_countdown_prompt,
    compact_answer=_reference_answer_nospace,
    default_eval_size=100,
    reward=countdown.reward,
    category=countdown.category,
  ),
}


def register_task(name: str, *, key: Callable[[dict], Hashable],
                  compact_prompt: Callable[[dict], str], compact_answer: Callable[[dict], str],
                  default_eval_size: int = 1000,
                  reward: Callable[[str, dict], float] | None = None,
                  category: Callable[[str, dict], str] | None = None) -> None:
  """Makes the reasoning-gym dataset `name` a task for `make_task` (and config.task.name).

  key(entry): the question's identity (train questions equal to an eval question are
  skipped); compact_prompt / compact_answer(entry): text for the character tokenizer
  (prompt_style "full" uses the dataset's question and answer); reward(answer, entry): a
  score in [0, 1] of the parsed answer (`parse_completion`), replacing the dataset's own
  `score_answer`; category(answer, entry): why a parsed answer that is not correct failed,
  one of rl.verdicts' no_answer, malformed, wrong_value (default: `default_category`;
  `numeric_category` suits numeric answers). The scoring worker (rl.scoring) rebuilds the
  task from a pickle, so these functions must be importable: define them at module level,
  not as lambdas. docs/add_task.md walks through an example.
  """
  if name not in _RG_DATASETS:
    raise ValueError(f"{name!r} is not a reasoning-gym dataset; known datasets: "
                     f"{', '.join(sorted(_RG_DATASETS))}.")
  spec = _TaskSpec(key=key, compact_prompt=compact_prompt, compact_answer=compact_answer,
                   default_eval_size=default_eval_size, reward=reward, category=category)
  TASKS.register(name, functools.partial(build, name, spec))


def parse_completion(completion: str) -> str:
  """Returns the answer part of a completion: the text before the first newline or
  end-of-sequence marker (after leading whitespace), stripped."""
  text = completion.lstrip()
  for stop in _STOP_STRINGS:
    text = text.split(stop, 1)[0]
  return text.strip()


class ReasoningGymTask:
  """One reasoning-gym dataset: deterministic train/eval examples and its scorer.

  Build with `rl.tasks.make_task`. Attributes: `name`, `prompt_style`, `difficulty` (the
  reasoning-gym config fields set), `seed`, `eval_size` (items in the eval split).
  """

  def __init__(self, name: str, prompt_style: str, seed: int, eval_size: int,
         difficulty: dict[str, Any], spec: _TaskSpec):
    self.name = name
    self.prompt_style = prompt_style
    self.seed = seed
    self.eval_size = eval_size
    self.difficulty = dict(difficulty)
    self._spec = spec
    self._datasets = {}
    self._eval_entries = None
    self._eval_keys = None
    # Build one dataset now so that a bad difficulty value fails at make_task.
    self._scorer = self._dataset(seed)

  def __reduce__(self):
    """Pickles as the arguments that rebuild the task, spec included, so a process where
    `register_task` never ran (the scoring worker) rebuilds a registered task too."""
    return (ReasoningGymTask, (self.name, self.prompt_style, self.seed, self.eval_size, self.difficulty,
                   self._spec))

  def __repr__(self) -> str:
    return (f"ReasoningGymTask({self.name!r}, prompt_style={self.prompt_style!r}, seed={self.seed}, "
        f"eval_size={self.eval_size}, difficulty={self.difficulty})")

  def _dataset(self, seed: int):
    dataset = self._datasets.get(seed)
    if dataset is None:
      try:
        dataset = reasoning_gym.create_dataset(
          self.name, size=_VIRTUAL_SIZE, seed=seed, **self.difficulty)
      except (AssertionError, ValueError) as error:  # reasoning-gym validates with asserts
        raise ValueError(
          f"Task {self.name!r}: invalid difficulty {self.difficulty}: {error}"
        ) from error
      self._datasets[seed] = dataset
    return dataset

  def _eval_set(self) -> tuple[list[dict], frozenset]:
    if self._eval_entries is None:
      dataset = self._dataset(self.seed + _EVAL_SEED_OFFSET)
      entries = [dataset[i] for i in range(self.eval_size)]
      self._eval_keys = frozenset(self._spec.key(e) for e in entries)
      self._eval_entries = entries
    return self._eval_entries, self._eval_keys

  def _train_entry(self, position: int) -> dict:
    _, eval_keys = self._eval_set()
    for draw in range(_MAX_TRAIN_DRAWS):
      entry = self._dataset(self.seed + draw * _TRAIN_SEED_STRIDE)[position]
      if self._spec.key(entry) not in eval_keys:
        return entry
    raise ValueError(
      f"Task {self.name!r}: train position {position} collided with the eval set "
      f"{_MAX_TRAIN_DRAWS} times; difficulty {self.difficulty} has too few distinct "
      f"questions for eval_size={self.eval_size}. Lower eval_size or raise the "
      f"difficulty.")

  def _example(self, entry: dict) -> Example:
    size = int(entry["metadata"].get("num_terms", 0))  # chain_sum / basic_arithmetic
    if self.prompt_style == "compact":
      return Example(prompt=self._spec.compact_prompt(entry),
              answer=self._spec.compact_answer(entry), entry=entry, size=size)
    if self.prompt_style == REASONED:
      return Example(prompt=f"{entry['question'].strip()} {REASONED_INSTRUCTION}",
                     answer=f"\\boxed{{{entry['answer']}}}", entry=entry, size=size)
    return Example(prompt=entry["question"], answer=entry["answer"], entry=entry, size=size)

  def examples(self, split: str, n: int, start: int = 0) -> list[Example]:
    """Returns examples at positions start, ..., start + n - 1 of `split`.

    Deterministic: the same (split, n, start) always gives the same examples, so a
    loop stores only an integer cursor. 'train' is unbounded; 'eval' holds
    `eval_size` examples, none of whose questions occur in 'train'.
    """
    if n < 0 or start < 0:
      raise ValueError(f"Task {self.name!r}: n={n} and start={start} must be >= 0.")
    if split == "eval":
      entries, _ = self._eval_set()
      if start + n > self.eval_size:
        raise ValueError(
          f"Task {self.name!r}: eval positions {start}..{start + n - 1} exceed "
          f"eval_size={self.eval_size}; pass a larger eval_size to make_task.")
      return [self._example(e) for e in entries[start:start + n]]
    if split == "train":
      return [self._example(self._train_entry(p)) for p in range(start, start + n)]
    raise ValueError(f"Task {self.name!r}: unknown split {split!r}; use 'train' or 'eval'.")

  def reward(self, completion: str, example: Example) -> float:
    """Scores `completion` with reasoning-gym's own `score_answer` (or the `reward` given
    to `register_task`; countdown: `rl.tasks.countdown.reward`), in [0, 1].

    The completion is first cut by `parse_completion`. Partial credit is the scorer's
    (chain_sum gives 0.5 for "-3" against "3"; countdown gives 0.01-0.05 for wrong
    expressions). A scorer that raises raises here: training and evaluation score through
    `rl.scoring`, which gives such a completion reward 0 and counts it (`reward_errors`),
    as it does for a non-finite value, a crash or a timeout.
    In `reasoned` style the whole completion is scored instead (module docstring): 1 when
    its final answer equals the dataset's, else 0.
    """
    if self.prompt_style == REASONED:
      return gsm.score(completion, example.entry["answer"])[0]
    score_answer = self._spec.reward or self._scorer.score_answer
    return float(score_answer(parse_completion(completion), example.entry))

  def exact_match(self, completion: str, example: Example) -> bool:
    """True when the scorer gives full credit (so equivalent answers such as "+03" for
    "3", or any correct countdown expression, count as exact)."""
    return self.reward(completion, example) >= 1.0

  def verdict(self, completion: str, example: Example) -> verdicts.Verdict:
    """The answer read (`parse_completion`'s first line) against the example's reference
    answer, and why it failed (the spec's `category`, else `default_category`). In
    `reasoned` style, the final answer of the whole reply (`rl.tasks.math_answer.verdict`)."""
    if self.prompt_style == REASONED:
      gold = example.entry["answer"]
      return math_answer.verdict(completion, gold, gsm.score(completion, gold)[1])
    answer = parse_completion(completion)
    category = (verdicts.CORRECT if self.exact_match(completion, example)
                else (self._spec.category or default_category)(answer, example.entry))
    return verdicts.Verdict(category, answer, example.answer)


def build(name: str, spec: _TaskSpec, prompt_style: str = "compact", seed: int = 0,
          eval_size: int | None = None, **difficulty) -> ReasoningGymTask:
  """The reasoning-gym task `name` as `spec` describes it (the builder `register_task`
  registers; `rl.tasks.make_task` calls it). `difficulty` kwargs go to the dataset's config;
  `eval_size` defaults to the spec's (1000; 100 for countdown, whose items are slow to
  make)."""
  if prompt_style not in PROMPT_STYLES:
    raise ValueError(
      f"Task {name!r}: unknown prompt_style {prompt_style!r}; use one of {PROMPT_STYLES}.")
  _, config_cls = _RG_DATASETS[name]
  fields = sorted(f.name for f in dataclasses.fields(config_cls)
          if f.name not in ("seed", "size"))
  unknown = sorted(set(difficulty) - set(fields))
  if unknown:
    raise ValueError(
      f"Task {name!r} has no difficulty field(s) {unknown}; valid fields: "
      f"{', '.join(fields)}.")
  if prompt_style == REASONED and spec.reward is not None:
    raise ValueError(
      f"Task {name!r}: prompt_style {REASONED!r} scores a numeric final answer, and {name!r} "
      "answers with something else (its own scorer); use prompt_style 'full' or 'compact'.")
  if eval_size is None:
    eval_size = spec.default_eval_size
  if eval_size < 1:
    raise ValueError(f"Task {name!r}: eval_size={eval_size} must be >= 1.")
  return ReasoningGymTask(name, prompt_style, seed, eval_size, difficulty, spec)


for _name, _spec in _BUILT_IN.items():
  TASKS.register(_name, functools.partial(build, _name, _spec))
