"""The reductions a tensor-parallel layer does inside `shard_map` over the `tp` axis.

Row-parallel projections (o_proj, down_proj, out_proj) hold a slice of their input dimension on
every device, so each device's output is a partial sum: `reduce_sum` adds them up.  A gated
RMSNorm whose group spans several devices (Mamba2 with fewer groups than devices) needs its sum
of squares added over those devices only: `group_sum`.

Both take the axis name explicitly (a static attribute of the layer, None when the layer is not
split), so the same layer code runs unsplit, with no axis bound, exactly as before.
"""

from __future__ import annotations

import jax

TP_AXIS = "tp"


def reduce_sum(x: jax.Array, axis: str | None) -> jax.Array:
    """psum of x over `axis`; x itself when axis is None (not under tensor parallelism)."""
    return x if axis is None else jax.lax.psum(x, axis)


def group_sum(x: jax.Array, axis: str | None, group: int) -> jax.Array:
    """Sum x over blocks of `group` consecutive devices of `axis` (device r with devices
    r // group * group ... + group - 1); x itself when axis is None or group == 1.

    x [...] (small: per-token statistics) -> [...] the block's sum.  One all-gather of x, then a
    local sum of this device's block, which keeps every device's result the same within a block.
    """
    if axis is None or group == 1:
        return x
    size = jax.lax.psum(1, axis)  # static under shard_map: the axis size
    if group == size:
        return jax.lax.psum(x, axis)
    everyone = jax.lax.all_gather(x, axis)  # [size, ...]
    blocks = everyone.reshape(size // group, group, *x.shape).sum(axis=1)
    return blocks[jax.lax.axis_index(axis) // group]


__all__ = ["TP_AXIS", "group_sum", "reduce_sum"]
