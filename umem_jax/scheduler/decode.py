"""The decode step: one token per running request ([B, 1]) and the memory for that token
(the Scheduler's decode path; speculation.py is its k+1-token counterpart).  Under pressure the
least preferred running request is retracted until the rows' memory fits (retraction.py)."""

from __future__ import annotations

from ..core.request import Request
from ..core.scheduled_batch import Row, ScheduledBatch
from ..memory.demand import Demand, DemandModel
from . import speculation
from .request_memory import RequestMemory
from .retraction import least_preferred


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


def schedule_decode(sch, rows: list[Request]) -> ScheduledBatch | None:
    """The decode step of `rows` (the Scheduler `sch`'s decoders), their next tokens' memory
    allocated, retracting as needed -> None if no row is left."""
    rows = rows[: sch.cfg.buckets.batch[-1]]
    if sch.cfg.num_speculative_tokens and not all(r.spec_off and not r.spec_ahead for r in rows):
        return _schedule_spec_decode(sch, rows)  # else: every row stopped speculating (and is exact), a plain step

    def place(rows):
        need = rows_needing_memory(rows, sch.demand.page_size, sch.demand.slots_per_request)
        total = next_token_demand(need, sch.demand)  # every other row's one-token demand is empty
        return sch._fits(lambda: total) and alloc_next_tokens(sch.memory, need)

    if not retract_until(sch, rows, place):
        return None
    batch = decode_batch(rows)
    sch.ratio = max(sch.cfg.min_new_token_ratio, sch.ratio - sch.cfg.new_token_ratio_decay)
    return batch


def _schedule_spec_decode(sch, rows: list[Request]) -> ScheduledBatch | None:
    """As schedule_decode, each row with the memory of its verify (speculation.py)."""
    k, d = sch.cfg.num_speculative_tokens, sch.demand
    lens: list[int] = []

    def place(rows):
        lens[:] = [speculation.spec_len(r, k) for r in rows]  # the lengths the memory was placed for
        need = speculation.spec_rows_needing_memory(rows, lens, d.page_size, d.slots_per_request)
        total = speculation.spec_demand(rows, lens, need, d)
        return sch._fits(lambda: total) and speculation.alloc_spec(sch.memory, rows, lens, need)

    if not retract_until(sch, rows, place):
        return None
    sch.ratio = max(sch.cfg.min_new_token_ratio, sch.ratio - sch.cfg.new_token_ratio_decay)
    return speculation.spec_decode_batch(rows, lens)


def retract_until(sch, rows: list[Request], place) -> bool:
    """Retract `sch`'s least preferred running request until `place(rows)` (price and allocate
    the rows' memory) succeeds; a retracted row leaves `rows` (changed in place).  False: no
    row is left."""
    while rows:
        if place(rows):
            return True
        victim = least_preferred(sch.running)
        if sch.running == [victim]:
            sch._restart_alone(victim)
        else:
            sch.retract(victim)
        if victim in rows:
            rows.remove(victim)
    return False


__all__ = ["alloc_next_tokens", "decode_batch", "next_token_demand", "retract_until", "rows_needing_memory",
           "schedule_decode"]
