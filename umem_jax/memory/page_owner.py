"""PageOwner: who holds each virtual token page, and who needs its window pages.

Token pages are shared between holders (in the engine: requests, for the pages of their
tokens, and the prefix cache, for the pages of its radix tree), so freeing is refcounted and
the allocator is told only when the last holder lets go:

  refs[v]             holders of token page v; the last release frees every physical page
                      bound to v (full and windows) and returns the id.
  window_refs[w][v]   holders that need v's page in window sub-pool w: a request for the pages
                      its future queries attend (from `window_start[w]` on), the cache for the
                      pages a hit could resume on.  The last window release tombstones v in w
                      (the id and its full page stay).  Without it, a request passing a shared
                      page would tombstone it under another request whose window still covers it.

Invariant (checked at idle by `check`): v is bound in w exactly when window_refs[w][v] > 0, and
a page with window holders has token holders.  A holder drops its window refs before its token
refs.
"""

from __future__ import annotations

import numpy as np

from .chain import ChainAllocator


class PageOwner:
    """Refcounts over `allocator`'s token page ids [0, capacity), per id and per window."""

    def __init__(self, allocator: ChainAllocator, capacity: int):
        self.allocator = allocator
        self.refs = np.zeros(capacity, np.int32)
        self.windows = tuple(sp.name for sp in allocator.plan.windows)
        self.window_refs = {w: np.zeros(capacity, np.int32) for w in self.windows}

    # ------------------------------------------------------------------ token pages
    def take(self, vids, windows: tuple[str, ...] = ()) -> None:
        """One more holder of `vids` (and of their pages in `windows`, which must be bound)."""
        v = np.asarray(vids, np.int64)
        self.refs[v] += 1
        for w in windows:
            self.take_window(v, w)

    def release(self, vids) -> None:
        """One holder fewer; pages nobody holds any more are freed."""
        v = np.asarray(vids, np.int64)
        if not v.size:
            return
        if (self.refs[v] <= 0).any():
            raise AssertionError(f"releasing token pages nobody holds: {v[self.refs[v] <= 0][:8]}")
        self.refs[v] -= 1
        dead = v[self.refs[v] == 0]
        if dead.size:
            for w in self.windows:
                if (self.window_refs[w][dead] > 0).any():
                    raise AssertionError(f"freeing token pages whose {w} pages still have holders: "
                                         f"{dead[self.window_refs[w][dead] > 0][:8]}")
            self.allocator.free_token_pages(dead)

    def held(self) -> np.ndarray:
        return np.flatnonzero(self.refs > 0)

    # ------------------------------------------------------------------ window pages
    def take_window(self, vids, window: str) -> None:
        v = np.asarray(vids, np.int64)
        if not v.size:
            return
        if (self.window_refs[window][v] <= 0).any():
            bound = self.allocator.translate_pages(v.astype(np.int32), window) > 0
            if not bound.all():
                raise AssertionError(f"{window}: holding window pages that are tombstoned: {v[~bound][:8]}")
        self.window_refs[window][v] += 1

    def release_window(self, vids, window: str) -> None:
        """One window holder fewer; pages no holder needs in `window` are tombstoned there."""
        v = np.asarray(vids, np.int64)
        if not v.size:
            return
        unheld = self.window_refs[window][v] <= 0
        if unheld.any():
            raise AssertionError(f"{window}: releasing window pages nobody holds: {v[unheld][:8]}")
        self.window_refs[window][v] -= 1
        dead = v[self.window_refs[window][v] == 0]
        if dead.size:
            self.allocator.release_window_pages(dead, window)

    def window_bound(self, vid: int, window: str) -> bool:
        """Whether token page `vid` has its page in `window` (a holder needs it)."""
        return bool(self.window_refs[window][vid] > 0)

    # ------------------------------------------------------------------ checks
    def check(self, refs: np.ndarray, window_refs: dict[str, np.ndarray]) -> list[str]:
        """Compare the counts with what the holders say they hold (refs / window_refs: expected counts
        per id) and the window invariant -> a list of problems, empty when all agree."""
        bad = []
        if (self.refs != refs).any():
            bad.append(f"token page refcounts differ from the holders at {np.flatnonzero(self.refs != refs)[:8]}")
        for w in self.windows:
            if (self.window_refs[w] != window_refs[w]).any():
                bad.append(f"{w}: window refcounts differ from the holders at "
                           f"{np.flatnonzero(self.window_refs[w] != window_refs[w])[:8]}")
            bound = self.allocator.translate_pages(np.arange(self.refs.size, dtype=np.int32), w) > 0
            if (bound != (self.window_refs[w] > 0)).any():
                bad.append(f"{w}: pages bound without a holder or held while tombstoned at "
                           f"{np.flatnonzero(bound != (self.window_refs[w] > 0))[:8]}")
        return bad


__all__ = ["PageOwner"]
