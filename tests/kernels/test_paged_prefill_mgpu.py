"""paged_prefill_attention_mgpu (Mosaic GPU) on CPU: the unsupported-case refusals (any jax), and
with jax >= 0.11 the kernel in jax's GPU interpreter vs the plain-JAX reference (simulated SMEM,
TMA, barriers; "races" cases with race detection), and on any jax with plgpu.kernel (0.10 too) a
CUDA cross-lowering check.

The interpreter form differs from the compiled kernel in one place: P reaches the PV wgmma
through shared memory and each block's PV product is added in registers (the interpreter's wgmma
takes no register operand and cannot run run_state over an accumulator).  Everything else (page
addressing, the producer/consumer barriers, the schedule barrier, masks, garbage-row zeroing) is
the same code.  Arenas are poisoned as in test_paged_prefill.py.  The compiled kernel itself runs in
tests/gpu/test_prefill_gpu.py on an H200.

fp8 (e4m3) K/V, written with per-kv-head scales: the same interpreter runs (one more difference:
the interpreter keeps a RefUnion's two views in separate buffers, so a consumer unpacks the
slot's words in registers where the compiled form loads its fp8 view; the RefUnion's byte layout
is pinned in test_paged_decode_mgpu.py), the shared-memory budget per head dim and its refusals,
the wrapper's scale folding (k_scale into q, v_scale into the output) around a stand-in for the
kernel on any jax, and cross-lowerings of the compiled fp8 form.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from _prefill_utils import assert_close, kv_view, prefill_case

from umem_jax.pallas_kernels import paged_prefill_mgpu
from umem_jax.pallas_kernels.paged_prefill_mgpu import (_SMEM_LIMIT, MgpuConfig, check_mgpu_supported,
                                                        default_mgpu_config, fp8_tiles, mgpu_available,
                                                        paged_prefill_attention_mgpu, smem_bytes)
from umem_jax.pallas_kernels.prefill_reference import paged_prefill_attention_reference

HAVE_MGPU, WHY_NOT = mgpu_available()
needs_mgpu = pytest.mark.skipif(not HAVE_MGPU, reason=WHY_NOT or "the Mosaic GPU kernel is unavailable here")

# (name, Hkv, G, D, ps, window, softcap, sinks, T, P, rows, cfg, extra)
CASES = [
    # two q tiles (heaviest first), partial last page, a row whose second consumer is idle, a
    # padding row; page 16 (4 page copies per 64-token block).
    ("gqa2_p16_two_tiles", 1, 2, 64, 16, None, None, False, 256, 24,
     [(0, 256), (37, 100), (5, 0)], {}, {}),
    # window starting mid-block with tombstoned pages, softcap + sinks, page 64 == block.
    ("window_tomb_softcap_sinks", 1, 2, 64, 64, 40, 5.0, True, 128, 8,
     [(150, 128), (0, 70)], {}, {"tombstone": True}),
    # a page larger than the block (one copy at an offset inside the page), 3-deep ring, no
    # ping-pong barrier, window shorter than a block.
    ("p128_ring3_nosched", 1, 1, 64, 128, 20, None, False, 128, 3,
     [(60, 128), (1, 30)], {"max_concurrent_steps": 3, "schedule_barrier": False}, {"tombstone": True}),
    # head_dim 128, two kv heads (column offset), race detection on.
    ("d128_two_kv_heads_races", 2, 1, 128, 16, None, None, False, 128, 12,
     [(40, 128)], {}, {"interpret": "races"}),
    # GQA ratios that are no power of two and head dims that are no multiple of 64 (issue 15):
    # D=80 (32-byte swizzle), D=96 (64-byte swizzle); the last kv head's columns end its row's
    # K words, so a box read past the head would meet the poisoned V/next words.
    ("g3_d80_window_sinks", 2, 3, 80, 16, 40, None, True, 128, 13,
     [(70, 128), (3, 50)], {}, {"tombstone": True}),
    ("g6_d96_softcap", 2, 6, 96, 32, None, 5.0, False, 128, 6,
     [(30, 100)], {}, {}),
]


@needs_mgpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mgpu_interpret_matches_reference(case):
    name, Hkv, G, D, ps, window, softcap, use_sinks, T, P, rows, cfg, extra = case
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, Hkv, G, D, ps, T, P, rows, window=window,
                                                          softcap=softcap, use_sinks=use_sinks,
                                                          tombstone=extra.get("tombstone", False))
    out = paged_prefill_attention_mgpu(q, arena, pt, q_lens, kv_lens, **kw, block_kv=64,
                                       interpret=extra.get("interpret", True), **cfg)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_close(out, ref, q_lens, fp32=False)


def _lowered_for_cuda(view, G, monkeypatch, *, T=512, window=None, softcap=None, sinks=False,
                      arena_dtype=jnp.uint16, **cfg) -> str:
    """paged_prefill_attention_mgpu over `view` (G q heads per kv head, 2 chunks of T queries),
    lowered for CUDA through Mosaic GPU's lowering -> the StableHLO text (fp8 views: with per-head
    k/v scales as arguments); cfg: block_kv / max_concurrent_steps / schedule_barrier."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    if not hasattr(plgpu, "kernel"):
        pytest.skip(f"jax {jax.__version__} has no plgpu.kernel (the Mosaic GPU API the kernel is written in)")
    # The version gate guards running the kernel; lowering it for CUDA works on jax 0.10 as well.
    monkeypatch.setattr(paged_prefill_mgpu, "mgpu_available", lambda: (True, ""))
    B, Hkv, D = 2, view.num_kv_heads, view.head_dim
    sds = jax.ShapeDtypeStruct
    args = (sds((B, T, Hkv * G, D), jnp.bfloat16), sds((64 * view.rows_per_page, view.row_words), arena_dtype),
            sds((B, 40), jnp.int32), sds((B,), jnp.int32), sds((B,), jnp.int32))
    args += (sds((Hkv,), jnp.float32),) * (2 if view.fp8 else 0)
    kw = dict(view=view, window=window, softcap=softcap, **cfg)
    if sinks:
        kw["sinks"] = jnp.zeros((Hkv * G,), jnp.float32)

    def f(q, arena, pt, q_lens, kv_lens, *kv_scales):
        extra = dict(zip(("k_scale", "v_scale"), kv_scales))
        return paged_prefill_attention_mgpu(q, arena, pt, q_lens, kv_lens, **kw, **extra)

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("D,G", [(128, 4), (80, 6), (96, 3)])
def test_mgpu_lowers_for_cuda(D, G, monkeypatch):
    """The compiled form (P from registers, run_state accumulator) lowers through Mosaic GPU's
    layout inference and dialect lowering for sm_90 at the benchmark geometry, and with head dims
    80 / 96 (32- / 64-byte swizzled tiles) and GQA ratios 6 / 3."""
    assert "mosaic_gpu" in _lowered_for_cuda(kv_view(8, D, 16), G, monkeypatch, window=256)


