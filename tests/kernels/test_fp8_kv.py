"""fp8 (e4m3) K/V in the 16-bit arena: the codec, the halved geometry, and every attention kernel
(Pallas in interpret mode) against its reference on fp8 arenas.

Arenas start poisoned (every word 0xFFFF: both bytes are e4m3fn NaN), only live tokens' rows are
written, and padded queries are NaN, so a kernel that reads an unwritten slot, a tombstoned page
or a padded query shows NaN.  K/V are written with per-kv-head scales (k_scale != v_scale), so
a kernel that drops or swaps a scale is off by a factor, far outside the tolerances:

* codec: exact (the unpacked bytes are numpy's float8_e4m3fn view of the same memory);
* kernel vs reference on the same fp8 bytes: 2e-5 relative with an f32 query (only summation
  order differs), 1.5e-2 with a bf16 query (q and p are rounded to bf16 for the dots, as the
  bf16 path does);
* fp8 attention vs attention over the unquantised (or bf16) K/V: within 10% of the largest output
  (e4m3 keeps 3 mantissa bits: V alone moves an output by up to 2**-4 = 6% of max |v|, and K's
  rounding shifts the softmax weights; measured 3-5% on these cases).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _kernel_utils import POISON, naive_decode, no_triton_deprecation
from _prefill_utils import abstract_gpu

from umem_jax.memory import MHA, Full, LayerDecl, Part, State, StateGeometry, StateTensor, Window, plan
from umem_jax.memory.declarations import FP8_E4M3, dtype_planes, dtype_words, kv_cache_dtype
from umem_jax.pallas_kernels.kv_write import read_kv_reference, write_kv, write_kv_reference
from umem_jax.pallas_kernels.paged_decode import FP8_DOTS, paged_decode_attention
from umem_jax.pallas_kernels.paged_prefill import DeviceInfo, paged_prefill_attention, prefill_backend
from umem_jax.pallas_kernels.words import (FP8_BITS_SCALE, FP8_MAX, decode_fp8, encode_fp8, unpack_fp8,
                                           unpack_fp8_bits)


def fp8_view(Hkv, D, ps, *, dtype=FP8_E4M3, layer=1):
    """View of full layer `layer` of a plan with 3 full layers and a window layer (rows not at 0)."""
    decls = [LayerDecl(i, (Part(MHA(Hkv, D, dtype=dtype), Full()),)) for i in range(3)]
    decls.append(LayerDecl(3, (Part(MHA(Hkv, D, dtype=dtype), Window(64)),)))
    return plan(decls, page_size=ps).full.kv_view(layer)


def fill(rng, view, lens, P, *, scales, extra_pages=3):
    """Write random K/V for positions [0, len) of every row into a poisoned arena (reference
    writer, fp8 with `scales` = (k_scale, v_scale)) -> (arena, page_table, k, v): k/v the
    written f32 values [B, P*ps, Hkv, D] (the oracle's input before quantisation)."""
    B, ps, Hkv, D = len(lens), view.page_size, view.num_kv_heads, view.head_dim
    num_pages = 1 + B * P + extra_pages
    table = rng.permutation(np.arange(1, num_pages))[:B * P].reshape(B, P).astype(np.int32)
    k = rng.standard_normal((B, P * ps, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, P * ps, Hkv, D)).astype(np.float32)
    pos = [np.arange(n) for n in lens]
    pages = np.concatenate([table[b, p // ps] for b, p in enumerate(pos)]).astype(np.int32)
    slots = np.concatenate([p % ps for p in pos]).astype(np.int32)
    kk = np.concatenate([k[b, p] for b, p in enumerate(pos)])
    vv = np.concatenate([v[b, p] for b, p in enumerate(pos)])
    arena = jnp.full((num_pages * view.rows_per_page, view.row_words), POISON, jnp.uint16)
    kw = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
    arena = write_kv_reference(arena, jnp.asarray(kk), jnp.asarray(vv), jnp.asarray(pages), jnp.asarray(slots),
                               view=view, **kw)
    return arena, jnp.asarray(table), k, v


def close(out, ref, *, tol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(ref).all(), "the reference read a poisoned (NaN) row"
    assert np.isfinite(out).all(), "the kernel read a poisoned (NaN) row"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())))


# --------------------------------------------------------------------------- codec and geometry


def test_codec_is_the_float8_array_in_memory():
    """Every byte pattern unpacks as numpy's float8_e4m3fn reads the same bytes (NaN included);
    encode saturates to +-448, keeps NaN, rounds to nearest, and lays element 2j in the low byte."""
    words = jnp.arange(1 << 16, dtype=jnp.uint32).astype(jnp.uint16)
    even, odd = unpack_fp8(words, jnp.float32)
    as_f8 = np.asarray(words).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1, 2)
    np.testing.assert_array_equal(np.asarray(even), as_f8[:, 0])
    np.testing.assert_array_equal(np.asarray(odd), as_f8[:, 1])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 50
    x[0, :4] = [1e4, -1e4, 449.0, np.nan]
    w = np.asarray(encode_fp8(jnp.asarray(x), 0.5))
    back = w.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(x.shape) * 0.5
    np.testing.assert_array_equal(back[0, :3], [FP8_MAX * 0.5, -FP8_MAX * 0.5, FP8_MAX * 0.5])
    assert np.isnan(back[0, 3])
    ok = np.isfinite(x) & (np.abs(x / 0.5) <= FP8_MAX) & (np.abs(x / 0.5) >= 2.0 ** -6)  # normal e4m3 range
    assert (np.abs(back - x)[ok] <= np.abs(x)[ok] * 2.0 ** -4).all()  # half an ulp of 3 mantissa bits
    np.testing.assert_array_equal(np.asarray(decode_fp8(jnp.asarray(w), 0.5)), back)


def test_geometry_halves_and_state_refuses_fp8():
    bf16, fp8 = MHA(4, 128), MHA(4, 128, dtype=FP8_E4M3)
    assert (fp8.k_words, fp8.v_words) == (bf16.k_words // 2, bf16.v_words // 2) == (256, 256)
    assert fp8.describe() == "MHA 4x128 fp8"
    assert dtype_words("fp8", 10) == 5 and dtype_words("float32", 10) == 20
    with pytest.raises(ValueError, match="only K/V rows may be fp8"):
        dtype_planes("fp8_e4m3")
    fp8_state = Part(StateGeometry((StateTensor("ssm", (4, 8), FP8_E4M3),)), State())
    with pytest.raises(ValueError, match="only K/V rows may be fp8"):
        plan([LayerDecl(0, (Part(MHA(1, 64), Full()),)), LayerDecl(1, (fp8_state,))])
    pb, pf = (plan([LayerDecl(i, (Part(MHA(2, 64, dtype=dt), Full() if i else Window(32)),)) for i in range(3)])
              for dt in ("bfloat16", FP8_E4M3))
    for a, b in zip(pb.subpools, pf.subpools):
        assert b.entry_bytes * 2 == a.entry_bytes and b.page_bytes * 2 == a.page_bytes
    assert "float8 e4m3" in pf.table() and "float8" not in pb.table()
    with pytest.raises(ValueError, match="Store its K/V as bf16"):  # 1 x 8 fp8 values: an 8-byte row
        plan([LayerDecl(i, (Part(MHA(1, 8, dtype=FP8_E4M3), Full() if i else Window(32)),)) for i in range(2)])
    view = pf.full.kv_view(1)
    assert view.fp8 and view.planes == 1 and view.k_words == 64 and (view.mk * view.row_words) == 64
    assert [kv_cache_dtype(n, "float32") for n in ("auto", "fp8", "fp8_e4m3", "bfloat16")] == \
        ["float32", FP8_E4M3, FP8_E4M3, "bfloat16"]
    with pytest.raises(ValueError, match="e5m2 K/V is not supported"):
        kv_cache_dtype("fp8_e5m2")


def test_scales_are_checked():
    view = fp8_view(2, 64, 16)
    arena = jnp.zeros((8 * view.rows_per_page, view.row_words), jnp.uint16)
    k = jnp.ones((3, 2, 64))
    pages, slots = jnp.ones(3, jnp.int32), jnp.arange(3, dtype=jnp.int32)
    with pytest.raises(ValueError, match="one per kv head"):
        write_kv(arena, k, k, pages, slots, view=view, k_scale=jnp.ones(3), impl="reference")
    bf16 = fp8_view(2, 64, 16, dtype="bfloat16")
    with pytest.raises(ValueError, match="apply to fp8 K/V only"):
        write_kv(jnp.zeros((8 * bf16.rows_per_page, bf16.row_words), jnp.uint16), k, k, pages, slots, view=bf16,
                 k_scale=1.0, impl="reference")


# --------------------------------------------------------------------------- KV write


def test_write_kernel_matches_reference_bytes():
    """The Pallas writer (interpret) stores the reference's bytes and leaves every other word of
    the poisoned arena as it was; reading back gives the scaled e4m3 values of the input."""
    view = fp8_view(2, 64, 16)
    rng = np.random.default_rng(1)
    T = 21
    k = jnp.asarray(rng.standard_normal((T, 2, 64)) * 4, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((T, 2, 64)), jnp.float32)
    pages = jnp.asarray(rng.integers(1, 6, T), jnp.int32)
    slots = jnp.asarray(rng.permutation(16 * 5)[:T] % 16, jnp.int32)
    pairs = {(int(p), int(s)) for p, s in zip(pages, slots)}
    if len(pairs) < T:  # distinct (page, slot): redraw deterministically
        flat = rng.permutation(5 * 16)[:T]
        pages, slots = jnp.asarray(1 + flat // 16, jnp.int32), jnp.asarray(flat % 16, jnp.int32)
    ks, vs = jnp.asarray([0.02, 0.5], jnp.float32), jnp.asarray([2.0, 0.125], jnp.float32)
    arena = jnp.full((7 * view.rows_per_page, view.row_words), POISON, jnp.uint16)
    ref = write_kv_reference(arena, k, v, pages, slots, view=view, k_scale=ks, v_scale=vs)
    with no_triton_deprecation():
        out = write_kv(jax.lax.bitcast_convert_type(arena, jnp.bfloat16), k, v, pages, slots, view=view,
                       k_scale=ks, v_scale=vs, impl="pallas", interpret=True)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint16)), np.asarray(ref))
    table = jnp.arange(1, 6, dtype=jnp.int32)[None]
    kr, vr = read_kv_reference(ref, table, view=view, k_scale=ks, v_scale=vs)
    at = (pages - 1) * 16 + slots
    kf = np.asarray(k, np.float32)
    want_k = np.clip(kf / np.asarray(ks)[None, :, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(kr[0, at]), want_k.astype(np.float32) * np.asarray(ks)[None, :, None])
    np.testing.assert_allclose(np.abs(np.asarray(kr[0, at])[:, 0]).max(), FP8_MAX * 0.02, rtol=1e-6)  # saturated
    np.testing.assert_allclose(np.asarray(vr[0, at]), np.asarray(v), rtol=2.0 ** -4, atol=2.0 ** -9 * 2)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("Hkv,G,D,ps,q_dtype,window,softcap,sinks", [
    (2, 4, 64, 16, jnp.float32, 40, 20.0, True),      # every feature, split-K over many blocks
    (1, 8, 256, 32, jnp.bfloat16, None, None, False),  # Gemma 3 270M's shape: one kv head of 256
    (2, 3, 80, 16, jnp.float32, None, None, False),    # G no power of two, a head of 40 words (masked tile)
])
def test_decode_kernel_matches_reference(Hkv, G, D, ps, q_dtype, window, softcap, sinks):
    view = fp8_view(Hkv, D, ps)
    rng = np.random.default_rng(D + G)
    lens = np.array([1, 37, 5 * ps + 3, 0], np.int32)  # one token, partial pages, many pages, padding lane
    P = 6
    ks = jnp.asarray(rng.uniform(0.05, 0.2, Hkv), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.5, 2.0, Hkv), jnp.float32)
    arena, table, k, v = fill(rng, view, lens, P, scales=(ks, vs))
    q = jnp.asarray(rng.standard_normal((len(lens), Hkv * G, D)), q_dtype)
    sk = jnp.asarray(rng.standard_normal(Hkv * G), jnp.float32) if sinks else None
    kw = {"view": view, "window": window, "softcap": softcap, "sinks": sk, "k_scale": ks, "v_scale": vs}
    ref = paged_decode_attention(q, arena, table, jnp.asarray(lens), impl="reference", **kw)
    with no_triton_deprecation():
        out = paged_decode_attention(q, arena, table, jnp.asarray(lens), impl="pallas", interpret=True,
                                     num_splits=3, **kw)
    assert out.dtype == q.dtype
    close(out, ref, tol=2e-5 if q_dtype == jnp.float32 else 1.5e-2)
    # The reference is attention over the dequantised K/V (an independent float64 loop) ...
    kd, vd = read_kv_reference(arena, table, view=view, k_scale=ks, v_scale=vs)
    want = naive_decode(np.asarray(q, np.float32), np.asarray(kd), np.asarray(vd), lens, window=window,
                        softcap=softcap, sinks=None if sk is None else np.asarray(sk))
    close(ref, want, tol=2e-5 if q_dtype == jnp.float32 else 1.5e-2)
    # ... and within e4m3's rounding of attention over the unquantised K/V.
    exact = naive_decode(np.asarray(q, np.float32), k, v, lens, window=window, softcap=softcap,
                         sinks=None if sk is None else np.asarray(sk))
    np.testing.assert_allclose(np.asarray(ref, np.float32), exact, atol=0.1 * np.abs(exact).max())


