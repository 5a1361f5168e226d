"""Paged prefill attention (Pallas Triton) vs cuDNN dense flash attention on the same tokens.

GPU (one H200):   python benchmarks/bench_prefill.py [--json out.json] [--no-sweep]
Tuning run:       python benchmarks/bench_prefill.py --tune   (<= ~6 min: checks, the wide Triton sweep,
                  then the Mosaic GPU kernel in a child process with a time limit (checks, its own
                  sweep, timings), then the table with Triton, Mosaic GPU and cuDNN side by side)
Mosaic GPU only:  python benchmarks/bench_prefill.py --mgpu [--json out.json]
CPU smoke test:   python benchmarks/bench_prefill.py --small      (interpret mode, seconds)
From bench_kernels.py:  bench_prefill.run(results, args)  (appends dict rows to `results`)

Order of work: (1) correctness: kernel vs the plain-JAX reference at real shapes (prefix 0 and a
partial-page prefix, a padding row; window + softcap + sinks with GQA 8; head_dim 256), then
kernel vs cuDNN on a benchmark shape; (2) a short tiling sweep; (3) the table: 4K-token chunks,
B in {1, 2, 4}, 32 q / 8 kv heads, D=128, page 16, prefix 0 and 4096.

Both sides count FLOPs the same way: 4 * Hq * D per visible (query, key) pair.  The paged kernel
runs the chunk (T queries after `prefix` cached tokens, pages in random order inside a > 4 GiB
arena, so the int64 offset path is what is timed).  cuDNN runs
`jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")` over the whole
sequence S = prefix + T (its causal mask is top-left aligned, so a chunk after a prefix is not
expressible; for prefix 0 the two do identical work).  The last T rows of cuDNN's output are the
chunk's attention, which gives the cross-check.  Goal: kernel TFLOP/s >= 0.8 x cuDNN.

The Mosaic GPU kernel (paged_prefill_mgpu.py) runs in a child process under --tune: a hang or a
crash in a new kernel then costs its time limit, not the Triton results or the table.  The child checks it
against the reference first and times it only if every check passed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_MEM_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
if __name__ == "__main__" and "--tune" in sys.argv[1:] and not any(k in os.environ for k in _MEM_ENV):
    # --tune starts a second GPU process (the Mosaic GPU child) while this one holds its arrays:
    # no preallocation, set before jax can read it (main() repeats it for programmatic calls).
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from umem_jax.memory.plan import KVView  # noqa: E402
from umem_jax.pallas_kernels._compat import silence_triton_deprecation  # noqa: E402
from umem_jax.pallas_kernels.kv_write import write_kv_reference  # noqa: E402
from umem_jax.pallas_kernels.paged_prefill import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
    prefill_config,
)

LAYERS = 4  # layers in the page envelope (the view is layer 1): pages are strided like the engine's


def _view(Hkv, D, ps, layer=1):
    rows = Hkv * D  # bf16 K row of one token == one arena row
    return KVView(rows_per_page=LAYERS * 2 * ps, page_size=ps, k_row=layer * 2 * ps, v_row=layer * 2 * ps + ps,
                  num_kv_heads=Hkv, head_dim=D, v_head_dim=D, row_words=rows, planes=1)


def build(key, *, B, T, prefix, Hq, Hkv, D, ps, arena_gib, window=None, q_lens=None, prefixes=None):
    """Random tokens of B requests, written into a paged arena in random page order.

    Every row has `prefix` cached tokens (or prefixes[b]) then a chunk of T (or q_lens[b]) new ones,
    already written.  Returns dict(view, q [B,T,Hq,D], arena, page_table, q_lens, kv_lens,
    q_full [B,S,Hq,D], k_full/v_full [B,S,Hkv,D]) with S = max(prefix) + T; the chunk's queries
    are q_full[:, prefix:prefix+T].
    """
    view = _view(Hkv, D, ps)
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


def timeit(f, *args, iters=20, reps=3):
    """Seconds per call: `iters` back-to-back calls per rep, best of `reps` (after a warm-up)."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def pairs(prefix, T):
    """Visible (query, key) pairs of a causal chunk of T queries after `prefix` cached keys."""
    return T * prefix + T * (T + 1) // 2


