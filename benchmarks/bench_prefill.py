"""Paged prefill attention (Pallas Triton) vs cuDNN dense flash attention on the same tokens.

GPU (one H200):   python3 -m benchmarks.bench_prefill [--json out.json] [--no-sweep]
Tuning run:       python3 -m benchmarks.bench_prefill --tune   (<= ~6 min: checks, the wide Triton sweep,
                  then the Mosaic GPU kernel in a child process with a time limit (checks, its own
                  sweep, timings), then the table with Triton, Mosaic GPU and cuDNN side by side)
Mosaic GPU only:  python3 -m benchmarks.bench_prefill --mgpu [--json out.json]
fp8 K/V:          python3 -m benchmarks.bench_prefill --fp8    (Mosaic GPU fp8 vs Triton fp8 vs both on
                  bf16, B=2 prefix 0 and B=1 prefix 4096; prefill_mgpu.run_fp8)
CPU smoke test:   python3 -m benchmarks.bench_prefill --small      (interpret mode, seconds)

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

The Mosaic GPU kernel (paged_prefill_mgpu.py) runs in a child process under --tune (prefill_mgpu.py):
a hang or a crash in it then costs its time limit, not the Triton results or the table.
Cases, checks and the kernel call: prefill_cases.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_MEM_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
if __name__ == "__main__" and "--tune" in sys.argv[1:] and not any(k in os.environ for k in _MEM_ENV):
    # --tune starts a second GPU process (the Mosaic GPU child) while this one holds its arrays:
    # no preallocation, set before jax can read it (main() repeats it for programmatic calls).
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax  # noqa: E402

from umem_jax.pallas_kernels._compat import silence_triton_deprecation  # noqa: E402
from umem_jax.pallas_kernels.paged_prefill import prefill_config  # noqa: E402

from .prefill_cases import (  # noqa: E402
    GPU_CHECKS,
    GPU_GEOMETRY,
    SWEEP_CONFIGS,
    SWEEP_SHAPES,
    TABLE_SHAPES,
    TUNE_CONFIGS,
    best_time,
    build,
    cfg_tuple,
    check_vs_reference,
    flops,
    geomean,
    kernel_args,
    kernel_fn,
    rel_err,
    with_sinks,
)
from .prefill_mgpu import mgpu_child, run_fp8, run_mgpu  # noqa: E402
from .report import RowLog, json_path  # noqa: E402

__all__ = ["build", "main", "rel_err", "run"]  # build and rel_err: the GPU tests build their cases here

SMALL_CHECKS = [
    ("bf16 prefix 0/17 + padding row", dict(B=3, T=32, prefix=0, prefixes=[0, 17, 0], q_lens=[32, 20, 0],
                                            Hq=4, Hkv=1, D=64, ps=16), {}),
    ("window 24 + softcap + sinks", dict(B=2, T=32, prefix=0, prefixes=[40, 3], q_lens=[32, 9],
                                         Hq=8, Hkv=1, D=64, ps=16), dict(window=24, softcap=20.0, sinks=True)),
]


def cases(a) -> dict:
    """Geometry, table shapes, checks, sweep configs and sweep shapes of this run."""
    if a.small:
        return dict(Hq=4, Hkv=1, D=64, ps=16, T=32, shapes=[(1, 0), (2, 32)], checks=SMALL_CHECKS,
                    configs=[(16, 16, 4, 2), (32, 32, 4, 2)], sweep_shapes=[(1, 0)])
    return dict(GPU_GEOMETRY, shapes=TABLE_SHAPES, checks=GPU_CHECKS,
                configs=TUNE_CONFIGS if a.tune else SWEEP_CONFIGS, sweep_shapes=SWEEP_SHAPES)


def correctness(a, log: RowLog, c: dict, key) -> bool:
    """Kernel vs the plain-JAX reference on every check case, before anything is timed."""
    all_ok = True
    for name, shp, kw in c["checks"]:
        d = build(key, arena_gib=a.arena_gib, **shp)
        kw = with_sinks(key, shp, kw)
        try:
            ok, err = check_vs_reference(name, d, interpret=a.small, **kw)
        except Exception as e:  # report and go on to the timings
            print(f"  correctness {name}: FAILED {type(e).__name__}: {str(e)[:1000]}", flush=True)
            ok, err = False, None
        all_ok &= ok
        log.add(dict(bench="prefill", kind="correctness", case=name, rel_err=err, ok=ok))
        del d
    return all_ok


def sweep(a, log: RowLog, c: dict, key, default):
    """Tiling sweep on the sweep shapes; the best geometric mean of TFLOP/s wins -> its config."""
    Hq, Hkv, D, ps, T = c["Hq"], c["Hkv"], c["D"], c["ps"], c["T"]
    data = [build(key, B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=a.arena_gib)
            for B, p in c["sweep_shapes"]]
    scores = {}
    for cfg in dict.fromkeys([default] + c["configs"]):
        if scores and time.time() > a.deadline - a.sweep_reserve:
            print("  sweep: time budget reached, stopping", flush=True)
            break
        try:
            ts = [best_time(kernel_fn(d["view"], cfg, interpret=a.small), kernel_args(d), iters=a.iters,
                            reps=1 if a.small else 2) for d in data]
            tf = [flops(Hq, D, B, p, T) / t / 1e12 for (B, p), t in zip(c["sweep_shapes"], ts)]
            scores[cfg] = geomean(tf)
            print(f"  sweep block_q={cfg[0]:>3} block_k={cfg[1]:>3} warps={cfg[2]:>2} stages={cfg[3]}: "
                  + "  ".join(f"{x:7.1f}" for x in tf) + " TFLOP/s", flush=True)
        except Exception as e:  # a config the compiler refuses (e.g. out of shared memory)
            print(f"  sweep {cfg}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)
        log.add(dict(bench="prefill", kind="sweep", impl="triton", config=list(cfg), tflops_geomean=scores.get(cfg)))
    best_cfg = max(scores, key=scores.get) if scores else default
    del data
    print(f"  best Triton config {best_cfg} (block_q, block_k, warps, stages): "
          f"{scores.get(best_cfg, float('nan')):.1f} TFLOP/s geomean; default {default}: "
          f"{scores.get(default, float('nan')):.1f}", flush=True)
    return best_cfg


def _time_kernel(a, row, d, cfg, default, nflops):
    """The paged kernel at cfg (and at the default config when the sweep chose another) -> its output."""
    reps = 1 if a.small else 3
    f = kernel_fn(d["view"], cfg, interpret=a.small)
    t_k = best_time(f, kernel_args(d), iters=a.iters, reps=reps)
    out_k = f(*kernel_args(d))
    row.update(us=t_k * 1e6, paged_ms=t_k * 1e3, paged_tflops=nflops / t_k / 1e12)
    if cfg != default:
        t_d = best_time(kernel_fn(d["view"], default, interpret=a.small), kernel_args(d), iters=a.iters, reps=reps)
        row.update(paged_default_ms=t_d * 1e3, paged_default_tflops=nflops / t_d / 1e12)
    return out_k


def _time_baseline(a, row, d, base_fn, out_k, p, c):
    """Dense attention over the whole sequence S = prefix + T; its last T rows cross-check the kernel."""
    qf, kf, vf = d["q_full"], d["k_full"], d["v_full"]
    t_b = best_time(base_fn, (qf, kf, vf), iters=a.iters, reps=1 if a.small else 3)
    S = d["S"]
    row.update(base_impl=a.baseline_impl, base_ms=t_b * 1e3, base_S=S,
               base_tflops=4 * c["Hq"] * c["D"] * row["B"] * (S * (S + 1) // 2) / t_b / 1e12)
    if out_k is not None:
        row["max_rel_diff_vs_base"] = rel_err(out_k, base_fn(qf, kf, vf)[:, p:p + c["T"]])


def table_row(a, c: dict, key, B: int, p: int, best_cfg, default, base_fn, mgpu: dict) -> dict:
    Hq, Hkv, D, ps, T = c["Hq"], c["Hkv"], c["D"], c["ps"], c["T"]
    d = build(key, B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, ps=ps, arena_gib=a.arena_gib)
    row = dict(bench="prefill", kind="perf", name="prefill_paged", shape=f"B={B} T={T} prefix={p} {Hq}/{Hkv}x{D} ps{ps}",
               B=B, T=T, prefix=p, Hq=Hq, Hkv=Hkv, D=D, page_size=ps,
               arena_gib=round(d["num_pages"] * d["view"].rows_per_page * d["view"].row_words * 2 / 2**30, 2),
               config=list(best_cfg))
    out_k = None
    try:
        out_k = _time_kernel(a, row, d, best_cfg, default, flops(Hq, D, B, p, T))
    except Exception as e:
        print(f"  paged kernel FAILED at B={B} prefix={p}: {type(e).__name__}: {str(e)[:500]}", flush=True)
    try:
        _time_baseline(a, row, d, base_fn, out_k, p, c)
    except Exception as e:
        print(f"  baseline FAILED at B={B} prefix={p}: {type(e).__name__}: {str(e)[:500]}", flush=True)
    if "paged_tflops" in row and "base_tflops" in row:
        row["ratio"] = row["paged_tflops"] / row["base_tflops"]
    if (B, p) in mgpu:
        m = mgpu[(B, p)]
        row.update(mgpu_ms=m["mgpu_ms"], mgpu_tflops=m["mgpu_tflops"], mgpu_config=m.get("mgpu_config"))
        if "base_tflops" in row:
            row["mgpu_ratio"] = row["mgpu_tflops"] / row["base_tflops"]
    nan = float("nan")
    print(f"{B:>2} {T:>5} {p:>6} | {row.get('paged_ms', nan):9.3f} {row.get('paged_tflops', nan):8.1f} | "
          f"{row.get('mgpu_ms', nan):8.3f} {row.get('mgpu_tflops', nan):8.1f} | "
          f"{row.get('base_ms', nan):9.3f} {row.get('base_tflops', nan):8.1f}              | "
          f"{row.get('ratio', nan):11.2f} | {row.get('mgpu_ratio', nan):9.2f} | "
          f"{row.get('max_rel_diff_vs_base', nan):.2e}", flush=True)
    return row


def summary(a, log: RowLog, best_cfg, all_ok: bool) -> None:
    perf = [r for r in log.rows if r.get("kind") == "perf" and "ratio" in r]
    if perf:
        gm = geomean([r["ratio"] for r in perf])
        print(f"  geomean Triton/{a.baseline_impl} TFLOP/s ratio {gm:.2f} (goal >= 0.8), config {best_cfg}; "
              f"correctness {'OK' if all_ok else 'FAILED'}", flush=True)
        log.add(dict(bench="prefill", kind="summary", impl="triton", geomean_ratio=gm, config=list(best_cfg)))
    perf_m = [r for r in log.rows if r.get("kind") == "perf" and "mgpu_ratio" in r]
    if perf_m:
        gm = geomean([r["mgpu_ratio"] for r in perf_m])
        print(f"  geomean MosaicGPU/{a.baseline_impl} TFLOP/s ratio {gm:.2f} (goal >= 0.8), config "
              f"{perf_m[0].get('mgpu_config')}", flush=True)
        log.add(dict(bench="prefill", kind="summary", impl="mgpu", geomean_ratio=gm,
                     config=perf_m[0].get("mgpu_config")))


def run(a, log: RowLog, before_table=None) -> list[dict]:
    """(1) correctness, (2) the tiling sweep, then `before_table()` (--tune: the Mosaic GPU child,
    whose rows join the table as extra columns), (3) the table and its geometric means."""
    silence_triton_deprecation()
    on_gpu = jax.default_backend() == "gpu"
    if not a.small and not on_gpu:
        print("bench_prefill: no GPU; run with --small for the CPU interpret-mode smoke test")
        return log.rows
    a.baseline_impl = "cudnn" if on_gpu else "xla"
    c = cases(a)
    key = jax.random.PRNGKey(0)
    print(f"== paged prefill attention: backend {jax.default_backend()}, jax {jax.__version__}, "
          f"baseline {a.baseline_impl}", flush=True)
    all_ok = correctness(a, log, c, key)
    base_fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                   implementation=a.baseline_impl))
    default = cfg_tuple(prefill_config(c["T"], c["Hq"] // c["Hkv"], c["D"]))
    best_cfg = sweep(a, log, c, key, default) if a.sweep else default
    mgpu_rows = before_table() if before_table is not None else []
    mgpu = {(r["B"], r["prefix"]): r for r in mgpu_rows if r.get("kind") == "perf" and "mgpu_ms" in r}
    print(f"{'B':>2} {'T':>5} {'prefix':>6} | {'triton ms':>9} {'TFLOP/s':>8} | {'mgpu ms':>8} {'TFLOP/s':>8} | "
          f"{a.baseline_impl + ' ms':>9} {'TFLOP/s':>8} (S=prefix+T) | triton/base | mgpu/base | max|diff| vs base",
          flush=True)
    for B, p in c["shapes"]:
        if time.time() > a.deadline:
            print(f"  B={B} prefix={p}: skipped (time budget reached)", flush=True)
            log.add(dict(bench="prefill", kind="perf", name="prefill_paged", B=B, T=c["T"], prefix=p,
                         note="skipped: time budget reached"))
            continue
        log.add(table_row(a, c, key, B, p, best_cfg, default, base_fn, mgpu))
    summary(a, log, best_cfg, all_ok)
    return log.rows


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in interpret mode (CPU smoke test)")
    ap.add_argument("--iters", type=int, default=0, help="calls per timing rep (default 20; 1 with --small)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the tiling sweep")
    ap.add_argument("--arena-gib", type=float, default=0.0, help="arena size (default 6 GiB on GPU, > 4 GiB)")
    ap.add_argument("--json", default=None, help="write the result rows here (default $OUT/bench_prefill.json if $OUT)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds from the start; past it the sweep stops and later shapes are skipped "
                         "(default 420; 350 with --tune, the Mosaic GPU child included)")
    ap.add_argument("--tune", action="store_true",
                    help="the Mosaic GPU kernel (child process) + the wide Triton sweep + the joint table")
    ap.add_argument("--mgpu", action="store_true", help="only the Mosaic GPU kernel (checks, sweep, timings)")
    ap.add_argument("--fp8", action="store_true",
                    help="only fp8 K/V: the Mosaic GPU and Triton kernels on fp8 and on bf16 arenas of the same K/V")
    ap.add_argument("--mgpu-timeout", type=float, default=150.0,
                    help="seconds the --tune child may take before it is killed (default 150)")
    ap.add_argument("--mgpu-budget", type=float, default=0.0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    t_start = time.time()
    if a.mgpu or a.fp8:
        if a.fp8:
            silence_triton_deprecation()  # the fp8 rows time the Triton kernel too
        only = run_fp8 if a.fp8 else run_mgpu
        only(a, RowLog(json_path(a.json, "bench_prefill"), jax=jax.__version__, device=str(jax.devices()[0])))
        return 0
    a.iters = a.iters or (1 if a.small else 20)
    a.budget = a.budget if a.budget is not None else (350.0 if a.tune else 420.0)
    a.deadline = t_start + a.budget
    a.sweep_reserve = 150.0  # seconds the table needs after the sweep
    a.arena_gib = a.arena_gib or (0.0 if a.small else 6.0)
    child_rows = []
    before_table = None
    if a.tune and not a.small:
        # The Mosaic GPU child runs between the Triton sweep and the table, while this process
        # is idle; without preallocation both fit on the card (set before the backend starts).
        if not any(k in os.environ for k in _MEM_ENV):
            os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        a.sweep_reserve = a.mgpu_timeout + 80  # the child, then ~80 s for the table

        def before_table():
            child_rows.extend(mgpu_child(a, a.mgpu_timeout))
            return child_rows

    log = RowLog(json_path(a.json, "bench_prefill"), jax=jax.__version__, device=str(jax.devices()[0]))
    run(a, log, before_table)
    for r in child_rows:
        if r.get("kind") != "perf":
            log.add(dict(r, source="mgpu_child"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
