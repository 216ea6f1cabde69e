"""Every combination of the RL phase's switches, through the launcher (experiments.train.run):

    rollout.kind x selection.kind x rl.async_ x rl.staleness x mesh.data
    {independent, tree, partial, pruned} x {uniform, dynamic, greso, adaptive, pods, ar3po}
    x {False, True}
    x {0, 2} x {one device, data=2 x fsdp=4 on the 8 virtual CPU devices}

either runs two GRPO steps with its effect visible in metrics.jsonl, or is refused before
any training by `validate` with an error naming the fields. The table in
docs/configuration.md is this test's expectation.

The policy is untrained (no warm start) and the reward is built so that every effect is
there by construction, whatever the seed: on the reasoning-gym gcd questions, a question at
an even train position (reasoning-gym's `source_index`) always scores 0, and one at an odd
position scores a pseudo-random number of the answer text (its CRC-32 / 2**32), so two
different answers score differently. Every two consecutive positions (a step's 2 prompts,
GRESO's pool of 2) hold an all-equal group for GRESO to skip and for adaptive allocation to
starve, and a group that is mixed unless the untrained policy wrote the same answer in
every row (its 3-character answers rarely repeat: the commonest, '===', was 6% of 272 in a
probe), for dynamic sampling to keep and for adaptive allocation to feed. Async cells also
check that a batch was trained on parameters older than its step (see `_check_effect`).
"""

import itertools
import json
import os
import zlib

import jax
import numpy as np
import pytest

from experiments import train as launcher
from rl import tasks
from rl import verdicts
from tests.launcher_config import rl_steps, tiny_run_config
from rl import wiring

KINDS = ("independent", "tree", "partial", "pruned")
SELECTIONS = ("uniform", "dynamic", "greso", "adaptive", "pods", "ar3po")
STALENESS = 2
COMBOS = list(itertools.product(KINDS, SELECTIONS, (False, True), (0, STALENESS)))
# The quick tier's combinations: each rollout kind, selection rule, async and staleness
# value at least once, each on one device and on the mesh where it runs there, except the
# selection rules of ONE_DEVICE_IN_QUICK: host-side choices of prompts and group sizes that
# the mesh does not touch, whose mesh runs are the slow tier's with the rest.
QUICK = {("independent", "uniform", False, 0), ("tree", "uniform", False, STALENESS),
         ("partial", "uniform", True, 0), ("independent", "dynamic", False, STALENESS),
         ("independent", "greso", True, 0), ("independent", "adaptive", False, 0),
         ("independent", "pods", False, 0), ("independent", "ar3po", False, 0),
         ("pruned", "uniform", False, 0)}
ONE_DEVICE_IN_QUICK = {("independent", selection, False, 0)
                       for selection in ("adaptive", "pods", "ar3po")}


def _matrix():
  """(kind, selection, async_, staleness, data values) parameters, marked by tier."""
  for combo in COMBOS:
    name = "-".join(map(str, combo))
    if combo in ONE_DEVICE_IN_QUICK:
      yield pytest.param(*combo, (1,), id=f"{name}-one-device")
      yield pytest.param(*combo, (1, 2), marks=pytest.mark.slow, id=name)
    else:
      yield pytest.param(*combo, (1, 2), marks=() if combo in QUICK else pytest.mark.slow,
                         id=name)


def index_reward(answer, entry):
  """0 at even train positions; elsewhere a score in [0, 1) that differs between answers."""
  if entry["metadata"]["source_index"] % 2 == 0:  # train position p is reasoning-gym's item p
    return 0.0
  return zlib.crc32(answer.encode()) / 2**32


def _gcd_key(entry):
  return tuple(entry["metadata"]["numbers"])


def _gcd_prompt(entry):
  return "gcd(" + ",".join(map(str, entry["metadata"]["numbers"])) + ")="


@pytest.fixture(scope="module", autouse=True)
def gcd_task():
  tasks.register_task("gcd", key=_gcd_key, compact_prompt=_gcd_prompt,
                      compact_answer=tasks.gym.reference_answer,
                      default_eval_size=4, reward=index_reward)
  yield
  tasks.TASKS.unregister("gcd")


