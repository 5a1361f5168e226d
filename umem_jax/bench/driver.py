"""Driver: one workload through one offline engine, timed, after a warm-up that compiles first.

    model = load_model("tiny")                               # ONCE: engines on it share compilations
    engine = build_engine(model, MemoryConfig("static", 0.8, 0.9), arena_bytes=..., **coarse_buckets(...))
    warm_up(engine)                                          # every step shape this engine can launch
    result = run(engine, workload, workload.prompts(vocab))  # -> RunResult

The loop adds each request once its arrival time has passed by the wall clock, then steps the
engine (LLMEngine.add_request / step), and after every step samples the timeline: output tokens
so far, running / waiting requests and the allocator's usage() (held bytes per band, holes, the
free gap).  Latencies are measured from each request's scheduled arrival.

Compilations: the engine's jitted step is cached per (model, plan) at module level and per
step shape by jit, and engines of equal arena bytes have equal arena shapes, so the unified and
the static engine of a sweep share every compilation.  `warm_up` launches every shape the
engine's buckets can produce (all-padding rows: they read and write only the sink) and the
relocation kernel at every move bucket, so compile time stays out of the figures; the run then
counts XLA compilations (jax.monitoring) and new step shapes, both expected to be 0.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ..core.sampling_params import SamplingParams
from ..core.scheduled_batch import Buckets
from ..engine.engine import EngineConfig, LLMEngine
from .progress import progress_bar
from .results import RequestRecord, RunResult, Timeline
from .workload import Workload

SGLANG_DEFAULTS = (0.8, 0.9)  # (--swa-full-tokens-ratio, --mamba-full-memory-ratio)
MAX_MOVE_BUCKET = 4096  # relocation batches padded up to this are compiled at warm-up

_compiles = [0]
_listening = [False]


def _on_event(event: str, *_a, **_kw) -> None:
    if event.endswith("backend_compile_duration"):
        _compiles[0] += 1


def compile_count() -> int:
    """XLA backend compilations in this process since the driver started listening."""
    if not _listening[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _listening[0] = True
    return _compiles[0]


# ------------------------------------------------------------------------------ configurations


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """How the arena is split: "unified", or "static" with SGLang's ratios (None where the
    model has no such memory: no window sub-pool means no swa ratio, no state no mamba ratio)."""

    mode: str = "unified"
    swa_full_tokens_ratio: float | None = None
    mamba_full_memory_ratio: float | None = None

    @property
    def label(self) -> str:
        if self.mode == "unified":
            return "unified"
        f = lambda x: "-" if x is None else f"{x:g}"
        return f"static {f(self.swa_full_tokens_ratio)}/{f(self.mamba_full_memory_ratio)}"

    @property
    def is_sglang_default(self) -> bool:
        return self.mode == "static" and all(
            v is None or v == d for v, d in zip((self.swa_full_tokens_ratio, self.mamba_full_memory_ratio),
                                                SGLANG_DEFAULTS))

    def engine_kwargs(self) -> dict:
        kw = {"memory_mode": self.mode}
        if self.swa_full_tokens_ratio is not None:
            kw["swa_full_tokens_ratio"] = self.swa_full_tokens_ratio
        if self.mamba_full_memory_ratio is not None:
            kw["mamba_full_memory_ratio"] = self.mamba_full_memory_ratio
        return kw


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def coarse_buckets(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, page_size: int) -> dict:
    """Few step shapes, so warm-up compiles a few dozen steps instead of hundreds.

    batch       1, 2, then powers of two stepping x4 down from max_num_seqs (two prompts of up
                to half the token budget share a step)
    tokens      powers of two from max_num_batched_tokens down to 1/16 of it (fine steps: a prompt
                just over a bucket pads to the next, and a lone row may take the largest)
    pages       the pages of max_model_len (a power of two) and 1/16 of that
    Padding a decode step to a larger batch or page table costs little (padding rows read
    nothing, loops stop at each row's length); padding prefill costs compute, equally in every
    memory mode."""
    top_b = _pow2_floor(max_num_seqs)
    batch = sorted({b for b in (1, 2) if b <= top_b} | {max(1, top_b >> (2 * k)) for k in range(8)})
    top_t = _pow2_floor(max(16, max_num_batched_tokens))
    tokens = sorted({t for t in (top_t >> k for k in range(5)) if t >= 16} | {top_t})
    pages_needed = -(-max_model_len // page_size)
    top_p = 1 << max(3, (pages_needed - 1).bit_length())
    pages = sorted({top_p} | ({top_p >> 4} if top_p >> 4 >= 8 else set()))
    return {"batch_buckets": tuple(batch), "token_buckets": tuple(tokens), "page_buckets": tuple(pages)}


def build_engine(model, memory: MemoryConfig, **engine_kwargs) -> LLMEngine:
    """An offline engine on `model` (a loaded Model: build it once per sweep) in `memory`'s mode."""
    return LLMEngine(EngineConfig(model=model, **memory.engine_kwargs(), **engine_kwargs))


def capacity(engine: LLMEngine, input_len: int, output_len: int, limit: int = 4096) -> int:
    """How many requests of this shape the empty arena holds at once, priced by the engine's own
    demand model over each request's whole life (what the arrival clip prices)."""
    from ..memory.demand import Demand

    dm = engine.demand
    d = dm.lifetime(input_len, output_len)
    times = lambda k: Demand(d.token_pages * k, {w: v * k for w, v in d.window_pages.items()}, d.state_slots * k)
    lo, hi = 0, limit
    while lo < hi:  # demand grows with k: the largest k that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if dm.fits_empty(times(mid)) else (lo, mid - 1)
    return lo


# ------------------------------------------------------------------------------ warm-up


def reachable_shapes(engine: LLMEngine) -> list[tuple[int, int, int, int]]:
    """Every (B, T, P, checkpoint columns) step shape the scheduler can launch with the engine's
    buckets (LLMEngine.reachable_shapes)."""
    return engine.reachable_shapes()


def shapes_of(bk: Buckets, max_num_batched_tokens: int, page_size: int, max_num_seqs: int,
              checkpoints_per_row: int = 0) -> list[tuple[int, int, int, int]]:
    """Every launchable (B, T, P, checkpoints_per_row) step shape: Buckets.reachable."""
    return bk.reachable(max_num_batched_tokens, page_size, max_num_seqs, checkpoints_per_row)


def enable_compile_cache(path: str) -> None:
    """Keep compiled executables in `path` (JAX's persistent compilation cache), so a later
    process -- another benchmark call on the same machine -- loads them instead of compiling."""
    import os

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def warm_up(engine: LLMEngine, *, probe: bool = True, log=None) -> dict:
    """Compile every reachable step shape and the relocation kernel at every move bucket, then
    (probe) run one real 2-token request and empty the prefix cache again.
    -> {"seconds", "shapes", "compiles"}.

    The step shapes compile through LLMEngine.warmup (ahead of time, on threads); the probe
    request then runs the whole path once."""
    from ..arena import apply_moves
    from ..memory.tables import Move

    t0, c0 = time.perf_counter(), compile_count()
    runner = engine.runner
    n_shapes = engine.warmup()
    if log is not None:
        log(f"  warm-up: {n_shapes} step shapes compiled in {time.perf_counter() - t0:.0f} s "
            f"({compile_count() - c0} compilations)")
    seen = set()
    for sp in engine.plan.subpools:
        rows_per_page = sp.rows_per_page
        if rows_per_page in seen:
            continue
        seen.add(rows_per_page)
        n, top = 16, min(MAX_MOVE_BUCKET, engine.size.num_rows // rows_per_page)
        while n <= max(16, top):
            zeros = np.zeros(n, np.int32)
            runner.arena = apply_moves(runner.arena, [Move(sp.name, zeros, zeros, rows_per_page)], impl=runner.impl,
                                       interpret=runner.interpret)
            n *= 2
    jax.block_until_ready(runner.arena)
    if probe:
        engine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                           request_id="umem-bench-warmup")
        while engine.has_unfinished_requests():
            engine.step()
        engine.reset_prefix_cache()
    return {"seconds": time.perf_counter() - t0, "shapes": n_shapes, "compiles": compile_count() - c0}


# ------------------------------------------------------------------------------ one run


def run(engine: LLMEngine, workload: Workload, prompts: list[list[int]], *, memory: MemoryConfig | None = None,
        max_run_s: float | None = None, progress: bool = True, temperature: float = 0.0) -> RunResult:
    """Drive `workload` through `engine` by the wall clock -> RunResult.

    max_run_s: stop admitting and abort every unfinished request once the run is this old (the
    result is then "truncated").  Engine counters in the result are deltas over the run."""
    memory = memory or MemoryConfig(engine.config.memory_mode, engine.config.swa_full_tokens_ratio,
                                    engine.config.mamba_full_memory_ratio)
    sched, alloc = engine.scheduler, engine.allocator
    reqs = workload.requests
    recs = [RequestRecord(r.arrival_s, r.input_len, r.output_len, r.kind) for r in reqs]
    params = {}
    tl = Timeline([sp.name for sp in engine.plan.subpools])
    before, c0, shapes0 = engine.stats(), compile_count(), len(engine.runner.shapes)
    live: dict[str, int] = {}
    done_tokens, truncated, i, n = 0, False, 0, len(reqs)
    t0 = time.time()
    end = t0
    with progress_bar(n, f"{workload.name} {memory.label}", progress) as advance:
        while True:
            now = time.time() - t0
            while i < n and reqs[i].arrival_s <= now and not truncated:
                r = reqs[i]
                sp = params.get(r.output_len)
                if sp is None:
                    sp = params[r.output_len] = SamplingParams(temperature=temperature, max_tokens=r.output_len,
                                                               ignore_eos=True)
                try:
                    live[engine.add_request(prompts[i], sp, request_id=str(i))] = i
                except ValueError as e:  # e.g. longer than max_model_len: reported, not fatal
                    recs[i].finish_reason, recs[i].error = "abort", str(e)
                    advance(1)
                i += 1
            if max_run_s is not None and now > max_run_s and not truncated:
                truncated = True
                for rid in list(live):
                    engine.abort_request(rid)
                for k in range(i, n):
                    recs[k].finish_reason, recs[k].error = "abort", "not sent: the run hit its time cap"
                i = n
            if not engine.has_unfinished_requests():
                if i >= n:
                    break
                u = alloc.usage()
                tl.add(now, done_tokens, 0, 0, u, engine.evictable_bytes())
                time.sleep(max(0.0, reqs[i].arrival_s - (time.time() - t0)))
                continue
            outs = engine.step()
            for o in outs:
                k = live.pop(o.request_id, None)
                if k is None:
                    continue
                _record(recs[k], o, t0 + reqs[k].arrival_s)
                done_tokens += recs[k].tokens
                end = max(end, o.metrics.finished_time or time.time())
            running_tokens = sum(len(q.output_token_ids) for q in sched.running)
            running_tokens += sum(len(q.output_token_ids) for q in sched.waiting)
            u = alloc.usage()
            tl.add(time.time() - t0, done_tokens + running_tokens, len(sched.running), len(sched.waiting), u,
                   engine.evictable_bytes(), sched.memory_bound)
            if outs:
                advance(len(outs), note=f"{len(sched.running)} running, {len(sched.waiting)} waiting")
    after = engine.stats()
    counters = {k: after[k] - before.get(k, 0) for k in ("num_retractions", "num_preemptions", "num_moved_pages",
                                                            "relocated_bytes", "num_evictions")}
    counters.update(compiles=compile_count() - c0, new_shapes=len(engine.runner.shapes) - shapes0,
                    steps={k: after["num_steps"][k] - before["num_steps"].get(k, 0) for k in after["num_steps"]})
    return RunResult(workload.name, memory.label, memory.mode, memory.swa_full_tokens_ratio,
                     memory.mamba_full_memory_ratio, status="truncated" if truncated else "ok", requests=recs,
                     timeline=tl, duration_s=max(end - t0, 1e-9), arena_bytes=int(engine.size.nbytes),
                     max_num_seqs=engine.scheduler.cfg.max_num_seqs, counters=counters)


def _record(rec: RequestRecord, out, arrival: float) -> None:
    """Fill `rec` from a finished RequestOutput (times from the engine's host clock)."""
    m = out.metrics
    comp = out.outputs[0]
    rec.tokens = len(comp.token_ids)
    rec.finish_reason = comp.finish_reason
    rec.error = out.error
    rec.retractions = m.num_retractions if m is not None else 0
    if m is None or m.first_token_time is None:
        return
    rec.ttft_s = m.first_token_time - arrival
    if m.finished_time is not None:
        rec.e2e_s = m.finished_time - arrival
        if rec.tokens > 1:
            rec.tpot_s = (m.finished_time - m.first_token_time) / (rec.tokens - 1)


__all__ = ["MemoryConfig", "SGLANG_DEFAULTS", "build_engine", "capacity", "coarse_buckets", "compile_count",
           "enable_compile_cache", "reachable_shapes", "run", "shapes_of", "warm_up"]
