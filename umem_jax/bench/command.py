"""`umem-jax bench`: the workload benchmark from the command line (flags and the handler).

    umem-jax bench --small --out out/                                                   (CPU, tiny, seconds)
    umem-jax bench --model tiny --workload shifting --arena-bytes 200000 --scale 0.05 --out out/
    umem-jax bench --model qwen3.5-4b-like --workload all --arena-gib 4 --out out/     (GPU)
    umem-jax bench --server http://127.0.0.1:8000 --workload mixed --scale 0.1          (a running server)

Offline (default): the model is built once, then for each workload the unified arena and the
static split at every --static-ratios setting run side by side with the same arena bytes and
engine flags, each configuration warmed (every step shape compiled, then an untimed rehearsal)
before its clock starts; a table and the unified / static ratios are printed last, with goal
verdicts only for a real measurement (not --small, not a CPU backend), and runs that aborted,
clipped or compiled inside their timed window are marked in the table and the plot titles;
results.json and PNGs go to --out.  With --server: the workloads are sent to that server over
HTTP (one configuration: whatever the server runs), prompts are random ids below --vocab-size.
--dataset-name (random | random-ids | generated-shared-prefix | sharegpt, with bench serve's
dataset flags) replaces the --workload traces by that dataset as one workload, prompts as token
ids (sharegpt: tokenized by --tokenizer or the model's tokenizer.json), arrivals Poisson at --rate.

--small is a fixed-seed CPU smoke preset: the tiny model on a shortened shifting trace with an
arena small enough that memory binds (SMALL below); any flag given explicitly overrides it.
"""

from __future__ import annotations

import argparse
import time

from .workload import WORKLOADS

# Flags whose default depends on --small: parsed as None, then filled in by resolve().
DEFAULTS = dict(workload="all", scale=1.0, phase_s=1.0, max_num_seqs=64, max_num_batched_tokens=2048, page_size=16,
                buckets="coarse")
