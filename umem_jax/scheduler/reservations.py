"""Decode reservations: what admission leaves free for the future tokens of running requests.

Two rules, both priced by the one DemandModel:
  ratio  (SGLang's) a request may stop at any token (EOS, a stop string), so it reserves a
         decaying ratio of the outputs it may still produce (`Scheduler.ratio`) and retraction
         catches the over-commitment.
  exact  a fixed-length request (ignore_eos, no stop strings, no stop token ids) decodes exactly
         max_tokens - num_output more tokens, so what it needs is known: at admission it
         reserves all of it (ratio 1), and once decoding, the fixed-length decoders reserve
         together `DemandModel.decode_peak` -- the worst step of their joint growth, counting
         what each gives back when it finishes.  It never reserves more than they will take and
         no fixed-length decoder is retracted for the others' growth.

The exact rule holds only while every decode step advances every decoder by one token, since
decode_peak orders the finishes by tokens left (`exact_applies`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np

from ..core.request import Request
from ..memory.demand import Demand, DemandModel


def exact_applies(cfg) -> bool:
    """Whether the exact rule is valid for SchedulerConfig `cfg`.  Not under speculation: a
    verify keeps 1..k+1 tokens, unknown ahead, so who finishes when is unknown (keep the ratio);
    not when max_num_seqs exceeds the largest batch bucket: a decode step then leaves some
    decoders out, they finish later than decode_peak assumes, and what it counted as given back
    by then is still held."""
    return bool(cfg.exact_fixed_length_reservation) and not cfg.num_speculative_tokens \
        and cfg.max_num_seqs <= cfg.buckets.batch[-1]


def fixed_length(req: Request) -> bool:
    """Nothing but its length ends `req`: ignore_eos, no stop strings, no stop token ids."""
    p = req.params
    return bool(p.ignore_eos) and not p.stop and not p.stop_token_ids and not req.stop_ids


def reserve_tokens(req: Request, ratio: float, exact: bool, after: int | None = None) -> int:
    """Tokens to keep free for `req` beyond `after` (default: what it has computed): the rest
    of its prompt, all of it (a chunked prompt needs every page before its first output; left
    out, later admissions take those pages and the prompt's next chunk retracts them), plus
    `ratio` of the outputs it may still produce -- or, fixed-length under the exact rule,
    exactly what it will compute: every known token not computed yet and every output still
    to come but the last (a sampled token is written only by the step after it)."""
    a = req.num_computed if after is None else after
    left = max(0, req.max_tokens - req.num_output)
    if exact and fixed_length(req):
        return max(0, req.num_tokens - a + left - 1)
    rest = 0 if req.decode_ready and after is None else max(0, req.num_tokens - a)
    return rest + math.ceil(ratio * left)


def window_holders(holders: list[Request], demand: DemandModel) -> dict[str, np.ndarray]:
    """{window: [page id] -> how many of `holders` hold that page in that window}."""
    out = {}
    for n, _ in demand.windows:
        held = [r.pages[r.window_start[n]:] for r in holders]
        out[n] = np.bincount(np.fromiter(itertools.chain.from_iterable(held), np.int64), minlength=1)
    return out


def shares_windows(counts: dict[str, np.ndarray]) -> bool:
    """Whether any window page is held by two holders at once (window_holders' counts)."""
    return any(c.size and int(c.max()) > 1 for c in counts.values())


def gives_back(reqs: list[Request], holders: list[Request], demand: DemandModel,
               counts: dict[str, np.ndarray] | None = None) -> list[Demand]:
    """What each of `reqs` gives back when it finishes: its slots, and the pages (full and per
    window) no other of `holders` holds.  A page shared with another running request (a prefix
    hit, a sibling of n samples) stays; one shared only with the prefix cache is evictable once
    the request is gone, which is how the scheduler makes room (`_fits`) before retracting.
    counts: window_holders(holders), if already at hand."""
    full = np.bincount(np.fromiter((p for r in holders for p in r.pages), np.int64), minlength=1)
    windows = window_holders(holders, demand) if counts is None else counts
    out = []
    for r in reqs:
        window_pages = {n: int((count[r.pages[r.window_start[n]:]] == 1).sum()) for n, count in windows.items()}
        out.append(Demand(int((full[r.pages] == 1).sum()), window_pages, len(r.slots)))
    return out


def shared_window_frees(reqs: list[Request], tokens_left: list[int], holders: list[Request], demand: DemandModel,
                        lag: int) -> dict[str, np.ndarray]:
    """{window: the decode step at which each window page that several of the fixed-length
    decoders `reqs` (and no other of `holders`) hold comes back}: the step its last holder
    passes it (the window's first page moves past it) or finishes (tokens_left + lag), for
    DemandModel.decode_peak.  A page another holder keeps (a request priced by the ratio, a
    held transfer) is not counted as coming back."""
    index = {id(r): i for i, r in enumerate(reqs)}
    ps, out = demand.page_size, {}
    for name, w in demand.windows:
        # one entry per (holder, window page): its page id, the holder's decoder index (-1: not
        # one of reqs) and the step at which that holder lets the page go
        vids, who, when = [], [], []
        for h in holders:
            first, n = h.window_start[name], len(h.pages)
            if n <= first:
                continue
            i = index.get(id(h), -1)
            j = np.arange(first, n, dtype=np.int64)
            vids.append(np.asarray(h.pages[first:], np.int64))
            who.append(np.full(n - first, i, np.int64))
            if i < 0:
                when.append(np.zeros(n - first, np.int64))
            else:  # h passes page j once c + t - w + 1 >= (j + 1) * ps (c: its tokens computed now)
                when.append(np.minimum(np.maximum(0, (j + 1) * ps + w - 1 - h.num_computed), tokens_left[i] + lag))
        if not vids:
            out[name] = np.zeros(0, np.int64)
            continue
        vids, who, when = np.concatenate(vids), np.concatenate(who), np.concatenate(when)
        uniq, inv, count = np.unique(vids, return_inverse=True, return_counts=True)
        last = np.zeros(uniq.size, np.int64)
        np.maximum.at(last, inv, when)
        outsider = np.zeros(uniq.size, bool)
        np.logical_or.at(outsider, inv, who < 0)
        out[name] = last[(count > 1) & ~outsider]
    return out


def shared_window(req: Request, counts: dict[str, np.ndarray], demand: DemandModel, after: int | None = None,
                  member: bool = True) -> dict[str, int]:
    """{window: pages `req` will hold in it once it has `after` tokens (default: now) that
    another request holds in its window too}: a shared prefix's tail (a hit on a running
    request's prompt, n siblings).  counts: window_holders(holders); member: whether `req` is
    one of those holders (a request being admitted is not yet)."""
    start = req.num_computed if after is None else after
    out = {}
    for n, w in demand.windows:
        first = max(req.window_start[n], max(0, start - w + 1) // demand.page_size)
        held = req.pages[first:]  # a holder's pages are all counted; another's may lie past the counts
        out[n] = int(((counts[n][held] if member else _counts(counts[n], held)) > int(member)).sum())
    return out


def _counts(count: np.ndarray, pages) -> np.ndarray:
    """count[pages], 0 for ids past the end (pages none of the holders has)."""
    pages = np.asarray(pages, np.int64)
    return np.where(pages < count.size, count[np.minimum(pages, count.size - 1)], 0)


def own(req: Request, end: int, holders: list[Request], demand: DemandModel, tokens: int) -> Demand:
    """`req`'s decode reservation of `tokens` once a pass has taken it to `end`, the window pages
    it shares with another of `holders` then priced as not held (shared_window)."""
    shared = None
    if req.pages and demand.windows:  # only a hit (or a prompt under way) holds pages already
        shared = shared_window(req, window_holders(holders, demand), demand, after=end, member=req in holders)
    return demand.reservation(req, tokens, after=end, shared_window=shared)


@dataclasses.dataclass
class AfterPass:
    """A request being admitted, as DemandModel.decode_peak reads a decoder (num_computed, pages,
    window_start, slots) once the pass that completes its prompt has run; `holds` is what it then
    holds and gives back when it finishes (DemandModel.held_after: none of it shared)."""
    num_computed: int
    pages: list
    window_start: dict
    slots: list
    holds: Demand

    @classmethod
    def of(cls, end: int, demand: DemandModel) -> AfterPass:
        held = demand.held_after(end)
        starts = {n: held.token_pages - k for n, k in held.window_pages.items()}
        return cls(end, [0] * held.token_pages, starts, [0] * held.state_slots, held)


def joins(req: Request, end: int, exact: bool) -> bool:
    """Whether admitting `req` with a pass to `end` may be priced jointly with the fixed-length
    decoders (`reservations(joining=...)`): under the exact rule, fixed-length, holding nothing
    yet, and the pass completes its prompt (it decodes right after).  The caller also excludes a
    prefix hit: its pages, shared with the cache or a running request, would be credited as
    given back when it finishes (a prototype of session 12 retracted so)."""
    return exact and fixed_length(req) and end == req.num_tokens and not req.pages and not req.slots


def reservations(running: list[Request], holders: list[Request], demand: DemandModel,
                 tokens: Callable[[Request], int], exact: bool, joining: tuple[Request, int] | None = None) -> Demand:
    """Reservations of every running request (decoding, or admitted with part of its prompt
    still to compute): `tokens(r)` (reserve_tokens) priced by the demand model, but for the
    fixed-length decoders under the exact rule, which reserve their decode_peak together.
    holders: every request holding memory (the running ones and held transfers).

    joining (req, end): a request being admitted (`joins`) counted as one more of those decoders
    after its pass, its own reservation included: what it gives back when it finishes then pays
    for the others' later growth, where adding its own reservation to theirs would count the two
    peaks as if they fell on the same step (a short request admitted beside long ones)."""
    total, fixed, counts = Demand(), [], None
    for r in running:
        if exact and r.decode_ready and r.wants_step and fixed_length(r):
            fixed.append(r)
        elif r.wants_step or not r.decode_ready:
            if counts is None:
                counts = window_holders(holders, demand)
            shared = shared_window(r, counts, demand) if shares_windows(counts) else None
            total = total + demand.reservation(r, tokens(r), shared_window=shared)
    if fixed or joining:
        # lag 1: a request's memory priced as back one step after the step that follows its last
        # token, where Scheduler.release_ending gives it to that step: one step to spare (a step
        # that sits a request out, a read-back that comes first), and lag 0 moved the host
        # simulation's memory-bound live share by 0.001 at most (Gemma 3, session 33)
        left = [r.max_tokens - r.num_output for r in fixed]
        counts = counts if counts is not None else window_holders(holders, demand)
        shared = frees = None
        if shares_windows(counts):  # a prefix hit's or n samples' window pages: priced as not held
            shared = [shared_window(r, counts, demand) for r in fixed]
            sharers = [h for h in holders if any((c[h.pages[h.window_start[n]:]] > 1).any() for n, c in counts.items())]
            frees = shared_window_frees(fixed, left, sharers, demand, lag=1)
        back = gives_back(fixed, holders, demand, counts)
        if joining is not None:  # its pass samples one output; it decodes the rest with the others
            req, end = joining
            after = AfterPass.of(end, demand)
            fixed, back = fixed + [after], back + [after.holds]
            left = left + [req.max_tokens - req.num_output - 1]
            shared = None if shared is None else shared + [{}]
        total = total + demand.decode_peak(fixed, left, back, lag=1, shared_window=shared, shared_frees=frees)
    return total


__all__ = ["AfterPass", "exact_applies", "fixed_length", "gives_back", "joins", "own", "reservations", "reserve_tokens",
           "shared_window", "shared_window_frees", "shares_windows", "window_holders"]
