"""One GRPO update, Arbor against TRL, on the same weights and batch (B9; docs/real_model.md).

    python -m experiments.trl_parity --config=experiments/configs/smollm2_basic_arithmetic.py
    python -m experiments.trl_parity --config=experiments/configs/smollm2_basic_arithmetic.py \\
        --config.lora.rank=0 --parity_json=docs/results/b9/trl_parity_full.json     # full weights

Arbor loads the run's policy (`--config`: model, LoRA, loss, learning rate, AdamW, gradient
clipping, temperature) and samples one batch of `--prompts` training prompts x
config.rollout.group_size completions with its own sampler (at most --max_new_tokens each).
The rewards are fixed, not scored: each group's are drawn uniformly from [0, 1) by a fixed
NumPy seed, except the last group, whose rewards are all 0.5 (its advantages must be exactly
0 on both sides). The parity is of the update given (prompts, completions, rewards); the
scorer is not under test, and fractional rewards make every other group informative.

TRL (`experiments/peers/trl_step_peer.py`, in the torch peer's virtualenv) then takes one
GRPOTrainer step on exactly those ids and rewards from Arbor's exported weights (and, under
LoRA, Arbor's initial adapters, so A and B start equal), for each aggregation in
--aggregations, with TRL's loss_type matched: seq_mean_token_mean = "grpo", token_mean =
"bnpo" (one process, one micro-batch). Arbor takes its one train step on the same batch
twice: with TRL's advantages (so that the loss, gradient and update compare like for like)
and with its own.

Compared, as relative differences |a - b| / |b| (b = TRL): advantages; the per-token
log-probs of the completion tokens under the initial weights (Arbor's trainer forward vs
TRL's); the loss; the gradient's global norm (before clipping); and the update, as
||delta_Arbor - delta_TRL|| / ||delta_TRL|| over all trained tensors, with the largest
element difference in units of the learning rate. Ratios: TRL's on-policy ratio is exactly
1 (it detaches its own log-probs); Arbor's is exp(logp - behaviour log-prob), the sampler's
log-probs, so its distance from 1 is the sampler-vs-trainer rounding, reported.

Known differences, each measured rather than hidden: TRL's group std is the sample std
(Bessel's n - 1) plus 1e-4, Arbor's the population std plus 1e-6, so TRL's advantages are
Arbor's times about sqrt((G - 1) / G); the result reports that ratio per row (the loss and
update comparison uses TRL's advantages on both sides, and `arbor_own` reports Arbor's step
with its own advantages). With seq_mean_token_mean the on-policy loss is zero up to rounding
on both sides (each group's advantages sum to zero and the ratio is 1), so its relative
difference is between two rounding errors; the absolute difference is reported beside it.

Writes --out (JSON). Runs TRL only outside CI (`experiments.peers.peers_enabled`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import config_flag
from experiments import peers
from experiments import provenance
from experiments.measure import load
from models import hf_checkpoint
from models import peft_adapter
from rl import train
from rl.objectives import composite
from rl import wiring

CONFIG = config_flag.run_config()
_PROMPTS = flags.DEFINE_integer("prompts", 4, "Prompts in the batch (each with group_size rows).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Completion budget of the fixed batch.")
_AGGREGATIONS = flags.DEFINE_list("aggregations", ["seq_mean_token_mean", "token_mean"],
                                  "Arbor aggregations compared (each with its TRL loss_type).")
_OUT = flags.DEFINE_string("parity_json", "docs/results/b9/trl_parity.json", "Result JSON.")
_PEER_ENVS, _PEER_WEIGHTS = peers.location_flags()
_REWARD_SEED = 0

TRL_LOSS_TYPE = {"seq_mean_token_mean": "grpo", "token_mean": "bnpo"}


def relative(a, b) -> float:
  """max |a - b| / max |b| (0 when both are 0)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = np.max(np.abs(b)) if b.size else 0.0
  diff = np.max(np.abs(a - b)) if a.size else 0.0
  return float(diff / scale) if scale > 0 else float(diff)


