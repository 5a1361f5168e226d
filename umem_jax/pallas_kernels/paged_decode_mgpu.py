"""Paged decode attention as a Mosaic GPU (`plgpu`) kernel for Hopper: TMA page copies into a
shared-memory ring, warpgroup MMA (wgmma) for both products, a producer warpgroup and a consumer.

Same contract as `paged_decode.paged_decode_attention` (docs/kernel_contracts.md)::

    paged_decode_attention_mgpu(q, arena, page_table, lengths, *, view, window=None, softcap=None,
                                sinks=None, scale=None, k_scale=None, v_scale=None) -> o [B, Hq, Dv]

and `paged_decode.paged_decode_attention_reference` is what it must compute.  It exists beside the
Triton kernel because jax 0.11 deprecates Pallas' Triton backend, and because Triton gathers K/V
token by token with vector loads where TMA moves a page as one box.

Supported (anything else raises NotImplementedError naming the reason; use the Triton kernel):
bf16 (or fp16) K/V stored one plane per token row (`view.planes == 1`, `mk == mv == 1`), or fp8
(e4m3) K/V in the same rows (`view.fp8`, below), head_dim == v_head_dim, a multiple of 16 in
[64, 256], any GQA ratio up to 64 (the q heads of one kv head are the rows of one wgmma M tile),
row_words a multiple of 8 (16-byte TMA strides), page size a multiple of 8 that divides the KV
block or is a multiple of it.  Windows, soft-cap, sinks and split-K.  Needs jax >= 0.11 (the
`plgpu.kernel` API) and an sm_90 GPU; CPU tests cross-lower it and, with jax >= 0.11, run it in
jax's GPU interpreter (`interpret=True`: P reaches the P V product through shared memory and an
fp8 slot is unpacked from its words, the rest is this code).

Kernel layout.  Grid (split, kv head, request).  A CTA is two warpgroups: a producer that walks
the split's KV blocks (`block_kv` tokens each) and copies each block's K and V into a
`ring_slots`-deep ring of shared-memory slots (one TMA copy per page, the source a [rows, D] box of
the 2-D arena at row `page * rows_per_page + k_row + offset` and column `kv_head * D`: a row
index and a column slice, never a flat offset), and a consumer that holds the G q heads of its kv
head as the 64 rows of a wgmma tile (rows past G are zero and never written out).  Per block:
S = Q K^T (wgmma, both in shared memory), an fp32 online softmax in log2 units with the scale
folded into the exp2 argument, P cast to the K/V dtype in registers, O += P V (wgmma).  Decode is
bound by the bytes of K and V, so one consumer suffices: its two MMAs and the softmax of one block
take less time than the producer needs to bring the next.  Where it does not (fp8: the consumer
dequantises every block), `consumers=C` (2 or 3) adds consumer warpgroups: they take the split's
blocks in turn (block lo + j to consumer j % C, ring slot j % ring_slots, so C must divide
ring_slots and each consumer waits on every fill of its own slots), each keeps its own online
softmax and writes it out as a split of its own, which combine_partials merges like any other; the
producer is then warpgroup C.  The CTA's 64K registers are shared out by `consumer_registers`: 232 a
consumer thread for one or two, 152 for three.  The Q tile is shared (the first consumer loads it),
so each consumer writes its O through a tile of its own (bf16: an O tile; fp8: its K tile, free
after its last QK).

Split-K.  The visible blocks of a request (those holding a position in [max(0, len - window),
len)) are shared out between the splits, as the Triton kernel does, so a window of 512 tokens in a
32K page table costs what 512 tokens cost.  Each split writes its O rows normalised by its own sum,
in the K/V dtype through the Q tile (an f32 tile would not fit beside a useful ring at D = 256),
and its running max and sum in f32 (log2 units); `combine_partials` merges them in XLA, adds the
sinks to the denominator and normalises.  A split with no block writes O = 0 and sum 0.

Never-read key slots.  TMA copies whole pages, so a block can hold slots past len (unwritten) or
before the window (tombstoned: the sink page, possibly poisoned).  Their scores are masked with a
`where` (NaN cannot pass) and, on the blocks that hold them, their V rows are zeroed in shared
memory before the PV MMA, where p == 0 would still meet 0 * NaN.

fp8 K/V (`view.fp8`: a head's D values are D/2 words, element 2j in the low byte of word j, so
the words' bytes are the float8 array [D]).  The producer copies a page's [rows, D/2] box of
words, as for bf16 (the arena is never bitcast in XLA: a width-changing bitcast there is a pass
over the whole arena), into an fp8 ring of half the bytes.  Each ring slot is a `plgpu.RefUnion`
of two views of the same bytes: [bkv, D/2] uint16 (what the TMA writes) and [bkv, D] float8_e4m3fn
(what the consumer reads), tiled and swizzled alike in bytes (tiles of 8 rows x `fp8_swizzle(D)`
bytes: (8, sw/2) words, (8, sw) values; plain rows where D % 32 == 16), so byte b of a row is
element b in both.  The consumer dequantises a slot into a 16-bit tile ([bkv, D], the tiling
above) in register chunks of 64 rows x 64 values (x D for plain rows and, by default, at D = 128;
WGMMA_8BIT layout: 4 bytes a thread, one `cvt.rn.f16x2.e4m3x2` a pair) and releases the slot at
once.  The wgmma products stay 16-bit (fp8 wgmma needs both operands K-major, V is not), in f16:
it holds every e4m3 value exactly, converts from e4m3 in one instruction (jax's Mosaic GPU emits
e4m3 -> bf16 only with PTX ISA >= 9.2, else through f32) and rounds q and P more finely than bf16.
K's conversion runs while the tensor cores take the previous block's P V, V's while they take this
block's Q K^T; V rows outside [start, len) are zeroed in registers on the way.  The scales never
enter the kernel: k_scale multiplies q (in f32, clipped to f16's range, then f16) and v_scale the
combined output, as in the Triton kernel; the split partials go out in f16.
paged_decode.decode_backend keeps fp8 on the Triton kernel under "auto": the conversions, not the
bytes, set this path's pace (0.95x Triton's fp8 speed on an H100, 0.71x on an H200, RESULTS.md).

Transposed scores (`transposed=True`, fp8, D a multiple of 64, one or two consumers).  Above, the
G q heads fill a 64-row M tile (8-16x the tensor-core work of G = 4-8 heads, and a 64-row Q read
from shared memory per block) and K reaches the wgmma through a 16-bit tile (the ring read, the
tile written, the tile read).  Transposed, S^T [bkv, N] = K Q^T: K is the A operand, converted
from the ring straight into registers (32-bit loads in the WGMMA_UPCAST_2X layout, one shuffle to
the WGMMA layout, one cvt a pair), Q^T the B operand, and the q heads its N columns (N =
q_columns(G): 16 for G <= 16).  The online softmax runs down the key axis (axis 0), whose rows the 4
warps share: its max and sum are cross-warp reductions through a shared-memory scratch, one per
consumer (`launch` in _body: the lowering would give two consumers the same one).  Then O^T [D,
N] += V^T P^T: V is dequantised into its tile as above (V^T is read from it with transposing
ldmatrix; 8-bit transposed loads need sm_100), P^T goes through a [bkv, N] tile as the B operand.
Each consumer writes O^T [D, N] and its max and sum as a [16, N] tile; the wrapper transposes them
back before combine_partials.  In the GPU interpreter K goes through a K tile and V^T is the
transposed tile itself.
The ring (`fp8_ring`) and the conversion (`dequantise_fp8`) are shared with the prefill
(paged_prefill_mgpu).
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
from .decode_reference import check_decode_args, merge_splits
from .kv_write import kv_scales
from .launch import choose_num_splits
from .paged_prefill_mgpu import (F16_MAX, RingStatics, _plgpu, dequantise_slot, fp8_ring, fp8_swizzle, head_swizzle,
                                 mma_accumulate, produce_kv_ring, pv_accumulate, tma_layout_refusal)
from .words import from_u16, kv_value_dtype, to_u16

__all__ = ["DecodeMgpuConfig", "check_decode_mgpu_supported", "combine_partials", "combine_splits",
           "decode_partials", "default_decode_mgpu_config", "fp8_swizzle", "paged_decode_attention_mgpu", "q_columns",
           "smem_bytes"]

_LOG2E = 1.4426950408889634
_NEG_BIG = -1e30  # finite start for the running max: exp2(NEG_BIG - NEG_BIG) = 1, never NaN
_SMEM_LIMIT = 227 * 1024  # dynamic shared memory per CTA on sm_90
_SM_SMEM = 228 * 1024 - 2 * 1024  # shared memory of an SM, less the 1 KB the hardware keeps per CTA (two CTAs)
_ROWS = 64  # one wgmma M tile: the q heads of one kv head, zero-padded
_ML_COLS = 32  # the running max (columns 0-15) and sum (16-31) of each row, as a [64, 32] f32 tile
_ML_T_ROWS = 16  # transposed: the max (rows 0-7) and sum (rows 8-15) of each q column, as [16, N]
_CTA_REGISTERS = 64 * 1024  # 32-bit registers of an SM, all of them one CTA's (the ring fills shared memory)
_PRODUCER_REGISTERS = 40  # a producer thread's (setmaxnreg): the page table walk and the TMA issue
MAX_CONSUMERS = 3
# Shared memory for one cross-warp reduction (jax's default): the transposed form's max and sum
# take one each, and each consumer gets its own (see _body's `launch`).
_REDUCTION_SCRATCH = 128 * 4 * 4


def consumer_registers(consumers: int) -> int:
    """Registers a consumer thread takes (setmaxnreg, a multiple of 8): what the CTA's 64K leave
    after the producer warpgroup's, shared by `consumers` warpgroups of 128 threads, at most 232
    (one or two consumers: 232; three: 152)."""
    spare = _CTA_REGISTERS - 128 * _PRODUCER_REGISTERS
    return min(232, spare // (128 * consumers) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class DecodeMgpuConfig:
    """block_kv: KV tokens per pipeline step (64 or 128); ring_slots: shared-memory K/V slots the
    producer may fill ahead of the consumers; num_splits: split-K (None: from the grid size);
    consumers: consumer warpgroups (1 or 2) taking the split's blocks in turn, each its own
    softmax (ring_slots a multiple of it; 1 to MAX_CONSUMERS); dequant_cols (fp8 only): the width of the register
    chunks a slot is dequantised in (None: dequantise_fp8's 64; D: whole rows, the default at D = 128);
    transposed (fp8 only, D a multiple of 64): the scores as S^T = K Q^T, K converted from the ring
    straight into registers as the wgmma's A operand and the q heads as its N columns (see the
    module docstring)."""

    block_kv: int = 128
    ring_slots: int = 2
    num_splits: int | None = None
    consumers: int = 1
    dequant_cols: int | None = None
    transposed: bool = False


def q_columns(G: int) -> int:
    """The q heads of one kv head as the N columns of the transposed products: G rounded up to 16
    (P^T [bkv, N] is the P V product's B operand with N the minor dimension, whose smallest wgmma
    tile is 8 x 16 values)."""
    return -(-G // 16) * 16


def smem_bytes(D: int, cfg: DecodeMgpuConfig, fp8: bool = False, G: int = _ROWS) -> int:
    """Q tile (2-byte) + K and V rings (2-byte; fp8: 1-byte, plus a 2-byte K and V tile per consumer
    that it dequantises a slot into) + each consumer's f32 max/sum tile + barriers; with two
    consumers of bf16 K/V, an O tile each (one consumer writes O through the Q tile, fp8 ones
    through their K tile).  Transposed (G q heads a kv head): a V tile, a P^T [bkv, N] tile, an O^T
    [D, N] tile, a [64, N] max/sum tile and a reduction scratch per consumer, N = q_columns(G)."""
    C = cfg.consumers
    if cfg.transposed:
        N = q_columns(G)
        per_consumer = 2 * cfg.block_kv * D + 2 * cfg.block_kv * N + 2 * D * N + 4 * _ROWS * N + _REDUCTION_SCRATCH
        return 2 * N * D + 2 * cfg.ring_slots * cfg.block_kv * D + C * per_consumer + 1024
    ring = cfg.ring_slots * cfg.block_kv * D * (1 if fp8 else 2)
    converted = C * 2 * cfg.block_kv * D if fp8 else 0
    o_tiles = C * 2 * _ROWS * D if C > 1 and not fp8 else 0
    return 2 * _ROWS * D + 2 * (ring + converted) + o_tiles + C * 4 * _ROWS * _ML_COLS + 1024


def default_decode_mgpu_config(D: int, page_size: int, fp8: bool = False) -> DecodeMgpuConfig:
    """128-token blocks where the page size allows (it divides 128 or is a multiple of it), else
    64; then as deep a ring as fits in shared memory, at most 4 (64-token blocks where 128-token
    ones would leave a ring of 1) -- except bf16 rows of D >= 128 in 128-token blocks: 2 slots, not
    the 3 that fit at D = 128 (faster on the main, G = 6 and long shapes alike, 1.5-1.8% in
    interleaved rounds on an H100 in session 31; 0.97x cuDNN where 3 slots were 0.95x; sessions
    11 and 27 agreed, RESULTS.md).  fp8 at D <= 128:
    two consumers (each dequantises its own blocks, which one consumer alone could not keep up
    with: 1.25x faster at D = 128 on an H100, RESULTS.md), 128-token blocks in 2 slots (64-token
    ones in 4 where the page asks for them), whole rows in each register chunk where a row fills
    whole 64-byte swizzle tiles (D = 128: 1.6% faster than 64-column chunks on an H100, 7.5% on an
    H200, sessions 28 and 35); above, one consumer (smem_bytes' fp8 budget): 2 slots
    of 128 tokens at D = 192, 3 slots of 64 tokens at D = 256.  bf16 rows that take a swizzle
    narrower than 128 bytes, where a 2-slot ring lets two CTAs share an SM (D = 80: 99 KB each):
    2 slots, faster than the deepest ring in all three runs that timed both at D = 80 (0.9% to
    3.6%, H100 and H200, RESULTS.md)."""
    bkv = 64 if (128 % page_size and page_size % 128) else 128
    if fp8:
        two = DecodeMgpuConfig(bkv, 2 if bkv == 128 else 4, None, 2, D if D % 64 == 0 and D > 64 else None)
        if smem_bytes(D, two, fp8) <= _SMEM_LIMIT:
            return two
    if smem_bytes(D, DecodeMgpuConfig(bkv, 2), fp8) > _SMEM_LIMIT:
        bkv = 64
    cfg = DecodeMgpuConfig(bkv, 2)
    if not fp8 and D % 16 == 0 and head_swizzle(D) < 128 and 2 * smem_bytes(D, cfg) <= _SM_SMEM:
        return cfg
    if not fp8 and bkv == 128 and D >= 128:  # 2 slots of 128 tokens hold enough bytes in flight (see above)
        return cfg
    while cfg.ring_slots < 4 and \
            smem_bytes(D, dataclasses.replace(cfg, ring_slots=cfg.ring_slots + 1), fp8) <= _SMEM_LIMIT:
        cfg = dataclasses.replace(cfg, ring_slots=cfg.ring_slots + 1)
    return cfg


def check_decode_mgpu_supported(q, view, cfg: DecodeMgpuConfig, kv_dtype=None):
    """Raise NotImplementedError if the Mosaic GPU decode kernel does not cover this case (pure shape
    logic: runs on any jax and any backend)."""
    D = q.shape[-1]
    G = q.shape[-2] // view.num_kv_heads

    def no(why):
        raise NotImplementedError(f"paged_decode_attention_mgpu: {why}; use the Triton kernel "
                                  "(paged_decode_attention)")

    why = tma_layout_refusal(D, view, kv_dtype)
    if why:
        no(why)
    if G > _ROWS:
        no(f"{G} q heads per kv head; at most {_ROWS} (one wgmma tile of rows)")
    if cfg.block_kv not in (64, 128):
        no(f"block_kv must be 64 or 128, got {cfg.block_kv}")
    if cfg.ring_slots < 2:
        no(f"ring_slots must be >= 2, got {cfg.ring_slots}")
    dc = cfg.dequant_cols
    if dc is not None and not (view.fp8 and (dc == D or (dc % 64 == 0 and D % dc == 0 and fp8_swizzle(D)))):
        no(f"dequant_cols {dc}: fp8 K/V only, and D ({D}) or a multiple of 64 dividing D on swizzled rows")
    if cfg.transposed and not (view.fp8 and D % 64 == 0):
        no(f"transposed scores: fp8 K/V with D a multiple of 64 (the V^T operand's 64-row tiles), got D = {D}"
           f"{'' if view.fp8 else ' and 16-bit K/V'}")
    if cfg.transposed and cfg.consumers > 2:
        # Three transposed consumers hang in jax's GPU interpreter (at varying points, not yet
        # understood; one or two pass, and three untransposed ones do), so none is compiled.
        no(f"transposed scores take one or two consumers, got {cfg.consumers}")
    if not 1 <= cfg.consumers <= MAX_CONSUMERS or cfg.ring_slots % cfg.consumers:
        # A consumer waits on every fill of the slots it owns (each thread keeps one phase bit per
        # barrier): the ring's slots must fall to the consumers in a fixed pattern.
        no(f"consumers must be 1 to {MAX_CONSUMERS} and divide ring_slots {cfg.ring_slots}, got {cfg.consumers}")
    ps = view.page_size
    if ps % 8 or (cfg.block_kv % ps and ps % cfg.block_kv):
        no(f"page_size {ps} must be a multiple of 8 that divides block_kv {cfg.block_kv} or is a multiple of it")
    need = smem_bytes(D, cfg, view.fp8, G)
    if need > _SMEM_LIMIT:
        no(f"{need} bytes of shared memory needed{' (fp8 K/V)' if view.fp8 else ''} (limit {_SMEM_LIMIT}); "
           "lower block_kv or ring_slots")


# --------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Static(RingStatics):
    num_splits: int = 1
    G8: int = 8  # q rows read and written: G rounded up to a multiple of 8 (whole tiles)
    fp8: bool = False  # fp8 K/V: the ring holds bytes, dequantised to `dtype` (f16) by the consumer
    consumers: int = 1  # consumer warpgroups, taking the blocks in turn; the producer is the last
    dequant_cols: int | None = None  # fp8: dequantise_fp8's register chunk width (None: its default)
    transposed: bool = False  # fp8: S^T = K Q^T with K in registers; G8 is then the N columns (q_columns)
    interpret: bool = False  # jax's GPU interpreter (CPU tests): P through shared memory, fp8 read as words


def _kernel(plgpu, c: _Static, len_ref, pt_ref, q_ref, arena_ref, o_ref, ml_ref):
    D, bkv, slots, C = c.D, c.bkv, c.ring_slots, c.consumers
    sw = head_swizzle(D)
    tiled = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
    ml_tiled = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    copies = max(1, bkv // c.page_size)  # TMA copies (pages) per KV block, all on one barrier
    q_rows = c.G8 if c.transposed else _ROWS
    if c.fp8:  # byte rings, and each consumer's 16-bit K and V tiles the wgmma reads (refs of their
        # own, not rows of one [C, bkv, D] ref: jax 0.11 cannot lower a static index of a ref that
        # the P V's run_state closes over); transposed: K goes to registers (a K tile only in the
        # GPU interpreter, whose wgmma takes no register operand)
        tile = lambda: plgpu.SMEM((bkv, D), c.dtype, transforms=tiled)  # noqa: E731
        k_tiles = None if c.transposed and not c.interpret else tuple(tile() for _ in range(C))
        rings = (fp8_ring(plgpu, slots, bkv, D), fp8_ring(plgpu, slots, bkv, D), k_tiles,
                 tuple(tile() for _ in range(C)))
    else:
        rings = (plgpu.SMEM((slots, bkv, D), c.dtype, transforms=tiled),
                 plgpu.SMEM((slots, bkv, D), c.dtype, transforms=tiled))
    # Where each consumer's O leaves: one consumer through the Q tile (no MMA reads Q after its
    # loop); two share Q, so bf16 ones get an O tile each and fp8 ones use their K tile.
    o_tiles = plgpu.SMEM((C, _ROWS, D), c.dtype, transforms=tiled) if C > 1 and not c.fp8 else None
    # Interpret form only: each consumer's P goes through shared memory (the GPU interpreter's wgmma
    # takes no register operand).
    p_tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    p_tiles = plgpu.SMEM((C, _ROWS, bkv), c.dtype, transforms=p_tiled) if c.interpret else None
    ml_tile = plgpu.SMEM((C, _ROWS, _ML_COLS), jnp.float32, transforms=ml_tiled)
    if c.transposed:  # per consumer: P^T [bkv, N] (the P V product's B operand), O^T [D, N] on the way
        # out, and the max/sum as a [64, N] f32 tile (its first _ML_T_ROWS rows leave: the max, then the sum)
        N = c.G8
        nsw = head_swizzle(N)  # N is a multiple of 16: rows of whole 32-byte swizzle units at least
        nt = (plgpu.TilingTransform((8, nsw // 2)), plgpu.SwizzleTransform(nsw))
        p_tiles = tuple(plgpu.SMEM((bkv, N), c.dtype, transforms=nt) for _ in range(C))
        o_tiles = tuple(plgpu.SMEM((D, N), c.dtype, transforms=nt) for _ in range(C))
        ml_tile = plgpu.SMEM((C, _ROWS, N), jnp.float32)
    pl.run_scoped(
        functools.partial(_body, plgpu, c, len_ref, pt_ref, q_ref, arena_ref, o_ref, ml_ref),
        (plgpu.SMEM((q_rows, D), c.dtype, transforms=tiled),
         rings,
         ml_tile,
         o_tiles, p_tiles),
        (plgpu.Barrier(num_arrivals=copies, num_barriers=slots),  # K slot filled
         plgpu.Barrier(num_arrivals=copies, num_barriers=slots),  # V slot filled
         plgpu.Barrier()),  # Q tile
        (plgpu.Barrier(num_barriers=slots),) * 2,  # K / V slot released by its consumer
        collective_axes="wg",
    )


def _body(plgpu, c: _Static, len_ref, pt_ref, q_ref, arena_ref, o_ref, ml_ref, smem, filled, released):
    q_smem, rings, ml_smem, o_tiles, p_tiles = smem
    if c.fp8:
        k16s, v16s = rings[2], rings[3]  # rings[0], rings[1]: (words, values) views of each fp8 ring
        ring_words = (rings[0][0], rings[1][0])  # what the producer's TMA copies write
    else:
        k_smem, v_smem = rings
        ring_words = rings
    k_filled, v_filled, q_filled = filled
    k_released, v_released = released
    D, bkv, slots, C = c.D, c.bkv, c.ring_slots, c.consumers
    i32 = jnp.int32

    split = lax.axis_index("split")
    kv_head = lax.axis_index("heads")
    b = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    length = jnp.minimum(len_ref[b], i32(c.P * c.page_size))
    start = jnp.maximum(length - c.window, 0) if c.window is not None else i32(0)

    def cdiv(a, n):
        return lax.div(a + (n - 1), i32(n))  # all operands >= 0: truncation == floor

    # This split's share of the blocks that hold visible positions (as the Triton kernel shares them).
    first_block = lax.div(start, i32(bkv))
    end_block = cdiv(length, bkv)
    per_split = cdiv(jnp.maximum(end_block - first_block, 0), c.num_splits)
    lo = first_block + split * per_split
    hi = jnp.maximum(jnp.minimum(lo + per_split, end_block), lo)

    # ------------------------------------------------------------------ consumers
    def consumer(ci: int):
        """Consumer warpgroup ci: blocks lo + ci, lo + ci + C, ... of the split (ring slot
        (kb - lo) % slots, which C divides: a slot's every fill is this consumer's), its own
        online softmax, written out as split `split * C + ci`."""
        plgpu.set_max_registers(consumer_registers(C), action="increase")
        layout = plgpu.Layout.WGMMA
        q_rows = c.G8 if c.transposed else _ROWS  # the q heads' extent in the products (zero-padded)
        if ci == 0:  # one consumer loads Q for all; the others wait for the same copy
            if c.G8 < q_rows:  # rows past the q heads: zeros, so their (discarded) scores stay finite
                q_smem[...] = plgpu.layout_cast(jnp.zeros((q_rows, D), c.dtype), layout)
                plgpu.commit_smem()  # generic-proxy writes before the TMA (async proxy) writes over them
            plgpu.copy_gmem_to_smem(q_ref.at[b, kv_head], q_smem.at[pl.ds(0, c.G8)], q_filled)
        plgpu.barrier_wait(q_filled)
        if c.fp8:
            k16, v16 = (None if k16s is None else k16s[ci]), v16s[ci]

        # Rows of S are q heads and columns keys; transposed (S^T), the other way round.
        key_axis = 0 if c.transposed else 1
        exp_scale = _LOG2E if c.softcap is not None else c.scale * _LOG2E
        m_i = plgpu.layout_cast(jnp.full((q_rows,), _NEG_BIG, jnp.float32), layout.reduce(key_axis))
        l_i = plgpu.layout_cast(jnp.full((q_rows,), 0.0, jnp.float32), layout.reduce(key_axis))
        acc_shape = (D, q_rows) if c.transposed else (_ROWS, D)
        acc = plgpu.layout_cast(jnp.full(acc_shape, 0.0, jnp.float32), layout)

        def softmax(s, k0, masked: bool, carry):
            """One block's online-softmax update: scores s [64, bkv] f32 of keys k0 .. k0 + bkv
            (transposed: [bkv, N]) -> (P in the 16-bit dtype, (acc rescaled, m, l))."""
            acc, m_i, l_i = carry
            q_axis = 1 - key_axis
            if c.softcap is not None:
                s = c.softcap * jnp.tanh(s * (c.scale / c.softcap))
            if masked:  # every q head is the same position: one mask over the keys
                kp = k0 + plgpu.broadcasted_iota(jnp.int32, s.shape, key_axis, layout=layout)
                s = jnp.where((kp >= start) & (kp < length), s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=key_axis) * exp_scale)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s * exp_scale - lax.broadcast_in_dim(m_new, s.shape, [q_axis]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1 if c.transposed else 0])
            l_i = l_i * alpha + p.sum(axis=key_axis)
            return p.astype(c.dtype), (acc, m_new, l_i)

        def pv_product(acc, p16, v_ref, overlap=None):
            """acc [64, D] + P V (pv_accumulate, shared with the prefill)."""
            return pv_accumulate(plgpu, acc, p16, v_ref, p_tiles.at[ci] if c.interpret else None, overlap)

        def step_bf16(kb, carry, masked: bool):
            slot = lax.rem(kb - lo, i32(slots))
            plgpu.barrier_wait(k_filled.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((_ROWS, bkv), jnp.float32))
            plgpu.barrier_arrive(k_released.at[slot])
            k0 = kb * bkv
            p16, (acc, m_new, l_i) = softmax(s, k0, masked, carry)
            plgpu.barrier_wait(v_filled.at[slot])
            if masked:
                @pl.when((k0 < start) | (k0 + bkv > length))
                def _zero_garbage_v():
                    v_ref = v_smem.at[slot]
                    rows = k0 + plgpu.broadcasted_iota(jnp.int32, (bkv, D), 0, layout=layout)
                    v = mgpu_load(plgpu, v_ref, layout)
                    v_ref[...] = jnp.where((rows >= start) & (rows < length), v, jnp.zeros_like(v))
                    plgpu.commit_smem()  # generic-proxy writes before the async-proxy (wgmma) read

            acc = pv_product(acc, p16, v_smem.at[slot])
            plgpu.barrier_arrive(v_released.at[slot])
            return acc, m_new, l_i

        def dequantise(which: int, slot, dst, k0, masked: bool):
            """Ring slot `slot` of K (which 0) or V (1), fp8 [bkv, D], into a 16-bit tile (dst [bkv,
            D]); masked: rows outside [start, length) (k0: position of row 0) become 0 (dequantise_slot,
            shared with the prefill; it ends with commit_smem, so the slot may be released)."""
            rows = (k0, start, length) if masked else None
            dequantise_slot(plgpu, rings[which], slot, dst, rows, cols=c.dequant_cols, interpret=c.interpret)

        def next_k(kb):
            """Dequantise block kb's K (its ring slot, then released) into k16."""
            slot = lax.rem(kb - lo, i32(slots))
            plgpu.barrier_wait(k_filled.at[slot])
            dequantise(0, slot, k16, None, masked=False)  # K: masked keys meet a `where` on S
            plgpu.barrier_arrive(k_released.at[slot])

        def step_fp8(kb, carry, masked: bool):
            # k16 holds this block's K (dequantised during the previous block's P V, or before the loop).
            slot = lax.rem(kb - lo, i32(slots))
            k0 = kb * bkv

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k16.transpose((1, 0)))
                # This block's V, dequantised while the tensor cores take Q K^T (v16's last reader,
                # this consumer's previous P V, has completed).
                plgpu.barrier_wait(v_filled.at[slot])
                dequantise(1, slot, v16, k0, masked)
                plgpu.barrier_arrive(v_released.at[slot])
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((_ROWS, bkv), jnp.float32))
            p16, (acc, m_new, l_i) = softmax(s, k0, masked, carry)

            # This consumer's next block's K, dequantised while the tensor cores take P V (k16's
            # reader, this block's Q K^T, has completed).
            acc = pv_product(acc, p16, v16, overlap=lambda: pl.when(kb + C < hi)(lambda: next_k(kb + C)))
            return acc, m_new, l_i

        def k_operand(slot):
            """Block K [bkv, D] as the S^T product's A operand: converted from the fp8 ring into
            registers (32-bit loads in the layout made for upcasting, one shuffle to the WGMMA
            layout, one cvt a pair); in the GPU interpreter, through the K tile.  The slot is free
            afterwards."""
            if c.interpret:
                dequantise(0, slot, k16, None, masked=False)
                return k16
            x = mgpu_load(plgpu, rings[0][1].at[slot], plgpu.Layout.WGMMA_UPCAST_2X)
            # The slot's next fill is a TMA write (the async proxy): without this fence it can
            # overtake these generic-proxy reads once the slot is released (wrong K, seen on an H100
            # with two consumers, each refilled the moment it lets go).
            plgpu.commit_smem()
            return plgpu.layout_cast(x, layout).astype(c.dtype)

        def step_fp8_transposed(kb, carry, masked: bool):
            """S^T [bkv, N] = K Q^T, then O^T [D, N] += V^T P^T: the q heads are the N columns (16
            where G <= 16, not 64 padded rows), and K never goes through a 16-bit tile."""
            slot = lax.rem(kb - lo, i32(slots))
            k0 = kb * bkv
            plgpu.barrier_wait(k_filled.at[slot])
            k_a = k_operand(slot)  # masked keys meet a `where` on S^T
            plgpu.barrier_arrive(k_released.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, k_a, q_smem.transpose((1, 0)))
                plgpu.barrier_wait(v_filled.at[slot])  # V dequantised while the tensor cores take S^T
                dequantise(1, slot, v16, k0, masked)
                plgpu.barrier_arrive(v_released.at[slot])
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((bkv, c.G8), jnp.float32))
            p16, (acc, m_new, l_i) = softmax(s, k0, masked, carry)
            pt = p_tiles[ci]  # P^T [bkv, N]: its last reader, the previous P V, has completed
            pt[...] = p16
            plgpu.commit_smem()
            vt = v16.transpose((1, 0))  # V^T [D, bkv]
            if not c.interpret:
                vt = mgpu_load(plgpu, vt, layout)
            acc = mma_accumulate(plgpu, acc, vt, pt, apart=c.interpret)
            return acc, m_new, l_i

        if c.transposed:
            step = step_fp8_transposed
        else:
            step = step_fp8 if c.fp8 else step_bf16
        if c.fp8 and not c.transposed:
            pl.when(lo + ci < hi)(lambda: next_k(lo + ci))  # the first block's K; each step dequantises the next

        def blocks(a, z, masked: bool, carry):
            """This consumer's blocks in [a, z), in order: those with (kb - lo) % C == ci."""
            if C == 1:
                return lax.fori_loop(a, z, functools.partial(step, masked=masked), carry)
            first = a + lax.rem(ci - lax.rem(a - lo, i32(C)) + C, i32(C))
            n = cdiv(jnp.maximum(z - first, 0), C)
            return lax.fori_loop(0, n, lambda j, cr: step(first + j * C, cr, masked), carry)

        # Blocks wholly inside [start, length) need no mask: [i_lo, i_hi); the first and last
        # blocks of the visible range may hold slots outside it.
        i_lo = jnp.clip(cdiv(start, bkv), lo, hi)
        i_hi = jnp.clip(lax.div(length, i32(bkv)), i_lo, hi)
        carry = (acc, m_i, l_i)
        carry = blocks(lo, i_lo, True, carry)
        carry = blocks(i_lo, i_hi, False, carry)
        carry = blocks(i_hi, hi, True, carry)
        acc, m_i, l_i = carry

        # O leaves normalised, in the 16-bit dtype, through a tile no MMA reads any more (see
        # _kernel); the max and sum go out in f32 beside it, for combine_splits.
        out = split * C + ci
        l_safe = jnp.where(l_i > 0, l_i, jnp.ones_like(l_i))  # an empty split: acc = 0, l = 0
        if c.transposed:  # O^T [D, N] and the [_ML_T_ROWS, N] max / sum tile
            o_smem = o_tiles[ci]
            o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])).astype(c.dtype)
            r = plgpu.broadcasted_iota(jnp.int32, (_ROWS, c.G8), 0, layout=layout)
            ml = jnp.where(r < _ML_T_ROWS // 2, lax.broadcast_in_dim(m_i, (_ROWS, c.G8), [1]),
                           lax.broadcast_in_dim(l_i, (_ROWS, c.G8), [1]))
            ml_smem.at[ci][...] = ml
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, kv_head, out])
            plgpu.copy_smem_to_gmem(ml_smem.at[ci, pl.ds(0, _ML_T_ROWS)], ml_ref.at[b, kv_head, out])
            plgpu.wait_smem_to_gmem(0)
            return
        if C == 1:
            o_smem = q_smem
        else:
            o_smem = k16.at[pl.ds(0, _ROWS)] if c.fp8 else o_tiles.at[ci]
        o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(c.dtype)
        cols = plgpu.broadcasted_iota(jnp.int32, (_ROWS, _ML_COLS), 1, layout=layout)
        ml = jnp.where(cols < _ML_COLS // 2, lax.broadcast_in_dim(m_i, (_ROWS, _ML_COLS), [0]),
                       lax.broadcast_in_dim(l_i, (_ROWS, _ML_COLS), [0]))
        ml_smem.at[ci][...] = ml
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, c.G8)], o_ref.at[b, kv_head, out])
        plgpu.copy_smem_to_gmem(ml_smem.at[ci, pl.ds(0, c.G8)], ml_ref.at[b, kv_head, out])
        plgpu.wait_smem_to_gmem(0)

    def launch(ci: int):
        """Consumers ci .. C-1, each `ci` reduction scratches deeper into shared memory than consumer
        0.  A reduction over a dimension the warps share (the transposed form's max and sum down
        the key axis: S^T's rows are spread over the 4 warps) goes through a scratch that jax's
        Mosaic GPU lowering places at the shared memory in use at that point of the program, the
        same offset for every consumer's copy of the code: two consumers racing on one scratch
        gave wrong outputs on the GPU (sessions 36-37; right since, RESULTS.md).  So consumer ci runs
        inside ci collective run_scoped
        pads of _REDUCTION_SCRATCH bytes: their barriers come first for every thread (they wrap
        the launches, before any work), and nothing synchronises on their exit."""
        if ci + 1 < C and c.transposed:
            pl.run_scoped(lambda _pad: launch(ci + 1), plgpu.SMEM((_REDUCTION_SCRATCH,), jnp.uint8),
                          collective_axes="wg")
        elif ci + 1 < C:
            launch(ci + 1)
        pl.when(wg == ci)(functools.partial(consumer, ci))

    launch(0)

    # ------------------------------------------------------------------ producer
    @pl.when(wg == C)
    def _producer():
        plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
        produce_kv_ring(plgpu, c, pt_ref, arena_ref, b, kv_head, lo, hi - lo, ring_words, (k_filled, v_filled),
                        (k_released, v_released), head_words=D // 2 if c.fp8 else None)


def combine_splits(o, ml, lengths, sinks, G: int, dtype):
    """Merge the splits' partials: o [B, Hkv, S, G8, D] each split's softmax-weighted V (normalised by
    its own sum), ml [B, Hkv, S, G8, 32] f32 (max in log2 units in column 0, sum in column 16) ->
    [B, Hkv * G, D] in dtype; sinks (natural-log logits, [Hkv * G] or None) join the denominator;
    lengths == 0 gives 0."""
    return combine_partials(o[:, :, :, :G], ml[:, :, :, :G, 0], ml[:, :, :, :G, _ML_COLS // 2], lengths, sinks,
                            dtype)


def combine_partials(o, m, l, lengths, sinks, dtype):
    """combine_splits on unpacked partials: o [B, Hkv, S, G, D], m and l [B, Hkv, S, G] f32 (the max
    in log2 units) -> [B, Hkv * G, D] in dtype."""
    B, Hkv, _, G, D = o.shape
    acc = o.astype(jnp.float32) * l[..., None]  # unnormalised again, as the Triton kernel's
    return merge_splits(acc, m / _LOG2E, l, lengths, sinks, dtype).reshape(B, Hkv * G, D)


def _paged_decode_mgpu(q, arena, page_table, lengths, sinks, k_scale, v_scale, *, view, window, softcap, scale,
                       kv_dtype, cfg: DecodeMgpuConfig, interpret=False):
    B, Hq, D = q.shape
    _, vs = kv_scales(view, k_scale, v_scale)  # f32 [Hkv] for fp8 views; an error for scales on 16-bit K/V
    o, m, l = decode_partials(q, arena, page_table, lengths, k_scale, view=view, window=window, softcap=softcap,
                              scale=scale, kv_dtype=kv_dtype, cfg=cfg, interpret=interpret)
    lengths = jnp.minimum(lengths, page_table.shape[1] * view.page_size)
    if not view.fp8:
        return combine_partials(o, m, l, lengths, sinks, q.dtype)
    out = combine_partials(o, m, l, lengths, sinks, jnp.float32).reshape(B, view.num_kv_heads, -1, D)
    return (out * vs[None, :, None, None]).reshape(B, Hq, D).astype(q.dtype)  # v_scale: linear in the output


def decode_partials(q, arena, page_table, lengths, k_scale, *, view, window, softcap, scale, kv_dtype,
                    cfg: DecodeMgpuConfig, interpret=False):
    """The kernel's partials, unpacked: o [B, Hkv, S * C, G, D] (each split's and consumer's softmax-
    weighted V, normalised by its own sum; 16-bit), m and l [B, Hkv, S * C, G] f32 (its max in log2
    units and its sum).  Part split * C + ci holds consumer ci's blocks of the split.  No support
    check: the wrapper's job (benchmarks probe refused tilings through this)."""
    plgpu = _plgpu()
    B, Hq, D = q.shape
    Hkv = view.num_kv_heads
    G = Hq // Hkv
    G8 = q_columns(G) if cfg.transposed else -(-G // 8) * 8
    ks, _ = kv_scales(view, k_scale, None)  # f32 [Hkv] for fp8 views, else None
    # fp8: the wgmma operands are f16 (see the module docstring), the ring copies the arena's words.
    dtype = jnp.dtype(jnp.float16) if view.fp8 else kv_value_dtype(view.planes, kv_dtype)
    P = page_table.shape[1]
    num_splits = cfg.num_splits
    if num_splits is None:
        visible = -(-P * view.page_size // cfg.block_kv)
        if window is not None:
            visible = min(visible, -(-(window - 1) // cfg.block_kv) + 1)
        # One CTA per SM at a time (the ring fills most of shared memory): about two waves.
        num_splits = choose_num_splits(B, Hkv, visible, waves=2, min_blocks_per_split=4)
    if view.fp8:  # k_scale folds into q (the scores are linear in K, before the soft-cap)
        qg = q.astype(jnp.float32).reshape(B, Hkv, G, D) * ks[None, :, None, None]
        qg = jnp.clip(qg, -F16_MAX, F16_MAX).astype(dtype)
        arena = to_u16(arena)  # the ring's TMA copies move words (same-width view: no copy)
    else:
        qg = q.astype(dtype).reshape(B, Hkv, G, D)
        if arena.dtype != dtype:
            arena = from_u16(to_u16(arena), dtype)  # same-width view: a bitcast, no copy
    if G8 != G:  # whole 8-row tiles for the TMA box; the padded rows are zeros, sliced off below
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, G8 - G), (0, 0)))
    c = _Static(bkv=cfg.block_kv, ring_slots=cfg.ring_slots, num_splits=int(num_splits), G8=G8, D=D, P=P,
                page_size=view.page_size, rows_per_page=view.rows_per_page, k_row=view.k_row, v_row=view.v_row,
                window=window, softcap=None if softcap is None else float(softcap),
                scale=1.0 / math.sqrt(D) if scale is None else float(scale), dtype=dtype, fp8=view.fp8,
                consumers=cfg.consumers, dequant_cols=cfg.dequant_cols, transposed=cfg.transposed,
                interpret=bool(interpret))
    parts = c.num_splits * c.consumers  # each consumer's softmax leaves as a split of its own
    # Transposed: O^T [D, N], and the max (first half of the rows) and sum (second half) as [_ML_T_ROWS, N].
    o_shape = (B, Hkv, parts) + ((D, G8) if cfg.transposed else (G8, D))
    ml_shape = (B, Hkv, parts) + ((_ML_T_ROWS, G8) if cfg.transposed else (G8, _ML_COLS))
    o, ml = plgpu.kernel(
        functools.partial(_kernel, plgpu, c),
        out_type=(jax.ShapeDtypeStruct(o_shape, dtype), jax.ShapeDtypeStruct(ml_shape, jnp.float32)),
        grid=(c.num_splits, Hkv, B),
        grid_names=("split", "heads", "batch"),
        num_threads=c.consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=_REDUCTION_SCRATCH),
        # CPU tests: jax's GPU interpreter (simulated SMEM, TMA and barriers, race detection).
        interpret=plgpu.InterpretGPUParams(detect_races=interpret == "races") if interpret else False,
    )(lengths, page_table, qg, arena)
    if cfg.transposed:
        return o[..., :G].swapaxes(-1, -2), ml[..., 0, :G], ml[..., _ML_T_ROWS // 2, :G]
    return o[:, :, :, :G], ml[:, :, :, :G, 0], ml[:, :, :, :G, _ML_COLS // 2]


# --------------------------------------------------------------------------- public wrapper


@functools.partial(jax.jit, static_argnames=("view", "window", "softcap", "scale", "kv_dtype", "block_kv",
                                             "ring_slots", "num_splits", "consumers", "dequant_cols", "transposed",
                                             "interpret"))
def paged_decode_attention_mgpu(q, arena, page_table, lengths, *, view, window=None, softcap=None, sinks=None,
                                scale=None, kv_dtype=None, k_scale=None, v_scale=None, block_kv=None, ring_slots=None,
                                num_splits=None, consumers=None, dequant_cols=None, transposed=None, interpret=False):
    """paged_decode_attention's contract, computed by the Mosaic GPU kernel (Hopper only).

    q [B, Hq, D]; arena [num_rows, row_words] u16/bf16; page_table int32 [B, P]; lengths int32 [B];
    sinks f32 [Hq] or None; k_scale, v_scale (fp8 views only) f32 [Hkv] or scalars, default 1.0
    -> [B, Hq, D] in q.dtype.  block_kv / ring_slots / num_splits / consumers / dequant_cols / transposed:
    DecodeMgpuConfig
    (None: default_decode_mgpu_config's, num_splits from the grid size; consumers None: the
    default's where the given block and ring take them, else 1).  interpret=True (or "races": with
    race detection) runs it in jax's GPU interpreter on CPU (jax >= 0.11), slowly, for tests.
    Unsupported cases raise NotImplementedError (see the module docstring).
    """
    check_decode_args(q, arena, page_table, lengths, view, sinks, window, softcap)
    cfg = default_decode_mgpu_config(q.shape[2], view.page_size, view.fp8)
    G = q.shape[1] // view.num_kv_heads
    given = DecodeMgpuConfig(block_kv or cfg.block_kv, ring_slots or cfg.ring_slots, num_splits, consumers or 1,
                             dequant_cols, cfg.transposed if transposed is None else bool(transposed))
    if consumers is None and cfg.consumers > 1:  # the default's consumers and chunks, where the given tiling takes them
        two = dataclasses.replace(given, consumers=cfg.consumers, dequant_cols=dequant_cols or cfg.dequant_cols)
        if two.ring_slots % two.consumers == 0 and smem_bytes(q.shape[2], two, view.fp8, G) <= _SMEM_LIMIT:
            given = two
    cfg = given
    check_decode_mgpu_supported(q, view, cfg, kv_dtype)
    return _paged_decode_mgpu(q, arena, page_table, lengths, sinks, k_scale, v_scale, view=view, window=window,
                              softcap=softcap, scale=None if scale is None else float(scale), kv_dtype=kv_dtype,
                              cfg=cfg, interpret=interpret)
