"""The launcher validates its whole config before any work (experiments/train.py `validate`),
reports unknown command-line fields with the valid ones (experiments/config_flag.py), and
says when it resumes."""

import json
import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from experiments import config_flag
from experiments import train as train_launcher
from experiments.configs import default
from tests.launcher_config import tiny_run_config
from rl import wiring

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("overrides,message", [
    # The cases: each trained (on empty batches, with zero loss) or failed late.
    ({"rollout.prompts_per_step": 0}, r"config.rollout.prompts_per_step = 0 must be >= 1"),
    ({"warm_start.batch_size": 0}, r"config.warm_start.batch_size = 0 must be >= 1"),
    ({"rollout.group_size": -4}, r"config.rollout.group_size = -4 must be >= 1"),
    ({"rollout.prompt_len": -1}, r"config.rollout.prompt_len = -1 must be >= 1"),
    ({"rollout.max_new_tokens": 0}, r"config.rollout.max_new_tokens = 0 must be >= 1"),
    ({"eval.batch_size": 0}, r"config.eval.batch_size = 0 must be >= 1"),
    ({"task.eval_size": 0}, r"config.task.eval_size = 0 must be >= 1"),
    ({"rl.num_microbatches": 0}, r"config.rl.num_microbatches = 0 must be >= 1"),
    ({"checkpoint.max_to_keep": 0}, r"config.checkpoint.max_to_keep = 0 must be >= 1"),
    ({"metrics.eval_samples": -1}, r"config.metrics.eval_samples = -1 must be >= 0"),
    ({"metrics.train_samples_every": -10},
     r"config.metrics.train_samples_every = -10 must be >= 0"),
    ({"rl.learning_rate": 0.0}, r"config.rl.learning_rate = 0.0 must be > 0"),
    ({"rollout.top_p": 1.5}, r"config.rollout.top_p = 1.5 must be > 0 and <= 1.0"),
    ({"loss.m2_tau": -0.04}, r"config.loss.m2_tau = -0.04 must be > 0"),
    ({"loss.mu_eps_high": -0.5}, r"config.loss.mu_eps_high = -0.5 must be >= 0"),
    ({"loss.aggregation": "nosuch"}, r"config.loss.aggregation = 'nosuch'; use one of 'token_mean'"),
    ({"loss.name": "nosuch"}, r"Unknown loss 'nosuch' \(config.loss.name\)"),
    ({"loss.corrections": ("m2po", "nosuch")}, r"Unknown correction 'nosuch'"),
    ({"loss.prox_estimate": "nosuch"}, r"config.loss.prox_estimate = 'nosuch'; use one of 'recompute', 'loglinear'"),
    ({"advantage.name": "nosuch"}, r"Unknown advantage estimator 'nosuch'"),
    ({"rollout.kind": "tree", "rollout.tree.advantage": "nosuch"},
     r"Unknown tree advantage estimator 'nosuch'"),
    ({"task.name": "nosuch"}, r"Unknown task 'nosuch' \(config.task.name\)"),
    ({"task.prompt_style": "terse"}, r"config.task.prompt_style = 'terse'"),
    ({"model.preset": "huge"}, r"Unknown config.model.preset 'huge'"),
    ({"model.dtype": "float16"}, r"config.model.dtype = 'float16'"),
    ({"loss.kl_coef": 0.1}, r"config.loss.kl_coef = 0.1: the launcher has no reference"),
    ({"model.tokenizer": "tok.json"}, r"config.model.tokenizer = 'tok.json' is the tokenizer "
                                      r"of a pretrained checkpoint; set config.model.checkpoint"),
    # Issue #31: G identical greedy completions give zero advantages, so RL never learns.
    ({"rollout.temperature": 0.0}, r"config.rollout.temperature = 0.0 is greedy decoding.*"
                                   r"Set config.rollout.temperature > 0"),
    # One batch is 2 updates, so a batch sampled one batch ahead is 2 updates stale: a bound
    # of 1 admits no overlap (the async loop would silently run synchronously).
    ({"rl.async_": True, "rl.num_minibatches": 2, "rl.max_staleness": 1},
     r"config.rl.max_staleness = 1 .*num_minibatches \* ppo_epochs = 2"),
    ({"rl.async_": True, "rl.ppo_epochs": 3, "rl.max_staleness": 2},
     r"config.rl.max_staleness = 2 .*num_minibatches \* ppo_epochs = 3"),
    # Simulated staleness counts optimiser updates too; parameters change once per batch.
    ({"rl.staleness": 3, "rl.num_minibatches": 2},
     r"config.rl.staleness = 3 counts optimiser updates.*multiple of 2"),
])
def test_bad_config_fails_before_any_work(tmp_path, overrides, message):
  workdir = tmp_path / "run"
  config = tiny_run_config(workdir, overrides)
  with pytest.raises(ValueError, match=message):
    train_launcher.run(config)
  assert not workdir.exists()  # nothing written: no model loaded, no step taken


