"""Random request traffic against ChainAllocator, with a host model of the arena's bytes.

Every step: the allocator's invariants hold, and *data follows ids*: each page written at
allocation with a pattern of (sub-pool, virtual id, row in page) still reads back that pattern
through the tables after every move batch has been applied with simultaneous-copy semantics
(read all sources, then write all destinations), exactly like the device copy.

`--long` (or UMEM_LONG_TESTS=1) also runs test_arena_machine_long: 10,000 sequences of up to
120 steps (it prints how many ran and how long they took).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from umem_jax.memory import ChainAllocator, full_attention, plan, recurrent_state, window_attention
from umem_jax.memory.declarations import StateTensor

PAGE = 4
LONG_SEQUENCES = 10_000


def make_plan(kind: str):
    """kind letters: s = state (a slot smaller than the sink), S = state (a slot larger than the
    sink: its grid starts below row 0), w = window 24, v = window 8; full attention always."""
    decls, layer = [], 0
    if "s" in kind or "S" in kind:
        numel = 40 if "s" in kind else 400
        decls.append(recurrent_state(layer, (StateTensor("h", (numel,), "float32"),)))  # 6 / 50 rows/slot
        layer += 1
    if "w" in kind:
        decls.append(window_attention(layer, 24, 1, 16))  # 8 rows/page
        layer += 1
    if "v" in kind:
        decls.append(window_attention(layer, 8, 1, 16))
        decls.append(window_attention(layer + 1, 8, 1, 16))  # 16 rows/page
        layer += 2
    decls.append(full_attention(layer, 3, 16))  # 24 rows/page: off the 16-row grids
    return plan(decls, page_size=PAGE)


PLANS = {k: make_plan(k) for k in ("w", "s", "sw", "wv", "swv", "Sw")}


def static_regions(p, rows: int, fractions) -> dict:
    """Contiguous regions in chain order, the i-th taking fractions[i] of the arena."""
    cuts = np.concatenate([[0], np.cumsum(fractions)])
    cuts = (cuts / cuts[-1] * rows).astype(int)
    return {sp.name: (int(cuts[i]), int(cuts[i + 1])) for i, sp in enumerate(p.subpools)}


class Request:
    def __init__(self, vids, slots):
        self.vids = list(vids)
        self.slots = list(slots)
        self.released = {}  # window name -> count of leading vids whose window page is released


class ArenaMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(sorted(PLANS)), mode=st.sampled_from(["lazy", "lazy", "eager", "static"]),
                rows=st.integers(600, 4000), fr=st.lists(st.integers(1, 4), min_size=4, max_size=4),
                cap=st.sampled_from([4096, 1]))
    def setup(self, kind, mode, rows, fr, cap):
        ArenaMachine.sequences += 1
        self.plan = PLANS[kind]
        regions = static_regions(self.plan, rows, fr[:len(self.plan.subpools)]) if mode == "static" else None
        self.a = ChainAllocator(self.plan, rows, static_regions=regions, eager=mode == "eager",
                                max_moves_per_flush=cap)
        self.tag = {sp.name: 1000 * (i + 1) for i, sp in enumerate(self.plan.subpools)}
        self.arena = np.zeros((rows, 2), np.int64)  # (tag + vid, row within page)
        self.reqs: dict[int, Request] = {}
        self.next = 0
        self.fresh = []  # (sub-pool, vids) allocated this step, written after the moves

    # ---------------------------------------------------------------- model of the device

    def apply_moves(self):
        for m in self.a.take_moves():
            assert len(set(m.dst.tolist())) == m.dst.size, "destinations repeat"
            assert not np.isin(m.dst, m.src).any(), "a destination is a source of its batch"
            assert (m.src > 0).all() and (m.dst > 0).all(), "a move touches the sink"
            src, dst = self.rows(m.subpool, m.src).ravel(), self.rows(m.subpool, m.dst).ravel()
            self.arena[dst] = self.arena[src].copy()  # read every source, then write

    def rows(self, name, pages):
        """Arena rows [n, rows_per_page] of physical pages of `name`, on its grid (the state grid
        starts at the sink): never in the sink, never past the arena."""
        sp = self.plan[name]
        rows = sp.page_row(np.asarray(pages, np.int64))[:, None] + np.arange(sp.rows_per_page)
        assert rows.size == 0 or (self.plan.sink_rows <= rows.min() and rows.max() < self.arena.shape[0]), \
            f"{name}: pages {pages[:8]} leave [sink, arena)"
        return rows

    def write(self, name, vids):
        sp = self.plan[name]
        pages = self.a.translate_pages(np.asarray(vids)[None], name)[0] if sp.kind != "state" \
            else self.a.translate_slots(np.asarray(vids))
        assert (pages > 0).all()
        rows = self.rows(name, pages)
        self.arena[rows, 0] = self.tag[name] + np.asarray(vids)[:, None]
        self.arena[rows, 1] = np.arange(sp.rows_per_page)

    def end_step(self):
        self.apply_moves()
        for name, vids in self.fresh:
            self.write(name, vids)
        self.fresh = []

    # ---------------------------------------------------------------- helpers

    def alloc_tokens(self, n, window_pages=None):
        fits = self.a.can_fit(n, window_pages=window_pages)
        vids = self.a.alloc_token_pages(n, window_pages)
        assert (vids is not None) == fits, f"can_fit said {fits} but alloc gave {vids}: {self.a.last_shortfall}"
        if vids is not None:
            self.fresh.append((self.plan.full.name, vids))
            for w in self.plan.windows:
                k = n if not window_pages else window_pages.get(w.name, n)
                if k:
                    self.fresh.append((w.name, vids[n - k:]))
        return vids

    def alloc_slots(self, n):
        fits = self.a.can_fit(state_slots=n)
        slots = self.a.alloc_state_slots(n)
        assert (slots is not None) == fits
        if slots is not None:
            self.fresh.append((self.plan.state.name, slots))
        return slots

    def window_pages_of(self, w):
        return -(-w.window // PAGE) + 1

    # ---------------------------------------------------------------- rules

    @rule(n=st.integers(1, 10), prefill_window=st.booleans())
    def arrive(self, n, prefill_window):
        # a long prompt may skip window pages for its early pages, which nothing will read
        wp = {w.name: min(n, self.window_pages_of(w)) for w in self.plan.windows} if prefill_window else None
        both = self.a.can_fit(n, 1 if self.plan.state is not None else 0, wp)
        vids = self.alloc_tokens(n, wp)
        assert vids is not None or not both
        if vids is None:
            self.end_step()
            return
        slots = []
        if self.plan.state is not None:
            slots = self.alloc_slots(1)
            assert slots is not None or not both, "can_fit(tokens, slots) held but the slots did not fit"
            if slots is None:
                self.a.free_token_pages(vids)
                self.fresh = []
                self.end_step()
                return
        r = Request(vids, slots)
        for w in self.plan.windows:
            r.released[w.name] = n - (wp[w.name] if wp else n)
        self.reqs[self.next] = r
        self.next += 1
        self.end_step()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), k=st.integers(1, 4))
    def grow(self, data, k):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        vids = self.alloc_tokens(k)
        if vids is not None:
            self.reqs[rid].vids += list(vids)
        self.end_step()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def slide(self, data):
        """Tokens leave the window: release the window pages older than the window."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        for w in self.plan.windows:
            keep = self.window_pages_of(w)
            upto = max(r.released[w.name], len(r.vids) - keep)
            gone = r.vids[r.released[w.name]:upto]
            if gone:
                self.a.release_window_pages(gone, w.name)
                r.released[w.name] = upto
        self.end_step()

    @precondition(lambda self: self.reqs and any(r.released.get(w.name) for r in self.reqs.values()
                                                 for w in self.plan.windows))
    @rule(data=st.data())
    def rebind_window(self, data):
        """A tombstoned page gets a window page again (recompute of a cached prefix)."""
        cands = [(rid, w) for rid, r in self.reqs.items() for w in self.plan.windows if r.released[w.name]]
        rid, w = data.draw(st.sampled_from(cands))
        r = self.reqs[rid]
        vid = r.vids[r.released[w.name] - 1]
        if self.a.bind_window_pages([vid], w.name):
            r.released[w.name] -= 1
            self.fresh.append((w.name, np.array([vid], np.int32)))
        self.end_step()

    @precondition(lambda self: self.reqs and self.plan.state is not None)
    @rule(data=st.data())
    def checkpoint(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.alloc_slots(1)
        if slots is not None:
            self.reqs[rid].slots += list(slots)
        self.end_step()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), many=st.integers(1, 3))
    def finish(self, data, many):
        for _ in range(min(many, len(self.reqs))):
            rid = data.draw(st.sampled_from(sorted(self.reqs)))
            r = self.reqs.pop(rid)
            self.a.free_token_pages(r.vids)
            if r.slots:
                self.a.free_state_slots(r.slots)
        self.end_step()

    @rule(urgent=st.booleans())
    def flush(self, urgent):
        self.a.flush(urgent)
        self.end_step()

    @precondition(lambda self: len(self.plan.subpools) > 2)
    @rule(data=st.data(), side=st.sampled_from(["low", "high"]), rows=st.integers(0, 300))
    def make_room(self, data, side, rows):
        name = data.draw(st.sampled_from([sp.name for sp in self.plan.subpools[1:-1]]))
        self.a.make_room(name, side, rows)
        self.end_step()

    @precondition(lambda self: len(self.reqs) < 4)  # keep most of the run below a full arena
    @rule()
    def fill(self):
        """Take everything available_token_pages promises; one more page must not fit."""
        n = self.a.available_token_pages()
        if n:
            vids = self.alloc_tokens(n)
            assert vids is not None
            self.reqs[self.next] = Request(vids, [])
            for w in self.plan.windows:
                self.reqs[self.next].released[w.name] = 0
            self.next += 1
        assert not self.a.can_fit(1)
        assert self.a.alloc_token_pages(1) is None
        self.end_step()

    @precondition(lambda self: self.plan.state is not None)
    @rule()
    def state_capacity(self):
        n = self.a.available_state_slots()
        assert self.a.can_fit(state_slots=n)
        assert not self.a.can_fit(state_slots=n + 1)

    # ---------------------------------------------------------------- checks after every step

    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        self.a.check_invariants()
        held_tok = [v for r in self.reqs.values() for v in r.vids]
        held_state = [s for r in self.reqs.values() for s in r.slots]
        assert not self.a.leaks(held_tok, held_state)
        for sp in self.plan.subpools:
            if sp.kind == "state":
                vids = np.array(held_state, np.int32)
                pages = self.a.translate_slots(vids)
            else:
                if sp.kind == "window":
                    vids = np.array([v for r in self.reqs.values() for v in r.vids[r.released[sp.name]:]], np.int32)
                    dead = np.array([v for r in self.reqs.values() for v in r.vids[:r.released[sp.name]]], np.int32)
                    assert (self.a.translate_pages(dead[None], sp.name) == 0).all(), "tombstone maps to a page"
                else:
                    vids = np.array(held_tok, np.int32)
                pages = self.a.translate_pages(vids[None], sp.name)[0]
            assert (pages > 0).all(), f"{sp.name}: a live id maps to the sink"
            rows = self.rows(sp.name, pages)
            want = self.tag[sp.name] + vids[:, None]
            assert (self.arena[rows, 0] == want).all(), f"{sp.name}: data did not follow its ids"
            assert (self.arena[rows, 1] == np.arange(sp.rows_per_page)).all(), f"{sp.name}: rows shuffled"


ArenaMachine.sequences = 0  # sequences started in this process (setup runs once per sequence)
SUPPRESS = [HealthCheck.too_slow, HealthCheck.filter_too_much]
ArenaMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                          suppress_health_check=SUPPRESS)
TestArenaMachine = ArenaMachine.TestCase


@pytest.mark.slow
def test_arena_machine_long():
    """10,000 sequences of up to 120 steps (`--long`)."""
    before, t0 = ArenaMachine.sequences, time.perf_counter()
    run_state_machine_as_test(ArenaMachine, settings=settings(
        max_examples=LONG_SEQUENCES, stateful_step_count=120, deadline=None, suppress_health_check=SUPPRESS))
    ran = ArenaMachine.sequences - before
    print(f"allocator state machine: {ran} sequences in {time.perf_counter() - t0:.0f} s")
    assert ran >= LONG_SEQUENCES
