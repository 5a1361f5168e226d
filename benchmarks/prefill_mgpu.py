"""The Mosaic GPU paged prefill kernel in the prefill benchmark: checks, a config sweep, timings.

`bench_prefill --tune` runs it in a child process (`mgpu_child`), between the Triton sweep and the
table: a hang or a crash in the kernel then costs the child's time limit, not the Triton results.
The child checks the kernel against the reference first and times it only if every check passed;
its rows carry mgpu_ms / mgpu_tflops per table shape for the parent's table.

`bench_prefill --fp8` (run_fp8) times the Mosaic GPU kernel's fp8 K/V path against the Triton
kernel's fp8 path and both kernels on a bf16 arena holding the same K/V, at the benchmark geometry
(32/8 heads, D=128, page 16, 4K-token chunks after prefix 0 and 4096); every kernel is checked
against the reference on its own arena first, and the Mosaic fp8 path is timed at its default
tiling (64-token blocks, a K and a V tile per consumer) and at FP8_MGPU_CONFIGS.  `auto` keeps
fp8 prefill on Triton until this has been measured (paged_prefill.prefill_backend).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from umem_jax.pallas_kernels.prefill_reference import paged_prefill_attention_reference

from .prefill_cases import (
    GPU_CHECKS,
    GPU_GEOMETRY,
    SWEEP_SHAPES,
    TABLE_SHAPES,
    best_time,
    build,
    check_vs_reference,
    flops,
    geomean,
    kernel_args,
    rel_err,
    with_sinks,
)
from .report import RowLog

# fp8 (block_kv, max_concurrent_steps) besides the default (64, 2): 128-token blocks leave one
# 16-bit tile per consumer at D = 128 (paged_prefill_mgpu.fp8_tiles), a deeper ring of 64.
FP8_MGPU_CONFIGS = [(128, 2), (64, 3)]
FP8_SHAPES = [(2, 0), (1, 4096)]  # (B, prefix) at GPU_GEOMETRY
# Mosaic GPU (block_kv, max_concurrent_steps, schedule_barrier); block_q is 64 per consumer.
# Shared memory at D=128: 32 KiB of Q/O + 2 * steps * block_kv * 256 B of K/V ring.
MGPU_CONFIGS = [(128, 2, True), (64, 3, True), (64, 4, True), (64, 2, True), (128, 2, False), (64, 3, False)]
REPO = Path(__file__).resolve().parents[1]


def mgpu_fn(view, cfg, **kw):
    """The Mosaic GPU kernel with cfg = (block_kv, max_concurrent_steps, schedule_barrier)."""
    from umem_jax.pallas_kernels.paged_prefill_mgpu import paged_prefill_attention_mgpu

    bkv, mcs, sched = cfg
    return jax.jit(functools.partial(paged_prefill_attention_mgpu, view=view, block_kv=bkv,
                                     max_concurrent_steps=mcs, schedule_barrier=sched, **kw))


def _checks(log: RowLog, key, arena_gib: float) -> bool:
    all_ok = True
    for name, shp, kw in GPU_CHECKS:
        kw = with_sinks(key, shp, kw)
        d = build(key, arena_gib=arena_gib, **shp)
        cfg = (64, 2, True) if shp["D"] > 128 else MGPU_CONFIGS[0]  # D=256: 64-token blocks fit shared memory
        t0 = time.time()
        try:
            ok, err = check_vs_reference("mgpu " + name, d, fn=lambda view, **k: mgpu_fn(view, cfg, **k), **kw)
        except Exception as e:
            print(f"  correctness mgpu {name}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
            ok, err = False, None
        print(f"    ({time.time() - t0:.1f} s with compile)", flush=True)
        all_ok &= ok
        log.add(dict(bench="prefill", kind="correctness", impl="mgpu", case=name, rel_err=err, ok=ok))
        del d
    return all_ok


def _sweep(log: RowLog, key, arena_gib: float, iters: int, deadline: float) -> dict:
    g = GPU_GEOMETRY
    data = {bp: build(key, B=bp[0], T=g["T"], prefix=bp[1], Hq=g["Hq"], Hkv=g["Hkv"], D=g["D"], ps=g["ps"],
                      arena_gib=arena_gib) for bp in SWEEP_SHAPES}
    scores = {}
    for cfg in MGPU_CONFIGS:
        if scores and time.time() > deadline - 45:
            print("  mgpu sweep: time budget reached, stopping", flush=True)
            break
        try:
            tf = []
            for (B, p), d in data.items():
                t = best_time(mgpu_fn(d["view"], cfg), kernel_args(d), iters=iters, reps=2)
                tf.append(flops(g["Hq"], g["D"], B, p, g["T"]) / t / 1e12)
            scores[cfg] = geomean(tf)
            print(f"  mgpu sweep block_kv={cfg[0]:>3} steps={cfg[1]} schedule_barrier={cfg[2]!s:<5}: "
                  + "  ".join(f"{x:7.1f}" for x in tf) + " TFLOP/s", flush=True)
        except Exception as e:
            print(f"  mgpu sweep {cfg}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                  flush=True)
        log.add(dict(bench="prefill", kind="sweep", impl="mgpu", config=list(cfg), tflops_geomean=scores.get(cfg)))
    return scores


def _table(log: RowLog, key, arena_gib: float, iters: int, deadline: float, best) -> None:
    g = GPU_GEOMETRY
    T = g["T"]
    for B, p in TABLE_SHAPES:
        if time.time() > deadline:
            print(f"  mgpu B={B} prefix={p}: skipped (time budget reached)", flush=True)
            continue
        d = build(key, B=B, T=T, prefix=p, Hq=g["Hq"], Hkv=g["Hkv"], D=g["D"], ps=g["ps"], arena_gib=arena_gib)
        try:
            t = best_time(mgpu_fn(d["view"], best), kernel_args(d), iters=iters, reps=3)
            tfl = flops(g["Hq"], g["D"], B, p, T) / t / 1e12
            log.add(dict(bench="prefill", kind="perf", impl="mgpu", B=B, T=T, prefix=p, mgpu_ms=t * 1e3,
                         mgpu_tflops=tfl, mgpu_config=list(best)))
            print(f"  mgpu B={B} T={T} prefix={p}: {t * 1e3:.3f} ms {tfl:.1f} TFLOP/s", flush=True)
        except Exception as e:
            print(f"  mgpu B={B} prefix={p}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        del d


def _skipped(log: RowLog, what: str) -> bool:
    """Whether the Mosaic GPU kernel cannot run here (no Hopper GPU, or jax < 0.11): says so, logs
    a `<what>_skipped` row."""
    from umem_jax.pallas_kernels.paged_prefill_mgpu import mgpu_available

    ok, why = mgpu_available()
    if ok and jax.default_backend() == "gpu":
        return False
    print(f"  {what}: skipped ({why or 'needs an NVIDIA GPU'})", flush=True)
    log.add(dict(bench="prefill", kind=f"{what}_skipped", why=why or "no GPU"))
    return True


def run_mgpu(args, log: RowLog) -> list[dict]:
    """Correctness vs the reference on the GPU checks, a config sweep on SWEEP_SHAPES, then one
    timing per TABLE_SHAPES row.  Every row goes to `log` as it comes (a child killed on its time
    limit still reports)."""
    if _skipped(log, "mgpu"):
        return log.rows
    iters = int(args.iters or 20)
    arena_gib = float(args.arena_gib or 6.0)
    deadline = time.time() + float(args.mgpu_budget or 150.0)
    key = jax.random.PRNGKey(0)
    print(f"== Mosaic GPU paged prefill: jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    if not _checks(log, key, arena_gib):
        print("  mgpu: a correctness check failed; not timing it", flush=True)
        return log.rows
    scores = _sweep(log, key, arena_gib, iters, deadline)
    if not scores:
        return log.rows
    best = max(scores, key=scores.get)
    print(f"  best Mosaic GPU config {best} (block_kv, steps, schedule_barrier): {scores[best]:.1f} TFLOP/s geomean",
          flush=True)
    _table(log, key, arena_gib, iters, deadline, best)
    return log.rows


def mgpu_child(args, timeout: float) -> list[dict]:
    """Run `bench_prefill --mgpu` in a child process (this process must leave it the GPU: no
    preallocation, idle meanwhile) and return its rows; a hang or crash costs `timeout` seconds."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "benchmarks.bench_prefill", "--mgpu", "--json", path,
           "--mgpu-budget", str(timeout - 20)]
    if args.arena_gib:
        cmd += ["--arena-gib", str(args.arena_gib)]
    if args.iters:
        cmd += ["--iters", str(args.iters)]
    t0 = time.time()
    try:
        rc = subprocess.run(cmd, timeout=timeout, cwd=REPO).returncode
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