def test_default_configs_validate():
  wiring.validate(default.get_config())
  wiring.validate(tiny_run_config("unused"))


@pytest.mark.parametrize("overrides", [
    {"rl.steps": 0, "rollout.temperature": 0.0},  # no RL rollouts: nothing samples at T = 0
    {"rl.async_": True, "rl.num_minibatches": 2, "rl.max_staleness": 0},  # synchronous
    {"rl.async_": True, "rl.num_minibatches": 2, "rl.max_staleness": 2},  # one batch ahead
    {"rl.num_minibatches": 2, "rl.max_staleness": 1},  # sync partial pools may bound below U
])
def test_settings_next_to_the_refused_ones_validate(overrides):
  wiring.validate(tiny_run_config("unused", overrides))


def test_unknown_field_lists_the_valid_ones():
  config = default.get_config()
  assert config_flag.unknown_field(config, "rl.steps") is None
  message = config_flag.unknown_field(config, "rl.stepz")
  assert message.startswith("--config.rl.stepz: config.rl has no field 'stepz'; valid fields: ")
  assert "steps" in message and "learning_rate" in message
  assert "config has no field 'nosuch'" in config_flag.unknown_field(config, "nosuch.x")
  assert "config.task.difficulty has no field 'max_digits'" in config_flag.unknown_field(
      config, "task.difficulty.max_digits")
  assert config_flag.unknown_field(ml_collections.ConfigDict({"a": (1, 2)}), "a.0") is None


@pytest.mark.parametrize("argv", [["--config.rl.stepz=5"],
                                  ["--config=experiments/configs/default.py",
                                   "--config.loss.nosuch=1"]])
def test_unknown_command_line_field_is_a_flag_error(argv):
  # ml_collections raised a bare AttributeError (at import, with the default config file).
  result = subprocess.run([sys.executable, "-m", "experiments.train", *argv], cwd=_REPO,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=_REPO, JAX_PLATFORMS="cpu"))
  assert result.returncode == 1
  assert "Traceback" not in result.stderr
  field = argv[-1].split("=")[0][len("--config."):]
  section, name = field.split(".")
  assert (f"FATAL Flags parsing error: --config.{field}: config.{section} has no field "
          f"{name!r}; valid fields: ") in result.stderr


def test_scoring_counters_reach_metrics_and_resume_is_announced(tmp_path, capsys):
  config = tiny_run_config(tmp_path, {"warm_start.steps": 1, "rl.steps": 1})
  train_launcher.run(config)
  assert "Resumed" not in capsys.readouterr().out
  (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")
               if '"phase": "rl"' in line and '"loss"' in line]
  assert record["reward_timeouts"] == 0 and record["reward_errors"] == 0
  summary = train_launcher.run(config)  # nothing left to do: restores and says so
  assert f"Resumed from step 2 (rl phase) in {tmp_path}." in capsys.readouterr().out
  assert summary["steps"] == 2


def test_rl_warmup_steps_reach_the_rl_optimizer():
  """--config.rl.warmup_steps=W: the RL learning rate rises linearly from 0 over W
  optimiser updates, then stays at rl.learning_rate (with a constant gradient every Adam
  update has the size of its step's learning rate)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from models.tokenizer import CharTokenizer  # pylint: disable=import-outside-toplevel
  from rl.tasks import make_task  # pylint: disable=import-outside-toplevel
  config = default.get_config()
  config.rl.learning_rate, config.rl.warmup_steps, config.rl.max_grad_norm = 1e-2, 4, 0.0
  tokenizer = CharTokenizer()
  task = make_task(config.task.name, eval_size=4, **config.task.difficulty)
  _, model_config, _ = wiring.load_policy(config, jax.random.PRNGKey(0))
  _, optimizer = wiring.make_context(config, task, tokenizer, model_config, wiring.RL)
  params = {"w": jnp.zeros(3)}
  state = optimizer.init(params)
  sizes = []
  for _ in range(6):
    updates, state = optimizer.update({"w": jnp.ones(3)}, state, params)
    sizes.append(float(jnp.abs(updates["w"][0])))
  assert sizes == pytest.approx([0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2], rel=1e-4)
