"""Held requests: arena memory that belongs to a page transfer, not to a running request.

Prefill/decode disaggregation (umem_jax/disagg) moves a request's memory between two engines.
While a transfer may still read or write its pages, they must neither run, be retracted, nor be
freed; these functions park a request in `Scheduler.held` for that time:

  hold      (prefill side) a request whose prefill is done leaves `running` keeping its pages and
            slots: its transfer reads them; `release` gives them back (to the prefix cache
            first, so they stay reusable) once the receiver acknowledged the transfer.
  reserve   (decode side) a new request takes the pages and slots of `computed` tokens -- full
            pages for every token, window pages only for the pages its future queries attend,
            its state slot -- before the sender sends; `activate` makes it a running, decode-
            ready request once the bytes are written; `release` frees a cancelled reservation.

Held requests are in no queue (never scheduled, never retracted) but count in the leak and
refcount checks (`Scheduler.held_ids`, `check_refs`).
"""

from __future__ import annotations

import numpy as np

from ..core.request import Request, RequestStatus
from ..memory.demand import Demand


def window_firsts(computed: int, page_size: int, windows) -> dict[str, int]:
    """First page index each window's future queries attend once `computed` tokens are in the
    arena (the bound RequestMemory.release_passed_windows keeps): {window name: page index}."""
    return {name: max(0, computed - w + 1) // page_size for name, w in windows}


def hold(sched, req: Request) -> None:
    """Park a running request, memory and all (its pass is done: nothing launched writes it)."""
    if req.status != RequestStatus.RUNNING:
        raise ValueError(f"only a running request can be held, {req.request_id} is {req.status.value}")
    sched.running.remove(req)
    sched.held[req.request_id] = req
    sched._reserved = None


def reserve(sched, req: Request, computed: int) -> bool:
    """Give the new request `req` the memory of `computed` tokens and hold it -> False (nothing
    taken) if that memory and the decode reservations of the running requests do not fit."""
    d, page_size = sched.demand, sched.demand.page_size
    num_pages = -(-computed // page_size)
    firsts = window_firsts(computed, page_size, d.windows)
    need = Demand(num_pages, {n: num_pages - f for n, f in firsts.items()}, d.slots_per_request)
    if not sched._fits(lambda: need + sched._reservations()):
        return False
    alloc = sched.allocator
    vids = alloc.alloc_token_pages(num_pages, need.window_pages) if num_pages else np.empty(0, np.int32)
    if vids is None:
        return False
    slots = alloc.alloc_state_slots(need.state_slots) if need.state_slots else np.empty(0, np.int32)
    if slots is None:
        alloc.free_token_pages(vids)
        return False
    owner = sched.memory.owner
    owner.take(vids)
    for name, first in firsts.items():
        owner.take_window(vids[first:], name)
    req.hold(vids.tolist(), slots.tolist())
    for name, first in firsts.items():
        req.pass_window(name, first)
    sched.held[req.request_id] = req
    return True


def activate(sched, req: Request, computed: int) -> None:
    """A reserved request whose first `computed` tokens are now in its pages starts running."""
    del sched.held[req.request_id]
    sched.running.append(req)
    req.mark_running(0)
    req.compute_to(computed)
    sched._reserved = None


def release(sched, req: Request) -> None:
    """Give back a held request's memory (the prefix cache keeps what it computed, if caching)."""
    del sched.held[req.request_id]
    sched._free_memory(req)
    sched._reserved = None
