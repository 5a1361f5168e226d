"""RunResult: what one workload run through one memory configuration measured, and its summary row.

A run records, per request, its latencies (seconds, from its scheduled arrival), and a timeline
sampled between engine steps: time, output tokens so far, running / waiting requests, and the
arena's bytes by band (held bytes of each sub-pool, holes, the free gap, the sink), which tile
the arena exactly.  `summary()` turns that into one table row.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

MAX_TIMELINE_POINTS = 800  # timelines are thinned to this many samples in the JSON (plots need no more)


@dataclasses.dataclass
class RequestRecord:
    """One request's outcome.  Times in seconds; None where the request never got there."""

    arrival_s: float  # scheduled arrival, from the run's start
    input_len: int
    output_len: int  # asked (max_tokens)
    kind: str
    tokens: int = 0  # output tokens received
    ttft_s: float | None = None  # arrival -> first output token on the host
    tpot_s: float | None = None  # (last token - first token) / (tokens - 1)
    e2e_s: float | None = None  # arrival -> finished
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    retractions: int = 0
    error: str | None = None


class Timeline:
    """Column-wise samples.  Columns: t (s from start), out_tokens, running, waiting, live, holes,
    free, sink, evictable (bytes; evictable: the part of live only the prefix cache holds), bound
    (1: the step's prefill attempt left a waiting request out for memory: Scheduler.memory_bound),
    and one `band:<sub-pool>` column of held bytes per sub-pool."""

    def __init__(self, bands: list[str]):
        self.bands = list(bands)
        self.cols: dict[str, list] = {k: [] for k in ("t", "out_tokens", "running", "waiting", "live", "holes",
                                                     "free", "sink", "evictable", "bound")}
        for b in self.bands:
            self.cols[f"band:{b}"] = []

    def add(self, t: float, out_tokens: int, running: int, waiting: int, usage, evictable: int = 0,
            bound: bool = False) -> None:
        """One sample; `usage` is ChainAllocator.usage() (an ArenaUsage) or a dict of the same
        numbers (live_bytes, hole_bytes, free_bytes, sink_bytes, held_bytes {band: bytes}, and
        optionally evictable_bytes, which overrides `evictable`)."""
        c = self.cols
        c["t"].append(round(float(t), 6))
        c["out_tokens"].append(int(out_tokens))
        c["running"].append(int(running))
        c["waiting"].append(int(waiting))
        c["bound"].append(int(bool(bound)))
        if isinstance(usage, dict):
            live, holes, free, sink, held = (usage["live_bytes"], usage["hole_bytes"], usage["free_bytes"],
                                             usage["sink_bytes"], usage["held_bytes"])
            evictable = usage.get("evictable_bytes", evictable)
        else:
            live, holes, free, sink = usage.live_bytes, usage.hole_bytes, usage.free_bytes, usage.sink_bytes
            held = {k: v.held_bytes for k, v in usage.subpools.items()}
        for k, v in (("live", live), ("holes", holes), ("free", free), ("sink", sink), ("evictable", evictable)):
            c[k].append(int(v))
        for b in self.bands:
            c[f"band:{b}"].append(int(held.get(b, 0)))

    def __len__(self) -> int:
        return len(self.cols["t"])

    def array(self, key: str) -> np.ndarray:
        return np.asarray(self.cols[key])

    def to_dict(self, max_points: int = MAX_TIMELINE_POINTS) -> dict:
        """Columns thinned to at most max_points samples (evenly, first and last kept)."""
        n = len(self)
        idx = np.unique(np.linspace(0, n - 1, max_points).round().astype(int)) if n > max_points else np.arange(n)
        return {"bands": self.bands, **{k: [v[i] for i in idx] for k, v in self.cols.items()}}


