"""Helpers shared by the relocate / kv_write / paged_decode tests (CPU and GPU).

Views are laid out the way plan.py lays them out (layer-major envelopes: [L0 K][L0 V][L1 K]...),
arenas are poisoned with NaN bit patterns so any element a kernel forgets to write, or reads when
it should not, shows up.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.memory import MHA, Full, LayerDecl, Part, Window, plan
from umem_jax.memory.plan import KVView
from umem_jax.pallas_kernels.kv_write import write_kv_reference

POISON = 0xFFFF  # a bf16 NaN, and an fp32 NaN when it is the hi plane


def make_view(num_kv_heads=2, head_dim=64, v_head_dim=None, page_size=16, layers=2, layer=1, planes=1,
              row_words=None) -> KVView:
    """KVView of layer `layer` of a sub-pool of `layers` identical MHA layers (plan.py layout)."""
    dv = v_head_dim or head_dim
    k_words, v_words = planes * num_kv_heads * head_dim, planes * num_kv_heads * dv
    W = row_words or int(np.gcd(k_words, v_words))
    mk, mv = k_words // W, v_words // W
    per_layer = page_size * (mk + mv)
    return KVView(rows_per_page=layers * per_layer, page_size=page_size, k_row=layer * per_layer,
                  v_row=layer * per_layer + page_size * mk, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  v_head_dim=dv, row_words=W, planes=planes)


def poisoned_arena(num_rows, row_words, dtype=jnp.uint16, value=POISON):
    a = jnp.full((num_rows, row_words), value, jnp.uint16)
    return a if jnp.dtype(dtype) == jnp.uint16 else jax.lax.bitcast_convert_type(a, dtype)


def random_words(rng, shape, dtype=jnp.uint16):
    """Random 16-bit words, a quarter of them NaN bit patterns (bf16 NaN payloads must survive)."""
    w = rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16)
    nan_mask = rng.random(shape) < 0.25
    w[nan_mask] = rng.choice(np.array([0xFFFF, 0x7FC1, 0xFF81, 0x7F80 | 0x1], np.uint16), size=int(nan_mask.sum()))
    a = jnp.asarray(w)
    return a if jnp.dtype(dtype) == jnp.uint16 else jax.lax.bitcast_convert_type(a, dtype)


def as_np_u16(a) -> np.ndarray:
    a = jnp.asarray(a)
    if a.dtype != jnp.uint16:
        a = jax.lax.bitcast_convert_type(a, jnp.uint16)
    return np.asarray(a)


def random_page_tables(rng, batch, pages_per_seq, first_page, num_pages):
    """Distinct physical pages in random order, [B, P] int32, never the sink."""
    ids = rng.permutation(np.arange(first_page, num_pages))[: batch * pages_per_seq]
    assert ids.size == batch * pages_per_seq, "arena too small for the page tables"
    return ids.reshape(batch, pages_per_seq).astype(np.int32)


def fill_kv(arena, view, page_table, lengths, rng, dtype=None, scale=1.0):
    """Write random K/V for positions [0, len) of every row through its page table (reference
    writer).  Unwritten slots keep the arena's poison.  Returns (arena, k, v) with k/v
    [B, P*ps, Hkv, D] numpy float32 (the stored values, NaN where never written)."""
    B, P = page_table.shape
    ps = view.page_size
    dt = dtype or (jnp.float32 if view.planes == 2 else jnp.bfloat16)
    kk = np.full((B, P * ps, view.num_kv_heads, view.head_dim), np.nan, np.float32)
    vv = np.full((B, P * ps, view.num_kv_heads, view.v_head_dim), np.nan, np.float32)
    pages, slots, ks, vs = [], [], [], []
    for b in range(B):
        n = int(lengths[b])
        k = jnp.asarray(scale * rng.standard_normal((n, view.num_kv_heads, view.head_dim)), dt)
        v = jnp.asarray(rng.standard_normal((n, view.num_kv_heads, view.v_head_dim)), dt)
        pos = np.arange(n)
        pages.append(page_table[b, pos // ps]); slots.append(pos % ps); ks.append(k); vs.append(v)
        kk[b, :n] = np.asarray(k.astype(jnp.float32)); vv[b, :n] = np.asarray(v.astype(jnp.float32))
    arena = write_kv_reference(arena, jnp.concatenate(ks), jnp.concatenate(vs),
                               jnp.asarray(np.concatenate(pages), jnp.int32),
                               jnp.asarray(np.concatenate(slots), jnp.int32), view=view)
    return arena, kk, vv


def decode_lengths(rng, B: int, ctx_max: int, min_len: int = 0) -> np.ndarray:
    """Lengths int32 [B] of a decode batch: random in [min_len, ctx_max], row 0 at ctx_max and, with
    B > 2, row 1 at length 1 and row 2 a padding lane (length 0)."""
    lengths = rng.integers(min_len, ctx_max + 1, size=B).astype(np.int32)
    lengths[0] = ctx_max
    if B > 2:
        lengths[1], lengths[2] = 1, 0
    return lengths


def decode_case(seed, *, B, Hkv, G, D, ps, ctx_max, planes=1, window=None, arena_dtype=jnp.uint16, Dv=None,
                 min_len=0):
    """A decode batch over a poisoned arena: random K/V written for [0, len) of each row (row 0 at
    ctx_max; with B > 2 row 1 at length 1 and row 2 a padding lane), pages past a row's length and,
    with a window, pages wholly before it pointing at the poisoned sink page 0.
    -> (view, arena, page_table, lengths, q)."""
    rng = np.random.default_rng(seed)
    view = make_view(Hkv, D, Dv, ps, layers=3, layer=2, planes=planes)
    P = -(-ctx_max // ps)
    lengths = decode_lengths(rng, B, ctx_max, min_len)
    npages = B * P + 2
    arena = poisoned_arena(npages * view.rows_per_page, view.row_words, arena_dtype)
    pt = random_page_tables(rng, B, P, 1, npages)
    for b in range(B):
        pt[b, -(-int(lengths[b]) // ps):] = 0
    arena, _, _ = fill_kv(arena, view, pt, lengths, rng)
    if window is not None:
        for b in range(B):
            pt[b, :max(0, int(lengths[b]) - window) // ps] = 0
    q = jnp.asarray(rng.standard_normal((B, Hkv * G, D)), jnp.bfloat16 if planes == 1 else jnp.float32)
    return view, arena, jnp.asarray(pt), jnp.asarray(lengths), q


def fp8_decode_case(seed, *, B, Hkv, G, D, ps, ctx_max, window=None, min_len=0):
    """A decode batch over a poisoned fp8 arena: K/V written (reference writer, per-kv-head scales,
    k_scale != v_scale) for [0, len) of each row (row 0 at ctx_max; with B > 2 row 1 at length 1 and
    row 2 a padding lane); pages past a row's length and, with a window, pages wholly before it point
    at the poisoned sink page 0.  -> (view, arena (bf16, as the engine allocates it), page_table,
    lengths, q bf16, k_scale, v_scale)."""
    rng = np.random.default_rng(seed)
    decls = [LayerDecl(i, (Part(MHA(Hkv, D, dtype="float8_e4m3fn"), Full()),)) for i in range(2)]
    decls.append(LayerDecl(2, (Part(MHA(Hkv, D, dtype="float8_e4m3fn"), Window(64)),)))
    view = plan(decls, page_size=ps).full.kv_view(1)  # rows not at 0 of the envelope
    P = -(-ctx_max // ps)
    lengths = decode_lengths(rng, B, ctx_max, min_len)
    npages = B * P + 2
    pt = rng.permutation(np.arange(1, npages))[:B * P].reshape(B, P).astype(np.int32)
    pos = [np.arange(n) for n in lengths]
    pages = jnp.asarray(np.concatenate([pt[b, p // ps] for b, p in enumerate(pos)]), jnp.int32)
    slots = jnp.asarray(np.concatenate([p % ps for p in pos]), jnp.int32)
    T = int(lengths.sum())
    ks = jnp.asarray(rng.uniform(0.05, 0.2, Hkv), jnp.float32)  # |k| < ~12: stored below 448 (no saturation)
    vs = jnp.asarray(rng.uniform(0.25, 2.0, Hkv), jnp.float32)
    k = jax.random.normal(jax.random.PRNGKey(seed), (T, Hkv, D), jnp.float32) * 3
    v = jax.random.normal(jax.random.PRNGKey(seed + 1), (T, Hkv, D), jnp.float32)
    arena = jnp.full((npages * view.rows_per_page, view.row_words), POISON, jnp.uint16)  # e4m3 NaN bytes
    arena = write_kv_reference(arena, k, v, pages, slots, view=view, k_scale=ks, v_scale=vs)
    for b in range(B):
        pt[b, -(-int(lengths[b]) // ps):] = 0
        if window is not None:
            pt[b, :max(0, int(lengths[b]) - window) // ps] = 0
    q = jnp.asarray(rng.standard_normal((B, Hkv * G, D)), jnp.bfloat16)
    return view, jax.lax.bitcast_convert_type(arena, jnp.bfloat16), jnp.asarray(pt), jnp.asarray(lengths), q, ks, vs


def close_fp8(got, ref, tol=1.5e-2):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    assert np.isfinite(ref).all(), "the reference read a poisoned (NaN) row"
    assert np.isfinite(got).all(), "the kernel read a poisoned (NaN) row"
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())))


def naive_decode(q, k, v, lengths, window=None, softcap=None, sinks=None, scale=None):
    """Independent numpy float64 decode attention over gathered k/v [B, S, Hkv, D]."""
    q = np.asarray(q, np.float64)
    B, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    G = Hq // Hkv
    scale = 1 / np.sqrt(D) if scale is None else scale
    out = np.zeros((B, Hq, Dv))
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        lo = 0 if window is None else max(0, n - window)
        for j in range(Hq):
            kh = np.asarray(k[b, lo:n, j // G], np.float64)
            vh = np.asarray(v[b, lo:n, j // G], np.float64)
            s = kh @ q[b, j] * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            logits = s if sinks is None else np.concatenate([s, [float(sinks[j])]])
            p = np.exp(logits - logits.max())
            p = p / p.sum()
            out[b, j] = p[: n - lo] @ vh
    return out


def _jax_version():
    return tuple(int(x) for x in jax.__version__.split(".")[:2])


def cuda_lowering(fn, *args, donate_argnums=()):
    """Cross-lower `fn` for CUDA from any machine (the Triton kernel is built at this point, so
    Pallas lowering errors show up here); returns the StableHLO text, or None when this jax
    cannot cross-lower without a GPU (0.11+ asks for GPU device info; tried with an abstract
    H100 first, as jax's own tests do)."""
    lower = lambda: jax.jit(fn, donate_argnums=donate_argnums).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    if _jax_version() < (0, 11) or jax.default_backend() == "gpu":
        return lower()
    try:
        from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

        dev = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132)
        with use_abstract_mesh(AbstractMesh((), (), abstract_device=dev)):
            return lower()
    except Exception:  # noqa: BLE001 - this jax cannot cross-lower here; the GPU run covers it
        return None


@contextlib.contextmanager
def no_triton_deprecation():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton.*deprecated.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield
