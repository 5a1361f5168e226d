"""Pieces both recurrent mixers (Mamba2, gated DeltaNet) are built from: the causal depthwise
conv over the mixer's input channels, the gated RMSNorm before out_proj, and the rule that says
when a row's state starts from zero."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..pallas_kernels.rms_norm import gated_rms_norm, gated_rms_norm_reference, norm_backend
from ..parallel.collectives import group_sum
from .layers import normal_init


def first_chunk(batch: Batch) -> jax.Array:
    """[B] bool: this step starts the row's request (nothing cached before it), so the prefill
    kernels start from a zero state instead of reading the slot.  Rows with q_len 0 never reset:
    a paused request keeps its state.

    A request's first tokens must come through a T > 1 (prefill) step: the decode kernels always
    read the slot.  The scheduler's prefill buckets guarantee that.
    """
    return (batch.kv_lens == batch.q_lens) & (batch.q_lens > 0)


class DepthwiseConv1d(nnx.Module):
    """Causal depthwise conv1d, weight [C, 1, K] as torch's nn.Conv1d(groups=C) stores it."""

    def __init__(self, channels: int, kernel: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (channels, 1, kernel), dtype, std=0.2))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype)) if bias else None

    @property
    def kernel_weight(self) -> jax.Array:
        """[C, K], the layout the state kernels take."""
        return self.weight[...][:, 0, :]

    @property
    def bias_or_none(self) -> jax.Array | None:
        return None if self.bias is None else self.bias[...]

    def dense(self, x: jax.Array) -> jax.Array:
        """x [B, T, C] from a zero history -> fp32 [B, T, C] (before the activation)."""
        w = self.kernel_weight.astype(jnp.float32)
        k = w.shape[1]
        t = x.shape[1]
        padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (k - 1, 0), (0, 0)))
        out = sum(padded[:, j:j + t, :] * w[:, j] for j in range(k))
        return out if self.bias is None else out + self.bias[...].astype(jnp.float32)


class GatedRMSNorm(nnx.Module):
    """w * RMSNorm(y) gated by silu(z), over groups of `group_size` channels of the last axis.

    norm_before_gate=False (Mamba2): w * norm(y * silu(z)).
    norm_before_gate=True (gated DeltaNet): w * norm(y) * silu(z).
    The casts follow transformers: statistics in fp32, w multiplies in the input dtype.
    Tensor parallelism with fewer groups than devices splits one group over `group_shards`
    consecutive devices of `reduce_axis` (set by sharding.py): the sum of squares is then added
    over them.
    """

    def __init__(self, dim: int, *, group_size: int, eps: float, norm_before_gate: bool, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.reduce_axis, self.group_shards = None, 1

    def __call__(self, y: jax.Array, z: jax.Array, z_offset: int = 0) -> jax.Array:
        """y [..., D], z [..., W] (the gate: channels z_offset .. z_offset + D, so a projection's
        output can be passed whole) -> [..., D] in y.dtype.  D is dim, or a multiple of it when
        every group shares the weight (dim == group_size: DeltaNet's heads).  One Pallas kernel on a
        GPU, which reads z in place (pallas_kernels/rms_norm.py), unless a group is split over
        devices."""
        dtype = y.dtype
        if self.reduce_axis is None or self.group_shards == 1:
            kw = dict(eps=self.eps, group_size=self.group_size, norm_before_gate=self.norm_before_gate,
                      z_offset=z_offset)
            if norm_backend() == "pallas" and self.weight.dtype == dtype:
                return gated_rms_norm(y, z, self.weight[...], interpret=jax.default_backend() != "gpu", **kw)
            return gated_rms_norm_reference(y, z, self.weight[...], **kw)
        z = jax.lax.slice_in_dim(z, z_offset, z_offset + y.shape[-1], axis=-1)
        yf = y.astype(jnp.float32)
        gate = jax.nn.silu(z.astype(jnp.float32))
        if not self.norm_before_gate:
            yf = yf * gate
        g = yf.reshape(*yf.shape[:-1], -1, self.group_size)
        # this device holds 1/group_shards of the group's channels
        ms = group_sum(jnp.sum(g * g, axis=-1, keepdims=True), self.reduce_axis, self.group_shards)
        ms = ms / (self.group_size * self.group_shards)
        g = g * jax.lax.rsqrt(ms + self.eps)
        out = self.weight[...] * g.reshape(yf.shape).astype(dtype)
        if self.norm_before_gate:
            out = (out.astype(jnp.float32) * gate).astype(dtype)
        return out


__all__ = ["DepthwiseConv1d", "GatedRMSNorm", "first_chunk"]