@pytest.mark.parametrize("what", ["fp32_planes", "mk2", "block_q", "page_size", "dims", "smem"])
def test_mgpu_refuses_unsupported(what):
    """Cases the kernel does not cover raise NotImplementedError before anything is traced."""
    D, ps, kw = 64, 16, {}
    view_kw = {}
    if what == "fp32_planes":
        view_kw = dict(fp32=True)
    elif what == "mk2":
        view_kw = dict(row_words=64)
    elif what == "block_q":
        kw = dict(block_q=128)
    elif what == "page_size":
        ps = 4  # below the 8-row TMA / shared-memory tile
        kw = dict(block_kv=64)
    elif what == "dims":
        D = 72  # not a multiple of 16 (the wgmma K step)
    elif what == "smem":
        D, kw = 256, dict(block_kv=256, max_concurrent_steps=3)
    view = kv_view(2, D, ps, **view_kw)
    q = jnp.zeros((1, 16, 4, D), jnp.bfloat16)
    arena = jnp.zeros((4 * view.rows_per_page, view.row_words), jnp.uint16)
    z = jnp.zeros((1,), jnp.int32)
    with pytest.raises(NotImplementedError, match="paged_prefill_attention_mgpu"):
        paged_prefill_attention_mgpu(q, arena, jnp.zeros((1, 2), jnp.int32), z, z, view=view, **kw)


# --------------------------------------------------------------------------- fp8 K/V

