"""Virtual <-> physical page tables of one sub-pool, virtual id pools, page moves, translation.

The scheduler, request tables and prefix cache hold *virtual* ids; kernels index *physical*
pages.  One `PageTable` per sub-pool maps one to the other:

    v2p   int32 [num_virtual + 1]  physical page of virtual id v, -1 when unbound (a window
                                   sub-pool's -1 on a live token id is a tombstone); the extra
                                   last entry is a sentinel 0
    read  int32 [num_virtual + 1]  v2p with every -1 replaced by the sink 0: the table
                                   translation gathers from (one clipped gather, no fix-up pass)
    p2v   int32 [num_physical]     virtual id held by physical page p, -1 when free

Virtual id 0 <-> physical page 0 (the sink) permanently; every padding or unmapped id translates
to 0.  Moving a page rewrites its v2p/p2v entries and nothing else, so ids held elsewhere stay
valid.  The tables never touch device memory: a relocation is returned as a `Move` that the
caller applies to the arena (`pallas_kernels.relocate.move_pages`) before the next step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

I32 = np.int32


@dataclasses.dataclass(frozen=True)
class Move:
    """One batch of page copies in one sub-pool: page src[i] -> page dst[i], all at once.

    src, dst: int32 [N].  Destinations are distinct and none is a source of the same batch, so
    one simultaneous copy (read every source, then write every destination) is correct.
    Batches must be applied in the order `ChainAllocator.take_moves()` returns them.
    copy: a copy the caller asked for (e.g. a state checkpoint saved or restored), not a
    relocation: the source page keeps its id and its bytes.
    """

    subpool: str
    src: np.ndarray
    dst: np.ndarray
    rows_per_page: int
    copy: bool = False

    def __len__(self) -> int:
        return int(self.src.size)


def ordered_batches(src: np.ndarray, dst: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split a page mapping whose source and destination sets may overlap into batches that are
    each safe as one simultaneous copy, in order.

    src, dst: int32 [N], each distinct; the mapping must have no cycle (an order-preserving shift
    never has one).  A pair is ready once its destination is no longer a pending source, so a
    shift by d pages of a span of L pages takes ceil(L / d) batches.
    """
    keep = src != dst
    src, dst = src[keep], dst[keep]
    out = []
    while src.size:
        ready = ~np.isin(dst, src)
        if not ready.any():
            raise ValueError("page mapping has a cycle; it cannot be applied without a spare page")
        out.append((src[ready], dst[ready]))
        src, dst = src[~ready], dst[~ready]
    return out


class IdPool:
    """Free virtual ids [1, capacity) as a LIFO stack (low ids come out first at start)."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._stack = np.arange(self.capacity - 1, 0, -1, dtype=I32)
        self._n = self.capacity - 1

    @property
    def free(self) -> int:
        return self._n

    def pop(self, n: int) -> np.ndarray:
        """Take n free ids -> int32 [n].  The caller checked `free >= n`."""
        ids = self._stack[self._n - n:self._n][::-1].copy()
        self._n -= n
        return ids

    def push(self, ids: np.ndarray) -> None:
        self._stack[self._n:self._n + ids.size] = ids
        self._n += ids.size

    def free_ids(self) -> np.ndarray:
        return self._stack[:self._n]


class PageTable:
    """v2p / p2v of one sub-pool (see the module docstring for the layout)."""

    def __init__(self, name: str, num_virtual: int, num_physical: int, rows_per_page: int):
        self.name = name
        self.rows_per_page = rows_per_page
        self.v2p = np.full(num_virtual + 1, -1, I32)
        self.read = np.zeros(num_virtual + 1, I32)
        self.p2v = np.full(num_physical, -1, I32)
        self.v2p[0] = self.v2p[-1] = 0  # sink <-> sink, and a sentinel past the last id
        self.p2v[0] = 0

    @property
    def num_virtual(self) -> int:
        return self.v2p.size - 1

    def bind(self, vids: np.ndarray, pages: np.ndarray) -> None:
        self.v2p[vids] = pages
        self.read[vids] = pages
        self.p2v[pages] = vids

    def unbind(self, vids: np.ndarray) -> np.ndarray:
        """Unbind `vids` (all bound) -> their physical pages int32 [n]; the pages become free."""
        pages = self.v2p[vids]
        self.v2p[vids] = -1
        self.read[vids] = 0
        self.p2v[pages] = -1
        return pages

    def move(self, src: np.ndarray, dst: np.ndarray) -> list[Move]:
        """Rebind the pages src -> dst (src bound, dst free or itself a source) and return the
        copies that carry their bytes, split into simultaneous-copy batches if src/dst overlap."""
        src = np.asarray(src, I32)
        dst = np.asarray(dst, I32)
        if src.size == 0:
            return []
        vids = self.p2v[src]
        self.p2v[src] = -1
        self.p2v[dst] = vids
        self.v2p[vids] = dst
        self.read[vids] = dst
        if not np.isin(dst, src).any():
            return [Move(self.name, src, dst, self.rows_per_page)]
        return [Move(self.name, s, d, self.rows_per_page) for s, d in ordered_batches(src, dst)]

    def bound(self) -> np.ndarray:
        """Virtual ids bound to a physical page, ascending (the sink excluded)."""
        return np.flatnonzero(self.v2p[:-1] > 0).astype(I32)

    def translate(self, vids: np.ndarray, width: int | None = None) -> np.ndarray:
        """Virtual ids [..., P] (-1 padding) -> physical ids [..., width], int32.

        Padding, unbound and tombstoned ids map to the sink 0; columns P..width-1 are 0, so the
        shape is fixed whatever the batch holds.
        """
        vids = np.asarray(vids)
        p = vids.shape[-1] if vids.ndim else 1
        # mode="clip": -1 reads entry 0 and ids past the table read the sentinel, both the sink
        if width is None or width == p:
            return np.take(self.read, vids, mode="clip")
        if width < p:
            raise ValueError(f"translation width {width} is narrower than the {p} ids given")
        out = np.zeros((*vids.shape[:-1], width), I32)
        out[..., :p] = np.take(self.read, vids, mode="clip")
        return out

    def check(self) -> list[str]:
        """v2p and p2v are inverse; no physical page holds two virtual ids."""
        bad = []
        if self.v2p[0] != 0 or self.v2p[-1] != 0 or self.p2v[0] != 0:
            bad.append(f"{self.name}: sink entries changed")
        if (self.read != np.maximum(self.v2p, 0)).any():
            bad.append(f"{self.name}: the read table differs from v2p")
        vids = self.bound()
        pages = self.v2p[vids]
        if (pages >= self.p2v.size).any():
            bad.append(f"{self.name}: v2p points past the page grid")
            return bad
        if (self.p2v[pages] != vids).any():
            bad.append(f"{self.name}: v2p and p2v are not inverse at vids {vids[self.p2v[pages] != vids][:8]}")
        if (self.v2p[:-1] < -1).any() or (self.p2v < -1).any():
            bad.append(f"{self.name}: table entries below -1")
        held = np.flatnonzero(self.p2v > 0)
        if held.size != vids.size:
            bad.append(f"{self.name}: {held.size} pages hold an id but {vids.size} ids are bound")
        return bad


__all__ = ["IdPool", "Move", "PageTable", "ordered_batches"]
