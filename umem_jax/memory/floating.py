"""Float: a sub-pool between the two end bands, occupying a span [lo, hi) of its own page grid.

A float has no anchor.  Its span holds live pages and interior holes; when it is empty the span
is reset and the float is *transparent*: neighbours' frontier walks see through it, so an empty
float never walls off free space.

    alloc      holes first (whole requests alternate between the low and high end of the hole
               list, so neither end is favoured), then extend toward the larger free gap and the
               rest toward the other; from empty, the span is placed at the midpoint of the
               region between the neighbours so both keep slack
    free       lazy holes; `absorb` later drops holes touching the span ends (zero copy)
    compact    pack live pages away from one side (survivors nearest that side into the holes
               nearest the other), one batch
    settle     bring every live page inside a target range [t, t + size): pages outside move
               into free pages inside, nearest the pages already there first (one batch: the
               sources are outside the range, the destinations inside)
    relocate   "leapfrog": move the whole float, order preserved, packed from a new first page;
               when the old and new ranges overlap the copies are split into ordered batches
    make_room  open `rows` free rows on one side by the least relocation: settle when part of
               the float can stay, relocate (centred in what is left) when none can

The float works on its own grid; the chain gives it the neighbours' row frontiers and it counts
pages on its grid between them (ceil at the low frontier, floor at the high one), since a raw row
division would over-count by one page whenever a frontier is off this grid.
"""

from __future__ import annotations

import numpy as np

from .band import Take
from .holes import Holes, boundary_run, compaction, span_problems
from .tables import I32, Move, PageTable


