"""ChainAllocator: what callers use to take and give back arena memory, by virtual id.

The arena is [num_rows, row_words]; each sub-pool addresses it as its own page grid (from row 0,
or from the sink for the state grid: plan.py) and occupies one band of it.  Where the bands sit and how they make room for each
other is the layout's business (layout.py); the counts are the accounting's (accounting.py);
the whole-arena checks are invariants.py's.  This class validates what callers pass, keeps the
id pools and turns requests into demands on the layout.

Ids.  A token page is one virtual id minted by the full sub-pool; every window sub-pool binds the
same id to a physical page of its own, or leaves it unbound (a tombstone, v2p = -1) once the
page's tokens left the window or if it was allocated without one.  State slots (page size 1) have
their own id space.  Virtual ids are stable; only the tables know physical pages.

Failing is not an error: an allocation that does not fit returns None and leaves the numbers in
`last_shortfall`, since running out of arena is an everyday scheduling event (the caller evicts
or retracts and retries).  `can_fit` answers exactly what the allocation would do.
"""

from __future__ import annotations

import numpy as np

from .accounting import Accounting, ArenaUsage, Shortfall, SubPoolUsage
from .band import Take
from .declarations import WORD_BYTES
from .invariants import broken_invariants, leaks
from .layout import ChainLayout
from .tables import I32, IdPool, Move, PageTable


