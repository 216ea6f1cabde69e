"""config.rollout: how the RL phase samples its batches, with its tree, pruning and
speculative subsections.

The rollout kinds, fork policies and samplers these settings name are in
rl/rollouts/kinds.py and sampling/, which build them from these settings; this module
imports nothing above rl/settings/, so the default config and the launcher's `--help` stay
light.
"""

from __future__ import annotations

import dataclasses

from rl.settings import Settings, nested, setting, used_when


@dataclasses.dataclass(frozen=True)
class TreeSettings(Settings):
  """config.rollout.tree: one tree per prompt (sampling/tree.py), used when kind == 'tree'."""
  SECTION = "rollout.tree"
  policy: str = setting("entropy", "entropy (TreeRL) | segments (TreePO) | lookahead (LATR)")
  advantage: str = setting("treerl", "rl/objectives/advantages.py TREE_ADVANTAGES: treerl "
                           "(value gaps / sqrt(leaves)) | treerl_normalized (/ leaf std) | "
                           "siblings")
  init_chains: int = setting(4, "chains grown from each prompt (M)", low=1)
  fork_points: int = setting(2, "entropy: forks per round at the N highest-entropy tokens",
                             low=1, used_when=used_when("policy", "entropy"))
  branches: int = setting(2, "entropy: branches per fork point (B); segments: b", low=1,
                          used_when=used_when("policy", "entropy", "segments"))
  rounds: int = setting(1, "entropy: fork rounds (L); leaves = M + L*N*B", low=0,
                        used_when=used_when("policy", "entropy"))
  segment_len: int = setting(2, "segments: tokens between branchings (S)", low=1,
                             used_when=used_when("policy", "segments"))
  max_depth: int = setting(2, "segments: branchings; leaves = M * b**max_depth", low=0,
                           used_when=used_when("policy", "segments"))
  leaves: int = setting(8, "lookahead: leaf budget per prompt", low=1,
                        used_when=used_when("policy", "lookahead"))
  top_k: int = setting(2, "lookahead: 1 + children per branching", low=1,
                       used_when=used_when("policy", "lookahead"))
  min_entropy: float = setting(1.0, "lookahead: branch when sampling entropy (nats) >= this",
                               low=0, used_when=used_when("policy", "lookahead"))
  lookahead_steps: int = setting(2, "lookahead: window before a child is checked", low=1,
                                 used_when=used_when("policy", "lookahead"))
  prune_similarity: float = setting(1.0, "lookahead: prune when this fraction matches parent",
                                    low=0, high=1.0, used_when=used_when("policy", "lookahead"))


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings(Settings):
  """config.rollout.speculative: speculative decoding (sampling/speculative.py) drafts
  tokens by n-gram lookup and verifies several per forward, accepting exactly (the same
  distribution as plain decoding)."""
  SECTION = "rollout.speculative"
  tokens: int = setting(0, "draft tokens per forward (k; 0 = plain decoding)", low=0)
  sources: tuple[str, ...] = setting(
      ("prompt_lookup",), "prompt_lookup (the row's own prompt and text) | group (its "
      "siblings' text) | history (the prompt's previous completion; needs task.train_pool); "
      "an earlier-listed source's match wins", used_when=used_when("tokens"))
  ngram: int = setting(3, "longest suffix matched (shorter ones tried after)", low=1,
                       used_when=used_when("tokens"))


