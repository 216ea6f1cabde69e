"""Sampling: one decode core (`sampler.write_token`, `sampler.make_generation`) under four
policies: plain lockstep decoding (`sampler`), tree rollouts (`tree`), resumable partial
rollouts (`partial`) and lossless speculative decoding with model-free drafts
(`speculative`). Every policy returns the one trajectory type, `Generation`.
"""

from sampling.partial import (RESUME_MODES, PartialConfig, RolloutPool, clear,
                              complete_groups, fill, init_pool, oldest_version, run_round, take)
from sampling.sampler import (DraftStats, Generation, SamplerState, SamplingConfig, TreePaths,
                              generate, sample)
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
    "TreePaths",
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
