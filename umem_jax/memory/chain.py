"""ChainAllocator: every sub-pool of the plan as one band of the arena, and the policy between them.

The arena is [num_rows, row_words]; each sub-pool addresses it as its own page grid from row 0
(plan.py).  The chain, low rows to high: the sink, the grow-up end band (plan.subpools[0]), the
floats in chain order, the grow-down end band (plan.subpools[-1]); free rows lie in the gaps
between non-empty bands.  An empty float is transparent: its neighbours see through it.

Ids.  A token page is one virtual id minted by the full sub-pool; every window sub-pool binds the
same id to a physical page of its own, or leaves it unbound (a tombstone, v2p = -1) once the
page's tokens left the window or if it was allocated without one.  State slots (page size 1) have
their own id space.  Virtual ids are stable; only the tables know physical pages.

Shortfall ladder, the one procedure behind every allocation (`_take`):
  1. plan the take on the current layout (ends first, then floats, each seeing the frontiers the
     earlier ones will leave); commit if it fits.
  2. if it cannot fit even with every band packed (the same test `can_fit` makes), fail now: no
     copy is spent on a lost cause.
  3. urgent-flush every band except a lone requester (whose own holes it already uses): floats
     first, so their zero-copy absorption lands before the ends are priced.  Re-plan.
  4. open the floats toward the short side: solve the layout (each float gets a target page
     range; a float whose span already fits its range stays put, others move by the least
     amount, clamped between the tightest packing from below and from above), settle the floats
     into their ranges, re-plan inside them.
  5. fail: return None and leave the numbers in `last_shortfall`.  (No exception: running out of
     arena is an everyday scheduling event; the caller evicts or retracts and retries.)
`can_fit` is exactly "step 1 fits or step 2 passes", so whatever it accepts the ladder
allocates.

Moves.  Every relocation is queued as a `Move` batch; `take_moves()` hands them over in order
and the caller applies them to the device arena before the next step writes (so a page vacated
and handed out again in the same host phase is copied from before it is written).

Static control mode (`static_regions`): every band keeps to a frozen row region; same code, the
neighbours' frontiers are replaced by the region bounds and floats never leave their region.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .band import EndBand, Take
from .declarations import WORD_BYTES
from .floating import FloatBand, place_floats, settle_floats
from .tables import I32, IdPool, Move, PageTable


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
        tok_capacity = self.num_rows // plan.full.rows_per_page
        self.bands: list = []
        for i, sp in enumerate(plan.subpools):
            rpp = sp.rows_per_page
            pages = self.num_rows // rpp
            table = PageTable(sp.name, pages if sp.kind == "state" else tok_capacity, pages, rpp)
            lo, hi = plan.first_page(sp), pages  # usable pages [lo, hi)
            if self.static:
                r0, r1 = self._regions[i]
                lo, hi = max(lo, -(-r0 // rpp)), min(hi, r1 // rpp)
            if sp.role == "up":
                self.bands.append(EndBand(sp, table, lo, hi - 1, +1))
            elif sp.role == "down":
                self.bands.append(EndBand(sp, table, lo, hi - 1, -1))
            else:
                self.bands.append(FloatBand(sp, table, lo, max(lo, hi)))
        self._index = {b.name: i for i, b in enumerate(self.bands)}
        self._full = len(self.bands) - 1
        self._windows = [self._index[sp.name] for sp in plan.windows]
        self._state = 0 if plan.state is not None else None
        self._token_ids = IdPool(tok_capacity)
        self._slot_ids = IdPool(self.bands[0].table.num_virtual) if plan.state is not None else None
        self._order_key = lambda i: (self.bands[i].is_float, i != self._full, i)
        self._moves: list[Move] = []
        self._epoch = 0
        self._memo: dict = {}
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

    # ================================================================== public: tokens and slots

    def alloc_token_pages(self, n: int, window_pages: dict[str, int] | None = None) -> np.ndarray | None:
        """Allocate n token pages -> their virtual ids int32 [n], or None (see `last_shortfall`).

        Each id gets a page in the full sub-pool and in every window sub-pool; window_pages
        {window name: k} gives window pages to the last k ids only (the others are born
        tombstoned, e.g. prompt pages that leave the window before anything reads them).
        """
        n = int(n)
        if n <= 0:
            return np.empty(0, I32)
        demands = self._token_demands(n, window_pages)
        if n > self._token_ids.free:
            return self._fail(demands)
        takes = self._take(demands)
        if takes is None:
            return None
        vids = self._token_ids.pop(n)
        for i, tk in takes.items():
            self.bands[i].commit(tk, vids[n - tk.n:])
        self._epoch += 1
        return vids

    def free_token_pages(self, vids) -> None:
        """Free token pages: every physical page still bound to them (full and windows)."""
        vids = self._live_ids(vids, self._token_ids, self.bands[self._full].table, "token page")
        if not vids.size:
            return
        touched = [self._full]
        for i in self._windows:
            bound = vids[self.bands[i].table.v2p[vids] > 0]
            if bound.size:
                self.bands[i].release(bound)
                touched.append(i)
        self.bands[self._full].release(vids)
        self._token_ids.push(vids)
        self._after_free(touched)

    def release_window_pages(self, vids, window: str) -> None:
        """Tombstone `vids` in sub-pool `window`: their window pages are freed, the ids and full
        pages stay.  Every id must be live and still bound in that window."""
        i = self._window_index(window)
        vids = self._live_ids(vids, self._token_ids, self.bands[self._full].table, "token page")
        if (self.bands[i].table.v2p[vids] <= 0).any():
            raise ValueError(f"{window}: releasing token pages with no window page (already released?): "
                             f"{vids[self.bands[i].table.v2p[vids] <= 0][:8]}")
        if vids.size:
            self.bands[i].release(vids)
            self._after_free([i])

    def bind_window_pages(self, vids, window: str) -> bool:
        """Give tombstoned live token pages a fresh page in `window` again (e.g. to recompute a
        cached prefix's window rows) -> False if the arena cannot (nothing changes)."""
        i = self._window_index(window)
        vids = self._live_ids(vids, self._token_ids, self.bands[self._full].table, "token page")
        if (self.bands[i].table.v2p[vids] > 0).any():
            raise ValueError(f"{window}: some token pages are already bound there")
        if not vids.size:
            return True
        takes = self._take({i: int(vids.size)})
        if takes is None:
            return False
        self.bands[i].commit(takes[i], vids)
        self._epoch += 1
        return True

    def alloc_state_slots(self, n: int) -> np.ndarray | None:
        """Allocate n state slots -> virtual slot ids int32 [n], or None."""
        n = int(n)
        if self._state is None:
            raise ValueError("this plan has no state sub-pool")
        if n <= 0:
            return np.empty(0, I32)
        if n > self._slot_ids.free:
            return self._fail({self._state: n})
        takes = self._take({self._state: n})
        if takes is None:
            return None
        vids = self._slot_ids.pop(n)
        self.bands[self._state].commit(takes[self._state], vids)
        self._epoch += 1
        return vids

    def free_state_slots(self, vids) -> None:
        if self._state is None:
            raise ValueError("this plan has no state sub-pool")
        vids = self._live_ids(vids, self._slot_ids, self.bands[self._state].table, "state slot")
        if vids.size:
            self.bands[self._state].release(vids)
            self._slot_ids.push(vids)
            self._after_free([self._state])

    def copy_state_slots(self, src, dst) -> None:
        """Queue a copy of live state slots src[i] -> dst[i] (virtual ids, dst distinct and
        none of them a source), e.g. a prefix-cache checkpoint into a request's working slot.
        It joins the move queue, so it runs after every relocation queued before it and before
        every one queued after: the bytes copied are those of the slots as they are now."""
        if self._state is None:
            raise ValueError("this plan has no state sub-pool")
        b = self.bands[self._state]
        src = self._live_ids(src, self._slot_ids, b.table, "state slot")
        dst = self._live_ids(dst, self._slot_ids, b.table, "state slot")
        if src.size != dst.size or np.isin(dst, src).any():
            raise ValueError(f"state slot copies need as many distinct destinations as sources, none a source: "
                             f"{src[:8]} -> {dst[:8]}")
        if src.size:
            self._moves.append(Move(b.name, b.table.v2p[src].copy(), b.table.v2p[dst].copy(), b.rpp, copy=True))

    # ================================================================== public: capacity

    def can_fit(self, token_pages: int = 0, state_slots: int = 0, window_pages: dict[str, int] | None = None) -> bool:
        """Whether allocating token_pages (with window_pages as in alloc_token_pages) and
        state_slots together succeeds now, through the shortfall ladder if needed."""
        demands = self._token_demands(token_pages, window_pages) if token_pages > 0 else {}
        if state_slots > 0:
            if self._state is None:
                return False
            demands[self._state] = demands.get(self._state, 0) + int(state_slots)
        if not demands:
            return True
        if token_pages > self._token_ids.free or (state_slots > 0 and state_slots > self._slot_ids.free):
            return False
        return self._plan(demands) is not None or (not self.static and self._layout(demands, True) is not None)

    def available_token_pages(self) -> int:
        """Most token pages (each with a page in every window) one allocation can get now."""
        ub = min(self._token_ids.free, self.bands[self._full].max_span - self.bands[self._full].live)
        return self._largest("tok", ub, lambda n: self.can_fit(token_pages=n))

    def available_state_slots(self) -> int:
        if self._state is None:
            return 0
        ub = min(self._slot_ids.free, self._max_pages(self._state) - self.bands[self._state].live)
        return self._largest("state", ub, lambda n: self.can_fit(state_slots=n))

    def _max_pages(self, i: int) -> int:
        b = self.bands[i]
        return b.max_page - b.min_page if b.is_float else b.max_span

    def _largest(self, key: str, ub: int, fits) -> int:
        memo = self._memo.get(key)
        if memo is not None and memo[0] == self._epoch:
            return memo[1]
        lo, hi = 0, max(0, ub)
        if hi and fits(hi):
            lo = hi
        while lo < hi:  # feasibility is monotone in n
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        self._memo[key] = (self._epoch, lo)
        return lo

    # ================================================================== public: compaction, moves

    def flush(self, urgent: bool = False) -> None:
        """Absorb every band's boundary holes (zero copy) and compact the end bands (at most
        max_moves_per_flush pages each); urgent: pack every band, floats included."""
        self._flush_bands(skip=None, urgent=urgent)
        self._epoch += 1

    def make_room(self, name: str, side: str, rows: int) -> bool:
        """Relocate float `name` so at least `rows` free rows lie between it and its neighbour
        on `side` ("low"/"high") -> False if that cannot be done (nothing changes)."""
        i = self._index[name]
        if not self.bands[i].is_float:
            raise ValueError(f"{name} is an end band, not a float")
        lo, hi = self._limits(i, self._extents())
        moves = self.bands[i].make_room(side, rows, lo, hi)
        if moves is None:
            return False
        self._moves += moves
        self._epoch += 1
        return True

    def take_moves(self) -> list[Move]:
        """The queued move batches, in order (and clear the queue).  Apply every one to the
        device arena, in order, before the next step reads or writes it."""
        out, self._moves = self._moves, []
        return out

    # ================================================================== public: translation

    def translate_pages(self, vids, subpool: str, width: int | None = None) -> np.ndarray:
        """Token page ids [B, P] (-1 padding) -> physical pages of `subpool` int32 [B, width],
        padded, unmapped and tombstoned entries being the sink 0."""
        b = self.bands[self._index[subpool]]
        if b.sp.kind == "state":
            raise ValueError("translate state slots with translate_slots")
        return b.table.translate(vids, width)

    def translate_slots(self, vids, width: int | None = None) -> np.ndarray:
        """State slot ids [B] (-1 padding) -> physical slots int32 [width], sink-padded."""
        if self._state is None:
            raise ValueError("this plan has no state sub-pool")
        return self.bands[self._state].table.translate(vids, width)

    # ================================================================== the ladder

    def _token_demands(self, n: int, window_pages: dict[str, int] | None) -> dict[int, int]:
        demands = {self._full: int(n)}
        window_pages = window_pages or {}
        for name in window_pages:
            self._window_index(name)
        for i in self._windows:
            k = min(int(n), max(0, int(window_pages.get(self.bands[i].name, n))))
            if k:
                demands[i] = k
        return demands

    def _extents(self) -> list:
        return [b.extent() for b in self.bands]

    def _limits(self, i: int, ext: list) -> tuple[int, int]:
        """Rows [lo, hi) band i may occupy: up to the nearest non-empty neighbours' frontiers
        (empty floats are transparent), or its static region."""
        if self.static:
            return self._regions[i]
        lo, hi = self.sink_rows, self.num_rows
        for j in range(i - 1, -1, -1):
            if ext[j] is not None:
                lo = ext[j][1]
                break
        for j in range(i + 1, len(ext)):
            if ext[j] is not None:
                hi = ext[j][0]
                break
        return lo, hi

    def _plan(self, demands: dict[int, int], bounds: dict | None = None) -> dict[int, Take] | None:
        """Plan every member's take, ends first then floats, each against the frontiers the
        earlier plans leave -> {band: Take}, or None if one does not fit."""
        ext = self._extents()
        takes = {}
        for i in sorted(demands, key=self._order_key):
            lo, hi = self._limits(i, ext)
            if bounds and i in bounds:
                t, size = bounds[i]
                r = self.bands[i].rpp
                lo, hi = max(lo, t * r), min(hi, (t + size) * r)
            tk = self.bands[i].plan(demands[i], lo, hi)
            if tk is None:
                return None
            takes[i] = tk
            ext[i] = tk.extent
        return takes

    def _take(self, demands: dict[int, int]) -> dict[int, Take] | None:
        takes = self._plan(demands)
        if takes is not None:
            return takes
        if self.static or self._layout(demands, True) is None:
            return self._fail(demands)
        self._flush_bands(skip=next(iter(demands)) if len(demands) == 1 else None, urgent=True)
        self._epoch += 1
        takes = self._plan(demands)
        if takes is None:
            targets = self._layout(demands, False)
            if targets is not None:
                self._settle(targets)
                takes = self._plan(demands, targets)
        return takes if takes is not None else self._fail(demands)

    def _layout(self, demands: dict[int, int], compacted: bool) -> dict[int, tuple[int, int]] | None:
        """Target page ranges of the floats for `demands` -> {float: (first page, pages)}, or None
        if even the tightest packing cannot hold it.  Sizes are live + demand (compacted: as
        after an urgent flush) or span + the demand its holes do not cover (the layout as is)."""
        bands = self.bands

        def size(i):
            b, d = bands[i], demands.get(i, 0)
            return b.live + d if compacted else b.span + max(0, d - b.nholes)

        up, dn = bands[0], bands[-1]
        su, sd = size(0), size(len(bands) - 1)
        if su > up.max_span or sd > dn.max_span:
            return None
        floats = [(i, bands[i], size(i)) for i in range(1, len(bands) - 1)
                  if not (bands[i].empty and demands.get(i, 0) == 0)]
        return place_floats(floats, up.extent_of(su)[1], dn.extent_of(sd)[0])

    def _settle(self, targets: dict[int, tuple[int, int]]) -> None:
        self._moves += settle_floats({i: (self.bands[i], t) for i, t in targets.items()})
        self._epoch += 1

    def _flush_bands(self, skip: int | None, urgent: bool) -> None:
        for i, b in enumerate(self.bands):  # floats first
            if b.is_float and i != skip and not b.empty:
                if urgent:
                    self._moves += b.compact(self._retreat_side(i))
                else:
                    b.absorb()
        for i, b in enumerate(self.bands):
            if not b.is_float and i != skip:
                self._moves += b.flush(None if urgent else self.max_moves_per_flush)

    def _retreat_side(self, i: int) -> str:
        """A float compacts away from its tighter side, giving that neighbour the rows."""
        b = self.bands[i]
        lo, hi = self._limits(i, self._extents())
        return "low" if b.lo * b.rpp - lo <= hi - b.hi * b.rpp else "high"

    def _after_free(self, touched: list[int]) -> None:
        if self.eager:
            for i in touched:
                b = self.bands[i]
                if b.is_float:
                    if not b.empty:
                        self._moves += b.compact(self._retreat_side(i))
                else:
                    self._moves += b.flush(None)
        self._epoch += 1

    def _fail(self, demands: dict[int, int]) -> None:
        holes = {self.bands[i].name: min(d, self.bands[i].nholes) for i, d in demands.items()}
        need = sum((d - min(d, self.bands[i].nholes)) * self.bands[i].rpp for i, d in demands.items())
        u = self._row_tally()
        self.last_shortfall = Shortfall({self.bands[i].name: d for i, d in demands.items()}, holes, need,
                                        u["gap"] + u["holes"])
        return None

    # ================================================================== helpers

    def _window_index(self, name: str) -> int:
        i = self._index.get(name)
        if i is None or i not in self._windows:
            raise ValueError(f"{name!r} is not a window sub-pool; windows: {[self.bands[j].name for j in self._windows]}")
        return i

    @staticmethod
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
            s = np.sort(v)
            if (s[1:] == s[:-1]).any():
                raise ValueError(f"{what} ids repeated in one free: {s[1:][s[1:] == s[:-1]][:8]}")
        return v

    # ================================================================== reports and checks

    def _row_tally(self) -> dict:
        spans = [e for e in self._extents() if e is not None]
        live = sum(b.live * b.rpp for b in self.bands)
        holes = sum(b.nholes * b.rpp for b in self.bands)
        span_rows = sum(hi - lo for lo, hi in spans)
        return {"live": live, "holes": holes, "span": span_rows,
                "gap": self.num_rows - self.plan.sink_rows - span_rows}

    def usage(self) -> ArenaUsage:
        tok, state = self.available_token_pages(), self.available_state_slots()
        subs = {}
        for i, b in enumerate(self.bands):
            avail = state if i == self._state else tok
            subs[b.name] = SubPoolUsage(b.name, b.sp.kind, b.sp.role,
                                        b.live, b.live * b.rpp * self.row_bytes, b.nholes, b.extent(), avail)
        t = self._row_tally()
        rb = self.row_bytes
        return ArenaUsage(self.num_rows * rb, self.plan.sink_rows * rb, t["live"] * rb, t["holes"] * rb, t["gap"] * rb,
                          tok, state, subs)

    def check_invariants(self) -> None:
        """Raise AssertionError listing every broken invariant (bytes tile the arena, spans in
        chain order without overlap, span = live + holes, tables inverse, ids conserved, window
        bindings only on live token pages)."""
        bad = []
        for b in self.bands:
            bad += b.table.check() + b.check()
        prev, tiled = self.plan.sink_rows, self.plan.sink_rows
        for i, e in enumerate(self._extents()):
            if e is None:
                continue
            if e[0] < prev or e[1] < e[0]:
                bad.append(f"{self.bands[i].name}: rows [{e[0]}, {e[1]}) overlap the band below (ends at {prev})")
            if self.static and not self._regions[i][0] <= e[0] <= e[1] <= self._regions[i][1]:
                bad.append(f"{self.bands[i].name}: rows [{e[0]}, {e[1]}) leave the static region {self._regions[i]}")
            tiled += (e[0] - prev) + (e[1] - e[0])
            prev = e[1]
        if prev > self.num_rows or tiled + (self.num_rows - prev) != self.num_rows:
            bad.append(f"sink, spans and gaps do not tile the arena ({prev} > {self.num_rows})")
        bad += self._check_ids(self._token_ids, self.bands[self._full].table, "token")
        live = self.bands[self._full].table.bound()
        for i in self._windows:
            wb = self.bands[i].table.bound()
            if not np.isin(wb, live).all():
                bad.append(f"{self.bands[i].name}: window pages bound to dead token ids {wb[~np.isin(wb, live)][:8]}")
        if self._state is not None:
            bad += self._check_ids(self._slot_ids, self.bands[self._state].table, "state")
        if bad:
            raise AssertionError("arena invariants broken:\n  " + "\n  ".join(bad))

    @staticmethod
    def _check_ids(ids: IdPool, table: PageTable, what: str) -> list[str]:
        every = np.sort(np.concatenate([table.bound(), ids.free_ids()]))
        if every.size != ids.capacity - 1 or (every != np.arange(1, ids.capacity)).any():
            return [f"{what} ids: live + free is not every id exactly once"]
        return []

    def live_token_pages(self) -> np.ndarray:
        return self.bands[self._full].table.bound()

    def live_state_slots(self) -> np.ndarray:
        return self.bands[self._state].table.bound() if self._state is not None else np.empty(0, I32)

    def leaks(self, token_pages=(), state_slots=()) -> dict[str, np.ndarray]:
        """Compare what the engine holds (every token page id held by a request or cached, every
        state slot) with what is allocated -> {problem: ids}, empty when they agree."""
        out = {}
        for what, held, live in (("token", token_pages, self.live_token_pages()),
                                 ("state", state_slots, self.live_state_slots())):
            held = np.unique(np.asarray(held, dtype=np.int64).reshape(-1))
            if (lost := np.setdiff1d(live, held)).size:
                out[f"{what} allocated but held by nobody"] = lost
            if (ghost := np.setdiff1d(held, live)).size:
                out[f"{what} held but not allocated"] = ghost
        return out


__all__ = ["ArenaUsage", "ChainAllocator", "Shortfall", "SubPoolUsage"]
