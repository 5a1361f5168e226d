"""GPU-only (Hopper, jax >= 0.11): the Mosaic GPU paged decode kernel, compiled, against the plain-JAX
reference over poisoned arenas (tombstoned window pages and unwritten slots hold NaN patterns),
for GQA ratios 1-64, head dims 64-256, page sizes below, equal to and above the KV block, windows,
soft-cap, sinks, split-K and the ring depths; and the engine's entry point (paged_decode_attention
with backend "mgpu" / "auto") choosing it.  The same for fp8 (e4m3) arenas written with random
per-kv-head k/v scales (the byte ring, its dequantisation to f16, the scales folded into q and the
output), with the fp8 Triton kernel's tolerance (1.5e-2 of the largest output).

Skipped on CPU (conftest: `gpu` marker).  Run: python -m pytest -q tests/gpu/test_decode_mgpu_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import close_fp8, decode_case, fp8_decode_case

from umem_jax.pallas_kernels.backend import device_info, hopper_refusal
from umem_jax.pallas_kernels.paged_decode import (decode_backend, paged_decode_attention,
                                                  paged_decode_attention_reference)

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(autouse=True)
def _hopper():
    if jax.default_backend() == "gpu" and hopper_refusal(device_info()):
        pytest.skip(f"the Mosaic GPU decode kernel needs Hopper and jax >= 0.11: {hopper_refusal(device_info())}")


CASES = [
    # (G, D, ps, window, softcap, sinks, tuning)
    (4, 128, 16, None, None, False, {}),
    (1, 128, 16, None, None, False, {}),
    (8, 64, 16, 128, None, True, {}),                       # gpt-oss's sliding layers
    (6, 128, 32, 200, None, True, {}),
    (3, 80, 16, None, None, True, {}),                      # 32-byte swizzle
    (6, 96, 64, None, 30.0, False, {}),                     # 64-byte swizzle, page == 64-token block
    (2, 256, 16, None, 50.0, False, {}),                    # Gemma-like head dim: 64-token blocks
    (5, 128, 128, 300, None, False, {}),                    # page == 128-token block
    (4, 64, 256, 100, None, True, {}),                      # a page larger than the block
    (16, 128, 16, None, None, False, {}),
    (64, 64, 16, None, None, True, {}),                     # the whole wgmma tile of q heads
    (4, 128, 16, None, None, False, {"num_splits": 1}),
    (4, 128, 16, 64, None, False, {"num_splits": 13}),      # more splits than blocks: empty splits
    (4, 128, 16, None, None, False, {"block_kv": 64, "ring_slots": 4}),
    (4, 128, 16, None, None, False, {"block_kv": 128, "ring_slots": 3}),
    # Two consumers taking the blocks in turn: an odd block count, a window, empty splits.
    (4, 128, 16, None, None, False, {"block_kv": 128, "ring_slots": 2, "consumers": 2}),
    (6, 80, 32, 200, 30.0, True, {"block_kv": 64, "ring_slots": 4, "consumers": 2}),
    (4, 128, 16, 64, None, False, {"num_splits": 13, "ring_slots": 2, "consumers": 2}),
    # Three consumers (152 registers a thread): blocks in turn, a window with sinks, empty splits.
    (4, 128, 16, None, None, False, {"block_kv": 64, "ring_slots": 3, "consumers": 3}),
    (6, 64, 32, 200, 30.0, True, {"block_kv": 64, "ring_slots": 3, "consumers": 3, "num_splits": 7}),
]


@pytest.mark.parametrize("G,D,ps,window,softcap,sinks,tuning", CASES,
                         ids=[f"g{c[0]}_d{c[1]}_p{c[2]}_w{c[3]}_sc{c[4]}_s{int(c[5])}_{c[6]}" for c in CASES])
def test_mgpu_decode_matches_reference(G, D, ps, window, softcap, sinks, tuning):
    from umem_jax.pallas_kernels.paged_decode_mgpu import paged_decode_attention_mgpu

    view, arena, pt, ln, q = decode_case(G * 1000 + D + ps, B=6, Hkv=2, G=G, D=D, ps=ps, ctx_max=1300, window=window)
    sk = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape[1]) * 2, jnp.float32) if sinks else None
    kw = dict(view=view, window=window, softcap=softcap, sinks=sk)
    got = paged_decode_attention_mgpu(q, arena, pt, ln, **kw, **tuning)
    ref = paged_decode_attention_reference(q, arena, pt, ln, **kw)
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    assert np.isfinite(ref).all() and np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(got[np.asarray(ln) == 0], 0.0)


def test_mgpu_long_context_many_splits():
    """32K tokens over 8 requests of random lengths: split-K's shares and the combine."""
    from umem_jax.pallas_kernels.paged_decode_mgpu import paged_decode_attention_mgpu

    view, arena, pt, ln, q = decode_case(7, B=8, Hkv=8, G=4, D=128, ps=16, ctx_max=32768, min_len=1)
    got = paged_decode_attention_mgpu(q, arena, pt, ln, view=view)
    ref = paged_decode_attention_reference(q, arena, pt, ln, view=view)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)


