"""Scheduler: continuous batching over one arena -- who runs next, with what memory.

Every step is either a prefill step (chunks of prompts, [B, T] padded to buckets, T > 1:
prefill.py) or a decode step (one token per request, [B, 1]: decode.py).  Prefill goes first,
but at most `max_prefill_streak` prefill steps in a row while requests wait to decode, so a
flood of long prompts cannot stall generation.

Memory, all priced by the one DemandModel (memory/demand.py), held through RequestMemory:
  * admission: a waiting request is admitted if its pass plus the decode reservations of every
    running request and its own (`new_token_ratio` x tokens left; exact for fixed-length
    requests: reservations.py) fits the arena now (admission.py); passes of a batch are allocated
    as they are admitted, so two admissions never spend the same bytes.
  * decode: the summed one-token demand must fit; if not (after the allocator's own
    flush/compaction), the least preferred running request is retracted, and so on.
  * priority: a waiting request that does not fit retracts running requests of lower priority,
    those freeing the most bytes in the bands it needs first (retraction.py).
  * early start (`early_admission`, on by default, early_start.py): a long prompt whose whole
    need does not fit yet starts its prefill in bytes no running request can need, one at a time.
A retracted request goes back to the queue keeping its output tokens; its next prefill
recomputes prompt + output (from the prefix cache when it can).  Nothing admitted is ever
aborted for memory (see memory/demand.py).

Prefix cache (prefix_cache.py, when enabled, driven by PrefixSharing): a waiting request resumes
from the deepest resumable cached prefix (its pages shared, the state checkpoint copied into its
working slot); running requests hand their computed pages and planned checkpoints to the cache
at the start of the next schedule (by then the step writing them is launched, so anything that
reads them runs after it).  Under pressure the cache's unreferenced entries are evicted (LRU)
BEFORE any running request is retracted.  Checkpoint slots are optional: taken only when the
demand model says they fit on top of what running requests are owed, else skipped.

Order: lower `priority` value first (vLLM), then earlier arrival.  Least preferred = the reverse.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from ..core.request import Request, RequestStatus
from ..core.scheduled_batch import Buckets, Row, ScheduledBatch
from ..memory.chain import ChainAllocator
from ..memory.demand import Demand, DemandModel
from . import admission, decode, held, reservations, speculation
from .early_start import EarlyStart
from .prefill import PrefillBatch, prefill_candidates
from .prefix_cache import PrefixCache
from .prefix_sharing import PrefixSharing
from .radix_node import Hit
from .request_memory import RequestMemory
from .retraction import make_room


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    buckets: Buckets
    new_token_ratio: float = 0.5  # decode reservation per running request: ratio x tokens it has left
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002  # per decode step; reset to new_token_ratio on retraction
    max_prefill_streak: int = 4
    min_chunk: int = 8  # do not split a prompt into a chunk shorter than this behind other rows
    enable_prefix_caching: bool = False
    max_checkpoints_per_path: int | None = 4  # state checkpoints kept on one cached path (None: no cap)
    checkpoint_interval: int = 0  # decode tokens between state checkpoints (0: only at prefill passes)
    num_speculative_tokens: int = 0  # draft tokens a decode row verifies per step (0: no speculation)
    # fixed-length requests (ignore_eos, no stop) reserve exactly what they will take instead of the
    # ratio, where valid (reservations.exact_applies); off: the ratio rule for every request
    exact_fixed_length_reservation: bool = True
    cache_lookahead: int = 0  # tokens past a cached page its bytes depend on (1: an MTP head; radix_node.py)
    early_admission: bool = True  # a prompt may start in the unreserved gap before its whole need fits (EngineConfig)
    # a fixed-length request whose one pass completes its prompt is admitted against the joint
    # peak of the fixed-length decoders and itself (reservations.joins), not its own peak added
    # to theirs; off: the sum (the rule before)
    joint_admission: bool = True


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: ChainAllocator, demand: DemandModel):
        self.cfg = config
        self.allocator = allocator
        self.demand = demand
        self.memory = RequestMemory(allocator, demand)
        self.owner = self.memory.owner
        self.cache: PrefixCache | None = None
        self.prefix: PrefixSharing | None = None
        if config.enable_prefix_caching:
            self.cache = PrefixCache(self.owner, demand.page_size, demand.windows, demand.plan.state is not None,
                                     max_checkpoints_per_path=config.max_checkpoints_per_path,
                                     lookahead=config.cache_lookahead)
            self.prefix = PrefixSharing(self.cache, self.memory, demand, config.checkpoint_interval)
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.ending: list[Request] = []  # memory given back, last token not read back yet (release_ending)
        self.held: dict[str, Request] = {}  # memory a page transfer owns: never scheduled (held.py)
        self.ratio = config.new_token_ratio
        self.exact = reservations.exact_applies(config)
        self._prefill_streak = 0
        self._reserved = None  # memo of _reservations(): (num_retractions, Demand)
        self.early = EarlyStart(self)  # the request admitted before its whole need fit (early_start.py)
        self.num_retractions = 0
        self.num_preemptions = 0
        self.num_restarts = 0  # lone requests restarted from an empty cache (`_restart_alone`)
        self._restarted = False
        self.failed: list[tuple[Request, Exception]] = []  # admissions that raised: see _add_pass
        # the last prefill attempt left a waiting request out for memory (not for the step's token
        # budget or the sequence cap): what "memory binds" means in utilization figures
        self.memory_bound = False

    @property
    def num_checkpoints(self) -> int:
        """State checkpoints taken (prefill and decode)."""
        return self.prefix.num_checkpoints if self.prefix is not None else 0

    @property
    def num_checkpoints_skipped(self) -> int:
        """State checkpoints skipped: no slot fit (a checkpoint never stalls a request)."""
        return self.prefix.num_checkpoints_skipped if self.prefix is not None else 0

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        req.mark_waiting()
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End `req` (finished or aborted): give back all its memory, drop it from the queues."""
        self.early.end(req)
        if any(r is req for r in self.ending):  # its memory went at release_ending
            self.ending.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self._free_memory(req)
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif self.held.get(req.request_id) is req:  # a reserved or held transfer's memory
            held.release(self, req)
        req.leave_queues(status)

    def fail(self, req: Request) -> None:
        """Drop `req` after work of its raised: out of the queues, its memory given back, and
        nothing of it handed to the prefix cache (a failed pass may claim tokens never written)."""
        if req.finished:
            return
        self.early.end(req)
        released = any(r is req for r in self.ending)
        for queue in (self.running, self.waiting, self.ending):
            if any(r is req for r in queue):
                queue.remove(req)
        if not released:
            self.memory.free(req)
        req.leave_queues(RequestStatus.FINISHED_ABORTED)
        self._reserved = None

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """The requests whose admission or pass raised since the last call, with the error."""
        failed, self.failed = self.failed, []
        return failed

    def retract(self, req: Request, *, preempted: bool = False) -> None:
        """Send a running request back to the queue: free its memory, keep its tokens."""
        self.early.end(req)
        self._free_memory(req)
        self.running.remove(req)
        req.restart(preempted=preempted)
        self.num_retractions += 1
        if preempted:
            self.num_preemptions += 1
        self.ratio = self.cfg.new_token_ratio
        self.add(req)

    def release_ending(self, keep=None) -> None:
        """Give back now the memory of the running requests whose last token the step in flight
        samples (max_tokens reached with it: nothing else can follow), so the next step is
        scheduled into their pages, not the one after it (async scheduling reads a step back
        after launching the next).  Safe: each step takes the arena the one before returns
        (donated through jit), so the step in flight has read their pages before any later step
        writes them, and their computed tokens are all known (the prefix cache takes them now).
        Each stays in `ending` until the engine reads its last token and finishes it.  Not under
        speculation (how many tokens a verify keeps is known only once read back), nor for
        `keep(req)` (a prefill held for its page transfer)."""
        if self.cfg.num_speculative_tokens:
            return
        for r in [r for r in self.running if r.num_pending and not r.wants_step and not (keep and keep(r))]:
            self.early.end(r)
            self._free_memory(r)
            self.running.remove(r)
            self.ending.append(r)
        self._reserved = None

    def _admit(self, req: Request, hit: Hit | None) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        req.mark_running(hit.resume if hit is not None else 0)
        if hit is not None:
            self.prefix.restore(req, hit)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step and allocate its memory (page tables are read after this)."""
        batch = self._schedule()
        if batch is None and self._restarted:  # a lone request went back to an empty cache: admit it now
            batch = self._schedule()
        self._restarted = False
        return batch

    def _schedule(self) -> ScheduledBatch | None:
        if self.prefix is not None:
            self._reserved = None  # the running set changed since the last schedule
            self.prefix.hand_off_running(self.running, self.early.owed)
        self.memory.release_passed_windows(self.running)
        self.memory_bound = self.memory_bound and bool(self.waiting)
        decoders = self._decoders()
        has_prefill = any(not r.decode_ready for r in self.running) or any(not r.num_pending for r in self.waiting)
        if has_prefill and (not decoders or self._prefill_streak < self.cfg.max_prefill_streak):
            batch = self._schedule_prefill()
            if batch is not None:
                self._prefill_streak += 1
                return batch
            decoders = self._decoders()  # the prefill attempt may have retracted requests
        self._prefill_streak = 0
        return decode.schedule_decode(self, decoders) if decoders else None

    def _decoders(self) -> list[Request]:
        return [r for r in self.running if r.decode_ready and r.wants_step
                and not (r.spec_ahead and speculation.may_end_in_flight(r))]

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> ScheduledBatch | None:
        self._reserved = None
        self.memory_bound = False  # price_pass sets it
        batch = PrefillBatch(self.cfg.buckets, self.cfg.max_num_batched_tokens, self.cfg.min_chunk)
        for req in prefill_candidates(self.running, self.waiting):
            if req.finished or batch.full:
                continue
            if req.status != RequestStatus.RUNNING and len(self.running) >= self.cfg.max_num_seqs:
                break
            if not self._add_pass(req, batch) or batch.tokens_left <= 0:
                break
        return batch.scheduled()

    def _add_pass(self, req: Request, batch: PrefillBatch) -> bool:
        """Give `req` its next pass in `batch` (admitting it if it waits) -> False when its memory
        does not fit even after making room, which ends the batch.  If this raises for `req`, the
        request is dropped (`fail`, reported in `failed`) and the batch goes on without it."""
        admitted = req.status == RequestStatus.RUNNING
        hit = None
        try:
            hit = self.prefix.take_hit(req) if not admitted and self.prefix is not None else None
            end, reservation = admission.price_pass(self, req, batch, admitted, hit)
            if end == admission.RETRY_AS_MISS:  # the clip vouches for the request as a miss, not for the hit's pin
                self.prefix.drop_hit(req, hit)
                hit = None
                end, reservation = admission.price_pass(self, req, batch, admitted, hit)
            if not end or not self.memory.alloc(req, end):
                if self.prefix is not None:
                    self.prefix.drop_hit(req, hit)
                return False
            if end == req.num_tokens:
                self.early.end(req)  # its last chunk was priced with its decode reservation: owed as any other's
            if not admitted:
                self._admit(req, hit)
                hit = None  # restored: what the hit pinned is the request's now
                batch.admitted_reservations = batch.admitted_reservations + reservation
            start = req.num_computed
            checkpoints = ()
            if self.prefix is not None:
                owed = lambda: self.early.owed() + batch.admitted_reservations
                checkpoints = self.prefix.plan_checkpoints(req, start, end, owed)
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the step for all
            if hit is not None:
                self.prefix.drop_hit(req, hit)  # unpin what the lookup pinned
            self.fail(req)
            self.failed.append((req, e))
            return True
        batch.add(Row(req, start, end, end == req.num_tokens, checkpoints))
        req.compute_to(end)
        return True

    # ------------------------------------------------------------------ decode
    def settle_speculation(self, req: Request, accepted: int, spec_len: int) -> None:
        """A verify of `req` scheduled with `spec_len` drafts kept `accepted`: the rest of its rows
        go back (speculation.py)."""
        speculation.settle(self.memory, req, accepted, spec_len)

    # ------------------------------------------------------------------ pressure
    def _fits(self, need) -> bool:
        """need() fits the arena now (or, with the prefix cache, after evicting from it)."""
        if self.prefix is not None:
            return self.prefix.fits_or_evict(need, self.running)
        return self.demand.fits(self.allocator, need())

    def _restart_alone(self, req: Request) -> None:
        """The last rung of the shortfall ladder: `req` runs alone and its memory still does not
        fit after eviction, so what stands in its way is cache it pinned itself (a hit, copies
        of its own pages).  Retract it, empty the cache and let it resume without a hit: the
        memory clip vouches for it in an empty arena, so no admitted request waits on itself.
        Never reached while pricing holds (num_restarts counts it; the soak expects 0)."""
        self.retract(req)
        if self.cache is not None:
            self.cache.clear()
        self.num_restarts += 1
        self._restarted = True

    def _make_room(self, need, req: Request, batch: PrefillBatch) -> bool:
        return make_room(need, req, self.running, batch.request_ids, self._fits, self.retract)

    def _reserve_tokens(self, req: Request, after: int | None = None) -> int:
        """Tokens to keep free for `req` beyond `after` (default: what it has computed)."""
        return reservations.reserve_tokens(req, self.ratio, self.exact, after)

    holders = property(lambda self: self.running + list(self.held.values()))  # every request holding memory

    def _reservations(self) -> Demand:
        """Reservations of every running request: the rest of a chunked prompt and the decode
        reservation (what admission must leave free); memoised within one schedule until a
        retraction changes the running set (the requests a prefill step admits meanwhile are
        not decoding yet: their share is the batch's `admitted_reservations`)."""
        key = self.num_retractions
        if self._reserved is not None and self._reserved[0] == key:
            return self._reserved[1]
        total = reservations.reservations(self.running, self.holders, self.demand, self._reserve_tokens, self.exact)
        self._reserved = (key, total)
        return total

    def _free_memory(self, req: Request) -> None:
        if self.prefix is not None:
            self.prefix.hand_off(req, last=True)  # what it computed stays reusable
        self.memory.free(req)

    # ------------------------------------------------------------------ checks
    def held_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(token page ids, state slot ids) the requests and the prefix cache hold: for the
        allocator's leak check."""
        return self.memory.held_ids(self.running + self.waiting + list(self.held.values()), self.cache)

    def check_refs(self) -> list[str]:
        """Page and window refcounts against what every holder says it holds -> problems."""
        return self.memory.check_refs(self.running + self.waiting + list(self.held.values()), self.cache)


__all__ = ["Scheduler", "SchedulerConfig"]
