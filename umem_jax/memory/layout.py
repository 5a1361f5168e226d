"""ChainLayout: where every band of the arena may sit, and how the bands make room for each other.

The chain, low rows to high: the sink, the grow-up end band (plan.subpools[0]), the floats in
chain order, the grow-down end band (plan.subpools[-1]); free rows lie in the gaps between
non-empty bands.  An empty float is transparent: its neighbours see through it.

Shortfall ladder, the one procedure behind every allocation (`take`):
  1. plan the take on the current layout (ends first, then floats, each seeing the frontiers the
     earlier ones will leave); commit if it fits.
  2. if it cannot fit even with every band packed (the same test `fits` makes), fail now: no
     copy is spent on a lost cause.
  3. urgent-flush every band except a lone requester (whose own holes it already uses): floats
     first, so their zero-copy absorption lands before the ends are priced.  Re-plan.
  4. open the floats toward the short side: solve the layout (each float gets a target page
     range; a float whose span already fits its range stays put, others move by the least
     amount, clamped between the tightest packing from below and from above), settle the floats
     into their ranges, re-plan inside them.
  5. fail: return None.  (No exception: running out of arena is an everyday scheduling event;
     the caller evicts or retracts and retries.)
`fits` is exactly "step 1 fits or step 2 passes", so whatever it accepts the ladder takes.

Moves.  Every relocation is queued as a `Move` batch; the allocator hands them over in order
and the caller applies them to the device arena before the next step writes (so a page vacated
and handed out again in the same host phase is copied from before it is written).

Static control mode (`regions` given): every band keeps to a frozen row region; same code, the
neighbours' frontiers are replaced by the region bounds and floats never leave their region.
"""

from __future__ import annotations

from .band import EndBand, Take
from .floating import FloatBand
from .tables import Move, PageTable


