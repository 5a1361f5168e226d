"""paged_decode_attention: the Pallas kernel (interpret mode) against the plain-JAX reference, and
the reference against an independent float64 numpy loop.

Every arena starts as NaN words (POISON); only positions [0, len) of each row are written, so a
read of a sink/tombstoned page, of a slot past the length, or of anything before the window
turns the output NaN.  Page tables hold distinct pages in random order, padded with the sink 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import (
    cuda_lowering,
    fill_kv,
    make_view,
    naive_decode,
    no_triton_deprecation,
    poisoned_arena,
    random_page_tables,
)

from umem_jax.pallas_kernels.paged_decode import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)


def _setup(seed, *, Hkv, G, D, ps, P, lengths, planes=1, window=None, row_words=None, arena_dtype=jnp.uint16,
           q_dtype=jnp.float32, sinks=False, Dv=None):
    rng = np.random.default_rng(seed)
    view = make_view(Hkv, D, Dv, ps, layers=2, layer=1, planes=planes, row_words=row_words)
    B = len(lengths)
    lengths = np.asarray(lengths, np.int32)
    npages = B * P + 3
    arena = poisoned_arena(npages * view.rows_per_page, view.row_words, arena_dtype)
    pt = random_page_tables(rng, B, P, 1, npages)
    need = -(-lengths // ps)
    for b in range(B):
        pt[b, need[b]:] = 0                                   # unmapped: sink padding
    arena, k, v = fill_kv(arena, view, pt, lengths, rng)
    if window is not None:                                    # pages wholly before the window: tombstoned
        for b in range(B):
            first_visible = max(0, int(lengths[b]) - window) // ps
            pt[b, :first_visible] = 0
    q = jnp.asarray(rng.standard_normal((B, Hkv * G, D)), q_dtype)
    sk = jnp.asarray(rng.standard_normal(Hkv * G) * 2, jnp.float32) if sinks else None
    return view, arena, jnp.asarray(pt), jnp.asarray(lengths), q, sk, k, v


CASES = {
    # name: (setup kwargs, call kwargs)
    "mha_d64_ps16_short_and_empty": (dict(Hkv=2, G=1, D=64, ps=16, P=4, lengths=[1, 16, 37, 0]), {}),
    "gqa4_d128_ps32_window_midpage_softcap": (
        dict(Hkv=2, G=4, D=128, ps=32, P=4, lengths=[100, 33, 41, 7], window=40), dict(window=40, softcap=5.0)),
    "gqa8_d256_ps64_sinks_bf16arena": (
        dict(Hkv=1, G=8, D=256, ps=64, P=3, lengths=[130, 64, 1], sinks=True, arena_dtype=jnp.bfloat16), {}),
    "splitk_many_pages": (dict(Hkv=1, G=4, D=64, ps=16, P=16, lengths=[256, 200, 17]),
                          dict(block_tokens=32, num_splits=3)),
    "rows_narrower_than_k_mk4": (dict(Hkv=4, G=2, D=64, ps=16, P=3, lengths=[48, 20], row_words=64),
                                 dict(window=30)),
    "block_smaller_than_page": (dict(Hkv=2, G=4, D=32, ps=64, P=3, lengths=[150, 64, 3], window=70),
                                dict(window=70, block_tokens=16, num_splits=2)),
    "bf16_q_and_out_window_crosses_pages": (
        dict(Hkv=2, G=4, D=64, ps=16, P=6, lengths=[90, 50], window=37, q_dtype=jnp.bfloat16, sinks=True),
        dict(window=37, block_tokens=16)),
}


# Any GQA ratio and head dim (issue 15): G in {1, 3, 5, 6, 7} x D in {64, 80, 96, 128, 256}, a
# covering subset.  Padded q heads / head dims must neither read the arena past a head's words
# (poisoned neighbours would turn the output NaN) nor leak into the output.
GQA_CASES = {
    "g3_d80_window_sinks": (dict(Hkv=2, G=3, D=80, ps=16, P=4, lengths=[50, 1, 33, 0], window=20, sinks=True),
                            dict(window=20)),
    "g5_d96_softcap_splitk": (dict(Hkv=1, G=5, D=96, ps=16, P=6, lengths=[90, 17]),
                              dict(softcap=5.0, block_tokens=16, num_splits=3)),
    "g6_d128_sinks_bf16arena": (dict(Hkv=2, G=6, D=128, ps=32, P=3, lengths=[70, 32, 5], sinks=True,
                                     arena_dtype=jnp.bfloat16), {}),
    "g7_d64_window_crosses_pages": (dict(Hkv=2, G=7, D=64, ps=16, P=5, lengths=[75, 40], window=37, sinks=True),
                                    dict(window=37, block_tokens=16)),
    "g3_d256": (dict(Hkv=1, G=3, D=256, ps=16, P=3, lengths=[40, 9]), {}),
    "g1_d80_mha": (dict(Hkv=4, G=1, D=80, ps=16, P=3, lengths=[35, 16]), {}),
    # rows narrower than a K row (row_words = D, mk = Hkv): the column of head h is traced.
    "g6_d80_rows_of_one_head": (dict(Hkv=2, G=6, D=80, ps=16, P=3, lengths=[40, 21], row_words=80), dict(window=30)),
    "g6_d96_fp32_planes": (dict(Hkv=2, G=6, D=96, ps=16, P=3, lengths=[44, 3], planes=2, sinks=True),
                           dict(window=25, softcap=4.0, block_tokens=16)),
}


FP32_CASES = {
    "fp32_window_softcap_sinks": (dict(Hkv=2, G=4, D=64, ps=16, P=4, lengths=[50, 1, 17, 0], planes=2, window=20,
                                       sinks=True), dict(window=20, softcap=3.0, block_tokens=32)),
    "fp32_mha_splitk_dv": (dict(Hkv=2, G=1, D=32, Dv=64, ps=16, P=5, lengths=[80, 65], planes=2),
                           dict(block_tokens=16, num_splits=2, scale=0.3)),
}


ALL_CASES = {**CASES, **GQA_CASES, **FP32_CASES}


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_pallas_matches_reference(name):
    """bf16 K/V within 1e-2 of the reference, fp32 planes (IEEE dots) within 1e-5."""
    setup, call = ALL_CASES[name]
    view, arena, pt, lengths, q, sk, _, _ = _setup(hash(name) % 2**31, **setup)
    tuning = {k: call[k] for k in ("block_tokens", "num_splits") if k in call}
    opts = {k: v for k, v in call.items() if k not in tuning}
    with no_triton_deprecation():
        got = paged_decode_attention(q, arena, pt, lengths, view=view, sinks=sk, impl="pallas", interpret=True,
                                     **opts, **tuning)
    ref = paged_decode_attention_reference(q, arena, pt, lengths, view=view, sinks=sk, **opts)
    assert got.shape == (q.shape[0], q.shape[1], view.v_head_dim) and got.dtype == q.dtype
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(ref).all() and np.isfinite(got).all()
    tol = 1e-5 if view.planes == 2 else 1e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[np.asarray(lengths) == 0], 0.0)


@pytest.mark.parametrize("name", ["g3_d80_window_sinks", "g6_d128_sinks_bf16arena",
                                  "gqa4_d128_ps32_window_midpage_softcap"])
def test_no_xla_op_pads_q_before_the_kernel(name):
    """The kernel loads its G query rows (and a head dim that is no power of two) masked, so the
    compiled step has no pad of q before it: one XLA launch fewer per attention layer on a GPU.
    Traced only (the GPU lowering's jaxpr: interpret=False), so it runs on any backend."""
    setup, call = ALL_CASES[name]
    view, arena, pt, lengths, q, sk, _, _ = _setup(7, **setup)
    opts = {k: v for k, v in call.items() if k in ("window", "softcap")}
    jaxpr = str(jax.make_jaxpr(lambda q, a: paged_decode_attention(q, a, pt, lengths, view=view, sinks=sk,
                                                                   impl="pallas", **opts))(q, arena))
    before = jaxpr.split("pallas_call[")[0]
    assert jaxpr.count("pallas_call[") == 1 and " pad[" not in before


@pytest.mark.parametrize("name", ["gqa4_d128_ps32_window_midpage_softcap", "gqa8_d256_ps64_sinks_bf16arena",
                                  "rows_narrower_than_k_mk4", "g3_d80_window_sinks", "g5_d96_softcap_splitk"])
def test_reference_matches_naive_loop(name):
    setup, call = ALL_CASES[name]
    setup = dict(setup, planes=2, arena_dtype=jnp.uint16, q_dtype=jnp.float32)  # exact fp32 K/V
    view, arena, pt, lengths, q, sk, k, v = _setup(1, **setup)
    opts = {kk: vv for kk, vv in call.items() if kk in ("window", "softcap")}
    ref = paged_decode_attention_reference(q, arena, pt, lengths, view=view, sinks=sk, **opts)
    want = naive_decode(q, k, v, lengths, sinks=None if sk is None else np.asarray(sk), **opts)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)