def kernel_fn(view, cfg, *, interpret=False, **kw):
    bq, bk, nw, ns = cfg
    return jax.jit(functools.partial(paged_prefill_attention, view=view, impl="pallas", backend="triton",
                                     interpret=interpret, block_q=bq, block_k=bk, num_warps=nw, num_stages=ns,
                                     **kw))


def mgpu_fn(view, cfg, **kw):
    """The Mosaic GPU kernel with cfg = (block_kv, max_concurrent_steps, schedule_barrier)."""
    from umem_jax.pallas_kernels.paged_prefill_mgpu import paged_prefill_attention_mgpu

    bkv, mcs, sched = cfg
    return jax.jit(functools.partial(paged_prefill_attention_mgpu, view=view, block_kv=bkv,
                                     max_concurrent_steps=mcs, schedule_barrier=sched, **kw))


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
        cfg = cfg or _cfg_tuple(prefill_config(d["q"].shape[1], G, d["q"].shape[3]))
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


def _cfg_tuple(c):
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
# Mosaic GPU (block_kv, max_concurrent_steps, schedule_barrier); block_q is 64 per consumer.
# Shared memory at D=128: 32 KiB of Q/O + 2 * steps * block_kv * 256 B of K/V ring.
MGPU_CONFIGS = [(128, 2, True), (64, 3, True), (64, 4, True), (64, 2, True), (128, 2, False), (64, 3, False)]


def _flops(Hq, D, B, prefix, T):
    return 4 * Hq * D * B * pairs(prefix, T)


