"""Paged decode attention for one layer, reading K/V straight from the page-major arena.

Contract (docs/kernel_contracts.md):

  paged_decode_attention(q, arena, page_table, lengths, *, view, window=None, softcap=None,
                         sinks=None, scale=None) -> o [B, Hq, Dv]

  q [B, Hq, D] (Hq a multiple of Hkv; q head j reads kv head j // (Hq // Hkv));
  arena [num_rows, row_words] uint16 | bfloat16;
  page_table int32 [B, P]: physical page of token page pos // page_size, sink 0 where unmapped
    or tombstoned (e.g. pages that slid out of a window);
  lengths int32 [B]: tokens in the cache including the current one (already written).  The
    query sits at position len-1 and sees positions [max(0, len - window), len).  len == 0 is a
    padding lane: output 0.  Lengths above P * page_size are clamped to it.
  softcap: logits become softcap * tanh(logits / softcap) (Gemma), after scaling.
  sinks [Hq]: per-q-head logit that joins the softmax denominator only (GPT-OSS).
  scale: default 1 / sqrt(D).
  kv_dtype (extra, optional): stored K/V dtype; default bf16 for 1-plane views, f32 for 2.
  k_scale, v_scale (fp8 views only): f32 [Hkv] or scalars, default 1.0: K = fp8 * k_scale.

Where a head's rows are (KVView, plan.py): the K row of token t of page p is arena rows
`p*rows_per_page + k_row + t*mk ... + mk`, holding [planes, Hkv, D] words; so the K tile of one
page for kv head h is `page_size` rows (stride mk) x D contiguous columns.

Kernel: grid (B, Hkv, num_splits).  Program (b, h, s) takes the q heads of kv head h (any G:
padded to a power of two >= 16 rows, the smallest Triton dot; a head dim that is no power of
two, e.g. 80 or 96, is a 128-wide tile whose columns past the head are masked off the loads; q's
G rows are loaded the same way, the tile's other rows and columns masked to 0, so no XLA pad of
q runs before the kernel), walks its share of the blocks of `block_tokens` positions that hold visible
positions (the visible range is split dynamically, so a window of 512 tokens in a 32K page
table costs what 512 tokens cost), gathers each block's K and V tiles with one vector load
each (page ids from the page table, row ids computed per token; masked lanes: positions outside
[start, len) are not loaded at all, so tombstoned and poisoned sink pages are never read) and
runs an fp32 online softmax.  Each split writes (acc, m, l); a small XLA step combines the
splits, adds the sinks to the denominator and normalises.

fp8 K/V (`view.fp8`, half a plane): a head's D values are D/2 words, element 2j in the low byte
of word j, 2j+1 in the high byte.  The kernel loads the [block_tokens, D/2] word tile once and
unpacks it in registers into its even and odd elements (words.unpack_fp8: masks, a u8 -> e4m3
bitcast, an e4m3 -> bf16 convert); the wrapper splits q the same way, so the scores are
q_even . k_even + q_odd . k_odd and the output comes out as two halves (p . v_even, p . v_odd),
interleaved back in XLA.  The per-head scales never enter the kernel: k_scale multiplies q (the
scores are linear in K, before the softcap) and v_scale the combined output.

Module layout: the Triton kernel, `_paged_decode_pallas` (the pallas_call), `decode_backend` (which
kernel impl="pallas" runs: this one, or the Mosaic GPU kernel of paged_decode_mgpu.py on Hopper;
env UMEM_JAX_DECODE=triton|mgpu|auto) and the public wrapper `paged_decode_attention`.  The
argument checks and `paged_decode_attention_reference` live in decode_reference.py, the split
count in launch.py; both kernel modules import them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .decode_reference import check_decode_args, merge_splits, paged_decode_attention_reference
from .kv_write import kv_scales
from .backend import DeviceInfo, choose, device_info, hopper_refusal, requested_backend
from .launch import ANY, choose_num_splits, pow2_ceil, pow2_divisor, resolve_impl
from .words import (FP8_BITS_SCALE, fp8_compute_dtype, from_u16, join_planes, kernel_view, kv_value_dtype, to_u16,
                    unpack_fp8, unpack_fp8_asm, unpack_fp8_bits)

__all__ = ["DECODE_ENV", "check_decode_args", "choose_num_splits", "decode_backend", "paged_decode_attention",
           "paged_decode_attention_reference"]

_NEG = -1e30  # finite "minus infinity" for the running max: exp(NEG - NEG) stays 1, never NaN
SMEM_BUDGET = 200 * 1024  # bytes of K/V tiles per program across pipeline stages (SM: 227 KiB)


# --------------------------------------------------------------------------- kernel


def _mask_2d(rows, cols, shape):
    """The `shape` mask of a row mask [shape[0]] and a column mask [shape[1]], either None (all
    true), broadcast to the whole tile as Triton's masked loads take it; None when both are."""
    mask = None if rows is None else jnp.broadcast_to(rows[:, None], shape)
    if cols is not None:
        cols = jnp.broadcast_to(cols[None, :], shape)
        mask = cols if mask is None else mask & cols
    return mask