def refusal(kind, selection, async_, staleness, data) -> str | None:
  """What the launcher's error names for a combination it refuses; None when it runs."""
  if kind != "independent" and selection != "uniform":
    return "config.selection.kind"
  if async_ and staleness:
    return "config.rl.staleness"
  if kind != "independent" and data > 1:
    return "decodes on one device"
  return None


def _config(workdir, kind, selection, async_, staleness, data):
  c = tiny_run_config(workdir, {
      "task.name": "gcd", "task.eval_size": 2, "eval.batch_size": 8, "warm_start.steps": 0,
      "warm_start.batch_size": 8, "rollout.prompt_len": 16, "rollout.max_new_tokens": 3,
      "rollout.kind": kind, "selection.kind": selection, "rl.async_": async_,
      "rl.staleness": staleness, "rollout.group_size": 4, "metrics.train_samples_every": 1,
      "mesh.data": data, "mesh.fsdp": 1 if data == 1 else -1})  # data=2 x fsdp=4: 8 devices
  c.task.difficulty = {"max_value": 100}
  if kind == "tree":
    c.rollout.tree.update(init_chains=2, fork_points=1, branches=2, rounds=1)  # 4 leaves
  if kind == "pruned":
    c.rollout.pruning.update(candidates=6, prefix_tokens=1)  # 6 started, 4 kept after 1 token
  if selection in ("dynamic", "greso"):  # the rules that refill their batch
    c.selection.max_attempts = 30
  if selection == "greso":  # a pool of 2 prompts seen every round: position 0's all-zero
    # group makes it skipped with probability 0.99 each time it comes up again, at least
    # twice in the two steps (step 1 needs a second round for its second informative group)
    c.task.train_pool = 2
    c.selection.greso.update(explore_prob=0.01, min_keep_prob=0.01, adapt_step=0.0)
  if selection == "adaptive":  # pilots of 2: the all-zero prompt's std is 0, so the other
    # (mixed) prompt gets the 4 further rollouts, up to its cap of 6
    c.selection.adaptive.update(initial_rollouts=2, max_rollouts=6)
  if selection == "pods":  # 6 rollouts per prompt, the 4 of largest reward variance kept
    c.selection.pods.rollouts = 6
  if selection == "ar3po":  # stages of 2; a pool of 2 prompts, so both recur each step
    c.task.train_pool = 2
  return c



