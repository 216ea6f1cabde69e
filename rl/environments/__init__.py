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
this interface and registry (`rl.environments.base`), the built-ins (`rl.environments.builtins`) and the host side
of the turn loop (`rl.environments.turns`: budgets, answering paused rows); the decode loop
that pauses rows at a call is `sampling.partial`'s.
"""

from rl.environments.base import (ENVIRONMENTS, Environment, make_environment,
                                  split_demonstration)
from rl.environments import builtins  # registers the built-ins  # pylint: disable=unused-import

__all__ = ["ENVIRONMENTS", "Environment", "make_environment", "split_demonstration"]
