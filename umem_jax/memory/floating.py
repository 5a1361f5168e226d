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

from .band import Take, boundary_run, compaction
from .tables import I32, Move, PageTable


class FloatBand:
    """Float over the pages [min_page, max_page) of its grid."""

    is_float = True

    def __init__(self, sp, table: PageTable, min_page: int, max_page: int):
        self.sp, self.table, self.name = sp, table, sp.name
        self.rpp = sp.rows_per_page
        self.min_page, self.max_page = min_page, max_page
        self.lo = self.hi = 0  # span, pages; lo == hi == 0 while empty ("parked")
        self.live = 0
        self._holes = np.empty(0, I32)  # hole pages; sorted only when _sorted
        self._sorted = True
        self._take_low = True  # which end of the hole list the next request drains

    # ------------------------------------------------------------------ geometry

    @property
    def nholes(self) -> int:
        return int(self._holes.size)

    @property
    def span(self) -> int:
        return self.hi - self.lo

    @property
    def empty(self) -> bool:
        return self.live == 0

    def extent(self) -> tuple[int, int] | None:
        """Row extent [lo_row, hi_row), or None while empty (transparent)."""
        return None if self.live == 0 else (self.lo * self.rpp, self.hi * self.rpp)

    def page_bounds(self, lo_limit: int, hi_limit: int) -> tuple[int, int]:
        """Pages [pmin, pmax) of this grid lying inside rows [lo_limit, hi_limit)."""
        return max(self.min_page, -(-lo_limit // self.rpp)), min(self.max_page, hi_limit // self.rpp)

    def live_pages(self) -> np.ndarray:
        """Live pages ascending, int32 (read from the table, so always exact)."""
        return (self.lo + np.flatnonzero(self.table.p2v[self.lo:self.hi] > 0)).astype(I32)

    # ------------------------------------------------------------------ alloc / free

    def plan(self, n: int, lo_limit: int, hi_limit: int) -> Take | None:
        pmin, pmax = self.page_bounds(lo_limit, hi_limit)
        if self.live == 0:
            if n > pmax - pmin:
                return None
            start = pmin + (pmax - pmin - n) // 2
            return Take(n, 0, 0, 0, (start * self.rpp, (start + n) * self.rpp), start)
        k = min(n, self._holes.size)
        r = n - k
        room_lo, room_hi = max(0, self.lo - pmin), max(0, pmax - self.hi)
        if r > room_lo + room_hi:
            return None
        if room_lo >= room_hi:
            low = min(r, room_lo)
            high = r - low
        else:
            high = min(r, room_hi)
            low = r - high
        return Take(n, k, low, high, ((self.lo - low) * self.rpp, (self.hi + high) * self.rpp))

    def commit(self, take: Take, vids: np.ndarray) -> np.ndarray:
        """Carry out `take`, binding `vids` (int32 [n]) -> physical pages int32 [n]."""
        if take.start is not None:
            self.lo, self.hi = take.start, take.start + take.n
            pages = np.arange(self.lo, self.hi, dtype=I32)
        else:
            parts = []
            if take.holes:
                self._sort()
                k = take.holes
                if self._take_low:
                    parts.append(self._holes[:k])
                    self._holes = self._holes[k:]
                else:
                    parts.append(self._holes[-k:])
                    self._holes = self._holes[:-k]
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
            self._holes = np.empty(0, I32)
            self._sorted = True
        else:
            self._holes = np.concatenate([self._holes, pages])
            self._sorted = False

    # ------------------------------------------------------------------ compaction

    def _sort(self) -> None:
        if not self._sorted:
            self._holes.sort()
            self._sorted = True

    def absorb(self) -> int:
        """Shrink the span over holes touching either end (zero copy) -> pages absorbed."""
        if not self._holes.size:
            return 0
        self._sort()
        h = self._holes
        up = boundary_run(h - self.lo, self.span)  # run ending at hi - 1
        if up:
            self.hi -= up
            h = h[:-up]
        down = boundary_run((self.hi - 1 - h)[::-1], self.span)  # run starting at lo
        if down:
            self.lo += down
            h = h[down:]
        self._holes = h
        return up + down

    def compact(self, retreat: str, max_moves: int | None = None) -> list[Move]:
        """Close interior holes by packing live pages away from side `retreat` ("low"/"high"),
        then absorb; the span shrinks from that side."""
        self.absorb()
        if not self._holes.size:
            return []
        # index space: 0 is the end the float packs toward
        if retreat == "low":
            to_idx = lambda p: (self.hi - 1 - p).astype(I32)
            to_page = lambda i: (self.hi - 1 - i).astype(I32)
        else:
            to_idx = lambda p: (p - self.lo).astype(I32)
            to_page = lambda i: (self.lo + i).astype(I32)
        holes = np.sort(to_idx(self._holes))
        src, dst = compaction(holes, self.span, self.live, max_moves)
        moves = self.table.move(to_page(src), to_page(dst))
        self._rescan(self.lo, self.hi)
        return moves

    def _rescan(self, lo: int, hi: int) -> None:
        """Rebuild span and holes from the table over pages [lo, hi) (after moves)."""
        live = lo + np.flatnonzero(self.table.p2v[lo:hi] > 0)
        if live.size == 0:
            self.lo = self.hi = 0
            self._holes = np.empty(0, I32)
        else:
            self.lo, self.hi = int(live[0]), int(live[-1]) + 1
            self._holes = (self.lo + np.flatnonzero(self.table.p2v[self.lo:self.hi] < 0)).astype(I32)
        self._sorted = True

    # ------------------------------------------------------------------ relocation

    def settle(self, t: int, size: int) -> list[Move]:
        """Move the live pages outside [t, t + size) into free pages inside it, nearest the live
        pages already inside.  The caller guarantees the range is free of other bands and holds
        at least `live` pages."""
        assert size >= self.live and self.min_page <= t and t + size <= self.max_page
        live = self.live_pages()
        inside = (live >= t) & (live < t + size)
        src = live[~inside]
        if not src.size:
            return []
        kept = live[inside]
        if not kept.size:
            return self.relocate(t + (size - self.live) // 2)
        free = (t + np.flatnonzero(self.table.p2v[t:t + size] < 0)).astype(I32)
        dist = np.maximum(np.maximum(kept[0] - free, free - kept[-1]), 0)
        dst = free[np.argsort(dist, kind="stable")[:src.size]]
        moves = self.table.move(src, dst)
        self._rescan(min(self.lo, t), max(self.hi, t + size))
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
        pmin, pmax = self.page_bounds(lo_limit, hi_limit)
        if side == "low":
            b = max(pmin, -(-(lo_limit + rows) // self.rpp))  # the span must start at b or above
            if self.lo >= b:
                return []
            if self.live > pmax - b:
                return None
            if self.live_pages()[-1] >= b:
                return self.settle(b, max(self.hi, b + self.live) - b)
            return self.relocate(b + (pmax - b - self.live) // 2)
        if side != "high":
            raise ValueError(f"side must be 'low' or 'high', got {side!r}")
        e = min(pmax, (hi_limit - rows) // self.rpp)  # the span must end at e or below
        if self.hi <= e:
            return []
        if self.live > e - pmin:
            return None
        if self.live_pages()[0] < e:
            t = min(self.lo, e - self.live)
            return self.settle(t, e - t)
        return self.relocate(pmin + (e - pmin - self.live) // 2)

    # ------------------------------------------------------------------ checks

    def check(self) -> list[str]:
        bad, n = [], self.name
        h = np.sort(self._holes)
        if self.live == 0:
            if self.lo != self.hi or h.size:
                bad.append(f"{n}: empty float not parked (span [{self.lo}, {self.hi}), {h.size} holes)")
        elif not self.min_page <= self.lo < self.hi <= self.max_page:
            bad.append(f"{n}: span [{self.lo}, {self.hi}) outside pages [{self.min_page}, {self.max_page})")
        if h.size and (h[0] < self.lo or h[-1] >= self.hi or (np.diff(h) == 0).any()):
            bad.append(f"{n}: hole list has duplicates or pages outside the span")
        if self.live + h.size != self.span:
            bad.append(f"{n}: span {self.span} != live {self.live} + holes {h.size}")
        bound = self.table.bound()
        if bound.size != self.live:
            bad.append(f"{n}: {bound.size} ids bound but live count is {self.live}")
        pages = self.table.v2p[bound]
        if pages.size and (pages.min() < self.lo or pages.max() >= self.hi):
            bad.append(f"{n}: a live page lies outside the span")
        if h.size and (self.table.p2v[h] != -1).any():
            bad.append(f"{n}: a hole is bound")
        return bad


def place_floats(floats: list, floor_row: int, ceil_row: int) -> dict | None:
    """Choose page ranges for the floats between two row frontiers, or None if they cannot fit.

    floats: [(key, FloatBand, pages)] in chain order, each needing `pages` contiguous pages of
    its grid.  Each float goes as near its current span (extended evenly) as the tightest
    packings from below and from above allow, so a float that already fits does not move and
    one that must move moves least.  -> {key: (first page, pages)}.
    """
    latest, top = {}, ceil_row
    for key, b, s in reversed(floats):  # tightest packing from above
        latest[key] = min(b.max_page, top // b.rpp) - s
        top = latest[key] * b.rpp
    out, prev = {}, floor_row
    for key, b, s in floats:  # from below
        first = max(b.min_page, -(-prev // b.rpp))
        if first > latest[key]:
            return None
        pref = (first + latest[key]) // 2 if b.empty else b.lo - (s - b.span) // 2
        t = min(max(pref, first), latest[key])
        out[key] = (t, s)
        prev = (t + s) * b.rpp
    return out if prev <= ceil_row else None


def settle_floats(targets: dict) -> list[Move]:
    """Move floats into disjoint target ranges {key: (FloatBand, (first page, pages))} -> moves.

    A float moves once no other unsettled float still occupies its range; with disjoint targets
    in chain order one always can (a float in the way moves in the same direction first).
    """
    for b, _ in targets.values():
        b.absorb()  # so a span never reaches past its live pages into another's target
    pending, moves = dict(targets), []
    while pending:
        done = []
        for key, (b, (t, s)) in pending.items():
            lo, hi = t * b.rpp, (t + s) * b.rpp
            if not any(k != key and (e := o.extent()) is not None and e[0] < hi and lo < e[1]
                       for k, (o, _) in pending.items()):
                moves += b.settle(t, s)
                done.append(key)
        if not done:
            raise RuntimeError(f"float layout cannot be reached: {pending}")
        for key in done:
            del pending[key]
    return moves


__all__ = ["FloatBand", "place_floats", "settle_floats"]
