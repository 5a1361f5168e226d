"""CacheHoldings: the prefix cache as one holder in the PageOwner, and what it holds per sub-pool.

The tree takes and releases its token page refs, window refs and checkpoint slots through
here, which keeps counts and boolean masks over virtual page ids beside them, so the usage
figures (`by_subpool`, `evictable_by_subpool`) are a few vector ops per call, not a walk of the
tree.
"""

from __future__ import annotations

import numpy as np

from ..memory.page_owner import PageOwner


class CacheHoldings:
    def __init__(self, owner: PageOwner):
        self.owner, self.allocator = owner, owner.allocator
        capacity = owner.refs.size
        self.pages = np.zeros(capacity, bool)  # the page ids the tree holds a token ref of
        self.window_pages = {name: np.zeros(capacity, bool) for name in owner.windows}  # ... a window ref of
        self.num_pages = 0
        self.num_window_pages = {name: 0 for name in owner.windows}
        self.num_checkpoints = 0
        self.pinned: set = set()  # nodes whose checkpoint a lookup is about to restore

    # ------------------------------------------------------------------ refs
    def take_page(self, vid: int) -> None:
        self.owner.take([vid])
        self.pages[vid] = True
        self.num_pages += 1

    def release_page(self, vid: int) -> None:
        self.owner.release([vid])
        self.pages[vid] = False
        self.num_pages -= 1

    def take_window(self, node, name: str) -> None:
        """The tree holds node's page in window `name` (node.wins says so)."""
        self.owner.take_window([node.vid], name)
        self.window_pages[name][node.vid] = True
        self.num_window_pages[name] += 1
        node.wins.add(name)

    def release_window(self, node, name: str) -> None:
        self.owner.release_window([node.vid], name)
        self.window_pages[name][node.vid] = False
        self.num_window_pages[name] -= 1
        node.wins.discard(name)

    def take_checkpoint(self) -> None:
        """The tree took a checkpoint slot (the caller allocated it)."""
        self.num_checkpoints += 1

    def release_checkpoint(self, slot: int) -> None:
        self.allocator.free_state_slots([slot])
        self.num_checkpoints -= 1

    def pin(self, node) -> None:
        """Keep node's checkpoint until `unpin` (a hit restores from it once admitted)."""
        node.pins += 1
        self.pinned.add(node)

    def unpin(self, node) -> None:
        node.pins -= 1
        if not node.pins:
            self.pinned.discard(node)

    # ------------------------------------------------------------------ usage
    def by_subpool(self) -> dict[str, int]:
        """Pages (slots) the cache holds per sub-pool, as ArenaUsage counts them."""
        plan = self.allocator.plan
        out = {plan.full.name: self.num_pages, **self.num_window_pages}
        if plan.state is not None:
            out[plan.state.name] = self.num_checkpoints
        return out

    def evictable_by_subpool(self) -> dict[str, int]:
        """Pages (slots) only the cache holds, per sub-pool: what eviction could free now without
        touching a request (a page a request also holds is the request's, with its window pages;
        a checkpoint is the cache's unless an admission pinned it).  What admission sees as
        reclaimable, so usage reports leave it out of the bytes requests hold (as SGLang's token
        usage leaves out its evictable radix-cache tokens)."""
        plan = self.allocator.plan
        only = self.pages & (self.owner.refs == 1)  # no request's path runs through it: it can go
        out = {plan.full.name: int(only.sum()), **{n: int((m & only).sum()) for n, m in self.window_pages.items()}}
        if plan.state is not None:
            out[plan.state.name] = self.num_checkpoints - sum(1 for x in self.pinned if x.alive and x.ckpt)
        return out

    def reclaimable_by_subpool(self) -> dict[str, int]:
        """At most what evicting everything evictable frees now, per sub-pool: as
        `evictable_by_subpool`, but a window page only the cache's window ref holds counts even
        on a request's path (eviction drops the window pages of marks and branch points there
        too).  An upper bound, so a need it says cannot fit cannot (fits_or_evict skips such
        evictions)."""
        out = self.evictable_by_subpool()
        for n, m in self.window_pages.items():
            out[n] = int((m & (self.owner.window_refs[n] == 1)).sum())
        return out


__all__ = ["CacheHoldings"]
