"""Scheduler: continuous batching over one arena -- who runs next, with what memory.

Every step is either a prefill step (chunks of prompts, [B, T] padded to buckets, T > 1) or a
decode step (one token per request, [B, 1]).  Prefill goes first, but at most
`max_prefill_streak` prefill steps in a row while requests wait to decode, so a flood of long
prompts cannot stall generation.

Memory, all priced by the one DemandModel (demand.py):
  * admission: a waiting request is admitted if its pass plus the decode reservations of every
    running request and its own (`new_token_ratio` x tokens left) fits the arena now; passes of
    a batch are allocated as they are admitted, so two admissions never spend the same bytes.
  * decode: the summed one-token demand must fit; if not (after the allocator's own
    flush/compaction), the least preferred running request is retracted, and so on.
  * priority: a waiting request that does not fit retracts running requests of lower priority,
    those freeing the most bytes in the bands it needs first.
A retracted request goes back to the queue keeping its output tokens; its next prefill
recomputes prompt + output (from the prefix cache when it can).  Nothing admitted is ever
aborted for memory (see demand.py).

Prefix cache (prefix_cache.py, when enabled): a waiting request resumes from the deepest
resumable cached prefix (its pages shared, the state checkpoint copied into its working slot);
running requests hand their computed pages and planned checkpoints to the cache at the start of
the next schedule (by then the step writing them is launched, so anything that reads them runs
after it).  Under pressure the cache's unreferenced entries are evicted (LRU) BEFORE any
running request is retracted.  Checkpoint slots are optional: taken only when the demand model
says they fit on top of what running requests are owed, else skipped.

Order: lower `priority` value first (vLLM), then earlier arrival.  Least preferred = the reverse.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time

import numpy as np

from ..core.request import Request, RequestStatus
from ..core.scheduled_batch import Buckets, Row, ScheduledBatch
from ..memory.chain import ChainAllocator
from ..memory.demand import Demand, DemandModel
from ..memory.page_owner import PageOwner
from .prefix_cache import PrefixCache
from .prefix_sharing import PrefixSharing


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



# ------------------------------------------------------------------------------ scheduler


class Scheduler(PrefixSharing):
    def __init__(self, config: SchedulerConfig, allocator: ChainAllocator, demand: DemandModel):
        self.cfg = config
        self.allocator = allocator
        self.demand = demand
        self.ps = demand.ps
        self.windows = demand.windows
        self.chunk = demand.chunk
        self.owner = PageOwner(allocator, allocator.bands[-1].table.num_virtual + 1)
        self.window_names = tuple(n for n, _ in self.windows)
        self.has_state = demand.plan.state is not None
        self.cache = None
        if config.enable_prefix_caching:
            self.cache = PrefixCache(self.owner, self.ps, self.windows, self.has_state,
                                     max_checkpoints_per_path=config.max_checkpoints_per_path)
        # decode checkpoints land on page boundaries: the interval rounded up to whole pages
        iv = int(config.checkpoint_interval)
        self.checkpoint_stride = -(-iv // self.ps) * self.ps if iv > 0 and self.has_state else 0
        self.num_checkpoints = 0  # state checkpoints taken (prefill and decode)
        self.num_checkpoints_skipped = 0  # ... and skipped: no slot fit (never stalls a request)
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.ratio = config.new_token_ratio
        self._prefill_streak = 0
        self._reserved = None  # memo of _reservations() for one schedule() call
        self.num_retractions = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End `req` (finished or aborted): give back all its memory, drop it from the queues."""
        if req.status == RequestStatus.RUNNING:
            self._free_memory(req)
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = status

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step and allocate its memory (page tables are read after this)."""
        if self.cache is not None:
            self._cache_running()
        self._release_windows()
        decoders = self._decoders()
        has_prefill = any(not r.decode_ready for r in self.running) or any(not r.num_pending for r in self.waiting)
        if has_prefill and (not decoders or self._prefill_streak < self.cfg.max_prefill_streak):
            batch = self._schedule_prefill()
            if batch is not None:
                self._prefill_streak += 1
                return batch
            decoders = self._decoders()  # the prefill attempt may have retracted requests
        self._prefill_streak = 0
        return self._schedule_decode(decoders) if decoders else None

    def _decoders(self) -> list[Request]:
        return [r for r in self.running if r.decode_ready and r.wants_step]

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> ScheduledBatch | None:
        cfg, B = self.cfg, self.cfg.buckets
        self._reserved = None
        rows: list[Row] = []
        budget = cfg.max_num_batched_tokens
        longest = 0
        admitted_fut = Demand()  # reservations of the requests admitted in this step
        cands = sorted((r for r in self.running if not r.decode_ready), key=lambda r: r.sort_key)
        cands += [r for r in self.waiting if not r.num_pending]
        for req in cands:
            if req.finished or len(rows) >= B.batch[-1]:
                continue
            admitted = req.status == RequestStatus.RUNNING
            if not admitted and len(self.running) >= cfg.max_num_seqs:
                break
            hit = self._apply_hit(req) if not admitted and self.cache is not None else None
            for _ in range(2):  # a second time only as a miss (below)
                c = self._fit_shape(len(rows) + 1, longest, min(req.to_compute, budget, self.chunk))
                if c <= 0 or (c < req.to_compute and c < cfg.min_chunk and rows):
                    ok = False
                    break
                end = req.num_computed + c
                d = self.demand.step(req, end)
                if admitted:
                    ok = self._fits_or_evict(lambda: d) or self._make_room(lambda: d, req, rows)
                    break
                fut = self.demand.reservation(req, self._reserve_tokens(req, after=end), after=end)
                need = lambda: d + fut + self._reservations() + admitted_fut
                ok = self._fits_or_evict(need)
                if not ok and not self.running:
                    ok = self._fits_or_evict(lambda: d)  # alone in the arena: the clip vouches for it
                    if not ok and hit is not None and hit.resume:
                        # ...as a miss: the hit's pinned checkpoint slot is beyond what the clip priced
                        self._drop_hit(req, hit)
                        hit = None
                        continue
                if not ok:
                    ok = self._preempt_for(req, need, rows)
                break
            if not ok or not self._alloc(req, end):
                self._drop_hit(req, hit)
                break
            if not admitted:
                self.waiting.remove(req)
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = time.time()
                    req.num_cached_tokens = hit.resume if hit is not None else 0
                if hit is not None:
                    self._restore(req, hit)
                admitted_fut = admitted_fut + fut
            ckpts = self._plan_checkpoints(req, req.num_computed, end, admitted_fut)
            rows.append(Row(req, req.num_computed, end, end == req.num_tokens, ckpts))
            req.num_computed = end
            budget -= c
            longest = max(longest, c)
            if budget <= 0:
                break
        return ScheduledBatch("prefill", rows) if rows else None

    def _fit_shape(self, n: int, longest: int, c: int) -> int:
        """Shrink chunk c so the padded prefill [B(n), T(max(longest, c))] stays within the token
        budget (a lone row may always take the largest T bucket)."""
        B = self.cfg.buckets
        # a lone row may take the largest T bucket, so no shape padded to at most that is worse
        limit = max(self.cfg.max_num_batched_tokens, B.batch[0] * B.tokens[-1])
        b = Buckets.pick(B.batch, n)
        c = min(c, B.tokens[-1])
        if c <= 0 or b * Buckets.pick(B.tokens, max(longest, c)) <= limit or n == 1:
            return c
        fits = [t for t in B.tokens if t >= longest and b * t <= limit]
        return min(c, fits[-1]) if fits else 0

    # ------------------------------------------------------------------ decode
    def _schedule_decode(self, rows: list[Request]) -> ScheduledBatch | None:
        rows = rows[: self.cfg.buckets.batch[-1]]
        while rows:
            need = self._needing_memory(rows)  # every other row's one-token demand is empty
            total = sum((self.demand.step(r, r.num_computed + 1) for r in need), Demand())
            if self._fits_or_evict(lambda: total) and self._alloc_all(need):
                break
            victim = max(self.running, key=lambda r: r.sort_key)
            self.retract(victim)
            if victim in rows:
                rows.remove(victim)
        if not rows:
            return None
        out = []
        for r in rows:
            out.append(Row(r, r.num_computed, r.num_computed + 1, True))
            r.num_computed += 1
        self.ratio = max(self.cfg.min_new_token_ratio, self.ratio - self.cfg.new_token_ratio_decay)
        return ScheduledBatch("decode", out)

    def _needing_memory(self, rows: list[Request]) -> list[Request]:
        """The decode rows whose next token needs a new page or state slot, in order.  For the
        others DemandModel.step prices the token at nothing (no new full page means no window
        page either) and _alloc takes nothing, so pricing and allocating only these is the same
        decision in the same order, without a Python demand per row per step."""
        ps, slots = self.ps, self.demand.slots_per_request
        return [r for r in rows if len(r.pages) * ps <= r.num_computed or len(r.slots) < slots]

    # ------------------------------------------------------------------ pressure
    def _reserve_tokens(self, req: Request, after: int | None = None) -> int:
        """Tokens to keep free for `req` beyond `after` (default: what it has computed): the rest
        of its prompt, all of it (a chunked prompt needs every page before its first output; left
        out, later admissions take those pages and the prompt's next chunk retracts them), plus
        the decaying ratio of the outputs it may still produce."""
        a = req.num_computed if after is None else after
        rest = 0 if req.decode_ready and after is None else max(0, req.num_tokens - a)
        return rest + math.ceil(self.ratio * max(0, req.max_tokens - req.num_output))

    def _reservations(self) -> Demand:
        """Reservations of every running request: the rest of a chunked prompt and the decode
        reservation (what admission must leave free);
        memoised within one prefill schedule until a retraction changes the running set (the
        requests admitted meanwhile are not decoding yet: their share is `admitted_fut`)."""
        key = self.num_retractions
        if self._reserved is not None and self._reserved[0] == key:
            return self._reserved[1]
        total = Demand()
        for r in self.running:  # decoding, or admitted with part of its prompt still to compute
            if r.wants_step or not r.decode_ready:
                total = total + self.demand.reservation(r, self._reserve_tokens(r))
        self._reserved = (key, total)
        return total

    def _make_room(self, need, req: Request, rows: list[Row]) -> bool:
        """Retract running requests less preferred than `req` (least preferred first), except
        those already in this step's `rows`, until need() fits."""
        keep = {id(r.req) for r in rows}
        while True:
            if self._fits_or_evict(need):
                return True
            victims = [r for r in self.running if r is not req and r.sort_key > req.sort_key and id(r) not in keep]
            if not victims:
                return False
            self.retract(max(victims, key=lambda r: r.sort_key))

    def _preempt_for(self, req: Request, need, rows: list[Row]) -> bool:
        """Priority preemption: retract running requests of lower priority than `req`, lowest
        priority first and, within a priority, those freeing the most bytes in the bands `req`
        needs (in the unified arena every band's bytes serve every other band)."""
        keep = {id(r.req) for r in rows}
        victims = [r for r in self.running if r.priority > req.priority and id(r) not in keep]
        if not victims:
            return False
        want = self.demand.subpools_of(need())
        bands = None if not self.allocator.static else want
        useful = {id(r): self.demand.bytes(self.demand.held(r), bands) for r in victims}
        if not self.allocator.static:  # cheap refusal: even all victims' bytes plus the free ones fall short
            u = self.allocator.usage()
            if sum(useful.values()) + u.free_bytes + u.hole_bytes < self.demand.bytes(need()):
                return False
        victims.sort(key=lambda r: (-r.priority, -useful[id(r)], -r.arrival))
        for v in victims:
            if self._fits_or_evict(need):
                return True
            self.retract(v, preempted=True)
        return self._fits_or_evict(need)

    def retract(self, req: Request, *, preempted: bool = False) -> None:
        """Send a running request back to the queue: free its memory, keep its tokens."""
        self._free_memory(req)
        self.running.remove(req)
        req.num_computed = 0
        req.fork = 0
        req.metrics.num_retractions += 1
        self.num_retractions += 1
        if preempted:
            req.metrics.num_preemptions += 1
            self.num_preemptions += 1
        self.ratio = self.cfg.new_token_ratio
        self.add(req)

    # ------------------------------------------------------------------ memory
    def _alloc(self, req: Request, end: int) -> bool:
        """Take the pages and slots of pass [num_computed, end) for `req` -> False if the arena
        refused (nothing is kept then).  Every new page gets its window pages too."""
        d = self.demand.step(req, end)
        vids = self.allocator.alloc_token_pages(d.token_pages) if d.token_pages else np.empty(0, np.int32)
        if vids is None:
            return False
        slots = self.allocator.alloc_state_slots(d.state_slots) if d.state_slots else np.empty(0, np.int32)
        if slots is None:
            if vids.size:
                self.allocator.free_token_pages(vids)
            return False
        self.owner.take(vids, self.window_names)  # every new page has its window pages
        req.pages += vids.tolist()
        req.slots += slots.tolist()
        return True

    def _alloc_all(self, rows: list[Request]) -> bool:
        done = []
        for r in rows:
            n, s = len(r.pages), len(r.slots)
            if not self._alloc(r, r.num_computed + 1):
                for q, n0, s0 in done:  # roll back this round
                    self._release_pages(q.pages[n0:], self.window_names)
                    if q.slots[s0:]:
                        self.allocator.free_state_slots(q.slots[s0:])
                    del q.pages[n0:], q.slots[s0:]
                return False
            done.append((r, n, s))
        return True

    def _release_pages(self, vids, windows) -> None:
        for name in windows:
            self.owner.release_window(vids, name)
        self.owner.release(vids)

    def _free_memory(self, req: Request) -> None:
        if self.cache is not None:
            self._cache_progress(req)  # what it computed stays reusable
        if req.ckpts:
            self.allocator.free_state_slots([s for _, s in req.ckpts])
        for name in self.window_names:
            self.owner.release_window(req.pages[req.window_start[name]:], name)
        self.owner.release(req.pages)
        if req.slots:
            self.allocator.free_state_slots(req.slots)
        req.pages, req.slots, req.ckpts = [], [], []
        req.window_start = {n: 0 for n, _ in self.windows}
        req.cache_node, req.cache_pages = None, 0

    def _release_windows(self) -> None:
        """Give up window pages whose tokens every future query of their request has passed:
        page k goes once (k + 1) * page_size <= num_computed - w + 1 (tombstoned unless the
        prefix cache or another request still needs it)."""
        for r in self.running:
            for name, w in self.windows:
                upto = min(len(r.pages), max(0, r.num_computed - w + 1) // self.ps)
                start = r.window_start[name]
                if upto > start:
                    self.owner.release_window(r.pages[start:upto], name)
                    r.window_start[name] = upto

    def held_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(token page ids, state slot ids) the requests and the prefix cache hold: for the
        allocator's leak check."""
        reqs = self.running + self.waiting
        pages = [p for r in reqs for p in r.pages]
        slots = [s for r in reqs for s in r.slots] + [s for r in reqs for _, s in r.ckpts]
        if self.cache is not None:
            vids, ckpts, _ = self.cache.held()
            pages += vids
            slots += ckpts
        return np.asarray(pages, np.int64), np.asarray(slots, np.int64)

    def check_refs(self) -> list[str]:
        """Page and window refcounts against what every holder says it holds -> problems."""
        n = self.owner.refs.size
        refs, wrefs = np.zeros(n, np.int32), {w: np.zeros(n, np.int32) for w in self.window_names}
        for r in self.running + self.waiting:
            np.add.at(refs, np.asarray(r.pages, np.int64), 1)
            for w in self.window_names:
                np.add.at(wrefs[w], np.asarray(r.pages[r.window_start[w]:], np.int64), 1)
        if self.cache is not None:
            vids, _, wins = self.cache.held()
            np.add.at(refs, np.asarray(vids, np.int64), 1)
            for w in self.window_names:
                np.add.at(wrefs[w], np.asarray(wins[w], np.int64), 1)
        return self.owner.check(refs, wrefs)


__all__ = ["Scheduler", "SchedulerConfig"]
