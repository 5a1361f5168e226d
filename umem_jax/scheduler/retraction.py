"""Making room: which running requests are retracted when a step's memory does not fit.

Order: lower `priority` value first (vLLM), then earlier arrival; the least preferred is the
reverse.  `fits(need)` is the scheduler's test (the demand fits now, or after evicting
unreferenced prefix-cache entries); `retract(req)` sends a request back to the queue.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.request import Request
from ..memory.chain import ChainAllocator
from ..memory.demand import Demand, DemandModel

Need = Callable[[], Demand]


def least_preferred(requests: list[Request]) -> Request:
    return max(requests, key=lambda r: r.sort_key)


def make_room(need: Need, req: Request, running: list[Request], keep: set[int],
              fits: Callable[[Need], bool], retract: Callable[[Request], None]) -> bool:
    """Retract running requests less preferred than `req` (least preferred first), except
    those whose ids are in `keep` (already in this step), until need() fits."""
    while True:
        if fits(need):
            return True
        victims = [r for r in running if r is not req and r.sort_key > req.sort_key and id(r) not in keep]
        if not victims:
            return False
        retract(least_preferred(victims))


def preempt_for(need: Need, req: Request, running: list[Request], keep: set[int], fits: Callable[[Need], bool],
                retract: Callable[..., None], demand: DemandModel, allocator: ChainAllocator) -> bool:
    """Priority preemption: retract running requests of lower priority than `req` (except
    those whose ids are in `keep`), lowest priority first and, within a priority, those freeing
    the most bytes in the bands `req` needs (in the unified arena every band's bytes serve
    every other band), until need() fits."""
    victims = [r for r in running if r.priority > req.priority and id(r) not in keep]
    if not victims:
        return False
    want = demand.subpools_of(need())
    bands = None if not allocator.static else want
    useful = {id(r): demand.bytes(demand.held(r), bands) for r in victims}
    if not allocator.static:  # cheap refusal: even all victims' bytes plus the free ones fall short
        usage = allocator.usage()
        if sum(useful.values()) + usage.free_bytes + usage.hole_bytes < demand.bytes(need()):
            return False
    victims.sort(key=lambda r: (-r.priority, -useful[id(r)], -r.arrival))
    for v in victims:
        if fits(need):
            return True
        retract(v, preempted=True)
    return fits(need)