@dataclasses.dataclass(frozen=True)
class PruningSettings(Settings):
  """config.rollout.pruning: arrol's online rollout pruning (rl/rollouts/pruning.py), used
  when kind == 'pruned'."""
  SECTION = "rollout.pruning"
  candidates: int = setting(0, "rollouts started per prompt, pruned to group_size after "
                            "prefix_tokens (0 = 2 * group_size)", low=0)
  prefix_tokens: int = setting(0, "completion tokens decoded before the quality head "
                               "decides (0 = max_new_tokens // 4)", low=0)
  positive_share: float = setting(0.5, "share of the survivors taken from the highest "
                                  "predicted success, the rest from the lowest (the target "
                                  "positive-reward ratio rho)", low=0, high=1.0)
  head_lr: float = setting(0.01, "Adam learning rate of the quality head", low=0,
                           low_open=True)
  head_steps: int = setting(4, "quality-head updates on each batch's survivors", low=0)

  def resolved(self, group_size: int, max_new_tokens: int) -> "PruningSettings":
    """The settings with their 0 defaults filled in."""
    return dataclasses.replace(
        self, candidates=self.candidates or 2 * group_size,
        prefix_tokens=self.prefix_tokens or max(max_new_tokens // 4, 1))


@dataclasses.dataclass(frozen=True)
class RolloutSettings(Settings):
  """config.rollout: how the RL phase samples its batches (rl/rollouts/kinds.py builds the
  kind it names; `rl.composition.check` checks the names and what they compose with).

  >>> RolloutSettings(kind="tree", tree=TreeSettings(rounds=2)).check()
  >>> RolloutSettings(tree=TreeSettings(rounds=2)).check()
  Traceback (most recent call last):
  ...
  ValueError: config.rollout.tree.rounds = 2 has no effect with config.rollout.kind = 'independent': it is read only when config.rollout.kind = 'tree'. Set that, or leave config.rollout.tree.rounds at its default 1.
  """
  SECTION = "rollout"
  prompt_len: int = setting(16, "prompt slots (BOS + prompt, left-padded)", low=1)
  max_new_tokens: int = setting(101, "completion slots (the longest worked solution + EOS)",
                                low=1)
  temperature: float = setting(1.0, "sampling temperature of GRPO rollouts (> 0; evaluation "
                               "decodes greedily)", low=0)
  top_k: int = setting(0, "0 = off", low=0)
  top_p: float = setting(1.0, "1.0 = off", low=0, low_open=True, high=1.0)
  group_size: int = setting(8, "completions per prompt (G)", low=1)
  prompts_per_step: int = setting(8, "prompts per GRPO step", low=1)
  kind: str = setting("independent", "independent: group_size samples per prompt; tree: one "
                      "tree per prompt (sampling/tree.py); partial: a resumable pool of rows, "
                      "each round stops once prompts_per_step groups are complete (APRIL / "
                      "CoPRIS; sampling/partial.py); pruned: more rollouts than group_size, "
                      "cut back to group_size after a prefix by a learned quality head "
                      "(arrol; rl/rollouts/pruning.py); ROLLOUT_KINDS")
  tree: TreeSettings = nested(TreeSettings, "used when kind == 'tree'",
                              used_when=used_when("kind", "tree"))
  pruning: PruningSettings = nested(PruningSettings, "used when kind == 'pruned'",
                                    used_when=used_when("kind", "pruned"))
  num_slots: int = setting(0, "partial: pool rows (0 = 2 * prompts_per_step * group_size)",
                           low=0, used_when=used_when("kind", "partial"))
  resume: str = setting("kept_kv", "partial: kept_kv (cheap) | reprefill (exact pi_new)",
                        used_when=used_when("kind", "partial"))
  decode_window: int = setting(0, "partial: most decode steps per round (0 = max_new_tokens)",
                               low=0, used_when=used_when("kind", "partial"))
  train_length_buckets: tuple[int, ...] = setting(
      (24, 48), "completion slots the train step may cut a batch to (its longest row's "
      "bucket; () = always max_new_tokens)")
  speculative: SpeculativeSettings = nested(SpeculativeSettings, "speculative decoding")
  weights: str = setting("", "the sampler's weight format, weight-only (models/quantize.py): "
                         "'' (the trainer's) | bfloat16 | int8 | fp8 | int4 (per-channel "
                         "scales; activations and KV cache stay in model.compute_dtype)")
