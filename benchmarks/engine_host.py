"""Host cost of one decode step, with the device work excluded (CPU is fine: tiny model).

    python3 -m benchmarks.bench_engine --host --batch 64 --prompt 512 --gen 80
    python3 -m benchmarks.bench_engine --host --profile 50
    python3 -m benchmarks.bench_engine --host --no-isolate    # + how often N+1 launched before N ended

Runs B requests of `--prompt` tokens through the engine, stepping by hand, and over the steady
decode steps (all B rows decoding, nothing waiting) reports the median host milliseconds of:

  schedule   scheduler.schedule()
  launch     runner.launch(): packing the metadata, the one host->device copy, the jit dispatch
  process    engine._process() after the step's tokens are on the host (stop checks, detok)
  host       their sum (what bench_engine calls host)

Each part is timed twice: wall time, and the host thread's CPU time (time.thread_time: robust
to other processes sharing the cores; the device's own threads are not counted).

The device wait (np.asarray of the tokens) is timed apart and left out.  On a CPU host the
"device" shares the cores, so by default (--isolate) each timed part runs with the device idle:
the in-flight step is waited for (untimed) before schedule and right after launch returns.
--profile N runs cProfile over N steady decode steps and prints the top functions by cumulative
and own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import numpy as np

PARTS = ("schedule", "launch", "process", "wait", "schedule_cpu", "launch_cpu", "process_cpu")


def parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_engine --host", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=80)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--arena-mib", type=float, default=96)
    ap.add_argument("--mode", default="unified")
    ap.add_argument("--profile", type=int, default=0, help="cProfile this many steady decode steps")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-isolate", dest="isolate", action="store_false",
                    help="let host parts overlap the (CPU) device work, as the engine does")
    ap.add_argument("--prefix-cache", choices=("default", "on", "off"), default="default")
    ap.add_argument("--text", action="store_true", help="token-id prompts still detokenize; this adds stop strings")
    return ap.parse_args(argv)


class HostClock:
    """Wraps the engine's schedule, launch and _process to time each part (wall and thread CPU)."""

    def __init__(self, eng, isolate: bool):
        import jax

        self.parts = {k: [] for k in PARTS}
        self.overlap: list[bool] = []  # without --isolate: was step N still running when N+1 launched?
        clock = time.thread_time
        sched, launch, process = eng.scheduler.schedule, eng.runner.launch, eng._process

        def timed_schedule(*a, **k):
            t0, c0 = time.perf_counter(), clock()
            try:
                return sched(*a, **k)
            finally:
                self.parts["schedule"].append(time.perf_counter() - t0)
                self.parts["schedule_cpu"].append(clock() - c0)

        def timed_process(launched):
            t0 = time.perf_counter()
            np.asarray(launched.tokens)  # the device wait, excluded from host
            t1, c1 = time.perf_counter(), clock()
            out = process(launched)
            self.parts["wait"].append(t1 - t0)
            self.parts["process"].append(time.perf_counter() - t1)
            self.parts["process_cpu"].append(clock() - c1)
            return out

        def isolated_launch(batch):
            prev = eng._inflight
            t0, c0 = time.perf_counter(), clock()
            out = launch(batch)
            self.parts["launch"].append(time.perf_counter() - t0)
            self.parts["launch_cpu"].append(clock() - c0)
            if prev is not None:
                self.overlap.append(not prev.tokens.is_ready())
            if isolate:
                jax.block_until_ready((out.tokens, eng.runner.arena))
            return out

        eng.scheduler.schedule, eng.runner.launch, eng._process = timed_schedule, isolated_launch, timed_process

    def clear(self):
        for v in self.parts.values():
            v.clear()

    def step_totals(self) -> dict:
        return {k: sum(v) for k, v in self.parts.items()}


def steady_steps(eng, clock: HostClock, args, prof) -> list[dict]:
    """Step the engine to the end -> the parts of every steady decode step."""
    import jax

    rows, profiled = [], 0
    while eng.has_unfinished_requests():
        clock.clear()
        steady = (len(eng.scheduler.running) == args.batch and not eng.scheduler.waiting
                  and all(r.decode_ready for r in eng.scheduler.running) and eng._inflight is not None)
        if args.isolate and eng._inflight is not None:
            jax.block_until_ready((eng._inflight.tokens, eng.runner.arena))
        on = prof is not None and steady and profiled < args.profile
        if on:
            prof.enable()
        eng.step()
        if on:
            prof.disable()
            profiled += 1
        if steady:
            rows.append(clock.step_totals())
    return rows


def main(argv=None) -> int:
    args = parse(argv)
    from umem_jax import LLM, SamplingParams
    from umem_jax.models.loader import load_model

    llm = LLM(load_model("tiny"), memory_mode=args.mode, arena_bytes=int(args.arena_mib * 2**20),
              max_num_seqs=args.batch, max_num_batched_tokens=4096, page_size=args.page_size,
              max_model_len=args.prompt + args.gen + 64, kernel_impl="reference",
              **({} if args.prefix_cache == "default" else {"enable_prefix_caching": args.prefix_cache == "on"}))
    eng = llm.llm_engine
    rng = np.random.default_rng(0)
    vocab = eng.model.config.vocab_size
    # warm-up: every bucket the measured run uses (prefill chunks, the decode batch)
    llm.generate([rng.integers(10, vocab - 1, args.prompt).tolist() for _ in range(args.batch)],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    compiles0 = eng.runner.num_compilations
    clock = HostClock(eng, args.isolate)
    sp = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True,
                        stop=["\x00\x00\x00"] if args.text else None)
    for _ in range(args.batch):
        eng.add_request(rng.integers(10, vocab - 1, args.prompt).tolist(), sp)
    prof = cProfile.Profile(time.thread_time) if args.profile else None
    rows = steady_steps(eng, clock, args, prof)
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in PARTS}
    med["host"] = statistics.median(r["schedule"] + r["launch"] + r["process"] for r in rows) * 1e3
    med["host_cpu"] = statistics.median(r["schedule_cpu"] + r["launch_cpu"] + r["process_cpu"] for r in rows) * 1e3
    out = {"batch": args.batch, "prompt": args.prompt, "steady_steps": len(rows),
           **{f"{k}_ms": round(v, 3) for k, v in med.items()},
           "recompiles": eng.runner.num_compilations - compiles0}
    if not args.isolate and clock.overlap:
        out["launched_while_previous_ran"] = round(sum(clock.overlap) / len(clock.overlap), 3)
    print(json.dumps(out))
    if prof is not None:
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(args.top)
        st.sort_stats("tottime").print_stats(args.top)
    return 0
