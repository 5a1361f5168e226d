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


def run_one(model, mode, args) -> dict:
    from umem_jax import LLM, SamplingParams

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

    eng._process = timed_process
    captured = {}
    step_fn = eng.runner._step

    def capturing_step(params, arena, meta, prev, counts, lay):  # keep the steady decode inputs
        if lay.T == 1 and lay.B >= args.batch:
            captured["args"] = (params, meta, prev, counts, lay)
        return step_fn(params, arena, meta, prev, counts, lay)

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
    steady = [b - a for (a, ok_a), (b, ok_b) in zip(stamps, stamps[1:]) if ok_a and ok_b]
    steady_host = [h for h, (_, ok) in zip(hosts[1:], stamps[1:]) if ok]
    itl = statistics.median(steady) if steady else float("nan")
    h = statistics.median(steady_host) if steady_host else float("nan")
    dev = _device_step(eng.runner, step_fn, captured.get("args"), args.replay)
    row = {"mode": mode, "batch": args.batch, "steady_steps": len(steady), "itl_ms": itl * 1e3,
           "host_ms": h * 1e3, "host_frac": h / itl if steady else float("nan"), "device_ms": dev * 1e3,
           "overhead_frac": max(0.0, itl - dev) / itl if steady else float("nan"),
           "compiles_after_warmup": (eng.stats().get("num_compilations") or 0) - (compiles or 0),
           "arena_gib": args.arena_gib}
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
        tokens, arena = step_fn(params, arena, meta, prev, counts, lay)
        jax.block_until_ready(tokens)
        t0 = time.perf_counter()
        for _ in range(reps):
            tokens, arena = step_fn(params, arena, meta, prev, counts, lay)
        jax.block_until_ready(tokens)
        times.append((time.perf_counter() - t0) / reps)
        runner.arena = arena
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="nemotronh-8b-like,qwen3.5-4b-like")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--arena-gib", type=float, default=24.0)
    ap.add_argument("--replay", type=int, default=50, help="back-to-back replays of the decode step")
    ap.add_argument("--small", action="store_true", help="tiny model, reference kernels, CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.small:
        args.models, args.batch, args.prompt, args.gen, args.chunk, args.arena_gib = "tiny", 4, 24, 6, 64, 0.03

    import jax

    from umem_jax.models.registry import build_random

    rows = []
    for name in args.models.split(","):
        # One model for both modes: the same graph, plan and arena shape reuse the compiled steps.
        from umem_jax.models.loader import load_model

        model = load_model("tiny") if name == "tiny" else build_random(name, "bfloat16")
        for mode in ("unified", "static"):
            r = {"model": name, **run_one(model, mode, args)}
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
    print(f"{'model':<20} {'mode':<8} {'B':>3} {'steps':>5} {'ITL ms':>8} {'device ms':>9} {'overhead':>8} "
          f"{'host ms':>8} {'recompiles':>10}")
    for r in rows:
        print(f"{r['model']:<20} {r['mode']:<8} {r['batch']:>3} {r['steady_steps']:>5} {r['itl_ms']:>8.2f} "
              f"{r['device_ms']:>9.2f} {100 * r['overhead_frac']:>7.1f}% {r['host_ms']:>8.2f} "
              f"{r['compiles_after_warmup']:>10}")
    for name in args.models.split(","):
        u = next(r for r in rows if r["model"] == name and r["mode"] == "unified")
        s = next(r for r in rows if r["model"] == name and r["mode"] == "static")
        ratio = u["itl_ms"] / s["itl_ms"]
        ov = u["overhead_frac"]
        print(f"{name}: unified/static ITL {ratio:.3f} (goal <= 1.01: {'met' if ratio <= 1.01 else 'MISSED'}); "
              f"host overhead {100 * ov:.1f}% of the step (goal <= 5%: {'met' if ov <= 0.05 else 'MISSED'})")


if __name__ == "__main__":
    main()