def test_entry_point_chooses_mgpu(monkeypatch):
    """paged_decode_attention with backend "auto" (argument or $UMEM_JAX_DECODE) runs the Mosaic
    kernel where it covers the case and gives the Triton kernel's answer within bf16 rounding."""
    view, arena, pt, ln, q = decode_case(3, B=4, Hkv=4, G=6, D=128, ps=16, ctx_max=700)
    assert decode_backend(q, view, backend="auto") == ("mgpu", "")
    tri = paged_decode_attention(q, arena, pt, ln, view=view, impl="pallas", backend="triton")
    auto = jax.jit(lambda *a: paged_decode_attention(*a, view=view, impl="pallas", backend="auto"))(q, arena, pt, ln)
    np.testing.assert_allclose(np.asarray(auto, np.float32), np.asarray(tri, np.float32), rtol=2e-2, atol=2e-2)
    monkeypatch.setenv("UMEM_JAX_DECODE", "auto")
    text = jax.jit(lambda *a: paged_decode_attention(*a, view=view, impl="pallas")).lower(q, arena, pt, ln).as_text()
    assert "mosaic_gpu" in text


# --------------------------------------------------------------------------- fp8 K/V

FP8_CASES = [
    # (G, D, ps, window, softcap, sinks, tuning)
    (6, 128, 16, None, None, False, {}),                     # 4 slots of 128 tokens, 64-byte ring swizzle
    (6, 80, 16, 200, None, True, {}),                        # unswizzled byte rows, a window, sinks
    (6, 256, 16, None, 50.0, False, {}),                     # 64-token blocks, 3 slots, soft-cap
    (6, 256, 64, 150, None, True, {"block_kv": 64, "ring_slots": 2}),
    (1, 128, 16, None, None, False, {"num_splits": 1}),
    (8, 64, 16, 128, None, True, {}),                        # gpt-oss's sliding layers, in fp8
    (4, 128, 64, 300, 30.0, True, {}),                       # page 64
    (6, 128, 16, 64, None, False, {"num_splits": 13}),       # more splits than blocks: empty splits
    (6, 96, 32, None, None, False, {"block_kv": 64, "ring_slots": 4}),  # 32-byte ring swizzle
    (3, 192, 128, None, None, False, {}),                    # page == 128-token block, 2 slots
    (2, 144, 16, 500, None, False, {}),                      # unswizzled rows wider than one chunk
    (64, 64, 256, 100, None, True, {}),                      # a whole wgmma tile of q heads, page > block
    # Two consumers (each dequantising its own blocks): the benchmark's tiling, a window with sinks,
    # empty splits, D = 80's plain byte rows.
    (6, 128, 16, None, None, False, {"block_kv": 128, "ring_slots": 2, "consumers": 2}),
    (4, 128, 64, 300, 30.0, True, {"block_kv": 64, "ring_slots": 4, "consumers": 2}),
    (6, 128, 16, 64, None, False, {"num_splits": 13, "block_kv": 64, "ring_slots": 2, "consumers": 2}),
    (6, 80, 16, 200, None, True, {"block_kv": 64, "ring_slots": 2, "consumers": 2}),
    # Whole-row dequantisation chunks (the experiment beside the 64-column default).
    (6, 128, 16, 200, None, True, {"block_kv": 128, "ring_slots": 2, "consumers": 2, "dequant_cols": 128}),
    (6, 128, 16, None, None, False, {"block_kv": 64, "ring_slots": 3, "consumers": 3, "dequant_cols": 128}),
    (4, 128, 64, 300, 30.0, True, {"block_kv": 64, "ring_slots": 3, "consumers": 3}),
    (4, 128, 64, None, 30.0, False, {"consumers": 1, "dequant_cols": 128}),
    # Transposed scores (S^T = K Q^T, K converted into registers; O^T += V^T P^T): the benchmark's
    # tilings with one and two consumers (two raced on one reduction scratch until session 38), many
    # blocks a consumer, a window with sinks and soft-cap, empty splits, G = 1 and 20, D = 64 and 256.
    (4, 128, 16, None, None, False, {"block_kv": 128, "ring_slots": 2, "consumers": 1, "transposed": True}),
    (4, 128, 16, None, None, False, {"block_kv": 128, "ring_slots": 2, "consumers": 2, "transposed": True}),
    (4, 128, 16, None, None, False, {"block_kv": 128, "ring_slots": 2, "consumers": 2, "transposed": True,
                                     "num_splits": 1}),  # each consumer through ~5 blocks: a slot refilled at once
    (4, 128, 16, None, None, False, {"block_kv": 128, "ring_slots": 2, "consumers": 1, "transposed": True,
                                     "num_splits": 1}),
    (6, 128, 16, 300, 30.0, True, {"block_kv": 128, "ring_slots": 4, "consumers": 2, "transposed": True}),
    (6, 128, 16, 64, None, False, {"num_splits": 13, "block_kv": 64, "ring_slots": 4, "consumers": 2,
                                   "transposed": True}),
    (1, 64, 32, None, None, True, {"block_kv": 64, "ring_slots": 2, "consumers": 1, "transposed": True}),
    (20, 256, 64, 200, None, False, {"block_kv": 64, "ring_slots": 2, "consumers": 1, "transposed": True}),
]


