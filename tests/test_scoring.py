"""Rewards never run, hang on or crash with what the policy writes (rl.tasks.countdown, rl.scoring).

The hostile completions are the issue's: code injection, `9**9**9`, `1e999999`,
`10**10000000`, a megabyte of digits, non-ASCII text, nothing at all.
"""

import builtins
import collections
import os
import random
import re
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import reasoning_gym
import sympy.parsing.sympy_parser

from models.tokenizer import CharTokenizer
from models import transformer
from rl.objectives import advantages
from rl.tasks import countdown
from rl import loop
from rl.rollouts import batches as rollout_lib
from rl import scoring
from rl import tasks
from rl import train
from rl.rollouts import producers
from sampling.sampler import SamplingConfig
from tests import scoring_tasks
from tests import tiny
from tests.rl_fixtures import GRPO

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def scorer():
  """A scoring worker of the test's own, stopped after it."""
  worker = scoring.Scorer()
  yield worker
  worker.close()


def hostile_completions(canary) -> list[str]:
  """What a policy with a subword tokenizer can write; `canary` is a path none may create."""
  return [
      f"__import__('os').system('echo PWNED > {canary}')",
      f"__import__('pathlib').Path('{canary}').touch()",
      f"1+__import__('os').system('touch {canary}')",
      f"exec(\"open('{canary}', 'w')\")",
      f"eval(\"__import__('os').system('touch {canary}')\")",
      "9**9**9", "1e999999", "10**10000000", "(9**9)**(9**9)", "2**2**2**2**2**2",
      "1" * 1_000_000, "9" * 5000, "1" + "+1" * 100_000, "(" * 10_000 + "1" + ")" * 10_000,
      "-" * 100_000 + "1", "1/0", "0/0", "nan", "inf", "-inf",
      "٣+٤", "²", "½", "\u200b1+1", "💥", "\x00", "\ud800",
      "", " ", "\n", "((((", "1,000,000", "lambda: 0",
  ]


def _prompt_style(name: str) -> str:
  """gsm_symbolic has full prompts only (a prompt style does not change scoring)."""
  return "full" if name == "gsm_symbolic" else "compact"


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_hostile_completions_are_scored_safely_and_quickly(name, tmp_path):
  canary = tmp_path / "PWNED"
  # running_sum's answers are its warm-start teacher's; with a perfect teacher they are the
  # reference solutions.
  perfect_teacher = {"teacher_carry_slip": 0.0} if name == "running_sum" else {}
  task = tasks.make_task(name, _prompt_style(name), eval_size=2, **perfect_teacher)
  examples = task.examples("eval", 2)
  hostile = hostile_completions(canary)
  rows = [(c, e) for e in examples for c in hostile + [e.answer]]
  start = time.perf_counter()
  scores = scoring.score(task, [c for c, _ in rows], [e for _, e in rows], timeout_s=2.0)
  elapsed = time.perf_counter() - start
  assert not canary.exists()
  assert np.all((scores.rewards >= 0) & (scores.rewards <= 1))
  # Built-in scorers need neither the time limit nor the error path on any of this ...
  assert scores.timeouts == 0 and scores.errors == 0
  # ... and the reference answers still score 1.
  assert scores.rewards[len(hostile)] == 1.0 and scores.rewards[-1] == 1.0
  assert scores.exact.tolist() == ([False] * len(hostile) + [True]) * 2
  # Seconds, worker start-up included (each call is bounded by the 2 s limit anyway).
  assert elapsed < 60, elapsed


