"""The `tp` mesh and its collectives, below the models: the 1-D mesh, the arena's sharding,
shard_map across jax versions, the multi-host start, and the reductions layers do inside
shard_map (no-ops without a tp axis).  How each model's weights split is the models' own
business (models/sharding.py)."""

from .collectives import TP_AXIS, group_sum, reduce_sum
from .mesh import arena_sharding, init_distributed, shard_map, tp_mesh

__all__ = ["TP_AXIS", "arena_sharding", "group_sum", "init_distributed", "reduce_sum", "shard_map", "tp_mesh"]
