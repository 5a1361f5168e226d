"""The Mosaic GPU paged prefill kernel in the prefill benchmark: checks, a config sweep, timings.

`bench_prefill --tune` runs it in a child process (`mgpu_child`), between the Triton sweep and the
table: a hang or a crash in the kernel then costs the child's time limit, not the Triton results.
The child checks the kernel against the reference first and times it only if every check passed;
its rows carry mgpu_ms / mgpu_tflops per table shape for the parent's table.
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
    with_sinks,
)
from .report import RowLog

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


def run_mgpu(args, log: RowLog) -> list[dict]:
    """Correctness vs the reference on the GPU checks, a config sweep on SWEEP_SHAPES, then one
    timing per TABLE_SHAPES row.  Every row goes to `log` as it comes (a child killed on its time
    limit still reports)."""
    from umem_jax.pallas_kernels.paged_prefill_mgpu import mgpu_available

    ok, why = mgpu_available()
    if not ok or jax.default_backend() != "gpu":
        print(f"  mgpu: skipped ({why or 'needs an NVIDIA GPU'})", flush=True)
        log.add(dict(bench="prefill", kind="mgpu_skipped", why=why or "no GPU"))
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
