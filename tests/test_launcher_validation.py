"""The launcher validates its whole config before any work (experiments/train.py `validate`),
reports unknown command-line fields with the valid ones (experiments/config_flag.py), and
says when it resumes."""

import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from experiments import config_flag
from experiments import train as train_launcher
from experiments.configs import default
from tests.launcher_config import default_run_config, refusal, tiny_run_config
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


@pytest.mark.parametrize("overrides,message", [
    # Token subsampling (NAT) keeps its estimator only for per-token terms that scale with
    # the advantage (tests/test_combinations.py checks the ones accepted).
    ({"loss.token_subsample": "urs", "loss.corrections": ("vcpo_baseline",)},
     r"'vcpo_baseline': it computes advantages of its own and discards NAT"),
    ({"loss.token_subsample": "rpc", "loss.corrections": ("vcpo_baseline",)},
     r"'vcpo_baseline': it computes advantages of its own"),
    ({"loss.token_subsample": "urs", "loss.name": "m2po"},
     r"'m2po': a token's term reads statistics of the whole batch"),
    ({"loss.token_subsample": "rpc", "loss.corrections": ("m2po",)}, r"'m2po'"),
    ({"loss.token_subsample": "urs", "loss.corrections": ("vcpo_ess",)}, r"'vcpo_ess'"),
    ({"loss.token_subsample": "rpc", "loss.name": "sat"}, r"'sat'"),
    ({"loss.token_subsample": "urs", "loss.name": "mu_grpo"},
     r"'mu_veto': a token's term reads the earlier tokens of its row.*token_subsample='rpc'"),
    ({"loss.token_subsample": "rpc", "loss.name": "gspo"}, r"config.loss.name = 'gspo'"),
    # Score centering: the sampled token's weight must be the one its expectation uses.
    ({"loss.name": "m2po", "loss.corrections": ("score_centering",)},
     r"'m2po' .* takes some tokens out of the update"),
    ({"loss.name": "gspo", "loss.corrections": ("score_centering",)},
     r"'gspo' weights the sampled token by a sequence's ratio"),
    # A correction twice, or on a loss that applies none.
    ({"loss.name": "decoupled", "loss.corrections": ("tis",)}, r"'tis' appears twice"),
    ({"loss.name": "sft", "loss.corrections": ("tis",)}, r"a loss function that applies no "
                                                         r"corrections"),
    # Advantages a correction or a rollout kind computes itself, over the estimator's.
    ({"loss.name": "vcpo", "advantage.name": "rloo"},
     r"config.advantage.name = 'rloo' with the correction 'vcpo_baseline'"),
    ({"rollout.kind": "tree", "advantage.name": "rloo"},
     r"config.advantage.name = 'rloo' has no effect with config.rollout.kind = 'tree'"),
    ({"rollout.kind": "tree", "loss.name": "vcpo"}, r"would discard the tree's"),
    # Settings of a kind that is not selected.
    ({"selection.pods.rollouts": 16}, r"config.selection.pods.rollouts = 16 has no effect "
                                      r"with config.selection.kind = 'uniform': it is read only "
                                      r"when config.selection.kind = 'pods'"),
    ({"selection.ar3po.stages": 3}, r"config.selection.ar3po.stages = 3 has no effect"),
    ({"selection.kind": "pods", "selection.ar3po.reuse": False},
     r"config.selection.ar3po.reuse = False has no effect with config.selection.kind = 'pods'"),
    ({"selection.greso.explore_prob": 0.3}, r"config.selection.greso.explore_prob"),
    ({"selection.adaptive.prompts": 2}, r"config.selection.adaptive.prompts"),
    ({"selection.max_attempts": 3}, r"config.selection.max_attempts = 3 has no effect .* "
                                    r"refills its batch"),
    ({"rollout.pruning.candidates": 8}, r"config.rollout.pruning.candidates = 8 has no "
                                        r"effect with config.rollout.kind = 'independent'"),
    ({"rollout.tree.rounds": 2}, r"config.rollout.tree.rounds = 2 has no effect"),
    ({"rollout.kind": "tree", "rollout.tree.segment_len": 4},
     r"config.rollout.tree.segment_len = 4 has no effect with config.rollout.tree.policy = "
     r"'entropy'"),
    ({"rollout.resume": "reprefill"}, r"config.rollout.resume = 'reprefill' has no effect"),
    ({"rollout.decode_window": 8}, r"config.rollout.decode_window = 8 has no effect"),
    ({"rollout.speculative.ngram": 2}, r"config.rollout.speculative.ngram = 2 has no effect "
                                       r"with config.rollout.speculative.tokens = 0"),
    ({"distill.objective": "k1"}, r"config.distill.objective = 'k1' has no effect"),
    ({"rl.max_staleness": 1}, r"config.rl.max_staleness = 1 has no effect with "
                              r"config.rl.async_ = False and config.rollout.kind = 'independent'"),
], ids=lambda value: None if isinstance(value, str) else ",".join(
    f"{k}={v}" for k, v in value.items()))
