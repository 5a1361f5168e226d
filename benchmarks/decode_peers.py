"""The paged decode benchmark's inputs and the peers it is compared with on the same bytes.

    view, arena, pt, lengths, q = decode_setup(key, B=64, ctx=4096, Hq=32, Hkv=8, D=128, page_size=16)
    k_pages, v_pages = head_major(arena, view, npages)      # jax paged_attention's own layout
    best = jax_paged_attention_best(q, k_pages, v_pages, pt, lengths, ref, timed, interpret)
    t, err = cudnn_dense(q, k_pages, v_pages, pt, ctx, ref, timed)
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.memory.plan import KVView


def decode_setup(key, *, B, ctx, Hq, Hkv, D, page_size, layers=2, window=None, dtype=jnp.bfloat16):
    """Arena of `layers`-layer KV envelopes filled with finite random values (the sink too), page
    tables of distinct pages in random order; with a window, pages wholly before it are
    tombstoned (0) and never allocated, as the engine does."""
    P = -(-ctx // page_size)
    first_live = 0 if window is None else max(0, ctx - window) // page_size
    live = P - first_live
    npages = 1 + B * live
    W = Hkv * D
    view = KVView(rows_per_page=layers * 2 * page_size, page_size=page_size, k_row=(layers - 1) * 2 * page_size,
                  v_row=(layers - 1) * 2 * page_size + page_size, num_kv_heads=Hkv, head_dim=D, v_head_dim=D,
                  row_words=W)
    k1, k2, k3 = jax.random.split(key, 3)
    arena = jax.jit(lambda k: jax.lax.bitcast_convert_type(
        jax.random.normal(k, (npages * view.rows_per_page, W), dtype), jnp.uint16))(k1)
    perm = np.asarray(jax.random.permutation(k2, np.arange(1, npages, dtype=np.int32)))
    pt = np.zeros((B, P), np.int32)
    pt[:, first_live:] = perm.reshape(B, live)
    q = jax.random.normal(k3, (B, Hq, D), dtype)
    lengths = jnp.full((B,), ctx, jnp.int32)
    return view, arena, jnp.asarray(pt), lengths, q


def head_major(arena, view, npages):
    """The same K/V in jax paged_attention's layout: [Hkv, pages, page_size, D] each."""
    page_size, Hkv, D = view.page_size, view.num_kv_heads, view.head_dim
    a = jax.lax.bitcast_convert_type(arena, jnp.bfloat16).reshape(npages, view.rows_per_page, view.row_words)
    k = a[:, view.k_row:view.k_row + page_size].reshape(npages, page_size, Hkv, D).transpose(2, 0, 1, 3)
    v = a[:, view.v_row:view.v_row + page_size].reshape(npages, page_size, Hkv, D).transpose(2, 0, 1, 3)
    return k, v


def kv_bytes(B, visible, view):
    """K and V bytes of `visible` positions of B rows (each read once per kv head)."""
    return B * visible * view.num_kv_heads * (view.head_dim + view.v_head_dim) * 2


def max_err(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def jax_paged_attention_best(q, k_pages, v_pages, pt, lengths, ref, timed, interpret):
    """jax's shipped Triton paged_attention at its best k_splits -> (seconds, k_splits, max err),
    or None when no split ran.  Raises ImportError where jax no longer ships it (deprecated)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    best = None
    D, P = q.shape[2], pt.shape[1]
    qs = (q.astype(jnp.float32) / math.sqrt(D)).astype(q.dtype)  # it does not scale q itself
    for ks in (16, 8, 4, 1):
        if P % ks:
            continue
        f = jax.jit(lambda q, k, v, pt, ln, ks=ks: paged_attention(q, k, v, pt, ln, k_splits=ks, interpret=interpret))
        try:
            err = max_err(f(qs, k_pages, v_pages, pt, lengths), ref)
            t = timed(lambda: f(qs, k_pages, v_pages, pt, lengths))
            print(f"    jax paged_attention k_splits={ks}: {t * 1e6:.1f} us err={err:.2e}", flush=True)
            if best is None or t < best[0]:
                best = (t, ks, err)
        except Exception as e:  # noqa: BLE001 - one split must not end a one-shot GPU run
            print(f"    jax paged_attention k_splits={ks}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    return best


def cudnn_dense_call(q, k_pages, v_pages, pt, ctx):
    """cuDNN dense attention over contiguous [B, ctx, Hkv, D] K/V holding the same values as the
    pages (gathered here, once) -> (jitted fn, its args).  GPU only."""
    B, _, D = q.shape
    Hkv = k_pages.shape[0]
    kd = k_pages[:, pt].transpose(1, 2, 3, 0, 4).reshape(B, ctx, Hkv, D)
    vd = v_pages[:, pt].transpose(1, 2, 3, 0, 4).reshape(B, ctx, Hkv, D)
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn")[:, 0])
    return f, (q, kd, vd)


def cudnn_dense(q, k_pages, v_pages, pt, ctx, ref, timed):
    """cudnn_dense_call, checked against `ref` and timed -> (seconds, max err)."""
    f, args = cudnn_dense_call(q, k_pages, v_pages, pt, ctx)
    err = max_err(f(*args), ref)
    return timed(lambda: f(*args)), err