def fixed_rewards(groups: int, group_size: int) -> np.ndarray:
  """Uniform [0, 1) rewards from a fixed seed; the last group all 0.5 (advantage 0)."""
  rewards = np.random.default_rng(_REWARD_SEED).random((groups, group_size)).astype(np.float32)
  rewards[-1] = 0.5
  return rewards.reshape(-1)


def row_ids(batch) -> tuple[list[list[int]], list[list[int]]]:
  """Each row's prompt ids and completion ids (the masked slots, in order)."""
  tokens = np.asarray(batch.tokens)
  prompt, completion = np.asarray(batch.prompt_mask), np.asarray(batch.completion_mask)
  return ([tokens[r][prompt[r]].tolist() for r in range(len(tokens))],
          [tokens[r][completion[r]].tolist() for r in range(len(tokens))])


def trained_tensors(params, model_config, lora) -> dict[str, np.ndarray]:
  """The trained parameters under TRL's names: adapters (LoRA) or the HF state dict."""
  if lora is not None:
    return peft_adapter.to_peft(params, model_config, lora, adapter_name="default")
  return hf_checkpoint.hf_tensors_from_params(params, model_config)


def relative_l2(pairs) -> float:
  """||a - b|| / ||b|| over (a, b) array pairs taken together."""
  num = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in pairs)
  den = sum(float(np.sum(b.astype(np.float64) ** 2)) for _, b in pairs)
  return float(np.sqrt(num / den)) if den else float(np.sqrt(num))


def update_difference(before: dict, arbor: dict, trl: dict, arbor_m: dict, trl_m: dict,
                      learning_rate: float, adam_eps: float) -> dict:
  """The two updates compared over the tensors both sides trained.

  gradient_relative_l2: of AdamW's first moments after the step ((1 - beta1) times the
  clipped gradient, element by element). update_relative_l2: of the parameter updates;
  update_max_abs_in_lr: their largest element difference in learning rates. Adam's first
  update is lr * g / (|g| + eps) per element, so where |g| is near eps a rounding-level
  difference in g moves the update by a sizeable fraction of lr; `update_relative_l2_large_g`
  and `update_max_abs_in_lr_large_g` restrict the comparison to elements whose gradient
  exceeds 100 eps on both sides, and `small_g_share` is the share of elements below it."""
  common = sorted(set(arbor) & set(trl) & set(before))
  deltas, large, worst, worst_large, small, total = [], [], 0.0, 0.0, 0, 0
  for name in common:
    d_arbor = arbor[name].astype(np.float64) - before[name]
    d_trl = trl[name].astype(np.float64) - before[name]
    deltas.append((d_arbor, d_trl))
    g_floor = 100 * adam_eps * 0.1  # (1 - beta1) * 100 eps, on the first moments
    keep = (np.abs(arbor_m[name]) > g_floor) & (np.abs(trl_m[name]) > g_floor)
    large.append((d_arbor[keep], d_trl[keep]))
    small += int(keep.size - keep.sum())
    total += int(keep.size)
    worst = max(worst, float(np.max(np.abs(d_arbor - d_trl))))
    if keep.any():
      worst_large = max(worst_large, float(np.max(np.abs(d_arbor - d_trl)[keep])))
  return {"tensors": len(common), "only_arbor": len(set(arbor) - set(trl)),
          "only_trl": len(set(trl) - set(arbor)), "elements": total,
          "gradient_relative_l2": relative_l2([(arbor_m[n], trl_m[n]) for n in common]),
          "update_relative_l2": relative_l2(deltas),
          "update_max_abs_in_lr": worst / learning_rate,
          "update_relative_l2_large_g": relative_l2(large),
          "update_max_abs_in_lr_large_g": worst_large / learning_rate,
          "small_g_share": small / max(total, 1),
          "update_norm_trl": float(np.sqrt(sum(float(np.sum(b ** 2)) for _, b in deltas)))}


def first_moment(opt_state):
  """The `mu` (AdamW's first moment) tree inside an optax optimiser state."""
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")):
    if hasattr(node, "mu"):
      return node.mu
  raise ValueError("The optimiser state holds no Adam first moment (mu).")