# --------------------------------------------------------------------------- prefill


def prefill_inputs(rng, view, rows, T, P, q_dtype, G):
    """rows [(prefix, q_len)]: K/V of positions < prefix + q_len written (fp8, per-head scales),
    q [B, T, Hq, D] with NaN past each q_len."""
    Hkv = view.num_kv_heads
    lens = [p + q for p, q in rows]
    ks = jnp.asarray(rng.uniform(0.05, 0.2, Hkv), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.5, 2.0, Hkv), jnp.float32)
    arena, table, _, _ = fill(rng, view, lens, P, scales=(ks, vs))
    q = rng.standard_normal((len(rows), T, Hkv * G, view.head_dim)).astype(np.float32)
    for b, (_, ql) in enumerate(rows):
        q[b, ql:] = np.nan
    q_lens = jnp.asarray([ql for _, ql in rows], jnp.int32)
    return jnp.asarray(q, q_dtype), arena, table, q_lens, jnp.asarray(lens, jnp.int32), ks, vs


@pytest.mark.parametrize("Hkv,G,D,ps,q_dtype,window,softcap,sinks", [
    (2, 4, 64, 16, jnp.float32, 24, 5.0, True),     # grouped tiles, every feature
    (2, 3, 80, 16, jnp.bfloat16, None, None, False),  # flat (query, head) tiles, a 40-word head
])
def test_prefill_kernel_matches_reference(Hkv, G, D, ps, q_dtype, window, softcap, sinks):
    view = fp8_view(Hkv, D, ps)
    rng = np.random.default_rng(D * G)
    rows = [(0, 20), (37, 9), (5, 0)]  # a whole prompt, a chunk after a cached prefix, a padding row
    q, arena, table, q_lens, kv_lens, ks, vs = prefill_inputs(rng, view, rows, 24, 4, q_dtype, G)
    sk = jnp.asarray(rng.standard_normal(Hkv * G) + 1.0, jnp.float32) if sinks else None
    kw = {"view": view, "window": window, "softcap": softcap, "sinks": sk, "k_scale": ks, "v_scale": vs}
    ref = paged_prefill_attention(q, arena, table, q_lens, kv_lens, impl="reference", **kw)
    with no_triton_deprecation():
        out = paged_prefill_attention(q, arena, table, q_lens, kv_lens, impl="pallas", interpret=True,
                                      block_q=8 if G == 4 else None, block_k=16, **kw)
    assert out.dtype == q.dtype
    for b, (_, ql) in enumerate(rows):
        assert (np.asarray(out[b, ql:], np.float32) == 0).all(), "rows past q_len must be 0"
    close(out, ref, tol=2e-5 if q_dtype == jnp.float32 else 1.5e-2)


