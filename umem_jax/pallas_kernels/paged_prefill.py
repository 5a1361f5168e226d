"""Paged prefill / extend attention over the page-major arena (flash-attention style, Pallas Triton).

Contract (docs/kernel_contracts.md)::

    paged_prefill_attention(q, arena, page_table, q_lens, kv_lens, *, view, window=None,
                            softcap=None, sinks=None, scale=None) -> o [B, T, Hq, Dv]

* q [B, T, Hq, D]: one padded chunk of new tokens per row (Hq = G * Hkv, GQA group G).
* arena [num_rows, row_words] uint16 or bfloat16; `view` (plan.KVView) says where this layer's
  K/V rows sit in a page envelope: K row of token slot t of physical page p is the `mk` arena rows
  `p*rows_per_page + k_row + t*mk ...`, holding `planes*Hkv*D` words head-major
  (fp32: `[hi plane | lo plane]`, see words.py / kv_write.py).  V likewise at `v_row`.
* page_table int32 [B, P]: physical page of token page `pos // page_size`; sink 0 where
  unmapped or tombstoned.
* q_lens int32 [B]: valid new tokens of each row (0: padding row).
* kv_lens int32 [B]: tokens in the cache *after* this chunk's K/V were written into the arena.
* Query j < q_len of row b sits at position `pos = kv_len - q_len + j` and attends to key
  positions p with `p <= pos` and, with a window, `p > pos - window`.  Rows j >= q_len are 0.
* scale: logits are `scale * q.k` (default 1/sqrt(D)); softcap: `softcap * tanh(logit / softcap)`;
  sinks f32 [Hq]: one extra logit per q head that joins the softmax denominator only (it is not
  scaled or capped and has no value row; gpt-oss style).

Pages wholly before the chunk's first query's window may be tombstoned (page 0): the kernel never
loads a key position outside `[first visible position, last query position]` of its q block, so
those pages, unwritten slots of the last page and rows past the table are never read.

Kernel layout: grid (q block, kv head, request).  One program owns BQ consecutive queries of one
request times the G q heads of one kv head, as one [BQ*G, D] tile (GQA: each K/V tile is loaded
once for the whole group).  A G that is no power of two (3, 5, 6, 7, ...) uses the flat layout
instead: q is viewed as [B, Hkv, T*G, D] (query-major rows, one transpose in XLA) and a tile is
block_rows consecutive rows of it, a power of two, so no tile row is a padded head (a query's
heads may straddle two tiles; each row finds its own query and sink).  Head dims that are no
power of two (80, 96) are 128-wide tiles: q zero-padded, the K/V columns past the head masked
off the loads (never read), the output sliced back.  A program walks the KV blocks (BK tokens)
its queries can see, in three loops: masked blocks at the window's left edge, unmasked interior
blocks, masked blocks on the causal diagonal, so interior blocks pay neither the mask nor masked
loads.  Online softmax in
fp32 (exp2 form).  KV rows are gathered through the page table with a vector of *row* indices on
the 2-D arena ref (`arena[rows, pl.ds(col, D)]`), so the Triton lowering does the row * stride
multiply in int64 when the arena exceeds 4 GiB.

fp8 K/V (`view.fp8`: two e4m3 values per word, words.py): a head's D values are D/2 words.  The
kernel loads the [BK, D/2] word tile and unpacks it in registers into its even and odd elements
(words.unpack_fp8), against q split the same way in the wrapper: the scores are
q_even . k_even + q_odd . k_odd, the output two halves p . v_even, p . v_odd (f32, interleaved
back in XLA).  k_scale multiplies q (scores are linear in K), v_scale the output; neither
enters the kernel.  The Mosaic GPU kernel reads fp8 too (paged_prefill_mgpu.py), 1.2x faster
than this one on an H100 (RESULTS.md, 2026-12-06), so on Hopper "auto" runs that one.

Module layout: `prefill_config` (the Triton tiling), the kernel body, `_paged_prefill_pallas` (the
pallas_call), `prefill_backend` (which kernel impl="pallas" runs: this Triton kernel, or the Mosaic
GPU kernel of paged_prefill_mgpu.py on Hopper where it covers the case; env
UMEM_JAX_PREFILL=triton|mgpu|auto) and the public wrapper `paged_prefill_attention`.  The argument
checks and `paged_prefill_attention_reference` (gather, mask, softmax: what both kernels must
compute) live in prefill_reference.py, which both kernel modules import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .kv_write import head_slot, kv_scales
from .backend import DeviceInfo, choose, device_info, hopper_refusal, requested_backend
from .launch import ANY, pow2_ceil, resolve_impl
from .paged_decode import SMEM_BUDGET
from .prefill_reference import check_prefill_args, check_prefill_options, paged_prefill_attention_reference
from .words import fp8_compute_dtype, from_u16, join_planes, kernel_view, kv_value_dtype, to_u16, unpack_fp8

__all__ = ["BLOCK_K_ENV", "PREFILL_ENV", "DeviceInfo", "PrefillConfig", "device_info", "paged_prefill_attention",
           "paged_prefill_attention_reference", "prefill_backend", "prefill_config"]

_LOG2E = 1.4426950408889634
_NEG_BIG = -1e30  # finite start for the running max: a fully masked block then gives exp2(-inf) = 0, not NaN


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Static tiling of one pallas_call.  block_q: queries per program (x G heads = tile rows);
    block_k: KV tokens per inner step; num_warps/num_stages: Triton compiler params.
    block_rows: tile rows.  G a power of two: block_q * G.  Otherwise (G = 3, 5, 6, ...) a tile
    is `block_rows` (a power of two) consecutive (query, head) rows of one kv head, so a query's
    heads may straddle two tiles and no tile row is padding; block_q is then the requested
    queries per tile (block_rows = pow2_ceil(block_q * G))."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int
    block_rows: int


def is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def tile_dim(dim: int) -> int:
    """Tile width of a head dim: a power of two (Triton tiles) >= 16 (the smallest Triton dot); a
    head dim of 80 or 96 is loaded as a 128-wide tile whose columns past the head are masked."""
    return max(16, pow2_ceil(dim))


# Shared memory an H100/H200 CTA may have (227 KiB), less 1 KiB for the softmax reductions: the
# K/V stages plus the q tile (the first dot's other operand) must fit.
_SMEM_LIMIT = 227 * 1024 - 1024


def _stage_bytes(block_k: int, D: int, Dv: int, planes: int, fp8: bool = False) -> int:
    """Shared memory of one pipeline stage: a [block_k, D] K and a [block_k, Dv] V tile (fp8:
    half the bytes, two values per word)."""
    return block_k * (D + Dv) * 2 * planes // (2 if fp8 else 1)


def prefill_config(T: int, G: int, D: int, *, Dv: int | None = None, planes: int = 1, fp8: bool = False,
                   block_q=None, block_k=None, num_warps=None, num_stages=None) -> PrefillConfig:
    """Default tiling: ~128 tile rows (64 for D=256) so the two dots are tensor-core sized, 8 warps
    and 3 K/V stages (head dims counted at their tile width, tile_dim).  BK=128 on 128-row bf16
    tiles at D <= 128: the H200 sweep (bench_prefill --tune, benchmarks/RESULTS.md) measured
    (rows 128, BK 128, 8 warps, 3 stages) fastest, 380 TFLOP/s geomean vs 337 at BK=64. Smaller
    tiles keep BK=64 (64 rows x 4 warps measured 349 at BK=64, 292 at BK=128), fp32 planes too (IEEE
    FMA dots, no tensor cores), and D=256 keeps BK=32 (ptxas for sm_90a: no spills; not timed). A
    defaulted BK, then stage count, is trimmed until the K/V stages fit SMEM_BUDGET (paged_decode's
    budget) and, with the q tile, the CTA's shared memory, so an odd geometry (fp32 planes at a
    128-wide head) compiles instead of failing at launch; explicit values are kept
    as given (the tuning sweep sets them).  fp8 K/V (D, Dv in values) tiles as bf16 does: the
    dequantised tiles are bf16 of the same shape in registers; only the shared-memory stages
    are half as big."""
    D, Dv = tile_dim(D), tile_dim(D if Dv is None else Dv)
    rows = 128 if D <= 128 else 64
    grouped = is_pow2(G)
    if grouped:
        if block_q is None:
            block_q = 1 << max(0, (rows // G).bit_length() - 1)  # largest power of two <= rows / G
            block_q = min(block_q, pow2_ceil(T))
            block_q = max(block_q, -(-16 // G))  # Triton dots need >= 16 rows
        block_rows = block_q * G
    else:  # flat (query, head) rows: any number of rows, so the power of two nearest the default
        if block_q is None:
            block_rows = min(rows, max(16, pow2_ceil(T * G)))
            block_q = -(-block_rows // G)
        else:
            block_rows = max(16, pow2_ceil(block_q * G))
    if num_warps is None:
        # 4 warps spill heavily on 128-row tiles and on D=256 (ptxas, sm_90a).
        num_warps = 8 if (block_rows >= 128 or D >= 256) else 4
    trim_k, trim_stages = block_k is None, num_stages is None
    if block_k is None:
        if max(D, Dv) > 128:
            block_k = 32
        elif planes == 1 and block_rows >= 128 and num_warps == 8:
            block_k = 128
        else:
            block_k = 64
    if num_stages is None:
        num_stages = 3  # K/V prefetched two blocks ahead (2 stages leaves the gather latency exposed)
    while trim_k and block_k > 16 and num_stages * _stage_bytes(block_k, D, Dv, planes, fp8) > SMEM_BUDGET:
        block_k //= 2
    while trim_stages and num_stages > 2 and num_stages * _stage_bytes(block_k, D, Dv, planes, fp8) > SMEM_BUDGET:
        num_stages -= 1
    # With the q tile: fp32 planes at 128-wide heads (D=80 or 96 padded, or 128) on 128-row tiles
    # would ask for 256 KiB (seen on the H200: RESOURCE_EXHAUSTED); the bf16 defaults fit as they are.
    q_bytes = block_rows * D * 2 * planes
    while num_stages * _stage_bytes(block_k, D, Dv, planes, fp8) + q_bytes > _SMEM_LIMIT:
        if trim_k and block_k > 16:
            block_k //= 2
        elif trim_stages and num_stages > 2:
            num_stages -= 1
        else:
            break
    for name, val in (("block_q", block_q if grouped else 1), ("block_k", block_k)):
        if not is_pow2(val):
            raise ValueError(f"{name} must be a power of two, got {val}")
    if block_k < 16:
        raise ValueError(f"block_k must be >= 16 (Triton dot), got {block_k}")
    if block_rows < 16:
        raise ValueError(f"block_q * G must be >= 16 (Triton dot), got {block_q}*{G}")
    return PrefillConfig(block_q, block_k, num_warps, num_stages, block_rows)


# --------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body needs at trace time."""

    q_blocks: int  # q blocks per row (grid dim 0)
    bq: int  # queries per tile (grouped layout)
    rows: int  # tile rows M: bq * G (grouped) or a power of two of (query, head) rows (flat)
    flat: bool  # G is no power of two: the flat layout (PrefillConfig)
    bk: int
    G: int
    D: int
    Dv: int
    Dp: int  # tile widths of the head dims (tile_dim)
    Dvp: int
    P: int  # page-table width
    page_size: int
    rows_per_page: int
    k_base: int  # view.k_row
    v_base: int
    mk: int
    mv: int
    Hkv: int
    row_words: int
    planes: int
    kv_dtype: object  # the dtype K/V tiles are computed in (fp8: what they are dequantised to)
    fp8: bool  # D/Dv/Dp/Dvp count words: half the head dims; two q and two output tiles
    window: int | None
    softcap: float | None
    scale: float
    has_sinks: bool