class ChainLayout:
    """The bands of one arena in chain order, the queue of moves between them, and the policy
    that places, grows, compacts and relocates them.

    regions: [(lo_row, hi_row)] per band in chain order for the static control, or None;
    eager: compact a band on every free instead of lazily at `flush`; max_moves_per_flush: cap
    on the pages a non-urgent flush of one end band moves.  `epoch` counts layout changes, so
    answers derived from the layout can be memoised until it changes.
    """

    def __init__(self, plan, num_rows: int, regions: list[tuple[int, int]] | None, *, eager: bool,
                 max_moves_per_flush: int):
        self.num_rows, self.sink_rows = num_rows, plan.sink_rows
        self.regions, self.static = regions, regions is not None
        self.eager, self.max_moves_per_flush = eager, max_moves_per_flush
        token_ids = num_rows // plan.full.rows_per_page  # the full band's page count bounds the token ids
        self.bands: list = [self._band(i, sp, plan, token_ids) for i, sp in enumerate(plan.subpools)]
        self.index = {b.name: i for i, b in enumerate(self.bands)}
        self.full = len(self.bands) - 1
        self.windows = [self.index[sp.name] for sp in plan.windows]
        self.state = 0 if plan.state is not None else None
        self.moves: list[Move] = []
        self.epoch = 0

    def _band(self, i: int, subpool, plan, token_ids: int):
        pages = subpool.num_pages(self.num_rows)
        table = PageTable(subpool.name, pages if subpool.kind == "state" else token_ids, pages, subpool.rows_per_page)
        lo, hi = plan.first_page(subpool), pages  # usable pages [lo, hi)
        if self.static:
            r0, r1 = self.regions[i]
            lo, hi = max(lo, subpool.page_ceil(r0)), min(hi, subpool.page_floor(r1))
        if subpool.role == "up":
            return EndBand(subpool, table, lo, hi - 1, +1)
        if subpool.role == "down":
            return EndBand(subpool, table, lo, hi - 1, -1)
        return FloatBand(subpool, table, lo, max(lo, hi))

    # ------------------------------------------------------------------ frontiers

    def extents(self) -> list:
        return [b.extent() for b in self.bands]

    def limits(self, i: int, extents: list) -> tuple[int, int]:
        """Rows [lo, hi) band i may occupy: up to the nearest non-empty neighbours' frontiers
        (empty floats are transparent), or its static region."""
        if self.static:
            return self.regions[i]
        lo, hi = self.sink_rows, self.num_rows
        for j in range(i - 1, -1, -1):
            if extents[j] is not None:
                lo = extents[j][1]
                break
        for j in range(i + 1, len(extents)):
            if extents[j] is not None:
                hi = extents[j][0]
                break
        return lo, hi

    # ------------------------------------------------------------------ taking pages

    def _order(self, i: int) -> tuple:
        """Ends before floats (the full band first): floats fill what the ends leave."""
        return (self.bands[i].is_float, i != self.full, i)

    def plan(self, demands: dict[int, int], bounds: dict | None = None) -> dict[int, Take] | None:
        """Plan every member's take, ends first then floats, each against the frontiers the
        earlier plans leave (and inside bounds[i] = (first page, pages) when given) -> {band:
        Take}, or None if one does not fit."""
        extents = self.extents()
        takes = {}
        for i in sorted(demands, key=self._order):
            lo, hi = self.limits(i, extents)
            if bounds and i in bounds:
                first, size = bounds[i]
                grid = self.bands[i].subpool
                lo, hi = max(lo, grid.page_row(first)), min(hi, grid.page_row(first + size))
            take = self.bands[i].plan(demands[i], lo, hi)
            if take is None:
                return None
            takes[i] = take
            extents[i] = take.extent
        return takes

    def fits(self, demands: dict[int, int]) -> bool:
        """Whether `take(demands)` would succeed now (step 1 fits or step 2 passes)."""
        return self.plan(demands) is not None or (not self.static and self._float_targets(demands, True) is not None)

    def fits_freeing(self, demands: dict[int, int], freed: dict[int, int]) -> bool:
        """Whether `demands` would fit once `freed` {band: live pages} were released: in the
        unified arena as the bands would pack compacted (sized live + demand - freed), in a
        static one within each band's own region (its freed pages become its holes)."""
        if self.static:
            return self.plan({i: max(0, d - freed.get(i, 0)) for i, d in demands.items()}) is not None
        net = dict(demands)
        for i, n in freed.items():
            net[i] = net.get(i, 0) - n
        return self._float_targets(net, True) is not None

    def take(self, demands: dict[int, int]) -> dict[int, Take] | None:
        """Plan `demands` {band: pages} through the shortfall ladder -> takes to commit, or None."""
        takes = self.plan(demands)
        if takes is not None:
            return takes
        if self.static or self._float_targets(demands, True) is None:
            return None
        self._flush_bands(skip=next(iter(demands)) if len(demands) == 1 else None, urgent=True)
        self.epoch += 1
        takes = self.plan(demands)
        if takes is None:
            targets = self._float_targets(demands, False)
            if targets is not None:
                self.moves += settle_floats({i: (self.bands[i], t) for i, t in targets.items()})
                self.epoch += 1
                takes = self.plan(demands, targets)
        return takes

    def commit(self, takes: dict[int, Take], vids) -> None:
        """Carry out `takes`, each binding the last `take.n` of `vids` (int32 [n])."""
        for i, take in takes.items():
            self.bands[i].commit(take, vids[len(vids) - take.n:])
        self.epoch += 1

    def _float_targets(self, demands: dict[int, int], compacted: bool) -> dict[int, tuple[int, int]] | None:
        """Target page ranges of the floats for `demands` -> {float: (first page, pages)}, or None
        if even the tightest packing cannot hold it.  Sizes are live + demand (compacted: as
        after an urgent flush) or span + the demand its holes do not cover (the layout as is)."""
        bands = self.bands

        def size(i):
            band, demand = bands[i], demands.get(i, 0)
            return band.live + demand if compacted else band.span + max(0, demand - band.nholes)

        up, down = bands[0], bands[-1]
        up_size, down_size = size(0), size(len(bands) - 1)
        if up_size > up.max_span or down_size > down.max_span:
            return None
        floats = [(i, bands[i], size(i)) for i in range(1, len(bands) - 1)
                  if not (bands[i].empty and demands.get(i, 0) == 0)]
        return place_floats(floats, up.extent_of(up_size)[1], down.extent_of(down_size)[0])

    # ------------------------------------------------------------------ compaction

    def flush(self, urgent: bool) -> None:
        self._flush_bands(skip=None, urgent=urgent)
        self.epoch += 1

    def _flush_bands(self, skip: int | None, urgent: bool) -> None:
        for i, band in enumerate(self.bands):  # floats first
            if band.is_float and i != skip and not band.empty:
                if urgent:
                    self.moves += band.compact(self._retreat_side(i))
                else:
                    band.absorb()
        for i, band in enumerate(self.bands):
            if not band.is_float and i != skip:
                self.moves += band.flush(None if urgent else self.max_moves_per_flush)

    def _retreat_side(self, i: int) -> str:
        """A float compacts away from its tighter side, giving that neighbour the rows."""
        band = self.bands[i]
        lo, hi = self.limits(i, self.extents())
        grid = band.subpool
        return "low" if grid.page_row(band.lo) - lo <= hi - grid.page_row(band.hi) else "high"

    def after_free(self, touched: list[int]) -> None:
        """Bands `touched` just released pages (eager mode compacts them now)."""
        if self.eager:
            for i in touched:
                band = self.bands[i]
                if band.is_float:
                    if not band.empty:
                        self.moves += band.compact(self._retreat_side(i))
                else:
                    self.moves += band.flush(None)
        self.epoch += 1

    def make_room(self, i: int, side: str, rows: int) -> bool:
        """Relocate float i so at least `rows` free rows lie on its `side` -> False if it cannot."""
        lo, hi = self.limits(i, self.extents())
        moves = self.bands[i].make_room(side, rows, lo, hi)
        if moves is None:
            return False
        self.moves += moves
        self.epoch += 1
        return True

    def take_moves(self) -> list[Move]:
        out, self.moves = self.moves, []
        return out


