"""The rollout batch that flows from the sampler, through scoring and advantages, to the loss."""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax


@flax.struct.dataclass
class TreeRows:
  """What a tree batch adds to its `Rollout` (rl.rollouts.batches.tree_rollout), [B] each:
  node, the row's id in its group's tree (-1: unused row); parent, the node it forked from
  (-1: a chain from the prompt); depth, its fork generation; prefix_len, the completion
  tokens it shares with its parent (context in this row, trained in the parent's)."""
  node: jax.Array
  parent: jax.Array
  depth: jax.Array
  prefix_len: jax.Array


@flax.struct.dataclass
class StepRewards:
  """Process rewards of a batch's rows (rl.rewards.step_rewards): value [B, T] float32, each
  step's reward at the last token of the step (0 elsewhere); mask [B, T] bool, those tokens.
  A row with no step has an empty mask."""
  value: jax.Array
  mask: jax.Array


@flax.struct.dataclass
class SamplerTopK:
  """The sampler's distribution at each slot, over its K most likely tokens (score
  centering's record, `rl.rollouts.sampler_topk`): ids [B, T, K] int32 and logp [B, T, K]
  float32, log q(v | tokens before slot t) for the K tokens v that q put most mass on at
  slot t (the distribution that drew token t, temperature and truncation applied; a token
  truncation removed has logp -inf). Meaningful at completion slots only."""
  ids: jax.Array
  logp: jax.Array


@flax.struct.dataclass
class Rollout:
  """One training batch of B sequences of T slots (prompt left-padded, then completion).

  tokens [B, T] int32; prompt_mask, completion_mask [B, T] bool; behavior_logp [B, T]
  log-prob each completion token had under the sampler (0 elsewhere); version [B, T]
  parameter version that generated each token (-1 for prompt and padding); group [B]
  prompt id (rows of one group share a prompt); reward [B]; advantages [B, T] per-token
  advantage (a sequence's advantage broadcast over its completion, or per-node advantages
  for tree rollouts): None as a producer returns the batch, set once on the final batch
  by the advantage stage (`rl.objectives.advantages.advantage_stage`); prox_logp [B, T] optional log-probs under the parameters at the start
  of this update (decoupled PPO); ref_logp [B, T] optional reference-policy log-probs (KL).
  tree: the tree structure of a tree batch (`TreeRows`), None otherwise. Each row of a
  tree batch (sampling/tree.py) is a root-to-leaf path whose prefix shared with its parent
  is in prompt_mask (context), not completion_mask: every tree token is trained once, in
  the row that decoded it (rl.rollouts.batches.tree_rollout).
  env_mask [B, T]: with turns (rl.environments.turns), the tokens an environment wrote; they are
  context, in prompt_mask and never in completion_mask, so nothing trains on them (None
  without an environment).
  step_rewards: per-step process rewards (`StepRewards`) for a process advantage stage
  (rl.objectives.advantages.process_relative), which consumes them: the batch it returns
  to the loop has None here (as every batch without process rewards).
  experts [B, T, L, k]: an MoE policy's routing record, the experts the sampler ran each
  token through in each layer (`sampling.sampler.routing_record`), which routing replay
  (R3, config.moe.routing_replay) makes the trainer's forward use; None for a dense
  policy and for rows no sampler wrote (teacher-forced warm-start rows).
  behavior_topk: the sampler's top-K distribution per slot (`SamplerTopK`), which score
  centering (config.loss.corrections 'score_centering') reads; None when no correction
  reads it.
  """
  tokens: jax.Array
  prompt_mask: jax.Array
  completion_mask: jax.Array
  behavior_logp: jax.Array
  version: jax.Array
  group: jax.Array
  reward: jax.Array
  advantages: Optional[jax.Array] = None
  prox_logp: Optional[jax.Array] = None
  ref_logp: Optional[jax.Array] = None
  tree: Optional[TreeRows] = None
  env_mask: Optional[jax.Array] = None
  step_rewards: Optional[StepRewards] = None
  experts: Optional[jax.Array] = None
  behavior_topk: Optional[SamplerTopK] = None

  @property
  def token_mask(self) -> jax.Array:
    return self.prompt_mask | self.completion_mask
