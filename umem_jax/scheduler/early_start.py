"""Early start: a long prompt begins its prefill in bytes no running request can need.

A waiting request is admitted when its pass, its own reservation (the rest of its prompt and its
decode reservation) and every running request's reservation fit.  A long prompt that does not fit
would wait in the queue while the bytes it does not fit into stay idle.  With an early start
(SchedulerConfig.early_admission) it is admitted when its first pass alone fits beside all that
every running request can still need -- each run to max_tokens (ratio 1; exact for fixed-length
requests under the exact rule) -- and it goes on that way:

  * a pass that does not fit is shortened to the longest token bucket that fits, down to 1/16
    of a chunk for the first and 1/2 for the later ones (every pass reads the weights once and
    costs its bucket's time: smaller passes, or passes between buckets, cost throughput);
  * its last pass also needs its own decode reservation, so it decodes as any admitted request;
  * once its whole need would be admitted by the usual rule, it is priced as any admitted request.

So it takes only bytes the demand model says no other request can need, and it finishes once
the others have given back their memory.  One at a time: its unfit rest stays in the running
requests' reservations, so every later request of the same or lower priority waits as it would
have (first come, first served).  It evicts prefix-cache entries only when no pass fits the
free bytes, and then only for its shortest pass (finished requests hand their pages to the
cache: waiting on them would block every later arrival while the decode batch drains), and
optional allocations (state checkpoints) are priced against what the others are owed, not
against its unfit rest.  A prompt that shares a page more than is
cached with a running request still computing its prompt does not start early: it would compute
and hold those pages twice, where waiting it finds them cached.  docs/memory.md measures it.
"""

from __future__ import annotations

from ..core.request import Request
from ..memory.demand import Demand
from . import reservations

FIRST_PASS_FRACTION = 16  # the first pass may shrink to chunk // 16 tokens (128 at 2048)
LATER_PASS_FRACTION = 2  # later passes to chunk // 2 (each pass reads the weights once)


