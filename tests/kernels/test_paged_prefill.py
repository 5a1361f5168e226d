"""paged_prefill_attention: Pallas kernel (interpret mode) vs the plain-JAX reference, the reference
vs dense attention on the same tokens, and a CUDA cross-lowering check of the Triton kernel.

Every test arena starts poisoned (all words 0xFFFF: NaN as bf16 and as an fp32 hi/lo pair); only
the rows of live tokens are written, tombstoned pages are poisoned again, and padded q rows are
NaN, so any read of an unmapped/tombstoned page, an unwritten slot or a padded query shows up as
NaN in the output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _prefill_utils import abstract_gpu, assert_close, kv_view, make_case, prefill_case

from umem_jax.pallas_kernels.paged_prefill import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_config,
)

CASES = [
    # prefix 0 / partial page / many pages; chunk of 1; chunks crossing pages; padding rows
    # (q_len 0 with and without cache); BK > page size (gathers rows of 2 pages per block).
    ("bf16_gqa4_p16", 2, 4, 64, 16, False, None, None, False, None, 8, 32, 24, 6,
     [(0, 20), (7, 1), (40, 9), (0, 0), (5, 0)], {}),
    # fp32 planes, MHA, BK < page size (one page per block), explicit scale.
    ("f32_mha_p32", 2, 1, 64, 32, True, None, None, False, 0.3, 16, 16, 16, 4,
     [(0, 16), (33, 16), (70, 3)], {}),
    # GQA 8, head_dim 128, window starting mid-page, tombstoned pages, chunk shorter than the
    # window, chunk longer than the window, decode-like chunk of 1.
    ("bf16_gqa8_window_tomb", 1, 8, 128, 16, False, 24, None, False, None, 4, 16, 32, 9,
     [(0, 20), (50, 5), (37, 30), (100, 1)], {"tombstone": True}),
    # softcap + sinks, page 64 (BK < page), GQA 4.
    ("bf16_softcap_sinks_p64", 2, 4, 64, 64, False, None, 5.0, True, 0.2, 4, 32, 16, 4,
     [(0, 12), (60, 10), (130, 16)], {}),
    # every feature at fp32 tolerance: window + softcap + sinks + tombstones, BK == page.
    ("f32_all_features", 2, 4, 64, 16, True, 10, 3.0, True, None, 4, 16, 16, 5,
     [(0, 7), (23, 9), (45, 16), (0, 0)], {"tombstone": True}),
    # head_dim 256.
    ("bf16_d256", 1, 1, 256, 16, False, None, None, False, None, 16, 16, 16, 3,
     [(0, 16), (20, 5)], {}),
    # a token row spanning several arena rows (row_words = D, mk = Hkv) in a bf16 arena.
    ("bf16_mk2_bf16arena", 2, 4, 64, 16, False, 20, None, False, None, 4, 32, 16, 5,
     [(10, 14), (41, 16)], {"row_words": 64, "arena_dtype": jnp.bfloat16, "tombstone": True}),
    # the default tiling (prefill_config): bq = 128 / G, BK = 128 (128-row bf16 tile), T padded to whole q blocks.
    ("bf16_default_tiling", 2, 4, 64, 16, False, None, None, False, None, None, None, 40, 10,
     [(0, 40), (100, 33)], {}),
]

# Any GQA ratio and head dim (issue 15).  G no power of two: flat (query, head) tiles whose rows
# split a query's heads between two tiles (bq * G not a multiple of the tile); head dims 80/96:
# 128-wide tiles with masked columns.  A covering subset of G in {1, 3, 5, 6, 7} x D in {64, 80,
# 96, 128, 256}, with windows, tombstones, softcap and sinks (per q head: the flat tile's rows
# each pick their own).
GQA_CASES = [
    ("g3_d80_window_sinks_tomb", 2, 3, 80, 16, False, 20, None, True, None, 8, 32, 24, 6,
     [(0, 20), (7, 1), (40, 9), (0, 0)], {"tombstone": True}),
    ("g5_d96_softcap", 1, 5, 96, 16, False, None, 5.0, False, None, 4, 16, 16, 4,
     [(0, 16), (33, 11)], {}),
    ("g6_d128_sinks_p32", 2, 6, 128, 32, False, None, None, True, 0.2, 4, 32, 16, 3,
     [(10, 16), (50, 5)], {}),
    ("g7_d64_window", 1, 7, 64, 16, False, 13, None, True, None, 4, 16, 16, 5,
     [(30, 16), (0, 9)], {"tombstone": True}),
    ("g3_d256", 1, 3, 256, 16, False, None, None, False, None, 8, 16, 16, 3, [(0, 16), (20, 5)], {}),
    ("g1_d80_mha_default_tiling", 2, 1, 80, 16, False, None, None, False, None, None, None, 24, 4,
     [(0, 24), (30, 7)], {}),
    ("g6_d96_default_tiling_mk2", 2, 6, 96, 16, False, 20, None, True, None, None, None, 24, 5,
     [(10, 24), (41, 13)], {"row_words": 96, "arena_dtype": jnp.bfloat16, "tombstone": True}),
    ("f32_g3_d80_all_features", 2, 3, 80, 16, True, 10, 3.0, True, None, 4, 16, 16, 4,
     [(0, 7), (23, 9), (0, 0)], {"tombstone": True}),
]


@pytest.mark.parametrize("case", CASES + GQA_CASES, ids=[c[0] for c in CASES + GQA_CASES])
def test_kernel_matches_reference(case):
    (name, Hkv, G, D, ps, fp32, window, softcap, use_sinks, scale, bq, bk, T, P, rows, extra) = case
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, Hkv, G, D, ps, T, P, rows, fp32=fp32, window=window,
                                                          softcap=softcap, use_sinks=use_sinks, scale=scale, **extra)
    out = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, **kw, impl="pallas", interpret=True,
                                  block_q=bq, block_k=bk)
    assert out.shape == (len(rows), T, Hkv * G, D) and out.dtype == q.dtype
    assert_close(out, ref, q_lens, fp32=fp32)


@pytest.mark.parametrize("window", [None, 13])
def test_kernel_random_batches(window):
    """Fresh random batches of one static shape (compiled once): random prefixes and chunk lengths,
    tables in random order, tombstones under the window."""
    Hkv, G, D, ps, T, P, B = 2, 4, 64, 16, 16, 8, 3
    view = kv_view(Hkv, D, ps, layer=0)
    seed_rng = np.random.default_rng(1234 + (window or 0))
    for _ in range(4):
        rows = []
        for _ in range(B):
            q_len = int(seed_rng.integers(0, T + 1))
            prefix = int(seed_rng.integers(0, P * ps - q_len + 1))
            rows.append((prefix, q_len))
        rng = np.random.default_rng(int(seed_rng.integers(2**31)))
        q, arena, pt, q_lens, kv_lens = make_case(rng, view, rows, T=T, P=P, Hq=Hkv * G, q_dtype=jnp.bfloat16,
                                                  window=window, tombstone=True, num_pages=B * P + 2)
        kw = dict(view=view, window=window)
        ref = paged_prefill_attention_reference(q, arena, pt, q_lens, kv_lens, **kw)
        out = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, **kw, impl="pallas", interpret=True,
                                      block_q=4, block_k=32)
        assert_close(out, ref, q_lens, fp32=False)


def test_default_impl():
    """impl=None: the reference itself off the GPU; on a GPU the Pallas kernel, within bf16
    tolerance of the reference (its K/V are bf16)."""
    view = kv_view(1, 64, 16, layer=0)
    q, arena, pt, q_lens, kv_lens = make_case(np.random.default_rng(0), view, [(3, 4)], T=4, P=2, Hq=1,
                                              q_dtype=jnp.float32)
    a = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view)
    b = paged_prefill_attention_reference(q, arena, pt, q_lens, kv_lens, view=view)
    if jax.default_backend() == "gpu":
        assert_close(a, b, q_lens, fp32=False)
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shape_checks():
    view = kv_view(2, 64, 16, layer=0)
    q, arena, pt, q_lens, kv_lens = make_case(np.random.default_rng(0), view, [(3, 4)], T=4, P=2, Hq=8,
                                              q_dtype=jnp.float32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention(q[..., :32], arena, pt, q_lens, kv_lens, view=view)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_prefill_attention(q[:, :, :3], arena, pt, q_lens, kv_lens, view=view)
    with pytest.raises(ValueError, match="page_table"):
        paged_prefill_attention(q, arena, pt.astype(jnp.uint32), q_lens, kv_lens, view=view)
    with pytest.raises(ValueError, match="q_lens"):
        paged_prefill_attention(q, arena, pt, q_lens[None], kv_lens, view=view)
    with pytest.raises(ValueError, match="sinks"):
        paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view, sinks=jnp.zeros((3,)))
    with pytest.raises(ValueError, match="window"):
        paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view, window=0)
    with pytest.raises(ValueError, match="power of two"):
        paged_prefill_attention(q, arena, pt, q_lens, kv_lens, view=view, impl="pallas", interpret=True,
                                block_k=24)
    with pytest.raises(NotImplementedError, match="straddles two arena rows"):  # D=48 over 16-word rows
        v48 = kv_view(1, 48, 16, layer=0, row_words=16)
        q48, a48, pt48, ql48, kl48 = make_case(np.random.default_rng(0), v48, [(3, 4)], T=4, P=2, Hq=3,
                                               q_dtype=jnp.float32)
        paged_prefill_attention(q48, a48, pt48, ql48, kl48, view=v48, impl="pallas", interpret=True)


def test_prefill_config_defaults():
    c = prefill_config(4096, 4, 128)
    assert (c.block_q * 4, c.block_k, c.num_warps) == (128, 128, 8)  # the H200 sweep's best
    c = prefill_config(1, 1, 128)  # a decode-like chunk still gets a 16-row tile
    assert c.block_q == 16
    c = prefill_config(4096, 8, 256)
    assert c.block_q * 8 == 64 and c.block_k == 32
    # G no power of two: flat tiles of the same 128 (64 at D=256) rows, no padded q head.
    c = prefill_config(4096, 6, 128)
    assert (c.block_rows, c.block_k, c.num_warps) == (128, 128, 8)
    assert prefill_config(4096, 3, 256).block_rows == 64
    assert prefill_config(1, 3, 128).block_rows == 16  # a decode-like chunk: one 16-row tile
    assert prefill_config(4096, 4, 80) == prefill_config(4096, 4, 128)  # D=80 is a 128-wide tile


# --------------------------------------------------------------------------- reference vs dense


def _dense_inputs(rng, view, rows, T, Hq, window):
    """Contiguous K/V per request plus the same tokens in a paged arena."""
    q, arena, pt, q_lens, kv_lens = make_case(rng, view, rows, T=T, P=8, Hq=Hq, q_dtype=jnp.float32,
                                              window=window)
    B, S = len(rows), 8 * view.page_size
    k_all = np.zeros((B, S, view.num_kv_heads, view.head_dim), np.float32)
    v_all = np.zeros((B, S, view.num_kv_heads, view.v_head_dim), np.float32)
    # Read the written tokens back straight from the arena layout (K row of token t of page p).
    a = np.asarray(arena).view(np.uint16)
    for b, (prefix, q_len) in enumerate(rows):
        for t in range(prefix + q_len):
            p = int(pt[b, t // view.page_size])
            for dst, base, m, dim in ((k_all, view.k_row, view.mk, view.head_dim),
                                      (v_all, view.v_row, view.mv, view.v_head_dim)):
                r0 = p * view.rows_per_page + base + (t % view.page_size) * m
                w = a[r0:r0 + m].reshape(-1).astype(np.uint32)
                n = view.num_kv_heads * dim
                dst[b, t] = ((w[:n] << 16) | w[n:2 * n]).view(np.float32).reshape(view.num_kv_heads, dim)
    return q, arena, pt, q_lens, kv_lens, k_all, v_all


@pytest.mark.parametrize("window", [None, 11])
def test_reference_matches_dense_attention(window):
    """The reference on paged tokens == jax.nn.dot_product_attention on the same contiguous tokens."""
    Hkv, G, D, ps, T = 2, 4, 32, 8, 12
    view = kv_view(Hkv, D, ps, fp32=True)
    rows = [(0, 12), (21, 12), (5, 3)]
    q, arena, pt, q_lens, kv_lens, k, v = _dense_inputs(np.random.default_rng(7), view, rows, T, Hkv * G, window)
    ref = np.asarray(paged_prefill_attention_reference(q, arena, pt, q_lens, kv_lens, view=view, window=window))
    S = k.shape[1]
    for b, (prefix, q_len) in enumerate(rows):
        pos = prefix + np.arange(q_len)[:, None]
        s = np.arange(S)[None, :]
        mask = s <= pos
        if window is not None:
            mask &= s > pos - window
        dense = jax.nn.dot_product_attention(
            jnp.asarray(q[b:b + 1, :q_len]), jnp.asarray(k[b:b + 1]), jnp.asarray(v[b:b + 1]),
            mask=jnp.asarray(mask)[None, None], scale=1 / math.sqrt(D), implementation="xla")
        np.testing.assert_allclose(ref[b, :q_len], np.asarray(dense)[0], rtol=1e-5, atol=1e-5)
        assert (ref[b, q_len:] == 0).all()


def test_reference_softcap_sinks_vs_numpy():
    """Soft-capping and sinks in the reference == a float64 numpy formula written out by hand."""
    Hkv, G, D, ps, T = 1, 4, 32, 8, 6
    view = kv_view(Hkv, D, ps, fp32=True)
    rows = [(9, 6), (0, 2)]
    q, arena, pt, q_lens, kv_lens, k, v = _dense_inputs(np.random.default_rng(3), view, rows, T, Hkv * G, 7)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    cap, scale = 2.5, 0.4
    ref = np.asarray(paged_prefill_attention_reference(q, arena, pt, q_lens, kv_lens, view=view, window=7,
                                                       softcap=cap, sinks=jnp.asarray(sinks), scale=scale))
    qn = np.asarray(q, np.float64)
    for b, (prefix, q_len) in enumerate(rows):
        for j in range(q_len):
            pos = prefix + j
            keys = [s for s in range(pos + 1) if s > pos - 7]
            for hq in range(Hkv * G):
                kh = hq // G
                logits = np.array([cap * np.tanh(scale * qn[b, j, hq] @ k[b, s, kh] / cap) for s in keys])
                e = np.exp(logits - max(logits.max(), sinks[hq]))
                den = e.sum() + np.exp(sinks[hq] - max(logits.max(), sinks[hq]))
                want = (e[:, None] * v[b, keys, kh]).sum(0) / den
                np.testing.assert_allclose(ref[b, j, hq], want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- CUDA lowering from CPU


def _lower_cuda(*, B, T, Hkv, G, D, ps, P, fp32=False, window=None, softcap=None, sinks=False, rows=None):
    view = kv_view(Hkv, D, ps, fp32=fp32, layer=0)
    rows = rows or (B * P + 1) * view.rows_per_page
    sds = jax.ShapeDtypeStruct
    args = (sds((B, T, Hkv * G, D), jnp.float32 if fp32 else jnp.bfloat16), sds((rows, view.row_words), jnp.uint16),
            sds((B, P), jnp.int32), sds((B,), jnp.int32), sds((B,), jnp.int32),
            sds((Hkv * G,), jnp.float32) if sinks else None)

    def f(q, a, pt, ql, kl, s):
        return paged_prefill_attention(q, a, pt, ql, kl, sinks=s, view=view, window=window, softcap=softcap,
                                       impl="pallas", backend="triton")

    with abstract_gpu():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_kernel_lowers_for_cuda():
    """The Triton kernel body lowers (catches Triton lowering errors on CPU CI) at the benchmark
    shapes and the feature corners."""
    txt = _lower_cuda(B=2, T=4096, Hkv=8, G=4, D=128, ps=16, P=512)
    assert "__gpu$xla.gpu.triton" in txt
    _lower_cuda(B=1, T=256, Hkv=2, G=8, D=256, ps=64, P=16, window=128, softcap=30.0, sinks=True)
    _lower_cuda(B=1, T=8, Hkv=4, G=1, D=64, ps=32, P=4, fp32=True, window=5)
    # any GQA ratio / head dim (power-of-two tiles: interpret mode does not check them)
    _lower_cuda(B=2, T=512, Hkv=4, G=6, D=80, ps=16, P=40, window=100, sinks=True)
    _lower_cuda(B=1, T=64, Hkv=2, G=3, D=96, ps=16, P=8, softcap=30.0, sinks=True)
    _lower_cuda(B=1, T=64, Hkv=2, G=5, D=256, ps=16, P=8)
    _lower_cuda(B=1, T=16, Hkv=2, G=7, D=80, ps=16, P=4, fp32=True, window=5, sinks=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_arena_offsets_are_64bit_past_4gib(monkeypatch, capfd):
    """On a 40 GiB arena the lowering must compute arena offsets in int64 (it does, from the row
    index, because the kernel indexes the 2-D ref by row); a 32-bit offset would wrap."""
    from jax.experimental import pallas as pl
    orig = pl.pallas_call

    def debug_call(*a, **k):
        k["debug"] = True
        return orig(*a, **k)

    monkeypatch.setattr(pl, "pallas_call", debug_call)
    rows = (40 << 30) // (2 * 8 * 128 * 2)  # 40 GiB of [rows, 1024] uint16
    _lower_cuda(B=1, T=128, Hkv=8, G=4, D=128, ps=16, P=64, rows=rows)
    ttir = capfd.readouterr().out
    assert "tt.dot" in ttir
    assert "x!tt.ptr<bf16>" in ttir or "x!tt.ptr<i16>" in ttir
    # The arena's K/V gathers: [block_k, D] = [128, 128] tiles of 64-bit offsets.
    assert "tensor<128x128xi64>" in ttir


def test_the_block_k_variable_sets_the_triton_kv_block(monkeypatch):
    """$UMEM_JAX_PREFILL_BLOCK_K (the parity harness's null) reaches the Triton kernel's tiling
    when the caller gives no block_k, and the result still matches the reference."""
    from umem_jax.pallas_kernels import paged_prefill

    seen = []
    real = paged_prefill.prefill_config

    def watched(*args, **kw):
        seen.append(kw.get("block_k"))
        return real(*args, **kw)

    monkeypatch.setattr(paged_prefill, "prefill_config", watched)
    monkeypatch.setenv(paged_prefill.BLOCK_K_ENV, "16")
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case("block_k_env", 2, 4, 64, 16, 24, 5, [(0, 24), (41, 13)])
    out = paged_prefill_attention(q, arena, pt, q_lens, kv_lens, **kw, impl="pallas", interpret=True)
    assert seen == [16]
    assert_close(out, ref, q_lens, fp32=False)
    monkeypatch.setenv(paged_prefill.BLOCK_K_ENV, "")  # empty: the default tiling
    paged_prefill_attention(q, arena, pt, q_lens, kv_lens, **kw, impl="pallas", interpret=True)
    assert seen == [16, None]
