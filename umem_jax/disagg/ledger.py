"""The decode side's transfers: one entry per transfer id, with the generation that may write it.

A transfer is RESERVED (its pages taken, waiting for the sender's bytes), then INSTALLED (bytes
written, decoding), or CANCELLED (the sender or the router gave up) or EXPIRED (no bytes before
its deadline).  Only a reserved transfer of the same generation may be written; anything else is
a late or stale write and is DROPPED, never touching the arena.  Generations are
"<epoch>-<n>": the epoch is new at every start of the worker, so writes meant for a previous
incarnation (a restart) are dropped too.  Every change happens on the engine thread (the
worker calls these from AsyncLLMEngine.call), so a check and the write it allows, or a cancel
and the free it allows, cannot interleave: once a transfer is fenced (cancelled / expired) its
pages are freed in the same engine-thread call, and no later write can reach them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import uuid

RESERVED, INSTALLED, CANCELLED, EXPIRED = "reserved", "installed", "cancelled", "expired"
KEEP = 4096  # ended transfers remembered (so their late writes are recognised and counted)


@dataclasses.dataclass
class Transfer:
    transfer_id: str
    generation: str
    deadline: float  # time.monotonic() by which the bytes must be installed
    state: str = RESERVED


class Ledger:
    def __init__(self, epoch: str | None = None):
        self.epoch = epoch or uuid.uuid4().hex[:8]
        self._n = itertools.count(1)
        self.transfers: collections.OrderedDict[str, Transfer] = collections.OrderedDict()
        self.counts = collections.Counter()
        self.num_live = 0  # reserved transfers: an int, so other threads may read it

    def new(self, transfer_id: str, timeout_s: float) -> Transfer:
        """A reservation (its pages already taken) of a new generation."""
        old = self.transfers.get(transfer_id)
        if old is not None and old.state in (RESERVED, INSTALLED):
            raise ValueError(f"transfer {transfer_id!r} is already {old.state}")
        t = Transfer(transfer_id, f"{self.epoch}-{next(self._n)}", time.monotonic() + timeout_s)
        self.transfers[transfer_id] = t
        self.transfers.move_to_end(transfer_id)
        while len(self.transfers) > KEEP and next(iter(self.transfers.values())).state not in (RESERVED, INSTALLED):
            self.transfers.popitem(last=False)
        self.counts["reserved"] += 1
        self.num_live += 1
        return t

    def writable(self, transfer_id: str, generation: str) -> Transfer | str:
        """The reserved transfer this write may fill, or why it is dropped."""
        t = self.transfers.get(transfer_id)
        if not generation.startswith(self.epoch + "-"):
            why = f"stale generation {generation} (this worker's epoch is {self.epoch})"
        elif t is None:
            why = f"no transfer {transfer_id} here"
        elif t.generation != generation:
            why = f"generation {generation} was replaced by {t.generation}"
        elif t.state != RESERVED:
            why = f"transfer {transfer_id} is {t.state}"
        else:
            return t
        self.counts["dropped_writes"] += 1
        return why

    def end(self, t: Transfer, state: str) -> None:
        self.num_live -= t.state == RESERVED
        t.state = state
        self.counts[state] += 1

    def due(self, now: float | None = None) -> list[Transfer]:
        """Reserved transfers past their deadline."""
        now = time.monotonic() if now is None else now
        return [t for t in self.transfers.values() if t.state == RESERVED and t.deadline <= now]

    def live(self) -> int:
        """Reserved transfers (safe from any thread)."""
        return self.num_live
