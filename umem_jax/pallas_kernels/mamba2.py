"""Mamba2 (NemotronH / Bamba / Granite-4-H mixer) recurrent state: decode kernel and prefill scan.

State of one layer in a request's slot (declarations.mamba2_state_tensors):
  conv [K-1, conv_dim]  the last K-1 pre-conv inputs x|B|C (conv dtype, bf16 by default)
  ssm  [H, P, N]        S_h for every head h: fp32 (two 16-bit planes in the arena), or bf16 / fp16
                        (one plane: engine option mamba_ssm_dtype); the math is fp32 either way
with conv_dim = H*P + 2*G*N; head h reads group g = h // (H // G) of B and C.

Math (Hugging Face `NemotronHMamba2Mixer`, one token t; A = -exp(A_log)):
  xBC_t      = silu(causal_conv1d(xBC_t | conv state) + conv_bias)      -> x [H, P], B, C [G, N]
  dt_t       = softplus(dt_raw_t + dt_bias)                             [H]   (prefill: max(dt, dt_min))
  S_h        = exp(dt_t,h * A_h) * S_h + dt_t,h * x_h (outer) B_g        [P, N]
  y_t,h      = S_h C_g + D_h * x_h                                       [P]
The gate z and the gated RMSNorm stay in the model.  HF applies the dt clamp (time_step_min, inf)
only on the prefill path (`torch_forward` chunked scan), never in decode.

Entry points (each takes the arena first and returns it last; call under a jit that donates it):
  mamba2_decode(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, *, view)
      -> (y [B, H, P], arena)
  mamba2_prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                 dt_min=0.0, reset=None, checkpoint_positions=None, checkpoint_slots=None,
                 algo=None, chunk_size=64)
      -> (y [B, T, H, P], arena)
  (plus *_reference twins: the decode in plain JAX, the prefill as a per-token lax.scan)
Shapes: slots int32 [B] physical slot ids (0 = padding lane: output 0, no state touched);
xbc [B, conv_dim] (prefill [B, T, conv_dim]); dt [B, H] raw (before bias and softplus; prefill
[B, T, H]); conv_weight [conv_dim, K] (HF's conv1d.weight squeezed); conv_bias [conv_dim] | None;
A_log, dt_bias, D [H].  y has xbc's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import recurrent
from ._compat import pltr
from .causal_conv import conv_block
from .launch import resolve_impl
from .recurrent import check_shapes, chunk_checkpoints, from_chunks, initial_checkpoints, softplus, to_chunks
from .state_io import block_fits, check_slots, check_state_view, load_block, store_block

__all__ = ["Mamba2Dims", "mamba2_decode", "mamba2_decode_reference", "mamba2_dims", "mamba2_prefill",
           "mamba2_prefill_reference", "pallas_supported", "softplus"]


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
    heads: int       # H
    head_dim: int    # P
    state_size: int  # N
    groups: int      # G
    conv_kernel: int  # K
    conv_dim: int    # H*P + 2*G*N


def mamba2_dims(view) -> Mamba2Dims:
    """Mamba2 dimensions from a layer's StateView (tensors "conv" [K-1, conv_dim], "ssm" [H, P, N])."""
    try:
        conv, ssm = view["conv"].tensor, view["ssm"].tensor
    except KeyError:
        raise ValueError("a Mamba2 state view needs the tensors 'conv' and 'ssm'") from None
    H, P, N = ssm.shape
    history, C = conv.shape
    two_G_N = C - H * P
    if two_G_N <= 0 or two_G_N % (2 * N) or H % (two_G_N // (2 * N)):
        raise ValueError(f"conv width {C} is not H*P + 2*G*N for ssm [H, P, N] = {ssm.shape} and G dividing H")
    if ssm.dtype not in recurrent.STATE_DTYPES:
        raise ValueError(f"the ssm state must be one of {recurrent.STATE_DTYPES}, got {ssm.dtype}")
    return Mamba2Dims(H, P, N, two_G_N // (2 * N), history + 1, C)


def _check(xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, d: Mamba2Dims, lead):
    want = {"xbc": (*lead, d.conv_dim), "dt": (*lead, d.heads), "conv_weight": (d.conv_dim, d.conv_kernel),
            "A_log": (d.heads,), "dt_bias": (d.heads,), "D": (d.heads,)}
    got = {"xbc": xbc, "dt": dt, "conv_weight": conv_weight, "A_log": A_log, "dt_bias": dt_bias, "D": D}
    if conv_bias is not None:
        want["conv_bias"], got["conv_bias"] = (d.conv_dim,), conv_bias
    check_shapes(want, got)


def _checked_dims(arena, view, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, lead) -> Mamba2Dims:
    """Static checks of a call; `lead` is the leading shape of xbc and dt (decode: (B,) from the
    slots, prefill: (B, T))."""
    check_state_view(arena, view)
    d = mamba2_dims(view)
    _check(xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, d, lead)
    return d


def _split(xc, d: Mamba2Dims):
    """Conv output [..., conv_dim] -> x [..., H, P], B [..., G, N], C [..., G, N]."""
    HP, GN = d.heads * d.head_dim, d.groups * d.state_size
    lead = xc.shape[:-1]
    return (xc[..., :HP].reshape(*lead, d.heads, d.head_dim),
            xc[..., HP:HP + GN].reshape(*lead, d.groups, d.state_size),
            xc[..., HP + GN:].reshape(*lead, d.groups, d.state_size))


def _per_row(v, ndim):
    """A scalar, or a [B] array broadcast against [B, ...] of rank ndim."""
    v = jnp.asarray(v, jnp.float32)
    return v.reshape(v.shape + (1,) * (ndim - 1)) if v.ndim == 1 else v


def _ssm_step(S, xc, dt_raw, A_log, dt_bias, D, d: Mamba2Dims, dt_min=None):
    """One token for a batch: S fp32 [B, H, P, N], xc fp32 conv output [B, conv_dim], dt_raw [B, H]
    -> (y fp32 [B, H, P], S')."""
    x, Bm, Cm = _split(xc, d)
    heads_per_group = d.heads // d.groups
    Bh = jnp.repeat(Bm, heads_per_group, axis=1)                                   # [B, H, N]
    Ch = jnp.repeat(Cm, heads_per_group, axis=1)
    dt = softplus(dt_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    if dt_min is not None:
        dt = jnp.maximum(dt, _per_row(dt_min, dt.ndim))
    dA = jnp.exp(dt * -jnp.exp(A_log.astype(jnp.float32)))            # [B, H]
    S = S * dA[..., None, None] + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", S, Ch, precision="highest") + D.astype(jnp.float32)[:, None] * x
    return y, S


# --------------------------------------------------------------------------- decode


def mamba2_decode_reference(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, *, view):
    """Plain-JAX Mamba2 decode step (XLA gather/scatter of the slots' rows); see the module doc."""
    d = _checked_dims(arena, view, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, slots.shape[:1])
    step = lambda S, xc: _ssm_step(S, xc, dt, A_log, dt_bias, D, d)
    return recurrent.decode_reference(arena, slots, xbc, conv_weight, conv_bias, view=view, state_name="ssm", step=step)


def _ssm_update(b, h, slot, p0, xc_ref, dt_ref, alog_ref, dtb_ref, d_ref, arena_ref, *, view, d: Mamba2Dims,
                block_p: int, dt_start: int = 0):
    """In-kernel: head rows [p0, p0 + block_p) of S_h in `slot`, updated in place -> y fp32 [block_p]."""
    H, P, N, G = d.heads, d.head_dim, d.state_size, d.groups
    g = h // (H // G)
    x = pltr.load(xc_ref.at[b, pl.ds(h * P + p0, block_p)])                 # fp32 [block_p]
    Bv = pltr.load(xc_ref.at[b, pl.ds(H * P + g * N, N)])                   # [N]
    Cv = pltr.load(xc_ref.at[b, pl.ds(H * P + G * N + g * N, N)])
    dt = softplus(dt_ref[b, dt_start + h].astype(jnp.float32) + dtb_ref[h].astype(jnp.float32))
    dA = jnp.exp(-dt * jnp.exp(alog_ref[h].astype(jnp.float32)))
    rows = view["ssm"]
    flat0 = h * (P * N) + p0 * N
    S = load_block(arena_ref, slot, view, rows, flat0, (block_p, N), jnp.float32)  # a 16-bit state too
    S = S * dA + (dt * x)[:, None] * Bv[None, :]
    store_block(arena_ref, slot, view, rows, flat0, S)  # rounded to the stored dtype once per token
    return jnp.sum(S * Cv[None, :], axis=1) + d_ref[h].astype(jnp.float32) * x


def pallas_supported(view) -> bool:
    """Whether the Pallas decode kernel can address this layout (else use the reference)."""
    d = mamba2_dims(view)
    return (recurrent.tile_rows(view, d.head_dim, d.state_size) is not None
            and conv_block(view, view["conv"], d.conv_dim) >= 16)


@functools.partial(jax.jit, static_argnames=("view", "interpret", "block_p", "conv_block_c", "num_warps", "num_stages"))
def _mamba2_decode_pallas(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                          interpret=False, block_p=None, conv_block_c=None, num_warps=4, num_stages=1):
    """xbc, dt: arrays or recurrent.Cols (read in place)."""
    d = _checked_dims(arena, view, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, slots.shape[:1])
    (xbc, x_start), (dt, dt_start) = recurrent.src_start(xbc), recurrent.src_start(dt)
    check_slots(slots)
    block_p = block_p or recurrent.tile_rows(view, d.head_dim, d.state_size)
    if block_p is None or d.head_dim % block_p or not block_fits(view, block_p * d.state_size):
        raise ValueError(f"no Pallas tile for ssm [{d.heads}, {d.head_dim}, {d.state_size}] in {view.row_words}-word "
                         "rows (needs a power-of-two block_p*N that divides or is whole rows); use impl='reference'")
    update = functools.partial(_ssm_update, view=view, d=d, block_p=block_p, dt_start=dt_start)
    return recurrent.decode_pallas(arena, slots, xbc, conv_weight, conv_bias, (dt, A_log, dt_bias, D), view=view,
                                   update=update, heads=d.heads, rows=d.head_dim, block=block_p,
                                   name="mamba2_ssm_decode", interpret=interpret, conv_block_c=conv_block_c,
                                   num_warps=num_warps, num_stages=num_stages, x_start=x_start)


def mamba2_decode(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                  impl: str | None = None, interpret: bool = False, **tuning):
    """One Mamba2 decode token per request, reading and writing each request's slot in place.

    Returns (y [B, H, P] in xbc's dtype, arena).  impl: "pallas" | "reference"; default pallas on
    GPU (or with interpret=True) when the layout has a Pallas tile (`pallas_supported`), else the
    reference.  xbc and dt may be recurrent.Cols of the in_proj output: the kernels read them in
    place.  tuning: block_p, conv_block_c, num_warps, num_stages.
    """
    if recurrent.decode_impl(impl, interpret, lambda: pallas_supported(view)) == "reference":
        xbc, dt = recurrent.as_array(xbc), recurrent.as_array(dt)
        return mamba2_decode_reference(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, view=view)
    return _mamba2_decode_pallas(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, view=view,
                                 interpret=interpret, **tuning)


# --------------------------------------------------------------------------- prefill


def _scan_core(S0, xc, dt, q_lens, pos, A_log, dt_bias, D, d: Mamba2Dims, dt_min):
    """Per-token recurrence.  S0 [B, H, P, N]; xc fp32 [B, T, conv_dim]; dt raw [B, T, H]; pos
    [B, C] | None -> (y [B, T, H, P], S [B, H, P, N], checkpoints [B, C, H, P, N] | None)."""
    step = lambda S, xc_t, dt_t: _ssm_step(S, xc_t, dt_t, A_log, dt_bias, D, d, dt_min)
    return recurrent.scan_tokens(S0, step, (xc, dt), q_lens, pos)


def _chunked_core(S0, xc, dt, q_lens, pos, A_log, dt_bias, D, d: Mamba2Dims, dt_min, chunk: int):
    """SSD-style chunked scan (same contract as _scan_core): inside a chunk of L tokens every
    output and the end state are matmuls over decay-weighted pairs; a lax.scan carries the state
    across the T/L chunks.  Padding tokens get dt = 0, i.e. decay 1 and no input: the state passes
    through them unchanged, so one formula serves every q_len.

    Per chunk, with a_t = dt_t * A_h, Ac = cumsum(a) (<= 0, decreasing), u_t = dt_t x_t:
      y_t   = sum_{s<=t} exp(Ac_t - Ac_s) (C_t . B_s) u_s + exp(Ac_t) C_t S_prev + D x_t
      S_end = exp(Ac_L) S_prev + sum_s exp(Ac_L - Ac_s) u_s (outer) B_s
    (every exponent is <= 0, so nothing overflows)."""
    highest = "highest"
    T = xc.shape[1]
    heads_per_group = d.heads // d.groups
    L = min(chunk, T)
    x, Bm, Cm = _split(xc, d)                                                 # [B,T,H,P], [B,T,G,N] x2
    dts = softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    if dt_min is not None:
        dts = jnp.maximum(dts, _per_row(dt_min, dts.ndim))
    dts = jnp.where(jnp.arange(T)[None, :, None] < q_lens[:, None, None], dts, 0.0)
    A = -jnp.exp(A_log.astype(jnp.float32))
    Dv = D.astype(jnp.float32)
    causal = jnp.tril(jnp.ones((L, L), bool))
    s_idx = jnp.arange(L)

    def body(carry, inp):
        S, checkpoints = carry
        c, x_c, B_c, C_c, dt_c = inp
        Ac = jnp.cumsum(dt_c * A, axis=1)                                      # [B, L, H]
        u = dt_c[..., None] * x_c                                             # [B, L, H, P]
        Bh, Ch = jnp.repeat(B_c, heads_per_group, axis=2), jnp.repeat(C_c, heads_per_group, axis=2)       # [B, L, H, N]
        seg = Ac[:, :, None, :] - Ac[:, None, :, :]                           # [B, t, s, H]
        decay = jnp.where(causal[None, :, :, None], jnp.exp(jnp.where(causal[None, :, :, None], seg, 0.0)), 0.0)
        CB = jnp.repeat(jnp.einsum("btgn,bsgn->btsg", C_c, B_c, precision=highest), heads_per_group, axis=3)
        y = jnp.einsum("btsh,bshp->bthp", decay * CB, u, precision=highest)
        y = y + jnp.exp(Ac)[..., None] * jnp.einsum("bthn,bhpn->bthp", Ch, S, precision=highest)
        y = y + Dv[:, None] * x_c
        w_end = jnp.exp(Ac[:, -1:, :] - Ac)                                    # [B, L, H]
        S_new = jnp.exp(Ac[:, -1])[..., None, None] * S + jnp.einsum("bsh,bshp,bshn->bhpn", w_end, u, Bh,
                                                                      precision=highest)
        if checkpoints is not None:  # the state after local token `last`, for checkpoints in this chunk
            inside, last = chunk_checkpoints(pos, c, L)                       # [B, C]
            Ac_last = jnp.take_along_axis(Ac, last[:, :, None], axis=1)       # [B, C, H]
            before = (s_idx[None, None, :] <= last[:, :, None])[..., None]    # [B, C, L, 1]
            w = jnp.where(before, jnp.exp(jnp.where(before, Ac_last[:, :, None, :] - Ac[:, None], 0.0)), 0.0)
            S_k = (jnp.exp(Ac_last)[..., None, None] * S[:, None]
                   + jnp.einsum("bksh,bshp,bshn->bkhpn", w, u, Bh, precision=highest))
            checkpoints = jnp.where(inside[:, :, None, None, None], S_k, checkpoints)
        return (S_new, checkpoints), y

    num_chunks = -(-T // L)
    xs = (jnp.arange(num_chunks, dtype=jnp.int32), to_chunks(x, L), to_chunks(Bm, L), to_chunks(Cm, L),
          to_chunks(dts, L))
    (S, checkpoints), ys = jax.lax.scan(body, (S0, initial_checkpoints(S0, pos)), xs)
    return from_chunks(ys, T), S, checkpoints


def _prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, *, view, dt_min, reset,
             checkpoint_positions, checkpoint_slots, state_impl, interpret, algo, chunk_size):
    d = _checked_dims(arena, view, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, xbc.shape[:2])
    if jnp.ndim(dt_min) not in (0, 1) or (jnp.ndim(dt_min) == 1 and jnp.shape(dt_min) != xbc.shape[:1]):
        # a scalar or one floor per row; any other shape only failed later as a broadcast in the scan
        raise ValueError(f"dt_min must be a scalar or [{xbc.shape[0]}] (one per row), got shape {list(jnp.shape(dt_min))}")

    def core(S0, xc, q_lens, pos):
        if algo == "scan":
            return _scan_core(S0, xc, dt, q_lens, pos, A_log, dt_bias, D, d, dt_min)
        return _chunked_core(S0, xc, dt, q_lens, pos, A_log, dt_bias, D, d, dt_min, chunk_size)

    return recurrent.prefill(arena, slots, xbc, q_lens, conv_weight, conv_bias, view=view, state_name="ssm",
                             reset=reset, checkpoint_positions=checkpoint_positions, checkpoint_slots=checkpoint_slots,
                             state_impl=state_impl, interpret=interpret, algo=algo, core=core)


def mamba2_prefill_reference(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                             dt_min: float = 0.0, reset=None, checkpoint_positions=None, checkpoint_slots=None):
    """Prefill a padded chunk by a `lax.scan` over its tokens (the exact per-token recurrence).

    xbc [B, T, conv_dim], dt [B, T, H] raw; q_lens int32 [B] valid tokens per row (tokens
    j >= q_len leave the state untouched; their y is 0).  The scan starts from the state in the
    slot, or from zeros where reset [B] (bool) is set (a request's first chunk).  dt is clamped
    to [dt_min, inf) after the softplus, as NemotronH's prefill does; dt_min is a float or a
    [B] array (per row: 0 leaves a row unclamped, e.g. a decoding row riding a mixed chunk).
    checkpoint_positions / checkpoint_slots int32 [B, C]: the state after the first p tokens of
    this chunk (0 <= p <= q_len) is also written to checkpoint slot s; p = -1 or s = 0 is padding.
    Returns (y [B, T, H, P] in xbc's dtype, arena).
    """
    return _prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, view=view,
                    dt_min=dt_min, reset=reset, checkpoint_positions=checkpoint_positions,
                    checkpoint_slots=checkpoint_slots, state_impl="reference", interpret=False, algo="scan",
                    chunk_size=0)


def mamba2_prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                   dt_min: float = 0.0, reset=None, checkpoint_positions=None, checkpoint_slots=None,
                   algo: str | None = None, chunk_size: int = 64, impl: str | None = None, interpret: bool = False):
    """Prefill one padded chunk per request from the state in its slot (arguments as
    `mamba2_prefill_reference`).  Plain JAX: algo "chunked" (SSD; `chunk_size` tokens per matmul
    block) or "scan" (per token); None (default): `recurrent.prefill_algo` by the chunk's length.  `impl` picks the state read/write path (Pallas on
    GPU).  Returns (y [B, T, H, P] in xbc's dtype, arena)."""
    return _prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, view=view,
                    dt_min=dt_min, reset=reset, checkpoint_positions=checkpoint_positions,
                    checkpoint_slots=checkpoint_slots, state_impl=resolve_impl(impl, interpret), interpret=interpret,
                    algo=recurrent.prefill_algo(algo, xbc.shape[1]), chunk_size=chunk_size)