def _check_effect(records, kind, selection, async_, staleness):
  """The switches' effects in the two RL steps' metrics."""
  assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
  if kind == "tree":
    assert all(r["leaves"] >= 2 * 2 and r["decoded_tokens_per_leaf"] > 0 for r in records)
  if kind == "pruned":  # 2 prompts x 6 started, 2 x 4 decoded to the end and trained
    assert all(r["rollouts"] == 2 * 6 and r["pruned_rows"] == 2 * 2 for r in records)
  if kind == "partial":  # the pool holds 4 groups, a batch takes 2: 2 carry over each step
    assert all(r["groups_finished"] >= 2 and r["groups_in_flight"] > 0 for r in records)
  if selection == "uniform":
    assert all(r.get("prompts_skipped", 0) == 0 for r in records)
  if selection == "dynamic":  # only informative groups are trained on
    assert all(r["batch_informative_groups"] == 1.0 for r in records)
  if selection == "greso":  # the all-zero prompt at position 0 is skipped when it recurs
    assert sum(r["prompts_skipped"] for r in records) > 0
  if selection == "adaptive":  # the budget goes unevenly: the mixed prompt gets more than 4 rows
    assert all(r["rollouts"] == 2 * 4 for r in records)
    assert max(r["max_group_size"] for r in records) > 4
  if selection == "pods":  # 2 prompts x 6 rolled out; a group with any spread keeps some
    assert all(r["rollouts"] == 2 * 6 for r in records)
    assert all(r["batch_informative_groups"] == r["informative_groups"] for r in records)
  if selection == "ar3po":  # every batch keeps 2 x 4 rows, sampled or padding; the
    # untrained policy rarely answers exactly (index_reward's odd-position scores are
    # partial credit), and a step with no exact answer samples both stages for both
    # prompts, stores nothing and so reuses nothing in the next
    assert all(r["rollouts"] - r["stage_padding_rows"] + r["padding_rows"] == 2 * 4
               for r in records)
    unsolved = [r for r in records if r["exact_match"] == 0]
    assert unsolved and all(r["rollout_rounds"] == 2 and r["rollouts"] == 2 * 4
                            for r in unsolved)
    assert records[0]["reused_responses"] == 0
  simulated = [min(t, staleness) for t in range(2)]  # iteration t samples max(t - k, 0)
  if async_:
    # Structural, not thread-timing luck: rl.max_staleness = 4 lets the producer run 4
    # batches (of 1 update) ahead, so it reads the newest published parameters for batch 1
    # right after queueing batch 0, microseconds later, while the trainer publishes new
    # ones only once its first train step (traced, compiled, run: seconds) has finished.
    # Batch 1 is sampled with the initial parameters and trained at step 1: one update stale.
    assert all("sampled_version" in r and r["staleness"] <= 4 for r in records)
    assert records[1]["sampled_version"] == records[0]["sampled_version"], records
    assert records[1]["staleness"] >= 1, records
  elif kind == "partial":  # rows carried over from step 1 add their own staleness
    assert all(simulated[t] <= r["staleness"] <= 4 for t, r in enumerate(records))
  else:
    assert [r["staleness"] for r in records] == simulated


def _check_train_samples(workdir, records):
  """Every RL step wrote its training samples (metrics.train_samples_every = 1), whatever
  made its batch: trained rows (tokens, a group), each with its prompt and a category."""
  for record in records:
    with open(os.path.join(workdir, "samples", f"train_{record['step']}.jsonl")) as f:
      written = [json.loads(line) for line in f]
    assert 1 <= len(written) <= 4
    assert [s["step"] for s in written] == [record["step"]] * len(written)
    assert all(s["prompt"].startswith("gcd(") and s["category"] in verdicts.CATEGORIES
               and s["length"] > 0 for s in written), written


