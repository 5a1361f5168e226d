"""The demand model: what a request costs the arena, in allocator units and bytes.

ONE function, `DemandModel.span`, prices every question the scheduler asks about memory, so
arrival, admission and retraction can never disagree about what a request needs (the policies
themselves live in umem_jax.scheduler; this module only prices, against a ChainAllocator):

    clip at arrival      span(0 -> input + max_new - 1) must fit an EMPTY arena (else the
                         prompt is refused, or max_new_tokens lowered until it fits)
    admission            span(this pass) + decode reservations, summed over the batch, must
                         fit the arena as it is now (ChainAllocator.can_fit on the sum)
    decode capacity      sum over the batch of span(one token) must fit, else retract
    preemption / retraction  `held` (what a request would give back), in bytes

Units (a `Demand`): new token pages (each a virtual id with a page in the full sub-pool), new
pages in each window sub-pool (a subset of those ids: `window_pages` of ChainAllocator), new
state slots.  A request computing tokens [a, e) in passes of at most c tokens holds:

  full     ceil(e / page_size) pages: every token written stays (positions 0 .. e-1).
  window w a pass [s, s+c) attends keys (s - w, s + c), so the pages touching that span must
           be bound together: at most spanned(w - 1 + c) pages (spanned(n): the most pages n
           consecutive tokens can touch, one more than ceil when unaligned), and never more
           than the pages touching [a - w + 1, e).  Pages that left every window are
           tombstoned after each step, so a request holds ~one window, not its whole history.
           This is SGLang's "part of this pass beyond one window + min(extend + max_new,
           window) + one page", made an exact upper bound for how this engine allocates
           (every new page gets a window page; out-of-window pages are released per step).
  state    1 working slot + `extra_state_slots` (0 by default), taken at the first pass and
           held to the end.  A prefix-cache hit restores its checkpoint into that working slot
           (a copy), so a hit costs no extra slot.

Prefix-cache checkpoints are OPTIONAL units (`checkpoint`), priced so that a caller can take
one only when `checkpoint() + the decode reservations of every running request (+ this step's
admissions)` fits the arena, and skip it otherwise; once taken it belongs to the cache, which
evicts it (LRU) before any request is retracted.  So checkpoints never spend bytes an admitted request
counts on, and a checkpoint that cannot be taken never stalls a request.  Pages and slots
shared with the cache are not new demand: a hit request holds them from admission on, and
`span` prices only what it adds.

Because the clip prices the whole life (worst pass = the chunk size, also for a request that
is retracted and recomputes prompt + output later), a request admitted alone always fits: an
admitted request is never aborted for memory, it is at worst retracted and resumed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .chain import ChainAllocator
from .plan import Plan


@dataclasses.dataclass
class Demand:
    """Allocator units: new token page ids, new pages per window sub-pool, new state slots."""

    token_pages: int = 0
    window_pages: dict[str, int] = dataclasses.field(default_factory=dict)
    state_slots: int = 0

    def __add__(self, other: Demand) -> Demand:
        window_pages = dict(self.window_pages)
        for name, pages in other.window_pages.items():
            window_pages[name] = window_pages.get(name, 0) + pages
        return Demand(self.token_pages + other.token_pages, window_pages, self.state_slots + other.state_slots)

    @property
    def empty(self) -> bool:
        return self.token_pages == 0 and self.state_slots == 0 and not any(self.window_pages.values())


def spanned(n: int, page_size: int) -> int:
    """The most pages n consecutive tokens can touch (n >= 1: ceil(n / page_size) or one more)."""
    return 0 if n <= 0 else (n + page_size - 2) // page_size + 1


class DemandModel:
    """Prices requests against `plan`.  chunk: the longest prefill pass (the engine's
    max_num_batched_tokens); empty: a never-touched allocator of the same arena (and static
    regions), the "otherwise empty arena" of the clip.

    A `req` argument is a umem_jax.core.request.Request (or anything with its num_computed,
    pages, slots and window_start).
    """

    def __init__(self, plan: Plan, *, chunk: int, empty: ChainAllocator, extra_state_slots: int = 0,
                 decode_pass: int = 1):
        self.plan = plan
        self.page_size = plan.page_size
        self.chunk = int(chunk)
        # tokens one decode step computes: 1, or k+1 under speculation (a verify of k drafts),
        # which binds w - 1 + k + 1 keys of each window at once
        self.decode_pass = int(decode_pass)
        if self.decode_pass > self.chunk:
            raise ValueError(f"a decode pass of {self.decode_pass} tokens is longer than the chunk {self.chunk}: "
                             "the memory clip prices passes of at most the chunk")
        self.windows = tuple((sp.name, sp.window) for sp in plan.windows)
        self.slots_per_request = (1 + int(extra_state_slots)) if plan.state is not None else 0
        self._empty = empty
        self._page_bytes = {sp.name: sp.page_bytes for sp in plan.subpools}
        self._clips: dict[tuple[int, int], int | None] = {}

    # ------------------------------------------------------------------ the one function
    def span(self, computed: int, end: int, *, held_pages: int = 0, held_window: dict[str, int] | None = None,
             held_slots: int = 0, pass_len: int | None = None) -> Demand:
        """New units to take a request from `computed` tokens in the arena to `end`, computing in
        passes of at most `pass_len` tokens (default: the chunk), given what it holds now.

        held_window[w] must be the pages bound in w now: those touching [computed - w + 1,
        computed), which is what the scheduler keeps after releasing out-of-window pages.
        """
        if end <= computed:
            return Demand(0, {n: 0 for n, _ in self.windows}, 0)
        page_size = self.page_size
        need = -(-end // page_size)
        full = max(0, need - held_pages)
        pass_tokens = max(1, min(self.chunk if pass_len is None else pass_len, end - computed))
        held_window = held_window or {}
        window_pages = {}
        for name, window in self.windows:
            first = max(0, computed - window + 1) // page_size
            peak = min(need - first, spanned(min(window - 1 + pass_tokens, end), page_size))
            # a single pass gives exactly `full` (every new page needs its window page)
            window_pages[name] = min(full, max(0, peak - held_window.get(name, 0)))
        slots = max(0, self.slots_per_request - held_slots)
        return Demand(full, window_pages, slots)

    # ------------------------------------------------------------------ views of a request
    def step(self, req, end: int) -> Demand:
        """This pass of `req`: tokens [req.num_computed, end)."""
        return self.span(req.num_computed, end, held_pages=len(req.pages), held_window=self.held_window(req),
                         held_slots=len(req.slots), pass_len=end - req.num_computed)

    def reservation(self, req, tokens: int, *, after: int | None = None,
                    shared_window: dict[str, int] | None = None) -> Demand:
        """The next `tokens` decode tokens of `req` once it has `after` tokens in the arena
        (default: now).  Priced from the state after this step's pass, so only decode pages.
        shared_window[w]: of the window pages it will hold then, those another request holds in
        its window too (reservations.shared_window): passing one frees nothing until the other
        passes it as well, so they are priced as not held (never less than the truth)."""
        start = req.num_computed if after is None else after
        if tokens <= 0:
            return Demand()
        shared = shared_window or {}
        if after is None:
            held_window = {n: max(0, k - shared.get(n, 0)) for n, k in self.held_window(req).items()}
            return self.span(start, start + tokens, held_pages=len(req.pages), held_window=held_window,
                             held_slots=len(req.slots), pass_len=self.decode_pass)
        held = self.held_after(start)
        held_window = {n: max(0, k - shared.get(n, 0)) for n, k in held.window_pages.items()}
        return self.span(start, start + tokens, held_pages=held.token_pages, held_window=held_window,
                         held_slots=held.state_slots, pass_len=self.decode_pass)

    def held_after(self, end: int) -> Demand:
        """What a request holds after a pass that ends at `end` (none of it shared): ceil(end /
        page_size) pages, in each window the pages touching [end - w + 1, end), and its slots."""
        pages = -(-end // self.page_size)
        return Demand(pages, {n: pages - max(0, end - w + 1) // self.page_size for n, w in self.windows},
                      self.slots_per_request)

    def decode_peak(self, reqs, tokens_left, gives_back=None, lag: int = 0, shared_window=None,
                    shared_frees=None) -> Demand:
        """What the decoders `reqs` must still be given, at the worst step, if request i decodes
        exactly tokens_left[i] more tokens (a fixed-length output: ignore_eos, no stop) and
        every decode step advances each of them by one token.

        At decode step t, request i has taken reservation(req_i, min(t, n_i)) new units, and
        every request with n_i + lag < t has finished: what it took is back, and what it held
        at the start too (gives_back[i]; default held(req_i) -- the scheduler passes less when
        another request shares its pages).  lag: steps between a request's last token and its
        memory coming back (1 under async scheduling, where a step's tokens are read, and its
        requests finished, after the next step is scheduled).  The peak over t falls on some
        t = n_i + lag (between two finishes the finished set is fixed and every survivor only
        grows), is taken per sub-pool and clipped at 0, so what one sub-pool frees never pays
        for another's growth.  Compared with a ratio of the tokens left this is exact: short
        requests about to finish pay for the long ones' growth.

        `reservation` (so `span`) written over arrays [request, candidate t] at once: a Python
        span per (request, t) would cost O(R^2) calls per schedule at a few hundred decoders.
        tests/memory/test_demand.py checks it against the loop over `reservation`.

        A window page several of `reqs` hold (a shared prefix's tail, n siblings) frees nothing
        when one passes it: each prices its window growth against the pages it holds alone
        (shared_window[i][w]: how many of request i's window pages others hold too, priced as
        not held, as in `reservation`), and the shared page comes back at the step its last
        holder passes it or finishes -- shared_frees[w]: those steps, one per shared page
        (scheduler/reservations.py: shared_window, shared_window_frees)."""
        if not reqs:
            return Demand()
        names = [name for name, _ in self.windows]
        n = np.maximum(0, np.asarray(tokens_left, np.int64))
        ts = np.unique(n + lag)
        ts = ts[ts > 0]  # the candidate steps: the last ones before a request gives back
        if not ts.size:
            return Demand(0, {w: 0 for w in names}, 0)
        back = [self.held(r) for r in reqs] if gives_back is None else list(gives_back)
        ps = self.page_size
        computed = np.array([r.num_computed for r in reqs], np.int64)[:, None]
        pages = np.array([len(r.pages) for r in reqs], np.int64)[:, None]
        alive = n[:, None] + lag >= ts[None, :]  # still holding at step ts[k]
        t = np.minimum(ts[None, :], n[:, None])  # [R, K]: tokens request i has taken by then
        end = computed + t
        need = -(-end // ps)
        full = np.maximum(0, need - pages)
        pass_tokens = np.maximum(1, np.minimum(self.decode_pass, t))

        def peak(grown, given, freed=0) -> int:  # per step: what the survivors took minus what came back
            return int(max(0, (np.where(alive, grown, -np.asarray(given, np.int64)[:, None]).sum(axis=0)
                               - freed).max()))

        window_pages = {}
        for name, w in self.windows:
            first = np.maximum(0, computed - w + 1) // ps
            shared = [0] * len(reqs) if shared_window is None else [d.get(name, 0) for d in shared_window]
            held_window = np.array([max(0, len(r.pages) - r.window_start[name] - k) for r, k in zip(reqs, shared)],
                                   np.int64)[:, None]
            spans = np.minimum(w - 1 + pass_tokens, end)
            bound = np.minimum(need - first, np.where(spans <= 0, 0, (spans + ps - 2) // ps + 1))  # spanned()
            grown = np.minimum(full, np.maximum(0, bound - held_window))
            frees = np.asarray((shared_frees or {}).get(name, ()), np.int64)
            freed = (frees[:, None] <= ts[None, :]).sum(axis=0)  # shared pages back by step ts[k]
            window_pages[name] = peak(grown, [b.window_pages.get(name, 0) for b in back], freed)
        slots = np.array([max(0, self.slots_per_request - len(r.slots)) for r in reqs], np.int64)[:, None]
        return Demand(peak(full, [b.token_pages for b in back]), window_pages,
                      peak(slots * (t > 0), [b.state_slots for b in back]))

    def checkpoint(self, n: int = 1) -> Demand:
        """n prefix-cache checkpoints: state slots (optional demand, see the module docstring)."""
        return Demand(0, {name: 0 for name, _ in self.windows}, int(n) if self.plan.state is not None else 0)

    def held(self, req) -> Demand:
        """What `req` holds now (what retracting it gives back)."""
        return Demand(len(req.pages), self.held_window(req), len(req.slots))

    def held_window(self, req) -> dict[str, int]:
        return {n: len(req.pages) - req.window_start[n] for n, _ in self.windows}

    def lifetime(self, input_len: int, max_new: int) -> Demand:
        """A fresh request's peak: prompt and outputs in the arena (the last sampled token is
        never written), the worst pass being a full chunk."""
        return self.span(0, input_len + max_new - 1)

    # ------------------------------------------------------------------ capacity
    def fits(self, allocator: ChainAllocator, d: Demand) -> bool:
        """Whether `d`, taken in one go, fits `allocator` now (compacting if needed)."""
        if d.empty:
            return True
        return allocator.can_fit(token_pages=d.token_pages, state_slots=d.state_slots, window_pages=d.window_pages)

    def fits_empty(self, d: Demand) -> bool:
        return self.fits(self._empty, d)

    def clip(self, input_len: int, max_new: int) -> int | None:
        """Largest max_new_tokens <= max_new whose lifetime fits the empty arena; None when even
        one new token does not (the prompt exceeds the memory budget)."""
        key = (int(input_len), int(max_new))
        if key in self._clips:
            return self._clips[key]
        out = None
        if max_new >= 1 and self.fits_empty(self.lifetime(input_len, 1)):
            lo, hi = 1, int(max_new)
            if self.fits_empty(self.lifetime(input_len, hi)):
                lo = hi
            while lo < hi:  # lifetime demand is monotone in max_new
                mid = (lo + hi + 1) // 2
                if self.fits_empty(self.lifetime(input_len, mid)):
                    lo = mid
                else:
                    hi = mid - 1
            out = lo
        if len(self._clips) > 4096:
            self._clips.clear()
        self._clips[key] = out
        return out

    # ------------------------------------------------------------------ bytes
    def bytes(self, d: Demand, subpools=None) -> int:
        """Arena bytes of `d` (only in `subpools` when given)."""
        full, state = self.plan.full.name, self.plan.state.name if self.plan.state is not None else None
        parts = [(full, d.token_pages), *d.window_pages.items()]
        if state is not None:
            parts.append((state, d.state_slots))
        return sum(n * self._page_bytes[name] for name, n in parts if subpools is None or name in subpools)

    def subpools_of(self, d: Demand) -> set[str]:
        """The sub-pools `d` asks something of (the bands a preemption should free)."""
        out = {n for n, v in d.window_pages.items() if v}
        if d.token_pages:
            out.add(self.plan.full.name)
        if d.state_slots and self.plan.state is not None:
            out.add(self.plan.state.name)
        return out


__all__ = ["Demand", "DemandModel", "spanned"]