SMALL = dict(model="tiny", workload="shifting", scale=0.02, count_scale=0.2, phase_s=0.2, arena_bytes=400_000,
             max_num_seqs=8, max_num_batched_tokens=64, page_size=4, buckets="single", seed=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small", action="store_true", help="CPU smoke preset: --model tiny --workload shifting "
                   "--scale 0.02 --count-scale 0.2 --phase-s 0.2 --arena-bytes 400000 --max-num-seqs 8 "
                   "--max-num-batched-tokens 64 --page-size 4 --buckets single --seed 0 (explicit flags override it)")
    p.add_argument("--model", default=None, help="built-in name (tiny, the default), a checkpoint path, or a "
                   "random-weight shape: gemma3-4b-like, nemotronh-8b-like, qwen3.5-4b-like (with --server: the "
                   "served model name)")
    p.add_argument("--workload", default=None, help=f"{'|'.join(WORKLOADS)}|all, or a comma list (default all)")
    arena = p.add_mutually_exclusive_group()
    arena.add_argument("--arena-gib", type=float, default=None, help="arena bytes in GiB (small, so memory binds)")
    arena.add_argument("--arena-bytes", type=int, default=None, help="arena bytes (default: the engine's)")
    p.add_argument("--static-ratios", default=None, help="static settings as swa:mamba pairs, comma separated "
                   "('-' where the model has no such memory; a bare number sets the one ratio the model has); "
                   "default: SGLang's 0.8:0.9 and four more")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 64")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 2048")
    p.add_argument("--page-size", type=int, default=None, help="default 16")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the longest request, rounded up")
    p.add_argument("--buckets", default=None, choices=("coarse", "single", "engine"),
                   help="step shapes: coarse (the default: few, warm-up compiles them all), single (one per "
                   "dimension: CPU smoke runs), engine (the engine's powers of two)")
    p.add_argument("--kernel-impl", default=None, choices=("pallas", "reference"))
    p.add_argument("--dtype", default="bfloat16", help="weights of a random-weight shape")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--scale", type=float, default=None, help="request lengths (and, by default, counts) times this "
                   "(default 1)")
    p.add_argument("--count-scale", type=float, default=None, help="request counts times this (default: --scale)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at once "
                   "per phase)")
    p.add_argument("--phase-s", type=float, default=None, help="seconds between the shifting trace's phases "
                   "(default 1)")
    p.add_argument("--spread", action="store_true", help="shifting trace: each phase's requests arrive over the "
                   "phase (Poisson at count / phase-s), sustained load, instead of all at its start")
    p.add_argument("--jitter", type=float, default=0.0, help="lengths uniform within +-this fraction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=None, help="skip runs that would start after this")
    p.add_argument("--max-run-s", type=float, default=None, help="cap on one run (unfinished requests aborted)")
    p.add_argument("--out", default=None, help="directory for results.json and the PNGs")
    p.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache directory (a later "
                   "call on the same machine loads the compiled steps instead of compiling them)")
    p.add_argument("--server", default=None, help="URL of a running umem-jax server: drive it over HTTP")
    p.add_argument("--vocab-size", type=int, default=256, help="with --server: prompt ids are drawn below this")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    from .datasets import add_arguments as dataset_flags

    dataset_flags(p, default=None)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset: from SMALL with --small (the arena only when neither --arena-gib
    nor --arena-bytes was given), from DEFAULTS otherwise.  Flags given explicitly stay."""
    for key, value in ({**DEFAULTS, **SMALL} if args.small else DEFAULTS).items():
        if key == "arena_bytes" and args.arena_gib is not None:
            continue
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def bucket_kwargs(kind: str, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  page_size: int) -> dict:
    from .driver import coarse_buckets

    if kind == "engine":
        return {}
    if kind == "coarse":
        return coarse_buckets(max_num_seqs, max_num_batched_tokens, max_model_len, page_size)
    pages = -(-max_model_len // page_size)
    return {"batch_buckets": (1 << (max_num_seqs.bit_length() - 1),), "token_buckets": (max_num_batched_tokens,),
            "page_buckets": (1 << (pages - 1).bit_length(),)}


def _workloads(args, max_len: int | None, vocab_size: int, tokenizer_path=None):
    from .workload import make_all

    if args.dataset_name:
        return [_dataset_workload(args, max_len, vocab_size, tokenizer_path)]
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    return make_all(names, scale=args.scale, count_scale=args.count_scale, max_len=max_len, rate=args.rate,
                    phase_s=args.phase_s, spread=args.spread, jitter=args.jitter, seed=args.seed)


def _dataset_workload(args, max_len: int | None, vocab_size: int, tokenizer_path=None):
    """--dataset-name: bench serve's dataset as one workload (token-id prompts; arrivals Poisson
    at --rate, else all at once; --scale and the trace flags do not apply)."""
    from .datasets import ClientTokenizer, arrivals, sample
    from .workload import from_samples

    name = args.tokenizer or (str(tokenizer_path) if tokenizer_path else None)
    tok = ClientTokenizer(name) if name and args.dataset_name == "sharegpt" else None  # the others draw ids
    samples = sample(args, tok, vocab_size, ids_only=True)
    offsets = arrivals(len(samples), args.rate or float("inf"), 1.0, args.seed)
    return from_samples(args.dataset_name, samples, offsets, args.seed, max_len)


def main(args) -> int:
    if args.dataset_name and args.workload is not None:
        raise ValueError("give --workload (a synthetic trace) or --dataset-name, not both")
    resolve(args)
    deadline = time.monotonic() + args.time_budget_s if args.time_budget_s else None
    arena = int(args.arena_gib * 2**30) if args.arena_gib is not None else args.arena_bytes
    if args.server:
        return _server(args)
    from .driver import enable_compile_cache
    from .sweep import load_bench_model, run_benchmark

    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    model = load_bench_model(args.model or "tiny", args.dtype, args.seed)
    workloads = _workloads(args, args.max_model_len or model.config.max_position_embeddings, model.config.vocab_size,
                           getattr(model, "tokenizer_path", None))
    ps = args.page_size
    mml = args.max_model_len or -(-(max(w.max_len for w in workloads) + ps) // ps) * ps
    engine_kwargs = dict(arena_bytes=arena, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, page_size=ps, max_model_len=mml,
                         seed=args.seed, kernel_impl=args.kernel_impl,
                         enable_prefix_caching=args.enable_prefix_caching,
                         **bucket_kwargs(args.buckets, args.max_num_seqs, args.max_num_batched_tokens, mml, ps))
    run_benchmark(model, workloads, engine_kwargs=engine_kwargs, statics=args.static_ratios, out_dir=args.out,
                  deadline=deadline, max_run_s=args.max_run_s, progress=args.progress,
                  meta={"model": args.model or "tiny", "scale": args.scale, "seed": args.seed, "small": args.small})
    return 0


def _server(args) -> int:
    from .http_driver import run_http
    from .sweep import table, write_report

    model = args.model  # the served model name; None: the server's first
    report = {"meta": {"server": args.server, "model": model or "", "scale": args.scale, "seed": args.seed},
              "workloads": [], "rows": [], "comparisons": [], "runs": []}
    for wl in _workloads(args, args.max_model_len, args.vocab_size):
        print(wl.describe())
        r = run_http(args.server, wl, wl.prompts(args.vocab_size), model=model, progress=args.progress)
        report["workloads"].append(wl.to_dict())
        report["rows"].append(r.summary())
        report["runs"].append(r.to_dict())
    if args.out:
        write_report(report, args.out, plots=True)
    print(table(report["rows"]))
    return 0


__all__ = ["DEFAULTS", "SMALL", "add_arguments", "bucket_kwargs", "main", "resolve"]
