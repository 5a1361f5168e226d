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


def gives_back(reqs: list[Request], holders: list[Request], demand: DemandModel) -> list[Demand]:
    """What each of `reqs` gives back when it finishes: its slots, and the pages (full and per
    window) no other of `holders` holds.  A page shared with another running request (a prefix
    hit, a sibling of n samples) stays; one shared only with the prefix cache is evictable once
    the request is gone, which is how the scheduler makes room (`_fits`) before retracting."""
    full = np.bincount(np.fromiter((p for r in holders for p in r.pages), np.int64), minlength=1)
    windows = {n: np.bincount(np.fromiter((p for r in holders for p in r.pages[r.window_start[n]:]), np.int64),
                              minlength=1) for n, _ in demand.windows}
    out = []
    for r in reqs:
        window_pages = {n: int((count[r.pages[r.window_start[n]:]] == 1).sum()) for n, count in windows.items()}
        out.append(Demand(int((full[r.pages] == 1).sum()), window_pages, len(r.slots)))
    return out


def reservations(running: list[Request], holders: list[Request], demand: DemandModel,
                 tokens: Callable[[Request], int], exact: bool) -> Demand:
    """Reservations of every running request (decoding, or admitted with part of its prompt
    still to compute): `tokens(r)` (reserve_tokens) priced by the demand model, but for the
    fixed-length decoders under the exact rule, which reserve their decode_peak together.
    holders: every request holding memory (the running ones and held transfers)."""
    total, fixed = Demand(), []
    for r in running:
        if exact and r.decode_ready and r.wants_step and fixed_length(r):
            fixed.append(r)
        elif r.wants_step or not r.decode_ready:
            total = total + demand.reservation(r, tokens(r))
    if fixed:
        # lag 1: under async scheduling the engine finishes a request (gives its memory back)
        # only after scheduling the step that follows its last token
        left = [r.max_tokens - r.num_output for r in fixed]
        total = total + demand.decode_peak(fixed, left, gives_back(fixed, holders, demand), lag=1)
    return total


__all__ = ["exact_applies", "fixed_length", "gives_back", "reservations", "reserve_tokens"]
