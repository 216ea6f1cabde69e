"""Device mesh, partition rules, resharding between layouts, multi-host start-up.

`rl` and `experiments` apply these to the pure functions of `models` and `sampling`, which
never mention devices. docs/pod.md shows how to run on several GPUs or a pod slice.
"""

from sharding.mesh import AXES, BATCH_AXES, MeshConfig, make_mesh
from sharding.reshard import make_publish, make_reshard
from sharding.rules import (BATCH_RULES, SAMPLER_RULES, SAMPLER_STATE_RULES, TRAINER_RULES,
                            tree_shardings)

__all__ = [
    "AXES",
    "BATCH_AXES",
    "BATCH_RULES",
    "MeshConfig",
    "SAMPLER_RULES",
    "SAMPLER_STATE_RULES",
    "TRAINER_RULES",
    "make_mesh",
    "make_publish",
    "make_reshard",
    "tree_shardings",
]
