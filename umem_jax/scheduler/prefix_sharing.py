"""PrefixSharing: the scheduler's side of the prefix cache (mixed into Scheduler).

  lookup      a waiting request takes the deepest resumable cached prefix (`_apply_hit`): it
              holds the shared pages and the window pages its first pass reads, skips the
              cached tokens, and once admitted with a working slot gets the hit's checkpoint
              copied into it (`_restore`: a slot copy in the allocator's move queue).  Not
              admitted -> `_drop_hit` undoes it all.
  hand-off    at the start of every schedule (and when a request finishes or is retracted) a
              request's computed pages whose tokens are known go into the tree with the
              checkpoints planned for them (`_cache_progress`): the steps writing them are
              launched, so anything that reads them later runs after them on the device.
  checkpoints planned per prefill pass (`_plan_checkpoints`: the fork point, the last page
              boundary) and written by the prefill kernels; every `checkpoint_interval` decode
              tokens a copy of the working slot (`_cache_running`).  Each slot is optional:
              priced by the demand model on top of every running request's reservation, and
              skipped when it does not fit (`_take_checkpoint_slot`).
  eviction    before anything is retracted or refused, unreferenced cache entries go, LRU
              (`_fits_or_evict`).

The host methods here use the Scheduler's allocator, demand model, owner, cache and
`_reservations` / `_free_memory`.
"""

from __future__ import annotations

from ..core.request import Request
from ..core.scheduled_batch import CHECKPOINTS_PER_ROW
from ..memory.demand import Demand
from .prefix_cache import Hit


class PrefixSharing:
    def _fits_or_evict(self, need) -> bool:
        """need() fits now, or after evicting unreferenced cache entries (LRU) -- tried before
        anything is retracted."""
        if self.demand.fits(self.allocator, need()):
            return True
        if self.cache is None:
            return False
        self.cache.evict(lambda: self.demand.fits(self.allocator, need()))
        return self.demand.fits(self.allocator, need())

    def _apply_hit(self, req: Request) -> Hit:
        """Look `req` up and, on a hit, make it hold the shared pages (and the window pages its
        first pass attends) and skip the cached tokens.  Undone by `_drop_hit` if it is not
        admitted; the state is restored by `_restore` once it has a working slot."""
        n = req.num_tokens  # a waiting request has no pending token: all known
        hit = self.cache.match(req.token_ids(0, n), (n - 1) // self.ps)  # compute >= 1 token
        req.fork = hit.fork
        if hit.resume:
            vids = [x.vid for x in hit.nodes]
            self.owner.take(vids)
            for name, w in self.windows:
                first = max(0, hit.resume - w + 1) // self.ps
                self.owner.take_window(vids[first:], name)
                req.window_start[name] = first
            req.pages = vids
            req.num_computed = hit.resume
            req.cache_node, req.cache_pages = hit.nodes[-1], len(vids)
            self.cache.pin(hit.nodes[-1])  # its checkpoint must survive evictions for this admission
        return hit

    def _drop_hit(self, req: Request, hit: Hit | None) -> None:
        if hit is not None and hit.resume:
            self.cache.unpin(hit.nodes[-1])
            self._free_memory(req)
            req.num_computed = 0
        req.fork = 0

    def _restore(self, req: Request, hit: Hit) -> None:
        """Count the admitted lookup; copy the hit's checkpoint into the request's working slot
        (queued with the moves, so it lands before the step that reads it: the checkpoint may go
        once the copy is queued)."""
        self.cache.record(req.num_tokens, hit)
        if hit.resume:
            if self.has_state:
                self.allocator.copy_state_slots([hit.checkpoint], [req.slots[0]])
            self.cache.unpin(hit.nodes[-1])

    def _cache_running(self) -> None:
        """Hand every running request's new pages and checkpoints to the cache (their steps are
        launched), and take the decode checkpoints that are due (slot copies of the working
        slots: all queued first, then attached, so no copy reads a slot the cache let go)."""
        self._reserved = None
        due = [x for r in self.running if (x := self._cache_progress(r, decode=True)) is not None]
        if due:
            self.allocator.copy_state_slots([r.slots[0] for r, _ in due], [s for _, s in due])
            for r, slot in due:
                r.ckpts.append((r.num_computed, slot))
                self._cache_progress(r)

    def _cache_progress(self, req: Request, decode: bool = False) -> tuple[Request, int] | None:
        """Insert the pages `req` computed whose tokens are known, with its planned checkpoints
        -> (req, new slot) when decode is set and a decode checkpoint is due (not attached yet)."""
        known = min(req.num_computed, req.prompt_len + len(req.output_token_ids))
        n = known // self.ps
        if n > req.cache_pages or req.ckpts:
            ck = {pos // self.ps: slot for pos, slot in req.ckpts}
            req.ckpts = []
            node, rejected = self.cache.insert(req.token_ids, req.pages, n, hint=req.cache_node, checkpoints=ck)
            if rejected:
                self.allocator.free_state_slots(rejected)
            req.cache_node, req.cache_pages = node, n
        p, stride = req.num_computed, self.checkpoint_stride
        if decode and stride and p and p % stride == 0 and p <= known and req.slots:
            node = req.cache_node  # the working slot holds the state after p tokens: checkpoint it
            while node is not None and node.depth * self.ps > p:
                node = node.parent
            if node is not None and node.alive and node.depth * self.ps == p and not node.ckpt:
                slot = self._take_checkpoint_slot()
                if slot:
                    return req, slot
        return None

    def _plan_checkpoints(self, req: Request, start: int, end: int, extra: Demand) -> tuple[tuple[int, int], ...]:
        """State checkpoints for pass [start, end): at the fork point (where the request leaves a
        cached path that goes on) and at the pass's last page boundary (before the last token
        on the pass that ends the known tokens, since a hit always computes one token)."""
        if self.cache is None or not self.has_state:
            return ()
        ps = self.ps
        last = ((end - 1) if end == req.num_tokens else end) // ps * ps
        out = []
        for q in sorted({q for q in (req.fork, last) if start < q <= end})[-CHECKPOINTS_PER_ROW:]:
            node = self.cache.find(req.token_ids(0, q), q // ps)
            if node is not None and node.ckpt:
                continue
            slot = self._take_checkpoint_slot(extra)
            if not slot:
                break
            out.append((q, slot))
        req.ckpts += out
        return tuple(out)

    def _take_checkpoint_slot(self, extra: Demand | None = None) -> int:
        """A state slot for a checkpoint -> its id, or 0 (skipped).  Priced by the demand model
        on top of every running request's decode reservation (and `extra`), so a checkpoint
        never takes memory an admitted request counts on: a stalled checkpoint is skipped, it
        never stalls a request.  Older cache entries may be evicted for it (LRU), as for any
        allocation: a full cache must not stop new checkpoints."""
        need = lambda: self.demand.checkpoint() + self._reservations() + (extra or Demand())
        slots = self.allocator.alloc_state_slots(1) if self._fits_or_evict(need) else None
        if slots is None:
            self.num_checkpoints_skipped += 1
            return 0
        self.num_checkpoints += 1
        return int(slots[0])


__all__ = ["PrefixSharing"]