def _tile_dim(dim: int) -> int:
    """Tile width of a head dim: a power of two (Triton tiles), >= 16 (the smallest Triton dot)."""
    return max(16, pow2_ceil(dim))


def _decode_kernel(lengths_ref, pt_ref, *refs, view, block_tokens, window, softcap, scale, num_splits,
                   kv_dtype, group: int, group_rows: int, fp8_bits=False, fp8_asm=False):
    # One q tile and one output tile per half: two (even, odd elements) for fp8, else one.
    halves = 2 if view.fp8 else 1
    q_refs, arena_ref, o_refs = refs[:halves], refs[halves], refs[halves + 1:2 * halves + 1]
    m_ref, l_ref = refs[2 * halves + 1:]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, rows_per_page, W = view.page_size, view.rows_per_page, view.row_words
    # Words of one head in one plane (D / 2 for fp8).  Triton tiles are powers of two: a head of
    # 80 or 96 words is loaded as a 128-wide tile whose columns past the head are masked off
    # (never read; they load as 0), q is zero-padded likewise.
    D, Dv, Hkv = view.head_words(view.head_dim), view.head_words(view.v_head_dim), view.num_kv_heads
    Dvp = _tile_dim(Dv)
    log2_page_size = page_size.bit_length() - 1
    length = lengths_ref[b]
    # All quantities below are >= 0, so C division (lax.div) equals floor division and keeps
    # the IR free of sign fix-ups.
    start = jnp.int32(0) if window is None else jnp.maximum(length - window, 0)
    # Blocks holding visible positions, shared out between the splits of this (b, h).
    first_block = lax.div(start, jnp.int32(block_tokens))
    end_block = lax.div(length + (block_tokens - 1), jnp.int32(block_tokens))
    blocks_per_split = lax.div(jnp.maximum(end_block - first_block, 0) + (num_splits - 1),
                               jnp.int32(num_splits))
    lo = first_block + s * blocks_per_split
    hi = jnp.minimum(lo + blocks_per_split, end_block)

    two_planes = view.planes == 2
    compute_dtype = jnp.float32 if two_planes else kv_dtype
    exact = two_planes or jnp.dtype(compute_dtype) == jnp.float32  # IEEE dots (no TF32) for fp32 values
    # q [B * Hkv * G, Dw] (each half): this kv head's G rows, loaded as a [group_rows, Dp] tile whose
    # rows past G and columns past the head are masked to 0 -- in the kernel, so the step needs no
    # XLA pad of q before it (a launch per attention layer: 1.5-2.2 us on an H100).
    q_rows = jnp.arange(group_rows, dtype=jnp.int32)
    q_cols = jnp.arange(_tile_dim(D), dtype=jnp.int32)
    q_mask = _mask_2d(q_rows < group if group_rows != group else None, q_cols < D if _tile_dim(D) != D else None,
                      (group_rows, _tile_dim(D)))
    q_at = ((b * Hkv + h) * group + jnp.minimum(q_rows, group - 1))[:, None], jnp.minimum(q_cols, D - 1)[None, :]
    q_tile = [r.at[q_at] for r in q_refs]
    qs = [(pltr.load(t) if q_mask is None else pltr.load(t, mask=q_mask, other=0)).astype(compute_dtype)
          for t in q_tile]  # [group_rows, Dp] each
    token_offsets = jnp.arange(block_tokens, dtype=jnp.int32)

    def head_cols(plane, dim):
        # (row offset within a token's rows, first column) of plane `plane` of kv head h.
        off_static = plane * Hkv * dim
        if W % (Hkv * dim) == 0:
            # A plane's [Hkv, dim] block sits inside one row (the common layout): static row,
            # column static + h*dim, which Triton sees as a multiple of dim (16-byte vectors).
            return off_static // W, off_static % W + h * dim
        off = off_static + h * dim
        # Rows narrower than a plane: W is a multiple of dim (checked), so the column is too;
        # say so (as a power of two: Triton's divisibility hints are), since Triton cannot see
        # through the remainder.
        return lax.div(off, jnp.int32(W)), pl.multiple_of(lax.rem(off, jnp.int32(W)), pow2_divisor(dim))

    def load_tile(rows_base, slot, r_off, col, m, dim, mask):
        rows = rows_base + slot * m + r_off                      # [block_tokens] arena rows
        width = _tile_dim(dim)
        lanes = jnp.arange(width, dtype=jnp.int32)
        cols = col + lanes
        # Two broadcasting int indexers ([block_tokens,1] x [1,width]): Triton computes row*W
        # itself (int64 above 4 GiB) and sees contiguous columns per row (vector loads);
        # interpret mode also takes this form.
        tile = arena_ref.at[rows[:, None], cols[None, :]]
        # padded columns past the head's words: never read, 0
        full = _mask_2d(mask, lanes < dim if width != dim else None, (block_tokens, width))
        return pltr.load(tile, mask=full, other=0)

    def decode_tile(rows_base, slot, which, mask):
        """The head's [block_tokens, tile] values of K or V: a list of one tile, or for fp8 two
        (the even and the odd elements, unpacked from one load of the words)."""
        dim, m, base = (D, view.mk, view.k_row) if which == "k" else (Dv, view.mv, view.v_row)
        r0, c0 = head_cols(0, dim)
        hi_words = load_tile(rows_base + base, slot, r0, c0, m, dim, mask)
        if view.fp8:
            if fp8_asm:
                return list(unpack_fp8_asm(hi_words))
            return list(unpack_fp8_bits(hi_words) if fp8_bits else unpack_fp8(hi_words, compute_dtype))
        if not two_planes:
            return [hi_words if hi_words.dtype == kv_dtype else from_u16(to_u16(hi_words), kv_dtype)]
        r1, c1 = head_cols(1, dim)
        lo_words = load_tile(rows_base + base, slot, r1, c1, m, dim, mask)
        return [join_planes(hi_words, lo_words, jnp.float32)]

    table_width = pt_ref.shape[1]

    def envelopes(block):
        # First arena row of the page envelope of each token of block `block` ([block_tokens]
        # int32; a row index < num_rows < 2**31, so int32 is exact).  The table index is clamped:
        # the prefetch for the block after a split's last one may run past the table, unused.
        # A block is `block_tokens` consecutive positions: several pages (block_tokens >
        # page_size) or part of one.  page_size is a power of two: the page index is a shift.
        idx = jnp.minimum(jnp.right_shift(block * block_tokens + token_offsets, log2_page_size), table_width - 1)
        return pltr.load(pt_ref.at[b, idx]) * rows_per_page

    def body(block, carry):
        # `envelope_rows` (this block's envelopes) was read from the table one iteration earlier, so
        # the K/V gathers depend on a loop-carried value rather than on a load in this iteration:
        # Triton's pipeliner can then issue them a stage earlier (an in-iteration table load
        # costs a pipeline stage and leaves the gather latency exposed).
        envelope_rows, accs, m_i, l_i = carry
        next_envelope_rows = envelopes(block + 1)
        pos = block * block_tokens + token_offsets
        slot = jnp.bitwise_and(pos, page_size - 1)
        visible = (pos < length) & (pos >= start)
        ks = decode_tile(envelope_rows, slot, "k", visible)               # [block_tokens, Dp] each
        dots = [pltr.dot(q, k, trans_b=True, allow_tf32=False if exact else None) for q, k in zip(qs, ks)]
        scores = (dots[0] if halves == 1 else dots[0] + dots[1]) * scale
        if softcap is not None:
            scores = softcap * jnp.tanh(scores / softcap)
        scores = jnp.where(visible[None, :], scores, -jnp.inf)            # [group_rows, block_tokens]
        m_new = jnp.maximum(m_i, jnp.max(scores, axis=1))
        p = jnp.exp(scores - m_new[:, None])
        alpha = jnp.exp(m_i - m_new)
        vs = decode_tile(envelope_rows, slot, "v", visible)               # [block_tokens, Dvp] each; masked 0
        pc = p.astype(vs[0].dtype)
        accs = tuple(acc * alpha[:, None] + pltr.dot(pc, v, allow_tf32=False if exact else None)
                     for acc, v in zip(accs, vs))
        return next_envelope_rows, accs, m_new, l_i * alpha + jnp.sum(p, axis=1)

    init = (envelopes(lo), tuple(jnp.zeros((group_rows, Dvp), jnp.float32) for _ in range(halves)),
            jnp.full((group_rows,), _NEG, jnp.float32), jnp.zeros((group_rows,), jnp.float32))
    _, accs, m_i, l_i = lax.fori_loop(lo, hi, body, init)
    for o_ref, acc in zip(o_refs, accs):
        o_ref[...] = acc
    m_ref[...] = m_i
    l_ref[...] = l_i


