"""Holes: the freed pages inside one band's span, and the arithmetic of packing them.

A free inside a span only marks its page a hole (no data moves), so frees stay cheap; a later
allocation reuses the hole, or a flush closes it by moving a live page in.  Both kinds of band
(end bands and floats) keep their holes the same way and check them against their span the same
way; only where the span lies and which end is "near" differ.
"""

from __future__ import annotations

import numpy as np

from .tables import I32, PageTable


class Holes:
    """A set of hole positions (page indices or pages, int32), appended to unsorted.

    Frees arrive a request at a time, so appending and sorting only when a reader needs the
    order (taking the nearest holes, absorbing a run at a span end) keeps a free O(its pages).
    """

    def __init__(self):
        self._items = np.empty(0, I32)
        self._sorted = True

    def __len__(self) -> int:
        return int(self._items.size)

    def add(self, items: np.ndarray) -> None:
        self._items = np.concatenate([self._items, items])
        self._sorted = False

    def sorted(self) -> np.ndarray:
        """The holes ascending, int32 [n] (sorted in place, once)."""
        if not self._sorted:
            self._items.sort()
            self._sorted = True
        return self._items

    def replace(self, items: np.ndarray) -> None:
        """Make `items` (ascending, int32) the holes."""
        self._items = items
        self._sorted = True

    def clear(self) -> None:
        self.replace(np.empty(0, I32))

    def take_first(self, n: int) -> np.ndarray:
        """Remove and return the n lowest holes."""
        items = self.sorted()
        self._items = items[n:]
        return items[:n]

    def take_last(self, n: int) -> np.ndarray:
        """Remove and return the n highest holes."""
        items = self.sorted()
        self._items = items[:-n]
        return items[-n:]

    def copy_sorted(self) -> np.ndarray:
        """A sorted copy (for checks, which must not change the band they read)."""
        return np.sort(self._items)


def compaction(holes: np.ndarray, span: int, live: int, max_moves: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Plan hole packing in index space -> (sources, targets), int32 [k] each.

    holes: sorted int32 hole indices in [0, span); live = span - len(holes).  Targets are the
    holes nearest index 0, sources the live indices farthest from it; with `max_moves`, at most
    that many pairs (the farthest survivors first, so what is vacated is the outer end of the span).
    """
    targets = holes[holes < live]
    if targets.size == 0:
        return targets, targets
    tail = np.ones(span - live, bool)
    tail[holes[holes >= live] - live] = False
    sources = (live + np.flatnonzero(tail)).astype(I32)
    if max_moves is not None and targets.size > max_moves:
        targets, sources = targets[:max_moves], sources[-max_moves:]
    return sources, targets


def boundary_run(holes: np.ndarray, span: int) -> int:
    """How many of the sorted hole indices form a run ending at span - 1 (absorbable)."""
    count = holes.size
    if count == 0 or holes[-1] != span - 1:
        return 0
    # holes strictly increase, so holes[i] - i is non-decreasing and reaches span - count only on the run.
    return int(np.count_nonzero(holes - np.arange(count, dtype=I32) == span - count))


def span_problems(name: str, table: PageTable, live: int, span: int, holes: np.ndarray, unit: str,
                  first: int, end: int, to_position, to_page) -> list[str]:
    """What is wrong between a band's span, its holes and its table -> messages (empty: nothing).

    holes: sorted hole positions, which must lie in the span [first, end) of the band's own
    positions (`unit` names them); to_position / to_page map physical pages to positions and
    back (both the identity for a float, whose positions are its pages).
    """
    bad = []
    if holes.size and (holes[0] < first or holes[-1] >= end or (np.diff(holes) == 0).any()):
        bad.append(f"{name}: hole list has duplicates or {unit} outside the span")
    if live + holes.size != span:
        bad.append(f"{name}: span {span} != live {live} + holes {holes.size}")
    bound = table.bound()
    if bound.size != live:
        bad.append(f"{name}: {bound.size} ids bound but live count is {live}")
    positions = to_position(table.v2p[bound])
    if positions.size and (positions.min() < first or positions.max() >= end):
        bad.append(f"{name}: a live page lies outside the span")
    if holes.size and (table.p2v[to_page(holes)] != -1).any():
        bad.append(f"{name}: a hole is bound")
    return bad


__all__ = ["Holes", "boundary_run", "compaction", "span_problems"]
