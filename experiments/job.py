"""One launcher job (`python -m experiments.train`): the supervised warm start, then RL,
with held-out evaluations, checkpoints, metrics and the run's records.

`Job(config, run)` builds the run's objects (rl.wiring) from its typed settings `run`, `restore_or_start` resumes from the
newest checkpoint (or starts RL from a shared warm start), `run_phase` steps a phase to its
end, evaluating and checkpointing on schedule, and `finish` writes summary.json and
plot.png. experiments/train.py validates the config (`rl.wiring.validate`, which returns `run`) and runs
these in order.
"""

from __future__ import annotations

import json
import os
import time

import jax
import ml_collections
import tqdm

from experiments import metrics
from experiments import provenance
from experiments import run_records
from models import lora as lora_lib
from models import peft_adapter
from rl import checkpoint
from rl import evaluation
from rl import loop
from rl import train
from rl import wiring
from rl.settings import run as run_lib
from rl import async_loop
from rl.rollouts import producers
from sharding import multihost

WARM_START, RL = wiring.WARM_START, wiring.RL
ADAPTER_DIR = "adapter"  # under the workdir: a LoRA run's final adapters (PEFT format)


class Job:
  """One launcher job: its policy, task, phase contexts, checkpoints, logs and run-level
  records (`meta`), with the steps of `run` as methods. `done` counts the steps of both
  phases taken so far (the checkpoint step)."""

  def __init__(self, config: ml_collections.ConfigDict, run: run_lib.RunSettings):
    """`config`: the launcher's config (workdir, resume and distributed are the launcher's
    own fields; the whole is recorded in config.json); `run`: its typed settings, as
    `rl.wiring.validate` returned them, which everything the run builds reads."""
    self.config, self.run = config, run
    self.started = time.time()
    d = config.distributed
    multihost.initialize(d.coordinator_address or None, d.num_processes or None,
                         None if d.process_id < 0 else d.process_id)
    self.mesh = wiring.build_mesh(run)
    self.primary = multihost.is_primary()
    init_rng, loop_rng = jax.random.split(jax.random.PRNGKey(run.seed))
    # The policy first: a LoRA rank its shapes refuse is refused before the workdir exists.
    self.tokenizer, self.model_config, params = wiring.load_policy(run, init_rng)
    if wiring.lora_config(run) is not None:
      lora_lib.check_rank(self.model_config, wiring.lora_config(run))
    os.makedirs(config.workdir, exist_ok=True)
    self.manager = checkpoint.make_manager(os.path.join(config.workdir, "checkpoints"),
                                           run.checkpoint.max_to_keep,
                                           remove_unfinished=True)
    self.config_json = config.to_json_best_effort(indent=2, sort_keys=True)
    self.record_launch()
    self.task = wiring.build_task(run)
    self.eval_examples = self.task.examples("eval", run.task.eval_size)
    # A distillation teacher is loaded (and its tokenizer and context checked) before step 1.
    teacher = wiring.load_teacher(run, self.tokenizer) if run.distill.teacher else None
    self.contexts = {phase: wiring.make_context(run, self.task, self.tokenizer,
                                                self.model_config, phase, self.mesh, teacher)
                     for phase in (WARM_START, RL)}
    if self.mesh is not None:  # a global array, so every process checkpoints the same key
      loop_rng = multihost.replicate(loop_rng, self.mesh)
    train_state = self.new_train_state(params, WARM_START)
    self.state = loop.LoopState(
        train=train_state, rng=loop_rng, history=self.history(train_state.params),
        producer=producers.CursorState(cursor=producers.cursor_array(0)))
    self.meta = run_records.new_meta()
    self.log = metrics.MetricsLog(
        os.path.join(config.workdir, "metrics.jsonl"),
        writers=metrics.make_writers(
            config.workdir, tensorboard=run.metrics.tensorboard,
            wandb_project=run.metrics.wandb_project,
            config=json.loads(self.config_json)) if self.primary else [])
    self.producer = wiring.make_rl_producer(run, self.contexts[RL][0])
    self.phase_steps = {WARM_START: run.warm_start.steps, RL: run.rl.steps}
    self.done = 0
    self.bar = None

  def record_launch(self) -> None:
    """Refuses, before anything is trained or written (only the policy is loaded by then:
    a LoRA rank its shapes refuse leaves no workdir behind), to resume checkpoints written
    under a config that differs in a field that changes results (`provenance.check_resume`),
    then records this launch: its resolved config in config.json, and a line in
    launches.jsonl (time, argv, the source commit and the hash of its uncommitted code, the
    config's fingerprint)."""
    config = self.config
    latest = self.manager.latest_step()
    allowed, previous = {}, None
    if latest is not None:
      if not config.resume.enabled:
        raise ValueError(f"config.resume.enabled=False but {config.workdir} already holds "
                         f"checkpoints (latest step {latest}); use a new config.workdir or "
                         "resume.enabled=True.")
      launches = provenance.read_launches(config.workdir)
      allowed = provenance.check_resume(config, launches)
      previous = launches[-1] if launches else None
    if self.primary:
      with open(os.path.join(config.workdir, "config.json"), "w") as f:
        f.write(self.config_json)
      source = provenance.source_state(os.path.dirname(os.path.dirname(__file__)))
      provenance.append_launch(config.workdir,
                               provenance.launch_record(config, source, allowed, previous))

  def new_train_state(self, params, phase: str):
    """The fresh TrainState of `phase` over `params` (`rl.wiring.new_train_state`)."""
    return wiring.new_train_state(self.run, self.model_config, params, self.contexts[phase][1],
                                  phase, self.mesh)

  def state_like(self, meta: dict) -> loop.LoopState:
    """The shapes of the LoopState a checkpoint with `meta` holds (`rl.wiring.loop_state_like`:
    its phase's TrainState, under LoRA adapters over a frozen base in the RL phase, and its
    producer state), placed as this run keeps it."""
    phase = meta["phase"]
    like = wiring.loop_state_like(self.run, self.model_config, self.state.train.params,
                                  phase, self.contexts[phase][1],
                                  self.producer if phase == RL else None,
                                  self.contexts[RL][0].stages)
    if self.mesh is None:
      return like
    # Restore straight into the trainer's layout; the ring (adapters or weights, and their
    # versions) and the producer state are small and replicated, as the key.
    placed = lambda like, sharding: jax.ShapeDtypeStruct(like.shape, like.dtype,
                                                         sharding=sharding)
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    train_like = jax.tree.map(placed, like.train, train.train_state_shardings(
        self.model_config, self.contexts[phase][1], self.mesh,
        lora=wiring.phase_lora(self.run, phase)))
    history = (None if like.history is None
               else jax.tree.map(lambda x: placed(x, replicated), like.history))
    return like.replace(train=train_like, history=history, rng=self.state.rng)

  def history(self, params):
    """Simulated staleness's parameter history (None without staleness)."""
    staleness = self.run.rl.staleness_in_batches
    return loop.init_history(params, staleness) if staleness else None

  def restore_warm_start(self, source: str) -> tuple[int, loop.LoopState, dict]:
    """(step, state, meta) at the start of the RL phase, taken from the end-of-warm-start
    checkpoint of the run in `source` (config.warm_start.init_from) as if this run had
    trained it: its policy, loop key, data cursor and run records, with this run's fresh RL
    TrainState, staleness ring and producer state built over that policy exactly as
    `run_phase` builds them. Its metrics records up to that checkpoint are copied into this
    run's log, so the curves and the summary cover the whole run."""
    step = self.phase_steps[WARM_START]
    directory = os.path.join(source, "checkpoints")
    steps = (checkpoint.make_manager(directory).all_steps() if os.path.isdir(directory)
             else [])  # never create a folder in another run's workdir
    if step not in steps:
      raise ValueError(
          f"config.warm_start.init_from = {source!r} holds no checkpoint at the end of its "
          f"warm start (step {step}; it holds {sorted(steps)}): a run that went "
          "on into RL may have pruned it. Train a warm start alone with --config.rl.steps=0.")
    tree, meta = checkpoint.restore_tree(checkpoint.make_manager(directory), step)
    if meta["phase"] != RL or meta["iteration"] != 0:
      raise ValueError(f"{source} checkpoint {step} is not the end of a warm start (phase "
                       f"{meta['phase']!r}, iteration {meta['iteration']}).")
    trained = tree["train"]["frozen"] or tree["train"]["params"]
    # Each host array goes where this run's parameters live: one device, or with a mesh
    # the trainer's sharding (every process giving its own shards).
    params = jax.tree.map(
        lambda like, value: jax.make_array_from_callback(
            like.shape, like.sharding,
            lambda index: jax.numpy.asarray(value, like.dtype)[index]),
        self.state.train.params, trained)
    rng = jax.numpy.asarray(tree["rng"])
    if self.mesh is not None:
      rng = multihost.replicate(rng, self.mesh)
    train_state = self.new_train_state(params, RL)
    # Where the warm start left the data stream (older checkpoints kept it in their meta).
    cursor = int(meta["data_cursor"] if "data_cursor" in meta else tree["producer"]["cursor"])
    state = loop.LoopState(train=train_state, rng=rng, history=self.history(train_state.params),
                           producer=self.producer.init(cursor),
                           stages=self.contexts[RL][0].stages.init(), iteration=0)
    records = metrics.MetricsLog(os.path.join(source, "metrics.jsonl"), writers=[]).read()
    if self.primary:
      self.log.truncate_after(-1)
      for record in records[:meta["log_records"]]:
        self.log.write(record)
    kept = set(run_records.new_meta()) | {"log_records"}  # not the source's digest
    meta = {key: value for key, value in meta.items() if key in kept}
    meta["warm_start_from"] = os.path.abspath(source)
    return step, state, meta

  def restore_or_start(self) -> None:
    """Resumes from the newest checkpoint (config.resume.enabled), else starts RL from
    config.warm_start.init_from when set, else clears what a fresh run overwrites; then
    opens the progress bar at the step reached."""
    if self.config.resume.enabled:
      self.refuse_older_checkpoints()
    restored = (checkpoint.restore_latest(self.manager, self.state_like)
                if self.config.resume.enabled else None)
    source = self.run.warm_start.init_from
    from_source = restored is None and bool(source)
    if from_source:
      restored = self.restore_warm_start(source)
    if restored is not None:
      step, state, meta = restored
      meta = run_records.upgrade_meta(meta)  # checkpoints written before some records existed
      self.state = state.replace(iteration=meta["iteration"])
      self.meta = meta
      if self.primary:
        self.log.truncate_to(meta["log_records"], step)
      if self.primary:  # absl logs only warnings here (see main), so say it plainly
        print(f"Starting RL from the warm start in {source}." if from_source else
              f"Resumed from step {step} ({meta['phase']} phase) in {self.config.workdir}.",
              flush=True)
    elif self.primary:
      self.log.truncate_after(-1)
    self.done = ((0 if self.meta["phase"] == WARM_START else self.phase_steps[WARM_START])
                 + self.state.iteration)
    if self.primary:  # once per launch, at the step it starts from
      self.log.write_text(self.done, "config", metrics.config_markdown(self.config_json))
    self.bar = tqdm.tqdm(total=sum(self.phase_steps.values()), initial=self.done,
                         desc=self.meta["phase"], dynamic_ncols=True, disable=not self.primary)

  def refuse_older_checkpoints(self) -> None:
    """Raises ValueError when the newest checkpoint was written before the producer state
    joined the LoopState (its meta holds the data cursor): this code cannot resume it."""
    latest = self.manager.latest_step()
    if latest is not None and "data_cursor" in checkpoint.read_meta(self.manager, latest):
      raise ValueError(
          f"{self.config.workdir} holds checkpoints of an older Arbor (step {latest} keeps "
          "the data cursor in its meta, not in the LoopState's producer state); resume it "
          "with the code that wrote it, or start a new config.workdir (its end-of-warm-start "
          "checkpoint still works as config.warm_start.init_from).")

  def save(self) -> None:
    """Checkpoints the loop state (the producer's as `for_checkpoint` keeps it) and the run
    records at step `done`."""
    state = self.state
    if self.meta["phase"] == RL:
      state = state.replace(producer=self.producer.for_checkpoint(state.producer))
    checkpoint.save(self.manager, self.done, state,
                    dict(self.meta, iteration=state.iteration, log_records=len(self.log.read())))
    self.log.flush()  # TensorBoard events up to the checkpoint reach disk with it

  def record_step(self, phase: str, step_metrics: dict) -> None:
    """Counts one step and logs its metrics (and its training samples, when it carries
    them: samples/train_<step>.jsonl); folds its lengths, skips and times into meta."""
    self.done += 1
    step_metrics = dict(step_metrics)
    samples = step_metrics.pop("samples", None)
    counts = step_metrics.pop("completion_length_counts", None)
    if counts is not None:
      self.meta["completion_length_counts"] = run_records.add_counts(self.meta["completion_length_counts"],
                                                         counts)
    self.meta["prompts_skipped"] += int(step_metrics.get("prompts_skipped", 0))
    tokens = self.meta["tokens"]
    if phase == WARM_START:  # its time is counted whole, in advance()
      tokens["warm_start_trained"] += int(step_metrics.get("trained_tokens", 0))
    else:
      for part in ("rollout", "train") + run_records.ROLLOUT_PARTS:
        self.meta["time_s"][part] += float(step_metrics.get(f"time_{part}_s", 0.0))
      tokens["sampled"] += int(step_metrics.get("sampled_tokens", 0))
      tokens["trained"] += int(step_metrics.get("trained_tokens", 0))
      run_records.add_step_metrics(self.meta, step_metrics)
    record = {"step": self.done, "phase": phase,
              **{k: float(v) for k, v in step_metrics.items()}}
    if self.primary:
      self.log.write(record)
      self.log.write_samples(self.done, "train", samples)
    self.bar.update(1)
    self.bar.set_postfix({k: f"{record[k]:.3f}" for k in ("loss", "reward_mean") if k in record})

  def evaluate(self, label: str) -> None:
    """Greedy held-out evaluation of the current parameters, logged (with its samples:
    samples/eval_<step>.jsonl) and kept in meta; with an environment (config.tools), once
    with it and once without it."""
    eval_started = time.perf_counter()
    settings = self.run
    turns = self.contexts[RL][0].batch.turns
    run = lambda turns, samples: evaluation.evaluate(
        self.state.train.policy_params(), self.eval_examples, task=self.task,
        tokenizer=self.tokenizer, prompt_len=settings.rollout.prompt_len,
        max_new_tokens=settings.rollout.max_new_tokens, model_config=self.model_config,
        batch_size=settings.eval.batch_size, mesh=self.mesh, turns=turns, samples=samples)
    result = run(turns, settings.metrics.eval_samples)
    record = run_records.eval_record(result, self.done, self.meta["phase"], label,
                                     self.meta["tokens"]["sampled"])
    if turns is not None:
      record.update(run_records.no_tools_record(run(None, 0), result))
    if self.primary:
      self.log.write_samples(self.done, "eval", result.samples)
    eval_s = time.perf_counter() - eval_started
    self.meta["time_s"]["eval"] += eval_s
    self.meta["evals"].append(record)
    self.meta["time_rl_at_evals_s"].append(self.meta["time_rl_s"])
    self.meta["eval_step_sums"].append({"steps": self.meta["rl_steps_recorded"],
                                        "sums": dict(self.meta["rl_metric_sums"])})
    if self.primary:  # its wall time goes to the log only: meta's records stay clock-free
      self.log.write(dict(record, time_eval_s=eval_s, time_rl_s=self.meta["time_rl_s"]))
    self.bar.write(f"[step {self.done}] {label}: held-out accuracy {result.accuracy:.3f}, "
                   f"mean reward {result.mean_reward:.3f}"
                   + run_records.failures_line(result.categories))

  def advance(self, phase: str) -> None:
    """One step of `phase` (for async RL: every step up to the next evaluation, checkpoint
    or the end; nothing is in flight after it)."""
    settings, ctx = self.run, self.contexts[phase][0]
    if phase == WARM_START:
      step_started = time.perf_counter()
      self.state, step_metrics = loop.sft_iteration(self.state, ctx,
                                                    settings.warm_start.length_window)
      self.meta["time_s"]["warm_start"] += time.perf_counter() - step_started
      self.record_step(phase, step_metrics)
    elif settings.rl.async_:
      boundary = min(self.phase_steps[phase],
                     *((self.state.iteration // every + 1) * every
                       for every in (settings.eval.every, settings.checkpoint.every)))
      self.state, _ = async_loop.run_async(
          self.state, ctx, self.producer, boundary - self.state.iteration,
          max_staleness=settings.rl.max_staleness, publish=ctx.publish or (lambda p: p),
          updates_per_batch=settings.rl.updates_per_batch,
          on_step=lambda _, step_metrics: self.record_step(RL, step_metrics))
    else:
      self.state, step_metrics = loop.grpo_iteration(self.state, ctx, self.producer)
      self.record_step(phase, step_metrics)

  def run_phase(self, phase: str) -> None:
    """Steps `phase` to its end, evaluating (RL) and checkpointing on schedule; the warm
    start ends with an evaluation and hands its parameters to RL with a fresh optimiser."""
    self.bar.set_description(phase)
    while self.state.iteration < self.phase_steps[phase]:
      started = time.perf_counter()
      self.advance(phase)
      if phase == RL:
        self.meta["time_rl_s"] += time.perf_counter() - started
      iteration = self.state.iteration
      if phase == RL and iteration % self.run.eval.every == 0:
        self.evaluate("eval")
      if iteration % self.run.checkpoint.every == 0 and iteration < self.phase_steps[phase]:
        self.save()  # the phase's last step is saved below
    if phase == WARM_START:
      self.evaluate("warm_start_end")
      self.meta["phase"] = RL
      train_state = self.new_train_state(self.state.train.params, RL)
      self.state = loop.LoopState(
          train=train_state, rng=self.state.rng, history=self.history(train_state.params),
          producer=self.producer.init(int(self.state.producer.cursor)),
          stages=self.contexts[RL][0].stages.init(), iteration=0)
      self.save()

  def finish(self) -> dict:
    """The final evaluation and checkpoint (if the schedule did not just make them), then
    summary.json and plot.png; returns the summary."""
    self.bar.close()
    last = self.meta["evals"][-1]
    if self.run.rl.steps and (last["step"] != self.done or last["event"] != "eval"):
      self.evaluate("eval")
    if self.manager.latest_step() != self.done:
      self.save()
    self.save_adapter()
    summary = self.summary()
    if self.primary:
      with open(os.path.join(self.config.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
      self.log.close()  # every writer's events on disk, the W&B run finished
      metrics.plot_run(self.log.read(), os.path.join(self.config.workdir, "plot.png"))
    return summary

  def save_adapter(self) -> None:
    """Under LoRA, once the RL phase has run: the trained adapters as a PEFT folder,
    <workdir>/adapter (models/peft_adapter.py; megabytes, where a checkpoint holds the
    frozen base too), loadable by PEFT and by `python -m experiments.eval --adapter=`."""
    lora = wiring.lora_config(self.run)
    if lora is None or self.meta["phase"] != RL:
      return
    adapters = multihost.fetch(self.state.train.params)  # every process takes part
    if self.primary:
      peft_adapter.save(os.path.join(self.config.workdir, ADAPTER_DIR), adapters,
                        self.model_config, lora, base_model=self.run.model.checkpoint)

  def summary(self) -> dict:
    """Held-out accuracies (warm start and final, with standard errors and by size; with an
    environment, also without it and its calls), steps, wall time and its split, rollout lengths, the selection / partial counts, and the
    tokens sampled and trained with their rates (`throughput_summary`)."""
    meta = self.meta
    warm = next(e for e in meta["evals"] if e["event"] == "warm_start_end")
    final = meta["evals"][-1]
    summary = {"warm_start_accuracy": warm["eval_accuracy"],
               "final_accuracy": final["eval_accuracy"],
               "warm_start_accuracy_stderr": warm["eval_accuracy_stderr"],
               "final_accuracy_stderr": final["eval_accuracy_stderr"],
               "warm_start_reward": warm["eval_reward"], "final_reward": final["eval_reward"],
               "categories": run_records.categories_summary(warm, final),
               "steps": self.done, "wall_time_s": time.time() - self.started,
               "time_s": {part: meta["time_s"][part] for part in run_records.TIME_PARTS},
               "rollout_completion_length": metrics.length_stats(
                   meta["completion_length_counts"]),
               "prompts_skipped": meta["prompts_skipped"],
               "nonfinite_updates": int(multihost.fetch(self.state.train.nonfinite_updates)),
               **run_records.throughput_summary(meta)}
    if "eval_accuracy_by_size" in final:
      summary["accuracy_by_size"] = run_records.accuracy_by_size_table(warm, final)
    if "eval_accuracy_no_tools" in final:
      summary["tools"] = run_records.tools_summary(warm, final)
    summary.update(self.state.producer.summary())
    summary["accuracy_curve"] = run_records.accuracy_curve(meta)
    summary["time_rl_s"] = meta["time_rl_s"]
    summary["time_rl_at_evals_s"] = list(meta["time_rl_at_evals_s"])
    summary["rl_step_means"] = run_records.rl_step_means(meta)
    summary["time_sample_median_s"] = run_records.time_sample_median_s(meta)
    summary["rl_step_means_between_evals"] = run_records.step_means_between_evals(meta)
    if "warm_start_from" in meta:
      summary["warm_start_from"] = meta["warm_start_from"]
    return summary