class _Recorder:
  def __init__(self):
    self.calls = []

  def __call__(self, *args, **kwargs):
    self.calls.append(args[:1])
    raise RuntimeError("a scorer evaluated the completion")


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_no_builtin_scorer_evaluates_the_completion(name, tmp_path, monkeypatch):
  # In-process, with eval, exec and sympy's parse_expr replaced by recorders: the built-in
  # scorers must not call them at all (the worker is a second line of defence, not the first).
  task = tasks.make_task(name, _prompt_style(name), eval_size=1)
  example = task.examples("eval", 1)[0]  # (basic_arithmetic's generator evals its own text)
  # Scored once before the recorders go in: a scorer's first use may import modules
  # (math-verify's grammar), and an import runs the module's code through builtins.exec.
  task.reward(example.answer, example)
  recorder = _Recorder()
  for module, attribute in [(builtins, "eval"), (builtins, "exec"),
                            (sympy.parsing.sympy_parser, "parse_expr"),
                            (reasoning_gym.games.countdown, "parse_expr")]:
    monkeypatch.setattr(module, attribute, recorder)
  for completion in hostile_completions(tmp_path / "PWNED") + [example.answer]:
    assert 0.0 <= task.reward(completion, example) <= 1.0
  monkeypatch.undo()
  assert recorder.calls == []


def test_countdown_grammar_and_exact_arithmetic():
  value, used = countdown.evaluate(" (6 / 4) * 4 - -2 ")
  assert value == 8 and used == [6, 4, 4, 2]
  assert countdown.evaluate("1/3+1/3+1/3")[0] == 1  # exact: no 0.999...
  for bad in ["", "1+", "(1", "1)", "1 2", "2**3", "1.5", "1e3", "0x10", "01", "a", "1//2",
              "1/0", "1/(2-2)", "-" * 40 + "1", "(" * 40 + "1" + ")" * 40,
              "1" * (countdown.MAX_DIGITS + 1), "1+" * 200 + "1",
              "*".join(["999999999999"] * 30)]:
    with pytest.raises(countdown.ExpressionError):
      countdown.evaluate(bad)


def test_countdown_reward_needs_every_number_once_and_the_target():
  numbers, target = [67, 50, 20, 82], 119
  assert countdown.score("82+20+67-50", numbers, target) == countdown.CORRECT
  assert countdown.score(" (82 + 20) + (67 - 50) ", numbers, target) == countdown.CORRECT
  assert countdown.score("82+20+67-50", numbers, target - 1) == countdown.WELL_FORMED  # value
  assert countdown.score("82+20+67-50+0", numbers, target) == countdown.WELL_FORMED  # extra 0
  assert countdown.score("82+20+17", numbers, target) == countdown.WELL_FORMED  # numbers
  assert countdown.score("82+82-50+5", numbers, target) == countdown.WELL_FORMED  # 82 twice
  assert countdown.score("82+20+67-50=119", numbers, target) == countdown.MALFORMED
  assert countdown.score("", numbers, target) == countdown.MALFORMED
  assert countdown.score("50*(82-67)/20*4", [50, 82, 67, 20, 4], 150) == countdown.CORRECT


def test_countdown_reward_matches_reasoning_gym_on_ordinary_expressions():
  # The scale is reasoning-gym's: on expressions sympy reads as arithmetic (no '**', '//',
  # leading zeros; those it executes or reads differently), the two scorers agree.
  task = tasks.make_task("countdown", eval_size=2)
  reference = reasoning_gym.create_dataset("countdown", size=1, seed=0)
  rng = random.Random(0)
  compared = collections.Counter()
  for example in task.examples("train", 40):
    answer = example.answer
    candidates = [answer, answer[::-1], answer.replace("+", "-", 1), f"({answer})",
                  f"-{answer}", f"{answer}*1", f"{answer}/1", answer.replace("+", " + ")]
    candidates += ["".join(rng.choice("0123456789+-*/() ") for _ in range(rng.randint(1, 12)))
                   for _ in range(25)]
    for text in candidates:
      if re.search(r"\*\s*\*|/\s*/|\b0\d", text):
        continue
      ours = countdown.reward(text, example.entry)
      assert ours == reference.score_answer(text, example.entry), text
      compared[ours] += 1
  assert set(compared) == {countdown.CORRECT, countdown.WELL_FORMED, countdown.MALFORMED}