def arbor_steps(run, tokenizer, model_config, host_params, batches, aggregation: str):
  """Arbor's train step of the run's settings with `aggregation`, once on each of `batches`
  from the same initial state: [(trained params after, AdamW's first moment, metrics)]."""
  run = dataclasses.replace(run, loss=dataclasses.replace(run.loss, aggregation=aggregation))
  ctx, optimizer = wiring.make_context(run, wiring.build_task(run), tokenizer, model_config,
                                       wiring.RL)
  results = []
  for batch in batches:
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), host_params)  # the step donates
    state = wiring.new_train_state(run, model_config, params, optimizer, wiring.RL)
    state, metrics = ctx.train_step(state, batch)
    results.append((jax.device_get(state.params), jax.device_get(first_moment(state.opt_state)),
                    {k: float(v) for k, v in jax.device_get(metrics).items()}))
  return results


def main(argv):
  del argv
  if not peers.peers_enabled(["torch"]):
    raise SystemExit("The TRL parity runs TRL in the torch peer's virtualenv, which is off "
                     "when CI is set; unset CI to run it.")
  config = CONFIG.value
  source = provenance.source_state(os.getcwd())
  with config.unlocked():
    config.rollout.prompts_per_step = _PROMPTS.value
    config.rollout.max_new_tokens = min(_MAX_NEW.value, config.rollout.max_new_tokens)
  run = wiring.settings(config)
  if run.loss.name != "grpo" or run.loss.kl_coef:
    raise ValueError("The TRL parity compares the clipped GRPO objective without KL: "
                     f"config.loss.name = {run.loss.name!r}, kl_coef = {run.loss.kl_coef}.")
  unknown = sorted(set(_AGGREGATIONS.value) - set(TRL_LOSS_TYPE))
  if unknown:
    raise ValueError(f"--aggregations {unknown}: TRL has a matching loss_type for "
                     f"{sorted(TRL_LOSS_TYPE)} only.")
  init_rng, _ = jax.random.split(jax.random.PRNGKey(run.seed))
  tokenizer, model_config, params = wiring.load_policy(run, init_rng)
  host_params = jax.device_get(params)
  task = wiring.build_task(run)
  ctx, _ = wiring.make_context(run, task, tokenizer, model_config, wiring.RL)
  producer = wiring.make_rl_producer(run, ctx)
  batch, _, _ = producer.produce(producer.init(0), params, 0, jax.random.PRNGKey(run.seed), 0)
  g = run.rollout.group_size
  batch = batch.replace(reward=jnp.asarray(fixed_rewards(_PROMPTS.value, g)))
  own = wiring.batch_advantages(run)(batch)
  logp = composite.policy_logprobs(params, batch, model_config, run.rollout.temperature)
  mask = np.asarray(batch.completion_mask)
  prompt_ids, completion_ids = row_ids(batch)

  lora = wiring.lora_config(run)
  state = wiring.new_train_state(run, model_config, params,
                                 train.make_optimizer(run.rl.learning_rate), wiring.RL)
  before = trained_tensors(jax.device_get(state.params), model_config, lora)
  workdir = tempfile.mkdtemp(prefix="arbor_trl_parity_")
  init_path = os.path.join(workdir, "lora_init.npz")
  if lora is not None:
    np.savez(init_path, **before)
  folder = peers.export_weights(peers.weights_folder(_PEER_WEIGHTS.value, run.model.checkpoint),
                                host_params, model_config, tokenizer, run.model.checkpoint)
  settings = dict(temperature=run.rollout.temperature,
                  epsilon_low=float(wiring.rl_loss(run).eps_low),
                  epsilon_high=float(wiring.rl_loss(run).eps_high),
                  learning_rate=run.rl.learning_rate, adam_beta1=0.9, adam_beta2=0.999,
                  adam_epsilon=1e-8, weight_decay=run.rl.weight_decay,
                  max_grad_norm=run.rl.max_grad_norm)
  result = {"config": run.model.checkpoint, "rows": len(prompt_ids), "group_size": g,
            "rewards": np.asarray(batch.reward).tolist(),
            "completion_lengths": [len(c) for c in completion_ids],
            "prompt_lengths": sorted({len(p) for p in prompt_ids}), "settings": settings,
            "lora": None if lora is None else dict(rank=lora.rank, alpha=lora.alpha,
                                                   targets=list(lora.targets)),
            "arbor_ratio_max_abs_minus_1": float(np.max(np.abs(
                np.exp(np.asarray(logp) - np.asarray(batch.behavior_logp)) - 1.0)[mask])),
            "load_before": load(), "commit": provenance.commit_label(source),
            "source": {k: v for k, v in source.items() if k != "diff"}, "cases": {}}
  for aggregation in _AGGREGATIONS.value:
    out = os.path.join(workdir, f"trl_{aggregation}.npz")
    spec = dict(weights=folder, prompt_ids=prompt_ids, completion_ids=completion_ids,
                rewards=result["rewards"], group_size=g, out=out,
                settings=dict(settings, loss_type=TRL_LOSS_TYPE[aggregation]),
                lora=None if lora is None else dict(
                    rank=lora.rank, alpha=lora.alpha, init=init_path,
                    modules=sorted(peft_adapter.module_name(t).split(".")[1]
                                   for t in lora.targets)))
    trl_out = peers.run_peer("torch", spec, _PEER_ENVS.value, script="trl_step_peer")
    trl_adv = np.asarray(trl_out["advantages"], np.float32)
    trl_batch = batch.replace(advantages=jnp.asarray(trl_adv)[:, None] * batch.completion_mask)
    (after, arbor_m, metrics), (_, _, own_metrics) = arbor_steps(
        run, tokenizer, model_config, host_params,
        [trl_batch, batch.replace(advantages=own)], aggregation)
    trl_logps = [np.asarray(row, np.float64)[np.asarray(m, bool)]
                 for row, m in zip(trl_out["logps"], trl_out["completion_mask"])]
    arbor_logps = [np.asarray(logp)[r][mask[r]] for r in range(len(mask))]
    own_rows = np.asarray(own)[np.arange(len(mask)), np.argmax(mask, axis=1)]
    informative = np.abs(trl_adv) > 0
    saved = dict(np.load(out))
    trl_after = {k: v for k, v in saved.items() if not k.startswith("exp_avg/")}
    trl_m = {k[len("exp_avg/"):]: v for k, v in saved.items() if k.startswith("exp_avg/")}
    result["cases"][aggregation] = {
        "trl_loss_type": TRL_LOSS_TYPE[aggregation],
        "advantages_trl": trl_adv.tolist(), "advantages_arbor": own_rows.tolist(),
        "advantage_ratio_trl_over_arbor": (trl_adv[informative] / own_rows[informative]).tolist(),
        "expected_ratio_sqrt_g_minus_1_over_g": float(np.sqrt((g - 1) / g)),
        "logp_max_abs_diff": float(max(np.max(np.abs(a - b)) for a, b in
                                       zip(arbor_logps, trl_logps))),
        "logp_relative": relative(np.concatenate(arbor_logps), np.concatenate(trl_logps)),
        "loss_arbor": metrics["loss"], "loss_trl": trl_out["loss"],
        "loss_relative": relative(metrics["loss"], trl_out["loss"]),
        "loss_abs_diff": abs(metrics["loss"] - trl_out["loss"]),
        "grad_norm_arbor": metrics["grad_norm"], "grad_norm_trl": trl_out["grad_norm"][0],
        "grad_norm_relative": relative(metrics["grad_norm"], trl_out["grad_norm"][0]),
        "update": update_difference(
            before, trained_tensors(after, model_config, lora), trl_after,
            trained_tensors(arbor_m, model_config, lora), trl_m,
            run.rl.learning_rate, settings["adam_epsilon"]),
        "arbor_own": {"loss": own_metrics["loss"], "grad_norm": own_metrics["grad_norm"]},
        "trl_trained_tensors": trl_out["trained_tensors"], "trl_trainable": trl_out["trainable"],
        "versions": {k: trl_out[k] for k in ("torch", "transformers", "trl")}}
    print(json.dumps({aggregation: {k: v for k, v in result["cases"][aggregation].items()
                                    if not isinstance(v, list)}}, indent=1), flush=True)
  result["load_after"] = load()
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=1)
  print(f"Written to {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=config_flag.parse_flags)
