"""Invariant checks of the whole arena, and the leak check the engine runs at idle.

The bands check themselves (span = live + holes, tables inverse); what only the whole chain can
check is here: the sink, the spans and the free gaps tile the arena in chain order without
overlap, every id is either live or free exactly once, and a window page is bound only to a live
token id (window sub-pools share the full sub-pool's ids).
"""

from __future__ import annotations

import numpy as np

from .layout import ChainLayout
from .tables import IdPool, PageTable


def broken_invariants(layout: ChainLayout, token_ids: IdPool, slot_ids: IdPool | None) -> list[str]:
    """Every broken invariant of `layout` and its id pools, as messages (empty: all hold)."""
    bad = []
    for band in layout.bands:
        bad += band.table.check() + band.check()
    bad += _tiling_problems(layout)
    full = layout.bands[layout.full]
    bad += _id_problems(token_ids, full.table, "token")
    live = full.table.bound()
    for i in layout.windows:
        bound = layout.bands[i].table.bound()
        dead = bound[~np.isin(bound, live)]
        if dead.size:
            bad.append(f"{layout.bands[i].name}: window pages bound to dead token ids {dead[:8]}")
    if layout.state is not None:
        bad += _id_problems(slot_ids, layout.bands[layout.state].table, "state")
    return bad


def _tiling_problems(layout: ChainLayout) -> list[str]:
    """The sink, the band spans (in chain order) and the gaps tile the arena's rows."""
    bad = []
    prev = tiled = layout.sink_rows
    for i, extent in enumerate(layout.extents()):
        if extent is None:
            continue
        lo, hi = extent
        name = layout.bands[i].name
        if lo < prev or hi < lo:
            bad.append(f"{name}: rows [{lo}, {hi}) overlap the band below (ends at {prev})")
        if layout.static and not layout.regions[i][0] <= lo <= hi <= layout.regions[i][1]:
            bad.append(f"{name}: rows [{lo}, {hi}) leave the static region {layout.regions[i]}")
        tiled += (lo - prev) + (hi - lo)
        prev = hi
    if prev > layout.num_rows or tiled + (layout.num_rows - prev) != layout.num_rows:
        bad.append(f"sink, spans and gaps do not tile the arena ({prev} > {layout.num_rows})")
    return bad


def _id_problems(ids: IdPool, table: PageTable, what: str) -> list[str]:
    every = np.sort(np.concatenate([table.bound(), ids.free_ids()]))
    if every.size != ids.capacity - 1 or (every != np.arange(1, ids.capacity)).any():
        return [f"{what} ids: live + free is not every id exactly once"]
    return []


def leaks(live_token_pages: np.ndarray, live_state_slots: np.ndarray, token_pages,
          state_slots) -> dict[str, np.ndarray]:
    """Compare what is allocated with what the holders say they hold (token_pages: every token
    page id held by a request or cached; state_slots: every state slot) -> {problem: ids},
    empty when they agree."""
    out = {}
    for what, held, live in (("token", token_pages, live_token_pages), ("state", state_slots, live_state_slots)):
        held = np.unique(np.asarray(held, dtype=np.int64).reshape(-1))
        if (lost := np.setdiff1d(live, held)).size:
            out[f"{what} allocated but held by nobody"] = lost
        if (ghost := np.setdiff1d(held, live)).size:
            out[f"{what} held but not allocated"] = ghost
    return out


__all__ = ["broken_invariants", "leaks"]
