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
    params, meta, prev, counts, lay = captured

    def step():
        tokens, runner.arena = step_fn(params, runner.arena, meta, prev, counts, layout=lay)
        return tokens

    return trace_calls(step, reps)


def trace_calls(call, reps: int, tag: str = "") -> dict | None:
    """The kernel table (kernel_table) of `reps` back-to-back calls of `call` (no arguments; it
    returns something to wait on), after one untraced call; None where the profiler fails."""
    import jax

    d = tempfile.mkdtemp(prefix="umem_trace_")
    try:
        jax.block_until_ready(call())
        with jax.profiler.trace(d, create_perfetto_trace=True):
            out = None
            for _ in range(reps):
                out = call()
            jax.block_until_ready(out)
        path = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
        if os.environ.get("OUT"):  # keep the raw trace beside the results (ui.perfetto.dev opens it)
            import shutil
            shutil.copy(path, os.path.join(os.environ["OUT"], f"trace_{tag or os.getpid()}.json.gz"))
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
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:40]
    return {"steps": reps, "busy_ms_per_step": busy / reps / 1e3,
            "span_ms_per_step": (iv[-1][1] - iv[0][0]) / reps / 1e3, "kernels_per_step": len(ks) / reps,
            "top": [{"name": n[:90], "ms_per_step": sum(v) / reps / 1e3, "count_per_step": len(v) / reps}
                    for n, v in top]}


def print_trace(title: str, t: dict | None) -> None:
    """The kernel table as text: busy / span / kernels per step, then the top kernels."""
    if t and "top" in t:
        print(f"\ntrace {title}: device busy {t['busy_ms_per_step']:.2f} ms of a {t['span_ms_per_step']:.2f} ms "
              f"span per step, {t['kernels_per_step']:.0f} kernels per step")
        for k in t["top"]:
            print(f"  {k['ms_per_step']:7.3f} ms  x{k['count_per_step']:<5.0f} {k['name']}")
    elif t:
        print(f"trace {title}: {t}")
