"""Speculation's share of scheduling: the memory of a speculative decode step and its rollback.

A decode row that speculates `s` tokens computes positions n..n+s in one verify (n =
num_computed: the pending token, then s draft tokens), so it needs the pages of n+s+1 tokens,
priced by the one DemandModel as a pass of s+1 tokens (window sub-pools: w - 1 + s + 1 keys).
`s` never takes the request past its max_tokens (the verify emits at most s+1 tokens), so a
request never holds more tokens than without speculation and the memory clip at arrival still
vouches for it.  After the verify, `settle` keeps what was accepted: num_computed advances by
the accepted count and the pages past the last position still to be written are given back (the
rejected positions' rows).

Overlap (engine.py): the next speculative step may be scheduled while one is in flight.  Its
rows' accepted counts are unknown then, so the host's num_computed and output count are lower
bounds by up to `Request.spec_ahead` (the in-flight step's spec_len): the step is placed for the
worst case (all of them accepted: the pages of n + spec_ahead + s + 1 tokens, and s bounded by
max_tokens as if they were) and the device shifts each row by the accepted count it reads from
the in-flight step's output (runner/shift.py).  A row that could reach max_tokens in the step in
flight sits the next step out (`may_end_in_flight`), so a row is never placed past its memory
clip.

Recurrent state: a request of a target with state holds 1 + k slots (the demand model's
extra_state_slots: priced at arrival and admission like any slot, held to the end), the working
slot and k speculative ones; the verify keeps the state after each verified position in them and
`commit_state` makes the accepted one the working slot (a step launched before the commit does
the same swap on the device).
"""

from __future__ import annotations

from ..core.request import Request
from ..core.scheduled_batch import Row, ScheduledBatch
from ..memory.demand import Demand, DemandModel
from .request_memory import RequestMemory


def spec_len(req: Request, k: int) -> int:
    """Draft tokens `req` may verify this step: at most k, never past max_tokens, none while
    min_tokens bans its stop tokens (the ban is per step, not per verified position), and with
    an MTP head at most the drafts it carries; none once its speculation was switched off."""
    if req.spec_off or req.num_output < req.min_tokens:
        return 0
    s = max(0, min(k, req.max_tokens - req.num_output - req.spec_ahead - 1))  # as if the step in flight kept all
    if req.drafts is None or req.num_pending:  # in flight: its drafts come from that step's output, on the device
        return s
    return min(s, len(req.drafts))


def may_end_in_flight(req: Request) -> bool:
    """The speculative step in flight may take `req` to max_tokens: it sits the next step out
    (placed for the worst case, its next step would pass its memory clip) and is scheduled
    again once that step is read back."""
    return req.spec_ahead > 0 and req.num_output + req.spec_ahead >= req.max_tokens


def spec_rows_needing_memory(rows: list[Request], lens: list[int], page_size: int, slots: int) -> list[int]:
    """Indexes of the rows whose verify needs a new page or state slot."""
    return [i for i, (r, s) in enumerate(zip(rows, lens))
            if len(r.pages) * page_size < _end(r, s) or len(r.slots) < slots]


def _end(req: Request, s: int) -> int:
    """Tokens whose rows a verify of `s` drafts may write: the worst case of the step in flight
    (all its drafts accepted) plus this one's."""
    return req.num_computed + req.spec_ahead + s + 1


def spec_demand(rows: list[Request], lens: list[int], need: list[int], demand: DemandModel) -> Demand:
    return sum((demand.step(rows[i], _end(rows[i], lens[i])) for i in need), Demand())


def alloc_spec(memory: RequestMemory, rows: list[Request], lens: list[int], need: list[int]) -> bool:
    """Take the memory of every verify in `need` -> False (and nothing kept) if one is refused."""
    done = []
    for i in need:
        r = rows[i]
        held = (r, len(r.pages), len(r.slots))
        if not memory.alloc(r, _end(r, lens[i])):
            for q, num_pages, num_slots in done:
                memory.give_back_since(q, num_pages, num_slots)
            return False
        done.append(held)
    return True


def spec_decode_batch(rows: list[Request], lens: list[int]) -> ScheduledBatch:
    """The decode step of `rows` (each its pending token) with their speculation lengths."""
    out = []
    for r in rows:
        out.append(Row(r, r.num_computed, r.num_computed + 1, True))
        r.compute_to(r.num_computed + 1)
    return ScheduledBatch("decode", out, spec_lens=list(lens))


def commit_state(req: Request, accepted: int, spec_len: int) -> None:
    """After a verify of `spec_len` drafts of which `accepted` were kept: make the working slot
    the one holding the state after the accepted tokens.  The verify wrote the state after its
    first j+1 tokens to the request's speculative slot slots[1 + j] (j < spec_len) and the state
    after all spec_len+1 tokens to the working slot slots[0]; so a partial acceptance swaps
    slots[0] with slots[1 + accepted] (virtual ids: nothing moves on the device).  The slot
    swapped out holds a rejected state and is overwritten by the next verify."""
    if req.slots and accepted < spec_len:
        j = 1 + accepted
        req.slots[0], req.slots[j] = req.slots[j], req.slots[0]


def settle(memory: RequestMemory, req: Request, accepted: int, spec_len: int) -> None:
    """After a verify of `req` (scheduled with `spec_len` drafts) kept `accepted` of them: its
    tokens move on by `accepted` (num_computed counted the step's pending token only), and the
    pages past the last position a step still in flight may write are given back."""
    req.spec_ahead -= spec_len
    req.compute_to(req.num_computed + accepted)
    keep = (req.num_computed + req.spec_ahead) // memory.page_size + 1
    if len(req.pages) > keep:
        memory.give_back_since(req, keep, len(req.slots))


__all__ = ["alloc_spec", "may_end_in_flight", "commit_state", "settle", "spec_decode_batch", "spec_demand", "spec_len", "spec_rows_needing_memory"]