@pytest.mark.parametrize("G,D,ps,window,softcap,sinks,tuning", FP8_CASES,
                         ids=[f"fp8_g{c[0]}_d{c[1]}_p{c[2]}_w{c[3]}_sc{c[4]}_s{int(c[5])}_{c[6]}" for c in FP8_CASES])
def test_mgpu_fp8_decode_matches_reference(G, D, ps, window, softcap, sinks, tuning):
    from umem_jax.pallas_kernels.paged_decode_mgpu import paged_decode_attention_mgpu

    view, arena, pt, ln, q, ks, vs = fp8_decode_case(G * 1000 + D + ps, B=6, Hkv=2, G=G, D=D, ps=ps, ctx_max=1300,
                                              window=window)
    sk = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape[1]) * 2, jnp.float32) if sinks else None
    kw = dict(view=view, window=window, softcap=softcap, sinks=sk, k_scale=ks, v_scale=vs)
    got = paged_decode_attention_mgpu(q, arena, pt, ln, **kw, **tuning)
    ref = paged_decode_attention_reference(q, arena, pt, ln, **kw)
    assert got.dtype == q.dtype
    close_fp8(got, ref)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[np.asarray(ln) == 0], 0.0)


@pytest.mark.parametrize("transposed,consumers", [(False, None), (True, 1), (True, 2)])
def test_mgpu_fp8_long_context_many_splits(transposed, consumers):
    """32K tokens over 8 requests of random lengths, fp8: split-K's shares, the combine, v_scale;
    many blocks per consumer, so each ring slot is refilled as soon as it is released."""
    from umem_jax.pallas_kernels.paged_decode_mgpu import paged_decode_attention_mgpu

    view, arena, pt, ln, q, ks, vs = fp8_decode_case(7, B=8, Hkv=8, G=4, D=128, ps=16, ctx_max=32768, min_len=1)
    kw = dict(view=view, k_scale=ks, v_scale=vs)
    close_fp8(paged_decode_attention_mgpu(q, arena, pt, ln, **kw, transposed=transposed, consumers=consumers),
              paged_decode_attention_reference(q, arena, pt, ln, **kw))


def test_entry_point_runs_mgpu_fp8_when_asked(monkeypatch):
    """fp8: backend "auto" keeps the Triton kernel (the Mosaic fp8 path measured slower), "mgpu"
    (argument or $UMEM_JAX_DECODE) runs the Mosaic kernel, with the scales, within fp8 tolerance of
    the Triton kernel's answer."""
    view, arena, pt, ln, q, ks, vs = fp8_decode_case(3, B=4, Hkv=4, G=6, D=128, ps=16, ctx_max=700, window=300)
    kernel, why = decode_backend(q, view, backend="auto")
    assert kernel == "triton" and "fp8" in why
    assert decode_backend(q, view, backend="mgpu") == ("mgpu", "")
    kw = dict(view=view, window=300, softcap=20.0, k_scale=ks, v_scale=vs, impl="pallas")
    tri = paged_decode_attention(q, arena, pt, ln, backend="triton", **kw)
    mg = jax.jit(lambda *a: paged_decode_attention(*a, backend="mgpu", **kw))(q, arena, pt, ln)
    close_fp8(mg, tri)
    close_fp8(mg, paged_decode_attention_reference(q, arena, pt, ln, view=view, window=300, softcap=20.0,
                                                   k_scale=ks, v_scale=vs))
    monkeypatch.setenv("UMEM_JAX_DECODE", "mgpu")
    text = jax.jit(lambda *a: paged_decode_attention(*a, **kw)).lower(q, arena, pt, ln).as_text()
    assert "mosaic_gpu" in text