def _kernel(qlen_ref, kvlen_ref, pt_ref, *refs, c: _Static):
    sinks_ref, refs = (refs[0], refs[1:]) if c.has_sinks else (None, refs)
    halves = 2 if c.fp8 else 1  # fp8: the even and the odd elements of every head, as two tiles
    q_refs, arena_ref, o_refs = refs[:halves], refs[halves], refs[halves + 1:]
    # Heaviest q blocks (most KV under the causal mask) first: better tail balance.
    qi = c.q_blocks - 1 - pl.program_id(0)
    h = pl.program_id(1)
    b = pl.program_id(2)
    q_len = qlen_ref[b]
    kv_len = kvlen_ref[b]
    M = c.rows
    row0 = qi * M  # first (query, head) row of the tile on this kv head's [T * G] row axis
    j0 = lax.div(row0, c.G) if c.flat else qi * c.bq  # its first query

    @pl.when(j0 >= q_len)
    def _padding():
        for o_ref in o_refs:
            pltr.store(o_ref, jnp.zeros(o_ref.shape, o_ref.dtype))

    @pl.when(j0 < q_len)
    def _attend():
        compute_dtype = c.kv_dtype
        # fp32 planes exist for parity: keep their dots IEEE (Triton's fp32 default is TF32).
        precision = lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None
        # Tile row r is (query, head) row row0 + r: query (row0 + r) // G, head h*G + (row0 + r) % G.
        qs = [q_ref[...].reshape(M, c.Dp).astype(compute_dtype) for q_ref in q_refs]
        r = lax.broadcasted_iota(jnp.int32, (M,), 0)
        q_start = kv_len - q_len
        if c.flat:
            query = lax.div(row0 + r, c.G)  # [M] query of each tile row
            pos = q_start + query  # [M] key position of each tile row's query
            last = jnp.minimum(lax.div(row0 + M - 1, c.G) + 1, q_len) - 1
        else:
            pos = q_start + j0 + lax.div(r, c.G)
            last = jnp.minimum(j0 + c.bq, q_len) - 1
        p_first, p_last = q_start + j0, q_start + last
        hi = p_last + 1  # keys [lo, hi) are all this block may read
        u_hi = p_first + 1  # keys [u_lo, u_hi) every query of the block sees
        if c.window is not None:
            lo = jnp.maximum(p_first - c.window + 1, 0)
            u_lo = jnp.maximum(p_last - c.window + 1, 0)
        else:
            lo = u_lo = jnp.int32(0)
        bk = c.bk
        # KV blocks [kb_first, kb_last) hold every visible key; [i_lo, i_hi) need no mask.
        # (All operands are >= 0, so truncating lax.div is floor division.)
        kb_first = lax.div(lo, bk)
        kb_last = lax.div(hi + bk - 1, bk)
        i_lo = jnp.clip(lax.div(u_lo + bk - 1, bk), kb_first, kb_last)
        i_hi = jnp.clip(lax.div(u_hi, bk), i_lo, kb_last)

        # (row offset, column) of this kv head's words inside a token's rows, per plane: word
        # plane*Hkv*dim + h*dim of the token vector (kv_write.head_slot with a traced head).
        def slots(dim, m):
            out = []
            for plane in range(c.planes):
                off = plane * c.Hkv * dim + h * dim
                if m == 1:  # the token vector is one arena row (the common case): no div/rem
                    out.append((0, off))
                else:
                    # Rows are whole 16-byte units and head offsets multiples of dim (>= 8), so
                    # the column is a multiple of 8 words: tell Triton, for 16-byte copies.
                    col = pl.multiple_of(lax.rem(off, c.row_words), 8)
                    out.append((lax.div(off, c.row_words), col))
            return out

        k_slots = slots(c.D, c.mk)
        v_slots = slots(c.Dv, c.mv)

        def envelope_rows_of(kb):
            """First arena row of the page envelope of each key kb*bk ... kb*bk + bk - 1 (int32
            [bk], or a scalar when a block lies in one page).  Row index, not element offset:
            < num_rows < 2**31, so int32 is exact.  The table index is clamped: the prefetch for
            the block after the last one may run past the table and is never used."""
            if bk <= c.page_size:  # the block lies in one page: one scalar table read
                page = pt_ref[b, jnp.minimum(lax.div(kb * bk, c.page_size), c.P - 1)]
            else:
                k_idx = kb * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
                page = pt_ref[b, jnp.minimum(lax.div(k_idx, c.page_size), c.P - 1)]
            return page * c.rows_per_page

        def load(rows, slot_list, dim, mask):
            """Gather [bk, tile_dim(dim)] values of this kv head from the arena rows `rows`; the
            columns past a head dim that is no power of two are masked off (0, never read)."""
            width = tile_dim(dim)
            words = []
            for r_off, col in slot_list:
                if mask is None and width == dim:
                    words.append(arena_ref[rows + r_off, pl.ds(col, dim)])
                else:
                    # Masked lanes (tombstoned pages, unwritten slots, past the table) are never
                    # read.  Both indices as arrays: interpret mode has no masked load of a
                    # (vector, slice) index; Triton lowers either form to the same pointer tile.
                    lanes = lax.broadcasted_iota(jnp.int32, (bk, width), 1)
                    cols = col + lanes
                    tile = arena_ref.at[(rows + r_off)[:, None], cols]
                    ok = None if mask is None else jnp.broadcast_to(mask[:, None], (bk, width))
                    if width != dim:
                        ok = (lanes < dim) if ok is None else ok & (lanes < dim)
                    words.append(pltr.load(tile, mask=ok, other=0))
            if c.fp8:  # dequantised in registers: the even and the odd elements
                return list(unpack_fp8(words[0], compute_dtype))
            if c.planes == 2:
                return [join_planes(words[0], words[1], compute_dtype)]
            return words  # the wrapper passes 1-plane arenas already viewed as the KV dtype

        # Scores stay unscaled; the running max m is kept in log2 units, so the scale folds into
        # the exp2 argument `s * c - m` (one FMA per score) instead of a separate multiply pass
        # over the [M, bk] tile.  With a softcap the cap's tanh needs the scaled logit anyway.
        exp_scale = _LOG2E if c.softcap is not None else c.scale * _LOG2E

        def step(kb, carry, masked):
            # `envelope_rows` (this block's page envelopes) was read from the table one iteration
            # earlier: the K/V gathers then depend on a loop-carried value, not on a load in the
            # same iteration, which lets Triton's software pipeliner prefetch K/V tiles ahead (an
            # in-iteration table load costs a pipeline stage and serialises its latency).
            envelope_rows, m_i, l_i, accs = carry
            next_envelope_rows = envelope_rows_of(kb + 1)
            k_idx = kb * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
            slot = lax.rem(k_idx, c.page_size)
            k_rows = envelope_rows + c.k_base + slot * c.mk
            v_rows = envelope_rows + c.v_base + slot * c.mv
            valid = ((k_idx >= lo) & (k_idx < hi)) if masked else None
            kts = load(k_rows, k_slots, c.D, valid)  # [bk, Dp] each
            dots = [lax.dot_general(q, kt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                    precision=precision) for q, kt in zip(qs, kts)]
            s = dots[0] if halves == 1 else dots[0] + dots[1]
            if c.softcap is not None:
                s = c.softcap * jnp.tanh(s * (c.scale / c.softcap))
            if masked:
                kp = k_idx[None, :]
                vis = valid[None, :] & (kp <= pos[:, None])
                if c.window is not None:
                    vis &= kp > pos[:, None] - c.window
                s = jnp.where(vis, s, -jnp.inf)
            # exp_scale > 0, so max(s) * exp_scale == max(s * exp_scale); a fully masked row gives
            # -inf here and m stays at its finite start.
            m_new = jnp.maximum(m_i, s.max(axis=1) * exp_scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * exp_scale - m_new[:, None])
            l_new = l_i * alpha + p.sum(axis=1)
            vts = load(v_rows, v_slots, c.Dv, valid)  # [bk, Dvp] each
            pc = p.astype(compute_dtype)
            accs = tuple(acc * alpha[:, None] + lax.dot_general(pc, vt, (((1,), (0,)), ((), ())),
                                                                preferred_element_type=jnp.float32,
                                                                precision=precision)
                         for acc, vt in zip(accs, vts))
            return next_envelope_rows, m_new, l_new, accs

        # Each loop ends carrying envelope_rows_of(its end), which is the next loop's start (an
        # empty loop passes it through), so one table read before the first loop primes all three.
        carry = (envelope_rows_of(kb_first), jnp.full((M,), _NEG_BIG, jnp.float32), jnp.zeros((M,), jnp.float32),
                 tuple(jnp.zeros((M, c.Dvp), jnp.float32) for _ in range(halves)))
        carry = lax.fori_loop(kb_first, i_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(i_lo, i_hi, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(i_hi, kb_last, functools.partial(step, masked=True), carry)
        _, m_i, l_i, accs = carry

        if c.has_sinks:
            if c.flat:  # each row's own q head
                sk = pltr.load(sinks_ref.at[h * c.G + lax.rem(row0 + r, c.G)]).astype(jnp.float32) * _LOG2E
            else:
                sk = sinks_ref[pl.ds(h * c.G, c.G)].astype(jnp.float32) * _LOG2E  # [G]
                sk = jnp.broadcast_to(sk[None, :], (c.bq, c.G)).reshape(M)
            m_f = jnp.maximum(m_i, sk)
            corr = jnp.exp2(m_i - m_f)
            l_i = l_i * corr + jnp.exp2(sk - m_f)
            accs = tuple(acc * corr[:, None] for acc in accs)
        live = (query if c.flat else j0 + lax.div(r, c.G)) < q_len
        for o_ref, acc in zip(o_refs, accs):
            out = jnp.where(live[:, None], acc / l_i[:, None], 0.0)  # rows past q_len are 0
            pltr.store(o_ref, out.reshape(o_ref.shape).astype(o_ref.dtype))


def _fp8_halves(q, ks, G: int) -> list:
    """q [B, T, Hq, D] -> [q_even, q_odd] (f32 [B, T, Hq, D/2]) times k_scale of each q head's kv head."""
    qf = q.astype(jnp.float32) * jnp.repeat(ks, G)[None, None, :, None]
    return [qf[..., 0::2], qf[..., 1::2]]


def _paged_prefill_pallas(q, arena, page_table, q_lens, kv_lens, sinks, k_scale=None, v_scale=None, *, view,
                          window, softcap, scale, kv_dtype, cfg: PrefillConfig, interpret: bool):
    B, T, Hq, D_values = q.shape
    Hkv, Dv_values = view.num_kv_heads, view.v_head_dim
    G = Hq // Hkv
    # D, Dv: a head's words per plane (half the head dims for fp8), the kernel's tile columns.
    D, Dv = view.head_words(D_values), view.head_words(Dv_values)
    Dp, Dvp = tile_dim(D), tile_dim(Dv)
    bq, M, flat = cfg.block_q, cfg.block_rows, not is_pow2(G)
    ks, vs = kv_scales(view, k_scale, v_scale)
    q_halves = _fp8_halves(q, ks, G) if view.fp8 else [q]
    out_dtype = jnp.float32 if view.fp8 else q.dtype  # fp8: scaled by v_scale and cast after the interleave
    squeezed = getattr(pl, "squeezed", None)  # the batch (and kv head) dims of q/o blocks are squeezed away
    if flat:
        # [B, Hkv, T * G rows (query-major, then head), Dp], padded to whole tiles of M rows: one
        # transpose of q (and of the output back), no padded q heads in any tile.
        R = -(-T * G // M) * M
        q_halves = [jnp.pad(x.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D),
                            ((0, 0), (0, 0), (0, R - T * G), (0, Dp - D))) for x in q_halves]
        q_blocks = R // M
        q_spec = pl.BlockSpec((squeezed, squeezed, M, Dp), lambda i, h, b: (b, h, q_blocks - 1 - i, 0))
        o_spec = pl.BlockSpec((squeezed, squeezed, M, Dvp), lambda i, h, b: (b, h, q_blocks - 1 - i, 0))
        o_shape = (B, Hkv, R, Dvp)
    else:
        T_padded = -(-T // bq) * bq
        if T_padded != T or Dp != D:  # whole q blocks only (Triton blocks have no bounds checks)
            q_halves = [jnp.pad(x, ((0, 0), (0, T_padded - T), (0, 0), (0, Dp - D))) for x in q_halves]
        q_blocks = T_padded // bq
        q_spec = pl.BlockSpec((squeezed, bq, G, Dp), lambda i, h, b: (b, q_blocks - 1 - i, h, 0))
        o_spec = pl.BlockSpec((squeezed, bq, G, Dvp), lambda i, h, b: (b, q_blocks - 1 - i, h, 0))
        o_shape = (B, T_padded, Hq, Dvp)
    c = _Static(
        q_blocks=q_blocks, bq=bq, rows=M, flat=flat, bk=cfg.block_k, G=G, D=D, Dv=Dv, Dp=Dp, Dvp=Dvp,
        P=page_table.shape[1],
        page_size=view.page_size, rows_per_page=view.rows_per_page, k_base=view.k_row,
        v_base=view.v_row, mk=view.mk, mv=view.mv,
        Hkv=Hkv, row_words=view.row_words, planes=view.planes,
        kv_dtype=fp8_compute_dtype(q.dtype) if view.fp8 else kv_value_dtype(view.planes, kv_dtype), fp8=view.fp8,
        window=window, softcap=None if softcap is None else float(softcap),
        scale=1.0 / math.sqrt(D_values) if scale is None else float(scale), has_sinks=sinks is not None)

    args = [q_lens, kv_lens, page_table]
    in_specs = [ANY] * 3
    if sinks is not None:
        args.append(sinks.astype(jnp.float32))
        in_specs.append(ANY)
    if view.fp8:
        arena = kernel_view(arena, interpret)  # words: unpacked in registers (uint16 when interpreting)
    elif view.planes == 1 and arena.dtype != c.kv_dtype:
        # A same-width view (free in XLA: a bitcast, no copy) so the kernel loads bf16 tiles
        # straight into the MMA's shared-memory operands; a bitcast inside the kernel makes Triton
        # bounce every K/V tile through registers (shared -> regs -> shared) before the dot.
        arena = from_u16(to_u16(arena), c.kv_dtype)
    halves = len(q_halves)
    args += [*q_halves, arena]
    in_specs += [*[q_spec] * halves, ANY]
    outs = pl.pallas_call(
        functools.partial(_kernel, c=c),
        out_shape=[jax.ShapeDtypeStruct(o_shape, out_dtype)] * halves,
        grid=(q_blocks, Hkv, B),
        in_specs=in_specs,
        out_specs=[o_spec] * halves,
        compiler_params=triton_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="paged_prefill_attention",
    )(*args)
    if flat:
        outs = [o[:, :, :T * G, :Dv].reshape(B, Hkv, T, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, Dv)
                for o in outs]
    elif T_padded != T or Dvp != Dv:
        outs = [o[:, :T, :, :Dv] for o in outs]
    if not view.fp8:
        return outs[0]
    out = jnp.stack(outs, axis=-1).reshape(B, T, Hq, Dv_values)  # interleave the even and odd elements
    return (out * jnp.repeat(vs, G)[None, None, :, None]).astype(q.dtype)


# --------------------------------------------------------------------------- kernel choice

PREFILL_ENV = "UMEM_JAX_PREFILL"
# With $UMEM_JAX_PREFILL unset, impl="pallas" runs "auto": the Mosaic GPU kernel on Hopper (jax >= 0.11)
# where it covers the case (bf16/fp16 or fp8 K/V: fp8 1.2x Triton's fp8 speed), else the Triton
# kernel, which covers every case of the contract (fp32 planes, any GQA ratio and head dim, interpret
# mode) on any CUDA GPU.  Mosaic became the default on Hopper on 2026-12-06: 1.4x Triton's TFLOP/s at
# 4K-token chunks, and on the served shifting trace its tokens part from Triton's no more than
# Triton's own at another K/V block (benchmarks/RESULTS.md, "Paged prefill attention").  "triton"
# and "mgpu" force one.
DEFAULT_BACKEND = "auto"
# The Triton kernel's K/V block (tokens per inner step) when the caller gives none, read when a
# step is traced.  Unset: prefill_config's default.  Only a rounding experiment needs it: the
# block sets where the online softmax rescales, so another block sums the same scores in another
# order (bench_engine --parity --null compares that with the Mosaic GPU kernel's difference).
BLOCK_K_ENV = "UMEM_JAX_PREFILL_BLOCK_K"


def _requested(backend: str | None) -> str:
    return requested_backend(backend, PREFILL_ENV, DEFAULT_BACKEND)


def _mgpu_refusal(q, view, kv_dtype, info: DeviceInfo) -> str | None:
    """Why the Mosaic GPU kernel cannot run this case here, or None when it can (auto takes every
    case it runs)."""
    why = hopper_refusal(info)
    if why is not None:
        return why
    # Imported here, after the version check, so that on older jax the module is never loaded.
    from .paged_prefill_mgpu import check_mgpu_supported, default_mgpu_config

    try:  # pure shape/dtype logic, at trace time
        check_mgpu_supported(q, view, default_mgpu_config(q.shape[3], view.page_size, view.fp8), kv_dtype)
    except NotImplementedError as e:
        return str(e)
    return None


def prefill_backend(q, view, *, kv_dtype=None, backend: str | None = None,
                    device: DeviceInfo | None = None) -> tuple[str, str]:
    """Which kernel impl="pallas" runs for q (anything with .shape: [B, T, Hq, D]) over `view`:
    ("mgpu", "") or ("triton", why not mgpu).  Decided from static shapes and dtypes, so at
    trace time.

    backend: "auto" | "triton" | "mgpu"; None reads $UMEM_JAX_PREFILL (default DEFAULT_BACKEND).  auto
    takes the Mosaic GPU kernel (0.98x cuDNN on an H200 vs 0.69x for Triton) when the device is a
    CUDA GPU of compute capability 9.x, jax >= 0.11 and check_mgpu_supported accepts the case
    (bf16/fp16 or fp8 e4m3 one-plane K/V, one row per token, D == Dv a multiple of 16 in [64, 256],
    ...); mgpu raises NotImplementedError naming the reason where it cannot run.  device: the
    DeviceInfo to decide for (default: this process's, device_info()).
    """
    choice = _requested(backend)
    return choose(choice, "prefill",
                  lambda: _mgpu_refusal(q, view, kv_dtype, device_info() if device is None else device))


# --------------------------------------------------------------------------- public wrapper


def _check_pallas(q, view):
    """Any G and head dims: only a head that straddles two arena rows is refused."""
    D = q.shape[3]
    for which, dim in (("k", D), ("v", view.v_head_dim)):
        for plane in range(view.planes):
            for h in range(view.num_kv_heads):
                _, col = head_slot(view, which, h, plane)
                if col + view.head_words(dim) > view.row_words:
                    raise NotImplementedError(
                        f"a {which.upper()} head straddles two arena rows (row_words={view.row_words}, "
                        f"dim={dim}); the Pallas kernel needs row_words to be a multiple of the head dim")


def paged_prefill_attention(q, arena, page_table, q_lens, kv_lens, *, view, window=None, softcap=None,
                            sinks=None, scale=None, kv_dtype=None, k_scale=None, v_scale=None,
                            impl: str | None = None, interpret: bool = False, backend: str | None = None,
                            block_q=None, block_k=None, num_warps=None, num_stages=None):
    """Causal (optionally windowed) attention of a padded chunk of queries over the paged arena.

    q [B, T, Hq, D]; arena [num_rows, row_words] u16/bf16; page_table int32 [B, P]; q_lens, kv_lens
    int32 [B]; sinks f32 [Hq] or None -> [B, T, Hq, Dv] in q.dtype.  See the module docstring.
    k_scale, v_scale: fp8 views' dequantisation scales, f32 [Hkv] or scalars (default 1.0).
    impl: "pallas" | "reference" (default: pallas on GPU or with interpret=True, else reference).
    backend: which Pallas kernel, "auto" | "triton" | "mgpu" (prefill_backend); None reads
    $UMEM_JAX_PREFILL when this is called, i.e. when a caller's jitted step is traced (unset:
    DEFAULT_BACKEND, "auto": Mosaic GPU on Hopper where it covers the case, else Triton).
    interpret=True and explicit block_q/block_k/num_warps/num_stages (the Triton tiling,
    prefill_config) run the Triton kernel.
    """
    # The environment is read here, outside this function's own jit, so the choice is part of that
    # jit's cache key: a new trace after the variable changed does not reuse the other kernel.
    if block_k is None and os.environ.get(BLOCK_K_ENV, "").strip():
        block_k = int(os.environ[BLOCK_K_ENV])  # an explicit tiling: the Triton kernel (below)
    return _paged_prefill_attention(q, arena, page_table, q_lens, kv_lens, view=view, window=window,
                                    softcap=softcap, sinks=sinks, scale=scale, kv_dtype=kv_dtype, k_scale=k_scale,
                                    v_scale=v_scale, impl=impl, interpret=interpret, backend=_requested(backend),
                                    block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("view", "window", "softcap", "scale", "kv_dtype", "impl",
                                             "interpret", "backend", "block_q", "block_k", "num_warps",
                                             "num_stages"))
def _paged_prefill_attention(q, arena, page_table, q_lens, kv_lens, *, view, window, softcap, sinks, scale,
                             kv_dtype, k_scale, v_scale, impl, interpret, backend, block_q, block_k, num_warps,
                             num_stages):
    check_prefill_args(q, arena, page_table, q_lens, kv_lens, sinks, view)
    check_prefill_options(window, softcap)
    window = None if window is None else int(window)  # 512.0 is a window too; the kernel's block math is integer
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return paged_prefill_attention_reference(q, arena, page_table, q_lens, kv_lens, view=view, window=window,
                                                 softcap=softcap, sinks=sinks, scale=scale, kv_dtype=kv_dtype,
                                                 k_scale=k_scale, v_scale=v_scale)
    # interpret=True (CPU tests) and an explicit Triton tiling (the tuning sweep) mean the Triton
    # kernel whatever the backend choice; the Mosaic kernel's own knobs are on paged_prefill_mgpu.
    triton_only = interpret or any(t is not None for t in (block_q, block_k, num_warps, num_stages))
    if not triton_only and prefill_backend(q, view, kv_dtype=kv_dtype, backend=backend)[0] == "mgpu":
        from .paged_prefill_mgpu import paged_prefill_attention_mgpu

        return paged_prefill_attention_mgpu(q, arena, page_table, q_lens, kv_lens, view=view, window=window,
                                            softcap=softcap, sinks=sinks, scale=scale, kv_dtype=kv_dtype,
                                            k_scale=k_scale, v_scale=v_scale)
    _check_pallas(q, view)
    G = q.shape[2] // view.num_kv_heads
    cfg = prefill_config(q.shape[1], G, q.shape[3], Dv=view.v_head_dim, planes=view.planes, fp8=view.fp8,
                         block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    return _paged_prefill_pallas(q, arena, page_table, q_lens, kv_lens, sinks, k_scale, v_scale, view=view,
                                 window=window, softcap=softcap, scale=scale, kv_dtype=kv_dtype, cfg=cfg,
                                 interpret=interpret)
