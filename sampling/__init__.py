"""Sampling: one decode core (`sampler.write_token`, `sampler.make_generation`) under three
policies: plain lockstep decoding (`sampler`), tree rollouts (`tree`) and resumable
partial rollouts (`partial`). Every policy returns the one trajectory type, `Generation`.
"""

from sampling.partial import (RESUME_MODES, PartialConfig, RolloutPool, clear,
                              complete_groups, fill, init_pool, oldest_version, run_round, take)
from sampling.sampler import (Generation, SamplerState, SamplingConfig, TreePaths, generate,
                              sample)
from sampling.tree import EntropyFork, FixedSegments, ForkPolicy, Lookahead, tree_generate

__all__ = [
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
    "take",
    "tree_generate",
]
