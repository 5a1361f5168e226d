"""The scheduler's memory decisions on a serving trace, on the host: no model, no device.

    python3 -m benchmarks.simulate_admission                       # qwen3.5-4b-like, bench_serving's shifting trace
    python3 -m benchmarks.simulate_admission --short 512,1024 --long 8192,1024 --arena-gib 2.5

The engine's own pieces (plan from the model's declarations, sized arena, ChainAllocator with or
without static regions, DemandModel, Scheduler) run the trace that benchmarks/bench_serving.py
drives on the GPU, with the same engine settings; a step "takes" the time of a simple cost model
fitted to the H200 (bench_models / bench_engine, RESULTS.md):

    prefill step  PREFILL_BASE_S + PREFILL_S_PER_TOKEN * tokens  (2048-token chunk ~ 100 ms; every pass
                  reads the weights once, as a decode step does: since session 15); tokens are the
                  step's padded shape B x T, each padded up to its bucket, as the engine computes
                  them (`--prefill-cost padded`, since session 29; `tokens`: the rows' own
                  tokens, the model of the tables before it)
    decode step   DECODE_BASE_S + DECODE_S_PER_ROW * rows + K/V read at the rows' lengths

so arrivals interleave with steps roughly as on the GPU.  A request that a step ends gives its
memory to the next schedule, as the engine's `Scheduler.release_ending` does since session 33
(before it, the engine held those pages one schedule longer than this simulation did).  What it
reports is exact for the scheduler (admissions, retractions, peak running, utilization of the
arena by live requests);
the times are the cost model's, so tok/s here is a model figure, not a measurement.

By default a long prompt may start its prefill in the bytes no running request is owed before its
whole need fits (early_admission, the engine's default; off in sessions 31-32); `--no-early` makes it
wait in the queue until its whole need fits.

`--rule before` prices a chunked prompt by its first chunk alone instead of reserving the rest
of the prompt at admission, to show what that reservation does to retractions.  Every request
here is fixed-length (ignore_eos, no stop), so the scheduler reserves for it exactly, as the
engine does by default (scheduler/reservations.py: decoders by DemandModel.decode_peak, the
others their whole remaining life); `--no-exact` turns that off
(exact_fixed_length_reservation=False): the decaying ratio of the outputs left, the rule before.

Utilization is reported twice: the mean over the samples with requests waiting while fewer than
max_num_seqs run (what bench_serving's figure also counts), and the median over the samples where
the first waiting request's admission does not fit the arena -- only there is memory what holds
it back; at the others the prefill token budget or the prefill streak does.  "reserved" is the
mean, over those samples, of the running requests' reservations (fraction of the arena): free
bytes already spoken for.

This is a script of its own, not a mode of bench_serving: it runs no model and no device, its
times and tok/s are a cost model's (only ratios within one table mean anything), and its flags
(one --model, --rule, the admission ratios) are the scheduler's, not the GPU run's.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

from umem_jax.bench.driver import MemoryConfig
from umem_jax.bench.sweep import static_configs
from umem_jax.bench.workload import Shape
from umem_jax.core.request import Request, RequestStatus
from umem_jax.core.sampling_params import SamplingParams
from umem_jax.core.scheduled_batch import Buckets
from umem_jax.memory import ChainAllocator, size_arena, static_regions
from umem_jax.memory import plan as make_plan
from umem_jax.memory.declarations import dtype_words, kv_cache_dtype
from umem_jax.memory.demand import DemandModel
from umem_jax.memory.sizing import budget_bytes
from umem_jax.models.registry import build_random
from umem_jax.scheduler.reservations import reservations, reserve_tokens
from umem_jax.scheduler.scheduler import Scheduler, SchedulerConfig

from . import bench_serving as bs

PREFILL_S_PER_TOKEN = 100e-3 / 2048
PREFILL_BASE_S = 2.6e-3  # the weights' read, as DECODE_BASE_S
DECODE_BASE_S = 2.6e-3  # weights of a 4B model at ~3.3 TB/s
DECODE_S_PER_ROW = 0.03e-3  # 24 gated-DeltaNet layers' state read + written per row
KV_S_PER_TOKEN = 32 * 1024 / 3.3e12  # Qwen3.5-4B-like: 8 attention layers x 4 KV heads x 256 x K,V in bf16


def _first_chunk_only(self, req, after=None):  # --rule before: reserve outputs only, not the prompt's rest
    return reserve_tokens(req, self.ratio, self.exact, after=req.num_tokens)


def _head_fits(sch, dm, alloc, chunk: int, batch) -> tuple[bool, int, int]:
    """Whether the first waiting request's first pass and reservations fit the arena now, the
    bytes the running requests' reservations hold back (what is free but spoken for), and the
    part of those the decoding requests hold back (the rest: prompts still being computed), priced
    as the next schedule prices them: with the tokens `batch` sampled pending (as under async
    scheduling), so its rows are decode-ready, and those that took their last token reserve
    nothing.  (Read before the tokens are appended, a decode row looks like a prompt with one
    token to compute: its exact reservation would be its own whole rest, not the decoders'
    joint peak.)"""
    head = sch.waiting[0]
    end = min(head.num_tokens, chunk)
    sampled = [row.req for row in batch.rows if row.sample]
    for r in sampled:
        r.num_pending += 1
    try:
        sch._reserved = None
        need = dm.span(0, end) + dm.reservation(head, sch._reserve_tokens(head, after=end), after=end)
        reserved = sch._reservations()
        decoding = [r for r in sch.running if r.decode_ready]
        by_decoders = reservations(decoding, sch.holders, dm, sch._reserve_tokens, sch.exact)
        return dm.fits(alloc, need + reserved), dm.bytes(reserved), dm.bytes(by_decoders)
    finally:
        for r in sampled:
            r.num_pending -= 1
        sch._reserved = None


def prefill_tokens(batch, buckets: Buckets, padded: bool = True) -> int:
    """The tokens a prefill step computes: its padded [B, T] shape (each padded up to its bucket:
    the projections and MLPs run over every padded token), or with `padded` False its rows' own."""
    own = [r.end - r.start for r in batch.rows]
    if not padded:
        return sum(own)
    return Buckets.pick(buckets.batch, len(own)) * Buckets.pick(buckets.tokens, max(own))


