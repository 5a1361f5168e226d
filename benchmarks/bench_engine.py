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
--trace N profiles N replayed steps (engine_trace.py); --roofline divides ITL by the bytes a
steady step must move over the copy rate measured in the same run (model_steps.step_costs).

    python3 -m benchmarks.bench_engine                     # GPU: nemotronh-8b-like, qwen3.5-4b-like
    python3 -m benchmarks.bench_engine --small             # CPU smoke test on the tiny model
    python3 -m benchmarks.bench_engine --host [--help]     # host cost of a step, device excluded (engine_host)
    python3 -m benchmarks.bench_engine --parity [--help]   # Pallas vs reference greedy tokens (engine_parity)
    python3 -m benchmarks.bench_engine --parity --prefill auto   # Mosaic vs Triton prefill on a served trace
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from .engine_trace import print_trace, trace_steps
from .modes import hand_over
from .report import RowLog, json_path

COMPILE_CACHE = Path(__file__).resolve().parents[1] / "out" / "jax_cache"


class StepClock:
    """Times the engine's host parts per step and captures the last steady decode step's inputs.

    schedule and launch are wrapped whole; _process is split into the wait for the step's tokens
    (left out) and the host work after it."""

    def __init__(self, eng, batch: int):
        self.host: list[float] = []  # this step's host parts, in call order
        self.captured: dict = {}
        self.step_fn = eng.runner._step
        for obj, name in ((eng.scheduler, "schedule"), (eng.runner, "launch")):
            setattr(obj, name, self._timed(getattr(obj, name)))
        process = eng._process

        def timed_process(launched):
            np.asarray(launched.tokens)  # the wait for the step's tokens: not host work
            t1 = time.perf_counter()
            out = process(launched)
            self.host.append(time.perf_counter() - t1)
            return out

        def capturing_step(params, arena, meta, prev, counts, *, layout):  # keep the steady decode inputs
            if layout.T == 1 and layout.B >= batch:
                self.captured["args"] = (params, meta, prev, counts, layout)
            return self.step_fn(params, arena, meta, prev, counts, layout=layout)

        eng._process, eng.runner._step = timed_process, capturing_step

    def _timed(self, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.host.append(time.perf_counter() - t0)
        return wrapper

    def split(self) -> dict:
        """host = [schedule, launch, process] in call order when a step does all three."""
        return dict(zip(("schedule", "launch", "process"), self.host)) if len(self.host) == 3 else {}


def _engine(model, mode, args):
    from umem_jax import LLM

    return LLM(model=model, memory_mode=mode, arena_bytes=int(args.arena_gib * 2**30), max_num_seqs=args.batch,
               max_num_batched_tokens=args.chunk, max_model_len=args.prompt + args.gen + 64,
               **({"kernel_impl": "reference"} if args.small else {}))


def _steady_run(eng, clock: StepClock, args, rng, vocab) -> tuple[list, list, dict]:
    """B requests to the end -> (steady step intervals, steady host times, host parts per step)."""
    from umem_jax import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(rng.integers(10, vocab - 1, args.prompt).tolist(), sp)
    parts = {"schedule": [], "launch": [], "process": []}
    stamps, hosts = [], []
    while eng.has_unfinished_requests():
        clock.host.clear()
        full = len(eng.scheduler.running) == args.batch and len(eng.scheduler.waiting) == 0
        eng.step()
        stamps.append((time.perf_counter(), full))
        hosts.append(sum(clock.host))
        if full:
            for k, v in clock.split().items():
                parts[k].append(v)
    steady = [b - a for (a, ok_a), (b, ok_b) in zip(stamps, stamps[1:]) if ok_a and ok_b]
    steady_host = [h for h, (_, ok) in zip(hosts[1:], stamps[1:]) if ok]
    return steady, steady_host, parts


def _roofline(eng, args) -> float | None:
    """Seconds of the bytes a steady step must move at its mean context, at the copy rate."""
    if not getattr(args, "copy_bw", None):
        return None
    from .model_steps import param_counts, step_costs

    c = param_counts(eng.model.params)
    # MoE: the experts a step reads are those its tokens route to (uniform-routing expectation;
    # at B = 1 exactly top_k a layer), not every expert's weights
    cost = step_costs(eng.model.config, eng.plan, c["params"], c["param_bytes"], B=args.batch, T=1,
                      start=args.prompt + args.gen // 2, expert_params=c["expert_params"],
                      expert_bytes=c["expert_bytes"])
    return cost["total_bytes"] / args.copy_bw


def run_one(model, mode, args, batch: int | None = None, prompt: int | None = None) -> dict:
    from umem_jax import SamplingParams

    if batch is not None:  # one case of --cases: this batch and prompt length
        args = argparse.Namespace(**{**vars(args), "batch": batch, "prompt": prompt})
    llm = _engine(model, mode, args)
    eng = llm.llm_engine
    rng = np.random.default_rng(0)
    vocab = eng.model.config.vocab_size
    # Warm up every bucket this run will use (prefill chunks and the decode batch).
    llm.generate([rng.integers(10, vocab - 1, args.prompt).tolist() for _ in range(args.batch)],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    compiles = eng.stats().get("num_compilations")
    clock = StepClock(eng, args.batch)
    steady, steady_host, parts = _steady_run(eng, clock, args, rng, vocab)
    itl = statistics.median(steady) if steady else float("nan")
    h = statistics.median(steady_host) if steady_host else float("nan")
    captured = clock.captured.get("args")
    dev = device_step(eng.runner, clock.step_fn, captured, args.replay)
    trace = trace_steps(eng.runner, clock.step_fn, captured, args.trace) if args.trace else None
    roof = _roofline(eng, args)
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


def device_step(runner, step_fn, captured, reps: int) -> float:
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


def print_rows(rows: list[dict], models: list[str]) -> None:
    print(f"{'model':<20} {'mode':<8} {'B':>3} {'prompt':>6} {'steps':>5} {'ITL ms':>8} {'device ms':>9} "
          f"{'overhead':>8} {'host ms':>8} {'sched':>6} {'launch':>6} {'process':>7} {'recompiles':>10}")
    nan = float("nan")
    for r in rows:
        print(f"{r['model']:<20} {r['mode']:<8} {r['batch']:>3} {r['prompt']:>6} {r['steady_steps']:>5} "
              f"{r['itl_ms']:>8.2f} {r['device_ms']:>9.2f} {100 * r['overhead_frac']:>7.1f}% {r['host_ms']:>8.2f} "
              f"{r.get('schedule_ms', nan):>6.2f} {r.get('launch_ms', nan):>6.2f} "
              f"{r.get('process_ms', nan):>7.2f} {r['compiles_after_warmup']:>10}"
              + (f"  roofline {r['roofline_ms']:.2f} ms, ITL/roofline {r['itl_over_roofline']:.2f}"
                 if "roofline_ms" in r else ""))
    for r in rows:
        print_trace(f"{r['model']} {r['mode']} B={r['batch']} prompt={r['prompt']}", r.get("trace"))
    for name in models:
        u = next((r for r in rows if r["model"] == name and r["mode"] == "unified"), None)
        s = next((r for r in rows if r["model"] == name and r["mode"] == "static"
                  and u is not None and r["batch"] == u["batch"] and r["prompt"] == u["prompt"]), None)
        if u is None or s is None:
            continue
        ratio = u["itl_ms"] / s["itl_ms"]
        ov = u["overhead_frac"]
        print(f"{name}: unified/static ITL {ratio:.3f} (goal <= 1.01: {'met' if ratio <= 1.01 else 'MISSED'}); "
              f"host overhead {100 * ov:.1f}% of the step (goal <= 5%: {'met' if ov <= 0.05 else 'MISSED'})")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", action="store_true", help="instead: host cost of a step (own options: --host --help)")
    ap.add_argument("--parity", action="store_true",
                    help="instead: Pallas vs reference greedy tokens (own options: --parity --help)")
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
    ap.add_argument("--json", default=None, help="rows here (default $OUT/bench_engine.json if $OUT is set)")
    args = ap.parse_args(argv)
    if args.small:
        args.models, args.batch, args.prompt, args.gen, args.chunk, args.arena_gib = "tiny", 4, 24, 6, 64, 0.03
    args.cases = ([tuple(int(x) for x in c.lower().split("x")) for c in args.cases.split(",")] if args.cases
                  else [(args.batch, args.prompt)])
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    return args


def main(argv=None) -> int:
    other = hand_over(argv, {"--host": "engine_host", "--parity": "engine_parity"})
    if other is not None:
        return other
    args = parse(argv)
    import jax

    from umem_jax.models.loader import load_model
    from umem_jax.models.registry import build_random

    if not args.small:  # a later call on the same machine loads the compiled steps instead of compiling them
        from umem_jax.bench.driver import enable_compile_cache

        enable_compile_cache(str(COMPILE_CACHE))
    args.copy_bw = None
    if args.roofline:
        from .copy_limit import copy_limit

        args.copy_bw = copy_limit((4 << 20) if args.small else (4 << 30), iters=10, trials=5).bytes_per_s
    log = RowLog(json_path(args.json, "bench_engine"), jax=jax.__version__, device=str(jax.devices()[0]))
    models = args.models.split(",")
    for name in models:
        # One model for both modes: the same graph, plan and arena shape reuse the compiled steps.
        model = load_model("tiny") if name == "tiny" else build_random(name, "bfloat16")
        for b, pr in args.cases:
            for mode in args.modes:
                r = log.add({"model": name, **run_one(model, mode, args, b, pr)})
                print(json.dumps(r), flush=True)
                gc.collect()
        del model
        gc.collect()
    print(f"\n== bench_engine: jax {jax.__version__} on {jax.devices()[0].device_kind}")
    print_rows(log.rows, models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