# (name, Hkv, G, D, ps, window, softcap, sinks, T, P, rows, cfg, extra), as CASES
FP8_CASES = [
    # D = 64: K and V tiles per consumer (64-byte fp8 ring swizzle); two q tiles, a row whose second
    # consumer is idle, a padding row.
    ("fp8_g2_d64_two_tiles", 1, 2, 64, 16, None, None, False, 256, 24,
     [(0, 256), (37, 100), (5, 0)], {}, {}),
    # window starting mid-block over tombstoned (poisoned) pages, softcap + sinks, page 64 == block.
    ("fp8_window_tomb_softcap_sinks", 1, 2, 64, 64, 40, 5.0, True, 128, 8,
     [(150, 128), (0, 70)], {}, {"tombstone": True}),
    # a page above the block, 3-deep ring, no ping-pong barrier.
    ("fp8_p128_ring3_nosched", 1, 1, 64, 128, 20, None, False, 128, 3,
     [(60, 128), (1, 30)], {"max_concurrent_steps": 3, "schedule_barrier": False}, {"tombstone": True}),
    # D = 128, two kv heads (column offsets of D/2 words), race detection.
    ("fp8_d128_two_kv_heads_races", 2, 1, 128, 16, None, None, False, 128, 12,
     [(40, 128)], {}, {"interpret": "races"}),
    # G = 3 at D = 80 (plain, unswizzled byte rows), G = 6 at D = 96 (32-byte ring swizzle).
    ("fp8_g3_d80_window_sinks", 2, 3, 80, 16, 40, None, True, 128, 13,
     [(70, 128), (3, 50)], {}, {"tombstone": True}),
    ("fp8_g6_d96_softcap", 2, 6, 96, 32, None, 5.0, False, 128, 6, [(30, 100)], {}, {}),
    # D = 256: one 16-bit tile per consumer (V dequantised where K was), window, softcap, sinks.
    ("fp8_d256_one_tile", 1, 2, 256, 16, 50, 30.0, True, 128, 12,
     [(60, 128), (0, 33)], {}, {"tombstone": True}),
]


@needs_mgpu
@pytest.mark.parametrize("case", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_mgpu_fp8_interpret_matches_reference(case):
    """The fp8 path in the GPU interpreter vs the reference on the same fp8 bytes and scales: the
    word ring, each consumer's dequantised tiles and their order against the barriers, the masked
    V rows zeroed on the way (tombstoned pages are NaN bytes), k_scale folded into q and v_scale
    into the output, within bf16's tolerance of the largest output."""
    name, Hkv, G, D, ps, window, softcap, use_sinks, T, P, rows, cfg, extra = case
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, Hkv, G, D, ps, T, P, rows, fp8=True, window=window,
                                                          softcap=softcap, use_sinks=use_sinks,
                                                          tombstone=extra.get("tombstone", False))
    assert fp8_tiles(D, MgpuConfig(64, 64, cfg.get("max_concurrent_steps", 2))) == (1 if D == 256 else 2)
    out = paged_prefill_attention_mgpu(q, arena, pt, q_lens, kv_lens, **kw, block_kv=64,
                                       interpret=extra.get("interpret", True), **cfg)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_close(out, ref, q_lens, fp32=False)


def fp8_view(Hkv, D, ps):
    return kv_view(Hkv, D, ps, fp8=True)


def test_fp8_budget_per_head_dim():
    """The fp8 tilings and shared-memory needs the docstrings quote (page 16, 64 queries per
    consumer): Q/O 2 x 64 x D x 2 B + the byte rings 2 x 2 slots x block_kv x D + each consumer's
    16-bit tiles (K and V, or one: D = 128-176 with 128-token blocks, and from D = 224) + 4 KiB."""
    want = {  # D: (block_kv, tiles, bytes)
        64: (128, 2, 16384 + 32768 + 65536 + 4096),      # 118784
        80: (128, 2, 20480 + 40960 + 81920 + 4096),      # 147456
        96: (128, 2, 24576 + 49152 + 98304 + 4096),      # 176128
        128: (128, 1, 32768 + 65536 + 65536 + 4096),     # 167936 (two tiles: 233472, over)
        256: (64, 1, 65536 + 65536 + 65536 + 4096),      # 200704 (two tiles: 266240, over)
    }
    for D, (bkv, tiles, need) in want.items():
        cfg = default_mgpu_config(D, 16, fp8=True)
        assert cfg == MgpuConfig(64, bkv, 2, True), D
        assert (fp8_tiles(D, cfg), smem_bytes(D, cfg, fp8=True)) == (tiles, need), D
        assert need <= _SMEM_LIMIT
    # the bf16 defaults are unchanged by the fp8 budget
    assert [default_mgpu_config(D, 16).block_kv for D in (64, 80, 96, 128, 256)] == [128, 128, 128, 128, 64]
    assert smem_bytes(128, MgpuConfig(64, 128, 2), fp8=True) == 32768 + 65536 + 65536 + 4096  # one tile would fit
    assert fp8_tiles(128, MgpuConfig(64, 128, 2)) == 1