def test_prefill_backend_takes_mosaic_for_fp8_on_hopper():
    """The Mosaic GPU prefill reads fp8, 1.2x the Triton kernel's fp8 speed on an H100: auto and mgpu
    take it on Hopper (elsewhere auto takes Triton and mgpu refuses), an fp8 view read as bf16 is
    refused."""
    q = jax.ShapeDtypeStruct((1, 128, 8, 128), jnp.bfloat16)
    hopper = DeviceInfo("gpu", "9.0", (0, 11))
    assert prefill_backend(q, fp8_view(2, 128, 16, dtype="bfloat16"), backend="auto", device=hopper) == ("mgpu", "")
    for Hkv, D in ((2, 128), (2, 64), (1, 256), (2, 80)):
        view = fp8_view(Hkv, D, 16)
        qv = jax.ShapeDtypeStruct((1, 128, 4 * Hkv, D), jnp.bfloat16)
        assert prefill_backend(qv, view, backend="auto", device=hopper) == ("mgpu", "")
        assert prefill_backend(qv, view, backend="auto", device=DeviceInfo("cpu", None, (0, 11)))[0] == "triton"
        assert prefill_backend(qv, view, backend="mgpu", device=hopper) == ("mgpu", "")
        assert prefill_backend(qv, view, kv_dtype=jnp.float8_e4m3fn, backend="mgpu", device=hopper) == ("mgpu", "")
    with pytest.raises(NotImplementedError, match="not an NVIDIA GPU"):
        prefill_backend(q, fp8_view(2, 128, 16), backend="mgpu", device=DeviceInfo("cpu", None, (0, 11)))
    with pytest.raises(NotImplementedError, match="kv_dtype"):
        prefill_backend(q, fp8_view(2, 128, 16), kv_dtype=jnp.bfloat16, backend="mgpu", device=hopper)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fp8_kernels_lower_for_cuda():
    """The fp8 decode and prefill bodies (u8 -> e4m3 bitcast, e4m3 -> bf16 convert) lower through
    Pallas' Triton path (lowering errors show on CPU CI; the GPU run compiles them)."""
    view = fp8_view(8, 128, 16)
    sds = jax.ShapeDtypeStruct
    arena = sds((1 << 16, view.row_words), jnp.uint16)
    pt, lens, sc = sds((4, 64), jnp.int32), sds((4,), jnp.int32), sds((8,), jnp.float32)
    dec = lambda q, a, t, n, k, v: paged_decode_attention(q, a, t, n, view=view, k_scale=k, v_scale=v,
                                                          impl="pallas")
    pre = lambda q, a, t, ql, kl, k, v: paged_prefill_attention(q, a, t, ql, kl, view=view, k_scale=k, v_scale=v,
                                                                impl="pallas", backend="triton")
    with abstract_gpu(), no_triton_deprecation():
        txt = jax.jit(dec).trace(sds((4, 32, 128), jnp.bfloat16), arena, pt, lens, sc, sc).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in txt
        txt = jax.jit(pre).trace(sds((4, 256, 32, 128), jnp.bfloat16), arena, pt, lens, lens, sc, sc).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in txt


