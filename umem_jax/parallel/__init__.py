"""Tensor parallelism over a `tp` mesh axis (DESIGN.md, scale-out).

    mesh.py           the 1-D `tp` mesh, the arena's sharding, shard_map across jax versions,
                      multi-host start (jax.distributed)
    collectives.py    the reductions layers do inside shard_map (no-ops without a tp axis)
    sharding.py       per-device model config and the Megatron split of every weight
    sharded_model.py  ShardedModel: a Model whose forward runs under shard_map over `tp`

Only mesh and collectives are imported here: the models import collectives, and sharding imports
the models, so importing sharding from this package's __init__ would be circular.
"""

from .collectives import TP_AXIS, group_sum, reduce_sum
from .mesh import arena_sharding, init_distributed, shard_map, tp_mesh

__all__ = ["TP_AXIS", "arena_sharding", "group_sum", "init_distributed", "reduce_sum", "shard_map", "tp_mesh"]
