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
              checkpoint_positions=None, checkpoint_slots=None, algo=None, chunk_size=64)
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

from . import recurrent
from ._compat import pltr
from .causal_conv import conv_block
from .launch import resolve_impl
from .recurrent import check_shapes, chunk_checkpoints, from_chunks, initial_checkpoints, softplus, to_chunks
from .state_io import block_fits, check_slots, check_state_view, load_block, store_block

__all__ = ["L2NORM_EPS", "GDNDims", "gdn_decode", "gdn_decode_reference", "gdn_dims", "gdn_prefill",
           "gdn_prefill_reference", "pallas_supported"]

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
    history, C = conv.shape
    rest = C - Hv * Dv
    if rest <= 0 or rest % (2 * Dk) or Hv % (rest // (2 * Dk)):
        raise ValueError(f"conv width {C} is not 2*Hk*Dk + Hv*Dv for recurrent [Hv, Dv, Dk] = {rec.shape}")
    if rec.dtype not in recurrent.STATE_DTYPES:
        raise ValueError(f"the recurrent state must be one of {recurrent.STATE_DTYPES}, got {rec.dtype}")
    return GDNDims(rest // (2 * Dk), Hv, Dk, Dv, history + 1, C)


def _check(qkv, a, b, conv_weight, A_log, dt_bias, d: GDNDims, lead):
    want = {"qkv": (*lead, d.conv_dim), "a": (*lead, d.v_heads), "b": (*lead, d.v_heads),
            "conv_weight": (d.conv_dim, d.conv_kernel), "A_log": (d.v_heads,), "dt_bias": (d.v_heads,)}
    got = {"qkv": qkv, "a": a, "b": b, "conv_weight": conv_weight, "A_log": A_log, "dt_bias": dt_bias}
    check_shapes(want, got)


def _checked_dims(arena, view, qkv, a, b, conv_weight, A_log, dt_bias, lead) -> GDNDims:
    """Static checks of a call; `lead` is the leading shape of qkv, a and b (decode: (B,) from
    the slots, prefill: (B, T))."""
    check_state_view(arena, view)
    d = gdn_dims(view)
    _check(qkv, a, b, conv_weight, A_log, dt_bias, d, lead)
    return d


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


# --------------------------------------------------------------------------- decode


def gdn_decode_reference(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view):
    """Plain-JAX gated DeltaNet decode step (XLA gather/scatter of the slots' rows)."""
    d = _checked_dims(arena, view, qkv, a, b, conv_weight, A_log, dt_bias, slots.shape[:1])

    def step(S, xc):
        g, beta = _gates(a, b, A_log, dt_bias)
        return _delta_step(S, xc, g, beta, d)

    return recurrent.decode_reference(arena, slots, qkv, conv_weight, None, view=view, state_name="recurrent",
                                      step=step)


def _delta_update(b, h, slot, v0, xc_ref, a_ref, b_ref, alog_ref, dtb_ref, arena_ref, *, view, d: GDNDims,
                  block_v: int, a_start: int = 0, b_start: int = 0):
    """In-kernel: value rows [v0, v0 + block_v) of head h's S^T in `slot`, updated in place
    -> o fp32 [block_v]."""
    Hk, Dk, Dv = d.k_heads, d.k_dim, d.v_dim
    j = h // (d.v_heads // Hk)                                                 # key head of value head h
    q = pltr.load(xc_ref.at[b, pl.ds(j * Dk, Dk)])                             # fp32 [Dk]
    k = pltr.load(xc_ref.at[b, pl.ds(Hk * Dk + j * Dk, Dk)])
    v = pltr.load(xc_ref.at[b, pl.ds(2 * Hk * Dk + h * Dv + v0, block_v)])     # [block_v]
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS) * (Dk ** -0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
    g = -jnp.exp(alog_ref[h].astype(jnp.float32)) * softplus(a_ref[b, a_start + h].astype(jnp.float32)
                                                              + dtb_ref[h].astype(jnp.float32))
    beta = jax.nn.sigmoid(b_ref[b, b_start + h].astype(jnp.float32))
    rows = view["recurrent"]
    flat0 = h * (Dv * Dk) + v0 * Dk
    S = load_block(arena_ref, slot, view, rows, flat0, (block_v, Dk), jnp.float32) * jnp.exp(g)  # [block_v, Dk] = S^T rows
    kv = jnp.sum(S * k[None, :], axis=1)
    delta = beta * (v - kv)
    S = S + delta[:, None] * k[None, :]
    store_block(arena_ref, slot, view, rows, flat0, S)  # rounded to the stored dtype once per token
    return jnp.sum(S * q[None, :], axis=1)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pallas_supported(view) -> bool:
    """Whether the Pallas decode kernel can address this layout (else use the reference)."""
    d = gdn_dims(view)
    return (_pow2(d.k_dim) and recurrent.tile_rows(view, d.v_dim, d.k_dim) is not None
            and conv_block(view, view["conv"], d.conv_dim) >= 16)


@functools.partial(jax.jit, static_argnames=("view", "interpret", "block_v", "conv_block_c", "num_warps", "num_stages"))
def _gdn_decode_pallas(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view, interpret=False,
                       block_v=None, conv_block_c=None, num_warps=4, num_stages=1):
    """qkv, a, b: arrays or recurrent.Cols (read in place)."""
    d = _checked_dims(arena, view, qkv, a, b, conv_weight, A_log, dt_bias, slots.shape[:1])
    (qkv, x_start), (a, a_start), (b, b_start) = (recurrent.src_start(v) for v in (qkv, a, b))
    check_slots(slots)
    block_v = block_v or recurrent.tile_rows(view, d.v_dim, d.k_dim)
    if block_v is None or d.v_dim % block_v or not block_fits(view, block_v * d.k_dim) or not _pow2(d.k_dim):
        raise ValueError(f"no Pallas tile for recurrent [{d.v_heads}, {d.v_dim}, {d.k_dim}] in {view.row_words}-word "
                         "rows (needs power-of-two Dk and block_v*Dk dividing or whole rows); use impl='reference'")
    update = functools.partial(_delta_update, view=view, d=d, block_v=block_v, a_start=a_start, b_start=b_start)
    return recurrent.decode_pallas(arena, slots, qkv, conv_weight, None, (a, b, A_log, dt_bias), view=view,
                                   update=update, heads=d.v_heads, rows=d.v_dim, block=block_v,
                                   name="gdn_delta_decode", interpret=interpret, conv_block_c=conv_block_c,
                                   num_warps=num_warps, num_stages=num_stages, x_start=x_start)


def gdn_decode(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, *, view, impl: str | None = None,
               interpret: bool = False, **tuning):
    """One gated DeltaNet decode token per request, reading and writing each slot in place.

    Returns (o [B, Hv, Dv] in qkv's dtype, arena).  impl: "pallas" | "reference"; default pallas on
    GPU (or with interpret=True) when `pallas_supported(view)`, else the reference.  qkv, a and b
    may be recurrent.Cols of one projection's output: the kernels read them in place.
    tuning: block_v, conv_block_c, num_warps, num_stages.
    """
    if recurrent.decode_impl(impl, interpret, lambda: pallas_supported(view)) == "reference":
        qkv, a, b = (recurrent.as_array(v) for v in (qkv, a, b))
        return gdn_decode_reference(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, view=view)
    return _gdn_decode_pallas(arena, slots, qkv, a, b, conv_weight, A_log, dt_bias, view=view, interpret=interpret,
                              **tuning)


# --------------------------------------------------------------------------- prefill


def _scan_core(S0, xc, g, beta, q_lens, pos, d: GDNDims):
    """Per-token recurrence.  S0 [B, Hv, Dv, Dk]; xc fp32 [B, T, conv_dim]; g, beta [B, T, Hv];
    pos [B, C] | None -> (o [B, T, Hv, Dv], S, checkpoints [B, C, Hv, Dv, Dk] | None)."""
    step = lambda S, xc_t, g_t, beta_t: _delta_step(S, xc_t, g_t, beta_t, d)
    return recurrent.scan_tokens(S0, step, (xc, g, beta), q_lens, pos)


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
    highest = "highest"
    T = xc.shape[1]
    Dv = d.v_dim
    L = min(chunk, T)
    live = jnp.arange(T)[None, :, None] < q_lens[:, None, None]
    g = jnp.where(live, g, 0.0)
    beta = jnp.where(live, beta, 0.0)
    q, k, v = jax.vmap(lambda x: _qkv(x, d), in_axes=1, out_axes=1)(xc)       # [B, T, H, Dk|Dv]
    strict = jnp.tril(jnp.ones((L, L), bool), -1)
    causal = jnp.tril(jnp.ones((L, L), bool))
    s_idx = jnp.arange(L)
    eye = jnp.eye(L, dtype=jnp.float32)

    def body(carry, inp):
        S, checkpoints = carry                                                        # S [B, H, Dk, Dv] (HF)
        c, q_c, k_c, v_c, g_c, b_c = inp                                     # [B, L, H, .], g/b [B, L, H]
        gc = jnp.cumsum(g_c, axis=1)                                         # [B, L, H]
        seg = gc[:, :, None, :] - gc[:, None, :, :]                          # [B, t, s, H]
        decay = jnp.exp(jnp.where(causal[None, :, :, None], seg, -jnp.inf))  # 0 above the diagonal
        kk = jnp.einsum("bthd,bshd->btsh", k_c, k_c, precision=highest)
        M = jnp.where(strict[None, :, :, None], b_c[:, :, None, :] * kk * decay, 0.0)
        IM = jnp.moveaxis(M, 3, 1) + eye                                     # [B, H, t, s] unit lower
        rhs = jnp.concatenate([jnp.moveaxis(b_c[..., None] * v_c, 2, 1),
                               jnp.moveaxis((b_c * jnp.exp(gc))[..., None] * k_c, 2, 1)], axis=-1)
        sol = jax.lax.linalg.triangular_solve(IM, rhs, left_side=True, lower=True, unit_diagonal=True)
        u_v, u_k = sol[..., :Dv], sol[..., Dv:]                              # [B, H, L, Dv|Dk]
        delta = u_v - jnp.einsum("bhtk,bhkv->bhtv", u_k, S, precision=highest)    # [B, H, L, Dv]
        qk = jnp.einsum("bthd,bshd->bhts", q_c, k_c, precision=highest) * jnp.moveaxis(decay, 3, 1)
        eg = jnp.moveaxis(jnp.exp(gc), 2, 1)                                 # [B, H, L]
        o = (eg[..., None] * jnp.einsum("bthk,bhkv->bhtv", q_c, S, precision=highest)
             + jnp.einsum("bhts,bhsv->bhtv", qk, delta, precision=highest))
        kh = jnp.moveaxis(k_c, 2, 1)                                         # [B, H, L, Dk]
        gch = jnp.moveaxis(gc, 2, 1)                                         # [B, H, L]
        w_end = jnp.exp(gch[..., -1:] - gch)
        S_new = jnp.exp(gc[:, -1])[..., None, None] * S + jnp.einsum("bhs,bhsk,bhsv->bhkv", w_end, kh, delta,
                                                                      precision=highest)
        if checkpoints is not None:  # the state after local token `last`, for checkpoints in this chunk
            inside, last = chunk_checkpoints(pos, c, L)                       # [B, C]
            g_last = jnp.take_along_axis(gc, last[:, :, None], axis=1)        # [B, C, H]
            before = (s_idx[None, None, :] <= last[:, :, None])[:, :, None, :]  # [B, C, 1, L]
            gcs = jnp.moveaxis(gc, 2, 1)[:, None]                             # [B, 1, H, L]
            w = jnp.where(before, jnp.exp(jnp.where(before, g_last[..., None] - gcs, 0.0)), 0.0)
            S_k = (jnp.exp(g_last)[..., None, None] * S[:, None]
                   + jnp.einsum("bchs,bhsk,bhsv->bchkv", w, kh, delta, precision=highest))
            checkpoints = jnp.where(inside[:, :, None, None, None], S_k, checkpoints)
        return (S_new, checkpoints), jnp.moveaxis(o, 1, 2)                            # o [B, L, H, Dv]

    to_hf = lambda x: jnp.swapaxes(x, -1, -2)                                # arena [.., Dv, Dk] <-> HF [.., Dk, Dv]
    num_chunks = -(-T // L)
    xs = (jnp.arange(num_chunks, dtype=jnp.int32), to_chunks(q, L), to_chunks(k, L), to_chunks(v, L),
          to_chunks(g, L), to_chunks(beta, L))
    (S, checkpoints), outs = jax.lax.scan(body, (to_hf(S0), initial_checkpoints(to_hf(S0), pos)), xs)
    return from_chunks(outs, T), to_hf(S), (None if checkpoints is None else to_hf(checkpoints))


def _prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, *, view, reset, checkpoint_positions,
             checkpoint_slots, state_impl, interpret, algo, chunk_size):
    d = _checked_dims(arena, view, qkv, a, b, conv_weight, A_log, dt_bias, qkv.shape[:2])

    def core(S0, xc, q_lens, pos):
        g, beta = _gates(a, b, A_log, dt_bias)                               # [B, T, Hv]
        if algo == "scan":
            return _scan_core(S0, xc, g, beta, q_lens, pos, d)
        return _chunked_core(S0, xc, g, beta, q_lens, pos, d, chunk_size)

    return recurrent.prefill(arena, slots, qkv, q_lens, conv_weight, None, view=view, state_name="recurrent",
                             reset=reset, checkpoint_positions=checkpoint_positions, checkpoint_slots=checkpoint_slots,
                             state_impl=state_impl, interpret=interpret, algo=algo, core=core)


def gdn_prefill_reference(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, *, view, reset=None,
                          checkpoint_positions=None, checkpoint_slots=None):
    """Prefill a padded chunk by a `lax.scan` over its tokens (HF's recurrent delta rule).

    qkv [B, T, conv_dim]; a, b [B, T, Hv]; q_lens int32 [B] (tokens j >= q_len leave the state
    untouched; their o is 0).  Starts from the slot's state, or zeros where reset [B] is set.
    checkpoint_positions / checkpoint_slots int32 [B, C]: the state after the first p tokens of
    the chunk (0 <= p <= q_len) also goes to slot s; p = -1 or s = 0 is padding.
    Returns (o [B, T, Hv, Dv] in qkv's dtype, arena).
    """
    return _prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, view=view, reset=reset,
                    checkpoint_positions=checkpoint_positions, checkpoint_slots=checkpoint_slots,
                    state_impl="reference", interpret=False, algo="scan", chunk_size=0)


def gdn_prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, *, view, reset=None,
                checkpoint_positions=None, checkpoint_slots=None, algo: str | None = None, chunk_size: int = 64,
                impl: str | None = None, interpret: bool = False):
    """Prefill one padded chunk per request from the state in its slot (arguments as
    `gdn_prefill_reference`).  Plain JAX: algo "chunked" (WY form) or "scan" (per token); None
    (default): `recurrent.prefill_algo` by the chunk's length.  `impl` picks the state read/write
    path.  Returns (o [B, T, Hv, Dv], arena)."""
    return _prefill(arena, slots, qkv, a, b, q_lens, conv_weight, A_log, dt_bias, view=view, reset=reset,
                    checkpoint_positions=checkpoint_positions, checkpoint_slots=checkpoint_slots,
                    state_impl=resolve_impl(impl, interpret), interpret=interpret,
                    algo=recurrent.prefill_algo(algo, qkv.shape[1]), chunk_size=chunk_size)
