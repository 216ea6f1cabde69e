"""Environments: what answers the policy in the middle of a rollout (tool calls, turns).

An environment is host-side Python, like a task's scorer. A row decodes until it writes
the environment's `call_end` text (the end of a tool call, e.g. "=" after "?+5");
the environment then sees the row's text so far (prompt and completion, environment
answers included) and returns the observation to append — tokens the policy did not
write, which the row conditions on and the loss never trains —, "" when the text was not
a call after all (the row resumes with nothing appended), or None, which ends the row. `rl.environments.turns` drives the turns; every `step` runs in `rl.scoring`'s
worker process under a time limit, so an environment that hangs, raises, crashes or
answers with something that is not text ends that row with reward 0 and a counter, never
the run.

    class Environment(Protocol):
      name: str
      call_end: str                      # the text that ends a tool call
      def step(self, text: str) -> str | None: ...
      # optional: timeout_s (seconds per step), limits (rl.scoring.Limits)

The built-in environments (`ENVIRONMENTS`, config.tools.name):

  adder       "?a+b=" -> "a+b", and "?+b=" -> b plus the running total, the number
              before the text's last comma (running_sum's tool: `,3:1234567,2:?+5=` is
              answered `1234572`); a malformed call "?..." ends the row; a "=" after no
              "?" is not a call.
  calculator  GSM8K's calculator annotations: "<<48/2=" -> "24>>" (+, -, *, /, parentheses
              and decimals, parsed by hand and computed with exact fractions: policy text
              is never evaluated as Python; a "=" outside an open "<<" is not a call).

docs/tools.md walks through writing one. The package holds everything environments are:
this interface and registry, the built-ins (`rl.environments.builtins`) and the host side
of the turn loop (`rl.environments.turns`: budgets, answering paused rows); the decode loop
that pauses rows at a call is `sampling.partial`'s.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from rl.registry import Registry


class Environment(Protocol):
  """What answers a row at a tool call (module docstring). Must pickle (module level): it
  runs in the scoring worker."""
  name: str
  call_end: str

  def step(self, text: str) -> Optional[str]:
    """Answers one tool call.

    Args:
      text: the row so far (prompt, completion and earlier answers), ending with
        `call_end`.

    Returns:
      The observation to append (context the loss never trains on), "" when `text` does
      not end in a call (nothing is appended, the row resumes), or None to end the row.
    """


ENVIRONMENTS: Registry[Callable[[], Environment]] = Registry(
    "environment", "config.tools.name", "rl.environments.ENVIRONMENTS.register adds one: "
    "docs/tools.md")


def make_environment(name: str) -> Environment:
  """The registered environment `name` (config.tools.name).

  Args:
    name: a name in `ENVIRONMENTS`.

  Returns:
    A fresh instance of that environment.

  >>> make_environment("adder").step(",2:1234567,3:?+5=")
  '1234572'
  """
  return ENVIRONMENTS.get(name)()


def split_demonstration(prompt: str, answer: str, environment: Environment) -> list[tuple[str, bool]]:
  """A reference answer cut into (text, written_by_environment) segments, by running the
  environment on it: after each `call_end` the answer must continue with what the
  environment answers there (a demonstration of the tool is what the tool would say).
  The warm start trains the policy's segments and keeps the environment's as context.
  Raises ValueError naming the answer when it disagrees with the environment."""
  segments, at, written = [], 0, 0
  end = environment.call_end
  while True:
    found = answer.find(end, at)
    if found < 0:
      break
    at = found + len(end)
    observation = environment.step(prompt + answer[:at])
    if observation is None:
      break
    if not answer.startswith(observation, at):
      raise ValueError(f"The reference answer {answer!r} continues the tool call at "
                       f"character {at} with {answer[at:at + len(observation)]!r}, but "
                       f"environment {environment.name!r} answers {observation!r}: a "
                       "demonstration must write what the tool would answer.")
    segments.append((answer[written:at], False))
    if observation:
      segments.append((observation, True))
    at += len(observation)
    written = at
  if written < len(answer):
    segments.append((answer[written:], False))
  return segments


from rl.environments import builtins  # registers the built-ins  # pylint: disable=wrong-import-position,unused-import
