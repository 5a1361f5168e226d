"""Speculation's share of scheduling: the memory of a speculative decode step and its rollback.

A decode row that speculates `s` tokens computes positions n..n+s in one verify (n =
num_computed: the pending token, then s draft tokens), so it needs the pages of n+s+1 tokens,
priced by the one DemandModel as a pass of s+1 tokens (window sub-pools: w - 1 + s + 1 keys).
`s` never takes the request past its max_tokens (the verify emits at most s+1 tokens), so a
request never holds more tokens than without speculation and the memory clip at arrival still
vouches for it.  After the verify, `rollback` keeps what was accepted: num_computed = n + a + 1
and the pages past the pending token's are given back (the rejected positions' rows).

Recurrent state: a request of a target with state holds 1 + k slots (the demand model's
extra_state_slots: priced at arrival and admission like any slot, held to the end), the working
slot and k speculative ones; the verify keeps the state after each verified position in them and
`commit_state` makes the accepted one the working slot.
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
    s = max(0, min(k, req.max_tokens - req.num_output - 1))
    return s if req.drafts is None else min(s, len(req.drafts))


def spec_rows_needing_memory(rows: list[Request], lens: list[int], page_size: int, slots: int) -> list[int]:
    """Indexes of the rows whose verify needs a new page or state slot."""
    return [i for i, (r, s) in enumerate(zip(rows, lens))
            if len(r.pages) * page_size < r.num_computed + s + 1 or len(r.slots) < slots]


def spec_demand(rows: list[Request], lens: list[int], need: list[int], demand: DemandModel) -> Demand:
    return sum((demand.step(rows[i], rows[i].num_computed + lens[i] + 1) for i in need), Demand())


def alloc_spec(memory: RequestMemory, rows: list[Request], lens: list[int], need: list[int]) -> bool:
    """Take the memory of every verify in `need` -> False (and nothing kept) if one is refused."""
    done = []
    for i in need:
        r = rows[i]
        held = (r, len(r.pages), len(r.slots))
        if not memory.alloc(r, r.num_computed + lens[i] + 1):
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


def rollback(memory: RequestMemory, req: Request, computed: int) -> None:
    """After a verify: `computed` tokens of `req` hold accepted K/V; give back the pages past
    the one its pending token (position `computed`) goes to."""
    req.compute_to(computed)
    keep = computed // memory.page_size + 1
    if len(req.pages) > keep:
        memory.give_back_since(req, keep, len(req.slots))


__all__ = ["alloc_spec", "commit_state", "rollback", "spec_decode_batch", "spec_demand", "spec_len", "spec_rows_needing_memory"]