def test_fp32_reference_matches_naive_with_everything():
    setup, call = FP32_CASES["fp32_window_softcap_sinks"]
    view, arena, pt, lengths, q, sk, k, v = _setup(5, **setup)
    ref = paged_decode_attention_reference(q, arena, pt, lengths, view=view, sinks=sk, window=20, softcap=3.0)
    want = naive_decode(q, k, v, lengths, window=20, softcap=3.0, sinks=np.asarray(sk))
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)


def test_default_splits_and_impl():
    # B * Hkv already fills 132 SMs several times: one split; a few long rows: many splits.
    assert choose_num_splits(64, 8, 32, num_sms=132) == 2
    assert choose_num_splits(8, 8, 256, num_sms=132) == 9
    assert choose_num_splits(1, 1, 3, num_sms=132) == 1
    assert choose_num_splits(512, 8, 256, num_sms=132) == 1
    view, arena, pt, lengths, q, sk, _, _ = _setup(3, Hkv=1, G=1, D=16, ps=4, P=2, lengths=[5])
    got = np.asarray(paged_decode_attention(q, arena, pt, lengths, view=view), np.float32)
    ref = np.asarray(paged_decode_attention_reference(q, arena, pt, lengths, view=view), np.float32)
    if jax.default_backend() == "gpu":  # the default impl there is the Pallas kernel (bf16 K/V)
        np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2)
    else:  # elsewhere the reference itself
        np.testing.assert_array_equal(got, ref)