def test_misbehaving_scorers_give_zero_and_are_counted():
  task = scoring_tasks.MisbehavingTask()
  first, second = ("prompt", 1), ("prompt", 2)
  rows = [("ab", first), ("SLEEP", first), ("abc", first), ("SPIN", first), ("POW", first),
          ("RAISE", first), ("NAN", first), ("EXIT", first), ("TEXT", first),
          ("abcd", second), ("SLEEP", first), ("SLEEP", second), ("a" * 20, second)]
  start = time.perf_counter()
  scores = scoring.score(task, [c for c, _ in rows], [e for _, e in rows], timeout_s=0.5)
  elapsed = time.perf_counter() - start
  np.testing.assert_allclose(scores.rewards, [0.2, 0, 0.3, 0, 0, 0, 0, 0, 0, 0.4, 0, 0, 1.0])
  np.testing.assert_array_equal(scores.exact, [False] * 12 + [True])  # exact: reward >= 1
  # SLEEP (twice for the same example: scored once), SLEEP for another example, SPIN, POW.
  assert scores.timeouts == 5
  assert scores.errors == 4  # RAISE, NAN, EXIT, TEXT
  assert elapsed < 30, elapsed
  # The worker that replaced the killed ones keeps scoring.
  again = scoring.score(task, ["abcde"], [first], timeout_s=0.5)
  assert again.rewards.tolist() == [0.5] and again.timeouts == again.errors == 0


def test_a_scorer_that_allocates_without_bound_is_stopped_and_counted(scorer):
  # HOARD allocates 256 MiB at a time until something stops it (untouched: address space,
  # not RAM); without a memory limit it reaches 64 GiB and scores 1. The worker's limit
  # (DEFAULT_LIMITS, 4 GiB over its start-up size) makes it a MemoryError: reward 0, an
  # error, the rest of the batch scored, and a fresh worker for the next batch.
  task, example = scoring_tasks.MisbehavingTask(), ("prompt", 1)
  assert scorer.score(task, ["ab"], [example]).rewards.tolist() == [pytest.approx(0.2)]
  pid = scorer._process.pid  # pylint: disable=protected-access
  scores = scorer.score(task, ["HOARD", "abc"], [example] * 2)
  assert scores.rewards.tolist() == [0.0, pytest.approx(0.3)]
  assert scores.errors == 1 and scores.timeouts == 0
  again = scorer.score(task, ["abcd"], [example])
  assert again.rewards.tolist() == [pytest.approx(0.4)] and again.errors == 0
  assert scorer._process.pid != pid  # pylint: disable=protected-access


def test_a_crafted_reply_is_counted_and_never_run(tmp_path, scorer):
  # A scorer tricked into running code can write into the worker's reply channel. Here it
  # writes a pickle that would create a marker file when loaded, framed as multiprocessing
  # frames a message (4-byte length) and as rl.scoring does (8-byte length). The trainer
  # reads replies as fixed records of numbers: the marker never appears, the completion that
  # wrote each is an error (exactly that one), and the others are scored.
  markers = [tmp_path / "unpickled-i", tmp_path / "unpickled-Q"]
  completions = ["ab", f"REPLY i {markers[0]}", "abc", f"REPLY Q {markers[1]}", "abcd"]
  scores = scorer.score(scoring_tasks.MisbehavingTask(), completions,
                        [("prompt", 1)] * len(completions))
  assert not any(marker.exists() for marker in markers)
  np.testing.assert_allclose(scores.rewards, [0.2, 0, 0.3, 0, 0.4])
  assert scores.errors == 2 and scores.timeouts == 0


