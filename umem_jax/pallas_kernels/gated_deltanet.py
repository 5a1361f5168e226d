"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) recurrent state: decode kernel and
prefill scan.

State of one layer in a request's slot (declarations.gated_deltanet_state_tensors):
  conv      [K-1, conv_dim]  the last K-1 pre-conv inputs q|k|v (conv dtype, bf16 by default)
  recurrent [Hv, Dv, Dk] fp32, v-major: recurrent[h, v, k] = S_h[k, v] of Hugging Face's
            [Hv, Dk, Dv] cache (transposed so each v-block of a head is contiguous words)
with conv_dim = 2*Hk*Dk + Hv*Dv, channels ordered [Q (Hk*Dk) | K (Hk*Dk) | V (Hv*Dv)].

Math (HF `Qwen3_5GatedDeltaNet` + `torch_recurrent_gated_delta_rule`, one token):
  q|k|v   = silu(causal_conv1d(qkv | conv state))                 (no conv bias)
  q, k    = l2norm over Dk: x * rsqrt(sum x^2 + 1e-6);  q *= Dk^-0.5
  GQA     : value head h reads key head h // (Hv // Hk)           (HF's repeat_interleave)
  beta    = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)  [Hv], fp32
  S_h     = exp(g) * S_h
  delta   = beta * (v - S_h^T k)                                  [Dv]
  S_h     = S_h + k (outer) delta                                 [Dk, Dv]
  o       = S_h^T q                                               [Dv]
The gated RMSNorm with z and the output projection stay in the model.

Entry points (arena first in, last out; call under a jit that donates it):
  gdn_decode(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view) -> (o [B, Hv, Dv], arena)
  gdn_prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, *, view, reset=None,
              checkpoint_positions=None, checkpoint_slots=None, algo="chunked", chunk_size=64)
      -> (o [B, T, Hv, Dv], arena)
  (plus *_reference twins: the decode in plain JAX, the prefill as a per-token lax.scan)
Shapes: slots int32 [B] (0 = padding lane: output 0, no state touched); qkv [B, conv_dim]
(prefill [B, T, conv_dim]); a, b [B, Hv] raw projections (prefill [B, T, Hv]); conv_weight
[conv_dim, K] (HF conv1d.weight squeezed); A_log, dt_bias [Hv].  o has qkv's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr, resolve_impl, triton_params
from .causal_conv import conv_block, conv_decode_pallas, conv_decode_reference, conv_prefill_reference
from .mamba2 import _checkpoint_args, _initial, softplus
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
    "GDNDims",
    "gdn_decode",
    "gdn_decode_reference",
    "gdn_dims",
    "gdn_prefill",
    "gdn_prefill_reference",
    "pallas_supported",
    "L2NORM_EPS",
]

L2NORM_EPS = 1e-6  # HF's l2norm(x, eps=1e-6) in the recurrent and chunked delta rules


@dataclasses.dataclass(frozen=True)
class GDNDims:
    k_heads: int   # Hk
    v_heads: int   # Hv
    k_dim: int     # Dk
    v_dim: int     # Dv
    conv_kernel: int
    conv_dim: int  # 2*Hk*Dk + Hv*Dv


