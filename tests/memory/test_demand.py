"""The demand model (memory/demand.py): host arithmetic against real ChainAllocators, no device.

What it must guarantee: (1) one pass prices exactly what the scheduler allocates; (2) the
lifetime price bounds what a request really holds at its peak, so the arrival clip (empty
arena) makes "admitted alone" mean "fits"; (3) the clip depends only on the empty arena;
(4) joint pricing catches demands that fit one at a time but not together.
"""

from __future__ import annotations

import numpy as np
import pytest
from _scheduler_drive import emit, finish

from umem_jax.core.request import Request
from umem_jax.core.sampling_params import SamplingParams
from umem_jax.core.scheduled_batch import Buckets
from umem_jax.memory import ChainAllocator, size_arena, static_regions
from umem_jax.memory import plan as make_plan
from umem_jax.memory.demand import Demand, DemandModel, spanned
from umem_jax.models.tiny import TinyHybrid, tiny_config
from umem_jax.scheduler.scheduler import Scheduler, SchedulerConfig

PS = 4


def tiny_plan(page_size=PS):
    return make_plan(TinyHybrid.decls(tiny_config(), "float32"), page_size=page_size)


def arena(budget, mode="unified", chunk=32, page_size=PS):
    p = tiny_plan(page_size)
    rows = size_arena(p, budget).num_rows
    regions = static_regions(p, rows) if mode == "static" else None
    live = ChainAllocator(p, rows, static_regions=regions)
    dm = DemandModel(p, chunk=chunk, empty=ChainAllocator(p, rows, static_regions=regions))
    return p, live, dm