def test_a_scorer_that_spins_is_ended_by_its_cpu_time_limit(scorer):
  # The trainer's wall-clock watch is 60 s here; the worker's own CPU-time limit (1 s per
  # completion, RLIMIT_CPU) ends SPIN first, which holds even when the trainer is not
  # watching (stalled, or stopped in a debugger). A CPU-time limit is a time limit: a timeout.
  task, example = scoring_tasks.MisbehavingTask(), ("prompt", 1)
  start = time.perf_counter()
  scores = scorer.score(task, ["SPIN", "ab"], [example] * 2, timeout_s=60.0,
                        limits=scoring.Limits(cpu_s=1.0))
  assert time.perf_counter() - start < 30
  assert scores.rewards.tolist() == [0.0, pytest.approx(0.2)]
  assert scores.timeouts == 1 and scores.errors == 0


def test_a_scorer_writes_in_a_scratch_directory_under_a_file_size_limit(tmp_path, monkeypatch,
                                                                        scorer):
  # WRITE leaves a file in its working directory and reports which one that was; BIGFILE
  # writes past 2 GiB (over the 1 GiB default limit: an error, not a file). Neither lands in
  # the trainer's working directory, and the scratch directory goes with the worker.
  trainer_cwd, report = tmp_path / "trainer", tmp_path / "report"
  trainer_cwd.mkdir()
  monkeypatch.chdir(trainer_cwd)
  scores = scorer.score(scoring_tasks.MisbehavingTask(), ["WRITE", "BIGFILE", "ab"],
                        [str(report)] * 3)
  scratch = report.read_text()
  assert os.path.exists(os.path.join(scratch, "scorer-output"))
  scorer.close()
  np.testing.assert_allclose(scores.rewards, [1, 0, 0.2])
  assert scores.errors == 1 and scores.timeouts == 0
  assert list(trainer_cwd.iterdir()) == []
  assert scratch != str(trainer_cwd) and not os.path.exists(scratch)


def test_slow_scorer_leaves_no_stale_message_for_the_next_request(scorer):
  # Each result goes back on its own. When the worker sent results in 10 ms chunks, it once
  # sent an empty message after the last one, which then answered the next request (a task
  # load: IndexError) in place of its own reply.
  for seconds in (0.02, 0.03, 0.02):  # three tasks: a load, then a batch, each time
    task = scoring_tasks.SlowTask(seconds=seconds)
    scores = scorer.score(task, ["a", "b", "c"], [None] * 3)
    assert scores.rewards.tolist() == [1.0] * 3 and scores.errors == scores.timeouts == 0


def test_tasks_use_their_exact_match_and_time_limit(scorer):
  class Limit(scoring_tasks.MisbehavingTask):
    pass

  with pytest.raises(ValueError, match="module level"):  # a local class does not pickle
    scorer.score(Limit(), ["a"], [None])
  task = tasks.make_task("chain_sum", eval_size=2)
  example = task.examples("eval", 1)[0]
  scores = scoring.score(task, [example.answer, "+0" + example.answer], [example, example])
  assert scores.exact.tolist() == [True, task.exact_match("+0" + example.answer, example)]


def _registered_reward(answer, entry):
  return 0.25 if answer == entry["answer"] else 0.0


def _registered_key(entry):
  return tuple(sorted(entry["metadata"]["numbers"]))


def _registered_prompt(entry):
  return "lcm(" + ",".join(map(str, entry["metadata"]["numbers"])) + ")="


def test_registered_task_is_rebuilt_in_the_worker():
  tasks.register_task("lcm", key=_registered_key, compact_prompt=_registered_prompt,
                      compact_answer=tasks.gym.reference_answer,
                      default_eval_size=4, reward=_registered_reward)
  try:
    task = tasks.make_task("lcm", max_value=20)
    example = task.examples("eval", 1)[0]
    scores = scoring.score(task, [example.answer, "1"], [example, example])
    assert scores.rewards.tolist() == [0.25, 0.0] and scores.errors == 0
  finally:
    tasks.TASKS.unregister("lcm")


