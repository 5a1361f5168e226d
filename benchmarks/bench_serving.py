"""Serving under load on the GPU: the unified arena vs the static split, per workload.

For each realistic model shape (random bf16 weights, built once), each workload runs through the
offline engine in unified mode and in static mode at SGLang's defaults (0.8, 0.9) plus four more
ratio settings, same arena bytes and engine flags, same process (umem_jax.bench.sweep).  The arena
is small on purpose so memory binds: 128 short requests want more concurrency than it holds, and
it holds only a few long ones.  Printed last: the table and the goals' ratios (unified / static
defaults tok/s >= 1.5x on the shifting trace; static / unified retractions >= 2x; unified / best
static >= 0.97x on each fixed mix).  Written to $OUT/<model>/ (or --out): results.json and PNGs.
The same traces through the scheduler alone, on the host: benchmarks/simulate_admission.py.

    python3 -m benchmarks.bench_serving --models qwen3.5-4b-like      # one model per call
    python3 -m benchmarks.bench_serving --small                       # CPU smoke (tiny)

Sizing for one GPU call of <= 9 minutes per model, compilation included (warm-up compiles every
step shape of the coarse buckets, ~36, before anything is timed; with --compile-cache, the
default, a second call on the same machine loads them from out/jax_cache instead):
  * long requests are 16K in / 256 out, not 32K: a 32K prefill of a 4B model takes ~1 s and the
    kv-heavy trace runs through 6 configurations; NemotronH-8B-like has 8K positions, so 6K in.
  * counts are modest (128 short for state-heavy, 8 long for kv-heavy), and `--time-budget-s`
    skips the runs that would start too late (reported as skipped) instead of being killed;
    `--max-run-s` caps one run (its unfinished requests are aborted, the row says "truncated").
Workloads run in the order shifting, state-heavy, kv-heavy, mixed, so the headline comes first.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

# Per model: arena GiB (memory binds: see the module docstring), the long request, how many long
# requests the KV-heavy traces carry.  NemotronH's attention KV is small per token (4 layers) and
# its context short, so it needs more long requests before full KV binds.
MODELS = {
    "qwen3.5-4b-like": dict(arena_gib=4.0, long=(16384, 256), n_long=8, n_long_phase=4),
    "gemma3-4b-like": dict(arena_gib=4.0, long=(16384, 256), n_long=8, n_long_phase=4),
    "nemotronh-8b-like": dict(arena_gib=3.0, long=(6144, 256), n_long=24, n_long_phase=12),
    # MoE families (issue 15), sized from their plans (page 16) so memory binds as above; not yet
    # run on the GPU.  gpt-oss: full K/V 24 KiB/token, the 128-token window 3 MiB a request, so
    # 3 GiB holds ~7 long or ~160 short; Qwen3.5-35B-A3B: 20 KiB/token + a 61 MiB state slot
    # (4 GiB: ~10 long or ~55 short); Nemotron 3 Nano: 6 KiB/token + a 47 MiB slot (3 GiB: ~20
    # long or ~60 short).
    "gpt-oss-20b-like": dict(arena_gib=3.0, long=(16384, 256), n_long=8, n_long_phase=4),
    "qwen3.5-35b-a3b-like": dict(arena_gib=4.0, long=(16384, 256), n_long=10, n_long_phase=5),
    "nemotron-3-nano-30b-a3b-like": dict(arena_gib=3.0, long=(16384, 256), n_long=24, n_long_phase=12),
}
ORDER = ("shifting", "state-heavy", "kv-heavy", "mixed")


def workloads(names, spec: dict, *, short, n_short: int, phase_s: float, jitter: float, seed: int, scale: float = 1.0,
              phases: int = 4, spread: bool = False):
    """The named traces at `spec`'s sizes; the shifting one has `phases` phases of n_short * 3/8
    short or spec["n_long_phase"] long requests, all at each phase's start or `spread` over it."""
    from umem_jax.bench.workload import Shape, make

    long = Shape(*spec["long"])
    counts = {"state-heavy": dict(n=n_short), "kv-heavy": dict(n=spec["n_long"]),
              "mixed": dict(n_short=n_short // 2, n_long=spec["n_long_phase"]),
              "shifting": dict(n_short=n_short * 3 // 8, n_long=spec["n_long_phase"], phases=phases, spread=spread)}
    return [make(n, scale=scale, count_scale=1.0, short=short, long=long, phase_s=phase_s, jitter=jitter, seed=seed,
                 **counts[n]) for n in names]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(list(MODELS)[:3]),
                    help=f"comma list of {', '.join(MODELS)} (one per GPU call fits 9 minutes; default the dense three)")
    ap.add_argument("--workloads", default=",".join(ORDER))
    ap.add_argument("--arena-gib", type=float, default=None, help="override the per-model arena")
    ap.add_argument("--static-ratios", default=None, help="swa:mamba pairs (default: 0.8:0.9 and four more; 'none': the unified arena alone)")
    ap.add_argument("--n-short", type=int, default=128, help="short requests of the state-heavy trace")
    ap.add_argument("--short", default="512,128", help="short request: input,output tokens")
    ap.add_argument("--long", default=None, help="long request: input,output tokens (default: the model's, e.g. "
                    "16384,256; longer outputs make the trace decode-bound, where the memory split decides)")
    ap.add_argument("--phase-s", type=float, default=2.0, help="seconds between the shifting trace's phases")
    ap.add_argument("--phases", type=int, default=4, help="phases of the shifting trace (>= 4: 3 shifts)")
    ap.add_argument("--spread", action="store_true", help="shifting trace: each phase's requests arrive over the "
                    "phase (Poisson), sustained load, instead of all at its start")
    ap.add_argument("--n-long-phase", type=int, default=None, help="long requests per long phase of the shifting "
                    "trace (default: the model's)")
    ap.add_argument("--jitter", type=float, default=0.2, help="request lengths uniform within +-this fraction")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--time-budget-s", type=float, default=480.0, help="per model, compilation included")
    ap.add_argument("--max-run-s", type=float, default=75.0, help="cap on one run")
    ap.add_argument("--budget-after-build", action="store_true",
                    help="start --time-budget-s after the model is built (the H200 took 40-140 s to build a 4B model)")
    ap.add_argument("--buckets", default=None, help="B,B,..:T,T,..:P,P,.. step-shape buckets instead of the coarse "
                    "set (fewer shapes compile faster: a 4B model's step takes ~10 s to compile on the H200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-dtype", default="auto", help="K/V storage of every configuration (auto, fp8, ...): "
                    "run once with auto and once with fp8 in the same --arena-gib to compare tokens held and tok/s")
    ap.add_argument("--early", action="store_true",
                    help="early_admission=True, the engine's default (kept for older commands)")
    ap.add_argument("--no-early", action="store_true",
                    help="a long prompt waits in the queue until its whole need fits (early_admission=False)")
    ap.add_argument("--no-joint", action="store_true",
                    help="a request's own decode peak is added to the decoders' (joint_admission=False)")
    ap.add_argument("--out", default=None, help="default: $OUT/bench_serving, else ./bench_serving_out")
    ap.add_argument("--compile-cache", default=str(Path(__file__).resolve().parents[1] / "out" / "jax_cache"),
                    help="JAX persistent compilation cache ('' for none; default out/jax_cache, git-ignored): a later "
                    "call on the same machine skips most of the warm-up")
    ap.add_argument("--small", action="store_true", help="CPU smoke: tiny model, tiny trace, reference kernels")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return ap.parse_args(argv)


def parse_buckets(text: str) -> dict:
    """'B,B,..:T,T,..:P,P,..' -> the engine's batch, token and page buckets."""
    b, t, p = ([int(x) for x in part.split(",")] for part in text.split(":"))
    return dict(batch_buckets=tuple(b), token_buckets=tuple(t), page_buckets=tuple(p))


def max_model_len(wls, page_size: int) -> int:
    """The longest request of the traces `wls` and one page more, rounded up to a page."""
    return -(-(max(w.max_len for w in wls) + page_size) // page_size) * page_size


def engine_settings(args, wls, arena_gib: float, small: bool) -> dict:
    """The engine flags every configuration of one model shares: arena bytes, batch limits, the
    longest request rounded up to a page as max_model_len, and the step-shape buckets."""
    from umem_jax.bench.command import bucket_kwargs

    ps = args.page_size
    mml = max_model_len(wls, ps)
    engine_kwargs = dict(arena_bytes=int(arena_gib * 2**30), max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, page_size=ps, max_model_len=mml,
                         seed=args.seed, early_admission=not args.no_early, joint_admission=not args.no_joint,
                         kv_cache_dtype=args.kv_cache_dtype,
                         **({"kernel_impl": "reference"} if small else {}),
                         **bucket_kwargs("single" if small else "coarse", args.max_num_seqs,
                                         args.max_num_batched_tokens, mml, ps))
    if args.buckets:
        engine_kwargs.update(parse_buckets(args.buckets))
    return engine_kwargs


def main(argv=None) -> int:
    args = parse(argv)
    import jax

    from umem_jax.bench.driver import enable_compile_cache
    from umem_jax.bench.sweep import load_bench_model, run_benchmark
    from umem_jax.bench.workload import Shape

    out_root = args.out or (os.path.join(os.environ["OUT"], "bench_serving") if os.environ.get("OUT")
                            else "bench_serving_out")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    short = Shape(*(int(x) for x in args.short.split(",")))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    small = args.small
    if small:  # CPU: the tiny hybrid, a short trace, one bucket per dimension
        models, short = ["tiny"], Shape(24, 8)
        spec = dict(arena_gib=300 / 2**20, long=(200, 8), n_long=3, n_long_phase=1)
        args.n_short, args.phase_s, args.max_num_seqs, args.max_num_batched_tokens, args.page_size = 16, 0.2, 8, 64, 4
    if args.compile_cache and not small:
        enable_compile_cache(args.compile_cache)
    print(f"== bench_serving: jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    status = 0
    for name in models:
        t0 = time.monotonic()
        deadline = t0 + args.time_budget_s
        if not small and name not in MODELS:
            print(f"unknown model {name!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
            return 2
        spec = spec if small else MODELS[name]
        if args.long and not small:
            spec = dict(spec, long=tuple(int(x) for x in args.long.split(",")))
        if args.n_long_phase is not None:
            spec = dict(spec, n_long_phase=args.n_long_phase)
        wls = workloads(names, spec, short=short, n_short=args.n_short, phase_s=args.phase_s, jitter=args.jitter,
                        seed=args.seed, phases=args.phases, spread=args.spread)
        arena = args.arena_gib if args.arena_gib is not None else spec["arena_gib"]
        engine_kwargs = engine_settings(args, wls, arena, small)
        mml = engine_kwargs["max_model_len"]
        print(f"\n=== {name}: arena {arena:g} GiB, max_model_len {mml}, buckets {engine_kwargs.get('batch_buckets')} x "
              f"{engine_kwargs.get('token_buckets')} x {engine_kwargs.get('page_buckets')}", flush=True)
        model = load_bench_model(name, "bfloat16", args.seed)
        print(f"model built in {time.monotonic() - t0:.1f} s", flush=True)
        if args.budget_after_build:  # the call's own timeout covers the build; the budget is for the runs
            deadline = time.monotonic() + args.time_budget_s
        out = os.path.join(out_root, name)
        rep = run_benchmark(model, wls, engine_kwargs=engine_kwargs, statics=args.static_ratios, out_dir=out,
                            deadline=deadline, max_run_s=args.max_run_s, progress=args.progress,
                            meta={"model": name, "arena_gib": arena, "command": " ".join(sys.argv)},
                            log=lambda s: print(s, flush=True))
        print(f"{name}: {time.monotonic() - t0:.0f} s in all; files: {', '.join(rep['files'])}", flush=True)
        if any(r["status"] == "failed" for r in rep["rows"] if r["mode"] == "unified"):
            status = 1
        del model, rep
        gc.collect()
    return status


if __name__ == "__main__":
    sys.exit(main())
