"""The paged prefill benchmark's cases: batches in a paged arena, the kernel call, the checks.

    d = build(key, B=2, T=4096, prefix=0, Hq=32, Hkv=8, D=128, ps=16, arena_gib=6)   # ps: page size
    ok, err = check_vs_reference("name", d)              # the Triton kernel vs the plain-JAX reference
    f = kernel_fn(d["view"], (32, 128, 8, 3))            # (block_q, block_k, num_warps, num_stages)

FLOPs are counted as 4 * Hq * D per visible (query, key) pair, by the kernel and by cuDNN alike.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.memory.plan import KVView
from umem_jax.pallas_kernels.kv_write import write_kv_reference
from umem_jax.pallas_kernels.paged_prefill import (
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_config,
)

from .timing import time_calls

LAYERS = 4  # layers in the page envelope (the view is layer 1): pages are strided like the engine's


def _view(Hkv, D, ps, layer=1, fp8=False):
    rows = Hkv * D // (2 if fp8 else 1)  # K row of one token == one arena row (fp8: two values a word)
    return KVView(rows_per_page=LAYERS * 2 * ps, page_size=ps, k_row=layer * 2 * ps, v_row=layer * 2 * ps + ps,
                  num_kv_heads=Hkv, head_dim=D, v_head_dim=D, row_words=rows, planes=1, fp8=fp8)


def build(key, *, B, T, prefix, Hq, Hkv, D, ps, arena_gib, window=None, q_lens=None, prefixes=None, fp8=False):
    """Random tokens of B requests, written into a paged arena in random page order.

    Every row has `prefix` cached tokens (or prefixes[b]) then a chunk of T (or q_lens[b]) new ones,
    already written.  Returns dict(view, q [B,T,Hq,D], arena, page_table, q_lens, kv_lens,
    q_full [B,S,Hq,D], k_full/v_full [B,S,Hkv,D]) with S = max(prefix) + T; the chunk's queries
    are q_full[:, prefix:prefix+T].  fp8: the same K/V stored as e4m3 (scale 1: N(0, 1) values),
    an arena of half the row width (k_full / v_full stay the bf16 values before quantisation).
    """
    view = _view(Hkv, D, ps, fp8=fp8)
    prefixes = list(prefixes) if prefixes is not None else [prefix] * B
    q_lens = list(q_lens) if q_lens is not None else [T] * B
    S = max(p + T for p in prefixes)
    P = -(-S // ps) + 2  # two spare sink entries past the longest row
    need = sum(-(-(p + ql) // ps) for p, ql in zip(prefixes, q_lens))
    page_bytes = view.rows_per_page * view.row_words * 2
    num_pages = max(need + 2, int(arena_gib * 2**30) // page_bytes)
    rng = np.random.default_rng(0)
    phys = rng.choice(np.arange(1, num_pages), size=need, replace=False)  # random order, spread out
    table = np.zeros((B, P), np.int32)
    pages, slots, src = [], [], []
    used = 0
    for b, (p, ql) in enumerate(zip(prefixes, q_lens)):
        n = -(-(p + ql) // ps)
        table[b, :n] = phys[used:used + n]
        used += n
        t = np.arange(p + ql)
        pages.append(table[b, t // ps])
        slots.append(t % ps)
        src.append(b * S + t)
    kq, kk, kv = jax.random.split(key, 3)
    q_full = jax.random.normal(kq, (B, S, Hq, D), jnp.bfloat16)
    k_full = jax.random.normal(kk, (B, S, Hkv, D), jnp.bfloat16)
    v_full = jax.random.normal(kv, (B, S, Hkv, D), jnp.bfloat16)
    src = jnp.asarray(np.concatenate(src), jnp.int32)
    write = jax.jit(functools.partial(write_kv_reference, view=view), donate_argnums=0)
    arena = jax.jit(lambda: jnp.zeros((num_pages * view.rows_per_page, view.row_words), jnp.uint16))()
    arena = write(arena, k_full.reshape(B * S, Hkv, D)[src], v_full.reshape(B * S, Hkv, D)[src],
                  jnp.asarray(np.concatenate(pages), jnp.int32), jnp.asarray(np.concatenate(slots), jnp.int32))
    q = jnp.stack([jax.lax.dynamic_slice_in_dim(q_full[b], p, T, 0) for b, p in enumerate(prefixes)])
    return dict(view=view, q=q, arena=arena, page_table=jnp.asarray(table), q_lens=jnp.asarray(q_lens, jnp.int32),
                kv_lens=jnp.asarray([p + ql for p, ql in zip(prefixes, q_lens)], jnp.int32),
                q_full=q_full, k_full=k_full, v_full=v_full, S=S, num_pages=num_pages)


def pairs(prefix, T):
    """Visible (query, key) pairs of a causal chunk of T queries after `prefix` cached keys."""
    return T * prefix + T * (T + 1) // 2


def kernel_fn(view, cfg, *, interpret=False, **kw):
    bq, bk, nw, ns = cfg
    return jax.jit(functools.partial(paged_prefill_attention, view=view, impl="pallas", backend="triton",
                                     interpret=interpret, block_q=bq, block_k=bk, num_warps=nw, num_stages=ns,
                                     **kw))


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.abs(a - b).max() / max(1e-6, float(np.abs(b).max())))


def check_vs_reference(name, d, cfg=None, interpret=False, fn=None, **kw):
    """Kernel vs reference on one built batch; returns (ok, rel err).  fn(view, **kw) -> jitted
    kernel overrides the Triton kernel (the Mosaic GPU check passes mgpu_fn)."""
    G = d["q"].shape[2] // d["view"].num_kv_heads
    args = (d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"])
    if fn is None:
        cfg = cfg or cfg_tuple(prefill_config(d["q"].shape[1], G, d["q"].shape[3]))
        out = kernel_fn(d["view"], cfg, interpret=interpret, **kw)(*args)
    else:
        out = fn(d["view"], **kw)(*args)
    ref = jax.jit(functools.partial(paged_prefill_attention_reference, view=d["view"], **kw))(*args)
    err = rel_err(out, ref)
    finite = bool(np.isfinite(np.asarray(out.astype(jnp.float32))).all())
    ql = np.asarray(d["q_lens"])
    zeros = all(bool((np.asarray(out[b, ql[b]:].astype(jnp.float32)) == 0).all()) for b in range(len(ql)))
    ok = finite and zeros and err <= 1e-2
    print(f"  correctness {name:<44} rel err {err:.2e}  finite={finite} pad-rows-zero={zeros}  "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    return ok, err


def cfg_tuple(c):
    return (c.block_q, c.block_k, c.num_warps, c.num_stages)


# The GPU geometry: 32 q / 8 kv heads, D=128, page 16, 4K-token chunks.
GPU_GEOMETRY = dict(Hq=32, Hkv=8, D=128, ps=16, T=4096)
TABLE_SHAPES = [(1, 0), (2, 0), (4, 0), (1, 4096), (2, 4096), (4, 4096)]  # (B, prefix)
SWEEP_SHAPES = [(2, 0), (1, 4096)]
GPU_CHECKS = [  # (name, build kwargs, kernel kwargs)
    ("B=3 T=1024 prefix 0/1000 + padding row", dict(B=3, T=1024, prefix=0, prefixes=[0, 1000, 0],
                                                     q_lens=[1024, 1024, 0], Hq=32, Hkv=8, D=128, ps=16), {}),
    ("GQA8 ps64 window 512 + softcap 30 + sinks", dict(B=2, T=1024, prefix=0, prefixes=[3000, 100],
                                                        q_lens=[1024, 700], Hq=32, Hkv=4, D=128, ps=64),
     dict(window=512, softcap=30.0, sinks=True)),
    ("D=256 GQA2 ps32 window 1024", dict(B=2, T=512, prefix=0, prefixes=[2000, 0], q_lens=[512, 300],
                                         Hq=8, Hkv=4, D=256, ps=32), dict(window=1024)),
]
# Triton (block_q, block_k, num_warps, num_stages); block_q * G tile rows, G = 4 here.  The short
# list (default run) compiles without spills for sm_90a (Triton 3.6 + ptxas, offline); 4-warp
# 128-row tiles spill heavily and are left out.
SWEEP_CONFIGS = [(32, 64, 8, 3), (32, 64, 8, 4), (32, 64, 8, 2), (32, 32, 8, 4), (16, 64, 4, 3),
                 (16, 64, 4, 2), (32, 128, 8, 2), (16, 128, 4, 2)]
# --tune: the wide grid.  Tile rows 64 (bq 16, 4 warps: one warpgroup), 128 (bq 32, 8 warps: two
# warpgroups of 64 rows) and 256 (bq 64, 16 warps: four warpgroups, each K/V tile feeds 256 rows);
# K blocks of 32..128 tokens = 2..8 pages of 16 gathered per load; 2..4 pipeline stages.
# Most promising first: the time budget cuts the tail.
TUNE_CONFIGS = [(32, 64, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (64, 64, 16, 2), (64, 64, 16, 3),
                (64, 128, 16, 2), (32, 64, 8, 4), (32, 64, 8, 2), (32, 32, 8, 4), (16, 64, 4, 3), (16, 128, 4, 2),
                (32, 64, 16, 3), (32, 128, 16, 2), (64, 32, 16, 3), (16, 64, 4, 2), (16, 32, 4, 4), (16, 128, 4, 3),
                (16, 64, 4, 4), (32, 32, 8, 3)]
def flops(Hq, D, B, prefix, T):
    return 4 * Hq * D * B * pairs(prefix, T)


def best_time(f, args, *, iters: int, reps: int) -> float:
    """Seconds per call of f(*args): `iters` back-to-back calls per rep, best of `reps` (after a warm-up)."""
    return time_calls(lambda: f(*args), iters=iters, trials=reps, warmup=0).best


def geomean(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def kernel_args(d) -> tuple:
    """The kernel's arrays of a built batch, in call order."""
    return d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"]


def with_sinks(key, shp: dict, kw: dict) -> dict:
    """A check's kernel kwargs with `sinks=True` replaced by one random sink logit per q head."""
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = jax.random.normal(key, (shp["Hq"],), jnp.float32)
    return kw
