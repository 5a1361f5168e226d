"""Shared pieces of the paged-prefill tests (CPU kernels, Mosaic GPU, backend choice, GPU):
a KV view, random cases with poisoned unwritten rows, dtype-aware closeness, and an abstract H200
for cross-lowering.

Every test arena starts poisoned (all words 0xFFFF: NaN as bf16, as an fp32 hi/lo pair and as both
e4m3 bytes of an fp8 word); only the rows of live tokens are written, so any read of an unwritten
row shows up as NaN."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.memory import MHA, Full, LayerDecl, Part, Window, plan
from umem_jax.memory.plan import KVView
from umem_jax.pallas_kernels.kv_write import write_kv_reference
from umem_jax.pallas_kernels.paged_prefill import paged_prefill_attention_reference

POISON = 0xFFFF


def kv_view(Hkv, D, ps, *, fp32=False, fp8=False, row_words=None, layer=1) -> KVView:
    """View of full-attention layer `layer` in a small hybrid plan (3 full layers + a window
    layer), so K/V rows do not start at row 0 of the envelope.  fp8: e4m3 K/V (D/2 words a head)."""
    dt = "float32" if fp32 else "float8_e4m3fn" if fp8 else "bfloat16"
    decls = [LayerDecl(i, (Part(MHA(Hkv, D, dtype=dt), Full()),)) for i in range(3)]
    decls.append(LayerDecl(3, (Part(MHA(Hkv, D, dtype=dt), Window(64)),)))
    p = plan(decls, page_size=ps, row_words=row_words)
    return p.full.kv_view(layer)


def make_case(rng, view, rows, *, T, P, Hq, q_dtype, window=None, tombstone=False, num_pages=None,
              arena_dtype=jnp.uint16, page_pool=None, scales=None):
    """A batch of chunks already written into a poisoned arena (built with jnp, so on the GPU it
    never passes through host memory).

    rows: [(prefix, q_len)] per request; kv_len = prefix + q_len.  Physical pages are handed out
    in random order from `page_pool` (default 1..num_pages-1); table entries past a row's pages
    are the sink 0.  With `tombstone`, pages wholly before the chunk's first query's window are
    unmapped (0) and re-poisoned.  scales (fp8 views): (k_scale, v_scale) f32 [Hkv] the writer
    quantises with (K drawn 3x wider, so it spans e4m3's exponents).  Returns (q, arena,
    page_table, q_lens, kv_lens).
    """
    ps, Hkv = view.page_size, view.num_kv_heads
    B = len(rows)
    need = sum(-(-(p + q) // ps) for p, q in rows)
    num_pages = num_pages or need + 3
    rpp, W = view.rows_per_page, view.row_words
    pool = np.arange(1, num_pages) if page_pool is None else np.asarray(page_pool)
    assert need <= len(pool) and pool.min() > 0 and pool.max() < num_pages
    phys = rng.permutation(pool)
    table = np.zeros((B, P), np.int32)
    pages, slots, n_used = [], [], 0
    for b, (prefix, q_len) in enumerate(rows):
        kv_len = prefix + q_len
        n = -(-kv_len // ps)
        assert n <= P and q_len <= T
        table[b, :n] = phys[n_used:n_used + n]
        n_used += n
        t = np.arange(kv_len)
        pages.append(table[b, t // ps])
        slots.append(t % ps)
    pages = np.concatenate(pages).astype(np.int32)
    slots = np.concatenate(slots).astype(np.int32)
    kv_dt = jnp.float32 if view.planes == 2 or view.fp8 else jnp.bfloat16
    n_tok = len(pages)
    k = jnp.asarray(rng.standard_normal((n_tok, Hkv, view.head_dim), np.float32) * (3 if view.fp8 else 1), kv_dt)
    v = jnp.asarray(rng.standard_normal((n_tok, Hkv, view.v_head_dim), np.float32), kv_dt)
    arena = jnp.full((num_pages * rpp, W), POISON, jnp.uint16)
    kw = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    arena = write_kv_reference(arena, k, v, jnp.asarray(pages), jnp.asarray(slots), view=view, **kw)
    if tombstone and window is not None:
        dead = []
        for b, (prefix, q_len) in enumerate(rows):
            first = prefix  # position of the chunk's first query
            for i in range(P):
                if table[b, i] and (i + 1) * ps <= first - window + 1:
                    dead.append(np.arange(table[b, i] * rpp, (table[b, i] + 1) * rpp))
                    table[b, i] = 0
        if dead:
            arena = arena.at[jnp.asarray(np.concatenate(dead), jnp.int32)].set(jnp.uint16(POISON))
    if jnp.dtype(arena_dtype) == jnp.bfloat16:
        arena = jax.lax.bitcast_convert_type(arena, jnp.bfloat16)
    q = rng.standard_normal((B, T, Hq, view.head_dim), np.float32)
    for b, (_, q_len) in enumerate(rows):
        q[b, q_len:] = np.nan  # padded queries: their output must be exactly 0, never NaN
    q_lens = np.array([ql for _, ql in rows], np.int32)
    kv_lens = np.array([p + ql for p, ql in rows], np.int32)
    return (jnp.asarray(q, q_dtype), arena, jnp.asarray(table), jnp.asarray(q_lens), jnp.asarray(kv_lens))


def prefill_case(name, Hkv, G, D, ps, T, P, rows, *, fp32=False, fp8=False, window=None, softcap=None,
                 use_sinks=False, scale=None, row_words=None, tombstone=False, arena_dtype=jnp.uint16):
    """A case seeded by its name -> (q, arena, page_table, q_lens, kv_lens, kw, ref): K/V bf16 (or
    fp32 planes, or fp8 e4m3 written with random per-kv-head scales, k_scale != v_scale), q bf16
    (fp32 for fp32 planes), sinks f32 [Hkv * G] when `use_sinks`; kw holds the attention options
    (and fp8's k_scale / v_scale), ref the reference output."""
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    view = kv_view(Hkv, D, ps, fp32=fp32, fp8=fp8, row_words=row_words)
    scales = None
    if fp8:  # |k| < ~12 over k_scale >= 0.05: stored below e4m3's 448 (no saturation)
        scales = (jnp.asarray(rng.uniform(0.05, 0.2, Hkv), jnp.float32),
                  jnp.asarray(rng.uniform(0.25, 2.0, Hkv), jnp.float32))
    q, arena, pt, q_lens, kv_lens = make_case(rng, view, rows, T=T, P=P, Hq=Hkv * G,
                                              q_dtype=jnp.float32 if fp32 else jnp.bfloat16, window=window,
                                              tombstone=tombstone, arena_dtype=arena_dtype, scales=scales)
    sinks = jnp.asarray(rng.standard_normal(Hkv * G) + 1.0, jnp.float32) if use_sinks else None
    kw = dict(view=view, window=window, softcap=softcap, sinks=sinks, scale=scale)
    if fp8:
        kw.update(k_scale=scales[0], v_scale=scales[1])
    return q, arena, pt, q_lens, kv_lens, kw, paged_prefill_attention_reference(q, arena, pt, q_lens, kv_lens, **kw)


def assert_close(out, ref, q_lens, *, fp32, tol=None):
    """Kernel output vs reference: both finite, exactly 0 past each row's q_len, and within 1e-5
    (fp32 planes) or 1e-2 (bf16), or `tol`, relative to the reference's largest value."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert np.isfinite(ref).all(), "reference produced non-finite values"
    assert np.isfinite(out).all(), "kernel produced non-finite values (read a poisoned row?)"
    for b, ql in enumerate(np.asarray(q_lens)):
        assert (out[b, ql:] == 0).all(), f"row {b}: outputs past q_len={ql} are not 0"
    tol = tol or (1e-5 if fp32 else 1e-2)
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def abstract_gpu():
    """jax >= 0.11 asks for GPU info when lowering Triton; give it an abstract H200."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    try:
        dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
        return use_abstract_mesh(AbstractMesh((), (), abstract_device=dev))
    except TypeError:  # pragma: no cover - a jax whose AbstractDevice differs
        return contextlib.nullcontext()
