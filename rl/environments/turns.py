"""Rollouts with turns: environments answer the policy mid-rollout (tool calls, docs/tools.md).

A row decodes until it writes one of the environment's call tokens (the tokens whose text
ends with `Environment.call_end`) and pauses there. Between decode rounds `Turns.answer`
sends the paused rows' text (prompt and completion so far) to the environment, in the
scoring worker (`rl.scoring.observe`: time-limited, isolated), tokenizes each observation,
caps it, and appends it to its row (`sampling.partial.append_observations`); the next
round re-encodes each row's whole prefix and decodes on. So rows are exact samples of the
policy given everything before them, environment text included, and each policy token
keeps the behaviour log-prob and version it was drawn with; environment tokens get version
-1 and end up as context (prompt_mask, `ToolRows.env_mask`), never in completion_mask, so
the loss, its length normalisation and every correction ignore them.

An environment that answers "" says the text was not a call (a "=" in prose, for the
calculator): the row resumes with nothing appended. A row ends when it stops (EOS), runs
out of its N tokens (policy and environment tokens together), has had
`ToolSettings.max_turns` answers (it ends at its next pause), or the environment ends it
(answers None). A step
that times out, raises or crashes, or an observation the tokenizer cannot encode, ends
the row as failed: it scores 0 and is counted; the run goes on.

Both the independent producer (`make_generate`: a pool of the batch's rows, drained) and
partial rollouts (`rl.rollouts.partial.PartialRollouts(turns=...)`) run turns on the
same pool mechanics, so turns compose with async training and resumable partial pools.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from rl import scoring
from rl.environments.base import make_environment
from rl.settings.tools import ToolSettings
from sampling import partial
from sampling.sampler import Generation, SamplingConfig, ToolRows


def call_tokens(tokenizer, call_end: str) -> tuple[int, ...]:
  """Ids of the tokens whose text ends with `call_end` (a subword tokenizer may merge the
  end of a call with what precedes it). ValueError when there are none."""
  special = {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id}
  ids = tuple(i for i in range(tokenizer.vocab_size)
              if i not in special and tokenizer.decode([i]).endswith(call_end))
  if not call_end or not ids:
    raise ValueError(f"No token of the tokenizer ends with the environment's call_end "
                     f"{call_end!r}, so a row could never call it; pick a call_end the "
                     "tokenizer can write.")
  return ids


@dataclasses.dataclass
class TurnCounters:
  """What answering tool calls cost over some rounds (summed)."""
  steps: int = 0
  errors: int = 0
  timeouts: int = 0
  cut: int = 0
  env_time_s: float = 0.0

  def add(self, other: "TurnCounters") -> "TurnCounters":
    return TurnCounters(*(getattr(self, f.name) + getattr(other, f.name)
                          for f in dataclasses.fields(self)))


class Turns:
  """Answers the tool calls of a pool's paused rows (host side; fixed configuration).

  Args:
    environment: an `rl.environments.Environment` (it must pickle: it runs in the worker).
    tokenizer: the policy's (observations are encoded with it, no BOS).
    config: the budgets (`ToolSettings`; its `name` is the caller's business: the
      environment is given).
  """

  def __init__(self, environment, tokenizer, config: ToolSettings = ToolSettings()):
    config.check_ranges()  # the budgets' ranges; the name is the caller's
    self.environment = environment
    self.tokenizer = tokenizer
    self.config = config
    self.call_tokens = call_tokens(tokenizer, environment.call_end)

  def decode_config(self, sampling_config: SamplingConfig) -> SamplingConfig:
    """`sampling_config` with the call tokens as stops too (a row pauses at a call)."""
    stops = tuple(sampling_config.stop_tokens) + tuple(
        t for t in self.call_tokens if t not in sampling_config.stop_tokens)
    return dataclasses.replace(sampling_config, stop_tokens=stops)

  def _row_text(self, prompt_ids, written_ids) -> str:
    """What the environment reads: the prompt's text (a chat template's end-of-turn
    markers, which may be the EOS id, skipped rather than ending it), then the completion's
    (the policy's and the environment's tokens)."""
    eos = self.tokenizer.eos_id
    return (self.tokenizer.decode([t for t in prompt_ids if t != eos])
            + self.tokenizer.decode(written_ids))

  def answer(self, pool: partial.RolloutPool) -> tuple[partial.RolloutPool, TurnCounters]:
    """Sends every paused row (stopped on a call token the policy wrote, environment still
    running) to the environment and appends the answers; a row answered "" (not a call)
    resumes as it is; rows past their turn budget or their token budget, and rows the
    environment ends or fails, are marked so. Rows must end at the resume slot C (between
    rounds)."""
    s = pool.sampler
    tokens, mask, version, done, start, status = (np.asarray(x) for x in jax.device_get(
        (s.tokens, s.token_mask, s.version, s.done, pool.start,
         pool.env_status)))
    c, p, n = pool.resume_slot, pool.prompt_slots, pool.max_new_tokens
    index = np.arange(tokens.shape[1])[None, :]
    completion = mask & (index >= (start + p)[:, None]) & (index < c)
    generated = completion.sum(axis=1)
    last = tokens[:, c - 1]
    paused = (done & (status == partial.ENV_RUNNING) & mask[:, c - 1] & (version[:, c - 1] >= 0)
              & np.isin(last, self.call_tokens))
    if not paused.any():
      return pool, TurnCounters()
    status = status.copy()
    answered = np.asarray(_answered_calls(completion & (version < 0)))
    over = paused & ((answered >= self.config.max_turns) | (generated >= n))
    status[over] = partial.ENV_ENDED
    rows = np.flatnonzero(paused & ~over)
    lengths = np.zeros(tokens.shape[0], np.int32)
    live = np.zeros(tokens.shape[0], bool)
    width = self.config.max_observation_tokens
    appended = np.zeros((tokens.shape[0], width), np.int32)
    counters = TurnCounters()
    if len(rows):
      texts = [self._row_text(tokens[r, start[r]:start[r] + p][mask[r, start[r]:start[r] + p]],
                              tokens[r, start[r] + p:c][mask[r, start[r] + p:c]]) for r in rows]
      started = time.perf_counter()
      answers = scoring.observe(self.environment, texts, self.config.timeout_s or None)
      counters = TurnCounters(steps=len(rows), errors=answers.errors, timeouts=answers.timeouts,
                              cut=int(answers.cut.sum()),
                              env_time_s=time.perf_counter() - started)
      for r, text, failed in zip(rows, answers.texts, answers.failed):
        if failed:
          status[r] = partial.ENV_FAILED
          continue
        if text is None:  # the environment ends the row
          status[r] = partial.ENV_ENDED
          continue
        try:
          ids = self.tokenizer.encode(text)
        except ValueError:  # text the policy's tokenizer cannot write: the step failed
          status[r] = partial.ENV_FAILED
          counters.errors += 1
          continue
        room = min(width, n - int(generated[r]))
        if len(ids) > room:
          ids = ids[:room]
          counters.cut += int(room == width)
        live[r] = True  # "" (not a call): the row resumes with nothing appended
        lengths[r] = len(ids)
        appended[r, :len(ids)] = ids
    pool = partial.append_observations(pool, jnp.asarray(appended), jnp.asarray(lengths),
                                       jnp.asarray(live), jnp.asarray(status))
    return pool, counters

  def tool_rows(self, generation: Generation, env_status: np.ndarray,
                counters: TurnCounters) -> Generation:
    """`generation` (a pool's rows in the plain layout, `partial.take`) with its environment
    tokens (completion slots of version -1) moved to context and `ToolRows` attached;
    env_status [B] is the taken rows' `RolloutPool.env_status`."""
    env = generation.completion_mask & (generation.version < 0)
    completion = generation.completion_mask & ~env
    tools = ToolRows(env_mask=env, calls=_answered_calls(env), failed=jnp.asarray(
        np.asarray(env_status) == partial.ENV_FAILED), steps=jnp.asarray(counters.steps),
        errors=jnp.asarray(counters.errors), timeouts=jnp.asarray(counters.timeouts),
        cut=jnp.asarray(counters.cut), env_time_s=jnp.asarray(counters.env_time_s, jnp.float32))
    return generation.replace(
        prompt_mask=generation.prompt_mask | env, completion_mask=completion,
        completion_len=completion.sum(axis=1).astype(jnp.int32), tools=tools)


def _answered_calls(env_mask):
  """[B] observations in each row: runs of environment tokens (NumPy or JAX arrays)."""
  xp = np if isinstance(env_mask, np.ndarray) else jnp
  starts = env_mask & ~xp.pad(env_mask, ((0, 0), (1, 0)))[:, :-1]
  return starts.sum(axis=1).astype(xp.int32)


def make_turns(settings: ToolSettings, tokenizer) -> Turns | None:
  """The environment `settings.name` names with its budgets, answering rows written with
  the policy's `tokenizer` (None without an environment)."""
  if not settings.name:
    return None
  return Turns(make_environment(settings.name), tokenizer, settings)
