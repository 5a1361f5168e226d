"""Accounting of the arena: where its rows are (live, holes, free gaps) and why an allocation failed.

Everything is counted from the bands themselves (live pages, holes, extents), so the figures
are exact at any moment; only `available` is an estimate, being what one new allocation could
get now (the allocator's capacity search, passed in).
"""

from __future__ import annotations

import dataclasses

from .layout import ChainLayout


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """Why the last allocation failed: pages asked per sub-pool and what the arena had."""

    demand: dict[str, int]  # pages (slots) asked
    holes: dict[str, int]  # holes each sub-pool could reuse
    rows_needed: int  # rows the demand needs beyond those holes (grid alignment not counted)
    rows_free: int  # rows in the free gaps plus every hole's rows

    def __str__(self) -> str:
        ask = ", ".join(f"{k}: {v}" for k, v in self.demand.items())
        return f"arena short: asked {{{ask}}}, needs {self.rows_needed} rows beyond holes, {self.rows_free} rows free"


@dataclasses.dataclass(frozen=True)
class SubPoolUsage:
    """One sub-pool.  held / held_bytes / holes / span are exact; available is an estimate
    (what a new allocation could get now, joint over the token sub-pools)."""

    name: str
    kind: str
    role: str
    held: int  # live pages (state: slots)
    held_bytes: int
    holes: int
    span: tuple[int, int] | None  # row extent, None for an empty float
    available: int


@dataclasses.dataclass(frozen=True)
class ArenaUsage:
    total_bytes: int
    sink_bytes: int
    live_bytes: int  # bytes of live pages
    hole_bytes: int  # bytes of holes inside spans
    free_bytes: int  # bytes in the gaps between bands (misalignment slivers included)
    token_pages_available: int
    state_slots_available: int
    subpools: dict[str, SubPoolUsage]


class Accounting:
    """Row and byte counts of `layout`'s bands; row_bytes: bytes of one arena row."""

    def __init__(self, layout: ChainLayout, row_bytes: int):
        self.layout, self.row_bytes = layout, row_bytes

    def row_tally(self) -> dict[str, int]:
        """Rows live, in holes, spanned by the bands, and free in the gaps -> {what: rows}."""
        bands = self.layout.bands
        spans = [e for e in self.layout.extents() if e is not None]
        span_rows = sum(hi - lo for lo, hi in spans)
        return {"live": sum(b.live * b.rows_per_page for b in bands),
                "holes": sum(b.nholes * b.rows_per_page for b in bands),
                "span": span_rows,
                "gap": self.layout.num_rows - self.layout.sink_rows - span_rows}

    def shortfall(self, demands: dict[int, int]) -> Shortfall:
        """What `demands` {band: pages} asked of the arena as it is now."""
        bands = self.layout.bands
        holes = {bands[i].name: min(d, bands[i].nholes) for i, d in demands.items()}
        need = sum((d - min(d, bands[i].nholes)) * bands[i].rows_per_page for i, d in demands.items())
        tally = self.row_tally()
        return Shortfall({bands[i].name: d for i, d in demands.items()}, holes, need, tally["gap"] + tally["holes"])

    def usage(self, token_pages_available: int, state_slots_available: int) -> ArenaUsage:
        layout, row_bytes = self.layout, self.row_bytes
        subpools = {}
        for i, b in enumerate(layout.bands):
            available = state_slots_available if i == layout.state else token_pages_available
            subpools[b.name] = SubPoolUsage(b.name, b.subpool.kind, b.subpool.role, b.live,
                                            b.live * b.rows_per_page * row_bytes, b.nholes, b.extent(), available)
        tally = self.row_tally()
        return ArenaUsage(layout.num_rows * row_bytes, layout.sink_rows * row_bytes, tally["live"] * row_bytes,
                          tally["holes"] * row_bytes, tally["gap"] * row_bytes, token_pages_available,
                          state_slots_available, subpools)


__all__ = ["Accounting", "ArenaUsage", "Shortfall", "SubPoolUsage"]
