"""Per-band memory in each band's own units: held by requests, held by the cache, available.

    bands = band_usage(engine.allocator, engine.scheduler.cache.evictable_by_subpool())
    bands["window512"]["cache"], bands["full"]["available_bytes"]

Bands' pages differ in size (a Gemma 3 window page is 5x a full-attention page), so each band
is counted in its own pages (state: slots) and in bytes:

  held       live pages (exact) = requests + cache
  requests   pages some request holds (a prefix shared with the cache counts here)
  cache      pages only the prefix cache holds: evictable, eviction frees them on demand
  available  pages of this band one allocation of this band alone could get now (compacting
             and moving floats if needed).  An estimate: the bands share the free bytes, so
             what one band takes the others lose, and the available figures do not add up.
"""

from __future__ import annotations

from ..memory.chain import ChainAllocator


def band_usage(allocator: ChainAllocator, evictable: dict[str, int]) -> dict[str, dict]:
    """{band name: {kind, window, unit, page_bytes, held, requests, cache, available, *_bytes}}."""
    usage = allocator.usage().subpools
    out = {}
    for i, band in enumerate(allocator.bands):
        sp, s = band.subpool, usage[band.name]
        cache = min(int(evictable.get(band.name, 0)), s.held)
        free = _available_alone(allocator, i)
        counts = {"held": s.held, "requests": s.held - cache, "cache": cache, "available": free}
        out[band.name] = {"kind": sp.kind, "window": sp.window if sp.kind == "window" else None,
                          "unit": "slots" if sp.kind == "state" else "pages", "page_bytes": sp.page_bytes,
                          **counts, **{f"{k}_bytes": v * sp.page_bytes for k, v in counts.items()}}
    return out


def _available_alone(allocator: ChainAllocator, i: int) -> int:
    """Largest n such that n pages of band i alone fit now (a search of ~log2(pages) fits)."""
    layout, band = allocator.layout, allocator.bands[i]
    if i == layout.state:
        return allocator.available_state_slots()
    if i == layout.full:  # token pages that bind no window page
        no_windows = {allocator.bands[j].name: 0 for j in layout.windows}
        fits = lambda k: allocator.can_fit(token_pages=k, window_pages=no_windows)
    else:
        fits = lambda k: layout.fits({i: k})
    lo, hi = 0, max(0, band.max_pages - band.live)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


__all__ = ["band_usage"]
