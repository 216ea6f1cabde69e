"""Advantage estimators: pure functions of rewards and group ids (docs/concepts.md).

Equal rewards give exactly zero advantage. In float32 the mean of seven 0.7s is not 0.7,
and GRPO divides that one-ulp residue by a std of the same size plus eps = 1e-6, which
gave every row of such a group an advantage of ~0.06 (reasoning-gym's partial credit makes
equal fractional groups common). So group statistics are computed on rewards shifted by
a per-group reference (`group_reference`): the differences of equal values are exact
zeros, so equal rewards centre to exactly 0; and a std below `REL_STD_TOL` times the
group's reward scale is float noise, not signal, so it standardises to 0 (`standardise`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from rl import stages
from rl.registry import Registry
from rl.types import Rollout

# The loop's advantage stage: batch -> per-token advantages [B, T] of its completion tokens,
# computed once on the final batch (`group_relative`, `per_tree`).
BatchAdvantages = Callable[[Rollout], jax.Array]


def _same_group(group: jax.Array) -> jax.Array:
  """[B, B] float matrix: 1 where two rows belong to the same group (prompt)."""
  return (group[:, None] == group[None, :]).astype(jnp.float32)


# A std at most this fraction of the group's largest |value| is rounding noise (about 8
# float32 ulps), and standardises to 0 rather than to +-1.
REL_STD_TOL = 1e-6


def group_reference(values: jax.Array, group: jax.Array) -> jax.Array:
  """The smallest value of each row's group, broadcast to rows [B]: the shift that makes
  group statistics exact for equal values (see the module docstring)."""
  same = group[:, None] == group[None, :]
  return jnp.min(jnp.where(same, values[None, :], jnp.inf), axis=1)


def group_mean(values: jax.Array, group: jax.Array) -> jax.Array:
  """Mean of `values` over each row's group, broadcast back to rows. [B] -> [B].

  Computed as reference + mean(values - reference), so a group of equal values has
  exactly that value as its mean.
  """
  same = _same_group(group)
  reference = group_reference(values, group)
  return reference + same @ (values - reference) / same.sum(axis=1)


def group_std(values: jax.Array, group: jax.Array) -> jax.Array:
  """Population (ddof=0) standard deviation of `values` within each row's group."""
  centred = values - group_mean(values, group)
  return jnp.sqrt(group_mean(centred * centred, group))


def group_scale(values: jax.Array, group: jax.Array) -> jax.Array:
  """Largest |value| of each row's group, broadcast to rows [B] (the scale of its noise)."""
  same = group[:, None] == group[None, :]
  return jnp.max(jnp.where(same, jnp.abs(values)[None, :], 0.0), axis=1)


