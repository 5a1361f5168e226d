"""Gated DeltaNet mixer (Qwen3.5 `linear_attention` layers), Hk key heads of Dk and Hv value heads of Dv.

    qkv   = silu(causal_conv1d(in_proj_qkv(x)))  -> q, k [Hk, Dk] | v [Hv, Dv]   (contiguous Q | K | V)
    q, k  = l2norm(q), l2norm(k);  q *= Dk^-0.5;  value head h reads key head h // (Hv / Hk)
    beta  = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)      [Hv]
    S_h   = exp(g) S_h;  S_h += k (outer) beta (v - S_h^T k);  o_h = S_h^T q               S_h [Dk, Dv]
    out   = out_proj(GatedRMSNorm(o, in_proj_z(x)))   (norm per head over Dv, then gate)

Parameter names are the checkpoint's (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
`conv1d.weight` [conv_dim, 1, K] with no bias, `dt_bias`, `A_log`, `norm.weight` [Dv],
`out_proj`).  As for Mamba2: `dense` is a per-token scan written here; `__call__` goes through
pallas_kernels.gated_deltanet (`gdn_prefill` for T > 1, `gdn_decode` for T == 1) and the
request's state slot, whose recurrent matrix is stored v-major ([Hv, Dv, Dk], HF's transposed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..pallas_kernels.gated_deltanet import L2NORM_EPS, gdn_decode, gdn_prefill
from ..pallas_kernels.recurrent import Cols
from ..pallas_kernels.mamba2 import softplus
from .arena_slot import ArenaSlot
from .layers import FusedLinear, Linear
from .recurrent import DepthwiseConv1d, GatedRMSNorm, first_chunk


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


class GatedDeltaNet(nnx.Module):
    def __init__(self, hidden: int, *, k_heads: int, v_heads: int, k_dim: int, v_dim: int, conv_kernel: int,
                 eps: float, dtype, rngs: nnx.Rngs):
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads {v_heads} must be a multiple of linear_num_key_heads {k_heads}")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = k_heads, v_heads, k_dim, v_dim
        self.key_dim, self.value_dim = k_heads * k_dim, v_heads * v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = Linear(hidden, conv_dim, dtype=dtype, rngs=rngs)
        self.in_proj_z = Linear(hidden, self.value_dim, dtype=dtype, rngs=rngs)
        self.in_proj_b = Linear(hidden, v_heads, dtype=dtype, rngs=rngs)
        self.in_proj_a = Linear(hidden, v_heads, dtype=dtype, rngs=rngs)
        self.conv1d = DepthwiseConv1d(conv_dim, conv_kernel, bias=False, dtype=dtype, rngs=rngs)
        # transformers' init: dt_bias = 1, A ~ U(0.01, 16); a fixed spread here (random builds only).
        self.dt_bias = nnx.Param(jnp.ones((v_heads,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(0.5, 16.0, v_heads)).astype(dtype))
        self.norm = GatedRMSNorm(v_dim, group_size=v_dim, eps=eps, norm_before_gate=True, dtype=dtype)
        self.out_proj = Linear(self.value_dim, hidden, dtype=dtype, rngs=rngs)
        self.in_proj = nnx.data(None)  # FusedLinear over qkv | z | b | a once fuse_projections() ran

    def fuse_projections(self, donate: bool = False) -> bool:
        """Replace the four input projections by one FusedLinear over their stacked weights."""
        if self.in_proj is not None:  # fused already
            return False
        self.in_proj = FusedLinear([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a], donate=donate)
        self.in_proj_qkv = self.in_proj_z = self.in_proj_b = self.in_proj_a = None
        return True

    def _project(self, x: jax.Array):
        """x [B, T, hidden] -> qkv [B, T, conv_dim], (zs, z_offset), b [B, T, Hv], a [B, T, Hv]: z
        [B, T, Hv*Dv] is zs[..., z_offset:z_offset + Hv*Dv] (the fused projection's whole output,
        which the gated norm's kernel reads in place)."""
        if self.in_proj is not None:
            y, starts = self.in_proj.product(x), self.in_proj.starts
            qkv, _, b, a = (y[..., s:s + n] for s, n in zip(starts, self.in_proj.sizes))
            return qkv, (y, starts[1]), b, a
        return self.in_proj_qkv(x), (self.in_proj_z(x), 0), self.in_proj_b(x), self.in_proj_a(x)

    def _out(self, o: jax.Array, z, dtype) -> jax.Array:
        """o [B, T, Hv, Dv], z (zs, z_offset) as _project gives it -> out_proj(GatedRMSNorm(o, z))
        [B, T, hidden] (one group a head, all heads sharing the norm's weight)."""
        b, t = o.shape[:2]
        o = self.norm(o.astype(dtype).reshape(b, t, self.value_dim), z[0], z_offset=z[1])
        return self.out_proj(o)

    # ------------------------------------------------------------------ dense (cache-free)
    def dense(self, x: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        """x [B, T, hidden] from a zero state; valid [B, T] (padding zeroed before the projections
        and after the conv, as transformers does) -> [B, T, hidden]."""
        del positions
        b, t, _ = x.shape
        mask = valid[..., None].astype(x.dtype)
        x = x * mask
        qkv, z, beta, a = self._project(x)
        qkv = jax.nn.silu(self.conv1d.dense(qkv)) * mask.astype(jnp.float32)
        values_per_key = self.v_heads // self.k_heads
        q = _l2norm(qkv[..., :self.key_dim].reshape(b, t, self.k_heads, self.k_dim)) * self.k_dim ** -0.5
        k = _l2norm(qkv[..., self.key_dim:2 * self.key_dim].reshape(b, t, self.k_heads, self.k_dim))
        q, k = jnp.repeat(q, values_per_key, axis=2), jnp.repeat(k, values_per_key, axis=2)  # [B, T, Hv, Dk]
        v = qkv[..., 2 * self.key_dim:].reshape(b, t, self.v_heads, self.v_dim)
        beta = jax.nn.sigmoid(beta.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))

        def step(s, inp):  # s [B, Hv, Dk, Dv], HF's layout
            q_t, k_t, v_t, g_t, beta_t = inp
            s = s * jnp.exp(g_t)[..., None, None]
            kv = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision="highest")
            s = s + k_t[..., :, None] * (beta_t[..., None] * (v_t - kv))[..., None, :]
            return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision="highest")

        time_major = lambda a: jnp.swapaxes(a, 0, 1)
        s0 = jnp.zeros((b, self.v_heads, self.k_dim, self.v_dim), jnp.float32)
        _, o = jax.lax.scan(step, s0, (time_major(q), time_major(k), time_major(v), time_major(g), time_major(beta)))
        return self._out(time_major(o), z, x.dtype)

    # ------------------------------------------------------------------ serving path
    def __call__(self, x: jax.Array, arena: jax.Array, batch: Batch, slot: ArenaSlot):
        """x [B, T, hidden] -> ([B, T, hidden], arena with each row's state slot advanced)."""
        qkv, z, b, a = self._project(x)
        params = (self.conv1d.kernel_weight, self.A_log[...], self.dt_bias[...])
        if x.shape[1] == 1:
            if self.in_proj is not None:  # the kernels read qkv, a and b in place from the fused product
                y, (q0, _, b0, a0) = z[0][:, 0], self.in_proj.starts
                qkv1, a1, b1 = Cols(y, q0, qkv.shape[-1]), Cols(y, a0, a.shape[-1]), Cols(y, b0, b.shape[-1])
            else:
                qkv1, a1, b1 = qkv[:, 0], a[:, 0], b[:, 0]
            o, arena = gdn_decode(arena, batch.state_slots, qkv1, a1, b1, *params, view=slot.view, **slot.kernel_kw)
            o = o[:, None]
        else:
            o, arena = gdn_prefill(arena, batch.state_slots, qkv, a, b, batch.q_lens, *params, view=slot.view,
                                   reset=first_chunk(batch), checkpoint_positions=batch.checkpoint_positions,
                                   checkpoint_slots=batch.checkpoint_slots, **slot.kernel_kw)
        return self._out(o, z, x.dtype), arena


__all__ = ["GatedDeltaNet"]