def test_fp8_attention_tracks_bf16_attention():
    """The same K/V through a bf16 arena and an fp8 arena (scales 1/16, 1/4 per head): decode
    outputs agree within e4m3's rounding (10% of the largest output)."""
    rng = np.random.default_rng(7)
    lens = np.array([50, 90], np.int32)
    outs = []
    for dtype, scales in (("bfloat16", None), (FP8_E4M3, (jnp.asarray([1 / 16, 1 / 4]), jnp.asarray([1 / 4, 1.0])))):
        view = fp8_view(2, 64, 16, dtype=dtype)
        arena, table, _, _ = fill(np.random.default_rng(3), view, lens, 6, scales=scales)
        q = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32) if not outs else outs[0][1]
        kw = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
        outs.append((paged_decode_attention(q, arena, table, jnp.asarray(lens), view=view, impl="reference", **kw), q))
    a, b = (np.asarray(o, np.float32) for o, _ in outs)
    np.testing.assert_allclose(b, a, atol=0.1 * np.abs(a).max())


# --------------------------------------------------------------------------- GPU (compiled kernels)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("Hkv,G,D,ps", [(8, 4, 128, 16), (1, 4, 256, 16), (4, 6, 80, 32)])
def test_gpu_fp8_kernels_match_reference(Hkv, G, D, ps):
    """The compiled Triton kernels (no interpret) on fp8 arenas: decode (split-K, window,
    softcap) and prefill (default tiling, backend auto: Triton, which auto keeps for fp8 until the
    Mosaic fp8 path is measured; that one is tests/gpu/test_prefill_gpu.py's)."""
    view = fp8_view(Hkv, D, ps)
    rng = np.random.default_rng(Hkv * D)
    ks = jnp.asarray(rng.uniform(0.05, 0.2, Hkv), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.5, 2.0, Hkv), jnp.float32)
    lens = np.array([1000, 1, 513, 0, 64, 777, 300, 999], np.int32)
    P = -(-int(lens.max()) // ps)
    arena, table, _, _ = fill(rng, view, lens, P, scales=(ks, vs))
    arena = jax.lax.bitcast_convert_type(arena, jnp.bfloat16)  # as the engine allocates it
    q = jnp.asarray(rng.standard_normal((len(lens), Hkv * G, D)), jnp.bfloat16)
    kw = {"view": view, "window": 200, "softcap": 30.0, "k_scale": ks, "v_scale": vs}
    ref = paged_decode_attention(q, arena, table, jnp.asarray(lens), impl="reference", **kw)
    for fp8_dot in FP8_DOTS:  # every way the tiles reach the dots, inline PTX included
        out = jax.jit(lambda q, a, d=fp8_dot: paged_decode_attention(q, a, table, jnp.asarray(lens), impl="pallas",
                                                                     fp8_dot=d, **kw))(q, arena)
        close(out, ref, tol=1.5e-2)
    rows = [(0, 512), (488, 24), (1, 0)]
    qp, arena_p, table_p, q_lens, kv_lens, ks, vs = prefill_inputs(rng, view, rows, 512, -(-512 // ps), jnp.bfloat16,
                                                                    G)
    kw = {"view": view, "k_scale": ks, "v_scale": vs}
    ref = paged_prefill_attention(qp, arena_p, table_p, q_lens, kv_lens, impl="reference", **kw)
    out = paged_prefill_attention(qp, arena_p, table_p, q_lens, kv_lens, impl="pallas", backend="auto", **kw)
    close(out, ref, tol=1.5e-2)


def test_bit_unpack_is_exact_for_every_word():
    """unpack_fp8_bits (integer ops to f16, times 2**-8) equals the convert path on all 65,536
    words but the NaN bytes (0x7f / 0xff), which the writer never stores."""
    words = jnp.arange(1 << 16, dtype=jnp.int32).astype(jnp.uint16)
    even, odd = unpack_fp8(words, jnp.float32)
    be, bo = (np.asarray(x, np.float32) * FP8_BITS_SCALE for x in unpack_fp8_bits(words))
    w = np.arange(1 << 16)
    finite_lo, finite_hi = (w & 0x7F) != 0x7F, ((w >> 8) & 0x7F) != 0x7F
    np.testing.assert_array_equal(be[finite_lo], np.asarray(even)[finite_lo])
    np.testing.assert_array_equal(bo[finite_hi], np.asarray(odd)[finite_hi])


@pytest.mark.parametrize("fp8_dot", ["bits", "f16", "bf16", "asm"])
def test_decode_fp8_dot_modes_match_reference(fp8_dot):
    """Each way the kernel turns fp8 tiles into dot operands (bf16 query) against the reference:
    window, soft-cap, sinks, per-head scales, G = 3 and a 40-word head (masked tile)."""
    Hkv, G, D, ps = 2, 3, 80, 16
    view = fp8_view(Hkv, D, ps)
    rng = np.random.default_rng(7)
    lens = np.array([1, 37, 5 * ps + 3, 0], np.int32)
    ks = jnp.asarray(rng.uniform(0.05, 0.2, Hkv), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.5, 2.0, Hkv), jnp.float32)
    arena, table, _, _ = fill(rng, view, lens, 6, scales=(ks, vs))
    q = jnp.asarray(rng.standard_normal((len(lens), Hkv * G, D)), jnp.bfloat16)
    sk = jnp.asarray(rng.standard_normal(Hkv * G), jnp.float32)
    kw = {"view": view, "window": 40, "softcap": 20.0, "sinks": sk, "k_scale": ks, "v_scale": vs}
    ref = paged_decode_attention(q, arena, table, jnp.asarray(lens), impl="reference", **kw)
    with no_triton_deprecation():
        out = paged_decode_attention(q, arena, table, jnp.asarray(lens), impl="pallas", interpret=True,
                                     num_splits=3, fp8_dot=fp8_dot, **kw)
    assert out.dtype == q.dtype
    close(out, ref, tol=1.5e-2)
    with pytest.raises(ValueError, match="fp8_dot"):
        paged_decode_attention(q, arena, table, jnp.asarray(lens), impl="pallas", interpret=True, fp8_dot="e5m2", **kw)
