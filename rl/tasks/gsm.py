"""gsm_symbolic: GSM8K-style word problems, answered after a chain of thought.

Items come from reasoning-gym's `gsm_symbolic` generators (templated GSM8K problems with
fresh names and numbers; integer answers), generated offline. The prompt is the question
followed by `Options.instruction` (by default: reason step by step, then give the answer, a
number, inside `\\boxed{}`); `Example.answer` is the generator's worked solution ending in
`\\boxed{answer}` (for a warm start). The whole completion is scored, up to an
end-of-sequence marker: `rl.tasks.math_answer` extracts the final answer (last box, else last
'####' line, else last number) and math-verify decides whether it equals the reference.

Reward: 1 for a correct answer, else 0. With `format_reward = w > 0` it is
`(1 - w) * correct + w * formatted`, where `formatted` means the answer is a number given in
a box or on a '####' line (not only as the last number of the text; not a box holding
anything but a plain numeral, such as a copied '\\boxed{answer}'): a correct boxed answer
scores 1, a correct bare number 1 - w, a wrong boxed answer w. `exact_match` is correctness
alone. Scoring runs in rl.scoring's worker with `reward_timeout_s` per completion. A hostile
box can keep math-verify busy forever: rl.tasks.math_answer ends it after a second with a
TimeoutError, which the worker counts in `reward_timeouts` (reward 0).

Items are index-addressable: item i of a stream seeded s is drawn by `Random(s + i)`, which
picks a generator and then its numbers. As in rl.tasks, the eval split is the first
`eval_size` items of the stream seeded `seed + 2**62`, and train position p takes item p of
the first stream `seed + k * 2**40` (k = 0, 1, ...) whose question is not an eval question
(questions are compared by their text without spaces), so the splits are disjoint.

Only `prompt_style = "full"`: the questions need a subword tokenizer (a pretrained
checkpoint), not the character tokenizer of the from-scratch policy.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re

import reasoning_gym
from reasoning_gym.arithmetic.gsm_symbolic import gsm_symbolic as _rg_gsm

from rl import verdicts
from rl.tasks import math_answer
from rl.tasks.base import TASKS, Example

NAME = "gsm_symbolic"
PROMPT_STYLES = ("full",)
DEFAULT_EVAL_SIZE = 200
# The box is shown empty: SmolLM2-135M copies a filled-in example ("\\boxed{answer}") verbatim.
DEFAULT_INSTRUCTION = ("Solve the problem step by step. At the end, write the final answer "
                       "(a number without units) inside \\boxed{}.")

_EVAL_SEED_OFFSET = 2**62
_TRAIN_SEED_STRIDE = 2**40
_MAX_TRAIN_DRAWS = 64


@dataclasses.dataclass(frozen=True)
class Options:
  """The task's settings (config.task.difficulty fields for gsm_symbolic).

  difficulty: reasoning-gym's GSMSymbolicDatasetConfig.difficulty (only 1.0 exists).
  instruction: appended to each question; asks for reasoning and the answer format.
  format_reward: weight w in [0, 1) of the format term (0 = off); see the module docstring.
  """
  difficulty: float = 1.0
  instruction: str = DEFAULT_INSTRUCTION
  format_reward: float = 0.0


def check_options(options: dict) -> Options:
  """Options from a dict, or a ValueError naming the bad field and the fix."""
  fields = sorted(f.name for f in dataclasses.fields(Options))
  unknown = sorted(set(options) - set(fields))
  if unknown:
    raise ValueError(f"Task {NAME!r} has no difficulty field(s) {unknown}; valid fields: "
                     f"{', '.join(fields)}.")
  result = Options(**options)
  w = result.format_reward
  if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
    raise ValueError(f"Task {NAME!r}: format_reward = {w!r} must be a number in [0, 1) "
                     "(0 = off; e.g. 0.1 for a small bonus for a boxed or '####' answer).")
  if not isinstance(result.instruction, str):
    raise ValueError(f"Task {NAME!r}: instruction = {result.instruction!r} must be a string.")
  return result


def question_key(entry: dict) -> str:
  """A question's identity for split disjointness: its text without whitespace."""
  return re.sub(r"\s+", "", entry["question"])


def reference_solution(entry: dict) -> str:
  """The generator's worked solution with its '#### n' line replaced by '\\boxed{n}'."""
  return math_answer.solution_with_box(entry["metadata"].get("answer_cot") or "",
                                       entry["answer"])


until_eos = math_answer.until_eos  # the completion up to the first end-of-sequence marker


@functools.lru_cache(maxsize=64)  # the worker asks reward, then exact_match, of each completion
def score(completion: str, gold: str, format_reward: float = 0.0) -> tuple[float, bool]:
  """(reward, correct) of a completion against the numeric reference `gold`. TimeoutError
  when math-verify runs past rl.tasks.math_answer's bound (the scoring worker counts it)."""
  answer = math_answer.extract_answer(until_eos(completion))
  correct = answer is not None and math_answer.equivalent(answer, gold)
  formatted = math_answer.is_formatted(answer)
  return (1.0 - format_reward) * correct + format_reward * formatted, correct


@functools.lru_cache(maxsize=None)
def _generators(difficulty: float) -> dict:
  """reasoning-gym's working generators by index (those it samples from), after its own
  validation of `difficulty`."""
  try:
    dataset = reasoning_gym.create_dataset(NAME, size=1, seed=0, difficulty=difficulty)
  except (AssertionError, ValueError) as error:
    raise ValueError(f"Task {NAME!r}: invalid difficulty={difficulty!r} (reasoning-gym "
                     f"supports only 1.0): {error}") from error
  return {i: dataset.generators[i] for i in _rg_gsm.tasks_ok}


