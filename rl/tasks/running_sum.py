"""running_sum: repeated addition written as a trace of states, Arbor's built-in RL testbed.

A problem adds `step` to a 7-digit start k times. The prompt gives the step and the initial
state "count:total", where count is the number of additions still to do: "+5,3:1234567"
asks for 1234567 + 5 + 5 + 5. A worked solution restates the initial state, writes the
state after each addition and ends at count 0: ",3:1234567,2:1234572,1:1234577,0:1234582".
The reward is 1.0 when the total of the last state is the true total and 0.0 otherwise by
default (only the exact final total scores, so junk cannot farm reward; `state_credit` adds
an optional process reward). Every step is local and the same: read the previous state 10
tokens back, write count - 1 and total + step (carrying when the units wrap), stop after
count 0. So a small transformer learns the procedure from demonstrations, and long problems
are harder only because errors compound. The restated initial state makes the first
addition read a state the policy wrote, like every later one.

Why this task makes RL visible on a CPU:

* Long tail by construction. k follows a Zipf law on [min_steps, max_steps] (1-9 by
  default; the law's tail beyond max_steps is folded into max_steps) and each state is 10
  tokens, so most completions are short and some are long (defaults: P(k=1) = 0.57, median
  21 tokens, 95th percentile 101 = 4.8x the median, longest 101).
* Headroom by construction: an imperfect teacher. The warm start imitates demonstrations
  (`Example.answer`) in which, at each step that carries, the teacher forgets the carry
  (writes 1234562 instead of 1234572 for 1234567 + 5) and then continues correctly from
  what it wrote. How often depends on the units digit being added to:
  `teacher_carry_slip` = (0.55, 0.9) by default, from 55% at 5 to 90% at 9. Supervised
  learning converges to the teacher's conditional distribution, so with every slip rate
  above 1/2 the warm-started policy's greedy choice at a carry is the slip. Adding 5
  carries at every other step, so greedy decoding solves only one-step problems that do
  not carry (about 30% of them). Sampling still carries with probability 0.1-0.45, so
  GRPO sees correct completions (short problems first) and raises the carry probability
  past one half; longer problems follow as the per-step accuracy rises (success ~ p **
  carries). The reward always checks the true total, never the teacher.

Items are index-addressable: item i of a split is drawn from NumPy generators seeded by
(seed, split, i), so `examples(split, n, start)` is a pure function and a loop resumes from
one integer cursor. The eval split is the first `eval_size` items of its stream; train
position p redraws its start (same k) until the question is not an eval question, so the
splits are disjoint and the train size distribution is exactly P(k).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from rl import verdicts
from rl.tasks.base import TASKS, Example

NAME = "running_sum"
PROMPT_STYLES = ("compact", "full")

_EVAL_STREAM, _TRAIN_STREAM, _TEACHER_STREAM, _TOOL_STREAM = 1, 2, 3, 4
_MAX_TRAIN_DRAWS = 64
_SIZE_DRAW = _MAX_TRAIN_DRAWS  # the draw index whose generator picks k
_FINAL_TOTAL = re.compile(r"[0-9]{1,12}")
# A state written with the adder (rl.environments.builtins.Adder): "?+step=" or "?previous+step=",
# and its answer.
_TOOL_STATE = re.compile(r"\?(?:[0-9]{1,12})?\+[0-9]{1,12}=([0-9]{1,12})")
# One written state after its comma: "count:total" or "count:?[previous]+step=total".
_STATE = re.compile(r"([0-9]):(?:([0-9]{1,12})|\?(?:([0-9]{1,12}))?\+([0-9])=([0-9]{1,12}))")
# The text of a completion that is scored: up to the first newline or end-of-sequence
# marker left in text decoded by a subword tokenizer.
_STOP_STRINGS = ("\n", "<|endoftext|>", "<|im_end|>", "</s>")


@dataclasses.dataclass(frozen=True)
class Problem:
  """start + step * steps, solved by adding `step` `steps` times."""
  start: int
  step: int
  steps: int

  @property
  def total(self) -> int:
    return self.start + self.step * self.steps


@dataclasses.dataclass(frozen=True)
class Difficulty:
  """The problem distribution and the warm-start teacher.

  min_steps / max_steps: range of k, the number of additions (1 to 9: the count is one
    digit).
  length_tail: k follows a Zipf law, P(k) proportional to k ** -length_tail, whose tail
    beyond max_steps is folded into max_steps (so the longest problems keep a share that
    a warm start can learn from); must be > 1.
  digits: width of the running total; starts are uniform over the `digits`-digit numbers
    that stay `digits` digits wide after max_steps additions.
  step: the number added at every step (1 to 9; 5 carries at every other step).
  teacher_carry_slip: (first, last): probability that a demonstration forgets the carry
    at a step that carries, when the units digit being added to is the smallest one that
    carries (10 - step) and when it is 9; linear in the units digit in between. The spread
    gives each carry context its own starting point, so GRPO flips them one after another
    (a learning curve rather than one jump). A single number p means (p, p); 0 = a perfect
    teacher.
  state_credit: partial credit for a wrong final total, in [0, 1): the reward is
    state_credit * (leading states equal to the true running states) / k, so a completion
    that goes wrong later scores more than one that goes wrong sooner (a process reward
    that only the true states earn; `correct_leading_states`). A correct final total
    always scores 1.0. 0 = exact match only.
  tool_share: probability that the teacher does an addition with the adder tool
    (config.tools.name='adder', rl.environments.builtins.Adder) instead of by hand: it writes the
    state ",2:?+5=" and the tool answers "1234572", the running total plus 5 (so
    ",2:?+5=1234572"), never slipping; the rest by hand, with the slips above. 0 = no tool
    calls (the default; the demonstrations are then exactly those of earlier versions).
  """
  min_steps: int = 1
  max_steps: int = 9
  length_tail: float = 1.9
  digits: int = 7
  step: int = 5
  teacher_carry_slip: tuple[float, float] = (0.55, 0.9)
  state_credit: float = 0.0
  tool_share: float = 0.0

  def __post_init__(self):
    slip = self.teacher_carry_slip
    slip = (slip, slip) if isinstance(slip, (int, float)) else tuple(slip)
    if len(slip) != 2 or not all(0.0 <= p <= 1.0 for p in slip):
      raise ValueError(f"running_sum: teacher_carry_slip={self.teacher_carry_slip} must be a "
                       "probability in [0, 1] or a pair of them (first, last).")
    object.__setattr__(self, "teacher_carry_slip", tuple(float(p) for p in slip))
    if not 1 <= self.min_steps <= self.max_steps <= 9:
      raise ValueError(f"running_sum: need 1 <= min_steps <= max_steps <= 9, got "
                       f"min_steps={self.min_steps}, max_steps={self.max_steps}.")
    if not 2 <= self.digits <= 12:
      raise ValueError(f"running_sum: digits={self.digits} must be in [2, 12].")
    if not 1 <= self.step <= 9:
      raise ValueError(f"running_sum: step={self.step} must be in [1, 9].")
    if not 0.0 <= self.state_credit < 1.0:
      raise ValueError(f"running_sum: state_credit={self.state_credit} must be in [0, 1) (a "
                       "wrong answer scores less than a right one).")
    if not 0.0 <= self.tool_share <= 1.0:
      raise ValueError(f"running_sum: tool_share={self.tool_share} must be a probability in "
                       "[0, 1].")
    if self.length_tail <= 1:
      raise ValueError(f"running_sum: length_tail={self.length_tail} must be > 1 (a Zipf "
                       "law with a finite tail).")

  def carry_slip(self, units: int) -> float:
    """The teacher's slip probability when adding `step` to a total whose units digit is
    `units` (0.0 where that addition does not carry)."""
    lowest = 10 - self.step
    if units < lowest:
      return 0.0
    first, last = self.teacher_carry_slip
    return first + (last - first) * (units - lowest) / max(9 - lowest, 1)

  @property
  def start_range(self) -> tuple[int, int]:
    """(lowest, highest) start: every running total has exactly `digits` digits."""
    return 10 ** (self.digits - 1), 10 ** self.digits - 1 - self.step * self.max_steps

  def size_probabilities(self) -> tuple[np.ndarray, np.ndarray]:
    """(k values, P(k)): Zipf weights k ** -length_tail, the last one the whole tail."""
    sizes = np.arange(self.min_steps, self.max_steps + 1)
    weights = sizes ** -float(self.length_tail)
    weights[-1] = zipf_tail(self.max_steps, self.length_tail)
    return sizes, weights / weights.sum()


def zipf_tail(first: int, exponent: float, terms: int = 10_000) -> float:
  """sum over j >= first of j ** -exponent (exponent > 1): `terms` terms, then the
  Euler-Maclaurin remainder (the Hurwitz zeta function zeta(exponent, first); relative
  error below 1e-10 for exponents 1.1-2 against mpmath's, measured)."""
  j = np.arange(first, first + terms, dtype=np.float64)
  end = float(first + terms)
  return float((j ** -exponent).sum() + end ** (1 - exponent) / (exponent - 1)
               + 0.5 * end ** -exponent)


def question(problem: Problem) -> str:
  """The prompt: the step to add, then the initial state "count:total", e.g.
  Problem(1234567, 5, 3) -> "+5,3:1234567" (add 5 three times to 1234567)."""
  return f"+{problem.step},{problem.steps}:{problem.start}"


def worked_solution(problem: Problem, slips=None, tools=None) -> str:
  """The initial state, then the state after each step, e.g. Problem(1234567, 5, 3) ->
  ",3:1234567,2:1234572,1:1234577,0:1234582": the count of steps left, then the running
  total; the solution ends at count 0.

  The first state restates the prompt's, so every addition, the first included, reads a
  state that the policy itself wrote (without it, a policy can learn the carry everywhere
  but at the first addition, which reads the prompt: seen in one seed of five).

  slips[j] (bool, one per step): at a step whose units digit wraps, forget the carry (write
  total - 10) and continue from the written total. None = no slips.
  tools[j] (bool, one per step): do step j with the adder, ",2:?+5=1234572" (the step,
  added to the previous written total, and the tool's exact answer); it never slips. None
  = every step by hand.
  """
  total, parts = problem.start, [f",{problem.steps}:{problem.start}"]
  for j in range(problem.steps):
    left = problem.steps - 1 - j
    if tools is not None and tools[j]:
      parts.append(f",{left}:?+{problem.step}={total + problem.step}")
      total += problem.step
      continue
    carries = total % 10 + problem.step >= 10
    total += problem.step - (10 if carries and slips is not None and slips[j] else 0)
    parts.append(f",{left}:{total}")
  return "".join(parts)


def scored_text(completion: str) -> str:
  """The part of a completion that is scored: up to the first newline or end-of-sequence
  marker, leading whitespace removed."""
  text = completion.lstrip()
  for stop in _STOP_STRINGS:
    text = text.split(stop, 1)[0]
  return text


def parse_final_answer(completion: str) -> int | None:
  """The total of the last state: the integer after the last colon of the scored text
  (`scored_text`; all of it when there is no colon), or the adder's answer when the last
  state is a tool call "?a+b=total"; None when that is not 1-12 decimal digits. Linear in
  the text's length; never evaluates the text."""
  final = final_state(completion)
  tool = _TOOL_STATE.fullmatch(final)
  if tool:
    final = tool.group(1)
  return int(final) if _FINAL_TOTAL.fullmatch(final) else None


def final_state(completion: str) -> str:
  """The scored text's last state, as `parse_final_answer` reads it: the text after its
  last colon (all of it when there is none), stripped."""
  return scored_text(completion).rsplit(":", 1)[-1].strip()


def failure_category(completion: str) -> str:
  """Why a completion without the right total failed: no_answer when its last state holds
  no digit (an empty reply, a trace cut before any total), malformed when it holds one but
  is not a total `parse_final_answer` reads ('12a4', '1234567,'), else wrong_value."""
  if parse_final_answer(completion) is not None:
    return verdicts.WRONG_VALUE
  if not any(char.isdigit() for char in final_state(completion)):
    return verdicts.NO_ANSWER
  return verdicts.MALFORMED


def correct_leading_states(completion: str, problem: Problem) -> int:
  """How many of the completion's first additions are exactly the true states, in order (0
  to k), after the restated initial state: ",3:37,2:42,1:52,0:57" for Problem(37, 5, 3) has
  1 (",2:42"); without a right ",3:37" first, 0. A state counts only when the text after
  it is the next state's comma or the end of the scored text, so ",2:423" does not count as
  ",2:42". Linear in the text's length; never evaluates it."""
  text, position = scored_text(completion), 0
  totals = [problem.start + problem.step * j for j in range(problem.steps + 1)]
  for matched, (left, total) in enumerate(zip(range(problem.steps, -1, -1), totals)):
    states = [f",{left}:{total}"]
    if matched:  # an addition may be an adder call, on the running or the named total
      states += [f",{left}:?+{problem.step}={total}",
                 f",{left}:?{totals[matched - 1]}+{problem.step}={total}"]
    for state in states:
      end = position + len(state)
      if text.startswith(state, position) and (end == len(text) or text[end] == ","):
        break
    else:
      return max(matched - 1, 0)
    position = end
  return problem.steps


def step_rewards(completion: str, problem: Problem) -> list[tuple[int, float]]:
  """The exact process reward of every written state: (the character offset in
  `completion` just past the state, +1.0 when the step is right, else -1.0), in order.

  Each ",count:total" of the scored text (`scored_text`) is a step. The first restates the
  prompt's state and is right when it is exactly ",k:start". A later one is judged on its
  own, given the state it reads (the convention of step-level process labels: is this step
  a correct step?): right when its count is one less than the previous written count and
  its total the previous written total plus the step (an adder call's answer counts as its
  total; an adder call naming a previous total must name the written one), so a state after
  count 0, a carry forgotten or a total copied wrong is -1, and the steps after a slip are
  judged from what was written. Text that is not a state (junk after a comma) is a wrong
  step; text before the first comma is none. Linear in the text's length; never
  evaluates it."""
  lead = len(completion) - len(completion.lstrip())
  text = scored_text(completion)
  rewards, position, previous = [], lead, None
  for index, piece in enumerate(text.split(",")):
    position += len(piece) + (1 if index else 0)
    if not index:
      continue
    state = _STATE.fullmatch(piece)
    count = total = None
    named = None
    if state:
      count = int(state.group(1))
      total = int(state.group(2) if state.group(2) is not None else state.group(5))
      named = state.group(3)
      if state.group(4) is not None and int(state.group(4)) != problem.step:
        state = None
    if previous is None:
      right = state is not None and (count, total) == (problem.steps, problem.start) and (
          state.group(2) is not None)
    else:
      right = (state is not None and previous[0] is not None and count == previous[0] - 1
               and total == previous[1] + problem.step
               and (named is None or int(named) == previous[1]))
    rewards.append((position, 1.0 if right else -1.0))
    previous = (count, total) if state is not None else (None, None)
  return rewards


class RunningSumTask:
  """The running_sum task: deterministic train/eval examples and the exact-answer reward.

  The rl.tasks.base.Task interface (name, prompt_style, seed, eval_size, difficulty,
  examples, reward, exact_match, verdict). `Example.size` is k, the number of additions;
  `Example.entry` holds the Problem, its true total and the correct worked solution;
  `Example.answer` is the teacher's worked solution (what the warm start imitates).
  Build with `rl.tasks.make_task("running_sum", ...)`.
  """

  name = NAME

  def __init__(self, prompt_style: str = "compact", seed: int = 0, eval_size: int = 500,
               **difficulty):
    if prompt_style not in PROMPT_STYLES:
      raise ValueError(f"Task {NAME!r}: unknown prompt_style {prompt_style!r}; use one of "
                       f"{PROMPT_STYLES}.")
    fields = sorted(f.name for f in dataclasses.fields(Difficulty))
    unknown = sorted(set(difficulty) - set(fields))
    if unknown:
      raise ValueError(f"Task {NAME!r} has no difficulty field(s) {unknown}; valid fields: "
                       f"{', '.join(fields)}.")
    if eval_size < 1:
      raise ValueError(f"Task {NAME!r}: eval_size={eval_size} must be >= 1.")
    self.prompt_style = prompt_style
    self.seed = seed
    self.eval_size = eval_size
    self.difficulty = dict(difficulty)
    self._difficulty = Difficulty(**difficulty)
    self._sizes, self._size_p = self._difficulty.size_probabilities()
    self._eval = None

  def __reduce__(self):
    """Pickles as the arguments that rebuild the task (rl.scoring's worker unpickles it),
    not its cache of held-out examples."""
    return (functools.partial(RunningSumTask, **self.difficulty),
            (self.prompt_style, self.seed, self.eval_size))

  def __repr__(self) -> str:
    return (f"RunningSumTask(prompt_style={self.prompt_style!r}, seed={self.seed}, "
            f"eval_size={self.eval_size}, difficulty={self.difficulty})")

  def _rng(self, stream: int, index: int, draw: int = 0) -> np.random.Generator:
    return np.random.default_rng((self.seed, stream, index, draw))

  def _size(self, stream: int, index: int) -> int:
    return int(self._rng(stream, index, _SIZE_DRAW).choice(self._sizes, p=self._size_p))

  def _problem(self, stream: int, index: int, steps: int, draw: int) -> Problem:
    rng = self._rng(stream, index, draw)
    d = self._difficulty
    low, high = d.start_range
    return Problem(start=int(rng.integers(low, high + 1)), step=d.step, steps=steps)

  def _example(self, stream: int, index: int, problem: Problem) -> Example:
    draws = self._rng(_TEACHER_STREAM, index, stream).random(problem.steps)
    # A slip keeps the units digit, so step j adds to units digit (start + j * step) % 10.
    units = (problem.start + problem.step * np.arange(problem.steps)) % 10
    slips = draws < [self._difficulty.carry_slip(int(u)) for u in units]
    share = self._difficulty.tool_share
    tools = (self._rng(_TOOL_STREAM, index, stream).random(problem.steps) < share
             if share else None)
    prompt = (question(problem) if self.prompt_style == "compact" else
              f"Add {problem.step} to {problem.start}, {problem.steps} times. Write a "
              f"comma, the number of additions left, a colon and the running total: first "
              f"for the start, then after each addition; stop when none are left. Start: "
              f"{question(problem)}\n")
    entry = {"problem": problem, "total": problem.total, "solution": worked_solution(problem)}
    return Example(prompt=prompt, answer=worked_solution(problem, slips, tools), entry=entry,
                   size=problem.steps)

  def _eval_items(self) -> tuple[list[Example], frozenset]:
    if self._eval is None:
      items = [self._example(_EVAL_STREAM, i,
                             self._problem(_EVAL_STREAM, i, self._size(_EVAL_STREAM, i), 0))
               for i in range(self.eval_size)]
      self._eval = (items, frozenset(e.entry["problem"] for e in items))
    return self._eval

  def _train_example(self, position: int) -> Example:
    _, eval_problems = self._eval_items()
    steps = self._size(_TRAIN_STREAM, position)
    for draw in range(_MAX_TRAIN_DRAWS):
      problem = self._problem(_TRAIN_STREAM, position, steps, draw)
      if problem not in eval_problems:
        return self._example(_TRAIN_STREAM, position, problem)
    raise ValueError(f"Task {NAME!r}: train position {position} (k={steps}) collided with the "
                     f"eval set {_MAX_TRAIN_DRAWS} times; lower eval_size or raise min_steps.")

  def examples(self, split: str, n: int, start: int = 0) -> list[Example]:
    """Examples at positions start .. start + n - 1 of 'train' (unbounded) or 'eval'
    (eval_size items, none of whose questions occur in 'train')."""
    if n < 0 or start < 0:
      raise ValueError(f"Task {NAME!r}: n={n} and start={start} must be >= 0.")
    if split == "eval":
      items, _ = self._eval_items()
      if start + n > self.eval_size:
        raise ValueError(f"Task {NAME!r}: eval positions {start}..{start + n - 1} exceed "
                         f"eval_size={self.eval_size}; raise config.task.eval_size.")
      return items[start:start + n]
    if split == "train":
      return [self._train_example(p) for p in range(start, start + n)]
    raise ValueError(f"Task {NAME!r}: unknown split {split!r}; use 'train' or 'eval'.")

  def reward(self, completion: str, example: Example) -> float:
    """1.0 when the final total (`parse_final_answer`) is start + step * steps; otherwise
    the difficulty's state_credit times the share of leading states that are right (0.0
    by default)."""
    if self.exact_match(completion, example):
      return 1.0
    credit = self._difficulty.state_credit
    if not credit:
      return 0.0
    problem = example.entry["problem"]
    return credit * correct_leading_states(completion, problem) / problem.steps

  def exact_match(self, completion: str, example: Example) -> bool:
    return parse_final_answer(completion) == example.entry["total"]

  def step_rewards(self, completion: str, example: Example) -> list[tuple[int, float]]:
    """Exact per-step process rewards (`step_rewards`): (character offset past the step, +1
    right / -1 wrong) for each written state."""
    return step_rewards(completion, example.entry["problem"])

  def second_opinion(self, completion: str, example: Example) -> bool:
    """A second verifier of a completion a rule verifier failed (rl.rewards): here the
    exact check itself, so it rescues every false negative."""
    return self.exact_match(completion, example)

  def verdict(self, completion: str, example: Example) -> verdicts.Verdict:
    """The final total read (for a malformed one, its last state's text; none for no
    answer) against the true total, and why it failed (`failure_category`)."""
    total = parse_final_answer(completion)
    category = (verdicts.CORRECT if total == example.entry["total"]
                else failure_category(completion))
    answer = (str(total) if total is not None else
              final_state(completion) if category == verdicts.MALFORMED else None)
    return verdicts.Verdict(category, answer, str(example.entry["total"]))


TASKS.register(NAME, RunningSumTask)