def test_combinations_that_would_not_compute_what_they_say_are_refused(tmp_path, overrides,
                                                                         message):
  """Each was accepted and then computed another estimator, or ignored a setting."""
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=message):
    train_launcher.run(tiny_run_config(workdir, overrides))
  assert not workdir.exists()


@pytest.mark.parametrize("overrides", [
    {"loss.token_subsample": "rpc", "loss.name": "mu_grpo"},  # the veto's trigger is kept
    {"loss.token_subsample": "urs", "loss.corrections": ("tis", "score_centering")},
    {"loss.name": "decoupled", "loss.corrections": ("score_centering",)},
    {"selection.kind": "pods", "selection.pods.rollouts": 16},
    {"rollout.kind": "tree", "rollout.tree.policy": "segments", "rollout.tree.segment_len": 4},
    {"selection.kind": "greso", "selection.max_attempts": 3, "task.train_pool": 64},
])
def test_combinations_next_to_the_refused_ones_validate(overrides):
  wiring.validate(tiny_run_config("unused", overrides))


def test_default_configs_validate():
  wiring.validate(default.get_config())
  wiring.validate(tiny_run_config("unused"))


@pytest.mark.parametrize("overrides", [
    {"rl.steps": 0, "rollout.temperature": 0.0},  # no RL rollouts: nothing samples at T = 0
    {"rl.async_": True, "rl.num_minibatches": 2, "rl.max_staleness": 0},  # synchronous
    {"rl.async_": True, "rl.num_minibatches": 2, "rl.max_staleness": 2},  # one batch ahead
    # sync partial pools may bound below U
    {"rl.num_minibatches": 2, "rl.max_staleness": 1, "rollout.kind": "partial"},
])
def test_settings_next_to_the_refused_ones_validate(overrides):
  wiring.validate(tiny_run_config("unused", overrides))


@pytest.mark.parametrize("overrides,message", [
    ({"loss.name": "foo"}, "Unknown loss 'foo' (config.loss.name); known: "),
    ({"selection.pods.rollouts": 16}, "config.selection.pods.rollouts = 16 has no effect with "
     "config.selection.kind = 'uniform'"),
    ({"task.name": "dataset", "task.path": "missing.jsonl", "task.difficulty": {},
      "task.prompt_style": "full"},
     "config.task.path = 'missing.jsonl': no such file"),
], ids=["unknown-name", "unread-setting", "missing-file"])
def test_a_refused_input_names_the_field_and_the_fix(tmp_path, overrides, message):
  assert refusal(default_run_config(tmp_path / "run", overrides)).startswith(message)


def test_a_refused_input_is_one_line_and_a_nonzero_exit(tmp_path, monkeypatch):
  """No traceback: `error: <message>` and status 2; ARBOR_TRACEBACK=1 re-raises the error
  (with its traceback) instead."""
  env = dict(os.environ, PYTHONPATH=_REPO, JAX_PLATFORMS="cpu")
  env.pop(config_flag.TRACEBACK_ENV, None)
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", f"--config.workdir={tmp_path / 'run'}",
       "--config.loss.name=foo"], cwd=_REPO, capture_output=True, text=True, timeout=300,
      env=env)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith("error: Unknown loss 'foo'")
  assert "Traceback" not in result.stderr
  monkeypatch.setenv(config_flag.TRACEBACK_ENV, "1")
  with pytest.raises(config_flag.InputError, match="Unknown loss 'foo'"):
    config_flag.exit_on_input_error(config_flag.InputError("Unknown loss 'foo'"))


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
  run = wiring.settings(config)
  _, model_config, _ = wiring.load_policy(run, jax.random.PRNGKey(0))
  _, optimizer = wiring.make_context(run, task, tokenizer, model_config, wiring.RL)
  params = {"w": jnp.zeros(3)}
  state = optimizer.init(params)
  sizes = []
  for _ in range(6):
    updates, state = optimizer.update({"w": jnp.ones(3)}, state, params)
    sizes.append(float(jnp.abs(updates["w"][0])))
  assert sizes == pytest.approx([0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2], rel=1e-4)