def _fp8_fns(d, kind: str) -> dict:
    """label -> jitted kernel on the built batch d (kind "bf16" or "fp8"): the Triton and the Mosaic
    GPU kernel through the engine's entry point, and for fp8 the Mosaic one at FP8_MGPU_CONFIGS."""
    from umem_jax.pallas_kernels.paged_prefill import paged_prefill_attention
    from umem_jax.pallas_kernels.paged_prefill_mgpu import paged_prefill_attention_mgpu

    view = d["view"]
    fns = {f"{kind} {b}": jax.jit(functools.partial(paged_prefill_attention, view=view, impl="pallas", backend=b))
           for b in ("triton", "mgpu")}
    if kind == "fp8":
        for bkv, steps in FP8_MGPU_CONFIGS:
            fns[f"fp8 mgpu {bkv}x{steps}"] = jax.jit(functools.partial(
                paged_prefill_attention_mgpu, view=view, block_kv=bkv, max_concurrent_steps=steps))
    return fns


def run_fp8(args, log: RowLog) -> list[dict]:
    """For each FP8_SHAPES row: bf16 then fp8 arenas of the same K/V, every kernel of _fp8_fns
    checked against the reference on its arena (1.5e-2 of the largest output: fp8 Triton's
    tolerance) and, if right, timed.  Prints the table; rows go to `log`."""
    if _skipped(log, "fp8"):
        return log.rows
    iters = int(args.iters or 20)
    arena_gib = float(args.arena_gib or 6.0)
    key = jax.random.PRNGKey(0)
    g = GPU_GEOMETRY
    print(f"== prefill fp8 vs bf16 K/V: jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for B, p in FP8_SHAPES:
        nflops = flops(g["Hq"], g["D"], B, p, g["T"])
        row = dict(bench="prefill", kind="fp8", B=B, T=g["T"], prefix=p, shape=f"B={B} T={g['T']} prefix={p}")
        for kind in ("bf16", "fp8"):
            d = build(key, B=B, T=g["T"], prefix=p, Hq=g["Hq"], Hkv=g["Hkv"], D=g["D"], ps=g["ps"],
                      arena_gib=arena_gib, fp8=kind == "fp8")
            args_ = kernel_args(d)
            ref = jax.jit(functools.partial(paged_prefill_attention_reference, view=d["view"]))(*args_)
            for label, f in _fp8_fns(d, kind).items():
                try:
                    err = rel_err(f(*args_), ref)
                    t = best_time(f, args_, iters=iters, reps=3) if err <= 1.5e-2 else None
                except Exception as e:  # noqa: BLE001 - one kernel that does not compile must not end the run
                    print(f"  {row['shape']} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                key_ = label.replace(" ", "_")
                row[key_ + "_err"] = err
                if t is not None:
                    row[key_ + "_ms"] = t * 1e3
                print(f"  {row['shape']} {label:<18} " + (f"{t * 1e3:8.3f} ms {nflops / t / 1e12:6.1f} TFLOP/s"
                      if t else "not timed") + f"  rel err {err:.2e}{'' if t else ' WRONG'}", flush=True)
            del d, ref
        rows.append(log.add(row))
    print("\n" + fp8_table(rows))
    return log.rows


def fp8_table(rows) -> str:
    """Triton vs Mosaic GPU on fp8 K/V (speed-up: Triton's time / Mosaic's), and each kernel's fp8
    time over its bf16 time, per shape (ms)."""
    g = GPU_GEOMETRY
    head = (f"{'shape':<22} | {'triton bf16':>11} {'mgpu bf16':>9} | {'triton fp8':>10} {'mgpu fp8':>8} "
            f"{'TFLOP/s':>7} | {'fp8 mgpu speed-up':>17} {'mgpu fp8/bf16 t':>15} {'triton fp8/bf16 t':>17} | "
            "mgpu fp8 other tilings")
    out = [head]
    ratio = lambda x, y: f"{x / y:.3f}" if x and y else "-"
    ms = lambda x: f"{x:.3f}" if x else "-"
    for r in rows:
        tb, mb, tf, mf = (r.get(k) for k in ("bf16_triton_ms", "bf16_mgpu_ms", "fp8_triton_ms", "fp8_mgpu_ms"))
        tfl = flops(g["Hq"], g["D"], r["B"], r["prefix"], r["T"]) / (mf * 1e-3) / 1e12 if mf else None
        alt = " ".join(f"{b}x{s}={ms(r.get(f'fp8_mgpu_{b}x{s}_ms'))}" for b, s in FP8_MGPU_CONFIGS)
        out.append(f"{r['shape']:<22} | {ms(tb):>11} {ms(mb):>9} | {ms(tf):>10} {ms(mf):>8} "
                   f"{(f'{tfl:.1f}' if tfl else '-'):>7} | {ratio(tf, mf):>17} {ratio(mf, mb):>15} "
                   f"{ratio(tf, tb):>17} | {alt}")
    return "\n".join(out)