class ChainAllocator:
    """Host allocators and tables of the whole arena.

    plan: the Plan; num_rows: arena rows; static_regions: {name: (lo_row, hi_row)} for the
    static-split control; eager: compact a band on every free instead of lazily at `flush`;
    max_moves_per_flush: cap on the pages a non-urgent flush of one end band moves.
    """

    def __init__(self, plan, num_rows: int, *, static_regions: dict | None = None, eager: bool = False,
                 max_moves_per_flush: int = 4096):
        if num_rows <= plan.sink_rows:
            raise ValueError(f"arena of {num_rows} rows does not reach past the {plan.sink_rows}-row sink")
        self.plan, self.num_rows, self.eager = plan, int(num_rows), eager
        self.max_moves_per_flush = max_moves_per_flush
        self.static = static_regions is not None
        self.sink_rows = plan.sink_rows
        self.row_bytes = plan.row_words * WORD_BYTES
        self._regions = self._check_regions(static_regions) if self.static else None
        self.layout = ChainLayout(plan, self.num_rows, self._regions, eager=eager,
                                  max_moves_per_flush=max_moves_per_flush)
        self.accounting = Accounting(self.layout, self.row_bytes)
        self.bands = self.layout.bands
        self._full_band = self.bands[self.layout.full]
        self._state = self.layout.state
        self._token_ids = IdPool(self._full_band.table.num_virtual)
        self._slot_ids = IdPool(self.bands[self._state].table.num_virtual) if self._state is not None else None
        self._memo: dict = {}  # capacity searches, valid while the layout's epoch is unchanged
        self.last_shortfall: Shortfall | None = None

    def _check_regions(self, regions: dict) -> list[tuple[int, int]]:
        names = set(self.plan.names)
        if set(regions) != names:
            raise ValueError(f"static_regions must name exactly {sorted(names)}, got {sorted(regions)}")
        out = [tuple(int(x) for x in regions[n]) for n in self.plan.names]
        prev = 0
        for (lo, hi), n in zip(out, self.plan.names):  # in chain order, disjoint, inside the arena
            if not prev <= lo < hi <= self.num_rows:
                raise ValueError(f"static region of {n} [{lo}, {hi}) must lie in [{prev}, {self.num_rows}): "
                                 "regions go in chain order without overlap")
            prev = hi
        return out

    # ================================================================== tokens and slots

    def alloc_token_pages(self, n: int, window_pages: dict[str, int] | None = None) -> np.ndarray | None:
        """Allocate n token pages -> their virtual ids int32 [n], or None (see `last_shortfall`).

        Each id gets a page in the full sub-pool and in every window sub-pool; window_pages
        {window name: k} gives window pages to the last k ids only (the others are born
        tombstoned, e.g. prompt pages that leave the window before anything reads them).
        """
        n = int(n)
        if n <= 0:
            return np.empty(0, I32)
        return self._alloc(self._token_ids, n, self._token_demands(n, window_pages))

    def free_token_pages(self, vids) -> None:
        """Free token pages: every physical page still bound to them (full and windows)."""
        vids = self._live_token_ids(vids)
        if not vids.size:
            return
        touched = [self.layout.full]
        for i in self.layout.windows:
            bound = vids[self.bands[i].table.v2p[vids] > 0]
            if bound.size:
                self.bands[i].release(bound)
                touched.append(i)
        self._full_band.release(vids)
        self._token_ids.push(vids)
        self.layout.after_free(touched)

    def release_window_pages(self, vids, window: str) -> None:
        """Tombstone `vids` in sub-pool `window`: their window pages are freed, the ids and full
        pages stay.  Every id must be live and still bound in that window."""
        i = self._window_index(window)
        vids = self._live_token_ids(vids)
        unbound = self.bands[i].table.v2p[vids] <= 0
        if unbound.any():
            raise ValueError(f"{window}: releasing token pages with no window page (already released?): "
                             f"{vids[unbound][:8]}")
        if vids.size:
            self.bands[i].release(vids)
            self.layout.after_free([i])

    def bind_window_pages(self, vids, window: str) -> bool:
        """Give tombstoned live token pages a fresh page in `window` again (e.g. to recompute a
        cached prefix's window rows) -> False if the arena cannot (nothing changes)."""
        i = self._window_index(window)
        vids = self._live_token_ids(vids)
        if (self.bands[i].table.v2p[vids] > 0).any():
            raise ValueError(f"{window}: some token pages are already bound there")
        if not vids.size:
            return True
        takes = self._take({i: int(vids.size)})
        if takes is None:
            return False
        self.layout.commit(takes, vids)
        return True

    def alloc_state_slots(self, n: int) -> np.ndarray | None:
        """Allocate n state slots -> virtual slot ids int32 [n], or None."""
        n = int(n)
        self._need_state()
        if n <= 0:
            return np.empty(0, I32)
        return self._alloc(self._slot_ids, n, {self._state: n})

    def free_state_slots(self, vids) -> None:
        self._need_state()
        vids = self._live_slot_ids(vids)
        if vids.size:
            self.bands[self._state].release(vids)
            self._slot_ids.push(vids)
            self.layout.after_free([self._state])

    def copy_state_slots(self, src, dst) -> None:
        """Queue a copy of live state slots src[i] -> dst[i] (virtual ids, dst distinct and
        none of them a source), e.g. a prefix-cache checkpoint into a request's working slot.
        It joins the move queue, so it runs after every relocation queued before it and before
        every one queued after: the bytes copied are those of the slots as they are now."""
        self._need_state()
        band = self.bands[self._state]
        src, dst = self._live_slot_ids(src), self._live_slot_ids(dst)
        if src.size != dst.size or np.isin(dst, src).any():
            raise ValueError(f"state slot copies need as many distinct destinations as sources, none a source: "
                             f"{src[:8]} -> {dst[:8]}")
        if src.size:
            self.layout.moves.append(Move(band.name, band.table.v2p[src].copy(), band.table.v2p[dst].copy(),
                                          band.rows_per_page, copy=True))

    # ================================================================== capacity

    def can_fit(self, token_pages: int = 0, state_slots: int = 0, window_pages: dict[str, int] | None = None,
                freed: dict[str, int] | None = None) -> bool:
        """Whether allocating token_pages (with window_pages as in alloc_token_pages) and
        state_slots together succeeds now, through the shortfall ladder if needed.  A window may
        ask more pages than token_pages: the rest are pages for ids that exist now (a priced
        future demand, DemandModel.decode_peak, whose window pages outgrow what finishing
        requests give back while their full pages do not).  freed {sub-pool: pages (slots)}:
        whether it would, once that many live pages (token ids, slots) of each were released --
        an estimate for the prefix cache's evictable entries, checked before evicting them; in
        the unified arena a band's freed pages count for the others too, as compaction gives
        their rows away."""
        demands = self._token_demands(token_pages, window_pages) if token_pages > 0 else {}
        for name, pages in (window_pages or {}).items():
            i = self._window_index(name)
            if pages > demands.get(i, 0):
                demands[i] = int(pages)
        if state_slots > 0:
            if self._state is None:
                return False
            demands[self._state] = demands.get(self._state, 0) + int(state_slots)
        if not demands:
            return True
        if freed:
            give = {self.layout.index[name]: int(n) for name, n in freed.items() if n}
            ids = self._token_ids.free + give.get(self.layout.full, 0)
            slots = self._slot_ids.free + give.get(self._state, 0) if self._state is not None else 0
            return token_pages <= ids and state_slots <= slots and self.layout.fits_freeing(demands, give)
        if token_pages > self._token_ids.free or (state_slots > 0 and state_slots > self._slot_ids.free):
            return False
        return self.layout.fits(demands)

    def available_token_pages(self) -> int:
        """Most token pages (each with a page in every window) one allocation can get now."""
        upper = min(self._token_ids.free, self._full_band.max_pages - self._full_band.live)
        return self._largest("tok", upper, lambda n: self.can_fit(token_pages=n))

    def available_state_slots(self) -> int:
        if self._state is None:
            return 0
        band = self.bands[self._state]
        upper = min(self._slot_ids.free, band.max_pages - band.live)
        return self._largest("state", upper, lambda n: self.can_fit(state_slots=n))

    def _largest(self, key: str, upper: int, fits) -> int:
        """Largest n in [0, upper] with fits(n), memoised until the layout changes."""
        memo = self._memo.get(key)
        if memo is not None and memo[0] == self.layout.epoch:
            return memo[1]
        lo, hi = 0, max(0, upper)
        if hi and fits(hi):
            lo = hi
        while lo < hi:  # feasibility is monotone in n
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        self._memo[key] = (self.layout.epoch, lo)
        return lo

    # ================================================================== compaction, moves

    def flush(self, urgent: bool = False) -> None:
        """Absorb every band's boundary holes (zero copy) and compact the end bands (at most
        max_moves_per_flush pages each); urgent: pack every band, floats included."""
        self.layout.flush(urgent)

    def make_room(self, name: str, side: str, rows: int) -> bool:
        """Relocate float `name` so at least `rows` free rows lie between it and its neighbour
        on `side` ("low"/"high") -> False if that cannot be done (nothing changes)."""
        i = self.layout.index[name]
        if not self.bands[i].is_float:
            raise ValueError(f"{name} is an end band, not a float")
        return self.layout.make_room(i, side, rows)

    def take_moves(self) -> list[Move]:
        """The queued move batches, in order (and clear the queue).  Apply every one to the
        device arena, in order, before the next step reads or writes it."""
        return self.layout.take_moves()

    # ================================================================== translation

    def translate_pages(self, vids, subpool: str, width: int | None = None) -> np.ndarray:
        """Token page ids [B, P] (-1 padding) -> physical pages of `subpool` int32 [B, width],
        padded, unmapped and tombstoned entries being the sink 0."""
        band = self.bands[self.layout.index[subpool]]
        if band.subpool.kind == "state":
            raise ValueError("translate state slots with translate_slots")
        return band.table.translate(vids, width)

    def translate_slots(self, vids, width: int | None = None) -> np.ndarray:
        """State slot ids [B] (-1 padding) -> physical slots int32 [width], sink-padded."""
        self._need_state()
        return self.bands[self._state].table.translate(vids, width)

    # ================================================================== reports and checks

    def usage(self) -> ArenaUsage:
        return self.accounting.usage(self.available_token_pages(), self.available_state_slots())

    def check_invariants(self) -> None:
        """Raise AssertionError listing every broken invariant (bytes tile the arena, spans in
        chain order without overlap, span = live + holes, tables inverse, ids conserved, window
        bindings only on live token pages)."""
        bad = broken_invariants(self.layout, self._token_ids, self._slot_ids)
        if bad:
            raise AssertionError("arena invariants broken:\n  " + "\n  ".join(bad))

    def live_token_pages(self) -> np.ndarray:
        return self._full_band.table.bound()

    def live_state_slots(self) -> np.ndarray:
        return self.bands[self._state].table.bound() if self._state is not None else np.empty(0, I32)

    def leaks(self, token_pages=(), state_slots=()) -> dict[str, np.ndarray]:
        """Compare what the engine holds (every token page id held by a request or cached, every
        state slot) with what is allocated -> {problem: ids}, empty when they agree."""
        return leaks(self.live_token_pages(), self.live_state_slots(), token_pages, state_slots)

    # ================================================================== demands and ids

    def _token_demands(self, n: int, window_pages: dict[str, int] | None) -> dict[int, int]:
        """n token pages -> {band: pages}: the full band n, each window its share of them."""
        demands = {self.layout.full: int(n)}
        window_pages = window_pages or {}
        for name in window_pages:
            self._window_index(name)
        for i in self.layout.windows:
            pages = min(int(n), max(0, int(window_pages.get(self.bands[i].name, n))))
            if pages:
                demands[i] = pages
        return demands

    def _alloc(self, ids: IdPool, n: int, demands: dict[int, int]) -> np.ndarray | None:
        """n fresh ids from `ids`, their pages taken by `demands` -> int32 [n], or None."""
        if n > ids.free:
            return self._fail(demands)
        takes = self._take(demands)
        if takes is None:
            return None
        vids = ids.pop(n)
        self.layout.commit(takes, vids)
        return vids

    def _take(self, demands: dict[int, int]) -> dict[int, Take] | None:
        takes = self.layout.take(demands)
        return takes if takes is not None else self._fail(demands)

    def _fail(self, demands: dict[int, int]) -> None:
        """Record why `demands` did not fit; the None it returns is the failed allocation's answer."""
        self.last_shortfall = self.accounting.shortfall(demands)

    def _need_state(self) -> None:
        if self._state is None:
            raise ValueError("this plan has no state sub-pool")

    def _window_index(self, name: str) -> int:
        i = self.layout.index.get(name)
        if i is None or i not in self.layout.windows:
            names = [self.bands[j].name for j in self.layout.windows]
            raise ValueError(f"{name!r} is not a window sub-pool; windows: {names}")
        return i

    def _live_token_ids(self, vids) -> np.ndarray:
        return _live_ids(vids, self._token_ids, self._full_band.table, "token page")

    def _live_slot_ids(self, vids) -> np.ndarray:
        return _live_ids(vids, self._slot_ids, self.bands[self._state].table, "state slot")


def _live_ids(vids, ids: IdPool, table: PageTable, what: str) -> np.ndarray:
    """Validate ids to free: in range, allocated, no repeats -> int32 [n]."""
    v = np.asarray(vids).reshape(-1)
    if not v.size:
        return v.astype(I32)
    if not np.issubdtype(v.dtype, np.integer) or v.min() < 1 or v.max() >= ids.capacity:
        raise ValueError(f"{what} ids out of range [1, {ids.capacity}): {v[:8]}")
    v = v.astype(I32)
    dead = table.v2p[v] <= 0
    if dead.any():
        raise ValueError(f"{what} ids not allocated (double free or never allocated): {v[dead][:8]}")
    if v.size > 1:
        ordered = np.sort(v)
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError(f"{what} ids repeated in one free: {ordered[1:][ordered[1:] == ordered[:-1]][:8]}")
    return v


__all__ = ["ArenaUsage", "ChainAllocator", "Shortfall", "SubPoolUsage"]
