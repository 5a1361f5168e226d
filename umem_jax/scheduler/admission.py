"""Admission: whether a request's next prefill pass fits the arena, and what it leaves free.

A waiting request is admitted when its pass (`DemandModel.step`) plus the decode reservations
of every running request and its own fit (reservations.py), after the prefix cache's evictable
entries and, for a request of higher priority, retractions (retraction.py) made room; else it may
start early, in bytes no running request can need (early_start.py).  A running request's next
chunk needs only its pass: what it reserved at admission is its own.

A fixed-length request whose one pass completes its prompt (`reservations.joins`) is priced with
the fixed-length decoders jointly: it decodes beside them and, shorter, often finishes before
their peak, so its pages pay for their later growth; adding its own peak to theirs counted two
peaks that never fall on the same step (Gemma 3's mixed trace: the memory-bound median live
utilization 0.962 -> 0.970, benchmarks/RESULTS.md session 23).  `SchedulerConfig.joint_admission`
turns it off.
"""

from __future__ import annotations

from ..core.request import Request
from ..memory.demand import Demand
from . import reservations
from .prefill import PrefillBatch
from .radix_node import Hit, resumes
from .retraction import preempt_for

# Returned by `price_pass` for a cache hit that fits only as a miss.
RETRY_AS_MISS = -1


def price_pass(sch, req: Request, batch: PrefillBatch, admitted: bool, hit: Hit | None) -> tuple[int, Demand]:
    """Whether `req`'s next pass in `batch` fits, making room as the rules allow -> (end of the
    pass, its decode reservation once admitted), end 0 if it does not fit, or RETRY_AS_MISS when
    `req` is alone and only the hit's pinned checkpoint slot (which the memory clip does not
    price) is in the way.  `sch` is the Scheduler: its running set, demand model and rules."""
    reservation = Demand()
    chunk = batch.chunk_for(req, sch.demand.chunk)
    if not chunk:
        return 0, reservation
    end = req.num_computed + chunk
    step = sch.demand.step(req, end)
    if admitted:  # an early start waits for free bytes (early_start.py); others make room
        got = sch.early.next_pass(req, step, end) if req is sch.early.req else None
        if got is None:
            got = end if sch._fits(lambda: step) or sch._make_room(lambda: step, req, batch) else 0
        if not got and sch.running == [req]:
            sch._restart_alone(req)
        return got, reservation
    if sch.early.blocks(req):
        sch.memory_bound = True  # it waits for the memory an early start's rest is owed
        return 0, reservation
    reservation = reservations.own(req, end, sch.holders, sch.demand, sch._reserve_tokens(req, end))
    if sch.cfg.joint_admission and not resumes(hit) and reservations.joins(req, end, sch.exact):
        # its own reservation inside the fixed-length decoders' joint peak; not memoised (this candidate's)
        need = lambda: step + reservations.reservations(sch.running, sch.holders, sch.demand, sch._reserve_tokens,
                                                        sch.exact, joining=(req, end)) + batch.admitted_reservations
    else:
        need = lambda: step + reservation + sch._reservations() + batch.admitted_reservations
    fits = sch._fits(need)
    if not fits and not sch.running:
        fits = sch._fits(lambda: step)  # alone in the arena: the clip vouches for it
        if not fits and resumes(hit):
            return RETRY_AS_MISS, reservation
    if not fits:
        fits = preempt_for(need, req, sch.running, batch.request_ids, sch._fits, sch.retract, sch.demand,
                           sch.allocator)
    if not fits:
        end = sch.early.start(req, end)
        sch.memory_bound = sch.memory_bound or not end
    return end, reservation


__all__ = ["RETRY_AS_MISS", "price_pass"]
