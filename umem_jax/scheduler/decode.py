"""The decode step: one token per running request ([B, 1]) and the memory for that token
(the Scheduler's decode path; speculation.py is its k+1-token counterpart)."""

from __future__ import annotations

from ..core.request import Request
from ..core.scheduled_batch import Row, ScheduledBatch
from ..memory.demand import Demand, DemandModel
from .request_memory import RequestMemory


def rows_needing_memory(rows: list[Request], page_size: int, slots_per_request: int) -> list[Request]:
    """The decode rows whose next token needs a new page or state slot, in order.  For the
    others DemandModel.step prices the token at nothing (no new full page means no window
    page either) and RequestMemory.alloc takes nothing, so pricing and allocating only these
    is the same decision in the same order, without a Python demand per row per step."""
    return [r for r in rows if len(r.pages) * page_size <= r.num_computed or len(r.slots) < slots_per_request]


def next_token_demand(rows: list[Request], demand: DemandModel) -> Demand:
    """What the next token of every row in `rows` adds, summed."""
    return sum((demand.step(r, r.num_computed + 1) for r in rows), Demand())


def alloc_next_tokens(memory: RequestMemory, rows: list[Request]) -> bool:
    """Take the memory of every row's next token -> False (and nothing kept) if the arena
    refuses one of them."""
    done = []
    for r in rows:
        held = (r, len(r.pages), len(r.slots))
        if not memory.alloc(r, r.num_computed + 1):
            for q, num_pages, num_slots in done:
                memory.give_back_since(q, num_pages, num_slots)
            return False
        done.append(held)
    return True


def decode_batch(rows: list[Request]) -> ScheduledBatch:
    """The step computing (and sampling after) the next token of every row."""
    out = []
    for r in rows:
        out.append(Row(r, r.num_computed, r.num_computed + 1, True))
        r.compute_to(r.num_computed + 1)
    return ScheduledBatch("decode", out)


__all__ = ["alloc_next_tokens", "decode_batch", "next_token_demand", "rows_needing_memory"]