def simulate(plan, num_rows: int, trace, mem, *, max_num_seqs: int, budget_tokens: int, page_size: int,
             max_model_len: int, rule: str = "now", kv_scale: float = 1.0, padded: bool = True,
             buckets: Buckets | None = None, **sched_kw) -> dict:
    """One memory configuration through `trace` -> its row.  kv_scale: the K/V bytes per token
    against bf16 (fp8 K/V: 0.5), which scales the decode step's K/V read in the cost model;
    padded: a prefill step costs its padded shape's tokens (prefill_tokens); buckets: the step
    shapes (default: the engine's powers of two)."""
    regions = None
    if mem.mode == "static":
        regions = static_regions(plan, num_rows, swa_full_tokens_ratio=mem.swa_full_tokens_ratio,
                                 mamba_full_memory_ratio=mem.mamba_full_memory_ratio)
    alloc = ChainAllocator(plan, num_rows, static_regions=regions)
    buckets = buckets or Buckets.default(max_num_seqs, budget_tokens, -(-max_model_len // page_size))
    dm = DemandModel(plan, chunk=min(budget_tokens, buckets.tokens[-1]),
                     empty=ChainAllocator(plan, num_rows, static_regions=regions))
    sch = Scheduler(SchedulerConfig(max_num_seqs, budget_tokens, buckets, **sched_kw), alloc, dm)
    if rule == "before":
        sch._reserve_tokens = _first_chunk_only.__get__(sch)
    windows = tuple(n for n, _ in dm.windows)
    pending = sorted(trace.requests, key=lambda r: r.arrival_s)
    t, i, out_tokens, steps, peak, util, refused, clipped, bound, reserved = 0.0, 0, 0, 0, 0, [], 0, 0, [], []
    prefill_steps, prefill_s = 0, 0.0
    by_decoders = []
    states = {}  # memory-bound samples by what is under way: [live, free + holes, cache-only, owed decoders]
    held = []  # tokens the running requests hold in the arena (computed and cached), per step
    while i < len(pending) or sch.has_work():
        while i < len(pending) and pending[i].arrival_s <= t:
            r = pending[i]
            m = dm.clip(r.input_len, r.output_len)
            i += 1
            if m is None:  # the engine refuses it at arrival: it does not fit even an empty arena
                refused += 1
                continue
            clipped += m < r.output_len
            # with the prefix cache, prompts share nothing (each its own tokens) but finished requests' pages stay cached
            tokens = [(i * 7919 + k) % 30000 + 3 for k in range(r.input_len)] if sch.cache is not None else \
                [5] * r.input_len
            req = Request(str(i), None, tokens, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                          arrival=i, seed=0, max_tokens=m, windows=windows)
            sch.add(req)
        if not sch.has_work():
            t = pending[i].arrival_s
            continue
        b = sch.schedule()
        if b is None:
            raise RuntimeError("the scheduler stalled with work queued")
        steps += 1
        peak = max(peak, len(sch.running))
        held.append(sum(r.num_computed for r in sch.running))
        if b.kind == "prefill":  # a step is a prefill or a decode: the decoders wait out a prefill step
            dt = PREFILL_BASE_S + PREFILL_S_PER_TOKEN * prefill_tokens(b, buckets, padded)
            t, prefill_steps, prefill_s = t + dt, prefill_steps + 1, prefill_s + dt
        else:
            kv_read = kv_scale * KV_S_PER_TOKEN * sum(r.end for r in b.rows)
            t += DECODE_BASE_S + len(b.rows) * DECODE_S_PER_ROW + kv_read
        if sch.waiting and len(sch.running) < max_num_seqs:  # memory binds: where the arena's bytes are
            u = alloc.usage()
            cached = 0 if sch.cache is None else \
                sum(n * plan[k].page_bytes for k, n in sch.cache.evictable_by_subpool().items())
            # live: what requests hold (pages only the prefix cache holds left out, as the engine's usage does)
            util.append(np.array([u.live_bytes - cached, u.hole_bytes, u.free_bytes, u.sink_bytes]) / u.total_bytes)
            fits, held_back, decoders_back = _head_fits(sch, dm, alloc, dm.chunk, b)
            if not fits:
                bound.append(util[-1])
                reserved.append(held_back / u.total_bytes)
                by_decoders.append(decoders_back / u.total_bytes)
                state = "an early start under way" if sch.early.req is not None else "no early start"
                states.setdefault(state, []).append([util[-1][0], (u.free_bytes + u.hole_bytes) / u.total_bytes,
                                                     cached / u.total_bytes, by_decoders[-1]])
        for row in b.rows:
            if row.sample:
                row.req.output_token_ids.append(7)
                out_tokens += 1
                if row.req.num_output >= row.req.max_tokens:
                    sch.finish(row.req, RequestStatus.FINISHED_LENGTH)
        alloc.take_moves()
    if sch.cache is not None:
        sch.cache.clear()  # what finished requests left cached: the arena holds nothing else at the end
    assert not alloc.leaks()
    return dict(config=mem.label, rule=rule, steps=steps, prefill_steps=prefill_steps, prefill_seconds=prefill_s,
                seconds=t, out_tok_per_s=out_tokens / t, peak_running=peak,
                retractions=sch.num_retractions, tokens_held_peak=max(held, default=0),
                tokens_held_mean=float(np.mean(held)) if held else 0.0,
                util=float(np.mean(util, axis=0)[0]) if util else None,
                split=dict(zip(("live", "holes", "free", "sink"), np.mean(util, axis=0).tolist())) if util else None,
                refused=refused, clipped=clipped, memory_bound_samples=len(bound),
                util_bound=float(np.median([b[0] for b in bound])) if bound else None,
                split_bound=dict(zip(("live", "holes", "free", "sink"), np.mean(bound, axis=0).tolist())) if bound else None,
                reserved_bound=float(np.mean(reserved)) if bound else None,
                reserved_decoders_bound=float(np.mean(by_decoders)) if bound else None,
                by_state={k: dict(zip(("samples", "live", "free", "cached", "owed_decoders"),
                                      [len(v), *np.mean(v, axis=0).tolist()])) for k, v in states.items()})


def main(argv=None) -> int:
    run(argv)
    return 0


def run(argv=None) -> list[dict]:
    """Parse argv, simulate every (rule, configuration), print a line each -> the rows."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-4b-like", choices=sorted(bs.MODELS))
    ap.add_argument("--workload", default="shifting", choices=bs.ORDER)
    ap.add_argument("--arena-gib", type=float, default=None)
    ap.add_argument("--short", default="512,128")
    ap.add_argument("--long", default=None)
    ap.add_argument("--n-short", type=int, default=128)
    ap.add_argument("--phase-s", type=float, default=2.0)
    ap.add_argument("--phases", type=int, default=4, help="phases of the shifting trace")
    ap.add_argument("--spread", action="store_true", help="shifting: arrivals spread over each phase (Poisson)")
    ap.add_argument("--n-long-phase", type=int, default=None, help="long requests per long phase (default: model's)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--static-ratios", default=None)
    ap.add_argument("--ratio", type=float, default=None, help="SchedulerConfig.new_token_ratio (default the engine's)")
    ap.add_argument("--min-ratio", type=float, default=None, help="SchedulerConfig.min_new_token_ratio")
    ap.add_argument("--decay", type=float, default=None, help="SchedulerConfig.new_token_ratio_decay")
    ap.add_argument("--rule", default="now,before", help="comma list: now (reserve a chunked prompt's rest), before")
    ap.add_argument("--no-exact", action="store_true",
                    help="the ratio rule for fixed-length requests too (exact_fixed_length_reservation=False)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="comma list of K/V storage dtypes to run in the same arena bytes (auto, fp8, ...): the "
                         "plan's K/V rows and the cost model's K/V read follow it")
    ap.add_argument("--prefill-cost", choices=("padded", "tokens"), default="padded",
                    help="a prefill step's tokens in the cost model: its padded [B, T] shape (what the engine "
                         "computes) or its rows' own tokens (the model of the tables before session 29)")
    ap.add_argument("--early", action="store_true",
                    help="early_admission=True, the engine's default (kept for older commands)")
    ap.add_argument("--no-early", action="store_true",
                    help="a long prompt waits in the queue until its whole need fits (early_admission=False)")
    ap.add_argument("--no-joint", action="store_true",
                    help="a request's own decode peak is added to the decoders' (joint_admission=False)")
    ap.add_argument("--buckets", default=None,
                    help="B,B,..:T,T,..:P,P,.. step-shape buckets, as bench_serving's (default: powers of two)")
    ap.add_argument("--by-state", action="store_true",
                    help="also the memory-bound samples' means by what is under way (an early-started prompt "
                    "still computing, or none): live, free (holes included), cache-only, owed to the decoders")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="the scheduler's prefix cache on, as the engine's default (prompts share no tokens, but "
                    "finished requests' pages stay cached until evicted)")
    a = ap.parse_args(argv)
    spec = dict(bs.MODELS[a.model])
    if a.long:
        spec["long"] = tuple(int(x) for x in a.long.split(","))
    short = Shape(*(int(x) for x in a.short.split(",")))
    if a.n_long_phase is not None:
        spec["n_long_phase"] = a.n_long_phase
    (trace,) = bs.workloads([a.workload], spec, short=short, n_short=a.n_short, phase_s=a.phase_s, jitter=0.2, seed=0,
                            phases=a.phases, spread=a.spread)
    page_size, max_num_seqs, budget_tokens = 16, a.max_num_seqs, a.max_num_batched_tokens
    mml = -(-(trace.max_len + page_size) // page_size) * page_size
    model = build_random(a.model, abstract=True)
    arena = a.arena_gib if a.arena_gib is not None else spec["arena_gib"]
    print(f"{a.model}, {trace.describe()}, arena {arena:g} GiB; "
          f"cost model: prefill {PREFILL_S_PER_TOKEN * 2048 * 1e3:.0f} ms per 2048 tokens ({a.prefill_cost}), decode "
          f"{DECODE_BASE_S * 1e3:.1f} ms + {DECODE_S_PER_ROW * 1e3:.2f} ms per row + K/V", flush=True)
    sched_kw = {k: v for k, v in (("new_token_ratio", a.ratio), ("min_new_token_ratio", a.min_ratio),
                                   ("new_token_ratio_decay", a.decay)) if v is not None}
    if a.no_exact:
        sched_kw["exact_fixed_length_reservation"] = False
    sched_kw["early_admission"] = not a.no_early
    sched_kw["enable_prefix_caching"] = a.prefix_cache
    if a.no_joint:
        sched_kw["joint_admission"] = False
    buckets = None
    if a.buckets:
        bk = bs.parse_buckets(a.buckets)
        buckets = Buckets(bk["batch_buckets"], bk["token_buckets"], bk["page_buckets"])
    rows = []
    for kv_name in a.kv_cache_dtype.split(","):
        kv = kv_cache_dtype(kv_name.strip(), model.config.dtype)
        plan = make_plan(model.decls(kv), page_size=page_size)
        num_rows = size_arena(plan, budget_bytes(fixed_bytes=int(arena * 2**30), plan=plan)).num_rows
        kv_scale = dtype_words(kv, 2) / 2  # 16-bit words a K/V value takes, against bf16's one
        for rule, mem in itertools.product([r.strip() for r in a.rule.split(",") if r.strip()],
                                           [MemoryConfig()] + static_configs(plan, a.static_ratios)):
            rows.append(simulate(plan, num_rows, trace, mem, max_num_seqs=max_num_seqs, budget_tokens=budget_tokens,
                                 page_size=page_size, max_model_len=mml, rule=rule, kv_scale=kv_scale,
                                 padded=a.prefill_cost == "padded", buckets=buckets, **sched_kw))
            r = rows[-1]
            r["kv_cache_dtype"] = kv
            print(f"  {kv:<9} {r['rule']:<7} {r['config']:<16} {r['steps']:>5} steps ({r['prefill_steps']} prefill, "
                  f"{r['prefill_seconds']:.1f} s)  {r['seconds']:6.1f} s  "
                  f"{r['out_tok_per_s']:7.1f} tok/s (model)  peak {r['peak_running']:>3}  tokens held "
                  f"{r['tokens_held_peak']:>7} peak / {r['tokens_held_mean']:9.0f} mean  "
                  f"{r['retractions']:>3} retractions  utilization under load "
                  f"{'-' if r['util'] is None else format(r['util'], '.2f')}"
                  + ("" if r["split"] is None else " (holes {holes:.3f}, free gap {free:.3f}, sink {sink:.3f})"
                     .format(**r["split"]))
                  + ("" if r["util_bound"] is None else "; memory-bound median {:.3f} (sink {:.3f}, reserved {:.3f}, "
                     "by decoders {:.3f})".format(r["util_bound"], r["split_bound"]["sink"], r["reserved_bound"],
                                                  r["reserved_decoders_bound"]))
                  + (f"  refused {r['refused']} (too long for the split)" if r["refused"] else "")
                  + (f"  clipped {r['clipped']}" if r["clipped"] else ""), flush=True)
            if a.by_state:
                for state, m in sorted(r["by_state"].items()):
                    print(f"      {state}: {m['samples']} samples, live {m['live']:.3f}, free {m['free']:.3f}, "
                          f"cache-only {m['cached']:.3f}, owed to the decoders {m['owed_decoders']:.3f}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
