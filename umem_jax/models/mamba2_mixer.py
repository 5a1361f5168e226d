"""Mamba2 mixer (NemotronH / Bamba / Granite-4-H naming).

    zxbcdt = in_proj(x)                 -> z [d_inner] | xBC [conv_dim] | dt [H]   (this order)
    xBC    = silu(causal_conv1d(xBC))   -> x [H, P] | B [G, N] | C [G, N]
    dt     = softplus(dt + dt_bias)     (prefill and dense: max(dt, time_step_min))
    S_h    = exp(dt_h A_h) S_h + dt_h x_h (outer) B_g(h);   y_h = S_h C_g(h) + D_h x_h
    out    = out_proj(GatedRMSNorm(y, z))   (gate first, RMS over G groups of d_inner/G)

with d_inner = H*P, conv_dim = d_inner + 2*G*N, A = -exp(A_log).  Parameter names are the
checkpoint's (`in_proj.weight`, `conv1d.weight` [conv_dim, 1, K], `conv1d.bias`, `dt_bias`,
`A_log`, `D`, `norm.weight`, `out_proj.weight`), so loading is a rename.

Two paths:
  * `dense`: cache-free, a per-token `lax.scan` written here (independent of the kernels, so the
    parity tests check the kernels too);
  * `__call__`: the serving path through pallas_kernels.mamba2 (`mamba2_prefill` for T > 1 chunks,
    `mamba2_decode` for T == 1), reading and writing the request's state slot in the arena.

The dt clamp follows transformers' NemotronH: its chunked (prompt, and cache-free) scan clamps dt
to [time_step_min, inf), its single-token decode does not.  With small dt, cached decoding
therefore differs from a cache-free recompute; we reproduce that, not "fix" it.  Here a row is
clamped when it prefills (more than one new token, or its request's first), whatever the chunk
it rides in (see `_prefill_dt_min`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.batch import Batch
from ..memory.declarations import StateTensor, mamba2_state_tensors
from ..pallas_kernels.mamba2 import mamba2_decode, mamba2_prefill, softplus
from ..pallas_kernels.recurrent import Cols
from .arena_slot import ArenaSlot
from .config import MambaConfig
from .layers import Linear
from .recurrent import DepthwiseConv1d, GatedRMSNorm, first_chunk


def inverse_softplus(x: jax.Array) -> jax.Array:
    return x + jnp.log(-jnp.expm1(-x))


class Mamba2Mixer(nnx.Module):
    @staticmethod
    def state_tensors(m: MambaConfig, conv_dtype: str) -> tuple[StateTensor, ...]:
        """What one Mamba2 layer keeps per request: the conv window over x|B|C (conv_dtype) and
        the SSM state, fp32 (the engine's mamba_ssm_dtype may store it 16-bit: with_ssm_dtype)."""
        return mamba2_state_tensors(m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel,
                                    conv_dtype=conv_dtype)

    def __init__(self, hidden: int, m: MambaConfig, *, time_step_min: float, eps: float, conv_bias: bool,
                 dtype, rngs: nnx.Rngs):
        h, p, n, g, k = m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel
        if h % g:
            raise ValueError(f"mamba heads {h} must be a multiple of n_groups {g}")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = h, p, n, g
        self.d_inner = h * p
        self.conv_dim = self.d_inner + 2 * g * n
        self.time_step_min = float(time_step_min)
        self.in_proj = Linear(hidden, self.d_inner + self.conv_dim + h, dtype=dtype, rngs=rngs)
        self.conv1d = DepthwiseConv1d(self.conv_dim, k, bias=conv_bias, dtype=dtype, rngs=rngs)
        # transformers' init: A = 1..H, D = 1, dt = softplus^-1 of a spread in [1e-3, 1e-1].
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)).astype(dtype))
        self.D = nnx.Param(jnp.ones((h,), dtype))
        dt = jnp.exp(jnp.linspace(jnp.log(1e-3), jnp.log(1e-1), h))
        self.dt_bias = nnx.Param(inverse_softplus(dt).astype(dtype))
        self.norm = GatedRMSNorm(self.d_inner, group_size=self.d_inner // g, eps=eps, norm_before_gate=False,
                                 dtype=dtype)
        self.out_proj = Linear(self.d_inner, hidden, dtype=dtype, rngs=rngs)

    def _split(self, zxbcdt: jax.Array):
        """[..., d_inner + conv_dim + H] -> xBC, dt (raw); z, the first d_inner, the norm reads in place."""
        a, b = self.d_inner, self.d_inner + self.conv_dim
        return zxbcdt[..., a:b], zxbcdt[..., b:]

    def _out(self, y: jax.Array, zxbcdt: jax.Array, dtype) -> jax.Array:
        """y [B, T, H, P], zxbcdt the in_proj output -> out_proj(GatedRMSNorm(y, z)) [B, T, hidden].
        The norm takes z as its first d_inner channels: its kernel reads them in place, where a
        slice would cost a copy launch at decode."""
        y = y.reshape(*y.shape[:2], self.d_inner)
        return self.out_proj(self.norm(y, zxbcdt, z_offset=0).astype(dtype))

    # ------------------------------------------------------------------ dense (cache-free)
    def dense(self, x: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        """x [B, T, hidden] from a zero state; valid [B, T] (padding tokens are zeroed before
        in_proj and after the conv, as transformers does) -> [B, T, hidden]."""
        del positions  # Mamba has none
        b, t, _ = x.shape
        h, p, n, g = self.num_heads, self.head_dim, self.state_size, self.n_groups
        mask = valid[..., None].astype(x.dtype)
        zxbcdt = self.in_proj(x * mask)
        xbc, dt = self._split(zxbcdt)
        xbc = jax.nn.silu(self.conv1d.dense(xbc)) * mask.astype(jnp.float32)
        xs = xbc[..., :self.d_inner].reshape(b, t, h, p)
        heads_per_group = h // g
        b_heads = jnp.repeat(xbc[..., self.d_inner:self.d_inner + g * n].reshape(b, t, g, n), heads_per_group,
                             axis=2)  # [B, T, H, N]
        c_heads = jnp.repeat(xbc[..., self.d_inner + g * n:].reshape(b, t, g, n), heads_per_group, axis=2)
        dt = softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.maximum(dt, self.time_step_min)
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        d = self.D[...].astype(jnp.float32)

        def step(s, inp):  # s [B, H, P, N]
            x_t, b_t, c_t, dt_t = inp
            s = s * jnp.exp(dt_t * a)[..., None, None] + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
            y = jnp.einsum("bhpn,bhn->bhp", s, c_t, precision="highest") + d[:, None] * x_t
            return s, y

        time_major = lambda v: jnp.swapaxes(v, 0, 1)
        _, ys = jax.lax.scan(step, jnp.zeros((b, h, p, n), jnp.float32),
                             (time_major(xs), time_major(b_heads), time_major(c_heads), time_major(dt)))
        return self._out(time_major(ys), zxbcdt, x.dtype)

    # ------------------------------------------------------------------ serving path
    def __call__(self, x: jax.Array, arena: jax.Array, batch: Batch, slot: ArenaSlot):
        """x [B, T, hidden] -> ([B, T, hidden], arena with each row's state slot advanced)."""
        zxbcdt = self.in_proj(x)
        xbc, dt = self._split(zxbcdt)
        params = (self.conv1d.kernel_weight, self.conv1d.bias_or_none, self.A_log[...], self.dt_bias[...],
                  self.D[...])
        if x.shape[1] == 1:  # the kernels read xBC and dt in place from the in_proj output
            row, a = zxbcdt[:, 0], self.d_inner
            xbc1, dt1 = Cols(row, a, xbc.shape[-1]), Cols(row, a + xbc.shape[-1], dt.shape[-1])
            y, arena = mamba2_decode(arena, batch.state_slots, xbc1, dt1, *params, view=slot.view, **slot.kernel_kw)
            y = y[:, None]
        else:
            y, arena = mamba2_prefill(arena, batch.state_slots, xbc, dt, batch.q_lens, *params, view=slot.view,
                                      dt_min=0.0 if slot.decode_rows else self._prefill_dt_min(batch),
                                      reset=first_chunk(batch),
                                      checkpoint_positions=batch.checkpoint_positions,
                                      checkpoint_slots=batch.checkpoint_slots, **slot.kernel_kw)
        return self._out(y, zxbcdt, x.dtype), arena

    def _prefill_dt_min(self, batch: Batch) -> jax.Array:
        """[B] per-row dt floor for the prefill kernel: time_step_min for prefilling rows, 0 (no
        clamp: softplus is positive) for decoding rows.

        transformers clamps in its chunked scan (a prompt) and not in its 1-token decode.  In a
        mixed chunk a decoding row (1 new token, not its first) rides the prefill kernel; a single
        floor for the whole chunk would clamp it and make its result depend on the batching.
        Known gap: a prompt whose last chunk is exactly one token is not clamped on that token
        (the Batch does not say which tokens are prompt tokens).  A speculative verify (k+1
        decode tokens per row, `ArenaSlot.decode_rows`) clamps no row, as the decode kernel.
        """
        prefilling = first_chunk(batch) | (batch.q_lens > 1)
        return jnp.where(prefilling, jnp.float32(self.time_step_min), jnp.float32(0.0))


__all__ = ["Mamba2Mixer", "inverse_softplus"]