def place_floats(floats: list, floor_row: int, ceil_row: int) -> dict | None:
    """Choose page ranges for the floats between two row frontiers, or None if they cannot fit.

    floats: [(key, FloatBand, pages)] in chain order, each needing `pages` contiguous pages of
    its grid.  Each float goes as near its current span (extended evenly) as the tightest
    packings from below and from above allow, so a float that already fits does not move and
    one that must move moves least.  -> {key: (first page, pages)}.
    """
    latest, top = {}, ceil_row
    for key, band, size in reversed(floats):  # tightest packing from above
        latest[key] = min(band.max_page, band.subpool.page_floor(top)) - size
        top = band.subpool.page_row(latest[key])
    out, prev = {}, floor_row
    for key, band, size in floats:  # from below
        first = max(band.min_page, band.subpool.page_ceil(prev))
        if first > latest[key]:
            return None
        preferred = (first + latest[key]) // 2 if band.empty else band.lo - (size - band.span) // 2
        start = min(max(preferred, first), latest[key])
        out[key] = (start, size)
        prev = band.subpool.page_row(start + size)
    return out if prev <= ceil_row else None


def settle_floats(targets: dict) -> list[Move]:
    """Move floats into disjoint target ranges {key: (FloatBand, (first page, pages))} -> moves.

    A float moves once no other unsettled float still occupies its range; with disjoint targets
    in chain order one always can (a float in the way moves in the same direction first).
    """
    for band, _ in targets.values():
        band.absorb()  # so a span never reaches past its live pages into another's target
    pending, moves = dict(targets), []
    while pending:
        done = []
        for key, (band, (first, size)) in pending.items():
            lo, hi = band.subpool.page_row(first), band.subpool.page_row(first + size)
            if not any(k != key and (e := other.extent()) is not None and e[0] < hi and lo < e[1]
                       for k, (other, _) in pending.items()):
                moves += band.settle(first, size)
                done.append(key)
        if not done:
            raise RuntimeError(f"float layout cannot be reached: {pending}")
        for key in done:
            del pending[key]
    return moves


__all__ = ["ChainLayout", "place_floats", "settle_floats"]
