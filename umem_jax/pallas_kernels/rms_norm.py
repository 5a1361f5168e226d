"""RMSNorm in one kernel, optionally after the residual add that feeds it, or gated (Mamba2, DeltaNet).

    y    = rms_norm(x, w, eps=..., offset=0.)              x [..., D], w [D] -> [..., D] in x.dtype
    y, h = rms_norm(x, w, eps=..., residual=r)             h = x + r (x.dtype): the new residual
                                                           stream, y = its norm
    y    = gated_rms_norm(y, z, w, eps=..., group_size=g, norm_before_gate=...)   [..., D]
                                                           (z [..., W], its channels at z_offset..+D:
                                                           read in place from a projection's output)

    rms_norm:       y = (x_hat * (offset + w)).astype(x.dtype),  x_hat = x * rsqrt(mean(x^2) + eps) in fp32
    gated_rms_norm: over groups of g channels, statistics in fp32, w multiplied in the input dtype:
                    norm_before_gate=False (Mamba2):       w * norm(y * silu(z))
                    norm_before_gate=True  (gated DeltaNet): (w * norm(y)) * silu(z)

These are the definitions of models/layers.RMSNorm and models/recurrent.GatedRMSNorm, cast for
cast (`*_reference` below).

Why a kernel: XLA lowers an RMSNorm over a decode token's row to two launches (a one-block
reduction for the mean square, then the scaling), three with the residual add before it.  In a
CUDA graph each costs about 1.2-1.6 us however small the row, and a hybrid MoE model has two norms
a layer: 80-100 of its 900 launches at batch 1 (benchmarks/RESULTS.md, session 19 traces).  Here a
program holds whole rows ([bn, D] in registers), so add, mean square and scaling are one launch.

Rows: a program takes `bn` rows of the [R, L] view (R = N * G rows of L = D / G = group_size
channels: view row r is group g = r % G of token r // G, and reads weight row g); L is padded to a
power of two with masked loads.  At decode R is small, so a program takes one row: one CTA per
row keeps more loads in flight than one CTA over all of them (a Qwen3.5 DeltaNet norm, 32 rows of
128, took 3.0 us as one program on an H100, against 1.5 us for XLA's 128-block fusion).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .launch import ANY, kernel_or_xla, pow2_ceil, pow2_floor

__all__ = ["NORM_ENV", "gated_rms_norm", "gated_rms_norm_reference", "norm_backend", "rms_norm",
           "rms_norm_reference"]

# $UMEM_JAX_NORM: "pallas" (these kernels), "xla" (the references), unset or "auto": the kernels on
# a GPU, XLA elsewhere (where they would only be interpreted).  Read at trace time; the runner keys
# its steps on it (runner.TRACE_ENV).
NORM_ENV = "UMEM_JAX_NORM"
TILE = 4096  # elements a program holds at most ([bn, L] fp32 in registers: 32 a thread at 4 warps)
SPREAD = 128  # up to about this many programs, a program takes one row (about one per SM)


def norm_backend() -> str:
    """"pallas" or "xla": what the models' norms run now ($UMEM_JAX_NORM, else by backend)."""
    return kernel_or_xla(NORM_ENV)


# ----------------------------------------------------------------------------- references