@pytest.mark.slow
def test_grpo_step_goes_on_when_a_completion_hangs_its_scorer(monkeypatch):
  # The policy "writes" 9**9**9 in row 1 (decoded text replaced); the task's scorer would
  # compute it forever. The step finishes, row 1 scores 0, and the timeout is counted.
  tokenizer = CharTokenizer()
  model_config = tiny.model(vocab_size=tokenizer.vocab_size, max_seq_len=16)
  optimizer = train.make_optimizer(1e-3)
  ctx = loop.LoopContext(
      batch=producers.BatchContext(
          task=scoring_tasks.DigitsUnlessTower(), tokenizer=tokenizer,
          model_config=model_config,
          sampling_config=SamplingConfig(max_new_tokens=4, temperature=1.0,
                                         stop_tokens=(tokenizer.eos_id,)),
          prompt_len=3, prompts_per_step=2, group_size=4),
      train_step=train.make_train_step(model_config, optimizer, GRPO),
      stages=advantages.advantage_stage(advantages.group_relative(advantages.grpo_advantages)))
  decode, sample_and_score = rollout_lib.decode_completions, rollout_lib.sample_and_score
  scored = []

  def hostile_decode(*args):
    texts = decode(*args)
    texts[1] = scoring_tasks.HANG_MARKER
    return texts

  def recorded_sample_and_score(*args, **kwargs):
    scored.append(sample_and_score(*args, **kwargs))
    return scored[-1]

  monkeypatch.setattr(rollout_lib, "decode_completions", hostile_decode)
  monkeypatch.setattr(rollout_lib, "sample_and_score", recorded_sample_and_score)
  params = transformer.init_params(model_config, jax.random.PRNGKey(0))
  producer = producers.independent(ctx.batch)
  state = loop.LoopState(train=train.init_train_state(params, optimizer), rng=jax.random.PRNGKey(1),
                         producer=producer.init(0))
  state, metrics = loop.grpo_iteration(state, ctx, producer)
  assert metrics["reward_timeouts"] == 1 and metrics["reward_errors"] == 0
  assert np.isfinite(metrics["loss"]) and int(state.train.step) == 1
  (samples,) = scored
  assert samples.completions[1] == scoring_tasks.HANG_MARKER
  assert float(samples.rollout.reward[1]) == 0.0
  assert samples.reward_timeouts == 1 and samples.reward_errors == 0


def test_worker_started_by_a_thread_outlives_the_thread(scorer):
  # The async loop's producer thread may score first and end; the worker (which the kernel
  # kills when the thread that started it ends) must stay for the next caller.
  task, first = scoring_tasks.MisbehavingTask(), ("prompt", 1)
  thread = threading.Thread(target=scorer.score, args=(task, ["ab"], [first]))
  thread.start()
  thread.join()
  pid = scorer._process.pid  # pylint: disable=protected-access
  time.sleep(0.5)
  scores = scorer.score(task, ["abc"], [first])
  assert scores.rewards.tolist() == [pytest.approx(0.3)] and scores.errors == 0
  assert scorer._process.pid == pid  # pylint: disable=protected-access


_MAIN_MODULE = '''
from rl import scoring

class LengthTask:
  name = "length"

  def reward(self, completion, example):
    return len(completion) / 10

if __name__ == "__main__":
  print(scoring.score(LengthTask(), ["abc", "abcdefghij"], [None, None]).rewards.tolist())
'''


def test_task_defined_in_the_main_module(tmp_path):
  # `python -m module`: the worker imports the module by name. `python script.py`: a clear
  # error before anything is sent, since the worker cannot import a script.
  (tmp_path / "length_task.py").write_text(_MAIN_MODULE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([_REPO, str(tmp_path)]))
  run = lambda *args: subprocess.run([sys.executable, *args], cwd=tmp_path, env=env,
                                     capture_output=True, text=True, timeout=300)
  result = run("-m", "length_task")
  assert result.returncode == 0 and result.stdout.strip() == "[0.30000001192092896, 1.0]"
  result = run("length_task.py")
  assert result.returncode == 1
  assert "LengthTask is defined in the main script" in result.stderr
