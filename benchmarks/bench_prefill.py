"""Paged prefill attention (Pallas Triton) vs cuDNN dense flash attention on the same tokens.

GPU (one H200):   python benchmarks/bench_prefill.py [--json out.json] [--no-sweep]
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
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from umem_jax.memory.plan import KVView  # noqa: E402
from umem_jax.pallas_kernels._compat import silence_triton_deprecation  # noqa: E402
from umem_jax.pallas_kernels.kv_write import write_kv_reference  # noqa: E402
from umem_jax.pallas_kernels.paged_prefill import (paged_prefill_attention,  # noqa: E402
                                                   paged_prefill_attention_reference, prefill_config)

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
    return jax.jit(functools.partial(paged_prefill_attention, view=view, impl="pallas", interpret=interpret,
                                     block_q=bq, block_k=bk, num_warps=nw, num_stages=ns, **kw))


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    return float(np.abs(a - b).max() / max(1e-6, float(np.abs(b).max())))


def check_vs_reference(name, d, cfg=None, interpret=False, **kw):
    """Kernel vs reference on one built batch; returns (ok, rel err)."""
    G = d["q"].shape[2] // d["view"].num_kv_heads
    cfg = cfg or _cfg_tuple(prefill_config(d["q"].shape[1], G, d["q"].shape[3]))
    args = (d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"])
    out = kernel_fn(d["view"], cfg, interpret=interpret, **kw)(*args)
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


def run(results, args):
    """Entry point for bench_kernels.py: appends one dict per measured row to `results`."""
    silence_triton_deprecation()
    small = bool(getattr(args, "small", False))
    iters = int(getattr(args, "iters", 0) or (1 if small else 20))
    sweep = bool(getattr(args, "sweep", True))
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
    else:
        Hq, Hkv, D, ps, T = 32, 8, 128, 16, 4096
        shapes = [(1, 0), (2, 0), (4, 0), (1, 4096), (2, 4096), (4, 4096)]
        checks = [("B=3 T=1024 prefix 0/1000 + padding row", dict(B=3, T=1024, prefix=0, prefixes=[0, 1000, 0],
                                                                  q_lens=[1024, 1024, 0], Hq=32, Hkv=8, D=128, ps=16), {}),
                  ("GQA8 ps64 window 512 + softcap 30 + sinks", dict(B=2, T=1024, prefix=0, prefixes=[3000, 100],
                                                                      q_lens=[1024, 700], Hq=32, Hkv=4, D=128, ps=64),
                   dict(window=512, softcap=30.0, sinks=True)),
                  ("D=256 GQA2 ps32 window 1024", dict(B=2, T=512, prefix=0, prefixes=[2000, 0], q_lens=[512, 300],
                                                       Hq=8, Hkv=4, D=256, ps=32), dict(window=1024))]
        # (block_q, block_k, num_warps, num_stages); block_q * G rows per program, G = 4 here.
        # All compile without spills for sm_90a (Triton 3.6 + ptxas, offline); 4-warp 128-row tiles
        # spill heavily and are left out.
        configs = [(32, 64, 8, 3), (32, 64, 8, 4), (32, 64, 8, 2), (32, 32, 8, 4), (16, 64, 4, 3),
                   (16, 64, 4, 2), (32, 128, 8, 2), (16, 128, 4, 2)]

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
        sweep_shapes = [(2, 0), (1, 4096)] if not small else [(1, 0)]
        data = [build(key, B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=arena_gib) for B, p in sweep_shapes]
        scores = {}
        for cfg in dict.fromkeys([default] + configs):
            if scores and over(reserve=150):
                print("  sweep: time budget reached, stopping", flush=True)
                break
            try:
                ts = []
                for (B, p), d in zip(sweep_shapes, data):
                    f = kernel_fn(d["view"], cfg, interpret=interpret)
                    ts.append(timeit(f, d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"],
                                     iters=iters, reps=1 if small else 2))
                tf = [4 * Hq * D * B * pairs(p, T) / t / 1e12 for (B, p), t in zip(sweep_shapes, ts)]
                scores[cfg] = math.exp(sum(map(math.log, tf)) / len(tf))
                print(f"  sweep block_q={cfg[0]:>3} block_k={cfg[1]:>3} warps={cfg[2]} stages={cfg[3]}: "
                      + "  ".join(f"{x:7.1f}" for x in tf) + " TFLOP/s", flush=True)
            except Exception as e:  # a config the compiler refuses (e.g. out of shared memory)
                print(f"  sweep {cfg}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            results.append(dict(bench="prefill", kind="sweep", config=list(cfg), tflops_geomean=scores.get(cfg)))
        if scores:
            best_cfg = max(scores, key=scores.get)
        del data
        print(f"  best config {best_cfg} (default {default})", flush=True)

    # ---- (3) the table
    print(f"{'B':>2} {'T':>5} {'prefix':>6} | {'paged ms':>9} {'TFLOP/s':>8} | {baseline_impl + ' ms':>9} "
          f"{'TFLOP/s':>8} (S=prefix+T) | ratio | max|diff| vs baseline", flush=True)
    for B, p in shapes:
        if over():
            print(f"  B={B} prefix={p}: skipped (time budget reached)", flush=True)
            results.append(dict(bench="prefill", kind="perf", name="prefill_paged", B=B, T=T, prefix=p,
                                note="skipped: time budget reached"))
            continue
        d = build(key, B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=arena_gib)
        args_k = (d["q"], d["arena"], d["page_table"], d["q_lens"], d["kv_lens"])
        row = dict(bench="prefill", kind="perf", name="prefill_paged", shape=f"B={B} T={T} prefix={p} {Hq}/{Hkv}x{D} ps{ps}",
                   B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, page_size=ps,
                   arena_gib=round(d["num_pages"] * d["view"].rows_per_page * d["view"].row_words * 2 / 2**30, 2),
                   config=list(best_cfg))
        try:
            f = kernel_fn(d["view"], best_cfg, interpret=interpret)
            t_k = timeit(f, *args_k, iters=iters, reps=1 if small else 3)
            out_k = f(*args_k)
            row.update(us=t_k * 1e6, paged_ms=t_k * 1e3, paged_tflops=4 * Hq * D * B * pairs(p, T) / t_k / 1e12)
            if best_cfg != default:
                fd = kernel_fn(d["view"], default, interpret=interpret)
                t_d = timeit(fd, *args_k, iters=iters, reps=1 if small else 3)
                row.update(paged_default_ms=t_d * 1e3, paged_default_tflops=4 * Hq * D * B * pairs(p, T) / t_d / 1e12)
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
        print(f"{B:>2} {T:>5} {p:>6} | {row.get('paged_ms', float('nan')):9.3f} {row.get('paged_tflops', float('nan')):8.1f} | "
              f"{row.get('base_ms', float('nan')):9.3f} {row.get('base_tflops', float('nan')):8.1f}              | "
              f"{row.get('ratio', float('nan')):5.2f} | {row.get('max_rel_diff_vs_base', float('nan')):.2e}", flush=True)
        results.append(row)
        del d
    perf = [r for r in results if r.get("kind") == "perf" and "ratio" in r]
    if perf:
        gm = math.exp(sum(math.log(r["ratio"]) for r in perf) / len(perf))
        print(f"  geomean paged/{baseline_impl} TFLOP/s ratio {gm:.2f} (goal >= 0.8); correctness "
              f"{'OK' if all_ok else 'FAILED'}", flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=0, help="calls per timing rep (default 20; 1 with --small)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the tiling sweep")
    ap.add_argument("--arena-gib", type=float, default=0.0, help="arena size (default 6 GiB on GPU, > 4 GiB)")
    ap.add_argument("--json", default=None, help="write the result rows here (default $OUT/bench_prefill.json if $OUT)")
    ap.add_argument("--budget", dest="prefill_budget", type=float, default=420.0,
                    help="seconds; past it the sweep stops and later shapes are skipped (default 420)")
    args = ap.parse_args(argv)
    path = args.json or (os.path.join(os.environ["OUT"], "bench_prefill.json") if os.environ.get("OUT") else None)
    results = run([], args)
    if path:
        with open(path, "w") as fh:
            json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=results), fh, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