class EarlyStart:
    """The request admitted before its whole need fit (at most one), and how its passes are priced.
    `sch` is the Scheduler: its running set, demand model, allocator and reservation rules."""

    def __init__(self, sch):
        self.sch = sch
        self.req: Request | None = None
        self.num_started = 0

    def blocks(self, req: Request) -> bool:
        """Whether waiting `req` cannot be admitted now: an early start's unfit rest comes first
        (pricing it anyway would evict the prefix cache in vain)."""
        return self.req is not None and req.priority >= self.req.priority

    def start(self, req: Request, end: int) -> int:
        """Admit waiting `req` early if a first pass to at most `end` fits -> its end, or 0."""
        sch = self.sch
        if not sch.cfg.early_admission or self.req is not None or end >= req.num_tokens or self._would_share(req):
            return 0
        owed = self.worst_case(req)
        end = self._shrink(req, end, lambda e: sch.demand.step(req, e) + owed,
                           sch.demand.chunk // FIRST_PASS_FRACTION)
        if end:
            self.req = req
            self.num_started += 1
        return end

    def next_pass(self, req: Request, step: Demand, end: int) -> int | None:
        """The end of the early-started `req`'s next pass (0: it waits), or None once it is
        priced as any admitted request (it would be admitted now)."""
        sch = self.sch
        if self._fits(lambda: self._admission_need(req, step, end), evict=sch.running == [req]):
            self.end(req)
            return None
        others = self.worst_case(req)  # once: a shorter pass re-prices only the pass
        return self._shrink(req, end, lambda e: self._need(req, e, others), sch.demand.chunk // LATER_PASS_FRACTION)

    def end(self, req: Request) -> None:
        """`req` has all it is owed, left the running set, or failed: no early start now."""
        if req is self.req:
            self.req = None

    def owed(self) -> Demand:
        """What running requests are owed, for optional allocations (state checkpoints): their
        reservations, but an early start's only once they fit -- counting its unfit rest would
        skip (and evict the cache for) every checkpoint while it waits."""
        sch = self.sch
        if self.req is None:
            return sch._reservations()
        return self._reservations(sch._reserve_tokens, but=self.req)

    def worst_case(self, req: Request) -> Demand:
        """All that every running request but `req` can still need: its whole rest and every
        output it may produce (ratio 1), exactly so under the exact rule (with speculation, a
        verify's drafts past that too); and for each with
        prompt left, its next pass on top (a reservation prices a prompt's rest by decode passes,
        while a prefill pass binds up to window - 1 + chunk window pages at once: the slack the
        usual admission leaves covers that, an early start would take it)."""
        sch = self.sch
        k = sch.cfg.num_speculative_tokens  # a verify in flight and the next one place up to 2k + 1 more
        ahead = 2 * k + 1 if k else 0
        total = self._reservations(lambda r: reservations.reserve_tokens(r, 1.0, sch.exact) + ahead, but=req)
        for r in sch.running:
            if r is not req and not r.decode_ready:
                total = total + sch.demand.step(r, min(r.num_tokens, r.num_computed + sch.demand.chunk))
        return total

    def _would_share(self, req: Request) -> bool:
        """Whether a running request still computing its prompt shares at least one page more of
        `req`'s prompt than is cached now: started early, `req` would compute those pages again
        (and hold them twice); waiting, it finds them cached (requests often share a system
        prompt with the one before them)."""
        if self.sch.cache is None:  # nothing is shared without a prefix cache: waiting gains nothing
            return False
        k = req.num_computed + self.sch.demand.page_size  # cached tokens (a hit) and one page more
        mine = req.prompt_token_ids[:k]
        return len(mine) == k and any(not r.decode_ready and r.prompt_token_ids[:k] == mine for r in self.sch.running)

    # ------------------------------------------------------------------ pricing
    def _reservations(self, tokens, but: Request) -> Demand:
        sch = self.sch
        others = [r for r in sch.running if r is not but]
        return reservations.reservations(others, sch.running + list(sch.held.values()), sch.demand, tokens, sch.exact)

    def _need(self, req: Request, end: int, others: Demand) -> Demand:
        """The pass to `end` and `others` (what every other running request can need); with its
        last pass its own decode reservation too."""
        sch = self.sch
        need = sch.demand.step(req, end) + others
        if end == req.num_tokens:
            need = need + reservations.own(req, end, sch.holders, sch.demand, sch._reserve_tokens(req, end))
        return need

    def _admission_need(self, req: Request, step: Demand, end: int) -> Demand:
        """What admitting `req` by the usual rule would need now: its pass, its reservation after
        it, and every other running request's."""
        sch = self.sch
        own = reservations.own(req, end, sch.holders, sch.demand, sch._reserve_tokens(req, end))
        return step + own + self._reservations(sch._reserve_tokens, but=req)

    def _shrink(self, req: Request, end: int, need, shortest: int) -> int:
        """The longest of `end` and the shorter passes of a token bucket's length (down to
        `shortest` tokens) that fits -> 0 if none does.  need(e): the demand of a pass to e with
        what others are owed.

        A pass fits in the free bytes or after evicting the prefix cache's unreferenced entries
        (LRU), as for any admission: finished requests hand their pages to the cache, and an
        early start that took only the free bytes waited on them, or took short passes beside
        them, while it blocked later arrivals.  Eviction is for the longest pass that can fit
        (fits_or_evict evicts nothing for one that cannot), and a pass between two buckets would
        be padded to the larger one, costing its time for less progress.  Evicting for the
        shortest pass made a 17K-token prompt's later passes half a chunk each, padded to a
        whole one by the GPU bench's buckets (Qwen3.5 shifting with a cache: 170 prefill steps
        against 140 and -17% tok/s in the host simulation, -17% on the GPU in session 31)."""
        start, sch = req.num_computed, self.sch
        floor = max(shortest, sch.cfg.min_chunk)
        ends = [end] + [start + t for t in reversed(sch.cfg.buckets.tokens) if floor <= t < end - start]
        if sch.prefix is None:
            fits = lambda d: sch.demand.fits(sch.allocator, d)
        else:
            fits = lambda d: sch.prefix.fits_or_evict(lambda: d, sch.running)
        return next((e for e in ends if fits(need(e))), 0)

    def _fits(self, need, evict: bool = False) -> bool:
        """need() fits the free bytes now; with `evict` (alone in the arena: nothing else will
        free memory for it) after evicting from the prefix cache, as any admission."""
        sch = self.sch
        return sch._fits(need) if evict else sch.demand.fits(sch.allocator, need())


__all__ = ["EarlyStart"]
