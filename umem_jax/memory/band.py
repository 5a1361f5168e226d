"""End band: a sub-pool anchored at one end of the arena, growing toward the other end.

The first sub-pool of the chain grows up from its first page above the sink; the last grows
down from the top of the arena.  Both are handled in *index space*: index i is page
`origin + direction * i`, so index 0 is the page nearest the band's anchor and the band's span
is indices [0, span).  Inside the span every page is live (bound in the table) or a hole.

    alloc    holes nearest the anchor first, then move the watermark (span) outward, never past
             the nearest non-empty neighbour's row frontier (the chain passes it in)
    free     lazy: the page becomes a hole, no data moves
    flush    absorb holes touching the watermark (zero copy), then move the survivors farthest
             from the anchor into the holes nearest it, in one batch (sources are past the
             final watermark, destinations before it, so they are disjoint)

Floats reuse `compaction` for their own hole packing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .tables import I32, Move, PageTable


@dataclasses.dataclass(frozen=True)
class Take:
    """A planned allocation of n pages in one band; `commit` carries it out unchanged.

    holes: pages reused from the hole list; low/high: pages added below/above the span;
    start: first page of a float placed from empty (then low = high = 0); extent: the band's
    row extent (lo_row, hi_row) once committed.
    """

    n: int
    holes: int
    low: int
    high: int
    extent: tuple[int, int]
    start: int | None = None


def compaction(holes: np.ndarray, span: int, live: int, cap: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Plan hole packing in index space -> (sources, targets), int32 [k] each.

    holes: sorted int32 hole indices in [0, span); live = span - len(holes).  Targets are the
    holes nearest index 0, sources the live indices farthest from it; with `cap`, at most cap
    pairs (the farthest survivors first, so what is vacated is the outer end of the span).
    """
    targets = holes[holes < live]
    if targets.size == 0:
        return targets, targets
    tail = np.ones(span - live, bool)
    tail[holes[holes >= live] - live] = False
    sources = (live + np.flatnonzero(tail)).astype(I32)
    if cap is not None and targets.size > cap:
        targets, sources = targets[:cap], sources[-cap:]
    return sources, targets


def boundary_run(holes: np.ndarray, span: int) -> int:
    """How many of the sorted hole indices form a run ending at span - 1 (absorbable)."""
    m = holes.size
    if m == 0 or holes[-1] != span - 1:
        return 0
    # holes strictly increase, so holes[i] - i is non-decreasing and reaches span - m only on the run.
    return int(np.count_nonzero(holes - np.arange(m, dtype=I32) == span - m))


