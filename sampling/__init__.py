"""Sampling: one decode core (`sampler.write_token`, `sampler.make_generation`) under four
policies: plain lockstep decoding (`sampler`), tree rollouts (`tree`), resumable partial
rollouts (`partial`) and lossless speculative decoding with model-free drafts
(`speculative`). Every policy returns the one trajectory type, `Generation`. A partial
pool's rows can also take tokens the policy did not write between rounds
(`append_observations`: the turns of rl.environments.turns).
"""

from sampling.partial import (RESUME_MODES, PartialConfig, RolloutPool, append_observations,
                              clear, complete_groups, fill, init_pool, oldest_version, run_round,
                              take)
from sampling.sampler import (DraftStats, Generation, SamplerState, SamplingConfig, ToolRows,
                              TreePaths, generate, sample)
from sampling.speculative import DraftConfig, speculative_generate
from sampling.tree import EntropyFork, FixedSegments, ForkPolicy, Lookahead, tree_generate

__all__ = [
    "DraftConfig",
    "DraftStats",
    "EntropyFork",
    "FixedSegments",
    "ForkPolicy",
    "Generation",
    "Lookahead",
    "PartialConfig",
    "RESUME_MODES",
    "RolloutPool",
    "SamplerState",
    "SamplingConfig",
    "ToolRows",
    "TreePaths",
    "append_observations",
    "clear",
    "complete_groups",
    "fill",
    "generate",
    "init_pool",
    "oldest_version",
    "run_round",
    "sample",
    "speculative_generate",
    "take",
    "tree_generate",
]
