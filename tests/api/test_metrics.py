"""EngineMetrics on its own (no model, no server): band gauges are the allocator's exact numbers,
labels name windows and units, counters follow the engine's totals, registries are per app.
The served /metrics endpoint is tested end to end in test_api_server.py."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from umem_jax.api.metrics import EngineMetrics
from umem_jax.engine.bands import band_usage
from umem_jax.memory.chain import ChainAllocator
from umem_jax.memory.plan import plan as make_plan
from umem_jax.memory.sizing import size_arena
from umem_jax.models.presets import preset


class FakeEngine:
    """What EngineMetrics reads: plan, allocator, stats()."""

    def __init__(self):
        self.plan = make_plan(preset("tiny-hybrid"), page_size=16)
        self.allocator = ChainAllocator(self.plan, size_arena(self.plan, 4 << 20).num_rows)
        self.counts = {"num_retractions": 0, "num_preemptions": 0, "num_compilations": 0}
        self.running = self.waiting = self.evictable = 0
        self.evictable_pages: dict[str, int] = {}

    def stats(self) -> dict:
        return {"num_running": self.running, "num_waiting": self.waiting, "evictable_bytes": self.evictable,
                "bands": band_usage(self.allocator, self.evictable_pages), **self.counts}


def scrape(m: EngineMetrics) -> dict:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def band(name, kind, window, unit):
    return (("band", name), ("kind", kind), ("unit", unit), ("window", window))


def _fits_alone(allocator, name, n) -> bool:
    """Would n pages (slots) of band `name` alone fit now?  The allocator asked directly."""
    layout = allocator.layout
    i = next(j for j, b in enumerate(allocator.bands) if b.name == name)
    if i == layout.state:
        return n <= allocator.available_state_slots()
    if i == layout.full:
        return allocator.can_fit(token_pages=n, window_pages={allocator.bands[j].name: 0 for j in layout.windows})
    return layout.fits({i: n})


def test_band_gauges_are_the_allocators_exact_numbers():
    eng, m = FakeEngine(), EngineMetrics("fake")
    m.bind(eng)
    s = scrape(m)
    assert s[("umem:arena_band_held", band("full", "full", "", "pages"))] == 0
    vids = eng.allocator.alloc_token_pages(5, window_pages={"window64": 2})
    slots = eng.allocator.alloc_state_slots(3)
    eng.running = 2
    eng.evictable = eng.plan["full"].page_bytes  # say the prefix cache alone holds one of the full pages
    eng.evictable_pages = {"full": 1}
    m.snapshot(eng)
    s, u = scrape(m), eng.allocator.usage()
    for name, kind, window, unit, held, cache in (("full", "full", "", "pages", 5, 1),
                                                  ("window64", "window", "64", "pages", 2, 0),
                                                  ("state", "state", "", "slots", 3, 0)):
        key = band(name, kind, window, unit)
        sp, size = u.subpools[name], eng.plan[name].page_bytes
        assert s[("umem:arena_band_held", key)] == held == sp.held
        assert s[("umem:arena_band_held_bytes", key)] == sp.held_bytes == held * size
        assert s[("umem:arena_band_held_cache", key)] == cache
        assert s[("umem:arena_band_held_requests", key)] == held - cache
        assert s[("umem:arena_band_held_requests_bytes", key)] == (held - cache) * size
        assert s[("umem:arena_band_held_cache_bytes", key)] == cache * size
        # available: what this band alone could get, in its own pages (tests/engine/test_defaults.py)
        free = s[("umem:arena_band_available", key)]
        assert free > 0 and _fits_alone(eng.allocator, name, free) and not _fits_alone(eng.allocator, name, free + 1)
        assert s[("umem:arena_band_available_bytes", key)] == free * size
        assert 0 < s[("umem:arena_band_usage_perc", key)] < 1
    assert s[("umem:arena_token_pages_available", ())] == u.token_pages_available
    assert s[("umem:num_requests_running", ())] == 2
    assert s[("umem:arena_evictable_bytes", ())] == eng.evictable
    # what requests hold: evictable pages count as free, as in vLLM's and SGLang's usage
    assert s[("umem:kv_cache_usage_perc", ())] == pytest.approx((u.live_bytes - eng.evictable)
                                                                / (u.total_bytes - u.sink_bytes))
    parts = sum(s[("umem:arena_bytes", (("part", p),))] for p in ("live", "holes", "free", "sink"))
    assert parts == s[("umem:arena_total_bytes", ())] == u.total_bytes
    eng.allocator.free_token_pages(vids)
    eng.allocator.free_state_slots(slots)
    m.snapshot(eng)
    s = scrape(m)
    assert all(v == 0 for k, v in s.items() if k[0] in ("umem:arena_band_held", "umem:arena_band_held_bytes"))


def test_engine_counters_follow_totals_and_optional_ones_stay_zero():
    eng, m = FakeEngine(), EngineMetrics("fake")
    m.bind(eng)
    eng.counts.update(num_retractions=3, num_compilations=2, relocated_bytes=4096)
    m.snapshot(eng)
    eng.counts.update(num_retractions=5)
    m.snapshot(eng)
    m.snapshot(eng)
    s = scrape(m)
    assert s[("umem:num_retractions_total", ())] == 5 and s[("umem:num_compilations_total", ())] == 2
    assert s[("umem:relocated_bytes_total", ())] == 4096
    assert s[("umem:num_evictions_total", ())] == 0  # not reported by this engine: stays 0


def test_request_histograms_and_token_counters():
    m = EngineMetrics("fake")
    m.on_admit(7)
    m.on_tokens(1, ttft=0.05)
    m.on_tokens(2, gap=0.02)  # two tokens read back together: two ITL samples of 0.01
    m.on_finish("length", 0.2, 0.001)
    m.on_abort("client")
    s = scrape(m)
    assert s[("umem:prompt_tokens_total", ())] == 7 and s[("umem:generation_tokens_total", ())] == 3
    assert s[("umem:time_to_first_token_seconds_count", ())] == 1
    assert s[("umem:inter_token_latency_seconds_count", ())] == 2
    assert s[("umem:inter_token_latency_seconds_sum", ())] == pytest.approx(0.02)
    assert s[("umem:e2e_request_latency_seconds_count", ())] == 1
    assert s[("umem:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("umem:num_aborted_requests_total", (("reason", "client"),))] == 1


def test_each_app_has_its_own_registry():
    a, b = EngineMetrics("a"), EngineMetrics("b")  # same names, no "Duplicated timeseries" error
    a.on_admit(1)
    assert scrape(b)[("umem:prompt_tokens_total", ())] == 0