@pytest.mark.parametrize("kind,selection,async_,staleness,datas", list(_matrix()))
def test_switches_compose_or_are_refused(tmp_path, kind, selection, async_, staleness, datas):
  if jax.device_count() != 8:
    pytest.fail("Needs the 8 virtual CPU devices tests/conftest.py configures.")
  first_loss = {}
  for data in datas:
    workdir = str(tmp_path / f"data{data}")
    config = _config(workdir, kind, selection, async_, staleness, data)
    refused = refusal(kind, selection, async_, staleness, data)
    if refused is not None:
      with pytest.raises(ValueError, match=refused):
        wiring.validate(config)
      continue
    summary = launcher.run(config)
    # No warm start: the launcher reports its first evaluation as the initial policy's.
    assert launcher.report(config, summary)[0].startswith("Initial held-out accuracy:")
    records = rl_steps(workdir)
    _check_effect(records, kind, selection, async_, staleness)
    _check_train_samples(workdir, records)
    first_loss[data] = records[0]["loss"]
  if len(first_loss) == 2:  # the sharded run trains on the same first batch
    np.testing.assert_allclose(first_loss[2], first_loss[1], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_async_with_minibatches_counts_versions_in_optimiser_updates(tmp_path):
  """The async x minibatch cell: rl.num_minibatches = 2 makes each batch 2 optimiser
  updates, so with rl.max_staleness = 2 the producer samples one batch ahead. Versions and
  staleness count updates, as in the sync loop: batch t trains at TrainState.step 2t, its
  tokens carry the (even) step of the parameters that sampled it, and a batch sampled a
  batch ahead is 2 updates stale. (The producer learns the 2 from batch 0, so batch 1
  waits for it; batch 2 is sampled while batch 1 trains.)"""
  config = _config(str(tmp_path), "independent", "uniform", True, 0, 1)
  config.rl.update(num_minibatches=2, max_staleness=2, steps=3)
  config.eval.every = config.checkpoint.every = 3  # one run_async call over all 3 steps
  launcher.run(config)
  records = rl_steps(str(tmp_path))
  assert len(records) == 3 and all(r["update_skipped"] == 0 for r in records)
  versions = [r["sampled_version"] for r in records]
  assert all(v % 2 == 0 for v in versions), versions
  assert [r["staleness"] for r in records] == [2 * t - v for t, v in enumerate(versions)]
  assert max(r["staleness"] for r in records) == 2, versions


@pytest.mark.slow
def test_simulated_staleness_counts_optimiser_updates_with_minibatches(tmp_path):
  """rl.staleness = 4 with 2 updates per batch lags sampling by 2 batches: once the lag is
  reached, every batch's tokens are exactly 4 optimiser updates old (the unit of
  max_staleness and of every version)."""
  config = _config(str(tmp_path), "independent", "uniform", False, 0, 1)
  config.rl.update(num_minibatches=2, staleness=4, steps=4)
  launcher.run(config)
  records = rl_steps(str(tmp_path))
  assert [r["staleness"] for r in records] == [0, 2, 4, 4]


def test_model_side_switches_compose_through_the_launcher(tmp_path, capsys):
  """The quick tier's one run of the model-side switches together: LoRA adapters
  (lora.rank), mixed precision (model.compute_dtype), rematerialisation (model.remat),
  chunked log-probs (rl.logprob_chunk), several updates per batch (rl.num_minibatches)
  and another objective (loss.name). Each reaches the run: the checkpoint's trained
  parameters are the adapters alone over a frozen float32 base, the sampler-trainer gap
  is bfloat16's, two updates per step, and mu_grpo's metrics. (Each switch has its own
  slower tests of what it computes.) The scorer's counters reach metrics.jsonl, and the
  same launch again finds nothing left to do: it restores the run and says so."""
  from models import lora as lora_lib  # pylint: disable=import-outside-toplevel
  from rl import checkpoint  # pylint: disable=import-outside-toplevel
  config = tiny_run_config(tmp_path, {
      "lora.rank": 2, "model.compute_dtype": "bfloat16", "model.remat": "full",
      "rl.logprob_chunk": 3, "rl.num_minibatches": 2, "loss.name": "mu_grpo"})
  launcher.run(config)
  assert "Resumed" not in capsys.readouterr().out
  records = rl_steps(str(tmp_path))
  assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
  assert all(r["reward_timeouts"] == 0 and r["reward_errors"] == 0 for r in records)
  assert all(r["rollout_train_mismatch_kl"] > 1e-10 for r in records)  # bf16's gap, not 0
  assert all("vetoed_fraction" in r for r in records)  # mu_grpo's veto ran
  saved = json.load(open(tmp_path / "config.json"))
  assert (saved["model"]["remat"], saved["rl"]["logprob_chunk"]) == ("full", 3)
  manager = checkpoint.make_manager(str(tmp_path / "checkpoints"))
  tree, meta = checkpoint.restore_tree(manager, manager.latest_step())
  assert meta["phase"] == "rl"
  state = tree["train"]
  assert int(state["step"]) == 2 * config.rl.steps  # two optimiser updates per RL step
  adapters = sum(np.asarray(x).size for x in jax.tree.leaves(state["params"]))
  run = wiring.settings(config)
  assert adapters == lora_lib.adapter_count(wiring.load_policy(run, jax.random.PRNGKey(0))[1],
                                            wiring.lora_config(run))
  assert all(np.asarray(x).dtype == np.float32
             for x in jax.tree.leaves((state["params"], state["frozen"])))
  steps = config.warm_start.steps + config.rl.steps
  assert launcher.run(config)["steps"] == steps
  assert f"Resumed from step {steps} (rl phase) in {tmp_path}." in capsys.readouterr().out