def _stats(xs, scale: float = 1e3) -> dict:
    """mean, median, p99 of xs (seconds) in milliseconds; NaN-free: None when xs is empty."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(xs, float) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


@dataclasses.dataclass
class RunResult:
    """One run.  status: "ok", "truncated" (stopped at its time cap; unfinished requests aborted),
    "skipped" (not run: out of time) or "failed" (error says why)."""

    workload: str
    label: str  # "unified", "static 0.8/0.9", "server"
    mode: str  # "unified" | "static" | "server"
    swa_full_tokens_ratio: float | None = None
    mamba_full_memory_ratio: float | None = None
    status: str = "ok"
    error: str | None = None
    requests: list[RequestRecord] = dataclasses.field(default_factory=list)
    timeline: Timeline | None = None
    duration_s: float = 0.0  # run start -> last request finished
    arena_bytes: int = 0
    max_num_seqs: int = 0
    counters: dict = dataclasses.field(default_factory=dict)  # engine counters over the run
    warmup: dict = dataclasses.field(default_factory=dict)  # warm-up seconds, shapes, compilations

    def summary(self) -> dict:
        """The row of the results table (latencies in ms, bytes in MiB, rates per second)."""
        row = {"workload": self.workload, "config": self.label, "mode": self.mode,
               "swa_full_tokens_ratio": self.swa_full_tokens_ratio,
               "mamba_full_memory_ratio": self.mamba_full_memory_ratio, "status": self.status, "error": self.error}
        if self.status in ("skipped", "failed"):
            return row
        reqs = self.requests
        done = [r for r in reqs if r.finish_reason in ("length", "stop")]
        tokens = sum(r.tokens for r in reqs)
        dur = max(self.duration_s, 1e-9)
        c = self.counters
        tl = self.timeline
        peak = max(tl.cols["running"], default=0) if tl is not None else c.get("peak_running", 0)
        row.update({
            "requests": len(reqs), "finished": len(done), "aborted": sum(r.finish_reason == "abort" for r in reqs),
            # finished short of output_len: the arrival clip lowered max_tokens to what the arena holds
            "clipped": sum(r.tokens < r.output_len for r in done),
            "output_tokens": tokens, "expected_output_tokens": sum(r.output_len for r in reqs),
            "duration_s": self.duration_s, "req_per_s": len(done) / dur, "out_tok_per_s": tokens / dur,
            **{f"ttft_ms_{k}": v for k, v in _stats(r.ttft_s for r in done).items()},
            **{f"tpot_ms_{k}": v for k, v in _stats(r.tpot_s for r in done).items()},
            **{f"e2e_ms_{k}": v for k, v in _stats(r.e2e_s for r in done).items()},
            "peak_running": int(peak), "retractions": int(c.get("num_retractions", 0)),
            "preemptions": int(c.get("num_preemptions", 0)),
            "relocated_mib": c.get("relocated_bytes", 0) / 2**20, "moved_pages": int(c.get("num_moved_pages", 0)),
            "utilization": self.utilization(), "utilization_with_cache": self.utilization(with_cache=True),
            "utilization_memory_bound": self.utilization(memory_bound=True),
            "compiles_after_warmup": c.get("compiles"),
            "step_shapes_after_warmup": c.get("new_shapes"), "arena_bytes": self.arena_bytes,
        })
        return row

    def utilization(self, *, with_cache: bool = False, memory_bound: bool = False) -> float | None:
        """Arena utilization under load: median of the bytes requests hold (live bytes less those
        only the prefix cache holds, which eviction frees on demand; with_cache: live bytes) /
        arena bytes over the samples with requests waiting although fewer than max_num_seqs run
        (the sequence cap does not hold them back, but the step's token budget may: a burst of
        arrivals waits for prefill passes while memory is free); over all samples with requests
        waiting if there are none such; None if nothing ever waited.  memory_bound: over the
        samples whose step left a waiting request out for memory alone (the `bound` column;
        None if there are none), the simulation's "memory-bound median"."""
        tl = self.timeline
        if tl is None or not len(tl) or not self.arena_bytes:
            return None
        waiting, running, live = tl.array("waiting"), tl.array("running"), tl.array("live")
        if not with_cache:
            live = live - tl.array("evictable")
        if memory_bound:
            bound = tl.array("bound") > 0
            return float(np.median(live[bound]) / self.arena_bytes) if bound.any() else None
        bound = (waiting > 0) & (running < self.max_num_seqs) if self.max_num_seqs else waiting > 0
        if not bound.any():
            bound = waiting > 0
        if not bound.any():
            return None
        return float(np.median(live[bound]) / self.arena_bytes)

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "counters": self.counters, "warmup": self.warmup,
                "requests": [dataclasses.asdict(r) for r in self.requests],
                "timeline": self.timeline.to_dict() if self.timeline is not None else None}


def shortfall(summary: dict) -> str:
    """What a run did not serve of its trace, for titles and tables: "" when it served every
    request in full, else e.g. "2/22 aborted, 1 clipped" (clipped: finished short of max_tokens),
    "truncated" (hit its time cap), "3 compiles in run" (compile time inside the timed window)."""
    if summary.get("status") in ("skipped", "failed"):
        return summary["status"]
    parts = ["truncated"] if summary.get("status") == "truncated" else []
    if summary.get("aborted"):
        parts.append(f"{summary['aborted']}/{summary['requests']} aborted")
    if summary.get("clipped"):
        parts.append(f"{summary['clipped']} clipped")
    if summary.get("compiles_after_warmup"):
        parts.append(f"{summary['compiles_after_warmup']} compiles in run")
    return ", ".join(parts)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing; inf when only b is 0."""
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else math.inf
    return a / b


__all__ = ["MAX_TIMELINE_POINTS", "RequestRecord", "RunResult", "Timeline", "ratio", "shortfall"]