def run(results, args):
    """Entry point for bench_kernels.py: appends one dict per measured row to `results`.

    args.tune: the wide Triton grid; args.sweep_reserve: seconds before the deadline at which the
    sweep stops; args.before_table: a callable run between the sweep and the table (--tune: the
    Mosaic GPU child) returning rows of run_mgpu, merged into the table as extra columns."""
    silence_triton_deprecation()
    small = bool(getattr(args, "small", False))
    iters = int(getattr(args, "iters", 0) or (1 if small else 20))
    sweep = bool(getattr(args, "sweep", True))
    tune = bool(getattr(args, "tune", False))
    mgpu_rows = list(getattr(args, "mgpu_rows", None) or [])
    arena_gib = float(getattr(args, "arena_gib", 0) or (0.0 if small else 6.0))
    interpret = small
    on_gpu = jax.default_backend() == "gpu"
    # Time budget: an absolute `args.deadline` (time.time()) from a caller, or `args.prefill_budget`
    # seconds from now.  Past it the sweep stops and the remaining table rows are skipped.
    deadline = getattr(args, "deadline", None)
    if deadline is None:
        budget = getattr(args, "prefill_budget", None)
        deadline = time.time() + budget if budget else float("inf")

    def over(reserve=0.0):
        return time.time() > deadline - reserve

    if not small and not on_gpu:
        print("bench_prefill: no GPU; run with --small for the CPU interpret-mode smoke test")
        return results
    baseline_impl = "cudnn" if on_gpu else "xla"

    if small:
        Hq, Hkv, D, ps, T = 4, 1, 64, 16, 32
        shapes = [(1, 0), (2, 32)]
        checks = [("bf16 prefix 0/17 + padding row", dict(B=3, T=32, prefix=0, prefixes=[0, 17, 0], q_lens=[32, 20, 0],
                                                           Hq=4, Hkv=1, D=64, ps=16), {}),
                  ("window 24 + softcap + sinks", dict(B=2, T=32, prefix=0, prefixes=[40, 3], q_lens=[32, 9],
                                                         Hq=8, Hkv=1, D=64, ps=16), dict(window=24, softcap=20.0, sinks=True))]
        configs = [(16, 16, 4, 2), (32, 32, 4, 2)]
        sweep_shapes = [(1, 0)]
    else:
        g = GPU_GEOMETRY
        Hq, Hkv, D, ps, T = g["Hq"], g["Hkv"], g["D"], g["ps"], g["T"]
        shapes = TABLE_SHAPES
        checks = [(n, dict(b), dict(k)) for n, b, k in GPU_CHECKS]
        configs = TUNE_CONFIGS if tune else SWEEP_CONFIGS
        sweep_shapes = SWEEP_SHAPES

    key = jax.random.PRNGKey(0)
    print(f"== paged prefill attention: backend {jax.default_backend()}, jax {jax.__version__}, "
          f"baseline {baseline_impl}", flush=True)
    # ---- (1) correctness first
    all_ok = True
    for name, shp, kw in checks:
        d = build(key, arena_gib=arena_gib, **shp)
        if kw.pop("sinks", False):
            kw["sinks"] = jax.random.normal(key, (shp["Hq"],), jnp.float32)
        try:
            ok, err = check_vs_reference(name, d, interpret=interpret, **kw)
        except Exception as e:  # report and go on to the timings
            print(f"  correctness {name}: FAILED {type(e).__name__}: {str(e)[:1000]}", flush=True)
            ok, err = False, None
        all_ok &= ok
        results.append(dict(bench="prefill", kind="correctness", case=name, rel_err=err, ok=ok))
        del d

    def baseline(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=baseline_impl)

    base_fn = jax.jit(baseline)

    # ---- (2) tiling sweep on two shapes; keep the best geometric mean
    G = Hq // Hkv
    default = _cfg_tuple(prefill_config(T, G, D))
    best_cfg = default
    if sweep:
        data = [build(key, B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=arena_gib) for B, p in sweep_shapes]
        scores = {}
        for cfg in dict.fromkeys([default] + configs):
            if scores and over(reserve=getattr(args, "sweep_reserve", None) or 150):
                print("  sweep: time budget reached, stopping", flush=True)
                break
            try:
                ts = []
                for (B, p), d in zip(sweep_shapes, data):
                    f = kernel_fn(d["view"], cfg, interpret=interpret)
                    ts.append(timeit(f, d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"],
                                     iters=iters, reps=1 if small else 2))
                tf = [_flops(Hq, D, B, p, T) / t / 1e12 for (B, p), t in zip(sweep_shapes, ts)]
                scores[cfg] = math.exp(sum(map(math.log, tf)) / len(tf))
                print(f"  sweep block_q={cfg[0]:>3} block_k={cfg[1]:>3} warps={cfg[2]:>2} stages={cfg[3]}: "
                      + "  ".join(f"{x:7.1f}" for x in tf) + " TFLOP/s", flush=True)
            except Exception as e:  # a config the compiler refuses (e.g. out of shared memory)
                print(f"  sweep {cfg}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                      flush=True)
            results.append(dict(bench="prefill", kind="sweep", impl="triton", config=list(cfg),
                                tflops_geomean=scores.get(cfg)))
        if scores:
            best_cfg = max(scores, key=scores.get)
        del data
        print(f"  best Triton config {best_cfg} (block_q, block_k, warps, stages): "
              f"{scores.get(best_cfg, float('nan')):.1f} TFLOP/s geomean; default {default}: "
              f"{scores.get(default, float('nan')):.1f}", flush=True)

    # ---- (3) the table
    hook = getattr(args, "before_table", None)
    if hook is not None:
        mgpu_rows += hook()
    mg = {(r["B"], r["prefix"]): r for r in mgpu_rows if r.get("kind") == "perf" and "mgpu_ms" in r}
    print(f"{'B':>2} {'T':>5} {'prefix':>6} | {'triton ms':>9} {'TFLOP/s':>8} | {'mgpu ms':>8} {'TFLOP/s':>8} | "
          f"{baseline_impl + ' ms':>9} {'TFLOP/s':>8} (S=prefix+T) | triton/base | mgpu/base | max|diff| vs base",
          flush=True)
    for B, p in shapes:
        if over():
            print(f"  B={B} prefix={p}: skipped (time budget reached)", flush=True)
            results.append(dict(bench="prefill", kind="perf", name="prefill_paged", B=B, T=T, prefix=p,
                                note="skipped: time budget reached"))
            continue
        d = build(key, B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=arena_gib)
        args_k = (d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"])
        flops = _flops(Hq, D, B, p, T)
        row = dict(bench="prefill", kind="perf", name="prefill_paged", shape=f"B={B} T={T} prefix={p} {Hq}/{Hkv}x{D} ps{ps}",
                   B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, page_size=ps,
                   arena_gib=round(d["num_pages"] * d["view"].rows_per_page * d["view"].row_words * 2 / 2**30, 2),
                   config=list(best_cfg))
        try:
            f = kernel_fn(d["view"], best_cfg, interpret=interpret)
            t_k = timeit(f, *args_k, iters=iters, reps=1 if small else 3)
            out_k = f(*args_k)
            row.update(us=t_k * 1e6, paged_ms=t_k * 1e3, paged_tflops=flops / t_k / 1e12)
            if best_cfg != default:
                fd = kernel_fn(d["view"], default, interpret=interpret)
                t_d = timeit(fd, *args_k, iters=iters, reps=1 if small else 3)
                row.update(paged_default_ms=t_d * 1e3, paged_default_tflops=flops / t_d / 1e12)
        except Exception as e:
            print(f"  paged kernel FAILED at B={B} prefix={p}: {type(e).__name__}: {str(e)[:500]}", flush=True)
            out_k = None
        try:
            qf, kf, vf = d["q_full"], d["k_full"], d["v_full"]
            t_b = timeit(base_fn, qf, kf, vf, iters=iters, reps=1 if small else 3)
            S = d["S"]
            row.update(base_impl=baseline_impl, base_ms=t_b * 1e3, base_S=S,
                       base_tflops=4 * Hq * D * B * (S * (S + 1) // 2) / t_b / 1e12)
            if out_k is not None:
                row["max_rel_diff_vs_base"] = rel_err(out_k, base_fn(qf, kf, vf)[:, p:p + T])
        except Exception as e:
            print(f"  baseline FAILED at B={B} prefix={p}: {type(e).__name__}: {str(e)[:500]}", flush=True)
        if "paged_tflops" in row and "base_tflops" in row:
            row["ratio"] = row["paged_tflops"] / row["base_tflops"]
        if (B, p) in mg:
            m = mg[(B, p)]
            row.update(mgpu_ms=m["mgpu_ms"], mgpu_tflops=m["mgpu_tflops"], mgpu_config=m.get("mgpu_config"))
            if "base_tflops" in row:
                row["mgpu_ratio"] = row["mgpu_tflops"] / row["base_tflops"]
        nan = float("nan")
        print(f"{B:>2} {T:>5} {p:>6} | {row.get('paged_ms', nan):9.3f} {row.get('paged_tflops', nan):8.1f} | "
              f"{row.get('mgpu_ms', nan):8.3f} {row.get('mgpu_tflops', nan):8.1f} | "
              f"{row.get('base_ms', nan):9.3f} {row.get('base_tflops', nan):8.1f}              | "
              f"{row.get('ratio', nan):11.2f} | {row.get('mgpu_ratio', nan):9.2f} | "
              f"{row.get('max_rel_diff_vs_base', nan):.2e}", flush=True)
        results.append(row)
        del d
    perf = [r for r in results if r.get("kind") == "perf" and "ratio" in r]
    if perf:
        gm = math.exp(sum(math.log(r["ratio"]) for r in perf) / len(perf))
        print(f"  geomean Triton/{baseline_impl} TFLOP/s ratio {gm:.2f} (goal >= 0.8), config {best_cfg}; "
              f"correctness {'OK' if all_ok else 'FAILED'}", flush=True)
        results.append(dict(bench="prefill", kind="summary", impl="triton", geomean_ratio=gm, config=list(best_cfg)))
    perf_m = [r for r in results if r.get("kind") == "perf" and "mgpu_ratio" in r]
    if perf_m:
        gm = math.exp(sum(math.log(r["mgpu_ratio"]) for r in perf_m) / len(perf_m))
        print(f"  geomean MosaicGPU/{baseline_impl} TFLOP/s ratio {gm:.2f} (goal >= 0.8), config "
              f"{perf_m[0].get('mgpu_config')}", flush=True)
        results.append(dict(bench="prefill", kind="summary", impl="mgpu", geomean_ratio=gm,
                            config=perf_m[0].get("mgpu_config")))
    return results


def run_mgpu(results, args):
    """The Mosaic GPU kernel: correctness vs the reference on the GPU checks it supports, a config
    sweep on SWEEP_SHAPES, then one timing per TABLE_SHAPES row (rows carry mgpu_ms / mgpu_tflops
    for run()'s table).  Times only after every check passed."""
    from umem_jax.pallas_kernels.paged_prefill_mgpu import mgpu_available

    ok, why = mgpu_available()
    if not ok or jax.default_backend() != "gpu":
        print(f"  mgpu: skipped ({why or 'needs an NVIDIA GPU'})", flush=True)
        results.append(dict(bench="prefill", kind="mgpu_skipped", why=why or "no GPU"))
        return results
    iters = int(getattr(args, "iters", 0) or 20)
    arena_gib = float(getattr(args, "arena_gib", 0) or 6.0)
    budget = float(getattr(args, "mgpu_budget", 0) or 150.0)
    deadline = time.time() + budget
    g = GPU_GEOMETRY
    Hq, Hkv, D, ps, T = g["Hq"], g["Hkv"], g["D"], g["ps"], g["T"]
    key = jax.random.PRNGKey(0)
    path = getattr(args, "json", None)

    def save():  # after every phase, so a child killed on its time limit still reports
        if path:
            _dump(path, results)

    print(f"== Mosaic GPU paged prefill: jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    all_ok = True
    for name, shp, kw in GPU_CHECKS:
        kw = dict(kw)
        d = build(key, arena_gib=arena_gib, **shp)
        if kw.pop("sinks", False):
            kw["sinks"] = jax.random.normal(key, (shp["Hq"],), jnp.float32)
        cfg = (64, 2, True) if shp["D"] > 128 else MGPU_CONFIGS[0]  # D=256: 64-token blocks fit shared memory
        t0 = time.time()
        try:
            ok, err = check_vs_reference("mgpu " + name, d, fn=lambda view, **k: mgpu_fn(view, cfg, **k), **kw)
        except Exception as e:
            print(f"  correctness mgpu {name}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
            ok, err = False, None
        print(f"    ({time.time() - t0:.1f} s with compile)", flush=True)
        all_ok &= ok
        results.append(dict(bench="prefill", kind="correctness", impl="mgpu", case=name, rel_err=err, ok=ok))
        save()
        del d
    if not all_ok:
        print("  mgpu: a correctness check failed; not timing it", flush=True)
        return results

    data = {bp: build(key, B=bp[0], T=T, prefix=bp[1], Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=arena_gib)
            for bp in SWEEP_SHAPES}
    scores = {}
    for cfg in MGPU_CONFIGS:
        if scores and time.time() > deadline - 45:
            print("  mgpu sweep: time budget reached, stopping", flush=True)
            break
        try:
            tf = []
            for (B, p), d in data.items():
                f = mgpu_fn(d["view"], cfg)
                t = timeit(f, d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"], iters=iters, reps=2)
                tf.append(_flops(Hq, D, B, p, T) / t / 1e12)
            scores[cfg] = math.exp(sum(map(math.log, tf)) / len(tf))
            print(f"  mgpu sweep block_kv={cfg[0]:>3} steps={cfg[1]} schedule_barrier={cfg[2]!s:<5}: "
                  + "  ".join(f"{x:7.1f}" for x in tf) + " TFLOP/s", flush=True)
        except Exception as e:
            print(f"  mgpu sweep {cfg}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                  flush=True)
        results.append(dict(bench="prefill", kind="sweep", impl="mgpu", config=list(cfg),
                            tflops_geomean=scores.get(cfg)))
        save()
    del data
    if not scores:
        return results
    best = max(scores, key=scores.get)
    print(f"  best Mosaic GPU config {best} (block_kv, steps, schedule_barrier): {scores[best]:.1f} TFLOP/s geomean",
          flush=True)
    for B, p in TABLE_SHAPES:
        if time.time() > deadline:
            print(f"  mgpu B={B} prefix={p}: skipped (time budget reached)", flush=True)
            continue
        d = build(key, B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=arena_gib)
        try:
            f = mgpu_fn(d["view"], best)
            args_k = (d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"])
            t = timeit(f, *args_k, iters=iters, reps=3)
            tfl = _flops(Hq, D, B, p, T) / t / 1e12
            results.append(dict(bench="prefill", kind="perf", impl="mgpu", B=B, T=T, prefix=p, mgpu_ms=t * 1e3,
                                mgpu_tflops=tfl, mgpu_config=list(best)))
            print(f"  mgpu B={B} T={T} prefix={p}: {t * 1e3:.3f} ms {tfl:.1f} TFLOP/s", flush=True)
            save()
        except Exception as e:
            print(f"  mgpu B={B} prefix={p}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        del d
    return results


def _dump(path, results):
    with open(path, "w") as fh:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=results), fh, indent=1, default=str)


def _mgpu_child(args, timeout):
    """Run `--mgpu` in a child process (this process must leave it the GPU: no preallocation, idle
    meanwhile) and return its rows; a hang or crash costs `timeout` seconds, not the run."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--mgpu", "--json", path, "--mgpu-budget", str(timeout - 20)]
    if args.arena_gib:
        cmd += ["--arena-gib", str(args.arena_gib)]
    if args.iters:
        cmd += ["--iters", str(args.iters)]
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
        note = f"exit {rc}"
    except subprocess.TimeoutExpired:
        note = f"killed after {timeout} s (hang?)"
    print(f"  mgpu child: {note}, {time.time() - t0:.0f} s", flush=True)
    rows = []
    try:
        with open(path) as fh:
            rows = json.load(fh).get("rows", [])
    except (OSError, ValueError):
        rows = [dict(bench="prefill", kind="mgpu_failed", note=note)]
    os.unlink(path)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=0, help="calls per timing rep (default 20; 1 with --small)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the tiling sweep")
    ap.add_argument("--arena-gib", type=float, default=0.0, help="arena size (default 6 GiB on GPU, > 4 GiB)")
    ap.add_argument("--json", default=None, help="write the result rows here (default $OUT/bench_prefill.json if $OUT)")
    ap.add_argument("--budget", dest="prefill_budget", type=float, default=None,
                    help="seconds from the start; past it the sweep stops and later shapes are skipped "
                         "(default 420; 350 with --tune, the Mosaic GPU child included)")
    ap.add_argument("--tune", action="store_true",
                    help="the Mosaic GPU kernel (child process) + the wide Triton sweep + the joint table")
    ap.add_argument("--mgpu", action="store_true", help="only the Mosaic GPU kernel (checks, sweep, timings)")
    ap.add_argument("--mgpu-timeout", type=float, default=150.0,
                    help="seconds the --tune child may take before it is killed (default 150)")
    ap.add_argument("--mgpu-budget", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    t_start = time.time()
    path = args.json or (os.path.join(os.environ["OUT"], "bench_prefill.json") if os.environ.get("OUT") else None)
    if args.mgpu:
        results = run_mgpu([], args)
    else:
        if args.prefill_budget is None:
            args.prefill_budget = 350.0 if args.tune else 420.0
        child_rows = []
        if args.tune and not args.small:
            # The Mosaic GPU child runs between the Triton sweep and the table, while this process
            # is idle; without preallocation both fit on the card (set before the backend starts).
            if not any(k in os.environ for k in _MEM_ENV):
                os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            args.deadline = t_start + args.prefill_budget
            args.sweep_reserve = args.mgpu_timeout + 80  # the child, then ~80 s for the table

            def before_table():
                child_rows.extend(_mgpu_child(args, args.mgpu_timeout))
                return child_rows

            args.before_table = before_table
        results = run([], args)
        results += [dict(r, source="mgpu_child") for r in child_rows if r.get("kind") != "perf"]
    if path:
        _dump(path, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