def rms_norm_reference(x: jax.Array, weight: jax.Array, *, eps: float, offset: float = 0.0,
                       residual: jax.Array | None = None):
    """x [..., D], weight [D] -> [..., D] in x.dtype; with residual [..., D]: (norm(x + residual),
    x + residual), the sum rounded to x.dtype first, as the models' `h + a` is."""
    h = x if residual is None else x + residual
    hf = h.astype(jnp.float32)
    y = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    y = (y * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return y if residual is None else (y, h)


def gated_rms_norm_reference(y: jax.Array, z: jax.Array, weight: jax.Array, *, eps: float, group_size: int,
                             norm_before_gate: bool, z_offset: int = 0) -> jax.Array:
    """y [..., D], z [..., W] (the gate: channels z_offset .. z_offset + D), weight [D] (or
    [group_size]: one weight every group shares, as DeltaNet's heads do) -> [..., D] in y.dtype
    (groups of group_size channels)."""
    dtype = y.dtype
    z = jax.lax.slice_in_dim(z, z_offset, z_offset + y.shape[-1], axis=-1)
    yf = y.astype(jnp.float32)
    gate = jax.nn.silu(z.astype(jnp.float32))
    if not norm_before_gate:
        yf = yf * gate
    g = yf.reshape(*yf.shape[:-1], -1, group_size)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    if weight.shape[-1] != yf.shape[-1]:  # shared by the groups
        weight = jnp.tile(weight, yf.shape[-1] // weight.shape[-1])
    out = weight * g.reshape(yf.shape).astype(dtype)
    if norm_before_gate:
        out = (out.astype(jnp.float32) * gate).astype(dtype)
    return out


# ----------------------------------------------------------------------------- kernel


def _kernel(*refs, R, L, G, WG, bn, lp, eps, offset, z_offset, mode):
    """mode: "plain", "residual", "gate_first" (Mamba2) or "gate_after" (DeltaNet)."""
    if mode == "plain":
        x_ref, w_ref, y_ref = refs
    elif mode == "residual":
        x_ref, r_ref, w_ref, y_ref, h_ref = refs
    else:
        x_ref, z_ref, w_ref, y_ref = refs
    rows = pl.program_id(0) * bn + jnp.arange(bn, dtype=jnp.int32)
    cols = jnp.arange(lp, dtype=jnp.int32)
    col_ok = cols < L
    mask = (rows < R)[:, None] & col_ok[None, :]
    at = (rows[:, None], cols[None, :])
    x = pltr.load(x_ref.at[at], mask=mask, other=0.0)
    # The weight row of each view row (G groups a token; WG = 1: all share one), loaded before the
    # reduction needs it.
    w = pltr.load(w_ref.at[((rows % G) % WG)[:, None], cols[None, :]], mask=mask, other=0.0)
    dtype = x.dtype
    if mode == "residual":
        x = (x.astype(jnp.float32) + pltr.load(r_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)).astype(dtype)
        pltr.store(h_ref.at[at], x, mask=mask)
    xf = x.astype(jnp.float32)
    gate = None
    if mode in ("gate_first", "gate_after"):
        # z [N, W]: view row r reads token r // G's channels z_offset + (r % G) * L + c, in place
        zcols = z_offset + (rows % G)[:, None] * L + cols[None, :]
        zf = pltr.load(z_ref.at[(rows // G)[:, None], zcols], mask=mask, other=0.0).astype(jnp.float32)
        gate = zf / (1.0 + jnp.exp(-zf))  # silu
        if mode == "gate_first":
            xf = xf * gate
    # Padding columns hold zeros: they add nothing to the sum of squares, which divides by L.
    xf = xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) * (1.0 / L) + eps)
    if mode == "plain" or mode == "residual":
        y = (xf * (offset + w.astype(jnp.float32))).astype(dtype)
    else:  # transformers' gated norms multiply by w in the input dtype
        y = (w.astype(jnp.float32) * xf.astype(dtype).astype(jnp.float32)).astype(dtype)
        if mode == "gate_after":
            y = (y.astype(jnp.float32) * gate).astype(dtype)
    pltr.store(y_ref.at[at], y, mask=mask)


def _tiles(R: int, L: int) -> tuple[int, int, int]:
    """(bn rows a program, lp padded row length, num_warps)."""
    lp = max(16, pow2_ceil(L))
    bn = max(1, min(pow2_floor(max(TILE // lp, 1)), pow2_ceil(-(-R // SPREAD))))
    elems = bn * lp
    return bn, lp, 1 if elems <= 256 else 2 if elems <= 1024 else 4 if elems <= 4096 else 8


@functools.partial(jax.jit, static_argnames=("G", "eps", "offset", "z_offset", "mode", "interpret"))
def _norm_2d(x, other, w, *, G, eps, offset, mode, interpret, z_offset=0):
    """x [R, L], w [G or 1, L], other: the residual [R, L] or the gate [R / G, W]."""
    R, L = x.shape
    bn, lp, warps = _tiles(R, L)
    kernel = functools.partial(_kernel, R=R, L=L, G=G, WG=w.shape[0], bn=bn, lp=lp, eps=float(eps),
                               offset=float(offset), z_offset=int(z_offset), mode=mode)
    operands = [x] + ([] if other is None else [other]) + [w]
    out_shape = [jax.ShapeDtypeStruct((R, L), x.dtype)]
    if mode == "residual":
        out_shape.append(jax.ShapeDtypeStruct((R, L), x.dtype))
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(R, bn),),
        in_specs=[ANY] * len(operands),
        out_specs=tuple(ANY for _ in out_shape),
        out_shape=tuple(out_shape),
        compiler_params=triton_params(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="umem_rms_norm",
    )(*operands)
    return out if mode == "residual" else out[0]


def _rows(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, offset: float = 0.0, residual: jax.Array | None = None,
             interpret: bool = False):
    """The Pallas kernel: x [..., D], weight [D] (, residual [..., D]) -> as rms_norm_reference."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight must be [{D}], got {list(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual {residual.dtype}{list(residual.shape)} must match x "
                         f"{x.dtype}{list(x.shape)}")
    n = _rows(x.shape[:-1])
    if n == 0 or D == 0:
        return rms_norm_reference(x, weight, eps=eps, offset=offset, residual=residual)
    out = _norm_2d(x.reshape(n, D), None if residual is None else residual.reshape(n, D), weight.reshape(1, D),
                   G=1, eps=float(eps), offset=float(offset), mode="plain" if residual is None else "residual",
                   interpret=interpret)
    if residual is None:
        return out.reshape(x.shape)
    return out[0].reshape(x.shape), out[1].reshape(x.shape)


def gated_rms_norm(y: jax.Array, z: jax.Array, weight: jax.Array, *, eps: float, group_size: int,
                   norm_before_gate: bool, z_offset: int = 0, interpret: bool = False) -> jax.Array:
    """The Pallas kernel: y [..., D], z [..., W], weight [D] -> as gated_rms_norm_reference."""
    D = y.shape[-1]
    if z.shape[:-1] != y.shape[:-1] or not 0 <= z_offset <= z.shape[-1] - D:
        raise ValueError(f"gated_rms_norm: z {list(z.shape)} must hold y's {list(y.shape)} channels from "
                         f"z_offset={z_offset}")
    if weight.shape not in ((D,), (group_size,)) or group_size <= 0 or D % group_size:
        raise ValueError(f"gated_rms_norm: weight [{D}] in groups of {group_size} channels, got weight "
                         f"{list(weight.shape)}")
    n = _rows(y.shape[:-1])
    if n == 0 or D == 0:
        return gated_rms_norm_reference(y, z, weight, eps=eps, group_size=group_size,
                                        norm_before_gate=norm_before_gate, z_offset=z_offset)
    G = D // group_size
    out = _norm_2d(y.reshape(n * G, group_size), z.reshape(n, z.shape[-1]),
                   weight.astype(y.dtype).reshape(-1, group_size), G=G, eps=float(eps), offset=0.0,
                   mode="gate_after" if norm_before_gate else "gate_first", z_offset=int(z_offset),
                   interpret=interpret)
    return out.reshape(y.shape)