class GsmTask:
  """The gsm_symbolic task: deterministic train/eval examples and the math reward.

  The rl.tasks.base.Task interface (name, prompt_style, seed, eval_size, difficulty,
  examples, reward, exact_match, verdict). Build with `rl.tasks.make_task("gsm_symbolic",
  prompt_style="full", ...)`.
  """

  name = NAME
  reward_timeout_s = 5.0  # rl.tasks.math_answer's 1 s bound ends math-verify first; this is the backstop

  def __init__(self, prompt_style: str = "full", seed: int = 0,
               eval_size: int = DEFAULT_EVAL_SIZE, **difficulty):
    if prompt_style not in PROMPT_STYLES:
      raise ValueError(f"Task {NAME!r} needs prompt_style='full' (got {prompt_style!r}): its "
                       "word problems need a pretrained checkpoint's tokenizer. Set "
                       "config.task.prompt_style='full' and config.model.checkpoint (e.g. "
                       "experiments/configs/smollm2_gsm.py).")
    if eval_size < 1:
      raise ValueError(f"Task {NAME!r}: eval_size={eval_size} must be >= 1.")
    self.options = check_options(difficulty)
    self.prompt_style = prompt_style
    self.seed = seed
    self.eval_size = eval_size
    self.difficulty = dict(difficulty)
    self._generators = _generators(float(self.options.difficulty))
    self._indices = sorted(self._generators)
    self._eval = None

  def __reduce__(self):
    """Pickles as the arguments that rebuild the task (for rl.scoring's worker)."""
    return (functools.partial(GsmTask, **self.difficulty),
            (self.prompt_style, self.seed, self.eval_size))

  def __repr__(self) -> str:
    return (f"GsmTask(prompt_style={self.prompt_style!r}, seed={self.seed}, "
            f"eval_size={self.eval_size}, difficulty={self.difficulty})")

  def entry(self, stream_seed: int, index: int) -> dict:
    """Item `index` of the stream seeded `stream_seed`: a reasoning-gym entry."""
    rng = random.Random(stream_seed + index)
    generator = self._indices[rng.randrange(len(self._indices))]
    entry = self._generators[generator](rng, float(self.options.difficulty))
    entry["metadata"].update(source_dataset=NAME, generator=generator)
    return entry

  def _eval_set(self) -> tuple[list[dict], frozenset]:
    if self._eval is None:
      entries = [self.entry(self.seed + _EVAL_SEED_OFFSET, i) for i in range(self.eval_size)]
      self._eval = entries, frozenset(question_key(e) for e in entries)
    return self._eval

  def _train_entry(self, position: int) -> dict:
    _, eval_keys = self._eval_set()
    for draw in range(_MAX_TRAIN_DRAWS):
      entry = self.entry(self.seed + draw * _TRAIN_SEED_STRIDE, position)
      if question_key(entry) not in eval_keys:
        return entry
    raise ValueError(f"Task {NAME!r}: train position {position} collided with the eval set "
                     f"{_MAX_TRAIN_DRAWS} times; lower eval_size={self.eval_size}.")

  def _example(self, entry: dict) -> Example:
    prompt = f"{entry['question']} {self.options.instruction}".strip()
    return Example(prompt=prompt, answer=reference_solution(entry), entry=entry)

  def examples(self, split: str, n: int, start: int = 0) -> list[Example]:
    """Examples at positions start, ..., start + n - 1 of 'train' (unbounded) or 'eval'
    (`eval_size` items, none of whose questions occur in 'train'). Deterministic."""
    if n < 0 or start < 0:
      raise ValueError(f"Task {NAME!r}: n={n} and start={start} must be >= 0.")
    if split == "eval":
      if start + n > self.eval_size:
        raise ValueError(f"Task {NAME!r}: eval positions {start}..{start + n - 1} exceed "
                         f"eval_size={self.eval_size}; pass a larger eval_size.")
      return [self._example(e) for e in self._eval_set()[0][start:start + n]]
    if split == "train":
      return [self._example(self._train_entry(p)) for p in range(start, start + n)]
    raise ValueError(f"Task {NAME!r}: unknown split {split!r}; use 'train' or 'eval'.")

  def reward(self, completion: str, example: Example) -> float:
    """Correctness, plus the format term when `format_reward` > 0; in [0, 1]."""
    return score(completion, example.entry["answer"], self.options.format_reward)[0]

  def exact_match(self, completion: str, example: Example) -> bool:
    """True when the final answer equals the reference (format does not matter)."""
    return score(completion, example.entry["answer"], self.options.format_reward)[1]

  def second_opinion(self, completion: str, example: Example) -> bool:
    """A second verifier of a completion the rule scorer failed (rl.rewards): math-verify's
    own extraction over the completion's tail (`math_answer.verified_anywhere`)."""
    return math_answer.verified_anywhere(completion, example.entry["answer"])

  def verdict(self, completion: str, example: Example) -> verdicts.Verdict:
    """The final answer read and why it failed (`rl.tasks.math_answer.verdict`)."""
    gold = example.entry["answer"]
    correct = score(completion, gold, self.options.format_reward)[1]
    return math_answer.verdict(completion, gold, correct)


TASKS.register(NAME, GsmTask)