@pytest.mark.parametrize("D", [64, 80, 96, 112, 128, 144, 160, 192, 208, 224, 240, 256])
@pytest.mark.parametrize("ps", [8, 16, 32, 64, 128, 256])
def test_fp8_default_config_fits_shared_memory_and_the_page(D, ps):
    """Every head dim the kernel takes gets an fp8 tiling that fits 227 KiB and the page size: the
    largest KV block that fits, then two 16-bit tiles per consumer where they fit beside it."""
    cfg = default_mgpu_config(D, ps, fp8=True)
    view = fp8_view(1, D, ps)
    check_mgpu_supported(jax.ShapeDtypeStruct((1, 64, 2, D), jnp.bfloat16), view, cfg)
    assert smem_bytes(D, cfg, fp8=True) <= _SMEM_LIMIT
    assert cfg.block_kv % ps == 0 or ps % cfg.block_kv == 0
    # 128-token blocks up to D = 176 (one tile from D = 128), then 64-token ones (one tile from 224)
    assert (cfg.block_kv, fp8_tiles(D, cfg)) == ((128, 2) if D <= 112 else (128, 1) if D <= 176 else
                                                 (64, 2) if D <= 208 else (64, 1))
    # the byte ring is half the bf16 ring; the dequantised tiles come on top
    bf16_ring = 2 * cfg.max_concurrent_steps * cfg.block_kv * D * 2
    assert smem_bytes(D, cfg, fp8=True) - smem_bytes(D, cfg) == \
        4 * fp8_tiles(D, cfg) * cfg.block_kv * D - bf16_ring // 2


@pytest.mark.parametrize("case,why", [
    ("kv_dtype", "kv_dtype"),
    ("d72", "multiple of 16"),
    ("ps4", "page_size 4"),
    ("d256_bkv128", "shared memory needed (fp8 K/V)"),
    ("d256_ring3", "shared memory needed (fp8 K/V)"),
    ("d128_ring4_bkv128", "shared memory needed (fp8 K/V)"),
])
def test_fp8_refusals(case, why):
    """fp8 cases the kernel does not cover raise NotImplementedError naming the reason: a kv_dtype
    that is not e4m3, a head dim off the wgmma K step, a page below the 8-row tile, and tilings
    whose byte rings plus 16-bit tiles exceed 227 KiB (D = 256 with 128-token blocks needs 331776
    bytes, with a 3-deep ring of 64-token blocks 233472; D = 128 with 4 slots of 128: 233472)."""
    D = {"d72": 72, "d256_bkv128": 256, "d256_ring3": 256}.get(case, 128)
    view = fp8_view(2 if case == "d72" else 1, D, 4 if case == "ps4" else 16)
    cfg = {"d256_bkv128": MgpuConfig(64, 128, 2), "d256_ring3": MgpuConfig(64, 64, 3),
           "d128_ring4_bkv128": MgpuConfig(64, 128, 4)}.get(case, MgpuConfig(64, 64, 2))
    q = jax.ShapeDtypeStruct((1, 64, 2 * view.num_kv_heads, D), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=why.replace("(", r"\(").replace(")", r"\)")):
        check_mgpu_supported(q, view, cfg, jnp.bfloat16 if case == "kv_dtype" else None)
    if case.startswith("d256"):
        need = smem_bytes(D, cfg, fp8=True)
        assert need == {"d256_bkv128": 331776, "d256_ring3": 233472}[case] > _SMEM_LIMIT


