"""Prometheus metrics of one served engine (prometheus-client, one CollectorRegistry per app).

Names are vLLM's with the prefix `umem:` instead of `vllm:` (so dashboards carry over with a
prefix swap), plus per-band arena gauges in SGLang's per-pool style.  Every series carries
`model_name`.  Counters are exposed with prometheus-client's `_total` suffix.

Scheduler
  umem:num_requests_running                 gauge      requests holding arena memory
  umem:num_requests_waiting                 gauge      queued (new or retracted)
  umem:num_retractions_total                counter    requests sent back to the queue for memory
  umem:num_preemptions_total                counter    ...of which displaced by a higher priority
  umem:num_early_starts_total               counter    prompts started in unreserved bytes before their
                                                       whole need fit (scheduler.py, early start)
  umem:num_aborted_requests_total{reason}   counter    "budget" (prompt over the KV budget) | "client"
                                                       (disconnect / abort) | "error" (failed in the engine)
  umem:request_success_total{finished_reason}  counter "stop" | "length"
  umem:num_compilations_total               counter    distinct step shapes compiled
Arena (all bands)
  umem:kv_cache_usage_perc                  gauge      live bytes / usable bytes (0-1)
  umem:arena_total_bytes                    gauge
  umem:arena_bytes{part}                    gauge      part = live | holes | free | sink (sums to total)
  umem:num_moved_pages_total                counter    pages relocated (compaction, float moves)
  umem:relocated_bytes_total                counter    bytes copied by those relocations
  umem:num_evictions_total                  counter    pages evicted from the prefix cache
  umem:num_compactions_total                counter    steps that applied page relocations first
Prefix cache (vLLM's names; 0 without a prefix cache)
  umem:prefix_cache_queries_total           counter    prompt tokens looked up (stats: prefix_cache_query_tokens)
  umem:prefix_cache_hits_total              counter    ...of which found cached (prefix_cache_hit_tokens)
  umem:arena_token_pages_available          gauge      ESTIMATE: token pages one allocation could get now,
                                                       each with its page in every window band
Per band, each in its own pages (labels band = sub-pool name, kind = full | window | state,
window = its length in tokens or "", unit = "pages" | "slots": a state slot is a page of size 1;
bands' pages differ in size, so compare bands in bytes)
  umem:arena_band_held / _held_bytes        gauge      exact, in `unit` / bytes: requests + cache
  umem:arena_band_held_requests (_bytes)    gauge      ...held by requests (prefixes shared with the cache too)
  umem:arena_band_held_cache (_bytes)       gauge      ...held only by the prefix cache: evictable, freed on demand
  umem:arena_band_available (_bytes)        gauge      ESTIMATE of what an allocation of this band alone could
                                                       get now; the bands share the free bytes (no sum)
  umem:arena_band_usage_perc                gauge      held / (held + available)
Latency and tokens
  umem:time_to_first_token_seconds          histogram  HTTP arrival -> first token on the host
  umem:inter_token_latency_seconds          histogram  gap between a request's successive tokens
  umem:e2e_request_latency_seconds          histogram  HTTP arrival -> finished
  umem:request_queue_time_seconds           histogram  HTTP arrival -> first scheduled
  umem:prompt_tokens_total                  counter    prompts admitted
  umem:generation_tokens_total              counter    tokens streamed
Speculative decoding (vLLM's spec_decode names; only with speculative_config)
  umem:spec_decode_num_drafts_total         counter    decode rows verified
  umem:spec_decode_num_draft_tokens_total   counter    draft tokens proposed
  umem:spec_decode_num_accepted_tokens_total  counter  ...of which accepted
  umem:spec_decode_num_accepted_tokens_per_pos_total{position}  counter  accepted at draft position 0..k-1

Gauges and engine counters are refreshed by the engine thread (`snapshot`, called between
steps), so a scrape never waits for a step and always sees exact allocator numbers of a moment
between two steps.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0)
_ITL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_BAND = ("model_name", "band", "kind", "window", "unit")

# engine.stats() key -> counter name (a key the engine does not report leaves its counter at 0)
_ENGINE_COUNTERS = {"num_retractions": "umem:num_retractions", "num_preemptions": "umem:num_preemptions",
                    "num_early_starts": "umem:num_early_starts",
                    "num_compilations": "umem:num_compilations", "num_moved_pages": "umem:num_moved_pages",
                    "relocated_bytes": "umem:relocated_bytes", "num_evictions": "umem:num_evictions",
                    "num_compactions": "umem:num_compactions",
                    "prefix_cache_query_tokens": "umem:prefix_cache_queries",
                    "prefix_cache_hit_tokens": "umem:prefix_cache_hits"}
# engine.stats()["bands"] key -> (gauge name, help): each band in its own unit, and in bytes
_BAND_GAUGES = {
    "held": ("umem:arena_band_held", "Pages (state: slots) held by a band (exact): requests + cache."),
    "held_bytes": ("umem:arena_band_held_bytes", "Bytes held by a band (exact)."),
    "requests": ("umem:arena_band_held_requests", "Pages (slots) of a band requests hold."),
    "requests_bytes": ("umem:arena_band_held_requests_bytes", "Bytes of a band requests hold."),
    "cache": ("umem:arena_band_held_cache", "Pages (slots) of a band only the prefix cache holds (evictable)."),
    "cache_bytes": ("umem:arena_band_held_cache_bytes", "Bytes of a band only the prefix cache holds (evictable)."),
    "available": ("umem:arena_band_available", "Pages (slots) an allocation of this band alone could get now "
                  "(estimate; the bands share the free bytes)."),
    "available_bytes": ("umem:arena_band_available_bytes", "Bytes an allocation of this band alone could get now "
                        "(estimate)."),
}


class EngineMetrics:
    """Every metric of one engine, registered in its own registry (tests build many apps)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.model_name = m = model_name
        L = ("model_name",)
        self.running = Gauge("umem:num_requests_running", "Requests holding arena memory.", L, registry=r).labels(m)
        self.waiting = Gauge("umem:num_requests_waiting", "Requests waiting to be scheduled.", L, registry=r).labels(m)
        self.kv_usage = Gauge("umem:kv_cache_usage_perc", "Arena bytes requests hold / usable arena bytes (0-1); "
                              "pages only the prefix cache holds count as free (eviction frees them on demand).", L,
                              registry=r).labels(m)
        self.evictable = Gauge("umem:arena_evictable_bytes", "Live arena bytes only the prefix cache holds.", L,
                               registry=r).labels(m)
        self.arena_total = Gauge("umem:arena_total_bytes", "Arena size in bytes.", L, registry=r).labels(m)
        self.arena_bytes = Gauge("umem:arena_bytes", "Arena bytes by part (live, holes, free, sink).",
                                 L + ("part",), registry=r)
        self.token_pages_avail = Gauge("umem:arena_token_pages_available", "Token pages one allocation could get "
                                       "now, each with its page in every window band (estimate).", L,
                                       registry=r).labels(m)
        self.band_gauges = {k: Gauge(name, doc, _BAND, registry=r) for k, (name, doc) in _BAND_GAUGES.items()}
        self.band_usage = Gauge("umem:arena_band_usage_perc", "Band held / (held + available).", _BAND, registry=r)
        self.engine_counters = {k: Counter(name, f"Engine {k.replace('_', ' ')}.", L, registry=r).labels(m)
                                for k, name in _ENGINE_COUNTERS.items()}
        self._seen = dict.fromkeys(_ENGINE_COUNTERS, 0)
        self.aborted = Counter("umem:num_aborted_requests", "Requests aborted, by reason.", L + ("reason",),
                               registry=r)
        self.success = Counter("umem:request_success", "Requests finished, by reason.", L + ("finished_reason",),
                               registry=r)
        self.prompt_tokens = Counter("umem:prompt_tokens", "Prompt tokens admitted.", L, registry=r).labels(m)
        self.generation_tokens = Counter("umem:generation_tokens", "Tokens generated.", L, registry=r).labels(m)
        self.ttft = Histogram("umem:time_to_first_token_seconds", "Time to first token.", L, buckets=_LATENCY,
                              registry=r).labels(m)
        self.itl = Histogram("umem:inter_token_latency_seconds", "Inter-token latency.", L, buckets=_ITL,
                             registry=r).labels(m)
        self.e2e = Histogram("umem:e2e_request_latency_seconds", "End-to-end request latency.", L,
                             buckets=_LATENCY, registry=r).labels(m)
        self.queue_time = Histogram("umem:request_queue_time_seconds", "Time from arrival to first scheduled.", L,
                                    buckets=_LATENCY, registry=r).labels(m)
        self._bands: dict[str, tuple[str, ...]] = {}
        self.spec = {k: Counter(f"umem:spec_decode_{k}", doc, L, registry=r).labels(m) for k, doc in (
            ("num_drafts", "Decode rows verified."), ("num_draft_tokens", "Draft tokens proposed."),
            ("num_accepted_tokens", "Draft tokens accepted."))}
        self.spec_per_pos = Counter("umem:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                                    "position.", L + ("position",), registry=r)
        self._spec_seen: dict = {}

    # ------------------------------------------------------------------ engine thread
    def bind(self, engine) -> None:
        """Label every band of the engine's plan (so all series exist before the first request)."""
        for sp in engine.plan.subpools:
            window = str(sp.window) if sp.kind == "window" else ""
            unit = "slots" if sp.kind == "state" else "pages"
            self._bands[sp.name] = (self.model_name, sp.name, sp.kind, window, unit)
        self.snapshot(engine)

    def snapshot(self, engine) -> None:
        """Refresh gauges and engine counters from the engine; call it in the engine's thread."""
        stats, u = engine.stats(), engine.allocator.usage()
        m = self.model_name
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        usable = max(1, u.total_bytes - u.sink_bytes)
        self.kv_usage.set((u.live_bytes - stats["evictable_bytes"]) / usable)  # cached-only pages count as free
        self.arena_total.set(u.total_bytes)
        self.evictable.set(stats["evictable_bytes"])
        for part, v in (("live", u.live_bytes), ("holes", u.hole_bytes), ("free", u.free_bytes),
                        ("sink", u.sink_bytes)):
            self.arena_bytes.labels(m, part).set(v)
        self.token_pages_avail.set(u.token_pages_available)
        for name, b in stats["bands"].items():
            labels = self._bands.get(name)
            if labels is None:
                continue
            for k, gauge in self.band_gauges.items():
                gauge.labels(*labels).set(b[k])
            self.band_usage.labels(*labels).set(b["held"] / max(1, b["held"] + b["available"]))
        for k, counter in self.engine_counters.items():
            v = int(stats.get(k, self._seen[k]))
            if v > self._seen[k]:
                counter.inc(v - self._seen[k])
                self._seen[k] = v
        if "speculative" in stats:
            self._snapshot_spec(engine.spec_stats)

    def _snapshot_spec(self, st) -> None:
        now = {"num_drafts": st.rows, "num_draft_tokens": st.proposed, "num_accepted_tokens": st.accepted,
               **{j: int(v) for j, v in enumerate(st.accepted_at)}}
        for key, v in now.items():
            got = v - self._spec_seen.get(key, 0)
            if got > 0:
                counter = self.spec[key] if isinstance(key, str) else self.spec_per_pos.labels(self.model_name, str(key))
                counter.inc(got)
                self._spec_seen[key] = v

    # ------------------------------------------------------------------ per request
    def on_admit(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, n: int, *, ttft: float | None = None, gap: float | None = None) -> None:
        """n new tokens of one request; ttft for its first, gap since its previous tokens."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)
            n -= 1
        if gap is not None and n > 0:
            for _ in range(n):  # tokens read back together share the gap
                self.itl.observe(gap / n)

    def on_finish(self, finish_reason: str, e2e: float, queue_time: float | None) -> None:
        self.success.labels(self.model_name, finish_reason).inc()
        self.e2e.observe(e2e)
        if queue_time is not None:
            self.queue_time.observe(queue_time)

    def on_abort(self, reason: str) -> None:
        self.aborted.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------------ HTTP
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["EngineMetrics"]
