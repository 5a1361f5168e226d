"""GPU-only: every arena kernel (Pallas, Triton lowering, compiled for the GPU) against its
plain-JAX reference on the GPU, including an arena over 4 GiB with pages at its top end, and the
in-place checks (aliasing, buffer pointer, no whole-arena copy).

Skipped on CPU (conftest: `gpu` marker).  Run: python -m pytest -q tests/gpu/test_kernels_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import decode_case, make_view, random_words

from umem_jax.pallas_kernels.kv_write import read_kv_reference, write_kv, write_kv_reference
from umem_jax.pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from umem_jax.pallas_kernels.relocate import move_pages, move_pages_reference, zero_pages, zero_pages_reference

BIG_BYTES = 4 << 30  # the "over 4 GiB" arena is this + 64 MiB (smaller only for CPU dry runs of the logic)

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:.*Pallas Triton.*:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


DECODE = [
    # (G, D, ps, planes, window, softcap, sinks)
    (1, 128, 16, 1, None, None, False),
    (4, 128, 16, 1, None, None, False),
    (8, 128, 32, 1, None, None, True),
    (4, 64, 64, 1, 200, None, False),
    (4, 256, 16, 1, None, 30.0, False),
    (8, 64, 16, 1, 128, 50.0, True),
    (4, 128, 16, 2, 300, 20.0, True),   # fp32 planes
]


@pytest.mark.parametrize("G,D,ps,planes,window,softcap,sinks", DECODE)
def test_decode_matches_reference(G, D, ps, planes, window, softcap, sinks):
    view, arena, pt, ln, q = decode_case(G * 1000 + D + ps, B=8, Hkv=4, G=G, D=D, ps=ps, ctx_max=1500,
                                          planes=planes, window=window)
    sk = jnp.asarray(np.random.default_rng(0).standard_normal(q.shape[1]) * 2, jnp.float32) if sinks else None
    kw = dict(view=view, window=window, softcap=softcap, sinks=sk)
    got = jax.jit(lambda q, a, p, l: paged_decode_attention(q, a, p, l, impl="pallas", **kw))(q, arena, pt, ln)
    ref = jax.jit(lambda q, a, p, l: paged_decode_attention_reference(q, a, p, l, **kw))(q, arena, pt, ln)
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(ref).all() and np.isfinite(got).all()
    tol = 1e-5 if planes == 2 else 1e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[np.asarray(ln) == 0], 0.0)


# Any GQA ratio and head dim (issue 15): G = 3, 5, 6, 7 and D = 80, 96 compiled for the GPU (Triton
# needs power-of-two tiles, which interpret mode does not check): padded q heads, 128-wide tiles
# with the columns past the head masked off the loads.
GQA_DECODE = [
    # (G, D, ps, planes, window, softcap, sinks)
    (3, 80, 16, 1, None, None, True),
    (6, 96, 32, 1, 200, None, True),
    (6, 128, 16, 1, None, None, False),
    (5, 80, 16, 1, 128, 30.0, False),
    (7, 64, 64, 1, None, None, True),
    (3, 96, 16, 2, 300, 20.0, True),    # fp32 planes
]


@pytest.mark.parametrize("G,D,ps,planes,window,softcap,sinks", GQA_DECODE,
                         ids=[f"gqa_g{c[0]}_d{c[1]}_p{c[3]}" for c in GQA_DECODE])
def test_decode_gqa_ratios_and_head_dims(G, D, ps, planes, window, softcap, sinks):
    test_decode_matches_reference(G, D, ps, planes, window, softcap, sinks)


@pytest.mark.parametrize("num_splits,block_tokens", [(1, 128), (7, 64), (32, 256), (None, None)])
def test_decode_splits_and_blocks(num_splits, block_tokens):
    view, arena, pt, ln, q = decode_case(11, B=4, Hkv=8, G=4, D=128, ps=16, ctx_max=4000, min_len=1)
    tune = {k: v for k, v in dict(num_splits=num_splits, block_tokens=block_tokens).items() if v is not None}
    got = paged_decode_attention(q, arena, pt, ln, view=view, impl="pallas", **tune)
    ref = paged_decode_attention_reference(q, arena, pt, ln, view=view)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)


def test_write_kv_matches_reference_bf16_and_fp32():
    rng = np.random.default_rng(3)
    for planes, adt in ((1, jnp.uint16), (2, jnp.bfloat16), (1, jnp.bfloat16)):
        view = make_view(8, 128, 128, 16, layers=3, layer=1, planes=planes)
        arena = random_words(rng, (300 * view.rows_per_page, view.row_words), adt)
        T = 1000
        pos = rng.permutation(299 * 16)[:T]
        pages, slots = jnp.asarray(1 + pos // 16, jnp.int32), jnp.asarray(pos % 16, jnp.int32)
        vdt = jnp.float32 if planes == 2 else jnp.bfloat16
        k = jnp.asarray(rng.standard_normal((T, 8, 128)), vdt)
        v = jnp.asarray(rng.standard_normal((T, 8, 128)), vdt)
        got = write_kv(arena, k, v, pages, slots, view=view, impl="pallas")
        ref = write_kv_reference(arena, k, v, pages, slots, view=view)
        assert bool(jnp.array_equal(jax.lax.bitcast_convert_type(got, jnp.uint16),
                                    jax.lax.bitcast_convert_type(ref, jnp.uint16)))


@pytest.mark.parametrize("page_bytes", [16 << 10, 1 << 20, 24 << 10])
def test_move_and_zero_match_reference(page_bytes):
    W = 1024
    rpp = page_bytes // (2 * W)
    rng = np.random.default_rng(page_bytes)
    npages = 64
    arena = random_words(rng, (npages * rpp + 5, W), jnp.bfloat16)
    perm = rng.permutation(np.arange(1, npages)).astype(np.int32)
    src, dst = jnp.asarray(np.r_[perm[:20], 0, 0]), jnp.asarray(np.r_[perm[20:40], 0, 0])
    u = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))
    np.testing.assert_array_equal(u(move_pages(arena, src, dst, rows_per_page=rpp, impl="pallas")),
                                  u(move_pages_reference(arena, src, dst, rows_per_page=rpp)))
    np.testing.assert_array_equal(u(zero_pages(arena, dst, rows_per_page=rpp, impl="pallas")),
                                  u(zero_pages_reference(arena, dst, rows_per_page=rpp)))


def test_in_place_pointer_and_no_copy():
    W, rpp = 1024, 64
    n_rows = 4096 * rpp                      # 512 MiB
    arena = jnp.zeros((n_rows, W), jnp.uint16)
    src, dst = jnp.arange(1, 9, dtype=jnp.int32), jnp.arange(100, 108, dtype=jnp.int32)
    f = jax.jit(lambda a, s, d: move_pages(a, s, d, rows_per_page=rpp, impl="pallas"), donate_argnums=0)
    c = f.lower(arena, src, dst).compile()
    m = c.memory_analysis()
    assert m.alias_size_in_bytes >= n_rows * W * 2
    assert m.temp_size_in_bytes < n_rows * W * 2 // 16
    assert not [l for l in c.as_text().splitlines() if " copy(" in l and f"[{n_rows},{W}]" in l]
    p0 = arena.unsafe_buffer_pointer()
    arena = f(arena, src, dst)
    assert arena.unsafe_buffer_pointer() == p0

    # one decode step: write K/V (aliased) then attend over the new arena, all donated
    view = make_view(8, 128, 128, 16, layers=2, layer=1)
    a2 = jnp.zeros((2000 * view.rows_per_page, view.row_words), jnp.uint16)
    B = 8
    q = jnp.ones((B, 32, 128), jnp.bfloat16)
    kv = jnp.ones((B, 8, 128), jnp.bfloat16)
    pt = jnp.arange(1, 1 + B * 16, dtype=jnp.int32).reshape(B, 16)
    ln = jnp.full((B,), 200, jnp.int32)

    def step(a, q, k, v, pt, ln):
        pos = ln - 1
        a = write_kv(a, k, v, pt[jnp.arange(B), pos // 16], pos % 16, view=view, impl="pallas")
        return a, paged_decode_attention(q, a, pt, ln, view=view, impl="pallas")

    c = jax.jit(step, donate_argnums=0).lower(a2, q, kv, kv, pt, ln).compile()
    m = c.memory_analysis()
    assert m.alias_size_in_bytes >= a2.nbytes
    assert m.temp_size_in_bytes < a2.nbytes // 8
    # and the step computes what the references compute on the same arena
    pos = ln - 1
    a_ref = write_kv_reference(jnp.zeros_like(a2), kv, kv, pt[jnp.arange(B), pos // 16], pos % 16, view=view)
    o_ref = np.asarray(paged_decode_attention_reference(q, a_ref, pt, ln, view=view), np.float32)
    del a_ref
    _, o = c(a2, q, kv, kv, pt, ln)
    np.testing.assert_allclose(np.asarray(o, np.float32), o_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("arena_dtype", [jnp.uint16, jnp.bfloat16])
def test_above_4gib_pages_at_the_top(arena_dtype):
    """Arena of 4 GiB + 64 MiB: move, zero, write and decode pages whose rows lie above 4 GiB."""
    view = make_view(8, 128, 128, 16, layers=2, layer=1)        # 64 rows x 2 KiB = 128 KiB pages
    rpp, W = view.rows_per_page, view.row_words
    npages = BIG_BYTES // (rpp * W * 2) + 512
    top = npages - 1
    arena = jax.jit(lambda: jnp.zeros((npages * rpp, W), arena_dtype))()
    assert arena.nbytes > BIG_BYTES
    rng = np.random.default_rng(0)

    # write K/V for 3 requests into pages at the very top, in random order
    B, P = 3, 8
    pt = np.array(rng.permutation(np.arange(top - B * P + 1, top + 1))).reshape(B, P).astype(np.int32)
    lengths = np.array([128, 77, 1], np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths])
    rows = np.repeat(np.arange(B), lengths)
    T = pos.size
    k = jnp.asarray(rng.standard_normal((T, 8, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((T, 8, 128)), jnp.bfloat16)
    pages = jnp.asarray(pt[rows, pos // 16])
    slots = jnp.asarray(pos % 16, jnp.int32)
    arena = jax.jit(lambda a: write_kv(a, k, v, pages, slots, view=view, impl="pallas"), donate_argnums=0)(arena)
    kr, vr = read_kv_reference(arena, jnp.asarray(pt), view=view)
    for b in range(B):
        sel = rows == b
        np.testing.assert_array_equal(np.asarray(kr[b, :lengths[b]]), np.asarray(k[sel]))
        np.testing.assert_array_equal(np.asarray(vr[b, :lengths[b]]), np.asarray(v[sel]))

    q = jnp.asarray(rng.standard_normal((B, 32, 128)), jnp.bfloat16)
    got = paged_decode_attention(q, arena, jnp.asarray(pt), jnp.asarray(lengths), view=view, impl="pallas")
    ref = paged_decode_attention_reference(q, arena, jnp.asarray(pt), jnp.asarray(lengths), view=view)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)

    # move the top pages down and some low pages up; everything else stays as it was
    src = np.r_[pt.reshape(-1)[:12], np.arange(1, 5)].astype(np.int32)
    dst = np.r_[np.arange(10, 22), np.arange(top - 40, top - 36)].astype(np.int32)
    before = jax.lax.bitcast_convert_type(arena, jnp.uint16) if arena_dtype != jnp.uint16 else arena.copy()
    moved = jax.jit(lambda a: move_pages(a, jnp.asarray(src), jnp.asarray(dst), rows_per_page=rpp, impl="pallas"),
                    donate_argnums=0)(arena)
    after = jax.lax.bitcast_convert_type(moved, jnp.uint16) if arena_dtype != jnp.uint16 else moved
    for s, d in zip(src, dst):
        assert bool(jnp.array_equal(after[d * rpp:(d + 1) * rpp], before[s * rpp:(s + 1) * rpp])), (s, d)
    same_row = np.asarray(jnp.all(after == before, axis=1))
    changed = np.zeros(npages * rpp, bool)
    for d in dst:
        changed[d * rpp:(d + 1) * rpp] = True
    assert same_row[~changed].all()
    del before, after

    zeroed = jax.jit(lambda a: zero_pages(a, jnp.asarray([top, top - 1], jnp.int32), rows_per_page=rpp,
                                          impl="pallas"), donate_argnums=0)(moved)
    assert not bool(jnp.any(jax.lax.bitcast_convert_type(zeroed[(top - 1) * rpp:], jnp.uint16)
                            if arena_dtype != jnp.uint16 else zeroed[(top - 1) * rpp:]))