def _stand_in_kernel(view, calls):
    """A plgpu.kernel stand-in computing what the Mosaic kernel writes, from what the wrapper hands
    it: attention of the q it is given over the arena's fp8 values read unscaled (k_scale = v_scale
    = 1), sinks and masks as the contract says, rows past q_len 0, in the kernel's 16-bit dtype.
    So the wrapper's own scaling is what a comparison with the reference checks."""

    def kernel(body, *, out_type, grid, **_):
        c = body.args[1]  # functools.partial(_kernel, plgpu, c)

        def run(q_lens, kv_lens, page_table, *rest):
            sinks, q, arena = rest if c.has_sinks else (None, *rest)
            calls.append((c, q.dtype, arena.dtype, out_type.shape))
            o = paged_prefill_attention_reference(q.astype(jnp.float32), arena, page_table, q_lens, kv_lens, view=view,
                                                  window=c.window, softcap=c.softcap, sinks=sinks, scale=c.scale)
            return o.astype(out_type.dtype)

        return run

    return kernel


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (40, 20.0, True)])
def test_fp8_wrapper_scales_around_a_stand_in_kernel(monkeypatch, window, softcap, sinks):
    """paged_prefill_attention_mgpu on an fp8 arena with per-head k/v scales, the kernel replaced by
    _stand_in_kernel (runs on any jax): k_scale reaches q (f16), v_scale the output, the arena goes
    in as words, q is padded to whole q tiles and cut back; the result is the reference's within
    f16 rounding, padded queries 0, per-head scales of the wrong length refused."""
    rows = [(37, 100), (0, 64), (5, 0)]  # a chunk after a cached prefix, a whole prompt, a padding row
    name = f"fp8_stand_in_{window}"
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, 2, 3, 64, 16, 100, 12, rows, fp8=True, window=window,
                                                          softcap=softcap, use_sinks=sinks)
    arena = jax.lax.bitcast_convert_type(arena, jnp.bfloat16)  # as the engine allocates it
    calls = []
    fake = types.SimpleNamespace(kernel=_stand_in_kernel(kw["view"], calls), CompilerParams=lambda **_: None)
    monkeypatch.setattr(paged_prefill_mgpu, "_plgpu", lambda: fake)
    got = paged_prefill_attention_mgpu.__wrapped__(q, arena, pt, q_lens, kv_lens, **kw)
    (c, q_dtype, arena_dtype, out_shape), = calls
    assert c.fp8 and c.dtype == jnp.float16 and q_dtype == jnp.float16 and arena_dtype == jnp.uint16
    assert out_shape == (3, 128, 6, 64) and c.fp8_tiles == 2  # 100 queries padded to one 128-query tile
    assert got.dtype == q.dtype and got.shape == ref.shape
    assert_close(got, ref, q_lens, fp32=False)
    with pytest.raises(ValueError, match="k_scale"):
        paged_prefill_attention_mgpu.__wrapped__(q, arena, pt, q_lens, kv_lens, **{**kw, "k_scale": jnp.ones(3)})


FP8_LOWER = [
    # (Hkv, G, D, ps, window, softcap, sinks, cfg)
    (8, 4, 128, 16, None, None, False, {}),                     # the benchmark's geometry: 64-token blocks
    (1, 1, 64, 16, None, 30.0, False, {}),                      # G = 1, D = 64: 128-token blocks, 64-byte swizzle
    (2, 6, 128, 64, 200, None, True, {}),                       # G = 6, page 64, window, sinks
    (1, 8, 256, 16, 100, 50.0, True, {}),                       # G = 8, D = 256: one tile per consumer
    (1, 8, 256, 256, None, None, False, {}),                    # a page above the block, D = 256
    (2, 6, 64, 16, 128, None, True, {"max_concurrent_steps": 4, "schedule_barrier": False}),
    (2, 3, 80, 16, 300, 5.0, True, {}),                         # D = 80: plain byte rows, 32-byte 16-bit tiles
    (2, 6, 96, 32, None, None, False, {"block_kv": 64}),        # D = 96: 32-byte ring swizzle
    (1, 2, 144, 16, None, None, False, {}),                     # plain rows wider than a 64-value chunk
    (1, 1, 128, 16, None, None, False, {"block_kv": 128}),      # 128-token blocks at D = 128: one tile
]


@pytest.mark.parametrize("case", FP8_LOWER, ids=[f"g{c[1]}_d{c[2]}_p{c[3]}_w{c[4]}" for c in FP8_LOWER])
def test_fp8_lowers_for_cuda(case, monkeypatch):
    """Mosaic GPU's lowering accepts the compiled fp8 form (the RefUnion byte rings, the word TMA
    boxes, the float8 chunk loads in WGMMA_8BIT layout, the e4m3 -> f16 converts into each
    consumer's tiles, both tile modes) for GQA 1-8, head dims 64-256 (64- / 32-byte / no ring
    swizzle), pages below, equal to and above the KV block, windows, soft-cap, sinks, ring depths
    and the ping-pong barrier off (the arena in bf16, as the engine allocates it)."""
    Hkv, G, D, ps, window, softcap, sinks, cfg = case
    text = _lowered_for_cuda(fp8_view(Hkv, D, ps), G, monkeypatch, window=window, softcap=softcap, sinks=sinks,
                             arena_dtype=jnp.bfloat16, **cfg)
    assert "mosaic_gpu" in text