def test_spanned():
    assert [spanned(n, 4) for n in range(10)] == [0, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    for n in range(1, 40):  # brute force: the most pages n consecutive positions touch
        assert spanned(n, 4) == max(len({p // 4 for p in range(s, s + n)}) for s in range(4))


def test_one_pass_prices_exactly_what_is_allocated():
    p, _live, dm = arena(1 << 20)
    w = p.windows[0].window
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = int(rng.integers(0, 300))
        e = a + int(rng.integers(1, 40))
        held = -(-a // PS)
        hw = held - max(0, a - w + 1) // PS  # what the scheduler keeps after releasing
        d = dm.span(a, e, held_pages=held, held_window={p.windows[0].name: hw}, held_slots=1 if a else 0,
                    pass_len=e - a)
        assert d.token_pages == -(-e // PS) - held
        assert d.window_pages[p.windows[0].name] == d.token_pages  # every new page needs its window page
        assert d.state_slots == (0 if a else 1)


def test_lifetime_holds_about_one_window_not_the_history():
    p, _live, dm = arena(1 << 20, chunk=32)
    w = p.windows[0].window
    d = dm.lifetime(500, 20)
    assert d.token_pages == -(-519 // PS)
    assert d.window_pages[p.windows[0].name] == spanned(w - 1 + 32, PS)
    assert d.state_slots == 1
    small = dm.lifetime(3, 2)  # shorter than a window: every page
    assert small.window_pages[p.windows[0].name] == small.token_pages == 1
    assert dm.bytes(d) == (d.token_pages * p.full.page_bytes + d.window_pages[p.windows[0].name]
                           * p.windows[0].page_bytes + p.state.page_bytes)


@pytest.mark.parametrize("mode", ["unified", "static"])
def test_clip_is_the_largest_that_fits_the_empty_arena(mode):
    _p, _live, dm = arena(160 << 10, mode)
    m = dm.clip(40, 10_000)
    assert m is not None and m < 10_000
    assert dm.fits_empty(dm.lifetime(40, m)) and not dm.fits_empty(dm.lifetime(40, m + 1))
    assert dm.clip(40, 5) == 5
    assert dm.clip(40, m + 7) == m  # monotone
    # a prompt that cannot fit even with one new token is refused
    huge = next(n for n in range(100, 10_000, 50) if not dm.fits_empty(dm.lifetime(n, 1)))
    assert dm.clip(huge, 1) is None and dm.clip(huge, 100) is None


def test_clip_ignores_what_is_allocated_now():
    _p, live, dm = arena(160 << 10)
    before = dm.clip(40, 10_000)
    dm._clips.clear()
    assert live.alloc_token_pages(20) is not None and live.alloc_state_slots(3) is not None
    assert dm.clip(40, 10_000) == before  # priced against the EMPTY arena, not `live`


def test_joint_demand_cannot_spend_the_same_bytes_twice():
    p, live, dm = arena(160 << 10)
    name = p.windows[0].name
    # take half of what fits, then find a demand that fits alone twice but not summed
    n = 1
    while dm.fits(live, Demand(n, {name: n}, 1)):
        n += 1
    one = Demand(n * 2 // 3, {name: n * 2 // 3}, 1)
    assert dm.fits(live, one)
    assert not dm.fits(live, one + one)


def _req(i, L, M, dm, prio=0):
    params = SamplingParams(temperature=0, max_tokens=M)
    return Request(str(i), None, [3 + (i + k) % 200 for k in range(L)], params, arrival=i, seed=0,
                   max_tokens=M, priority=prio, windows=tuple(n for n, _ in dm.windows))


@pytest.mark.parametrize("chunk", [8, 32])
def test_lifetime_bounds_the_real_peak(chunk):
    """Run lone requests through the scheduler (which allocates and releases as the engine does)
    and check that what they hold never exceeds their lifetime price, per sub-pool."""
    _p, live, dm = arena(1 << 20, chunk=chunk)
    cfg = SchedulerConfig(4, chunk, Buckets((4,), (max(chunk, 2),), (512,)))
    sch = Scheduler(cfg, live, dm)
    rng = np.random.default_rng(1)
    for i in range(12):
        L, M = int(rng.integers(1, 120)), int(rng.integers(1, 60))
        r = _req(i, L, M, dm)
        sch.add(r)
        price = dm.lifetime(L, M)
        peak = Demand()
        while not r.finished:
            b = sch.schedule()
            assert b is not None
            held = dm.held(r)
            peak = Demand(max(peak.token_pages, held.token_pages),
                          {k: max(peak.window_pages.get(k, 0), v) for k, v in held.window_pages.items()},
                          max(peak.state_slots, held.state_slots))
            for row in b.rows:
                if row.sample:
                    row.req.output_token_ids.append(7)
                    if row.req.num_output >= row.req.max_tokens:
                        sch.finish(row.req, type(row.req.status).FINISHED_LENGTH)
        assert peak.token_pages <= price.token_pages
        assert peak.state_slots == price.state_slots
        for k, v in peak.window_pages.items():
            assert v <= price.window_pages[k], (L, M, k, v, price)
        assert not live.leaks()


def _held_total(dm, reqs) -> Demand:
    total = Demand()
    for r in reqs:
        if not r.finished:
            total = total + dm.held(r)
    return total


@pytest.mark.parametrize("seed,lag", [(0, 0), (1, 0), (0, 1), (2, 1)])
def test_decode_peak_is_the_real_peak_of_fixed_lengths(seed, lag):
    """Fixed-length decoders (one token each per decode step): run them through the scheduler to
    the end and compare what they held at each step, over what they held at the start, with
    decode_peak.  lag 1 finishes a request one schedule after its last token, as the engine
    does under async scheduling.  The full sub-pool (pages kept to the end) meets it exactly;
    window pages (released as they leave the window) and state slots stay within it."""
    p, live, dm = arena(1 << 20, chunk=64)
    cfg = SchedulerConfig(8, 64, Buckets((8,), (64,), (512,)))
    sch = Scheduler(cfg, live, dm)
    rng = np.random.default_rng(seed)
    reqs = [_req(i, int(rng.integers(1, 10)), int(rng.integers(2, 70)), dm) for i in range(6)]
    for r in reqs:
        sch.add(r)
    done = []  # requests whose last token came in the previous step (lag 1: not finished yet)

    def step(measure=lambda: None):
        b = sch.schedule()
        assert b is not None
        measure()  # what the step's rows hold, before those finishing give it back
        finish(sch, done)  # lag 1: what finished a step ago gives back only now, after this schedule
        emit(b, done)
        if not lag:
            finish(sch, done)
        return b

    assert step().kind == "prefill" and all(r.decode_ready for r in reqs)  # one pass admits all six
    start = _held_total(dm, reqs)
    left = [r.max_tokens - r.num_output for r in reqs]
    peak = dm.decode_peak(reqs, left, lag=lag)
    seen = {"token": 0, "state": 0, **{n: 0 for n, _ in dm.windows}}

    def measure():
        now = _held_total(dm, reqs)
        seen["token"] = max(seen["token"], now.token_pages - start.token_pages)
        seen["state"] = max(seen["state"], now.state_slots - start.state_slots)
        for n, _ in dm.windows:
            seen[n] = max(seen[n], now.window_pages.get(n, 0) - start.window_pages.get(n, 0))

    while any(r.wants_step for r in reqs):
        assert step(measure).kind == "decode"
    finish(sch, done)
    assert seen["token"] == peak.token_pages
    assert seen["state"] <= peak.state_slots == 0
    for n, _ in dm.windows:
        assert seen[n] <= peak.window_pages[n]
    # the point of it: short requests about to finish pay for the long ones' growth
    every = sum((dm.reservation(r, k) for r, k in zip(reqs, left)), Demand())
    assert peak.token_pages <= every.token_pages
    assert not live.leaks()


def _peak_by_loop(dm, reqs, left, back, lag) -> Demand:
    """decode_peak by its definition: every step t, one `reservation` per request."""
    best = {"token": 0, "state": 0, **{n: 0 for n, _ in dm.windows}}
    for t in range(1, max(left) + lag + 1):
        net = dict.fromkeys(best, 0)
        for r, k, b in zip(reqs, left, back):
            sign, d = (1, dm.reservation(r, min(t, k))) if t <= k + lag else (-1, b)
            net["token"] += sign * d.token_pages
            net["state"] += sign * d.state_slots
            for n, _ in dm.windows:
                net[n] += sign * d.window_pages.get(n, 0)
        best = {k: max(v, net[k]) for k, v in best.items()}
    return Demand(best["token"], {n: best[n] for n, _ in dm.windows}, best["state"])


@pytest.mark.parametrize("decode_pass", [1, 3])
def test_decode_peak_equals_reservation_at_every_step(decode_pass):
    """The array form of decode_peak is the one demand model's `reservation`, step by step
    (every t, not only the finishes), with and without a lag and a given-back override."""
    p = tiny_plan()
    rows = size_arena(p, 1 << 20).num_rows
    dm = DemandModel(p, chunk=32, empty=ChainAllocator(p, rows), decode_pass=decode_pass)
    rng = np.random.default_rng(decode_pass)
    for trial in range(40):
        reqs = []
        for i in range(int(rng.integers(1, 7))):
            r = _req(i, 4, 8, dm)
            c = int(rng.integers(1, 60))
            r.num_computed = c
            r.pages = list(range(1, -(-c // PS) + 1 + int(rng.integers(0, 2))))  # one page ahead sometimes
            r.window_start = {n: max(0, c - w + 1) // PS for n, w in dm.windows}
            r.slots = [1] if rng.random() < 0.8 else []
            reqs.append(r)
        left = [int(k) for k in rng.integers(0, 30, len(reqs))]
        if not any(left):
            left[0] = 1
        windows = lambda: {n: int(rng.integers(0, 3)) for n, _ in dm.windows}  # noqa: E731
        back = None if trial % 2 else [Demand(int(rng.integers(0, 5)), windows(), int(rng.integers(0, 2))) for _ in reqs]
        for lag in (0, 1):
            want = _peak_by_loop(dm, reqs, left, back or [dm.held(r) for r in reqs], lag)
            assert dm.decode_peak(reqs, left, back, lag=lag) == want, (trial, lag)


def test_decode_peak_counts_what_finishing_requests_give_back():
    """Two decoders: one finishing after a token frees its pages for the other's growth."""
    _p, _live, dm = arena(1 << 20)
    short, long = _req(0, 4 * PS, 1, dm), _req(1, 1, 10 * PS, dm)
    for r, (L, pages) in ((short, (4 * PS, 4)), (long, (1, 1))):
        r.num_computed, r.pages, r.slots = L - 1, list(range(1, pages + 1)), [1]
        r.window_start = {n: 0 for n, _ in dm.windows}
    alone = dm.decode_peak([long], [10 * PS])
    both = dm.decode_peak([short, long], [1, 10 * PS])
    assert alone.token_pages == dm.reservation(long, 10 * PS).token_pages > 0
    # the short one's 4 pages come back after step 1 (it takes none: its last token is on page 4)
    assert both.token_pages == alone.token_pages - 4
    assert dm.decode_peak([], []).empty


def test_window_pages_beyond_token_pages_are_priced():
    """decode_peak takes each sub-pool's peak on its own, so a window may need more new pages than
    the full sub-pool (a finishing request gives back many full pages, few window pages): fits()
    must ask the window band for all of them, as binding window pages to existing ids takes them."""
    def filled():
        """An arena full of token pages without window pages, 20 of them freed again."""
        _p, live, dm = arena(1 << 19)
        none = {n: 0 for n, _ in dm.windows}
        vids = []
        for n in (8, 1):
            while (v := live.alloc_token_pages(n, none)) is not None:
                vids += v.tolist()
        live.free_token_pages(vids[:20])
        return live, dm, vids[20:], dm.windows[0][0]

    answers = []
    for k in range(1, 16):
        live, dm, vids, name = filled()
        d = Demand(0, {n: (k if n == name else 0) for n, _ in dm.windows}, 0)
        answers.append(dm.fits(live, d))
        assert answers[-1] == live.bind_window_pages(vids[:k], name), k
    assert answers[0] and not answers[-1]  # both answers occur
