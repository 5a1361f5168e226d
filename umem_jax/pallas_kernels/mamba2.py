"""Mamba2 (NemotronH / Bamba / Granite-4-H mixer) recurrent state: decode kernel and prefill scan.

State of one layer in a request's slot (declarations.mamba2_state_tensors):
  conv [K-1, conv_dim]  the last K-1 pre-conv inputs x|B|C (conv dtype, bf16 by default)
  ssm  [H, P, N] fp32   S_h for every head h (two 16-bit planes in the arena)
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
                 algo="chunked", chunk_size=64)
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

from ._compat import pltr, resolve_impl, triton_params
from .causal_conv import conv_block, conv_decode_pallas, conv_decode_reference, conv_prefill_reference
from .state_io import (
    block_fits,
    check_state_view,
    load_block,
    read_state,
    read_state_reference,
    store_block,
    write_state,
    write_state_reference,
)
from .words import from_u16, to_u16

__all__ = [
    "Mamba2Dims",
    "mamba2_decode",
    "mamba2_decode_reference",
    "mamba2_dims",
    "mamba2_prefill",
    "mamba2_prefill_reference",
    "pallas_supported",
    "ssm_block",
    "softplus",
]


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
    Km1, C = conv.shape
    G2N = C - H * P
    if G2N <= 0 or G2N % (2 * N) or H % (G2N // (2 * N)):
        raise ValueError(f"conv width {C} is not H*P + 2*G*N for ssm [H, P, N] = {ssm.shape} and G dividing H")
    if ssm.dtype != "float32":
        raise ValueError(f"the ssm state must be float32, got {ssm.dtype}")
    return Mamba2Dims(H, P, N, G2N // (2 * N), Km1 + 1, C)


def softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20): x above 20, else log1p(exp(x))."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _check(xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, d: Mamba2Dims, lead):
    want = {"xbc": (*lead, d.conv_dim), "dt": (*lead, d.heads), "conv_weight": (d.conv_dim, d.conv_kernel),
            "A_log": (d.heads,), "dt_bias": (d.heads,), "D": (d.heads,)}
    got = {"xbc": xbc, "dt": dt, "conv_weight": conv_weight, "A_log": A_log, "dt_bias": dt_bias, "D": D}
    if conv_bias is not None:
        want["conv_bias"], got["conv_bias"] = (d.conv_dim,), conv_bias
    for k, shape in want.items():
        if tuple(got[k].shape) != tuple(shape):
            raise ValueError(f"{k} must be {list(shape)}, got {list(got[k].shape)}")
        if not jnp.issubdtype(got[k].dtype, jnp.floating):
            raise ValueError(f"{k} must be floating point, got {got[k].dtype}")


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
    rep = d.heads // d.groups
    Bh = jnp.repeat(Bm, rep, axis=1)                                   # [B, H, N]
    Ch = jnp.repeat(Cm, rep, axis=1)
    dt = softplus(dt_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    if dt_min is not None:
        dt = jnp.maximum(dt, _per_row(dt_min, dt.ndim))
    dA = jnp.exp(dt * -jnp.exp(A_log.astype(jnp.float32)))            # [B, H]
    S = S * dA[..., None, None] + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", S, Ch, precision="highest") + D.astype(jnp.float32)[:, None] * x
    return y, S


# --------------------------------------------------------------------------- decode: reference


def mamba2_decode_reference(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, *, view):
    """Plain-JAX Mamba2 decode step (XLA gather/scatter of the slots' rows); see the module doc."""
    check_state_view(arena, view)
    d = mamba2_dims(view)
    B = slots.shape[0]
    _check(xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, d, (B,))
    st = read_state_reference(arena, slots, view=view)
    xc, conv = conv_decode_reference(st["conv"], xbc, conv_weight, conv_bias)
    y, S = _ssm_step(st["ssm"], xc, dt, A_log, dt_bias, D, d)
    arena = write_state_reference(arena, slots, {"conv": conv, "ssm": S}, view=view)
    y = jnp.where((slots != 0)[:, None, None], y, 0.0)
    return y.astype(xbc.dtype), arena


# --------------------------------------------------------------------------- decode: Pallas


def ssm_block(view, P: int, N: int, target: int = 4096) -> int | None:
    """Head rows per program (block_p): a power of two dividing P whose [block_p, N] tile of the
    ssm state is one block (block_fits), about `target` elements; None if no such block."""
    bp = 1
    while P % (bp * 2) == 0 and bp * 2 * N <= target:
        bp *= 2
    while bp >= 1:
        if block_fits(view, bp * N):
            return bp
        bp //= 2
    return None


def _ssm_kernel(slots_ref, xc_ref, dt_ref, alog_ref, dtb_ref, d_ref, arena_in, y_ref, arena_ref, *,
                view, d: Mamba2Dims, bp: int):
    del arena_in  # aliased with arena_ref
    b, h, pc = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    H, P, N, G = d.heads, d.head_dim, d.state_size, d.groups
    slot = slots_ref[b]
    p0 = pl.multiple_of(pc * bp, bp)
    y_dst = y_ref.at[b, h, pl.ds(p0, bp)]

    @pl.when(slot == 0)
    def _():
        pltr.store(y_dst, jnp.zeros((bp,), y_ref.dtype))

    @pl.when(slot != 0)
    def _():
        g = h // (H // G)
        x = pltr.load(xc_ref.at[b, pl.ds(h * P + p0, bp)])                      # fp32 [bp]
        Bv = pltr.load(xc_ref.at[b, pl.ds(H * P + g * N, N)])                   # [N]
        Cv = pltr.load(xc_ref.at[b, pl.ds(H * P + G * N + g * N, N)])
        dt = softplus(dt_ref[b, h].astype(jnp.float32) + dtb_ref[h].astype(jnp.float32))
        dA = jnp.exp(-dt * jnp.exp(alog_ref[h].astype(jnp.float32)))
        rows = view["ssm"]
        flat0 = h * (P * N) + p0 * N
        S = load_block(arena_ref, slot, view, rows, flat0, (bp, N))
        S = S * dA + (dt * x)[:, None] * Bv[None, :]
        store_block(arena_ref, slot, view, rows, flat0, S)
        y = jnp.sum(S * Cv[None, :], axis=1) + d_ref[h].astype(jnp.float32) * x
        pltr.store(y_dst, y.astype(y_ref.dtype))


def pallas_supported(view) -> bool:
    """Whether the Pallas decode kernel can address this layout (else use the reference)."""
    d = mamba2_dims(view)
    return ssm_block(view, d.head_dim, d.state_size) is not None and conv_block(view, view["conv"], d.conv_dim) >= 16


@functools.partial(jax.jit, static_argnames=("view", "interpret", "block_p", "conv_block_c", "num_warps", "num_stages"))
def _mamba2_decode_pallas(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                          interpret=False, block_p=None, conv_block_c=None, num_warps=4, num_stages=1):
    check_state_view(arena, view)
    d = mamba2_dims(view)
    B = slots.shape[0]
    _check(xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, d, (B,))
    if slots.shape != (B,) or slots.dtype != jnp.int32:
        raise ValueError(f"slots must be int32 [B], got {slots.dtype}{list(slots.shape)}")
    bp = block_p or ssm_block(view, d.head_dim, d.state_size)
    if bp is None or d.head_dim % bp or not block_fits(view, bp * d.state_size):
        raise ValueError(f"no Pallas tile for ssm [{d.heads}, {d.head_dim}, {d.state_size}] in {view.row_words}-word "
                         "rows (needs a power-of-two block_p*N that divides or is whole rows); use impl='reference'")
    dtype = arena.dtype
    words = to_u16(arena)  # integer words only: see state_io._U16_NOTE
    params = triton_params(num_warps=num_warps, num_stages=num_stages)
    xc, words = conv_decode_pallas(words, slots, xbc, conv_weight, conv_bias, view=view, rows=view["conv"],
                                   interpret=interpret, block=conv_block_c, compiler_params=params)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    y, words = pl.pallas_call(
        functools.partial(_ssm_kernel, view=view, d=d, bp=bp),
        grid=(B, d.heads, d.head_dim // bp),
        in_specs=[any_] * 7,
        out_specs=(any_, any_),
        out_shape=(jax.ShapeDtypeStruct((B, d.heads, d.head_dim), xbc.dtype),
                   jax.ShapeDtypeStruct(words.shape, words.dtype)),
        input_output_aliases={6: 1},
        compiler_params=params,
        interpret=interpret,
        name="mamba2_ssm_decode",
    )(slots, xc, dt, A_log, dt_bias, D, words)
    return y, from_u16(words, dtype)


def mamba2_decode(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                  impl: str | None = None, interpret: bool = False, **tuning):
    """One Mamba2 decode token per request, reading and writing each request's slot in place.

    Returns (y [B, H, P] in xbc's dtype, arena).  impl: "pallas" | "reference"; default pallas on
    GPU (or with interpret=True) when the layout has a Pallas tile (`pallas_supported`), else the
    reference.  tuning: block_p, conv_block_c, num_warps, num_stages.
    """
    chosen = resolve_impl(impl, interpret)
    if chosen == "pallas" and impl is None and not pallas_supported(view):
        chosen = "reference"
    if chosen == "reference":
        return mamba2_decode_reference(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, view=view)
    return _mamba2_decode_pallas(arena, slots, xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, view=view,
                                 interpret=interpret, **tuning)


# --------------------------------------------------------------------------- prefill


def _checkpoint_args(checkpoint_positions, checkpoint_slots, q_lens):
    """Normalise checkpoint args: positions outside [0, q_len] or slot <= 0 are padding (slot 0)."""
    if checkpoint_positions is None:
        return None, None
    pos = checkpoint_positions.astype(jnp.int32)
    sl = checkpoint_slots.astype(jnp.int32)
    if pos.shape != sl.shape or pos.ndim != 2 or pos.shape[0] != q_lens.shape[0]:
        raise ValueError(f"checkpoint_positions and checkpoint_slots must both be [B, K], got {pos.shape} {sl.shape}")
    valid = (pos >= 0) & (pos <= q_lens[:, None]) & (sl > 0)
    return jnp.where(valid, pos, 0), jnp.where(valid, sl, 0)


def _initial(st, reset):
    if reset is None:
        return st
    keep = ~reset.astype(bool)
    return {k: jnp.where(keep.reshape(-1, *([1] * (v.ndim - 1))), v, jnp.zeros((), v.dtype)) for k, v in st.items()}


def _scan_core(S0, xc, dt, q_lens, pos, A_log, dt_bias, D, d: Mamba2Dims, dt_min):
    """Per-token recurrence (lax.scan over T).  S0 [B, H, P, N]; xc fp32 [B, T, conv_dim]; dt raw
    [B, T, H]; pos [B, Kc] | None -> (y [B, T, H, P], S [B, H, P, N], ck [B, Kc, H, P, N] | None)."""
    T = xc.shape[1]

    def body(carry, inp):
        S, ck = carry
        t, xc_t, dt_t = inp
        y, S_new = _ssm_step(S, xc_t, dt_t, A_log, dt_bias, D, d, dt_min)
        S = jnp.where((t < q_lens)[:, None, None, None], S_new, S)
        if ck is not None:  # checkpoint p = t + 1: the state after token t
            ck = jnp.where((pos == t + 1)[:, :, None, None, None], S[:, None], ck)
        return (S, ck), y

    ck0 = None
    if pos is not None:  # p = 0: the state before the chunk
        ck0 = jnp.where((pos == 0)[:, :, None, None, None], S0[:, None], jnp.zeros((), jnp.float32))
    (S, ck), ys = jax.lax.scan(body, (S0, ck0), (jnp.arange(T, dtype=jnp.int32), jnp.swapaxes(xc, 0, 1),
                                                  jnp.swapaxes(dt, 0, 1)))
    return jnp.swapaxes(ys, 0, 1), S, ck


def _chunked_core(S0, xc, dt, q_lens, pos, A_log, dt_bias, D, d: Mamba2Dims, dt_min, chunk: int):
    """SSD-style chunked scan (same contract as _scan_core): inside a chunk of L tokens every
    output and the end state are matmuls over decay-weighted pairs; a lax.scan carries the state
    across the T/L chunks.  Padding tokens get dt = 0, i.e. decay 1 and no input: the state passes
    through them unchanged, so one formula serves every q_len.

    Per chunk, with a_t = dt_t * A_h, Ac = cumsum(a) (<= 0, decreasing), u_t = dt_t x_t:
      y_t   = sum_{s<=t} exp(Ac_t - Ac_s) (C_t . B_s) u_s + exp(Ac_t) C_t S_prev + D x_t
      S_end = exp(Ac_L) S_prev + sum_s exp(Ac_L - Ac_s) u_s (outer) B_s
    (every exponent is <= 0, so nothing overflows)."""
    hp = "highest"
    B, T = xc.shape[:2]
    H, P, N, G = d.heads, d.head_dim, d.state_size, d.groups
    R = H // G
    L = min(chunk, T)
    nc = -(-T // L)
    x, Bm, Cm = _split(xc, d)                                                 # [B,T,H,P], [B,T,G,N] x2
    dts = softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    if dt_min is not None:
        dts = jnp.maximum(dts, _per_row(dt_min, dts.ndim))
    dts = jnp.where(jnp.arange(T)[None, :, None] < q_lens[:, None, None], dts, 0.0)
    A = -jnp.exp(A_log.astype(jnp.float32))
    Dv = D.astype(jnp.float32)

    def chunks(a):  # [B, T, ...] -> [nc, B, L, ...] (zero-padded: dt 0 there, so inert)
        a = jnp.pad(a, ((0, 0), (0, nc * L - T)) + ((0, 0),) * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, nc, L, *a.shape[2:]), 1, 0)

    causal = jnp.tril(jnp.ones((L, L), bool))
    s_idx = jnp.arange(L)

    def body(carry, inp):
        S, ck = carry
        c, x_c, B_c, C_c, dt_c = inp
        Ac = jnp.cumsum(dt_c * A, axis=1)                                      # [B, L, H]
        u = dt_c[..., None] * x_c                                             # [B, L, H, P]
        Bh, Ch = jnp.repeat(B_c, R, axis=2), jnp.repeat(C_c, R, axis=2)       # [B, L, H, N]
        seg = Ac[:, :, None, :] - Ac[:, None, :, :]                           # [B, t, s, H]
        decay = jnp.where(causal[None, :, :, None], jnp.exp(jnp.where(causal[None, :, :, None], seg, 0.0)), 0.0)
        CB = jnp.repeat(jnp.einsum("btgn,bsgn->btsg", C_c, B_c, precision=hp), R, axis=3)
        y = jnp.einsum("btsh,bshp->bthp", decay * CB, u, precision=hp)
        y = y + jnp.exp(Ac)[..., None] * jnp.einsum("bthn,bhpn->bthp", Ch, S, precision=hp)
        y = y + Dv[:, None] * x_c
        w_end = jnp.exp(Ac[:, -1:, :] - Ac)                                    # [B, L, H]
        S_new = jnp.exp(Ac[:, -1])[..., None, None] * S + jnp.einsum("bsh,bshp,bshn->bhpn", w_end, u, Bh,
                                                                      precision=hp)
        if ck is not None:  # state after local token li = pos - c*L - 1, for pos in this chunk
            li = pos - c * L - 1                                              # [B, Kc]
            inside = (li >= 0) & (li < L)
            lic = jnp.clip(li, 0, L - 1)
            Ac_li = jnp.take_along_axis(Ac, lic[:, :, None], axis=1)          # [B, Kc, H]
            before = (s_idx[None, None, :] <= lic[:, :, None])[..., None]     # [B, Kc, L, 1]
            w = jnp.where(before, jnp.exp(jnp.where(before, Ac_li[:, :, None, :] - Ac[:, None], 0.0)), 0.0)
            S_k = (jnp.exp(Ac_li)[..., None, None] * S[:, None]
                   + jnp.einsum("bksh,bshp,bshn->bkhpn", w, u, Bh, precision=hp))
            ck = jnp.where(inside[:, :, None, None, None], S_k, ck)
        return (S_new, ck), y

    ck0 = None
    if pos is not None:
        ck0 = jnp.where((pos == 0)[:, :, None, None, None], S0[:, None], jnp.zeros((), jnp.float32))
    (S, ck), ys = jax.lax.scan(body, (S0, ck0), (jnp.arange(nc, dtype=jnp.int32), chunks(x), chunks(Bm),
                                                  chunks(Cm), chunks(dts)))
    y = jnp.moveaxis(ys, 0, 1).reshape(B, nc * L, H, P)[:, :T]
    return y, S, ck


def _prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, *, view, dt_min, reset,
             checkpoint_positions, checkpoint_slots, state_impl, interpret, algo, chunk_size):
    check_state_view(arena, view)
    d = mamba2_dims(view)
    B, T = xbc.shape[:2]
    _check(xbc, dt, conv_weight, conv_bias, A_log, dt_bias, D, d, (B, T))
    if algo not in ("scan", "chunked"):
        raise ValueError(f"algo must be 'scan' or 'chunked', got {algo!r}")
    q_lens = q_lens.astype(jnp.int32)
    pos, ck_slots = _checkpoint_args(checkpoint_positions, checkpoint_slots, q_lens)
    st = _initial(read_state(arena, slots, view=view, impl=state_impl, interpret=interpret), reset)
    xc, conv_final, conv_at = conv_prefill_reference(st["conv"], xbc, q_lens, conv_weight, conv_bias,
                                                     positions=pos)
    if algo == "scan":
        y, S, ck = _scan_core(st["ssm"], xc, dt, q_lens, pos, A_log, dt_bias, D, d, dt_min)
    else:
        y, S, ck = _chunked_core(st["ssm"], xc, dt, q_lens, pos, A_log, dt_bias, D, d, dt_min, chunk_size)
    valid = (jnp.arange(T)[None, :] < q_lens[:, None]) & (slots != 0)[:, None]
    y = jnp.where(valid[:, :, None, None], y, 0.0).astype(xbc.dtype)
    arena = write_state(arena, slots, {"conv": conv_final, "ssm": S}, view=view, impl=state_impl, interpret=interpret)
    if pos is not None:
        Kc = pos.shape[1]
        ck_slots = jnp.where((slots != 0)[:, None], ck_slots, 0)
        arena = write_state(arena, ck_slots.reshape(-1),
                            {"conv": conv_at.reshape(B * Kc, *conv_at.shape[2:]),
                             "ssm": ck.reshape(B * Kc, *ck.shape[2:])},
                            view=view, impl=state_impl, interpret=interpret)
    return y, arena


def mamba2_prefill_reference(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                             dt_min: float = 0.0, reset=None, checkpoint_positions=None, checkpoint_slots=None):
    """Prefill a padded chunk by a `lax.scan` over its tokens (the exact per-token recurrence).

    xbc [B, T, conv_dim], dt [B, T, H] raw; q_lens int32 [B] valid tokens per row (tokens
    j >= q_len leave the state untouched; their y is 0).  The scan starts from the state in the
    slot, or from zeros where reset [B] (bool) is set (a request's first chunk).  dt is clamped
    to [dt_min, inf) after the softplus, as NemotronH's prefill does; dt_min is a float or a
    [B] array (per row: 0 leaves a row unclamped, e.g. a decoding row riding a mixed chunk).
    checkpoint_positions / checkpoint_slots int32 [B, Kc]: the state after the first p tokens of
    this chunk (0 <= p <= q_len) is also written to checkpoint slot s; p = -1 or s = 0 is padding.
    Returns (y [B, T, H, P] in xbc's dtype, arena).
    """
    return _prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, view=view,
                    dt_min=dt_min, reset=reset, checkpoint_positions=checkpoint_positions,
                    checkpoint_slots=checkpoint_slots, state_impl="reference", interpret=False, algo="scan",
                    chunk_size=0)


def mamba2_prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, *, view,
                   dt_min: float = 0.0, reset=None, checkpoint_positions=None, checkpoint_slots=None,
                   algo: str = "chunked", chunk_size: int = 64, impl: str | None = None, interpret: bool = False):
    """Prefill one padded chunk per request from the state in its slot (arguments as
    `mamba2_prefill_reference`).  Plain JAX: algo "chunked" (SSD, default; `chunk_size` tokens
    per matmul block) or "scan" (per token).  `impl` picks the state read/write path (Pallas on
    GPU).  Returns (y [B, T, H, P] in xbc's dtype, arena)."""
    return _prefill(arena, slots, xbc, dt, q_lens, conv_weight, conv_bias, A_log, dt_bias, D, view=view,
                    dt_min=dt_min, reset=reset, checkpoint_positions=checkpoint_positions,
                    checkpoint_slots=checkpoint_slots, state_impl=resolve_impl(impl, interpret), interpret=interpret,
                    algo=algo, chunk_size=chunk_size)