def standardise(centred: jax.Array, std: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """centred / (std + eps), or exactly 0 where std <= REL_STD_TOL * scale (the values
  differ only by rounding). Shapes broadcast."""
  return jnp.where(std > REL_STD_TOL * scale, centred / (std + eps), 0.0)


def grpo_advantages(reward: jax.Array, group: jax.Array, eps: float = 1e-6) -> jax.Array:
  """GRPO (DeepSeekMath): (r - mean_group(r)) / (std_group(r) + eps).

  The std is the population std (ddof=0); a group whose rewards are all equal gets
  exactly 0, fractional rewards included.

  Args:
    reward: [B] rewards.
    group: [B] group ids (rows of one prompt share one).
    eps: added to the std.

  Returns:
    [B] advantages.

  >>> import jax.numpy as jnp
  >>> adv = grpo_advantages(jnp.array([1.0, 0.0, 0.5, 0.5]), jnp.array([0, 0, 1, 1]))
  >>> [round(a, 4) for a in adv.tolist()]  # std 0.5: (1 - 0.5) / 0.5; the equal group: 0
  [1.0, -1.0, 0.0, 0.0]
  """
  reward = reward.astype(jnp.float32)
  return standardise(reward - group_mean(reward, group), group_std(reward, group),
                     group_scale(reward, group), eps)


def drgrpo_advantages(reward: jax.Array, group: jax.Array) -> jax.Array:
  """Dr.GRPO (Understanding R1-Zero-like training): r - mean_group(r), no std division."""
  reward = reward.astype(jnp.float32)
  return reward - group_mean(reward, group)


def rloo_advantages(reward: jax.Array, group: jax.Array) -> jax.Array:
  """RLOO (REINFORCE leave-one-out): r_i - mean of the other rewards of the group,
  = G / (G - 1) * (r_i - mean_group(r)). A group of one gets 0. Computed on rewards
  shifted by the group reference, so equal rewards give exactly 0."""
  shifted = reward.astype(jnp.float32) - group_reference(reward.astype(jnp.float32), group)
  same = _same_group(group)
  size = same.sum(axis=1)
  others = (same @ shifted - shifted) / jnp.maximum(size - 1.0, 1.0)
  return jnp.where(size > 1, shifted - others, 0.0)


def median_advantages(reward: jax.Array, group: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Median baseline (MC-GRPO): (r - median_group(r)) / (std_group(r) + eps).

  With an odd group (G + 1 samples) the median sample's advantage is exactly 0, so it is
  excluded from the gradient; with an even group the baseline is the mean of the two
  middle rewards. The std scale (population) is GRPO's, chosen so step sizes match.
  """
  reward = reward.astype(jnp.float32)
  same = _same_group(group) > 0
  median = jnp.nanmedian(jnp.where(same, reward[None, :], jnp.nan), axis=1)
  return standardise(reward - median, group_std(reward, group), group_scale(reward, group), eps)


# Estimators fn(reward [B], group [B]) -> advantage [B], by config.advantage.name.
ADVANTAGES: Registry[Callable[[jax.Array, jax.Array], jax.Array]] = Registry(
    "advantage estimator", "config.advantage.name")
ADVANTAGES.register("grpo", grpo_advantages)
ADVANTAGES.register("drgrpo", drgrpo_advantages)
ADVANTAGES.register("rloo", rloo_advantages)
ADVANTAGES.register("median", median_advantages)
get_advantage_fn = ADVANTAGES.get


def group_relative(estimator: Callable[[jax.Array, jax.Array], jax.Array]) -> BatchAdvantages:
  """The advantage stage of independent groups: `estimator(reward, group)` (an ADVANTAGES
  entry), each row's value on every one of its completion tokens (rows masked out of the
  loss, such as a rejected group's, get 0)."""
  def batch_advantages(batch: Rollout) -> jax.Array:
    return estimator(batch.reward, batch.group)[:, None] * batch.completion_mask
  return batch_advantages


# --- Tree advantages (docs/concepts.md). ---
#
# A tree rollout is a batch of root-to-leaf rows (rl.types.Rollout tree fields): row r of
# group g is node `node[r]` of g's tree, forked from the row whose node id is `parent[r]`
# (-1: a chain from the prompt) after sharing its first `prefix_len[r]` completion tokens.
# A completion token (r, j) was decoded by its *owner* row: r itself when j >= prefix_len[r],
# else the owner of (parent, j). Two leaves share token j exactly when their owners of j
# agree, so a token's leaf set is {s : owner(s, j) == owner(r, j)}. A tree node is a maximal
# run of tokens of one row with the same leaf set; along a row the leaf sets shrink at
# each branch point, so a node starts where the leaf count drops.


def tree_token_owners(group: jax.Array, node: jax.Array, parent: jax.Array,
                      prefix_len: jax.Array, completion_len: int) -> jax.Array:
  """Batch row that decoded each completion position: [B] fields -> owner [B, N].

  Rows with node < 0 (unused slots) own nothing: their entries are -1.
  """
  rows = jnp.arange(group.shape[0])
  is_parent = ((group[:, None] == group[None, :]) & (node[None, :] == parent[:, None])
               & (parent[:, None] >= 0) & (node[None, :] >= 0))
  parent_row = jnp.where(is_parent.any(axis=1), jnp.argmax(is_parent, axis=1), -1)
  pos = jnp.arange(completion_len)[None, :]
  owner = jnp.broadcast_to(rows[:, None], (rows.shape[0], completion_len))

  def climb(owner):
    inherited = pos < prefix_len[owner]
    return jnp.where(inherited & (parent_row[owner] >= 0), parent_row[owner], owner)

  owner = jax.lax.while_loop(lambda o: jnp.any(climb(o) != o), climb, owner)
  return jnp.where(node[:, None] >= 0, owner, -1)


def tree_node_values(reward: jax.Array, group: jax.Array, node: jax.Array, parent: jax.Array,
                     prefix_len: jax.Array, completion_mask: jax.Array) -> dict[str, jax.Array]:
  """Per-token node statistics of tree rollouts, all [B, N] (N = completion slots).

  completion_mask [B, N] marks each leaf's whole completion (shared prefix included).
  Returns owner, value (V(n): mean reward of the leaves below the token's node), leaves
  (#leaves(n)), start (node's first completion position), parent_value (V of the node
  before it; V(root), the group's mean leaf reward, for a node starting at position 0),
  root_value, root_std (population std of the group's leaf rewards), root_scale (the
  group's largest |reward|, for `standardise`), and valid.
  """
  batch, completion_len = completion_mask.shape
  leaf = node >= 0
  reward = jnp.where(leaf, reward.astype(jnp.float32), 0.0)
  # Sums run over rewards shifted by the group's smallest leaf reward, so a group of equal
  # rewards has every value exactly equal (and so every difference exactly 0).
  same = ((group[:, None] == group[None, :]) & leaf[None, :]).astype(jnp.float32)
  reference = jnp.min(jnp.where(same > 0, reward[None, :], jnp.inf), axis=1)
  reference = jnp.where(jnp.isfinite(reference), reference, 0.0)
  shifted = jnp.where(leaf, reward - reference, 0.0)
  owner = tree_token_owners(group, node, parent, prefix_len, completion_len)
  valid = completion_mask & leaf[:, None]
  ids = jnp.where(valid, owner * completion_len + jnp.arange(completion_len)[None, :],
                  batch * completion_len)
  segments = batch * completion_len + 1
  total = jax.ops.segment_sum(jnp.where(valid, shifted[:, None], 0.0).reshape(-1),
                              ids.reshape(-1), segments)
  count = jax.ops.segment_sum(valid.astype(jnp.float32).reshape(-1), ids.reshape(-1), segments)
  leaves = jnp.where(valid, count[ids], 0.0)
  value = jnp.where(valid, reference[:, None] + total[ids] / jnp.maximum(count[ids], 1.0), 0.0)
  root_count = jnp.maximum(same.sum(axis=1), 1.0)
  root_mean = same @ shifted / root_count  # the root's value, less the reference
  root_value = reference + root_mean
  root_std = jnp.sqrt(same @ (shifted - root_mean) ** 2 / root_count)
  pos = jnp.arange(completion_len)[None, :]
  previous = jnp.pad(leaves, ((0, 0), (1, 0)), constant_values=jnp.inf)[:, :-1]
  is_start = valid & (leaves < previous)
  start = jax.lax.cummax(jnp.where(is_start, pos, 0), axis=1)
  before = jnp.take_along_axis(value, jnp.maximum(start - 1, 0), axis=1)
  parent_value = jnp.where(start > 0, before, root_value[:, None])
  return dict(owner=owner, value=value, leaves=leaves, start=start, parent_value=parent_value,
              root_value=root_value, root_std=root_std, root_scale=group_scale(reward, group),
              valid=valid, is_start=is_start)


def treerl_advantages(reward: jax.Array, group: jax.Array, node: jax.Array, parent: jax.Array,
                      prefix_len: jax.Array, completion_mask: jax.Array, *,
                      normalize: bool = False, eps: float = 1e-6) -> jax.Array:
  """TreeRL token advantages [B, N], the method's formula at its own scale:
  ((V(n) - V(root)) + (V(n) - V(parent(n)))) / sqrt(#leaves(n)).

  normalize=True (registered as 'treerl_normalized') averages the two terms instead of
  summing them and divides by the group's leaf-reward std + eps, so a tree without forks
  (every leaf a chain from the prompt) gets exactly GRPO's advantages; the spec does not
  say this, so it is an option, not the default. Tokens of one node get one value in
  every row that contains them; unused rows and padding get 0; a group of equal leaf
  rewards gets exactly 0.
  """
  s = tree_node_values(reward, group, node, parent, prefix_len, completion_mask)
  raw = (s["value"] - s["root_value"][:, None]) + (s["value"] - s["parent_value"])
  scaled = raw / jnp.sqrt(jnp.maximum(s["leaves"], 1.0))
  if normalize:
    scaled = standardise(0.5 * scaled, s["root_std"][:, None], s["root_scale"][:, None], eps)
  return jnp.where(s["valid"], scaled, 0.0)


def sibling_advantages(reward: jax.Array, group: jax.Array, node: jax.Array, parent: jax.Array,
                       prefix_len: jax.Array, completion_mask: jax.Array,
                       eps: float = 1e-6) -> jax.Array:
  """BranchGRPO-style token advantages [B, N]: a node's value normalised among its siblings,
  (V(n) - mean_siblings V) / (std_siblings V + eps) (population std).

  Siblings are the nodes with the same parent node (the root's children for nodes that
  start at position 0), so a tree without forks gets exactly GRPO's advantages.
  """
  s = tree_node_values(reward, group, node, parent, prefix_len, completion_mask)
  batch, completion_len = completion_mask.shape
  rows = jnp.arange(batch)
  first_row = jnp.argmax(group[:, None] == group[None, :], axis=1)
  before = jnp.maximum(s["start"] - 1, 0)
  parent_owner = jnp.take_along_axis(s["owner"], before, axis=1)
  parent_id = jnp.where(s["start"] > 0, parent_owner * completion_len + before,
                        batch * completion_len + first_row[:, None])
  # Each node counted once: at its first token, in the row that decoded it.
  once = s["is_start"] & (s["owner"] == rows[:, None])
  segments = batch * completion_len + batch + 1
  ids = jnp.where(once, parent_id, segments - 1).reshape(-1)
  # Values relative to the root: exactly 0 throughout a group of equal rewards.
  value = s["value"] - s["root_value"][:, None]
  n = jax.ops.segment_sum(once.astype(jnp.float32).reshape(-1), ids, segments)
  total = jax.ops.segment_sum(jnp.where(once, value, 0.0).reshape(-1), ids, segments)
  mean = total / jnp.maximum(n, 1.0)
  centred = jnp.where(once, value - mean[parent_id], 0.0)
  square = jax.ops.segment_sum((centred ** 2).reshape(-1), ids, segments)
  std = jnp.sqrt(square / jnp.maximum(n, 1.0))
  adv = standardise(value - mean[parent_id], std[parent_id], s["root_scale"][:, None], eps)
  return jnp.where(s["valid"], adv, 0.0)


def treerl_normalized_advantages(*args, eps: float = 1e-6) -> jax.Array:
  """TreeRL with normalize=True: the two terms averaged and divided by the group's
  leaf-reward std (a tree without forks gets GRPO's advantages)."""
  return treerl_advantages(*args, normalize=True, eps=eps)


# Tree estimators fn(reward, group, node, parent, prefix_len, completion_mask) -> per-token
# advantages, by config.rollout.tree.advantage.
TREE_ADVANTAGES: Registry[Callable[..., jax.Array]] = Registry(
    "tree advantage estimator", "config.rollout.tree.advantage")
TREE_ADVANTAGES.register("treerl", treerl_advantages)
TREE_ADVANTAGES.register("treerl_normalized", treerl_normalized_advantages)
TREE_ADVANTAGES.register("siblings", sibling_advantages)
get_tree_advantage_fn = TREE_ADVANTAGES.get


def per_tree(estimator: Callable[..., jax.Array], prompt_len: int) -> BatchAdvantages:
  """The advantage stage of tree batches (rl.rollouts.batches.tree_rollout): `estimator`
  (a TREE_ADVANTAGES entry) over each tree's nodes, every token getting its node's
  advantage in the row that decoded it (its completion_mask; the prefix a row shares with
  its parent is context there). A row's whole root-to-leaf completion is its token mask
  after the `prompt_len` prompt slots."""
  def batch_advantages(batch: Rollout) -> jax.Array:
    path = (batch.prompt_mask | batch.completion_mask)[:, prompt_len:]
    tree = batch.tree
    token_adv = estimator(batch.reward, batch.group, tree.node, tree.parent, tree.prefix_len,
                          path)
    return jnp.pad(token_adv, ((0, 0), (prompt_len, 0))) * batch.completion_mask
  return batch_advantages


# --- Process advantages (PURE, arXiv 2504.15275): per-step rewards, per-token returns. ---


def _suffix_sum(x: jax.Array) -> jax.Array:
  """sum over positions >= t of x[:, t'], for every t: [B, T] -> [B, T]."""
  return jnp.flip(jnp.cumsum(jnp.flip(x, axis=1), axis=1), axis=1)


def _leave_one_out_mean(values: jax.Array, group: jax.Array) -> jax.Array:
  """Mean of `values` over the other rows of each row's group [B] (0 for a group of one)."""
  same = _same_group(group)
  size = same.sum(axis=1)
  return jnp.where(size > 1, (same @ values - values) / jnp.maximum(size - 1.0, 1.0), 0.0)


def pure_advantages(step_value: jax.Array, step_mask: jax.Array, reward: jax.Array,
                    group: jax.Array, completion_mask: jax.Array, *, form: str,
                    verifier_coef: float = 1.0) -> jax.Array:
  """PURE's process-reward returns (arXiv 2504.15275) as per-token advantages [B, T].

  A row's steps j = 1..m end at tokens p_1 < ... < p_m with process rewards r_j (a perfect
  process reward model's p(correct) - p(wrong): +1 or -1). Each form turns them into
  per-step rewards r'_j whose return-to-go is the value of token t:
  - min-form: r'_j = M_j - M_{j+1} with M_j = min over l >= j of r_l (M_{m+1} = 0), so
    the return at a token of step t is min over j >= t of r_j: the worst step still ahead
    (METHODS.md's exact min; PURE's code approximates a min with softmax(-r / 0.1) weights
    over all steps, which we do not).
  - sum-form: r'_j = r_j / m, so the return is the mean reward over the row's steps
    summed from t on (PURE's code divides by the step count with its
    disable_weighted_reward switch; the paper's comparison is this form's credit).
  Baseline (PURE's `reward_baseline='step'`, a leave-one-out baseline per step): each row
  has o = sum_j r'_j (its return at its first step), and b_i = the mean of o_k / m_k over
  the other rows k of its group (o_k / m_k = 0 for a row without steps); every step
  reward becomes r'_j - b_i, so token t's return is the form's value at t minus b_i times
  the number of steps that end at or after t.
  Verifier reward (PURE's PRM+VR mode): v_i = reward_i - 1 (0 for a pass, -1 for a
  failure), centred leave-one-out over the group and added at the row's last token with
  weight `verifier_coef`, so every completion token's return includes it. A group of one
  has neither baseline: its verifier term is 0 (as RLOO's advantage) and its process
  returns are the form's values.
  Unlike PURE's code, step-end tokens keep their return (PURE zeroes their advantage: its
  step separators are special tokens; a running_sum step ends on a digit the policy
  chose).

  Args:
    step_value: [B, T] each step's reward at its last token (`rl.types.StepRewards`).
    step_mask: [B, T] the steps' last tokens.
    reward: [B] the outcome reward (the verifier's pass: 1).
    group: [B] group ids.
    completion_mask: [B, T] the tokens trained.
    form: 'min' or 'sum'.
    verifier_coef: weight of the verifier reward (0: process rewards alone).

  Returns:
    [B, T] advantages, 0 outside completion_mask.
  """
  if form not in ("min", "sum"):
    raise ValueError(f"PURE credit form {form!r}: use 'min' or 'sum'.")
  mask = step_mask & completion_mask
  value = jnp.where(mask, step_value.astype(jnp.float32), 0.0)
  steps = mask.sum(axis=1).astype(jnp.float32)
  steps_ahead = _suffix_sum(mask.astype(jnp.float32))
  if form == "min":
    ahead = jax.lax.cummin(jnp.where(mask, value, jnp.inf), axis=1, reverse=True)
    credit = jnp.where(steps_ahead > 0, ahead, 0.0)
  else:
    credit = _suffix_sum(value) / jnp.maximum(steps, 1.0)[:, None]
  first = credit[:, 0]  # o_i: the return over all steps (a step ends after position 0)
  per_step = jnp.where(steps > 0, first / jnp.maximum(steps, 1.0), 0.0)
  baseline = _leave_one_out_mean(per_step, group)
  returns = credit - baseline[:, None] * steps_ahead
  verifier = reward.astype(jnp.float32) - 1.0
  alone = _same_group(group).sum(axis=1) < 2
  verifier = jnp.where(alone, 0.0, verifier - _leave_one_out_mean(verifier, group))
  returns = returns + verifier_coef * verifier[:, None]
  return jnp.where(completion_mask, returns, 0.0)


# Process estimators fn(step_value, step_mask, reward, group, completion_mask, verifier_coef)
# -> per-token advantages, by config.advantage.name (they need process rewards: the
# task's `step_rewards`, rl/rewards.py).
PROCESS_ADVANTAGES: Registry[Callable[..., jax.Array]] = Registry(
    "process advantage estimator", "config.advantage.name")
PROCESS_ADVANTAGES.register(
    "pure_min", lambda *args, verifier_coef: pure_advantages(*args, form="min",
                                                             verifier_coef=verifier_coef))
PROCESS_ADVANTAGES.register(
    "pure_sum", lambda *args, verifier_coef: pure_advantages(*args, form="sum",
                                                             verifier_coef=verifier_coef))


def process_relative(estimator: Callable[..., jax.Array], verifier_coef: float) -> BatchAdvantages:
  """The advantage stage of batches with process rewards (`Rollout.step_rewards`, set by
  rl.rewards' stage): `estimator` (a PROCESS_ADVANTAGES entry) over each row's steps."""
  def batch_advantages(batch: Rollout) -> jax.Array:
    if batch.step_rewards is None:
      raise ValueError("A process advantage estimator (config.advantage.name = pure_min | "
                       "pure_sum) needs the batch's step rewards; rl.wiring sets the reward "
                       "stage that adds them (rl.rewards.RewardStage with process=True).")
    steps = batch.step_rewards
    return estimator(steps.value, steps.mask, batch.reward, batch.group,
                     batch.completion_mask, verifier_coef=verifier_coef)
  return batch_advantages


def advantage_stage(batch_advantages: BatchAdvantages) -> stages.Stage:
  """The advantage stage (`rl.stages`): the batch with its per-token advantages, computed
  once on the final batch by `batch_advantages` (whatever rounds, rejections or pool made
  it). Step rewards (a process estimator's input) are consumed here: the batch goes on
  without them."""
  def apply(rollout, stats, state, **extras):
    del extras
    return rollout.replace(advantages=batch_advantages(rollout), step_rewards=None), stats, state

  return stages.Stage(init=lambda: None, apply=apply, name="advantages",
                      declares=stages.Declaration(writes=frozenset({"advantages"})))


def is_process(name: str) -> bool:
  """Whether config.advantage.name is a process estimator (it reads per-step rewards)."""
  return name in PROCESS_ADVANTAGES.names()