class EndBand:
    """Grow-up (direction +1) or grow-down (-1) end band over pages [lo_page, hi_page]."""

    is_float = False

    def __init__(self, sp, table: PageTable, lo_page: int, hi_page: int, direction: int):
        self.sp, self.table, self.name = sp, table, sp.name
        self.rpp = sp.rows_per_page
        self.direction = direction
        self.origin = lo_page if direction > 0 else hi_page
        self.max_span = max(0, hi_page - lo_page + 1)
        self.span = 0  # watermark, in pages from the anchor
        self.live = 0
        self._holes = np.empty(0, I32)  # hole indices; sorted only when _sorted
        self._sorted = True

    # ------------------------------------------------------------------ geometry

    @property
    def nholes(self) -> int:
        return int(self._holes.size)

    @property
    def empty(self) -> bool:
        return self.span == 0

    def pages(self, idx: np.ndarray) -> np.ndarray:
        return (self.origin + self.direction * idx).astype(I32)

    def index(self, pages: np.ndarray) -> np.ndarray:
        return ((pages - self.origin) * self.direction).astype(I32)

    def extent_of(self, span: int) -> tuple[int, int]:
        """Row extent [lo_row, hi_row) of a span of `span` pages (zero length at the anchor)."""
        if self.direction > 0:
            return self.origin * self.rpp, (self.origin + span) * self.rpp
        return (self.origin + 1 - span) * self.rpp, (self.origin + 1) * self.rpp

    def extent(self) -> tuple[int, int]:
        return self.extent_of(self.span)

    def max_span_below(self, lo_limit: int, hi_limit: int) -> int:
        """Largest span that stays inside rows [lo_limit, hi_limit) (the neighbours' frontiers)."""
        if self.direction > 0:
            room = hi_limit // self.rpp - self.origin
        else:
            room = self.origin + 1 - (-(-lo_limit // self.rpp))
        return max(0, min(self.max_span, room))

    # ------------------------------------------------------------------ alloc / free

    def plan(self, n: int, lo_limit: int, hi_limit: int) -> Take | None:
        """Plan taking n pages (holes first, then the watermark), or None if it does not fit."""
        k = min(n, self._holes.size)
        grow = n - k
        if self.span + grow > self.max_span_below(lo_limit, hi_limit):
            return None
        low, high = (0, grow) if self.direction > 0 else (grow, 0)
        return Take(n, k, low, high, self.extent_of(self.span + grow))

    def commit(self, take: Take, vids: np.ndarray) -> np.ndarray:
        """Carry out `take`, binding `vids` (int32 [n]) -> their physical pages int32 [n]."""
        grow = take.n - take.holes
        if take.holes:
            self._sort()
            idx = self._holes[:take.holes]
            self._holes = self._holes[take.holes:]
            if grow:
                idx = np.concatenate([idx, np.arange(self.span, self.span + grow, dtype=I32)])
        else:
            idx = np.arange(self.span, self.span + grow, dtype=I32)
        self.span += grow
        pages = self.pages(idx)
        self.table.bind(vids, pages)
        self.live += take.n
        return pages

    def release(self, vids: np.ndarray) -> None:
        """Unbind `vids` (bound here); their pages become holes (no data moves)."""
        pages = self.table.unbind(vids)
        self._holes = np.concatenate([self._holes, self.index(pages)])
        self._sorted = False
        self.live -= vids.size

    # ------------------------------------------------------------------ compaction

    def _sort(self) -> None:
        if not self._sorted:
            self._holes.sort()
            self._sorted = True

    def absorb(self) -> int:
        """Retreat the watermark over holes touching it (zero copy) -> pages absorbed."""
        if not self._holes.size:
            return 0
        self._sort()
        r = boundary_run(self._holes, self.span)
        if r:
            self.span -= r
            self._holes = self._holes[:-r]
        return r

    def flush(self, max_moves: int | None = None) -> list[Move]:
        """Absorb boundary holes, then fill the holes nearest the anchor with the survivors
        farthest from it (at most max_moves; None: until packed) -> the moves, in order."""
        if not self._holes.size:
            return []
        self.absorb()
        src, dst = compaction(self._holes, self.span, self.live, max_moves)
        if not src.size:
            return []
        moves = self.table.move(self.pages(src), self.pages(dst))
        self._holes = np.sort(np.concatenate([self._holes[dst.size:], src]))
        self.absorb()
        return moves

    # ------------------------------------------------------------------ checks

    def live_pages(self) -> np.ndarray:
        span_pages = self.pages(np.arange(self.span, dtype=I32))
        return span_pages[self.table.p2v[span_pages] > 0]

    def check(self) -> list[str]:
        bad, n = [], self.name
        h = np.sort(self._holes)
        if not 0 <= self.span <= self.max_span:
            bad.append(f"{n}: watermark {self.span} outside [0, {self.max_span}]")
        if h.size and (h[0] < 0 or h[-1] >= self.span or (np.diff(h) == 0).any()):
            bad.append(f"{n}: hole list has duplicates or indices outside the span")
        if self.live + h.size != self.span:
            bad.append(f"{n}: span {self.span} != live {self.live} + holes {h.size}")
        bound = self.table.bound()
        if bound.size != self.live:
            bad.append(f"{n}: {bound.size} ids bound but live count is {self.live}")
        idx = self.index(self.table.v2p[bound])
        if idx.size and (idx.min() < 0 or idx.max() >= self.span):
            bad.append(f"{n}: a live page lies outside the span")
        if h.size and (self.table.p2v[self.pages(h)] != -1).any():
            bad.append(f"{n}: a hole is bound")
        return bad


__all__ = ["EndBand", "Take", "boundary_run", "compaction"]