class FloatBand:
    """Float over the pages [min_page, max_page) of its grid."""

    is_float = True

    def __init__(self, subpool, table: PageTable, min_page: int, max_page: int):
        self.subpool, self.table, self.name = subpool, table, subpool.name
        self.rows_per_page = subpool.rows_per_page
        self.min_page, self.max_page = min_page, max_page
        self.lo = self.hi = 0  # span, pages; lo == hi == 0 while empty ("parked")
        self.live = 0
        self.holes = Holes()  # hole pages
        self._take_low = True  # which end of the hole list the next request drains

    # ------------------------------------------------------------------ geometry

    @property
    def nholes(self) -> int:
        return len(self.holes)

    @property
    def span(self) -> int:
        return self.hi - self.lo

    @property
    def empty(self) -> bool:
        return self.live == 0

    @property
    def max_pages(self) -> int:
        """The most pages the float can ever hold (the whole arena to itself)."""
        return self.max_page - self.min_page

    def extent(self) -> tuple[int, int] | None:
        """Row extent [lo_row, hi_row), or None while empty (transparent)."""
        return None if self.live == 0 else (self.subpool.page_row(self.lo), self.subpool.page_row(self.hi))

    def page_bounds(self, lo_limit: int, hi_limit: int) -> tuple[int, int]:
        """Pages [first, end) of this grid lying inside rows [lo_limit, hi_limit)."""
        grid = self.subpool
        return max(self.min_page, grid.page_ceil(lo_limit)), min(self.max_page, grid.page_floor(hi_limit))

    def live_pages(self) -> np.ndarray:
        """Live pages ascending, int32 (read from the table, so always exact)."""
        return (self.lo + np.flatnonzero(self.table.p2v[self.lo:self.hi] > 0)).astype(I32)

    # ------------------------------------------------------------------ alloc / free

    def plan(self, n: int, lo_limit: int, hi_limit: int) -> Take | None:
        first, end = self.page_bounds(lo_limit, hi_limit)
        row = self.subpool.page_row
        if self.live == 0:
            if n > end - first:
                return None
            start = first + (end - first - n) // 2
            return Take(n, 0, 0, 0, (row(start), row(start + n)), start)
        reused = min(n, self.nholes)
        grow = n - reused
        room_lo, room_hi = max(0, self.lo - first), max(0, end - self.hi)
        if grow > room_lo + room_hi:
            return None
        if room_lo >= room_hi:
            low = min(grow, room_lo)
            high = grow - low
        else:
            high = min(grow, room_hi)
            low = grow - high
        return Take(n, reused, low, high, (row(self.lo - low), row(self.hi + high)))

    def commit(self, take: Take, vids: np.ndarray) -> np.ndarray:
        """Carry out `take`, binding `vids` (int32 [n]) -> physical pages int32 [n]."""
        if take.start is not None:
            self.lo, self.hi = take.start, take.start + take.n
            pages = np.arange(self.lo, self.hi, dtype=I32)
        else:
            parts = []
            if take.holes:
                take_end = self.holes.take_first if self._take_low else self.holes.take_last
                parts.append(take_end(take.holes))
                self._take_low = not self._take_low
            if take.low:
                parts.append(np.arange(self.lo - take.low, self.lo, dtype=I32))
                self.lo -= take.low
            if take.high:
                parts.append(np.arange(self.hi, self.hi + take.high, dtype=I32))
                self.hi += take.high
            pages = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.table.bind(vids, pages)
        self.live += take.n
        return pages

    def release(self, vids: np.ndarray) -> None:
        """Unbind `vids`; their pages become holes.  Emptied, the float parks (transparent)."""
        pages = self.table.unbind(vids)
        self.live -= vids.size
        if self.live == 0:
            self.lo = self.hi = 0
            self.holes.clear()
        else:
            self.holes.add(pages)

    # ------------------------------------------------------------------ compaction

    def absorb(self) -> int:
        """Shrink the span over holes touching either end (zero copy) -> pages absorbed."""
        holes = self.holes.sorted()
        up = boundary_run(holes - self.lo, self.span)  # run ending at hi - 1
        if up:
            self.hi -= up
            holes = holes[:-up]
        down = boundary_run((self.hi - 1 - holes)[::-1], self.span)  # run starting at lo
        if down:
            self.lo += down
            holes = holes[down:]
        self.holes.replace(holes)
        return up + down

    def compact(self, retreat: str, max_moves: int | None = None) -> list[Move]:
        """Close interior holes by packing live pages away from side `retreat` ("low"/"high"),
        then absorb; the span shrinks from that side."""
        self.absorb()
        if not self.nholes:
            return []
        # index space: 0 is the end the float packs toward
        if retreat == "low":
            to_index = lambda p: (self.hi - 1 - p).astype(I32)
            to_page = lambda i: (self.hi - 1 - i).astype(I32)
        else:
            to_index = lambda p: (p - self.lo).astype(I32)
            to_page = lambda i: (self.lo + i).astype(I32)
        holes = np.sort(to_index(self.holes.sorted()))
        src, dst = compaction(holes, self.span, self.live, max_moves)
        moves = self.table.move(to_page(src), to_page(dst))
        self._rescan(self.lo, self.hi)
        return moves

    def _rescan(self, lo: int, hi: int) -> None:
        """Rebuild span and holes from the table over pages [lo, hi) (after moves)."""
        live = lo + np.flatnonzero(self.table.p2v[lo:hi] > 0)
        if live.size == 0:
            self.lo = self.hi = 0
            self.holes.clear()
        else:
            self.lo, self.hi = int(live[0]), int(live[-1]) + 1
            self.holes.replace((self.lo + np.flatnonzero(self.table.p2v[self.lo:self.hi] < 0)).astype(I32))

    # ------------------------------------------------------------------ relocation

    def settle(self, first: int, size: int) -> list[Move]:
        """Move the live pages outside [first, first + size) into free pages inside it, nearest the
        live pages already inside.  The caller guarantees the range is free of other bands and
        holds at least `live` pages."""
        end = first + size
        assert size >= self.live and self.min_page <= first and end <= self.max_page
        live = self.live_pages()
        inside = (live >= first) & (live < end)
        src = live[~inside]
        if not src.size:
            return []
        kept = live[inside]
        if not kept.size:
            return self.relocate(first + (size - self.live) // 2)
        free = (first + np.flatnonzero(self.table.p2v[first:end] < 0)).astype(I32)
        dist = np.maximum(np.maximum(kept[0] - free, free - kept[-1]), 0)
        dst = free[np.argsort(dist, kind="stable")[:src.size]]
        moves = self.table.move(src, dst)
        self._rescan(min(self.lo, first), max(self.hi, end))
        return moves

    def relocate(self, new_lo: int) -> list[Move]:
        """Leapfrog: pack every live page, order preserved, into [new_lo, new_lo + live).
        Overlapping old and new ranges give several ordered batches."""
        assert self.min_page <= new_lo and new_lo + self.live <= self.max_page
        src = self.live_pages()
        moves = self.table.move(src, np.arange(new_lo, new_lo + src.size, dtype=I32))
        self._rescan(min(self.lo, new_lo), max(self.hi, new_lo + src.size))
        return moves

    def make_room(self, side: str, rows: int, lo_limit: int, hi_limit: int) -> list[Move] | None:
        """Open at least `rows` free rows between this float and its neighbour on `side`
        ("low"/"high"), the neighbours' frontiers being lo_limit / hi_limit.  -> the moves
        (empty if the room is already there or the float is empty), or None when even packing
        the float against the far neighbour cannot open that much (nothing changes)."""
        if self.live == 0:
            return []
        self.absorb()  # so both span ends are live pages
        first, end = self.page_bounds(lo_limit, hi_limit)
        if side == "low":
            start = max(first, self.subpool.page_ceil(lo_limit + rows))  # the span must start here or above
            if self.lo >= start:
                return []
            if self.live > end - start:
                return None
            if self.live_pages()[-1] >= start:
                return self.settle(start, max(self.hi, start + self.live) - start)
            return self.relocate(start + (end - start - self.live) // 2)
        if side != "high":
            raise ValueError(f"side must be 'low' or 'high', got {side!r}")
        stop = min(end, self.subpool.page_floor(hi_limit - rows))  # the span must end here or below
        if self.hi <= stop:
            return []
        if self.live > stop - first:
            return None
        if self.live_pages()[0] < stop:
            target = min(self.lo, stop - self.live)
            return self.settle(target, stop - target)
        return self.relocate(first + (stop - first - self.live) // 2)

    # ------------------------------------------------------------------ checks

    def check(self) -> list[str]:
        bad, holes = [], self.holes.copy_sorted()
        if self.live == 0:
            if self.lo != self.hi or holes.size:
                bad.append(f"{self.name}: empty float not parked (span [{self.lo}, {self.hi}), {holes.size} holes)")
        elif not self.min_page <= self.lo < self.hi <= self.max_page:
            bad.append(f"{self.name}: span [{self.lo}, {self.hi}) outside pages [{self.min_page}, {self.max_page})")
        same = lambda pages: pages
        return bad + span_problems(self.name, self.table, self.live, self.span, holes, "pages",
                                   self.lo, self.hi, same, same)


__all__ = ["FloatBand"]
