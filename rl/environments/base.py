"""The environment interface (`Environment`), its registry (`ENVIRONMENTS`, config.tools.name)
and what the warm start needs of one (`split_demonstration`); the package's docstring
describes environments, `rl.environments.builtins` registers the built-in ones."""

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

  >>> from rl import environments  # registers the built-ins
  >>> environments.make_environment("adder").step(",2:1234567,3:?+5=")
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
