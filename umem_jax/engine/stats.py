"""The engine's numbers, as `LLMEngine.stats()` returns them (what /metrics and the benchmarks
read): the arena's bytes and bands, the queues, steps, compilations, page moves and the prefix
cache's counters."""

from __future__ import annotations


def engine_stats(engine) -> dict:
    """One flat dict of the engine's counters and memory figures (bytes; pages under "held")."""
    u = engine.allocator.usage()
    sch, runner = engine.scheduler, engine.runner
    return {
        "memory_mode": engine.config.memory_mode, "arena_bytes": u.total_bytes, "live_bytes": u.live_bytes,
        "evictable_bytes": engine.evictable_bytes(), "hole_bytes": u.hole_bytes, "free_bytes": u.free_bytes,
        "held": {k: v.held for k, v in u.subpools.items()},
        "bands": engine.bands(),
        "num_running": engine.num_running, "num_waiting": engine.num_waiting,
        "num_retractions": sch.num_retractions, "num_preemptions": sch.num_preemptions,
        "num_early_starts": sch.early.num_started,
        "num_steps": dict(engine.num_steps), "num_compilations": runner.num_compilations,
        "num_moved_pages": runner.num_moved_pages, "relocated_bytes": runner.relocated_bytes,
        "num_compactions": runner.num_compactions, "num_failed_requests": engine.isolation.num_failed,
        **cache_stats(engine),
        **({"speculative": engine.spec_stats.as_dict()} if engine.spec_stats is not None else {}),
    }


def cache_stats(engine) -> dict:
    """Prefix-cache counters, flat (what metrics export) and in detail under "prefix_cache"."""
    sch, cache = engine.scheduler, engine.scheduler.cache
    c = cache.stats() if cache is not None else {}
    detail = {"enabled": cache is not None, **c, "checkpoints_taken": sch.num_checkpoints,
              "checkpoints_skipped": sch.num_checkpoints_skipped,
              "copied_slots": engine.runner.num_copied_slots,
              "held": cache.held_by_subpool() if cache is not None else {}}
    return {"prefix_cache_query_tokens": c.get("query_tokens", 0),
            "prefix_cache_hit_tokens": c.get("hit_tokens", 0), "num_evictions": c.get("evicted_pages", 0),
            "prefix_cache": detail}


__all__ = ["cache_stats", "engine_stats"]
