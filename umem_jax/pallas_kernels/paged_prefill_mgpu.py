"""Paged prefill / extend attention as a Mosaic GPU (`plgpu`) kernel for Hopper: TMA page copies,
warpgroup MMA (wgmma), warp-specialised producer/consumers, FlashAttention-3 style.

Same contract as `paged_prefill.paged_prefill_attention` (docs/kernel_contracts.md)::

    paged_prefill_attention_mgpu(q, arena, page_table, q_lens, kv_lens, *, view, window=None,
                                 softcap=None, sinks=None, scale=None, k_scale=None,
                                 v_scale=None) -> o [B, T, Hq, Dv]

and `prefill_reference.paged_prefill_attention_reference` is what it must compute.  It exists beside
the Triton kernel because Pallas Triton has no warp specialisation and no way to overlap the softmax
of one tile with the MMAs of another: on an H200 the Triton kernel reaches 0.69x cuDNN, this one
0.98x.

Supported (anything else raises NotImplementedError naming the reason; use the Triton kernel):
bf16 (or fp16) K/V stored one plane per token row (`view.planes == 1`, `mk == mv == 1`), or fp8
(e4m3) K/V in the same rows (`view.fp8`, below), head_dim == v_head_dim, a multiple of 16 in
[64, 256] (80 and 96 too: their shared-memory tiles use a 32- or 64-byte swizzle, head_swizzle),
any GQA ratio (each CTA is one q head), row_words a multiple of 8 (16-byte TMA strides), page
size a multiple of 8 that divides the KV block or is a multiple of it.  Causal with an optional
window, softcap and sinks.  Needs jax >= 0.11 (the `plgpu.kernel` API used here) and an sm_90
GPU; on CPU, tests run it in jax's GPU interpreter (interpret=True, jax >= 0.11) and cross-lower
the compiled form for CUDA.

Kernel layout.  Grid (q head, q tile, request); q tiles run heaviest-first.  A CTA is three
warpgroups: two consumers, each owning `block_q` consecutive queries of one q head (the q tile is
2 * block_q queries), and one producer that walks the KV blocks (`block_kv` tokens) the tile can
see and copies them into a `max_concurrent_steps`-deep ring of shared-memory slots.  A KV block
is assembled from pages: one TMA copy per page (`block_kv / page_size` of them, all arriving on
the slot's barrier), the source a [page_size, D] box of the 2-D arena at row
`page * rows_per_page + k_row` and column `kv_head * D` (row index + column slice, never a flat
offset; TMA coordinates are 64-bit-safe).  The page id comes from a scalar read of the page
table in global memory, clamped to the table.  GQA: each q head's CTA loads its kv head's blocks;
the G CTAs of one kv head run side by side (q head is the fastest grid axis), so the repeats come
from L2.

Consumers: S = Q K^T (wgmma, Q and K in shared memory), online softmax in fp32 in log2 units with
the scale folded into the exp2 argument, P cast to bf16 in registers, O += P V (wgmma, V in shared
memory).  A two-arrival "schedule" barrier alternates the two consumers so one's softmax overlaps
the other's MMAs (FA3 ping-pong).  Each consumer splits its block range in three, as the Triton
kernel does: masked blocks at the window's left edge, unmasked interior blocks, masked blocks on
the causal diagonal.  Blocks of the CTA's range that one consumer cannot see are "skipped": it
still waits on and releases the slot and keeps the schedule barrier in step, so every barrier's
phase stays in sync for both consumers.

Never-written key slots.  TMA copies whole pages, so a block can hold key slots past kv_len
(unwritten) or pages before the first query's window (tombstoned: the sink page).  Their K rows
only meet masked scores (a `where`, so NaN cannot pass); their V rows would meet p == 0 in the PV
MMA, where 0 * NaN = NaN.  So on a block that holds such slots the consumer zeroes those V rows in
shared memory before its PV MMA (both consumers may do it: the writes are idempotent).

fp8 K/V (`view.fp8`: a head's D values are D/2 words, element 2j in the low byte of word j),
as the Mosaic GPU decode reads them (paged_decode_mgpu.py).  The producer copies a page's
[rows, D/2] box of words (the arena is never bitcast in XLA) into byte rings of half the bytes,
each slot a `plgpu.RefUnion` of [bkv, D/2] uint16 (what the TMA writes) and [bkv, D]
float8_e4m3fn (what the consumers read), tiled and swizzled alike in bytes (`fp8_ring`).  Each
consumer dequantises the slots it reads into 16-bit tiles of its own ([bkv, D], the head_swizzle
tiling; `dequantise_fp8`: register chunks of 64 rows, one `cvt.rn.f16x2.e4m3x2` a pair) and
releases a slot as soon as it has converted it: the two consumers are half a block apart
(ping-pong), so a shared tile would tie them together.  The products stay 16-bit wgmma (fp8 wgmma
needs both operands K-major, V is not), in f16 (every e4m3 value is exact in f16, and e4m3 -> f16
is one instruction).  Where a K and a V tile per consumer fit shared memory (`fp8_tiles`: D <= 112
with 128-token blocks, D <= 208 with 64-token ones), K's conversion for the next block runs while
the tensor cores take this block's P V and V's while they take Q K^T, as in the decode; at D >= 224
each consumer has one tile, V dequantised into it once Q K^T has read K, the next K once P V has
read V.  V rows outside [row_lo, kv_len) are zeroed in registers on the way (masked blocks).  The
scales never enter the kernel: k_scale multiplies q (in f32, clipped to f16's range, then f16),
v_scale the output (in f32), as in the Triton kernel.  paged_prefill.prefill_backend keeps fp8 on
the Triton kernel under "auto" until this path has been measured on the GPU; "mgpu" runs it.  The
GPU interpreter allocates a RefUnion's views as separate buffers, so there (interpret=True) a
consumer reads the slot's words and unpacks them in registers instead of loading the fp8 view.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._compat import mgpu_load
from .kv_write import kv_scales
from .prefill_reference import check_prefill_args, check_prefill_options
from .words import FP8, from_u16, kv_value_dtype, to_u16, unpack_fp8

__all__ = ["MgpuConfig", "check_mgpu_supported", "default_mgpu_config", "dequantise_fp8", "fp8_ring", "fp8_swizzle",
           "fp8_tiles", "mgpu_available", "paged_prefill_attention_mgpu", "smem_bytes"]

_LOG2E = 1.4426950408889634
_NEG_BIG = -1e30  # finite start for the running max: a fully masked first block gives exp2(-inf) = 0, not NaN
_SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90
_CHUNK = 64  # fp8 -> f16 conversion in [64, <= 64] register chunks (64 rows: the WGMMA_8BIT layout's tile)
F16_MAX = 65504.0  # fp8 paths: k_scale * q saturates here rather than becoming inf in f16


def mgpu_available() -> tuple[bool, str]:
    """(True, "") when this jax has the plgpu API this module is written for, else (False, why)."""
    try:
        major, minor = (int(x) for x in jax.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - odd dev version strings
        major, minor = 0, 0
    if (major, minor) < (0, 11):
        return False, ("the Mosaic GPU prefill kernel is written for jax >= 0.11 (plgpu.kernel API); "
                       f"this is {jax.__version__}")
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as e:  # pragma: no cover
        return False, f"jax.experimental.pallas.mosaic_gpu does not import: {e}"
    return True, ""


def _plgpu():
    ok, why = mgpu_available()
    if not ok:
        raise NotImplementedError(why)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """block_q: queries per consumer warpgroup (the CTA's q tile is 2 * block_q); block_kv: KV
    tokens per pipeline step; max_concurrent_steps: shared-memory ring depth; schedule_barrier:
    FA3 ping-pong between the two consumers."""

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    schedule_barrier: bool = True


def default_mgpu_config(D: int, page_size: int, fp8: bool = False) -> MgpuConfig:
    """The tiling the H200 sweep measured best (block_kv 128, a 2-deep ring, ping-pong barrier:
    0.98x cuDNN at D=128), with 64-token KV blocks where 128 does not fit: the ring of 128-token
    blocks needs 324 KiB of shared memory at D=256, and a page size that neither divides 128 nor is
    a multiple of it cannot be assembled into 128-token blocks.  fp8 (smem_bytes' fp8 budget):
    128-token blocks wherever they fit, with a K and a V tile per consumer up to D = 112 and one
    tile (V dequantised into K's once Q K^T has read it) up to D = 176; 64-token blocks above (one
    tile per consumer from D = 224, fp8_tiles).  At D = 128 on an H100 the 128-token blocks with
    one tile ran 1.08-1.13x faster than 64-token blocks with two (RESULTS.md, 2026-12-06)."""
    cfg = MgpuConfig()
    bkv = cfg.block_kv
    too_big = smem_bytes(D, cfg, fp8) > _SMEM_LIMIT
    if too_big or (bkv % page_size and page_size % bkv):
        cfg = dataclasses.replace(cfg, block_kv=64)
    return cfg


def tma_layout_refusal(D: int, view, kv_dtype=None) -> str | None:
    """Why the arena's K/V rows of this view cannot go by TMA boxes into shared-memory tiles (the
    Mosaic GPU prefill's and decode's shared condition), or None when they can.  Both kernels take
    fp8 views too: they copy a head's D/2 words and dequantise them in shared memory before the
    wgmma (fp8_ring, dequantise_fp8)."""
    if view.fp8:
        if kv_dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(jnp.float8_e4m3fn):
            return f"an fp8 view stores float8_e4m3fn, kv_dtype says {jnp.dtype(kv_dtype)}"
    else:
        if view.planes != 1:
            return "fp32 (two-plane) K/V is not supported, only bf16/fp16"
        vdt = jnp.dtype(kv_value_dtype(view.planes, kv_dtype))
        if vdt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"K/V dtype {vdt} is not supported, only bf16/fp16"
    if view.mk != 1 or view.mv != 1:
        return f"a token's K/V vector spans {view.mk}/{view.mv} arena rows; one row per token is needed"
    if D != view.v_head_dim:
        return f"head_dim {D} != v_head_dim {view.v_head_dim}"
    if D % 16 or not 64 <= D <= 256:
        return f"head_dim must be a multiple of 16 in [64, 256], got {D}"
    if view.row_words % 8:
        return f"row_words {view.row_words} is not a multiple of 8 (TMA strides are 16-byte multiples)"
    if view.num_kv_heads * view.head_words(D) > view.row_words:  # head_words: D, or D / 2 for fp8
        return "the kv heads of one token do not fit one arena row"
    return None


def check_mgpu_supported(q, view, cfg: MgpuConfig, kv_dtype=None):
    """Raise NotImplementedError if the Mosaic GPU kernel does not cover this case (pure shape
    logic: runs on any jax and any backend)."""
    D = q.shape[3]
    page_size = view.page_size

    def no(why):
        raise NotImplementedError(f"paged_prefill_attention_mgpu: {why}; use the Triton kernel "
                                  "(paged_prefill_attention)")

    why = tma_layout_refusal(D, view, kv_dtype)
    if why:
        no(why)
    if cfg.block_q != 64:
        no(f"block_q must be 64 (one wgmma M tile per consumer), got {cfg.block_q}")
    if cfg.block_kv % 64 or not 64 <= cfg.block_kv <= 256:
        no(f"block_kv must be 64, 128, 192 or 256, got {cfg.block_kv}")
    if cfg.max_concurrent_steps < 2:
        no(f"max_concurrent_steps must be >= 2, got {cfg.max_concurrent_steps}")
    if page_size % 8 or (cfg.block_kv % page_size and page_size % cfg.block_kv):
        no(f"page_size {page_size} must be a multiple of 8 that divides block_kv {cfg.block_kv} or is a "
           "multiple of it")
    need = smem_bytes(D, cfg, view.fp8)
    if need > _SMEM_LIMIT:
        no(f"{need} bytes of shared memory needed{' (fp8 K/V)' if view.fp8 else ''} (limit {_SMEM_LIMIT}); "
           "lower block_kv or max_concurrent_steps")


def head_swizzle(D: int) -> int:
    """Shared-memory swizzle (bytes) of a [rows, D] bf16 tile: the widest of 128/64/32 bytes whose
    span divides a row of D elements (D a multiple of 16)."""
    return next(sw for sw in (128, 64, 32) if (2 * D) % sw == 0)


def smem_bytes(D: int, cfg: MgpuConfig, fp8: bool = False) -> int:
    """Q/O tiles of both consumers + the K and V rings (2-byte elements) + barriers/reductions.
    fp8: the rings hold 1-byte elements, and each consumer has fp8_tiles(D, cfg) 16-bit [block_kv,
    D] tiles it dequantises ring slots into."""
    if fp8:
        return _fp8_smem_bytes(D, cfg, fp8_tiles(D, cfg))
    return 2 * (2 * cfg.block_q * D + 2 * cfg.max_concurrent_steps * cfg.block_kv * D) + 4096


def _fp8_smem_bytes(D: int, cfg: MgpuConfig, tiles: int) -> int:
    qo = 2 * 2 * cfg.block_q * D
    ring = 2 * cfg.max_concurrent_steps * cfg.block_kv * D
    converted = 2 * tiles * 2 * cfg.block_kv * D  # two consumers x tiles x [block_kv, D] f16
    return qo + ring + converted + 4096


def fp8_tiles(D: int, cfg: MgpuConfig) -> int:
    """16-bit tiles per consumer on the fp8 path: 2 (K and V: each dequantised while the tensor
    cores take the other product) where they fit shared memory, else 1 (V dequantised into K's tile
    once Q K^T has read it; D >= 224 even with 64-token blocks)."""
    return 2 if _fp8_smem_bytes(D, cfg, 2) <= _SMEM_LIMIT else 1


def fp8_swizzle(D: int) -> int | None:
    """Swizzle (bytes) of an fp8 ring's [rows, D]-byte tiles: 64 where it divides a row of D bytes,
    else 32, else None (D % 32 == 16: plain rows, whose odd number of 16-byte chunks already puts
    the 8 rows a warp reads on distinct banks).  Not 128: its 128-value tiles would make the
    conversion's register chunks twice as wide."""
    return next((sw for sw in (64, 32) if D % sw == 0), None)


def fp8_ring(plgpu, slots: int, bkv: int, D: int):
    """One fp8 ring (K or V): a RefUnion of the same bytes as [slots, bkv, D/2] uint16 words (the TMA
    destination) and as [slots, bkv, D] float8_e4m3fn values (what a consumer loads).  Both views
    are tiled 8 rows x sw bytes and swizzled by sw bytes (fp8_swizzle), so their byte layouts are
    one; both union members start at byte 0 (each is a group of its own)."""
    sw = fp8_swizzle(D)
    if sw is None:
        t_words = t_bytes = ()
    else:
        t_words = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
        t_bytes = (plgpu.TilingTransform((8, sw)), plgpu.SwizzleTransform(sw))
    return plgpu.RefUnion(plgpu.SMEM((slots, bkv, D // 2), jnp.uint16, transforms=t_words),
                          plgpu.SMEM((slots, bkv, D), FP8, transforms=t_bytes))


def dequantise_fp8(plgpu, src, dst, rows=None, cols=None):
    """One fp8 ring slot into a 16-bit tile: src [bkv, D] float8_e4m3fn (fp8_ring's value view),
    dst [bkv, D] in the wgmma dtype (f16), bkv a multiple of 64.  rows None, or (k0, lo, hi): row
    r holds position k0 + r, and rows outside [lo, hi) become 0 (V rows a masked block holds past
    the written or visible keys: p == 0 would still meet 0 * NaN).  cols: the register chunk's
    width (None: 64 on swizzled rows, D on plain ones; D: whole rows, fewer and larger chunks, more
    live registers).  Ends with commit_smem, so the tile is ready for the wgmma and the slot's reads
    are done (it may be released)."""
    bkv, D = src.shape
    layout = plgpu.Layout.WGMMA_8BIT  # 4 consecutive values a thread (32-bit loads)
    # Columns: 64 at a time (a multiple of both tilings' widths, which divide D and 64); plain
    # (unswizzled) fp8 rows in one piece (jax 0.11 cannot load a column slice of them).
    cols = cols or (_CHUNK if fp8_swizzle(D) else D)
    for r0 in range(0, bkv, _CHUNK):
        for c0 in range(0, D, cols):
            w = min(cols, D - c0)
            x = mgpu_load(plgpu, src.at[pl.ds(r0, _CHUNK), pl.ds(c0, w)], layout).astype(dst.dtype)
            if rows is not None:
                k0, lo, hi = rows
                pos = k0 + r0 + plgpu.broadcasted_iota(jnp.int32, (_CHUNK, w), 0, layout=layout)
                x = jnp.where((pos >= lo) & (pos < hi), x, jnp.zeros_like(x))
            dst.at[pl.ds(r0, _CHUNK), pl.ds(c0, w)][...] = x
    plgpu.commit_smem()  # generic-proxy writes before the async-proxy (wgmma) reads


def pv_accumulate(plgpu, acc, p16, v_ref, p_smem=None, overlap=None):
    """acc [rows, D] f32 + P V (wgmma: P [rows, bkv] from registers, V [bkv, D] in shared memory)
    into the running accumulator; overlap(): work for the CUDA cores while the tensor cores take it
    (fp8: the next block's K).  p_smem [rows, bkv]: the interpret form (the GPU interpreter runs no
    register operand and no run_state over an accumulator): P goes through this tile into a fresh
    accumulator, added in registers.  Shared by the decode (paged_decode_mgpu)."""
    if p_smem is not None:
        p_smem[...] = p16
        plgpu.commit_smem()
        return mma_accumulate(plgpu, acc, p_smem, v_ref, overlap, apart=True)
    return mma_accumulate(plgpu, acc, p16, v_ref, overlap)


def mma_accumulate(plgpu, acc, a, b, overlap=None, apart=False):
    """acc [M, N] f32 + a [M, K] b [K, N] (one wgmma: a from registers or shared memory, b in shared
    memory) into the running accumulator; overlap(): CUDA-core work while the tensor cores take it.
    apart: the GPU interpreter's form (no run_state over an accumulator): the product goes into a
    fresh accumulator, added in registers."""
    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if overlap is not None:
            overlap()
        if apart:
            return acc_ref[...]

    if apart:
        return acc + pl.run_scoped(mma, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(mma)(plgpu.ACC.init(acc))


def dequantise_slot(plgpu, ring, slot, dst, rows=None, cols=None, interpret=False):
    """Ring slot `slot` of an fp8 ring (fp8_ring's (words, bytes) views) into the 16-bit tile dst:
    dequantise_fp8 on the byte view, or in the GPU interpreter (which keeps a RefUnion's views in
    separate buffers) dequantise_words on the words the TMA wrote."""
    words, values = ring
    if interpret:
        dequantise_words(plgpu, words.at[slot], dst, rows)
    else:
        dequantise_fp8(plgpu, values.at[slot], dst, rows, cols=cols)


def dequantise_words(plgpu, src, dst, rows=None):
    """dequantise_fp8 for the GPU interpreter, from the slot's word view (src [bkv, D/2] uint16: the
    interpreter keeps a RefUnion's views in separate buffers, so only the words hold what the TMA
    wrote), unpacked in registers."""
    even, odd = unpack_fp8(src[...], dst.dtype)
    x = jnp.stack([even, odd], axis=-1).reshape(dst.shape)
    if rows is not None:
        k0, lo, hi = rows
        pos = k0 + lax.broadcasted_iota(jnp.int32, x.shape, 0)
        x = jnp.where((pos >= lo) & (pos < hi), x, jnp.zeros_like(x))
    dst[...] = x
    plgpu.commit_smem()


# --------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class RingStatics:
    """What a Mosaic GPU attention kernel over the arena fixes at trace time, the prefill's and the
    decode's alike: the KV ring (produce_kv_ring reads bkv .. v_row) and the softmax's options."""

    bkv: int  # KV tokens per ring slot
    ring_slots: int  # shared-memory K/V slots
    D: int
    P: int  # page-table width
    page_size: int
    rows_per_page: int
    k_row: int
    v_row: int
    window: int | None
    softcap: float | None
    scale: float
    dtype: object


@dataclasses.dataclass(frozen=True)
class _Static(RingStatics):
    n_tiles: int = 1  # q tiles per row (grid axis "q_seq")
    bq: int = 64
    ping_pong: bool = True  # schedule_barrier: the consumers alternate on the tensor cores
    G: int = 1
    has_sinks: bool = False
    pv_in_scoped_acc: bool = False  # True only for the CPU GPU-interpreter tests
    fp8: bool = False  # fp8 K/V: byte rings, dequantised to `dtype` (f16) by each consumer
    fp8_tiles: int = 2  # fp8: 16-bit tiles per consumer (fp8_tiles(D, cfg)): K and V, or one for both


def _kernel(plgpu, c: _Static, qlen_ref, kvlen_ref, pt_ref, *refs):
    if c.has_sinks:
        sinks_ref, q_ref, arena_ref, o_ref = refs
    else:
        sinks_ref, (q_ref, arena_ref, o_ref) = None, refs
    bq, bkv, ring_slots, D = c.bq, c.bkv, c.ring_slots, c.D
    # Q/K/V tiles: the widest swizzle whose span divides a head row (128 B for D = 64, 128, 192,
    # 256; 64 B for D = 96; 32 B for D = 80), tiled (8, swizzle / 2 bytes) as wgmma reads them.
    sw = head_swizzle(D)
    tiled = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
    qo_scratch = plgpu.SMEM((2, bq, D), c.dtype, transforms=tiled)
    if c.fp8:  # byte rings, and each consumer's 16-bit tiles (K then V, or one for both) the wgmma reads
        k_scratch, v_scratch = fp8_ring(plgpu, ring_slots, bkv, D), fp8_ring(plgpu, ring_slots, bkv, D)
        converted = plgpu.SMEM((2 * c.fp8_tiles, bkv, D), c.dtype, transforms=tiled)
    else:
        k_scratch = plgpu.SMEM((ring_slots, bkv, D), c.dtype, transforms=tiled)
        v_scratch = plgpu.SMEM((ring_slots, bkv, D), c.dtype, transforms=tiled)
        converted = None
    # Interpret form only: P goes through shared memory (the GPU interpreter's wgmma takes no
    # register operand).
    p_tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    p_scratch = plgpu.SMEM((2, bq, bkv), c.dtype, transforms=p_tiled) if c.pv_in_scoped_acc else None
    copies = max(1, bkv // c.page_size)  # TMA copies (pages) per KV block, all on one barrier
    pl.run_scoped(
        functools.partial(_body, plgpu, c, qlen_ref, kvlen_ref, pt_ref, sinks_ref, q_ref, arena_ref, o_ref),
        (qo_scratch, k_scratch, v_scratch, p_scratch, converted),
        (plgpu.Barrier(num_arrivals=copies, num_barriers=ring_slots),  # K slot filled
         plgpu.Barrier(num_arrivals=copies, num_barriers=ring_slots),  # V slot filled
         plgpu.Barrier(num_barriers=2)),  # Q tile of each consumer
        (plgpu.Barrier(num_arrivals=2, num_barriers=ring_slots),) * 2,  # K / V slot released by both consumers
        plgpu.Barrier(num_arrivals=2),  # schedule (ping-pong)
        collective_axes="wg",
    )


def _body(plgpu, c: _Static, qlen_ref, kvlen_ref, pt_ref, sinks_ref, q_ref, arena_ref, o_ref, smem, filled,
          released, schedule_bar):
    qo_smem2, k_smem, v_smem, p_smem2, converted = smem
    if c.fp8:  # each ring a (words, values) pair of views of the same bytes (fp8_ring)
        ring_words = (k_smem[0], v_smem[0])  # what the producer's TMA copies write
    else:
        ring_words = (k_smem, v_smem)
    k_filled, v_filled, q_filled = filled
    k_released, v_released = released
    bq, bkv, ring_slots, D, G = c.bq, c.bkv, c.ring_slots, c.D, c.G
    i32 = jnp.int32

    head = lax.axis_index("heads")
    tile = (c.n_tiles - 1) - lax.axis_index("q_seq")  # heaviest tiles (most keys) first
    b = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    kv_head = lax.div(head, i32(G))
    q_len = qlen_ref[b]
    kv_len = kvlen_ref[b]
    q_start = kv_len - q_len  # position of the chunk's first query

    def cdiv(a, n):
        return lax.div(a + (n - 1), i32(n))  # all operands >= 0: truncation == floor

    def wg_range(w):
        """Block ranges of consumer w: (active, first, i_lo, i_hi, last).  Blocks [first, last) hold
        every key its queries see; [i_lo, i_hi) need no mask (every query sees every key)."""
        j0 = tile * (2 * bq) + w * bq
        active = j0 < q_len
        last_j = jnp.minimum(j0 + bq, q_len) - 1
        p_first, p_last = q_start + j0, q_start + last_j
        hi, u_hi = p_last + 1, p_first + 1
        if c.window is not None:
            lo = jnp.maximum(p_first - c.window + 1, 0)
            u_lo = jnp.maximum(p_last - c.window + 1, 0)
        else:
            lo = u_lo = i32(0)
        first = lax.div(lo, i32(bkv))
        last = cdiv(hi, bkv)
        i_lo = jnp.clip(cdiv(u_lo, bkv), first, last)
        i_hi = jnp.clip(lax.div(u_hi, i32(bkv)), i_lo, last)
        return active, first, i_lo, i_hi, last

    range0, range1 = wg_range(0), wg_range(1)
    # The CTA walks the union of both ranges; consumer 0 has the earlier queries, so its range
    # starts first and consumer 1's ends last.  Consumer 0 idle => consumer 1 idle too.
    cta_first = range0[1]
    cta_last = jnp.where(range1[0], range1[4], jnp.where(range0[0], range0[4], cta_first))
    n_steps = cta_last - cta_first

    def slot_of(kb):
        return lax.rem(kb - cta_first, i32(ring_slots))

    # Keys outside [row_lo, kv_len) may be garbage (tombstoned pages, unwritten slots).
    row_lo = jnp.maximum(q_start - c.window + 1, 0) if c.window is not None else i32(0)

    def schedule():
        if c.ping_pong:
            plgpu.barrier_arrive(schedule_bar)
            plgpu.barrier_wait(schedule_bar)

    # ------------------------------------------------------------------ consumers
    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        sel = lambda a, b_: jnp.where(wg == 0, a, b_)
        active = sel(range0[0], range1[0])
        first = jnp.where(active, sel(range0[1], range1[1]), cta_last)
        i_lo = jnp.where(active, sel(range0[2], range1[2]), cta_last)
        i_hi = jnp.where(active, sel(range0[3], range1[3]), cta_last)
        last = jnp.where(active, sel(range0[4], range1[4]), cta_last)
        qo_smem = qo_smem2.at[wg]
        j0 = tile * (2 * bq) + wg * bq
        q_pos0 = q_start + j0  # position of this consumer's first query

        @pl.when(active)
        def _load_q():
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(j0, bq), head], qo_smem, q_filled.at[wg])
            plgpu.barrier_wait(q_filled.at[wg])

        # Scores stay unscaled; m is in log2 units, so the scale folds into exp2's FMA argument.
        exp_scale = _LOG2E if c.softcap is not None else c.scale * _LOG2E
        wgmma_layout = plgpu.Layout.WGMMA
        m_i = plgpu.layout_cast(jnp.full((bq,), _NEG_BIG, jnp.float32), wgmma_layout.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), wgmma_layout.reduce(1))
        acc = plgpu.layout_cast(jnp.full((bq, D), 0.0, jnp.float32), wgmma_layout)

        def skip(kb, _):
            # A block of the CTA's range this consumer cannot see: keep barrier phases in step.
            slot = slot_of(kb)
            plgpu.barrier_wait(k_filled.at[slot])
            plgpu.barrier_arrive(k_released.at[slot])
            schedule()
            plgpu.barrier_wait(v_filled.at[slot])
            plgpu.barrier_arrive(v_released.at[slot])
            schedule()
            return _

        def softmax(s, kb, masked: bool, carry):
            """One block's online-softmax update: scores s [bq, bkv] f32 of KV block kb -> (P in the
            16-bit dtype, (acc rescaled, m, l))."""
            acc, m_i, l_i = carry
            if c.softcap is not None:
                s = c.softcap * jnp.tanh(s * (c.scale / c.softcap))
            if masked:
                q_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=wgmma_layout)
                k_ids = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=wgmma_layout)
                kp = kb * bkv + k_ids
                pos = q_pos0 + q_ids
                vis = kp <= pos
                if c.window is not None:
                    vis = vis & (kp > pos - c.window)
                s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1) * exp_scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * exp_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)
            p16 = p.astype(c.dtype)
            if D <= 128:
                # Finish the whole softmax (row sums included) before handing the tensor cores
                # back; jax's FA3 kernel measured this order as markedly faster at D <= 128.
                acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            return p16, (acc, m_new, l_i)

        def pv_product(acc, p16, v_ref, overlap=None):
            return pv_accumulate(plgpu, acc, p16, v_ref, p_smem2.at[wg] if c.pv_in_scoped_acc else None, overlap)

        def step(kb, carry, masked: bool):
            slot = slot_of(kb)
            plgpu.barrier_wait(k_filled.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                schedule()  # the other consumer's turn on the tensor cores
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_released.at[slot])
            p16, (acc, m_new, l_i) = softmax(s, kb, masked, carry)
            if c.ping_pong:
                plgpu.barrier_arrive(schedule_bar)  # softmax done
            plgpu.barrier_wait(v_filled.at[slot])
            if c.ping_pong:
                plgpu.barrier_wait(schedule_bar)  # tensor cores free
            if masked:
                k0 = kb * bkv

                @pl.when((k0 < row_lo) | (k0 + bkv > kv_len))
                def _zero_garbage_v():
                    v_ref = v_smem.at[slot]
                    rows = k0 + plgpu.broadcasted_iota(jnp.int32, (bkv, D), 0, layout=wgmma_layout)
                    v = mgpu_load(plgpu, v_ref, wgmma_layout)
                    v_ref[...] = jnp.where((rows >= row_lo) & (rows < kv_len), v, jnp.zeros_like(v))
                    plgpu.commit_smem()  # generic-proxy writes before the async-proxy (wgmma) read

            acc = pv_product(acc, p16, v_smem.at[slot])
            plgpu.barrier_arrive(v_released.at[slot])
            return acc, m_new, l_i

        # fp8: this consumer's 16-bit tiles; with one tile, V goes where K was.
        if c.fp8:
            k16 = converted.at[wg * c.fp8_tiles]
            v16 = converted.at[wg * c.fp8_tiles + (c.fp8_tiles - 1)]
            overlapped = c.fp8_tiles == 2  # each conversion runs while the tensor cores take the other tile's MMA

        def dequantise(which, slot, dst, rows=None):
            dequantise_slot(plgpu, (k_smem, v_smem)[which], slot, dst, rows, interpret=c.pv_in_scoped_acc)

        def next_k(kb):
            """Dequantise block kb's K (its ring slot, then released) into k16."""
            slot = slot_of(kb)
            plgpu.barrier_wait(k_filled.at[slot])
            dequantise(0, slot, k16)  # K: masked keys meet a `where` on S
            plgpu.barrier_arrive(k_released.at[slot])

        def step_fp8(kb, carry, masked: bool):
            # k16 holds this block's K (dequantised during the previous block, or before the loops).
            slot = slot_of(kb)
            k0 = kb * bkv

            def next_v():
                """Dequantise this block's V (its ring slot, then released) into v16, zeroing the
                rows outside [row_lo, kv_len) on masked blocks."""
                plgpu.barrier_wait(v_filled.at[slot])
                dequantise(1, slot, v16, (k0, row_lo, kv_len) if masked else None)
                plgpu.barrier_arrive(v_released.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, k16.transpose((1, 0)))
                schedule()  # the other consumer's turn on the tensor cores
                if overlapped:  # v16's last reader, the previous block's P V, has completed
                    next_v()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
            if not overlapped:  # one tile: V goes where K was, now that Q K^T has read it
                next_v()
            p16, (acc, m_new, l_i) = softmax(s, kb, masked, carry)
            if c.ping_pong:
                plgpu.barrier_arrive(schedule_bar)  # softmax done
                plgpu.barrier_wait(schedule_bar)  # tensor cores free
            prefetch = lambda: pl.when(kb + 1 < last)(lambda: next_k(kb + 1))
            # Two tiles: the next block's K while the tensor cores take P V (k16's reader, this
            # block's Q K^T, has completed); one tile: once P V has read V.
            acc = pv_product(acc, p16, v16, prefetch if overlapped else None)
            if not overlapped:
                prefetch()
            return acc, m_new, l_i

        if c.ping_pong:
            pl.when(wg == 1)(schedule)  # consumer 0 goes first
        lax.fori_loop(cta_first, first, skip, None)
        if c.fp8:
            step = step_fp8
            pl.when(first < last)(lambda: next_k(first))  # the first block's K; each step dequantises the next one's
        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(first, i_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(i_lo, i_hi, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(i_hi, last, functools.partial(step, masked=True), carry)
        acc, m_i, l_i = carry
        lax.fori_loop(last, cta_last, skip, None)
        if c.ping_pong:
            pl.when(wg == 0)(schedule)

        if c.has_sinks:
            sk = sinks_ref[head] * _LOG2E  # one extra logit per q head, denominator only
            m_f = jnp.maximum(m_i, sk)
            corr = jnp.exp2(m_i - m_f)
            l_i = l_i * corr + jnp.exp2(sk - m_f)
            acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
        out = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
        rows = j0 + plgpu.broadcasted_iota(jnp.int32, (bq, D), 0, layout=wgmma_layout)
        out = jnp.where(rows < q_len, out, jnp.zeros_like(out))  # rows past q_len are 0 (idle: all)
        qo_smem[...] = out.astype(c.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[b, pl.ds(j0, bq), head])
        plgpu.wait_smem_to_gmem(0)

    # ------------------------------------------------------------------ producer
    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        produce_kv_ring(plgpu, c, pt_ref, arena_ref, b, kv_head, cta_first, n_steps, ring_words,
                        (k_filled, v_filled), (k_released, v_released), head_words=D // 2 if c.fp8 else None)


def produce_kv_ring(plgpu, c: RingStatics, pt_ref, arena_ref, b, kv_head, first, n_steps, smem, filled, released,
                    head_words: int | None = None):
    """The producer warpgroup of the Mosaic GPU prefill and decode: copy the K and V of KV blocks
    first .. first + n_steps of request b's kv head into the shared-memory ring, slot i % ring_slots,
    one TMA copy per page (a [rows, W] box at arena row page * rows_per_page + k_row (v_row) +
    offset, column kv_head * W), waiting for the consumers' release of a slot before refilling it.
    c: the kernel's RingStatics; head_words W: the words of one head in a row (None: c.D, one word
    per value; the fp8 kernels pass D / 2, two values per word)."""
    (k_smem, v_smem), (k_filled, v_filled), (k_released, v_released) = smem, filled, released
    i32 = jnp.int32
    bkv, ring_slots = c.bkv, c.ring_slots
    D = c.D if head_words is None else head_words
    page_size, rows_per_page = c.page_size, c.rows_per_page
    col = kv_head * D
    rows_per_copy = min(page_size, bkv)
    n_copies = max(1, bkv // page_size)

    def pages_of(kb):
        """Page ids of block kb's copies: scalar reads of the table in global memory, clamped
        to the table (the read one block past the end is never used)."""
        return tuple(pt_ref[b, jnp.minimum(lax.div(kb * bkv + i * rows_per_copy, i32(page_size)), c.P - 1)]
                     for i in range(n_copies))

    def issue(kb, slot, pages, base_row, smem, bar):
        for i, page in enumerate(pages):
            # first arena row of this copy: the page's K (or V) rows, from token kb*bkv + i*rows
            row = page * rows_per_page + base_row + lax.rem(kb * bkv + i * rows_per_copy, i32(page_size))
            plgpu.copy_gmem_to_smem(arena_ref.at[pl.ds(row, rows_per_copy), pl.ds(col, D)],
                                    smem.at[slot, pl.ds(i * rows_per_copy, rows_per_copy)], bar.at[slot])

    def fill(i, pages):
        kb = first + i
        slot = lax.rem(i, i32(ring_slots))
        # The next block's page ids are read before this block's waits, so the table reads'
        # latency hides behind them; K and V share the ids.
        next_pages = pages_of(kb + 1)

        @pl.when(i >= ring_slots)
        def _():
            plgpu.barrier_wait(k_released.at[slot])

        issue(kb, slot, pages, c.k_row, k_smem, k_filled)

        @pl.when(i >= ring_slots)
        def _():
            plgpu.barrier_wait(v_released.at[slot])

        issue(kb, slot, pages, c.v_row, v_smem, v_filled)
        return next_pages

    lax.fori_loop(0, n_steps, fill, pages_of(first))

    # Observe the last releases too, so every barrier phase the producer took part in is
    # seen before the scratch goes away (the CTA cannot retire before the consumers anyway).
    for j in range(ring_slots):
        i = n_steps - ring_slots + j

        @pl.when(i >= 0)
        def _():
            slot = lax.rem(i, i32(ring_slots))
            plgpu.barrier_wait(k_released.at[slot])
            plgpu.barrier_wait(v_released.at[slot])


def _paged_prefill_mgpu(q, arena, page_table, q_lens, kv_lens, sinks, k_scale, v_scale, *, view, window, softcap,
                        scale, kv_dtype, cfg: MgpuConfig, interpret: bool):
    plgpu = _plgpu()
    B, T, Hq, D = q.shape
    Hkv = view.num_kv_heads
    G = Hq // Hkv
    ks, vs = kv_scales(view, k_scale, v_scale)  # f32 [Hkv] each for fp8 views, else (None, None)
    tile_q = 2 * cfg.block_q
    T_padded = -(-T // tile_q) * tile_q
    out_dtype = q.dtype
    if view.fp8:  # the wgmma operands are f16 (module docstring); k_scale folds into q (scores are linear in K)
        dtype = jnp.dtype(jnp.float16)
        q = q.astype(jnp.float32) * jnp.repeat(ks, G)[None, None, :, None]
        q = jnp.clip(q, -F16_MAX, F16_MAX).astype(dtype)
    else:
        dtype = kv_value_dtype(view.planes, kv_dtype)
        q = q.astype(dtype)
    if T_padded != T:  # whole q tiles only (the q/o TMA boxes are block_q rows)
        q = jnp.pad(q, ((0, 0), (0, T_padded - T), (0, 0), (0, 0)))
    if view.fp8:
        arena = to_u16(arena)  # the ring's TMA copies move words (same-width view: no copy)
    elif arena.dtype != dtype:
        arena = from_u16(to_u16(arena), dtype)  # same-width view: a bitcast, no copy
    c = _Static(n_tiles=T_padded // tile_q, bq=cfg.block_q, bkv=cfg.block_kv, ring_slots=cfg.max_concurrent_steps,
                ping_pong=cfg.schedule_barrier, G=Hq // Hkv, D=D, P=page_table.shape[1], page_size=view.page_size,
                rows_per_page=view.rows_per_page, k_row=view.k_row, v_row=view.v_row, window=window,
                softcap=None if softcap is None else float(softcap),
                scale=1.0 / math.sqrt(D) if scale is None else float(scale), has_sinks=sinks is not None,
                dtype=dtype, pv_in_scoped_acc=bool(interpret), fp8=view.fp8,
                fp8_tiles=fp8_tiles(D, cfg) if view.fp8 else 2)
    args = [q_lens, kv_lens, page_table]
    if sinks is not None:
        args.append(sinks.astype(jnp.float32))
    args += [q, arena]
    out = plgpu.kernel(
        functools.partial(_kernel, plgpu, c),
        out_type=jax.ShapeDtypeStruct((B, T_padded, Hq, D), dtype),
        grid=(Hq, c.n_tiles, B),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        # CPU tests: jax's GPU interpreter (simulated SMEM, TMA and barriers, race detection).
        interpret=plgpu.InterpretGPUParams(detect_races=interpret == "races") if interpret else False,
    )(*args)
    out = out[:, :T] if T_padded != T else out
    if view.fp8:  # v_scale: linear in the output (rows past q_len stay 0)
        return (out.astype(jnp.float32) * jnp.repeat(vs, G)[None, None, :, None]).astype(out_dtype)
    return out.astype(out_dtype)


# --------------------------------------------------------------------------- public wrapper


@functools.partial(jax.jit, static_argnames=("view", "window", "softcap", "scale", "kv_dtype", "block_q", "block_kv",
                                             "max_concurrent_steps", "schedule_barrier", "interpret"))
def paged_prefill_attention_mgpu(q, arena, page_table, q_lens, kv_lens, *, view, window=None, softcap=None,
                                 sinks=None, scale=None, kv_dtype=None, k_scale=None, v_scale=None, block_q=64,
                                 block_kv=None, max_concurrent_steps=2, schedule_barrier=True, interpret=False):
    """paged_prefill_attention's contract, computed by the Mosaic GPU kernel (Hopper only).

    q [B, T, Hq, D]; arena [num_rows, row_words] u16/bf16; page_table int32 [B, P]; q_lens, kv_lens
    int32 [B]; sinks f32 [Hq] or None; k_scale, v_scale (fp8 views only) f32 [Hkv] or scalars,
    default 1.0 -> [B, T, Hq, D] in q.dtype.  block_q/block_kv/max_concurrent_steps/
    schedule_barrier: MgpuConfig (block_kv None: default_mgpu_config's, 128 or 64).  interpret=True
    (or "races": with race detection) runs it in jax's GPU interpreter on CPU, slowly, for tests.
    Unsupported cases raise NotImplementedError (see the module docstring).
    """
    check_prefill_args(q, arena, page_table, q_lens, kv_lens, sinks, view)
    check_prefill_options(window, softcap)
    if block_kv is None:
        block_kv = default_mgpu_config(q.shape[3], view.page_size, view.fp8).block_kv
    cfg = MgpuConfig(block_q, block_kv, max_concurrent_steps, schedule_barrier)
    check_mgpu_supported(q, view, cfg, kv_dtype)
    return _paged_prefill_mgpu(q, arena, page_table, q_lens, kv_lens, sinks, k_scale, v_scale, view=view,
                               window=window, softcap=softcap, scale=scale, kv_dtype=kv_dtype, cfg=cfg,
                               interpret=interpret)