def test_shape_checks():
    view = make_view(2, 16, 16, 4)
    arena = jnp.zeros((8 * view.rows_per_page, view.row_words), jnp.uint16)
    pt = jnp.zeros((2, 2), jnp.int32)
    ln = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode_attention(jnp.zeros((2, 3, 16)), arena, pt, ln, view=view, impl="reference")
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention(jnp.zeros((2, 4, 16)), arena, pt[:1], ln, view=view, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(jnp.zeros((2, 4, 16)), arena, pt, ln, view=view, sinks=jnp.zeros(3), impl="reference")
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(jnp.zeros((2, 4, 16)), arena, pt, ln, view=view, window=0, impl="reference")
    with pytest.raises(NotImplementedError, match="inside one arena row"):  # a head over two rows
        v48 = make_view(1, 48, 48, 4, row_words=16)
        a48 = jnp.zeros((8 * v48.rows_per_page, v48.row_words), jnp.uint16)
        paged_decode_attention(jnp.zeros((2, 1, 48)), a48, pt, ln, view=v48, impl="pallas", interpret=True)


@pytest.mark.parametrize("planes,D,ps,G", [(1, 128, 16, 4), (1, 256, 64, 8), (2, 64, 32, 1), (1, 80, 16, 6),
                                           (1, 96, 32, 3), (2, 80, 16, 5)])
def test_lowers_for_cuda_above_4gib(planes, D, ps, G):
    view = make_view(8, D, D, ps, layers=4, layer=3, planes=planes)
    a = jax.ShapeDtypeStruct((2**33 // (2 * view.row_words) + 64, view.row_words), jnp.uint16)   # > 8 GiB
    B, P = 16, 64
    q = jax.ShapeDtypeStruct((B, 8 * G, D), jnp.bfloat16)
    pt = jax.ShapeDtypeStruct((B, P), jnp.int32)
    ln = jax.ShapeDtypeStruct((B,), jnp.int32)
    sk = jax.ShapeDtypeStruct((8 * G,), jnp.float32)
    f = lambda q, a, pt, ln, sk: paged_decode_attention(q, a, pt, ln, view=view, sinks=sk, window=100, softcap=20.0,
                                                        impl="pallas")
    with no_triton_deprecation():
        txt = cuda_lowering(f, q, a, pt, ln, sk)
    if txt is None:
        pytest.skip("this jax cannot cross-lower Pallas Triton for CUDA without a GPU")
    assert "__gpu$xla.gpu.triton" in txt
