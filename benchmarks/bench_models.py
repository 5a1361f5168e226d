"""Whole-model steps at realistic shapes with random bf16 weights: ms per step against a bytes roofline.

  python3 -m benchmarks.bench_models                          # GPU: three families, --budget 420 s
  python3 -m benchmarks.bench_models --families gemma3 --ctx 2048
  python3 -m benchmarks.bench_models --small                  # CPU: tiny shapes, reference kernels, seconds
  python3 -m benchmarks.bench_models --breakdown [--help]     # where one decode step's time goes (model_breakdown)
  python3 -m benchmarks.bench_models --memory-probe [--help]  # compile only: temporaries against the arena size

Families: benchmarks/families.py (configs built there, no checkpoint; weights made on the device in bf16).

Per family, in this order:
  1. correctness at a reduced size (model_check.py): one layer of each kind the family has (real
     head and state geometry; vocab cut to 16384).  Two requests run a T=64 prefill chunk, a T=64
     chunk holding one row's last 16 prompt tokens (prefix 64) beside the other row decoding
     inside the chunk, then a T=1 decode step, all through the arena; each row's logits vs
     `model.dense_logits` on the same tokens: max|a - b| / max|b| <= --tol (bf16 on both sides).
  2. the full model: plan(model.decls()) -> size_arena(--arena-gib) -> Arena.create.  For every
     measurement a fresh ChainAllocator hands out token pages and state slots as the engine does
     (model_steps.Pager) and translates them into the batch's physical page tables; the step is
     `model.jit_forward()` (arena donated), default kernels (Pallas on the GPU).
     Measurements, most important first: decode at B=64 then B=1 (--ctx 2048,8192: one compile
     per batch size, the page-table width fits the longest context), prefill of a 2048-token
     prompt at B=1, a chunk of 512 new tokens after a 1536-token prefix at B=8.

--small: tiny widths and a few layers of each family's pattern, reference kernels, on the CPU; the
check runs on the timed model itself and every bucket uses one page-table width (prefill at B=2),
so a family compiles two step shapes.  Its times mean nothing; it exercises the code path.

Timing (timing.time_calls): the first call (compile + run) is first_call_s; ms is the per-step
median over --trials runs of --iters back-to-back steps (the arena rebound each step).

Roofline = bytes the step must move (model_steps.step_costs) / the copy limit measured at the
start of this run (copy_limit.py: the fastest of an XLA copy, an XOR pass, a Pallas copy and a
torch copy over 4 GiB, bytes read + written).
Goal: decode step at B=64 <= 1.25x roofline (dense families), <= 1.3x (MoE families: issue 15).
Prefill rows also give TFLOP/s of the matmuls and attention (approximate).  The table comes
last; rows go to $OUT/bench_models.json (or --json) after every row.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
import traceback
import warnings

import jax
import numpy as np

from umem_jax.arena import Arena
from umem_jax.memory import plan as make_plan
from umem_jax.memory import size_arena
from umem_jax.pallas_kernels._compat import silence_triton_deprecation

from .families import ALIASES, FAMILIES, build_model, family_key
from .engine_trace import print_trace, trace_calls
from .model_check import CHECK_T, check_family, check_width
from .model_steps import ArenaFull, Pager, Stepper, param_counts, routed_experts, step_costs
from .modes import environment, hand_over
from .report import RowLog, fmt, json_path
from .copy_limit import copy_limit
from .timing import time_calls

GIB = 2**30

DENSE_GOAL = 1.25  # decode ms / roofline ms at the goal batch: the dense families'
MOE_GOAL = 1.3  # the MoE families' (issue 15)


def parse_variants(spec: str) -> list[tuple[str, dict]]:
    """'A=1,B=2;A=3' -> [(label, {ENV: value})]; '' -> one variant, the environment as it is."""
    out = []
    for part in (spec.split(";") if spec.strip() else [""]):
        env = {}
        for kv in filter(None, (x.strip() for x in part.split(","))):
            key, sep, value = kv.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--variants: {kv!r} is not ENV=value")
            env[key.strip()] = value.strip()
        out.append((",".join(f"{k}={v}" for k, v in env.items()), env))
    return out


def record(log: RowLog, **row) -> dict:
    row.setdefault("note", "")
    log.add(row)
    print(f"  {row.get('family', ''):<18} {row['kind']:<8} B={fmt(row.get('B'), 'd'):<3} "
          f"T={fmt(row.get('T'), 'd'):<5} ctx={fmt(row.get('ctx'), 'd'):<5} {fmt(row.get('ms'), '.3f'):>9} ms  "
          f"roofline {fmt(row.get('roofline_ms'), '.3f'):>8} ms  ratio {fmt(row.get('ratio'), '.2f'):>5}  "
          f"first {fmt(row.get('first_call_s'), '.1f')} s  {row.get('verdict', '')} {row['note']}", flush=True)
    return row


def fail(log: RowLog, family, kind, exc, **kw):
    traceback.print_exc()
    return record(log, family=family, kind=kind, ms=None, verdict="FAILED",
                  note=f"FAILED: {type(exc).__name__}: {str(exc)[:300]}", **kw)


def measure_copy(log: RowLog, small: bool, trials: int) -> float:
    """The copy limit (bytes/s, read + written; copy_limit.py: the fastest of several copies) over
    4 GiB (4 MiB with --small); best of `trials` runs of 10 calls each."""
    c = copy_limit((4 << 20) if small else (4 << 30), iters=10, trials=trials)
    record(log, family="-", kind="copy", B=None, T=None, ctx=None, ms=c.seconds * 1e3, bytes=c.nbytes, tbps=c.tbps,
           note=f"{c.nbytes / 2 / GIB:.3g} GiB: {c.tbps:.3f} TB/s ({c.fastest}; read + written, best of {trials}; "
           + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in c.variants.items()) + ")")
    return c.bytes_per_s


def setup(cfg, a, arena_bytes: int, seed: int = 0):
    """Random model, plan, arena of `arena_bytes` and the donated step -> (model, plan, rows, Stepper, counts)."""
    model = build_model(cfg, seed)
    if a.fuse:  # as the engine serves it (EngineConfig.fuse_projections)
        model = model.fuse_projections()
    jax.block_until_ready(model.params)
    counts = param_counts(model.params)
    plan = make_plan(model.decls(), page_size=a.page_size)
    size = size_arena(plan, int(arena_bytes))
    arena = jax.block_until_ready(Arena.create(plan, size.num_rows))
    return model, plan, size.num_rows, Stepper(model.jit_forward(impl=a.impl), model.params, arena), counts


def run_check(log, fam: str, cfg, a) -> None:
    """The GPU check: its own reduced model and arena, freed afterwards."""
    model, plan, rows, run, _ = setup(cfg, a, a.check_arena_mib * 2**20, seed=1)
    try:
        record(log, **check_family(fam, model, run, plan, rows, a, check_width(a.page_size)))
    finally:
        del run, model
        gc.collect()


# =============================================================================== measurements


def measurements(a) -> list[dict]:
    """Buckets in priority order; every bucket compiles once and may hold several contexts."""
    w = lambda tokens: a.width or -(-tokens // a.page_size)
    out = [dict(kind="decode", B=B, T=1, ctxs=list(a.ctx), width=w(max(a.ctx))) for B in a.decode_batches]
    pb, pt = a.prefill
    out.append(dict(kind="prefill", B=pb, T=pt, ctxs=[pt], width=w(pt)))
    cb, ct = a.chunk
    out.append(dict(kind="chunk", B=cb, T=ct, ctxs=[a.chunk_prefix + ct], width=w(a.chunk_prefix + ct)))
    return [m for m in out if m["kind"] in a.kinds]


def run_bucket(log, fam, m, run: Stepper, model, plan, num_rows, a, copy_bw, counts, variant: str = "") -> None:
    cfg, name = model.config, FAMILIES[fam]["name"] + (f" [{variant}]" if variant else "")
    B, T = m["B"], m["T"]
    rng = np.random.default_rng(B * 7919 + T)
    for ctx in m["ctxs"]:
        start = ctx - T
        try:
            pager = Pager(plan, num_rows)
            reqs = [pager.new() for _ in range(B)]
            for r in reqs:
                pager.extend(r, start, ctx)
            assert not pager.alloc.take_moves()  # a fresh allocator packs without moving
            toks = rng.integers(1, cfg.vocab_size, size=(B, T), dtype=np.int64)
            batch = pager.batch(reqs, toks, [T] * B, [ctx] * B, m["width"])
            usage = pager.alloc.usage()
        except ArenaFull as e:
            record(log, family=name, kind=m["kind"], B=B, T=T, ctx=ctx, ms=None, verdict="skipped",
                   note=f"arena of {a.arena_gib} GiB too small: {e}")
            continue
        decode = T == 1
        iters = a.iters or (1 if a.small else (10 if decode else 3))
        trials = a.trials or (1 if a.small else 5)
        t = time_calls(lambda: run.advance(batch), iters=iters, trials=trials, warmup=0 if a.small else 2)
        med = t.median
        finite = bool(np.isfinite(np.asarray(run(batch))).all())
        trace = None
        if a.trace and decode and not a.small:
            trace = trace_calls(lambda: run.advance(batch), a.trace, tag=f"{fam}_B{B}_ctx{ctx}")
            print_trace(f"{name} decode B={B} ctx={ctx}", trace)
        # MoE: the weights the roofline counts are the experts this batch's router really picked
        # (random weights route unevenly: the uniform-routing expectation overstates them)
        routed = None
        if getattr(cfg, "moe", None) is not None:
            routed, run.arena = routed_experts(model, run.arena, batch, impl=a.impl)
        c = step_costs(cfg, plan, counts["params"], counts["param_bytes"], B=B, T=T, start=start,
                       expert_params=counts["expert_params"], expert_bytes=counts["expert_bytes"], routed=routed)
        roof = c["total_bytes"] / copy_bw
        ratio = med / roof
        verdict = ""
        if decode and B >= a.goal_batch and not a.small:
            goal = a.goal if a.goal is not None else (MOE_GOAL if getattr(cfg, "moe", None) is not None else DENSE_GOAL)
            verdict = "met" if ratio <= goal else "MISSED"
        live = {k: (v.held, v.held_bytes) for k, v in usage.subpools.items()}
        note = "" if finite else "NON-FINITE LOGITS; "
        if not decode:
            note += f"{c['flops'] / med / 1e12:.0f} TFLOP/s (matmul+attn)"
        issue = statistics.median(t.issue)
        if issue > 0.8 * med:
            # the host's work, or a dispatch that waits for the device (XLA's sort-based top-k did)
            note += f"host-bound: issuing a step took {issue * 1e3:.3f} ms; "
        record(log, family=name, kind=m["kind"], B=B, T=T, ctx=ctx, prefix=start, ms=med * 1e3, ms_min=t.best * 1e3,
               issue_ms=issue * 1e3,
               first_call_s=t.first_s, roofline_ms=roof * 1e3, ratio=ratio, verdict=verdict,
               tokens_per_s=B * T / med, tflops=c["flops"] / med / 1e12, page_table_width=m["width"],
               held={k: dict(pages=v[0], bytes=v[1]) for k, v in live.items()}, iters=iters, trials=trials,
               finite=finite, note=note, routed_experts=routed, **({"trace": trace} if trace else {}), **c)


def _skip_all(log, name, todo):
    for m in todo:
        record(log, family=name, kind=m["kind"], B=m["B"], T=m["T"], ms=None, verdict="skipped",
               note="skipped: --budget reached")


def run_family(log, fam: str, a, copy_bw: float, fam_deadline: float, deadline: float) -> None:
    spec = FAMILIES[fam]
    name = spec["name"]
    cfg = spec["full"]("bfloat16")
    if a.small:
        cfg = spec["tiny"](cfg)  # already check-sized: the check runs on the timed model itself
    elif a.check:
        if time.time() > deadline:
            record(log, family=name, kind="check", ms=None, verdict="skipped", note="skipped: --budget reached")
        else:
            try:
                run_check(log, fam, spec["check"](cfg), a)
            except Exception as e:  # noqa: BLE001 - one family must not end a one-shot GPU run
                fail(log, name, "check", e)
    todo = measurements(a)
    if time.time() > deadline:
        return _skip_all(log, name, todo)
    try:
        t = time.time()
        model, plan, num_rows, run, counts = setup(cfg, a, a.arena_gib * GIB)
        arena_bytes = run.arena.nbytes
        record(log, family=name, kind="build", ms=None, seconds=time.time() - t, **counts, arena_bytes=arena_bytes,
               subpools=list(plan.names),
               note=f"{counts['params'] / 1e9:.2f} B params, {counts['param_bytes'] / GIB:.2f} GiB; arena "
                    f"{arena_bytes / GIB:.2f} GiB ({', '.join(plan.names)}); {time.time() - t:.1f} s")
    except Exception as e:  # noqa: BLE001
        fail(log, name, "build", e)
        return
    if a.small and a.check:
        try:
            record(log, **check_family(fam, model, run, plan, num_rows, a, a.width))
        except Exception as e:  # noqa: BLE001
            fail(log, name, "check", e)
    steps = {}  # variant -> its step, traced under its environment (the kernels read theirs at trace time)
    for i, m in enumerate(todo):
        # The first (most important) bucket starts while the whole budget lasts; the others only
        # within this family's share, so a slow family cannot starve the next.
        if time.time() > (deadline if i == 0 else fam_deadline):
            _skip_all(log, name, [m])
            continue
        for _, (label, env) in itertools.product(range(a.rounds), a.variants):
            try:
                with environment(env):
                    if label not in steps:
                        steps[label] = run.step if not env else model.jit_forward(impl=a.impl)
                    run.step = steps[label]
                    run_bucket(log, fam, m, run, model, plan, num_rows, a, copy_bw, counts, variant=label)
            except Exception as e:  # noqa: BLE001
                fail(log, name, m["kind"], e, B=m["B"], T=m["T"])
                if getattr(run.arena.data, "is_deleted", lambda: False)():  # donated into a failed call
                    run.arena = Arena.create(plan, num_rows)
    del run, model, steps
    gc.collect()
    jax.clear_caches()
    live = sum(x.nbytes for x in jax.live_arrays())
    print(f"  [{name}] freed; live device bytes now {live / GIB:.2f} GiB", flush=True)


# =============================================================================== main


def table(rows) -> str:
    lines = [f"{'family':<18} {'kind':<8} {'B':>3} {'T':>5} {'ctx':>5} {'ms':>9} {'roofline ms':>11} {'ratio':>6}  "
             "verdict"]
    for r in rows:
        if r["kind"] == "build":
            continue
        extra = ""
        if r["kind"] == "check" and r.get("max_rel_err") is not None:
            extra = f"  (max rel err {r['max_rel_err']:.1e})"
        elif r.get("verdict") in ("skipped", "FAILED"):
            extra = f"  {r['note'][:90]}"
        lines.append(f"{r.get('family', ''):<18} {r['kind']:<8} {fmt(r.get('B'), 'd'):>3} {fmt(r.get('T'), 'd'):>5} "
                     f"{fmt(r.get('ctx'), 'd'):>5} {fmt(r.get('ms'), '.3f'):>9} "
                     f"{fmt(r.get('roofline_ms'), '.3f'):>11} {fmt(r.get('ratio'), '.2f'):>6}  "
                     f"{r.get('verdict', '')}{extra}")
    return "\n".join(lines)


def _ints(s):
    return [int(x) for x in str(s).split(",") if x]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--breakdown", action="store_true",
                    help="instead: where the Qwen3.5-4B-like decode step's time goes (own options: --breakdown --help)")
    ap.add_argument("--memory-probe", action="store_true",
                    help="instead: compile-only probe of step temporaries vs the arena size (--memory-probe --help)")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"comma list of {','.join(FAMILIES)} (or {','.join(ALIASES)})")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds; no new measurement starts past it (each family also keeps to its share)")
    ap.add_argument("--small", action="store_true", help="tiny shapes, reference kernels (CPU, seconds)")
    ap.add_argument("--ctx", default=None, help="decode contexts (default 2048,8192; --small 64,128)")
    ap.add_argument("--decode-batches", default=None, help="decode batch sizes (default 64,1; --small 2)")
    ap.add_argument("--prefill", default=None, help="BxT of the prompt prefill (default 1x2048; --small 2x64)")
    ap.add_argument("--chunk", default=None, help="BxT of the chunk step (default 8x512; --small 2x64)")
    ap.add_argument("--kinds", default="decode,prefill,chunk", help="which steps to time, comma list")
    ap.add_argument("--chunk-prefix", type=int, default=None, help="cached tokens before the chunk (default 1536)")
    ap.add_argument("--width", type=int, default=None,
                    help="one page-table width for every bucket (default: each bucket its own; --small: one, "
                         "so the check and the timed steps share two compiled shapes)")
    ap.add_argument("--arena-gib", type=float, default=None, help="arena bytes (default 32 GiB; --small 1/32)")
    ap.add_argument("--check-arena-mib", type=float, default=None, help="arena of the correctness check (256; 16)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-fuse", dest="fuse", action="store_false",
                    help="keep q/k/v, gate/up and GDN input projections as separate matmuls")
    ap.add_argument("--iters", type=int, default=None, help="steps per timed trial (default decode 10, prefill 3)")
    ap.add_argument("--trials", type=int, default=None, help="timed trials, median (default 5)")
    ap.add_argument("--tol", type=float, default=5e-2, help="max rel err of the correctness check (bf16)")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    ap.add_argument("--impl", default=None, choices=("pallas", "reference"),
                    help="kernels (default: pallas on the GPU; --small: reference)")
    ap.add_argument("--goal", type=float, default=None,
                    help=f"decode ms / roofline ms goal at the goal batch (default {DENSE_GOAL} dense, {MOE_GOAL} MoE)")
    ap.add_argument("--goal-batch", type=int, default=64)
    ap.add_argument("--trace", type=int, default=0, help="also profile this many decode steps (kernel table, engine_trace)")
    ap.add_argument("--variants", default="",
                    help="A/B in one process: variants separated by ';', each a ','-list of ENV=value read when a step "
                         "is traced (e.g. 'UMEM_JAX_MOE_PLAN=xla;UMEM_JAX_MOE_PLAN=pallas'): every bucket times each, "
                         "on the same weights, arena and routing; an empty variant is the environment as it is")
    ap.add_argument("--rounds", type=int, default=1, help="with --variants: times through them, alternating")
    ap.add_argument("--json", default=None, help="rows here (default $OUT/bench_models.json if $OUT is set)")
    return ap


def parse(argv):
    ap = _parser()
    a = ap.parse_args(argv)
    if not a.small and jax.default_backend() != "gpu":
        print(f"no GPU ({jax.default_backend()}): running --small", flush=True)
        a.small = True
    s = a.small
    bxt = lambda v: tuple(int(x) for x in v.lower().split("x"))
    a.ctx = _ints(a.ctx or ("64,128" if s else "2048,8192"))
    a.decode_batches = _ints(a.decode_batches or ("2" if s else "64,1"))
    a.prefill = bxt(a.prefill or ("2x64" if s else "1x2048"))
    a.kinds = set(a.kinds.split(","))
    if not a.kinds <= {"decode", "prefill", "chunk"}:
        ap.error(f"--kinds {sorted(a.kinds)}: choose from decode, prefill, chunk")
    a.chunk = bxt(a.chunk or (f"2x{CHECK_T}" if s else "8x512"))
    a.chunk_prefix = a.chunk_prefix if a.chunk_prefix is not None else (32 if s else 1536)
    if s and a.width is None:
        a.width = max(-(-n // a.page_size) for n in (max(a.ctx), a.prefill[1], a.chunk_prefix + a.chunk[1]))
        a.width = max(a.width, check_width(a.page_size))
    a.arena_gib = a.arena_gib or (1 / 32 if s else 32.0)
    a.check_arena_mib = a.check_arena_mib or (16.0 if s else 256.0)
    if s and a.impl is None:
        a.impl = "reference"
    fams = []
    for f in a.families.split(","):
        key = family_key(f)
        if key is None:
            ap.error(f"unknown family {f.strip()!r}; known: {', '.join(FAMILIES)}")
        fams.append(key)
    a.families = fams
    try:
        a.variants = parse_variants(a.variants)
    except ValueError as e:
        ap.error(str(e))
    return a


def main(argv=None) -> int:
    other = hand_over(argv, {"--breakdown": "model_breakdown", "--memory-probe": "step_memory"})
    if other is not None:
        return other
    a = parse(argv)
    silence_triton_deprecation()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    dev = jax.devices()[0]
    log = RowLog(json_path(a.json, "bench_models"), jax=jax.__version__,
                 device=str(getattr(dev, "device_kind", dev.platform)), small=a.small, args=dict(vars(a)))
    print(f"jax {jax.__version__} on {dev.platform} {getattr(dev, 'device_kind', '')}"
          f"{' (--small: tiny shapes, reference kernels)' if a.small else ''}; families {a.families}", flush=True)
    t0 = time.time()
    deadline = t0 + a.budget
    try:
        copy_bw = measure_copy(log, a.small, trials=3 if a.small else 5)
    except Exception as e:  # noqa: BLE001
        fail(log, "-", "copy", e)
        copy_bw = float("nan")
    log.meta["copy_bytes_per_s"] = copy_bw
    n = len(a.families)
    for i, fam in enumerate(a.families):
        share = t0 + a.budget * (i + 1) / n
        run_family(log, fam, a, copy_bw, share, deadline)
    log.meta["seconds"] = time.time() - t0
    log.flush()
    print(f"\n== bench_models ({log.meta['seconds']:.0f} s; copy {copy_bw / 1e12:.3f} TB/s"
          f"{'; --small: times mean nothing' if a.small else ''}) ==")
    print(table(log.rows))
    bad = [r for r in log.rows if r.get("verdict") in ("FAILED", "FAIL") or r.get("finite") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
