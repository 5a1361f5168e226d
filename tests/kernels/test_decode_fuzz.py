"""paged_decode_attention (Pallas, interpret mode) against its reference, and the reference against
the float64 numpy loop, on hypothesis-drawn cases that mix what the fixed cases of
test_paged_decode.py / test_fp8_kv.py take one at a time: any listed GQA ratio (up to 16), page
sizes down to 8 (below the 16-token block), fp8 K/V with per-head scales, fp16 / bf16 / f32
queries, ragged lengths with length-1 rows and padding lanes, windows smaller and larger than the
context, softcap, sinks and split-K.  Arenas start poisoned (NaN words), so a read outside a row's
visible range, or an output element nobody wrote, shows up as NaN."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from _kernel_utils import fill_kv, make_view, naive_decode, no_triton_deprecation, poisoned_arena, random_page_tables
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fp8_kv import fill, fp8_view

from umem_jax.pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

Q_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


@st.composite
def cases(draw):
    P, ps = draw(st.integers(1, 3)), draw(st.sampled_from([8, 16, 32]))
    B = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(0, P * ps), min_size=B, max_size=B))
    lengths[0] = max(lengths[0], 1)
    return dict(
        G=draw(st.sampled_from([1, 2, 3, 5, 6, 7, 8, 16])), D=draw(st.sampled_from([64, 80, 96, 128])),
        Hkv=draw(st.integers(1, 2)), ps=ps, P=P, lengths=lengths, kind=draw(st.sampled_from(["bf16", "fp32", "fp8"])),
        q=draw(st.sampled_from(sorted(Q_DTYPES))),
        window=draw(st.one_of(st.none(), st.integers(1, P * ps + 4))),
        softcap=draw(st.sampled_from([None, 5.0])), sinks=draw(st.booleans()),
        num_splits=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_decode_kernel_matches_reference_and_naive(c):
    rng = np.random.default_rng(c["seed"])
    Hkv, G, D, ps, P, lengths = c["Hkv"], c["G"], c["D"], c["ps"], c["P"], np.asarray(c["lengths"], np.int32)
    B, window = len(lengths), c["window"]
    extra = {}
    if c["kind"] == "fp8":
        view = fp8_view(Hkv, D, ps)
        ks, vs = (jnp.asarray(rng.uniform(0.5, 2.0, Hkv), jnp.float32) for _ in range(2))
        arena, pt, _, _ = fill(rng, view, lengths, P, scales=(ks, vs))
        pt = np.array(pt)
        extra = dict(k_scale=ks, v_scale=vs)
    else:
        view = make_view(Hkv, D, None, ps, layers=2, layer=1, planes=2 if c["kind"] == "fp32" else 1)
        arena = poisoned_arena((B * P + 3) * view.rows_per_page, view.row_words)
        pt = random_page_tables(rng, B, P, 1, B * P + 3)
        arena, k, v = fill_kv(arena, view, pt, lengths, rng)
    for b, n in enumerate(lengths.tolist()):
        pt[b, -(-n // ps):] = 0                                        # unmapped: the (poisoned) sink
        if window is not None:
            pt[b, :max(0, n - window) // ps] = 0                        # slid out of the window: tombstoned
    q = jnp.asarray(rng.standard_normal((B, Hkv * G, D)), Q_DTYPES[c["q"]])
    sinks = jnp.asarray(rng.standard_normal(Hkv * G) * 2, jnp.float32) if c["sinks"] else None
    kw = dict(view=view, window=window, softcap=c["softcap"], sinks=sinks, **extra)
    args = (q, arena, jnp.asarray(pt), jnp.asarray(lengths))
    with no_triton_deprecation():
        got = paged_decode_attention(*args, impl="pallas", interpret=True, num_splits=c["num_splits"],
                                     block_tokens=16, **kw)
    ref = paged_decode_attention_reference(*args, **kw)
    assert got.shape == (B, Hkv * G, D) and got.dtype == q.dtype
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(ref).all() and np.isfinite(got).all()
    exact = c["kind"] == "fp32" and c["q"] == "f32"
    tol = 1e-4 if exact else 2e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())))
    np.testing.assert_array_equal(got[lengths == 0], 0.0)
    if c["kind"] != "fp8":  # the reference's math against the float64 loop, on the stored K/V
        want = naive_decode(np.asarray(q.astype(jnp.float32)), k, v, lengths, window=window, softcap=c["softcap"],
                            sinks=None if sinks is None else np.asarray(sinks))
        np.testing.assert_allclose(ref, want, rtol=tol, atol=tol)
