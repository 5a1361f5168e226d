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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from _prefill_utils import assert_close, kv_view, prefill_case

from umem_jax.pallas_kernels import paged_prefill_mgpu
from umem_jax.pallas_kernels.paged_prefill_mgpu import mgpu_available, paged_prefill_attention_mgpu

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


@pytest.mark.parametrize("D,G", [(128, 4), (80, 6), (96, 3)])
def test_mgpu_lowers_for_cuda(D, G, monkeypatch):
    """The compiled form (P from registers, run_state accumulator) lowers through Mosaic GPU's
    layout inference and dialect lowering for sm_90 at the benchmark geometry, and with head dims
    80 / 96 (32- / 64-byte swizzled tiles) and GQA ratios 6 / 3."""
    plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    if not hasattr(plgpu, "kernel"):
        pytest.skip(f"jax {jax.__version__} has no plgpu.kernel (the Mosaic GPU API the kernel is written in)")
    # The version gate guards running the kernel; lowering it for CUDA works on jax 0.10 as well.
    monkeypatch.setattr(paged_prefill_mgpu, "mgpu_available", lambda: (True, ""))
    view = kv_view(8, D, 16)
    B, T, Hq = 2, 512, 8 * G
    sds = jax.ShapeDtypeStruct
    args = (sds((B, T, Hq, D), jnp.bfloat16), sds((64 * view.rows_per_page, view.row_words), jnp.uint16),
            sds((B, 40), jnp.int32), sds((B,), jnp.int32), sds((B,), jnp.int32))
    f = jax.jit(functools.partial(paged_prefill_attention_mgpu, view=view, window=256))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


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
