"""Engine-level decode: unified vs static memory at equal batch, and the host's share of a step.

For each model shape (random bf16 weights) and memory mode, the offline engine runs B prompts of
`--prompt` tokens to `--gen` tokens each (greedy, ignore_eos), stepping by hand so every step is
timed.  Reported per (model, mode), over the steady decode steps (all B rows decoding):
  ITL      median wall time between consecutive decode steps (the inter-token latency)
  host     median host CPU time per step: scheduling + packing + launch + processing the previous
           step's tokens, i.e. everything but waiting on the device (overlapped with the device
           step by async scheduling, so it costs nothing while it stays below the device time)
  device   the same jitted decode step (the last steady step's packed inputs) replayed back to
           back with nothing on the host in between: the device's own time per step
  overhead (ITL - device) / ITL: the share of each step the device waits on the host
           (goal <= 5% at batch 64); and unified ITL / static ITL (goal <= 1.01)

    python benchmarks/bench_engine.py                     # GPU: nemotronh-8b-like, qwen3.5-4b-like
    python benchmarks/bench_engine.py --small             # CPU smoke test on the tiny model
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import numpy as np


def _timed(obj, name, bucket):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            bucket.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def run_one(model, mode, args, batch: int | None = None, prompt: int | None = None) -> dict:
    import jax

    from umem_jax import LLM, SamplingParams

    if batch is not None:  # one case of --cases: this batch and prompt length
        args = argparse.Namespace(**{**vars(args), "batch": batch, "prompt": prompt})

    llm = LLM(model=model, memory_mode=mode, arena_bytes=int(args.arena_gib * 2**30), max_num_seqs=args.batch,
              max_num_batched_tokens=args.chunk, max_model_len=args.prompt + args.gen + 64,
              **({"kernel_impl": "reference"} if args.small else {}))
    eng = llm.llm_engine
    rng = np.random.default_rng(0)
    vocab = eng.model.config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    # Warm up every bucket this run will use (prefill chunks and the decode batch).
    llm.generate([rng.integers(10, vocab - 1, args.prompt).tolist() for _ in range(args.batch)],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    compiles = eng.stats().get("num_compilations")

    host: list[float] = []
    parts = {"schedule": [], "launch": [], "process": []}  # per step, for the breakdown
    _timed(eng.scheduler, "schedule", host)
    _timed(eng.runner, "launch", host)
    wait: list[float] = []
    process = eng._process

    def timed_process(launched):  # host part of _process = total - the wait for the tokens
        t0 = time.perf_counter()
        np.asarray(launched.tokens)
        t1 = time.perf_counter()
        out = process(launched)
        wait.append(t1 - t0)
        host.append(time.perf_counter() - t1)
        return out

    def split(h):  # host = [schedule, launch, process] in call order when a step does all three
        return dict(zip(("schedule", "launch", "process"), h)) if len(h) == 3 else {}

    eng._process = timed_process
    captured = {}
    step_fn = eng.runner._step

    def capturing_step(params, arena, meta, prev, counts, *, layout):  # keep the steady decode inputs
        if layout.T == 1 and layout.B >= args.batch:
            captured["args"] = (params, meta, prev, counts, layout)
        return step_fn(params, arena, meta, prev, counts, layout=layout)

    eng.runner._step = capturing_step
    for _ in range(args.batch):
        eng.add_request(rng.integers(10, vocab - 1, args.prompt).tolist(), sp)
    stamps, hosts = [], []
    while eng.has_unfinished_requests():
        host.clear()
        running = len(eng.scheduler.running)
        waiting = len(eng.scheduler.waiting)
        eng.step()
        stamps.append((time.perf_counter(), running == args.batch and waiting == 0))
        hosts.append(sum(host))
        if running == args.batch and waiting == 0:
            for k, v in split(host).items():
                parts[k].append(v)
    steady = [b - a for (a, ok_a), (b, ok_b) in zip(stamps, stamps[1:]) if ok_a and ok_b]
    steady_host = [h for h, (_, ok) in zip(hosts[1:], stamps[1:]) if ok]
    itl = statistics.median(steady) if steady else float("nan")
    h = statistics.median(steady_host) if steady_host else float("nan")
    dev = _device_step(eng.runner, step_fn, captured.get("args"), args.replay)
    trace = _trace_steps(eng.runner, step_fn, captured.get("args"), args.trace) if args.trace else None
    roof = None
    if getattr(args, "copy_bw", None):  # the bytes a steady step must move at its mean context / copy rate
        from bench_models import step_costs

        leaves = jax.tree.leaves(eng.model.params)
        cost = step_costs(eng.model.config, eng.plan, sum(x.size for x in leaves), sum(x.nbytes for x in leaves),
                          B=args.batch, T=1, start=args.prompt + args.gen // 2)
        roof = cost["total_bytes"] / args.copy_bw
    row = {"mode": mode, "batch": args.batch, "prompt": args.prompt, "steady_steps": len(steady),
           "itl_ms": itl * 1e3,
           **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in parts.items() if v},
           "host_ms": h * 1e3, "host_frac": h / itl if steady else float("nan"), "device_ms": dev * 1e3,
           "overhead_frac": max(0.0, itl - dev) / itl if steady else float("nan"),
           "compiles_after_warmup": (eng.stats().get("num_compilations") or 0) - (compiles or 0),
           "arena_gib": args.arena_gib, **({"trace": trace} if trace else {}),
           **({"roofline_ms": roof * 1e3, "itl_over_roofline": itl / roof} if roof else {})}
    del llm, eng
    gc.collect()
    return row


def _device_step(runner, step_fn, captured, reps: int) -> float:
    """Seconds per decode step with the host out of the way: the captured step relaunched
    `reps` times back to back (dispatch is asynchronous, so the device never waits), median of
    three such runs.  The replay rewrites the same K/V rows and state slots each time."""
    if captured is None:
        return float("nan")
    import jax

    params, meta, prev, counts, lay = captured
    times = []
    for _ in range(3):
        arena = runner.arena
        tokens, arena = step_fn(params, arena, meta, prev, counts, layout=lay)
        jax.block_until_ready(tokens)
        t0 = time.perf_counter()
        for _ in range(reps):
            tokens, arena = step_fn(params, arena, meta, prev, counts, layout=lay)
        jax.block_until_ready(tokens)
        times.append((time.perf_counter() - t0) / reps)
        runner.arena = arena
    return statistics.median(times)


def _trace_steps(runner, step_fn, captured, reps: int) -> dict | None:
    """Kernel-level view of `reps` replayed decode steps from a jax.profiler trace (perfetto
    JSON): device busy time per step (the union of kernel intervals), the span per step, kernels
    per step and the top kernels by time.  busy << span means the device idles between kernels
    (launch-bound); None (with the error printed) where the profiler is not available."""
    if captured is None:
        return None
    import glob
    import gzip
    import tempfile

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="nemotronh-8b-like,qwen3.5-4b-like")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--arena-gib", type=float, default=24.0)
    ap.add_argument("--replay", type=int, default=50, help="back-to-back replays of the decode step")
    ap.add_argument("--cases", default=None, help="BxPROMPT comma list (e.g. 1x16384,4x16384,64x512): "
                    "one engine per case and mode on the same model, instead of --batch/--prompt")
    ap.add_argument("--modes", default="unified,static")
    ap.add_argument("--trace", type=int, default=0, help="also profile this many replayed steps (kernel table)")
    ap.add_argument("--roofline", action="store_true", help="measure the copy rate and give ITL / bytes roofline "
                    "(weights + K/V + state at the mean decode context, as bench_models counts them)")
    ap.add_argument("--small", action="store_true", help="tiny model, reference kernels, CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.small:
        args.models, args.batch, args.prompt, args.gen, args.chunk, args.arena_gib = "tiny", 4, 24, 6, 64, 0.03

    cases = ([tuple(int(x) for x in c.lower().split("x")) for c in args.cases.split(",")] if args.cases
             else [(args.batch, args.prompt)])
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    import jax

    from umem_jax.models.registry import build_random

    if not args.small:  # reuse compiled steps across the calls of one session on the same machine
        from umem_jax.bench.driver import enable_compile_cache

        enable_compile_cache(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out", "jax_cache"))
    args.copy_bw = None
    if args.roofline:
        from bench_models import measure_copy

        args.copy_bw = measure_copy(args.small, trials=5)
    rows = []
    for name in args.models.split(","):
        # One model for both modes: the same graph, plan and arena shape reuse the compiled steps.
        from umem_jax.models.loader import load_model

        model = load_model("tiny") if name == "tiny" else build_random(name, "bfloat16")
        for b, pr in cases:
            for mode in modes:
                r = {"model": name, **run_one(model, mode, args, b, pr)}
                rows.append(r)
                print(json.dumps(r), flush=True)
                gc.collect()
        del model
        gc.collect()
    out = args.json or (os.path.join(os.environ["OUT"], "bench_engine.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": rows}, f, indent=1)
    print(f"\n== bench_engine: jax {jax.__version__} on {jax.devices()[0].device_kind}")
    print(f"{'model':<20} {'mode':<8} {'B':>3} {'prompt':>6} {'steps':>5} {'ITL ms':>8} {'device ms':>9} "
          f"{'overhead':>8} {'host ms':>8} {'sched':>6} {'launch':>6} {'process':>7} {'recompiles':>10}")
    for r in rows:
        print(f"{r['model']:<20} {r['mode']:<8} {r['batch']:>3} {r['prompt']:>6} {r['steady_steps']:>5} "
              f"{r['itl_ms']:>8.2f} {r['device_ms']:>9.2f} {100 * r['overhead_frac']:>7.1f}% {r['host_ms']:>8.2f} "
              f"{r.get('schedule_ms', float('nan')):>6.2f} {r.get('launch_ms', float('nan')):>6.2f} "
              f"{r.get('process_ms', float('nan')):>7.2f} {r['compiles_after_warmup']:>10}"
              + (f"  roofline {r['roofline_ms']:.2f} ms, ITL/roofline {r['itl_over_roofline']:.2f}"
                 if "roofline_ms" in r else ""))
    for r in rows:
        t = r.get("trace")
        if t and "top" in t:
            print(f"\ntrace {r['model']} {r['mode']} B={r['batch']} prompt={r['prompt']}: device busy "
                  f"{t['busy_ms_per_step']:.2f} ms of a {t['span_ms_per_step']:.2f} ms span per step, "
                  f"{t['kernels_per_step']:.0f} kernels per step")
            for k in t["top"]:
                print(f"  {k['ms_per_step']:7.3f} ms  x{k['count_per_step']:<5.0f} {k['name']}")
        elif t:
            print(f"trace {r['model']} B={r['batch']}: {t}")
    for name in args.models.split(","):
        u = next((r for r in rows if r["model"] == name and r["mode"] == "unified"), None)
        s = next((r for r in rows if r["model"] == name and r["mode"] == "static"
                  and u is not None and r["batch"] == u["batch"] and r["prompt"] == u["prompt"]), None)
        if u is None or s is None:
            continue
        ratio = u["itl_ms"] / s["itl_ms"]
        ov = u["overhead_frac"]
        print(f"{name}: unified/static ITL {ratio:.3f} (goal <= 1.01: {'met' if ratio <= 1.01 else 'MISSED'}); "
              f"host overhead {100 * ov:.1f}% of the step (goal <= 5%: {'met' if ov <= 0.05 else 'MISSED'})")


if __name__ == "__main__":
    main()
