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
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .holes import Holes, boundary_run, compaction, span_problems
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


class EndBand:
    """Grow-up (direction +1) or grow-down (-1) end band over pages [lo_page, hi_page]."""

    is_float = False

    def __init__(self, subpool, table: PageTable, lo_page: int, hi_page: int, direction: int):
        self.subpool, self.table, self.name = subpool, table, subpool.name
        self.rows_per_page = subpool.rows_per_page
        self.direction = direction
        self.origin = lo_page if direction > 0 else hi_page
        self.max_span = max(0, hi_page - lo_page + 1)
        self.span = 0  # watermark, in pages from the anchor
        self.live = 0
        self.holes = Holes()  # hole indices

    # ------------------------------------------------------------------ geometry

    @property
    def nholes(self) -> int:
        return len(self.holes)

    @property
    def empty(self) -> bool:
        return self.span == 0

    @property
    def max_pages(self) -> int:
        """The most pages the band can ever hold (the whole arena to itself)."""
        return self.max_span

    def pages(self, idx: np.ndarray) -> np.ndarray:
        return (self.origin + self.direction * idx).astype(I32)

    def index(self, pages: np.ndarray) -> np.ndarray:
        return ((pages - self.origin) * self.direction).astype(I32)

    def extent_of(self, span: int) -> tuple[int, int]:
        """Row extent [lo_row, hi_row) of a span of `span` pages (zero length at the anchor)."""
        row = self.subpool.page_row
        if self.direction > 0:
            return row(self.origin), row(self.origin + span)
        return row(self.origin + 1 - span), row(self.origin + 1)

    def extent(self) -> tuple[int, int]:
        return self.extent_of(self.span)

    def max_span_below(self, lo_limit: int, hi_limit: int) -> int:
        """Largest span that stays inside rows [lo_limit, hi_limit) (the neighbours' frontiers)."""
        if self.direction > 0:
            room = self.subpool.page_floor(hi_limit) - self.origin
        else:
            room = self.origin + 1 - self.subpool.page_ceil(lo_limit)
        return max(0, min(self.max_span, room))

    # ------------------------------------------------------------------ alloc / free

    def plan(self, n: int, lo_limit: int, hi_limit: int) -> Take | None:
        """Plan taking n pages (holes first, then the watermark), or None if it does not fit."""
        reused = min(n, self.nholes)
        grow = n - reused
        if self.span + grow > self.max_span_below(lo_limit, hi_limit):
            return None
        low, high = (0, grow) if self.direction > 0 else (grow, 0)
        return Take(n, reused, low, high, self.extent_of(self.span + grow))

    def commit(self, take: Take, vids: np.ndarray) -> np.ndarray:
        """Carry out `take`, binding `vids` (int32 [n]) -> their physical pages int32 [n]."""
        grow = take.n - take.holes
        idx = np.arange(self.span, self.span + grow, dtype=I32)
        if take.holes:
            reused = self.holes.take_first(take.holes)
            idx = np.concatenate([reused, idx]) if grow else reused
        self.span += grow
        pages = self.pages(idx)
        self.table.bind(vids, pages)
        self.live += take.n
        return pages

    def release(self, vids: np.ndarray) -> None:
        """Unbind `vids` (bound here); their pages become holes (no data moves)."""
        self.holes.add(self.index(self.table.unbind(vids)))
        self.live -= vids.size

    # ------------------------------------------------------------------ compaction

    def absorb(self) -> int:
        """Retreat the watermark over holes touching it (zero copy) -> pages absorbed."""
        holes = self.holes.sorted()
        run = boundary_run(holes, self.span)
        if run:
            self.span -= run
            self.holes.replace(holes[:-run])
        return run

    def flush(self, max_moves: int | None = None) -> list[Move]:
        """Absorb boundary holes, then fill the holes nearest the anchor with the survivors
        farthest from it (at most max_moves; None: until packed) -> the moves, in order."""
        if not self.nholes:
            return []
        self.absorb()
        holes = self.holes.sorted()
        src, dst = compaction(holes, self.span, self.live, max_moves)
        if not src.size:
            return []
        moves = self.table.move(self.pages(src), self.pages(dst))
        self.holes.replace(np.sort(np.concatenate([holes[dst.size:], src])))
        self.absorb()
        return moves

    # ------------------------------------------------------------------ checks

    def check(self) -> list[str]:
        bad = []
        if not 0 <= self.span <= self.max_span:
            bad.append(f"{self.name}: watermark {self.span} outside [0, {self.max_span}]")
        return bad + span_problems(self.name, self.table, self.live, self.span, self.holes.copy_sorted(), "indices",
                                   0, self.span, self.index, self.pages)


__all__ = ["EndBand", "Take"]
