"""RequestMemory: the arena memory running requests hold, taken and given back.

A request holds virtual token page ids (`pages[i]` covers positions [i * page_size,
(i + 1) * page_size)) with their window pages from `window_start[w]` on, a working state slot,
and the checkpoint slots planned for its passes.  Pages are refcounted by the PageOwner because
the prefix cache shares them: a request releases its refs, the last holder frees the page.
"""

from __future__ import annotations

import numpy as np

from ..core.request import Request
from ..memory.chain import ChainAllocator
from ..memory.demand import DemandModel
from ..memory.page_owner import PageOwner


class RequestMemory:
    """allocator: the arena's; demand: prices each pass in allocator units."""

    def __init__(self, allocator: ChainAllocator, demand: DemandModel):
        self.allocator = allocator
        self.demand = demand
        self.page_size = demand.page_size
        self.windows = demand.windows  # ((name, window tokens), ...)
        self.window_names = tuple(name for name, _ in self.windows)
        self.owner = PageOwner(allocator, allocator.bands[-1].table.num_virtual + 1)

    def alloc(self, req: Request, end: int) -> bool:
        """Take the pages and slots of pass [num_computed, end) for `req` -> False if the arena
        refused (nothing is kept then).  Every new page gets its window pages too."""
        d = self.demand.step(req, end)
        vids = self.allocator.alloc_token_pages(d.token_pages) if d.token_pages else np.empty(0, np.int32)
        if vids is None:
            return False
        slots = self.allocator.alloc_state_slots(d.state_slots) if d.state_slots else np.empty(0, np.int32)
        if slots is None:
            if vids.size:
                self.allocator.free_token_pages(vids)
            return False
        self.owner.take(vids, self.window_names)
        req.hold(vids.tolist(), slots.tolist())
        return True

    def give_back_since(self, req: Request, num_pages: int, num_slots: int) -> None:
        """Undo allocations: release the pages past the first `num_pages` (all their window
        pages were taken with them) and the slots past the first `num_slots`."""
        pages = req.pages[num_pages:]
        for name in self.window_names:
            self.owner.release_window(pages, name)
        self.owner.release(pages)
        if req.slots[num_slots:]:
            self.allocator.free_state_slots(req.slots[num_slots:])
        req.drop_held_since(num_pages, num_slots)

    def free(self, req: Request) -> None:
        """Give back everything `req` holds (its planned checkpoints not handed to the cache
        included)."""
        if req.ckpts:
            self.allocator.free_state_slots([s for _, s in req.ckpts])
        for name in self.window_names:
            self.owner.release_window(req.pages[req.window_start[name]:], name)
        self.owner.release(req.pages)
        if req.slots:
            self.allocator.free_state_slots(req.slots)
        req.forget_memory(self.window_names)

    def release_passed_windows(self, running: list[Request]) -> None:
        """Give up window pages whose tokens every future query of their request has passed:
        page k goes once (k + 1) * page_size <= num_computed - w + 1 (tombstoned unless the
        prefix cache or another request still needs it)."""
        for r in running:
            for name, w in self.windows:
                upto = min(len(r.pages), max(0, r.num_computed - w + 1) // self.page_size)
                start = r.window_start[name]
                if upto > start:
                    self.owner.release_window(r.pages[start:upto], name)
                    r.pass_window(name, upto)

    # ------------------------------------------------------------------ checks
    def held_ids(self, requests: list[Request], cache) -> tuple[np.ndarray, np.ndarray]:
        """(token page ids, state slot ids) the requests and the prefix cache (or None) hold:
        for the allocator's leak check."""
        pages = [p for r in requests for p in r.pages]
        slots = [s for r in requests for s in r.slots] + [s for r in requests for _, s in r.ckpts]
        if cache is not None:
            vids, checkpoints, _ = cache.held()
            pages += vids
            slots += checkpoints
        return np.asarray(pages, np.int64), np.asarray(slots, np.int64)

    def check_refs(self, requests: list[Request], cache) -> list[str]:
        """Page and window refcounts against what every holder says it holds -> problems."""
        n = self.owner.refs.size
        refs = np.zeros(n, np.int32)
        window_refs = {name: np.zeros(n, np.int32) for name in self.window_names}
        for r in requests:
            np.add.at(refs, np.asarray(r.pages, np.int64), 1)
            for name in self.window_names:
                np.add.at(window_refs[name], np.asarray(r.pages[r.window_start[name]:], np.int64), 1)
        if cache is not None:
            vids, _, windows = cache.held()
            np.add.at(refs, np.asarray(vids, np.int64), 1)
            for name in self.window_names:
                np.add.at(window_refs[name], np.asarray(windows[name], np.int64), 1)
        return self.owner.check(refs, window_refs)