def gdn_dims(view) -> GDNDims:
    """Dimensions from a layer's StateView (tensors "conv" [K-1, conv_dim], "recurrent" [Hv, Dv, Dk])."""
    try:
        conv, rec = view["conv"].tensor, view["recurrent"].tensor
    except KeyError:
        raise ValueError("a gated DeltaNet state view needs the tensors 'conv' and 'recurrent'") from None
    Hv, Dv, Dk = rec.shape
    Km1, C = conv.shape
    rest = C - Hv * Dv
    if rest <= 0 or rest % (2 * Dk) or Hv % (rest // (2 * Dk)):
        raise ValueError(f"conv width {C} is not 2*Hk*Dk + Hv*Dv for recurrent [Hv, Dv, Dk] = {rec.shape}")
    if rec.dtype != "float32":
        raise ValueError(f"the recurrent state must be float32, got {rec.dtype}")
    return GDNDims(rest // (2 * Dk), Hv, Dk, Dv, Km1 + 1, C)


def _check(qkv, a, b, conv_weight, A_log, dt_bias, d: GDNDims, lead):
    want = {"qkv": (*lead, d.conv_dim), "a": (*lead, d.v_heads), "b": (*lead, d.v_heads),
            "conv_weight": (d.conv_dim, d.conv_kernel), "A_log": (d.v_heads,), "dt_bias": (d.v_heads,)}
    got = {"qkv": qkv, "a": a, "b": b, "conv_weight": conv_weight, "A_log": A_log, "dt_bias": dt_bias}
    for k, shape in want.items():
        if tuple(got[k].shape) != tuple(shape):
            raise ValueError(f"{k} must be {list(shape)}, got {list(got[k].shape)}")
        if not jnp.issubdtype(got[k].dtype, jnp.floating):
            raise ValueError(f"{k} must be floating point, got {got[k].dtype}")


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _gates(a, b, A_log, dt_bias):
    """(g, beta) fp32 from the raw projections a, b [..., Hv]."""
    g = -jnp.exp(A_log.astype(jnp.float32)) * softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def _qkv(xc, d: GDNDims):
    """Conv output [B, conv_dim] -> q, k [B, Hv, Dk] (normalised, q scaled, repeated per value
    head) and v [B, Hv, Dv]."""
    HK = d.k_heads * d.k_dim
    B = xc.shape[0]
    q = _l2norm(xc[:, :HK].reshape(B, d.k_heads, d.k_dim)) * (d.k_dim ** -0.5)
    k = _l2norm(xc[:, HK:2 * HK].reshape(B, d.k_heads, d.k_dim))
    v = xc[:, 2 * HK:].reshape(B, d.v_heads, d.v_dim)
    r = d.v_heads // d.k_heads
    return jnp.repeat(q, r, axis=1), jnp.repeat(k, r, axis=1), v


def _delta_step(S, xc, g, beta, d: GDNDims):
    """One token: S fp32 [B, Hv, Dv, Dk] (v-major), xc fp32 [B, conv_dim], g, beta [B, Hv]
    -> (o fp32 [B, Hv, Dv], S')."""
    q, k, v = _qkv(xc, d)
    S = S * jnp.exp(g)[..., None, None]
    kv = jnp.einsum("bhvk,bhk->bhv", S, k, precision="highest")           # S^T k
    delta = beta[..., None] * (v - kv)
    S = S + delta[..., :, None] * k[..., None, :]
    o = jnp.einsum("bhvk,bhk->bhv", S, q, precision="highest")            # S^T q
    return o, S


# --------------------------------------------------------------------------- decode: reference


def gdn_decode_reference(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view):
    """Plain-JAX gated DeltaNet decode step (XLA gather/scatter of the slots' rows)."""
    check_state_view(arena, view)
    d = gdn_dims(view)
    B = slots.shape[0]
    _check(qkv, a, b, conv_weight, A_log, dt_bias, d, (B,))
    st = read_state_reference(arena, slots, view=view)
    xc, conv = conv_decode_reference(st["conv"], qkv, conv_weight, None)
    g, beta = _gates(a, b, A_log, dt_bias)
    o, S = _delta_step(st["recurrent"], xc, g, beta, d)
    arena = write_state_reference(arena, slots, {"conv": conv, "recurrent": S}, view=view)
    o = jnp.where((slots != 0)[:, None, None], o, 0.0)
    return o.astype(qkv.dtype), arena


# --------------------------------------------------------------------------- decode: Pallas


def delta_block(view, Dv: int, Dk: int, target: int = 4096) -> int | None:
    """Value rows per program (block_v): a power of two dividing Dv whose [block_v, Dk] tile is
    one block (block_fits), about `target` elements; None if there is none."""
    bv = 1
    while Dv % (bv * 2) == 0 and bv * 2 * Dk <= target:
        bv *= 2
    while bv >= 1:
        if block_fits(view, bv * Dk):
            return bv
        bv //= 2
    return None


def _delta_kernel(slots_ref, xc_ref, a_ref, b_ref, alog_ref, dtb_ref, arena_in, o_ref, arena_ref, *,
                  view, d: GDNDims, bv: int):
    del arena_in  # aliased with arena_ref
    b, h, vc = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    Hk, Dk, Dv = d.k_heads, d.k_dim, d.v_dim
    slot = slots_ref[b]
    v0 = pl.multiple_of(vc * bv, bv)
    o_dst = o_ref.at[b, h, pl.ds(v0, bv)]

    @pl.when(slot == 0)
    def _():
        pltr.store(o_dst, jnp.zeros((bv,), o_ref.dtype))

    @pl.when(slot != 0)
    def _():
        j = h // (d.v_heads // Hk)                                             # key head of value head h
        q = pltr.load(xc_ref.at[b, pl.ds(j * Dk, Dk)])                         # fp32 [Dk]
        k = pltr.load(xc_ref.at[b, pl.ds(Hk * Dk + j * Dk, Dk)])
        v = pltr.load(xc_ref.at[b, pl.ds(2 * Hk * Dk + h * Dv + v0, bv)])      # [bv]
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS) * (Dk ** -0.5)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
        g = -jnp.exp(alog_ref[h].astype(jnp.float32)) * softplus(a_ref[b, h].astype(jnp.float32)
                                                                  + dtb_ref[h].astype(jnp.float32))
        beta = jax.nn.sigmoid(b_ref[b, h].astype(jnp.float32))
        rows = view["recurrent"]
        flat0 = h * (Dv * Dk) + v0 * Dk
        S = load_block(arena_ref, slot, view, rows, flat0, (bv, Dk)) * jnp.exp(g)   # [bv, Dk] = S^T rows
        kv = jnp.sum(S * k[None, :], axis=1)
        delta = beta * (v - kv)
        S = S + delta[:, None] * k[None, :]
        store_block(arena_ref, slot, view, rows, flat0, S)
        o = jnp.sum(S * q[None, :], axis=1)
        pltr.store(o_dst, o.astype(o_ref.dtype))


def pallas_supported(view) -> bool:
    """Whether the Pallas decode kernel can address this layout (else use the reference)."""
    d = gdn_dims(view)
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    return (pow2(d.k_dim) and delta_block(view, d.v_dim, d.k_dim) is not None
            and conv_block(view, view["conv"], d.conv_dim) >= 16)


@functools.partial(jax.jit, static_argnames=("view", "interpret", "block_v", "conv_block_c", "num_warps", "num_stages"))
def _gdn_decode_pallas(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view, interpret=False,
                       block_v=None, conv_block_c=None, num_warps=4, num_stages=1):
    check_state_view(arena, view)
    d = gdn_dims(view)
    B = slots.shape[0]
    _check(qkv, a, b, conv_weight, A_log, dt_bias, d, (B,))
    if slots.shape != (B,) or slots.dtype != jnp.int32:
        raise ValueError(f"slots must be int32 [B], got {slots.dtype}{list(slots.shape)}")
    bv = block_v or delta_block(view, d.v_dim, d.k_dim)
    if bv is None or d.v_dim % bv or not block_fits(view, bv * d.k_dim) or d.k_dim & (d.k_dim - 1):
        raise ValueError(f"no Pallas tile for recurrent [{d.v_heads}, {d.v_dim}, {d.k_dim}] in {view.row_words}-word "
                         "rows (needs power-of-two Dk and block_v*Dk dividing or whole rows); use impl='reference'")
    dtype = arena.dtype
    words = to_u16(arena)  # integer words only: see state_io._U16_NOTE
    params = triton_params(num_warps=num_warps, num_stages=num_stages)
    xc, words = conv_decode_pallas(words, slots, qkv, conv_weight, None, view=view, rows=view["conv"],
                                   interpret=interpret, block=conv_block_c, compiler_params=params)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    o, words = pl.pallas_call(
        functools.partial(_delta_kernel, view=view, d=d, bv=bv),
        grid=(B, d.v_heads, d.v_dim // bv),
        in_specs=[any_] * 7,
        out_specs=(any_, any_),
        out_shape=(jax.ShapeDtypeStruct((B, d.v_heads, d.v_dim), qkv.dtype),
                   jax.ShapeDtypeStruct(words.shape, words.dtype)),
        input_output_aliases={6: 1},
        compiler_params=params,
        interpret=interpret,
        name="gdn_delta_decode",
    )(slots, xc, a, b, A_log, dt_bias, words)
    return o, from_u16(words, dtype)


def gdn_decode(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view, impl: str | None = None,
               interpret: bool = False, **tuning):
    """One gated DeltaNet decode token per request, reading and writing each slot in place.

    Returns (o [B, Hv, Dv] in qkv's dtype, arena).  impl: "pallas" | "reference"; default pallas on
    GPU (or with interpret=True) when `pallas_supported(view)`, else the reference.
    tuning: block_v, conv_block_c, num_warps, num_stages.
    """
    chosen = resolve_impl(impl, interpret)
    if chosen == "pallas" and impl is None and not pallas_supported(view):
        chosen = "reference"
    if chosen == "reference":
        return gdn_decode_reference(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, view=view)
    return _gdn_decode_pallas(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, view=view, interpret=interpret,
                              **tuning)


# --------------------------------------------------------------------------- prefill


def _scan_core(S0, xc, g, beta, q_lens, pos, d: GDNDims):
    """Per-token recurrence.  S0 [B, Hv, Dv, Dk]; xc fp32 [B, T, conv_dim]; g, beta [B, T, Hv];
    pos [B, Kc] | None -> (o [B, T, Hv, Dv], S, ck [B, Kc, Hv, Dv, Dk] | None)."""
    T = xc.shape[1]

    def body(carry, inp):
        S, ck = carry
        t, xc_t, g_t, beta_t = inp
        o, S_new = _delta_step(S, xc_t, g_t, beta_t, d)
        S = jnp.where((t < q_lens)[:, None, None, None], S_new, S)
        if ck is not None:
            ck = jnp.where((pos == t + 1)[:, :, None, None, None], S[:, None], ck)
        return (S, ck), o

    ck0 = None
    if pos is not None:
        ck0 = jnp.where((pos == 0)[:, :, None, None, None], S0[:, None], jnp.zeros((), jnp.float32))
    sw = lambda x: jnp.swapaxes(x, 0, 1)
    (S, ck), os_ = jax.lax.scan(body, (S0, ck0), (jnp.arange(T, dtype=jnp.int32), sw(xc), sw(g), sw(beta)))
    return sw(os_), S, ck


def _chunked_core(S0, xc, g, beta, q_lens, pos, d: GDNDims, chunk: int):
    """Chunked delta rule (the WY/UT form of HF's `torch_chunk_gated_delta_rule`; same contract
    as _scan_core).  Padding tokens get g = 0 and beta = 0: decay 1 and no update, so the state
    passes through them.  Per chunk of L tokens with gc = cumsum(g) and S in HF orientation
    [Dk, Dv]:
      M      = strictly-lower (beta_t k_t . k_s) exp(gc_t - gc_s);   U = (I + M)^-1
      delta  = U (beta v) - U (beta exp(gc) k) S_prev                  (the per-token deltas)
      o_t    = exp(gc_t) q_t S_prev + sum_{s<=t} exp(gc_t - gc_s) (q_t . k_s) delta_s
      S_end  = exp(gc_L) S_prev + sum_s exp(gc_L - gc_s) k_s (outer) delta_s
    (every exponent is <= 0).  The triangular inverse is a unit-lower triangular solve."""
    hp = "highest"
    B, T = xc.shape[:2]
    H, Dk, Dv = d.v_heads, d.k_dim, d.v_dim
    L = min(chunk, T)
    nc = -(-T // L)
    live = jnp.arange(T)[None, :, None] < q_lens[:, None, None]
    g = jnp.where(live, g, 0.0)
    beta = jnp.where(live, beta, 0.0)
    q, k, v = jax.vmap(lambda x: _qkv(x, d), in_axes=1, out_axes=1)(xc)       # [B, T, H, Dk|Dv]

    def chunks(a):  # [B, T, ...] -> [nc, B, L, ...], zero-padded (g = beta = 0 there: inert)
        a = jnp.pad(a, ((0, 0), (0, nc * L - T)) + ((0, 0),) * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(B, nc, L, *a.shape[2:]), 1, 0)

    strict = jnp.tril(jnp.ones((L, L), bool), -1)
    causal = jnp.tril(jnp.ones((L, L), bool))
    s_idx = jnp.arange(L)
    eye = jnp.eye(L, dtype=jnp.float32)

    def body(carry, inp):
        S, ck = carry                                                        # S [B, H, Dk, Dv] (HF)
        c, q_c, k_c, v_c, g_c, b_c = inp                                     # [B, L, H, .], g/b [B, L, H]
        gc = jnp.cumsum(g_c, axis=1)                                         # [B, L, H]
        seg = gc[:, :, None, :] - gc[:, None, :, :]                          # [B, t, s, H]
        decay = jnp.exp(jnp.where(causal[None, :, :, None], seg, -jnp.inf))  # 0 above the diagonal
        kk = jnp.einsum("bthd,bshd->btsh", k_c, k_c, precision=hp)
        M = jnp.where(strict[None, :, :, None], b_c[:, :, None, :] * kk * decay, 0.0)
        IM = jnp.moveaxis(M, 3, 1) + eye                                     # [B, H, t, s] unit lower
        rhs = jnp.concatenate([jnp.moveaxis(b_c[..., None] * v_c, 2, 1),
                               jnp.moveaxis((b_c * jnp.exp(gc))[..., None] * k_c, 2, 1)], axis=-1)
        sol = jax.lax.linalg.triangular_solve(IM, rhs, left_side=True, lower=True, unit_diagonal=True)
        u_v, u_k = sol[..., :Dv], sol[..., Dv:]                              # [B, H, L, Dv|Dk]
        delta = u_v - jnp.einsum("bhtk,bhkv->bhtv", u_k, S, precision=hp)    # [B, H, L, Dv]
        qk = jnp.einsum("bthd,bshd->bhts", q_c, k_c, precision=hp) * jnp.moveaxis(decay, 3, 1)
        eg = jnp.moveaxis(jnp.exp(gc), 2, 1)                                 # [B, H, L]
        o = (eg[..., None] * jnp.einsum("bthk,bhkv->bhtv", q_c, S, precision=hp)
             + jnp.einsum("bhts,bhsv->bhtv", qk, delta, precision=hp))
        kh = jnp.moveaxis(k_c, 2, 1)                                         # [B, H, L, Dk]
        gch = jnp.moveaxis(gc, 2, 1)                                         # [B, H, L]
        w_end = jnp.exp(gch[..., -1:] - gch)
        S_new = jnp.exp(gc[:, -1])[..., None, None] * S + jnp.einsum("bhs,bhsk,bhsv->bhkv", w_end, kh, delta,
                                                                      precision=hp)
        if ck is not None:
            li = pos - c * L - 1
            inside = (li >= 0) & (li < L)
            lic = jnp.clip(li, 0, L - 1)
            g_li = jnp.take_along_axis(gc, lic[:, :, None], axis=1)          # [B, Kc, H]
            before = (s_idx[None, None, :] <= lic[:, :, None])[:, :, None, :]  # [B, Kc, 1, L]
            gcs = jnp.moveaxis(gc, 2, 1)[:, None]                             # [B, 1, H, L]
            w = jnp.where(before, jnp.exp(jnp.where(before, g_li[..., None] - gcs, 0.0)), 0.0)
            S_k = (jnp.exp(g_li)[..., None, None] * S[:, None]
                   + jnp.einsum("bchs,bhsk,bhsv->bchkv", w, kh, delta, precision=hp))
            ck = jnp.where(inside[:, :, None, None, None], S_k, ck)
        return (S_new, ck), jnp.moveaxis(o, 1, 2)                            # o [B, L, H, Dv]

    hf = lambda x: jnp.swapaxes(x, -1, -2)                                   # arena [.., Dv, Dk] <-> HF [.., Dk, Dv]
    ck0 = None
    if pos is not None:
        ck0 = jnp.where((pos == 0)[:, :, None, None, None], hf(S0)[:, None], jnp.zeros((), jnp.float32))
    (S, ck), os_ = jax.lax.scan(body, (hf(S0), ck0), (jnp.arange(nc, dtype=jnp.int32), chunks(q), chunks(k),
                                                       chunks(v), chunks(g), chunks(beta)))
    o = jnp.moveaxis(os_, 0, 1).reshape(B, nc * L, H, Dv)[:, :T]
    return o, hf(S), (None if ck is None else hf(ck))


def _prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, *, view, reset, checkpoint_positions,
             checkpoint_slots, state_impl, interpret, algo, chunk_size):
    check_state_view(arena, view)
    d = gdn_dims(view)
    B, T = qkv.shape[:2]
    _check(qkv, a, b, conv_weight, A_log, dt_bias, d, (B, T))
    if algo not in ("scan", "chunked"):
        raise ValueError(f"algo must be 'scan' or 'chunked', got {algo!r}")
    q_lens = q_lens.astype(jnp.int32)
    pos, ck_slots = _checkpoint_args(checkpoint_positions, checkpoint_slots, q_lens)
    st = _initial(read_state(arena, slots, view=view, impl=state_impl, interpret=interpret), reset)
    xc, conv_final, conv_at = conv_prefill_reference(st["conv"], qkv, q_lens, conv_weight, None, positions=pos)
    g, beta = _gates(a, b, A_log, dt_bias)                                   # [B, T, Hv]
    if algo == "scan":
        o, S, ck = _scan_core(st["recurrent"], xc, g, beta, q_lens, pos, d)
    else:
        o, S, ck = _chunked_core(st["recurrent"], xc, g, beta, q_lens, pos, d, chunk_size)
    valid = (jnp.arange(T)[None, :] < q_lens[:, None]) & (slots != 0)[:, None]
    o = jnp.where(valid[:, :, None, None], o, 0.0).astype(qkv.dtype)
    arena = write_state(arena, slots, {"conv": conv_final, "recurrent": S}, view=view, impl=state_impl,
                        interpret=interpret)
    if pos is not None:
        Kc = pos.shape[1]
        ck_slots = jnp.where((slots != 0)[:, None], ck_slots, 0)
        arena = write_state(arena, ck_slots.reshape(-1),
                            {"conv": conv_at.reshape(B * Kc, *conv_at.shape[2:]),
                             "recurrent": ck.reshape(B * Kc, *ck.shape[2:])},
                            view=view, impl=state_impl, interpret=interpret)
    return o, arena


def gdn_prefill_reference(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, *, view, reset=None,
                          checkpoint_positions=None, checkpoint_slots=None):
    """Prefill a padded chunk by a `lax.scan` over its tokens (HF's recurrent delta rule).

    qkv [B, T, conv_dim]; a, b [B, T, Hv]; q_lens int32 [B] (tokens j >= q_len leave the state
    untouched; their o is 0).  Starts from the slot's state, or zeros where reset [B] is set.
    checkpoint_positions / checkpoint_slots int32 [B, Kc]: the state after the first p tokens of
    the chunk (0 <= p <= q_len) also goes to slot s; p = -1 or s = 0 is padding.
    Returns (o [B, T, Hv, Dv] in qkv's dtype, arena).
    """
    return _prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, view=view, reset=reset,
                    checkpoint_positions=checkpoint_positions, checkpoint_slots=checkpoint_slots,
                    state_impl="reference", interpret=False, algo="scan", chunk_size=0)


def gdn_prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, *, view, reset=None,
                checkpoint_positions=None, checkpoint_slots=None, algo: str = "chunked", chunk_size: int = 64,
                impl: str | None = None, interpret: bool = False):
    """Prefill one padded chunk per request from the state in its slot (arguments as
    `gdn_prefill_reference`).  Plain JAX: algo "chunked" (WY form, default) or "scan" (per
    token); `impl` picks the state read/write path.  Returns (o [B, T, Hv, Dv], arena)."""
    return _prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, view=view, reset=reset,
                    checkpoint_positions=checkpoint_positions, checkpoint_slots=checkpoint_slots,
                    state_impl=resolve_impl(impl, interpret), interpret=interpret, algo=algo, chunk_size=chunk_size)
