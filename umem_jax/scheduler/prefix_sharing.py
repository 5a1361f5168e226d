"""PrefixSharing: the scheduler's side of the prefix cache (the Scheduler owns one when caching).

  lookup      a waiting request takes the deepest resumable cached prefix (`take_hit`): it
              holds the shared pages and the window pages its first pass reads, skips the
              cached tokens, and once admitted with a working slot gets the hit's checkpoint
              copied into it (`restore`: a slot copy in the allocator's move queue).  Not
              admitted -> `drop_hit` undoes it all.
  hand-off    at the start of every schedule (and when a request finishes or is retracted) a
              request's computed pages whose tokens are known go into the tree with the
              checkpoints planned for them (`hand_off`): the steps writing them are launched,
              so anything that reads them later runs after them on the device.
  checkpoints planned per prefill pass (`plan_checkpoints`: the fork point, the last page
              boundary) and written by the prefill kernels; every `checkpoint_interval` decode
              tokens a copy of the working slot (`hand_off_running`).  Each slot is optional:
              priced by the demand model on top of what running requests are owed, and skipped
              when it does not fit (`take_checkpoint_slot`).
  eviction    before anything is retracted or refused, unreferenced cache entries go, LRU
              (`fits_or_evict`).

`owed` arguments are callables returning the Demand the running requests (and the step's
admissions) are owed: evaluated only when a checkpoint is priced, as the running set is then.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.request import Request
from ..core.scheduled_batch import CHECKPOINTS_PER_ROW
from ..memory.demand import Demand, DemandModel
from .prefix_cache import PrefixCache
from .radix_node import Hit, resumes
from .request_memory import RequestMemory

Owed = Callable[[], Demand]


class PrefixSharing:
    """cache: the radix tree; memory: the requests' pages and slots (the tree shares them);
    demand: prices checkpoint slots; checkpoint_interval: decode tokens between state
    checkpoints (0: checkpoints only at prefill passes)."""

    def __init__(self, cache: PrefixCache, memory: RequestMemory, demand: DemandModel, checkpoint_interval: int):
        self.cache, self.memory, self.demand = cache, memory, demand
        self.allocator = memory.allocator
        self.page_size = memory.page_size
        self.has_state = demand.plan.state is not None
        # decode checkpoints land on page boundaries: the interval rounded up to whole pages
        interval, page_size = int(checkpoint_interval), self.page_size
        self.checkpoint_stride = -(-interval // page_size) * page_size if interval > 0 and self.has_state else 0
        self.num_checkpoints = 0  # state checkpoints taken (prefill and decode)
        self.num_checkpoints_skipped = 0  # ... and skipped: no slot fit (never stalls a request)

    def fits_or_evict(self, need: Callable[[], Demand], running: list[Request] = ()) -> bool:
        """need() fits now, or after evicting unreferenced cache entries (LRU) -- tried before
        anything is retracted.  Then the tree-only copies of pages that `running` requests
        computed again (a shortened hit, a prefix computed twice) go too: they sit above the
        requests' own cached pages, where eviction cannot reach them (`release_duplicates`).
        While requests run (they will give memory back), nothing is evicted for a need that
        would not fit even with every evictable entry gone (`could_fit`): a failed admission
        keeps the cache, as SGLang's, which admits against free + evictable tokens."""
        d = need()  # priced once: evicting unreferenced entries changes no request's holdings
        fits = lambda: self.demand.fits(self.allocator, d)
        if fits():
            return True
        futile = lambda: bool(running) and not self.could_fit(d, self.cache.holdings.reclaimable_by_subpool())
        if not futile():
            self.cache.evict(fits)
            if fits():
                return True
        if self.cache.release_duplicates([(r.cache_node, r.pages) for r in running if r.cache_node is not None]):
            d = need()
            if not futile():
                self.cache.evict(fits)
        return fits()

    def could_fit(self, need: Demand, evictable: dict[str, int]) -> bool:
        """Whether `need` would fit once the pages (slots) `evictable` counts per sub-pool were
        freed (the cache's reclaimable_by_subpool(): an upper bound of what eviction frees)."""
        return self.allocator.can_fit(need.token_pages, need.state_slots, need.window_pages, freed=evictable)

    # ------------------------------------------------------------------ lookup
    def take_hit(self, req: Request) -> Hit:
        """Look `req` up and, on a hit, make it hold the shared pages (and the window pages its
        first pass attends) and skip the cached tokens.  Undone by `drop_hit` if it is not
        admitted; the state is restored by `restore` once it has a working slot."""
        n = req.num_tokens  # a waiting request has no pending token: all known
        # compute >= 1 token; a lookahead key reads the token at the resume point, which is known;
        # none cached for one whose prompt is still to be scored (core/prompt_logprobs.py)
        scoring = req.prompt_lp is not None and not req.prompt_lp.complete
        hit = self.cache.match(req.token_ids(0, n), 0 if scoring else (n - 1) // self.page_size)
        req.set_fork(hit.fork)
        if hit.resume:
            owner, vids = self.memory.owner, [x.vid for x in hit.nodes]
            owner.take(vids)
            window_start = {}
            for name, w in self.memory.windows:
                first = max(0, hit.resume - w + 1) // self.page_size
                owner.take_window(vids[first:], name)
                window_start[name] = first
            req.resume_from(vids, window_start, hit.resume, hit.nodes[-1])
            self.cache.pin(hit.nodes[-1])  # its checkpoint must survive evictions for this admission
        return hit

    def drop_hit(self, req: Request, hit: Hit | None) -> None:
        """Not admitted (or admitted as a miss): give back what the hit made `req` hold.  With
        no hit, only the fork point of an earlier lookup is forgotten."""
        if resumes(hit):
            self.cache.unpin(hit.nodes[-1])
            self.memory.free(req)  # it holds only cached pages: nothing to hand off
            req.undo_resume()
        req.set_fork(0)

    def restore(self, req: Request, hit: Hit) -> None:
        """Count the admitted lookup; copy the hit's checkpoint into the request's working slot
        (queued with the moves, so it lands before the step that reads it: the checkpoint may go
        once the copy is queued)."""
        self.cache.record(req.num_tokens, hit)
        if hit.resume:
            if self.has_state:
                self.allocator.copy_state_slots([hit.checkpoint], [req.slots[0]])
            self.cache.unpin(hit.nodes[-1])

    # ------------------------------------------------------------------ hand-off
    def hand_off_running(self, running: list[Request], owed: Owed) -> None:
        """Hand every running request's new pages and checkpoints to the cache (their steps are
        launched), and take the decode checkpoints that are due (slot copies of the working
        slots: all queued first, then attached, so no copy reads a slot the cache let go)."""
        due = []
        for r in running:
            self.hand_off(r)
            if self._decode_checkpoint_due(r):
                slot = self.take_checkpoint_slot(owed)
                if slot:
                    due.append((r, slot))
        if due:
            self.allocator.copy_state_slots([r.slots[0] for r, _ in due], [s for _, s in due])
            for r, slot in due:
                r.add_checkpoint(slot)
                self.hand_off(r)

    def hand_off(self, req: Request, last: bool = False) -> None:
        """Insert the pages `req` computed whose tokens are known (with the cache's lookahead: and
        the token after them), with its planned checkpoints.  last: `req` is about to let its
        memory go (finished, retracted): its deepest cached node, if pressure let its window
        pages go while `req` ran on past it, is an anchor again and takes them back while `req`
        still holds them (window_retention.py)."""
        page_size = self.page_size
        known = req.prompt_len + len(req.output_token_ids) - self.cache.lookahead
        num_pages = min(req.num_computed, known) // page_size
        if num_pages > req.cache_pages or req.ckpts:
            checkpoints = {pos // page_size: slot for pos, slot in req.take_planned_checkpoints()}
            end = (req.prompt_len - 1) // page_size  # where the prompt's exact repeat resumes
            node, rejected = self.cache.insert(req.token_ids, req.pages, num_pages, hint=req.cache_node,
                                               checkpoints=checkpoints,
                                               marks=(end,) if req.cache_pages < end <= num_pages else ())
            if rejected:
                self.allocator.free_state_slots(rejected)
            req.mark_cached(node, num_pages)
        if last and req.cache_node is not None:
            self.cache.retention.reanchor(req.cache_node)

    def _decode_checkpoint_due(self, req: Request) -> bool:
        """The working slot holds the state after p = num_computed tokens, p is on the decode
        checkpoint stride, its tokens are known and cached, and no checkpoint is there yet.  Not
        while a speculative step of it is in flight: p is then a lower bound and the state after
        p tokens may be in a speculative slot (scheduler/speculation.py)."""
        p, stride = req.num_computed, self.checkpoint_stride
        known = min(p, req.prompt_len + len(req.output_token_ids))
        if not (stride and p and p % stride == 0 and p <= known and req.slots) or req.spec_ahead:
            return False
        node = req.cache_node
        while node is not None and node.depth * self.page_size > p:
            node = node.parent
        return node is not None and node.alive and node.depth * self.page_size == p and not node.ckpt

    # ------------------------------------------------------------------ checkpoints
    def plan_checkpoints(self, req: Request, start: int, end: int, owed: Owed) -> tuple[tuple[int, int], ...]:
        """State checkpoints for pass [start, end): at the fork point (where the request leaves a
        cached path that goes on) and at the pass's last page boundary (before the last token
        on the pass that ends the known tokens, since a hit always computes one token)."""
        if not self.has_state:
            return ()
        page_size = self.page_size
        last = ((end - 1) if end == req.num_tokens else end) // page_size * page_size
        out = []
        for position in sorted({q for q in (req.fork, last) if start < q <= end})[-CHECKPOINTS_PER_ROW:]:
            node = self.cache.find(req.token_ids(0, position + self.cache.lookahead), position // page_size)
            if node is not None and node.ckpt:
                continue
            slot = self.take_checkpoint_slot(owed)
            if not slot:
                break
            out.append((position, slot))
        req.plan_checkpoints(out)
        return tuple(out)

    def take_checkpoint_slot(self, owed: Owed) -> int:
        """A state slot for a checkpoint -> its id, or 0 (skipped).  Priced by the demand model
        on top of what running requests are owed (`owed()`), so a checkpoint never takes memory
        an admitted request counts on: a stalled checkpoint is skipped, it never stalls a
        request.  Older cache entries may be evicted for it (LRU), as for any allocation: a full
        cache must not stop new checkpoints."""
        need = lambda: self.demand.checkpoint() + owed()
        slots = self.allocator.alloc_state_slots(1) if self.fits_or_evict(need) else None
        if slots is None:
            self.num_checkpoints_skipped += 1
            return 0
        self.num_checkpoints += 1
        return int(slots[0])


__all__ = ["PrefixSharing"]
