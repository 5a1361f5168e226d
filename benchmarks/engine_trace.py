"""Kernel-level view of replayed engine steps, from a jax.profiler trace (perfetto JSON).

    trace = trace_steps(runner, step_fn, captured, reps=5)
    trace["busy_ms_per_step"], trace["span_ms_per_step"], trace["kernels_per_step"], trace["top"]

busy is the union of the kernel intervals on the GPU streams; busy << span means the device
idles between kernels (launch-bound).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile


def trace_steps(runner, step_fn, captured, reps: int) -> dict | None:
    """Kernel-level view of `reps` replayed decode steps from a jax.profiler trace (perfetto
    JSON): device busy time per step (the union of kernel intervals), the span per step, kernels
    per step and the top kernels by time.  busy << span means the device idles between kernels
    (launch-bound); None (with the error printed) where the profiler is not available."""
    if captured is None:
        return None
    import jax

    params, meta, prev, counts, lay = captured
    d = tempfile.mkdtemp(prefix="umem_trace_")
    try:
        arena = runner.arena
        tokens, arena = step_fn(params, arena, meta, prev, counts, layout=lay)
        jax.block_until_ready(tokens)
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(reps):
                tokens, arena = step_fn(params, arena, meta, prev, counts, layout=lay)
            jax.block_until_ready(tokens)
        runner.arena = arena
        path = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path, "rt") as f:
            ev = json.load(f)
    except Exception as e:  # noqa: BLE001 - a missing profiler must not lose the timings
        print(f"no trace: {type(e).__name__}: {e}", flush=True)
        return None
    return kernel_table(ev, reps)


def kernel_table(ev, reps: int) -> dict:
    """Device busy time, span and kernels per step, and the top kernels, from perfetto events."""
    ev = ev.get("traceEvents", ev) if isinstance(ev, dict) else ev
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in ev if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    gpu = {p for p, n in names.items() if "GPU" in n or "gpu" in n or "/device:" in n}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in ev if e.get("ph") == "M"
               and e.get("name") == "thread_name" and e.get("pid") in gpu}
    streams = {k for k, n in threads.items() if "Stream" in n}  # not the "XLA Modules/Ops" summary lines
    ks = [e for e in ev if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e
          and (not streams or (e["pid"], e.get("tid")) in streams)]
    if not ks:
        return {"error": f"no device events; processes: {sorted(set(names.values()))[:12]}"}
    iv = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ks)
    busy, cur_a, cur_b = 0.0, *iv[0]
    for a, b in iv[1:]:
        if a > cur_b:
            busy, cur_a, cur_b = busy + cur_b - cur_a, a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    by: dict[str, list[float]] = {}
    for e in ks:
        by.setdefault(e["name"], []).append(float(e["dur"]))
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {"steps": reps, "busy_ms_per_step": busy / reps / 1e3,
            "span_ms_per_step": (iv[-1][1] - iv[0][0]) / reps / 1e3, "kernels_per_step": len(ks) / reps,
            "top": [{"name": n[:90], "ms_per_step": sum(v) / reps / 1e3, "count_per_step": len(v) / reps}
                    for n, v in top]}