@functools.partial(jax.jit, static_argnames=("view", "window", "softcap", "scale", "kv_dtype", "interpret",
                                              "block_tokens", "num_splits", "num_warps", "num_stages", "fp8_dot"))
def _paged_decode_pallas(q, arena, page_table, lengths, sinks=None, k_scale=None, v_scale=None, *, view,
                         window=None, softcap=None, scale=None, kv_dtype=None, interpret=False, block_tokens=None,
                         num_splits=None, num_warps=4, num_stages=None, fp8_dot=None):
    check_decode_args(q, arena, page_table, lengths, view, sinks, window, softcap)
    window = None if window is None else int(window)  # 512.0 is a window too; the kernel's block math is integer
    B, Hq, D = q.shape
    Hkv, Dv, page_size = view.num_kv_heads, view.v_head_dim, view.page_size
    G = Hq // Hkv
    # Any G (q heads padded to a power-of-two tile of >= 16 rows) and any head dim (tiles padded
    # to a power of two, the padding masked).  Dw/Dvw: a head's words per plane (D / 2 for fp8).
    Dw, Dvw = view.head_words(D), view.head_words(Dv)
    Dp, Dvp = _tile_dim(Dw), _tile_dim(Dvw)
    for dim, words in ((D, Dw), (Dv, Dvw)):
        if view.row_words % words:
            raise NotImplementedError(f"pallas decode needs each head inside one arena row "
                                      f"(row_words={view.row_words} a multiple of head dim {dim}"
                                      + (f": {words} words in fp8)" if view.fp8 else ")"))
    if page_size & (page_size - 1):
        raise NotImplementedError(f"page_size must be a power of two, got {page_size}")
    ks, vs = kv_scales(view, k_scale, v_scale)
    fp8_bits = False
    if view.fp8:
        _check_kv_dtype_fp8(kv_dtype)
        fp8_dot = _fp8_dot(fp8_dot, q.dtype)
        fp8_bits = fp8_dot == "bits"
        value_dtype = jnp.dtype(jnp.float16) if fp8_dot in ("f16", "bits", "asm") else fp8_compute_dtype(q.dtype)
    else:
        value_dtype = kv_value_dtype(view.planes, kv_dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # unpack_fp8_bits' values are K and V times 2**-8: the scores' factor goes into `scale`, V's below.
    kernel_scale = scale * FP8_BITS_SCALE if fp8_bits else scale
    if block_tokens is None:
        # bf16: 8K words per K (and V) tile (64 tokens at D=128).  With num_stages=3 the
        # pipeliner double-buffers K and V (the page ids come one block ahead), ~70 KiB of
        # shared memory, so three programs share an SM and keep ~200 KiB of loads in flight
        # (ptxas sm_90: ~128-190 registers, no spills).  fp32 planes have no tensor-core dot
        # (IEEE FMA loops) and spill above 32 tokens; they exist for parity.
        block_tokens = max(16, 8192 // max(Dp, Dvp)) if view.planes == 1 else 32
        if view.fp8:  # fp8: 4K words (64 tokens at D=128) and 4 stages, the H200 sweep's best (session 8)
            block_tokens //= 2
    if num_stages is None:
        num_stages = 4 if view.fp8 else 3
    block = pow2_ceil(max(16, block_tokens))  # >= 16: the smallest Triton dot
    # Each pipeline stage buffers one K and one V tile in shared memory; an H100/H200 SM has
    # 227 KiB.  Trim the stages (then the block) of a config that would not fit rather than fail
    # at launch with RESOURCE_EXHAUSTED.
    tile_bytes = lambda b: b * (Dp + Dvp) * 2 * view.planes
    while num_stages > 1 and num_stages * tile_bytes(block) > SMEM_BUDGET:
        num_stages -= 1
    while block > 16 and tile_bytes(block) > SMEM_BUDGET:
        block //= 2
    P = page_table.shape[1]
    lengths = jnp.minimum(lengths, P * page_size)
    if num_splits is None:
        visible_blocks = -(-P * page_size // block)
        if window is not None:
            visible_blocks = min(visible_blocks, -(-(window - 1) // block) + 1)
        num_splits = choose_num_splits(B, Hkv, visible_blocks)
    group_rows = max(16, pow2_ceil(G))
    qg = q.reshape(B, Hkv, G, D)
    if view.fp8:  # k_scale folds into q (the scores are linear in K); then the even and odd elements
        qg = qg.astype(jnp.float32) * ks[None, :, None, None]
        if value_dtype == jnp.float16:  # the kernel's dots take q as f16: saturate, never inf
            qg = jnp.clip(qg, -F16_MAX, F16_MAX)
        q_halves = [qg[..., 0::2], qg[..., 1::2]]
    else:
        q_halves = [qg]
    # [B * Hkv * G, Dw] rows (a free reshape): the kernel loads its head's G rows and masks the tile's rest to 0
    q_halves = [x.reshape(B * Hkv * G, Dw) for x in q_halves]
    halves = len(q_halves)
    kernel = functools.partial(_decode_kernel, view=view, block_tokens=block, window=window, softcap=softcap,
                               scale=kernel_scale, num_splits=num_splits, kv_dtype=value_dtype, fp8_bits=fp8_bits,
                               fp8_asm=view.fp8 and fp8_dot == "asm" and not interpret, group=G,
                               group_rows=group_rows)
    acc_spec = pl.BlockSpec((None, None, None, group_rows, Dvp), lambda b, h, s: (b, h, s, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, group_rows), lambda b, h, s: (b, h, s, 0))
    acc_shape = jax.ShapeDtypeStruct((B, Hkv, num_splits, group_rows, Dvp), jnp.float32)
    ml_shape = jax.ShapeDtypeStruct((B, Hkv, num_splits, group_rows), jnp.float32)
    *accs, m, l = pl.pallas_call(
        kernel,
        grid=(B, Hkv, num_splits),
        in_specs=[ANY, ANY, *[ANY] * halves, ANY],
        out_specs=[*[acc_spec] * halves, ml_spec, ml_spec],
        out_shape=[*[acc_shape] * halves, ml_shape, ml_shape],
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="umem_paged_decode",
    )(lengths, page_table, *q_halves, kernel_view(arena, interpret))  # tiles are bitcast/unpacked in-kernel
    accs, m, l = [a[:, :, :, :G, :Dvw] for a in accs], m[:, :, :, :G], l[:, :, :, :G]
    if view.fp8:  # interleave the halves back into [.., Dv]; v_scale is linear in the output
        v_factor = vs * FP8_BITS_SCALE if fp8_bits else vs
        acc = jnp.stack(accs, axis=-1).reshape(*accs[0].shape[:-1], Dv) * v_factor[None, :, None, None, None]
    else:
        acc = accs[0]
    return merge_splits(acc, m, l, lengths, sinks, q.dtype).reshape(B, Hq, Dv)


F16_MAX = 65504.0
FP8_DOTS = ("bf16", "f16", "bits", "asm")


def _has_e4m3x2_convert() -> bool:
    """True on CUDA GPUs of compute capability >= 8.9 (Ada, Hopper, later): PTX cvt.f16x2.e4m3x2."""
    try:
        d = jax.devices()[0]
        cc = getattr(d, "compute_capability", None) if d.platform == "gpu" else None
        return cc is not None and tuple(int(x) for x in str(cc).split(".")[:2]) >= (8, 9)
    except Exception:  # pragma: no cover - no device / unusual platform string
        return False


def _fp8_dot(fp8_dot, q_dtype) -> str:
    """How fp8 tiles reach the dots (FP8_DOTS):
      "asm"  one inline-PTX cvt.rn.f16x2.e4m3x2 per word gives both halves (default where the GPU
             has it: compute capability >= 8.9; interpret mode runs it as "f16");
      "f16"  e4m3 -> f16 converts per element (default elsewhere);
      "bits" integer unpack to f16 (words.unpack_fp8_bits: no convert instruction at all);
      "bf16" e4m3 -> bf16 converts (Hopper has none: three steps each).
    H200, B=64 ctx 4096 (RESULTS.md, session 8): asm 164 us, f16 176-180 us, bits 234 us, bf16 263 us,
    against 275 us for bf16 K/V.  An f32 query (parity runs) always takes the f32 convert."""
    if jnp.dtype(q_dtype) == jnp.float32:
        return "f32"
    if fp8_dot is None:
        fp8_dot = "asm" if _has_e4m3x2_convert() else "f16"
    if fp8_dot not in FP8_DOTS:
        raise ValueError(f"fp8_dot must be one of {FP8_DOTS}, got {fp8_dot!r}")
    return fp8_dot


def _check_kv_dtype_fp8(kv_dtype) -> None:
    if kv_dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"an fp8 view stores float8_e4m3fn, kv_dtype says {jnp.dtype(kv_dtype)}")



# --------------------------------------------------------------------------- kernel choice

DECODE_ENV = "UMEM_JAX_DECODE"
# With $UMEM_JAX_DECODE unset, impl="pallas" runs the Triton kernel above: it covers every case of
# the contract (fp8 and fp32 K/V, any GQA ratio and head dim, interpret mode) on any CUDA GPU.  The
# Mosaic GPU kernel (paged_decode_mgpu.py) covers bf16/fp16 and fp8 K/V on Hopper: "auto" takes it where
# it covers the case (fp8 not: 0.95x Triton's fp8 speed), "mgpu" insists on it.  Inside whole models (H100,
# 2026-12-06, RESULTS.md "Whole models" session 24) "auto" was 0.3-0.5% slower than Triton at B = 64
# and its first step compiled 3-13x longer (Gemma 3: 121 s against 9 s), so Triton stays the default.
DEFAULT_DECODE_BACKEND = "triton"
_TRITON_TUNING = ("block_tokens", "num_warps", "num_stages", "fp8_dot")


def decode_backend(q, view, *, kv_dtype=None, backend: str | None = None,
                   device: DeviceInfo | None = None) -> tuple[str, str]:
    """Which kernel impl="pallas" runs for q (anything with .shape: [B, Hq, D]) over `view`: ("mgpu",
    "") or ("triton", why not mgpu), from static shapes and dtypes, so at trace time (backend.py).

    backend: "auto" | "triton" | "mgpu"; None reads $UMEM_JAX_DECODE (default DEFAULT_DECODE_BACKEND).
    device: the DeviceInfo to decide for (default: this process's)."""
    choice = requested_backend(backend, DECODE_ENV, DEFAULT_DECODE_BACKEND)

    def refusal():
        why = hopper_refusal(device_info() if device is None else device)
        if why is not None:
            return why
        # Imported only past the device check: on older jax the Mosaic GPU module is never loaded.
        from .paged_decode_mgpu import check_decode_mgpu_supported, default_decode_mgpu_config

        try:  # pure shape/dtype logic
            check_decode_mgpu_supported(q, view, default_decode_mgpu_config(q.shape[2], view.page_size, view.fp8),
                                        kv_dtype)
        except NotImplementedError as e:
            return str(e)
        if choice == "auto" and view.fp8:
            # Correct on the GPU, but slower than the Triton kernel's fp8 path: 0.95x with two
            # consumers at D = 128 on an H100 (RESULTS.md, 2026-12-06), 0.54x with one on an H200.
            return ("fp8 K/V: the Mosaic kernel's fp8 path measured slower than Triton's (0.95x at D = 128; asked "
                    "for with backend 'mgpu', it runs)")
        if choice == "auto" and (2 * q.shape[2]) % 128:
            # A head row that no 128-byte swizzle divides (D = 80, 96, ...) gets narrower shared-memory
            # swizzles; the H200 measured the Mosaic kernel at 0.91x Triton at D = 80, the H100 at 0.97-0.98x
            # (1.00x with the 2-slot ring now its default there: no gain to take; RESULTS.md).
            return (f"head_dim {q.shape[2]}: its rows take a narrower than 128-byte swizzle, where the Mosaic "
                    "kernel measured no faster than Triton (asked for with backend 'mgpu', it runs)")
        return None

    return choose(choice, "decode", refusal)


# --------------------------------------------------------------------------- public wrapper


def paged_decode_attention(q, arena, page_table, lengths, *, view, window=None, softcap=None, sinks=None,
                           scale=None, kv_dtype=None, k_scale=None, v_scale=None, impl: str | None = None,
                           interpret: bool = False, backend: str | None = None, **tuning):
    """Decode attention over the arena for one layer -> [B, Hq, Dv] in q.dtype (see module doc).

    k_scale, v_scale: fp8 views' dequantisation scales (f32 [Hkv] or scalars; default 1.0).
    impl: "pallas" | "reference"; default pallas on GPU (or with interpret=True), else reference.
    tuning (pallas): block_tokens (tokens per loop step; default 8192 // head_dim, also for fp8, 32
    for fp32 planes), num_splits (default: choose_num_splits), num_warps, num_stages (default 3, fp8
    4), fp8_dot (how fp8 tiles reach the dots, see _fp8_dot; default "asm" on sm_89+, else "f16").
    backend: which Pallas kernel, "auto" | "triton" | "mgpu" (decode_backend); None reads
    $UMEM_JAX_DECODE when this is called (unset: the Triton kernel).  interpret=True and the Triton
    tuning knobs above (all but num_splits) mean the Triton kernel.
    """
    impl = resolve_impl(impl, interpret)
    if impl == "reference":
        return paged_decode_attention_reference(q, arena, page_table, lengths, view=view, window=window,
                                                softcap=softcap, sinks=sinks, scale=scale, kv_dtype=kv_dtype,
                                                k_scale=k_scale, v_scale=v_scale)
    triton_only = interpret or any(tuning.get(k) is not None for k in _TRITON_TUNING)
    if not triton_only and decode_backend(q, view, kv_dtype=kv_dtype, backend=backend)[0] == "mgpu":
        from .paged_decode_mgpu import paged_decode_attention_mgpu

        return paged_decode_attention_mgpu(q, arena, page_table, lengths, view=view, window=window, softcap=softcap,
                                           sinks=sinks, scale=None if scale is None else float(scale),
                                           kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale,
                                           num_splits=tuning.get("num_splits"))
    return _paged_decode_pallas(q, arena, page_table, lengths, sinks, k_scale, v_scale, view=view, window=window,
                                softcap=softcap, scale=None if scale is None else float(scale), kv_dtype=kv_dtype,
                                interpret=interpret, **tuning)
