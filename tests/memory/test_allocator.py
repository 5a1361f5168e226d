"""Unit tests of the host arena allocators: tables, end bands, floats, the chain's ladder."""

from __future__ import annotations

import numpy as np
import pytest

from umem_jax.memory import (
    ChainAllocator,
    EndBand,
    FloatBand,
    PageTable,
    full_attention,
    ordered_batches,
    plan,
    recurrent_state,
    window_attention,
)
from umem_jax.memory.declarations import StateTensor

PAGE = 4


def make_plan(kind: str):
    """s = state (6 rows/slot), w = window 24 (8 rows/page), v = window 8 (16 rows/page),
    full attention always (24 rows/page, off the 16-row grids)."""
    decls, layer = [], 0
    if "s" in kind:
        decls.append(recurrent_state(layer, (StateTensor("h", (40,), "float32"),)))
        layer += 1
    if "w" in kind:
        decls.append(window_attention(layer, 24, 1, 16))
        layer += 1
    if "v" in kind:
        decls += [window_attention(layer, 8, 1, 16), window_attention(layer + 1, 8, 1, 16)]
        layer += 2
    decls.append(full_attention(layer, 3, 16))
    return plan(decls, page_size=PAGE)


class Arena:
    """Host model of the device arena: pages carry (tag, vid, row) so data can be followed."""

    def __init__(self, a: ChainAllocator):
        self.a = a
        self.rows = np.zeros((a.num_rows, 3), np.int64)

    def apply(self):
        for m in self.a.take_moves():
            assert not np.isin(m.dst, m.src).any() and np.unique(m.dst).size == m.dst.size
            r = np.arange(m.rows_per_page)
            src = (m.src[:, None] * m.rows_per_page + r).ravel()
            dst = (m.dst[:, None] * m.rows_per_page + r).ravel()
            self.rows[dst] = self.rows[src].copy()

    def _pages(self, name, vids):
        sp = self.a.plan[name]
        vids = np.asarray(vids, np.int32)
        pages = self.a.translate_slots(vids) if sp.kind == "state" else self.a.translate_pages(vids[None], name)[0]
        return sp, vids, pages[:, None] * sp.rows_per_page + np.arange(sp.rows_per_page)

    def write(self, name, vids):
        sp, vids, rows = self._pages(name, vids)
        self.rows[rows] = np.stack(np.broadcast_arrays(hash(name) % 997, vids[:, None], np.arange(sp.rows_per_page)), -1)

    def verify(self, name, vids):
        sp, vids, rows = self._pages(name, vids)
        want = np.stack(np.broadcast_arrays(hash(name) % 997, vids[:, None], np.arange(sp.rows_per_page)), -1)
        assert (self.rows[rows] == want).all(), f"{name}: data did not follow ids"


def alloc_write(arena: Arena, n: int):
    v = arena.a.alloc_token_pages(n)
    assert v is not None
    arena.apply()
    for sp in arena.a.plan.token_pools:
        arena.write(sp.name, v)
    return v


# ------------------------------------------------------------------------------ tables


def test_translation_pads_with_sink_and_fixed_width():
    t = PageTable("x", 10, 20, 4)
    t.bind(np.array([1, 2, 3], np.int32), np.array([7, 8, 9], np.int32))
    t.unbind(np.array([2], np.int32))  # a tombstone
    got = t.translate(np.array([[1, 2, -1], [3, -1, -1]], np.int32), width=5)
    assert got.dtype == np.int32 and got.shape == (2, 5)
    assert got.tolist() == [[7, 0, 0, 0, 0], [9, 0, 0, 0, 0]]
    assert t.translate(np.array([5, 1], np.int32)).tolist() == [0, 7]  # unbound -> sink
    with pytest.raises(ValueError):
        t.translate(np.zeros((1, 4), np.int32), width=3)
    assert not t.check()


def test_ordered_batches_shift_overlap():
    src = np.arange(10, 20, dtype=np.int32)
    dst = src + 3  # overlapping shift up
    batches = ordered_batches(src, dst)
    assert len(batches) == 4  # ceil(10 / 3)
    mem = np.arange(40)
    for s, d in batches:
        assert not np.isin(d, s).any()
        mem[d] = mem[s].copy()
    assert (mem[13:23] == np.arange(10, 20)).all()


# ------------------------------------------------------------------------------ end bands


def _band(direction, pages=20, rpp=4):
    sp = make_plan("w").full
    table = PageTable("full", 64, pages + 2, sp.rows_per_page)
    return EndBand(sp, table, 1, pages, direction)


@pytest.mark.parametrize("direction", [+1, -1])
def test_end_band_holes_first_nearest_origin_then_watermark(direction):
    b = _band(direction)
    big = 10**9
    tk = b.plan(6, 0, big)
    b.commit(tk, np.arange(1, 7, dtype=np.int32))
    b.release(np.array([5, 2], np.int32))  # lazy: holes at indices 4 and 1
    assert b.span == 6 and b.nholes == 2 and b.live == 4
    tk = b.plan(3, 0, big)
    assert (tk.holes, tk.low + tk.high) == (2, 1)
    pages = b.commit(tk, np.array([7, 8, 9], np.int32))
    assert b.index(pages).tolist() == [1, 4, 6]  # nearest the anchor first, then the watermark
    assert not b.check() and not b.table.check()


def test_end_band_limited_by_neighbour_frontier():
    b = _band(-1, pages=20)  # pages 1..20, anchor at 20, rows of 24
    rpp = b.rows_per_page
    # a neighbour whose frontier is at row 17*rpp + 5 leaves pages 18..20 only (17 straddles it)
    assert b.plan(3, 17 * rpp + 5, 10**9) is not None
    assert b.plan(4, 17 * rpp + 5, 10**9) is None


def test_end_band_flush_absorbs_then_packs_in_one_batch():
    b = _band(+1)
    b.commit(b.plan(10, 0, 10**9), np.arange(1, 11, dtype=np.int32))
    b.release(np.array([9, 10], np.int32))  # boundary: absorbed, no copy
    assert b.flush() == [] and b.span == 8
    b.release(np.array([1, 3], np.int32))  # holes at indices 0, 2; survivors farthest: 7, 6
    moves = b.flush()
    assert len(moves) == 1
    m = moves[0]
    assert b.index(m.src).tolist() == [6, 7] and sorted(b.index(m.dst).tolist()) == [0, 2]
    assert b.span == 6 and b.nholes == 0 and not b.check() and not b.table.check()


def test_end_band_flush_cap_moves_farthest_first():
    b = _band(-1)
    b.commit(b.plan(12, 0, 10**9), np.arange(1, 13, dtype=np.int32))
    b.release(np.array([1, 2, 3, 4], np.int32))  # 4 holes at the anchor
    moves = b.flush(max_moves=2)
    assert sum(len(m) for m in moves) == 2 and b.span == 10 and b.nholes == 2
    b.flush()
    assert b.span == 8 and b.nholes == 0 and not b.check()


# ------------------------------------------------------------------------------ floats


def _float(lo=1, hi=100):
    sp = make_plan("sw").windows[0]
    return FloatBand(sp, PageTable(sp.name, 200, hi + 1, sp.rows_per_page), lo, hi)


def test_float_from_empty_at_midpoint_and_transparent_when_empty():
    f = _float()
    r = f.rows_per_page
    tk = f.plan(4, 10 * r, 50 * r)
    assert tk.start == 10 + (40 - 4) // 2
    f.commit(tk, np.arange(1, 5, dtype=np.int32))
    assert f.extent() == (28 * r, 32 * r)
    f.release(np.arange(1, 5, dtype=np.int32))
    assert f.extent() is None and f.lo == f.hi == 0 and not f.check()


def test_float_extends_toward_larger_gap_then_other_side():
    f = _float()
    r = f.rows_per_page
    f.commit(f.plan(4, 20 * r, 30 * r), np.arange(1, 5, dtype=np.int32))  # [23, 27)
    tk = f.plan(5, 20 * r, 40 * r)  # low room 3, high room 13
    assert (tk.low, tk.high) == (0, 5)
    tk = f.plan(16, 20 * r, 40 * r)
    assert (tk.low, tk.high) == (3, 13)
    assert f.plan(17, 20 * r, 40 * r) is None


def test_float_counts_pages_on_its_own_grid():
    f = _float()
    r = f.rows_per_page
    # frontiers off this grid: rows [10r + 1, 14r - 1) hold only pages 11 and 12
    assert f.plan(2, 10 * r + 1, 14 * r - 1) is not None
    assert f.plan(3, 10 * r + 1, 14 * r - 1) is None


def test_make_room_moves_just_enough_pages():
    f = _float()
    r = f.rows_per_page
    f.commit(f.plan(8, 20 * r, 36 * r), np.arange(1, 9, dtype=np.int32))  # [24, 32)
    moves = f.make_room("low", 6 * r, 20 * r, 60 * r)  # span must start at 26 -> move 2 pages up
    assert sum(len(m) for m in moves) == 2
    assert (f.lo, f.hi) == (26, 34) and not f.check() and not f.table.check()
    assert f.make_room("low", 6 * r, 20 * r, 60 * r) == []  # already there
    moves = f.make_room("high", 30 * r, 20 * r, 60 * r)  # span must end at 30 -> 4 pages down
    assert sum(len(m) for m in moves) == 4 and f.hi <= 30 and not f.check()


def test_make_room_refuses_without_changing_anything():
    f = _float()
    r = f.rows_per_page
    f.commit(f.plan(8, 20 * r, 36 * r), np.arange(1, 9, dtype=np.int32))
    before = f.table.v2p.copy()
    assert f.make_room("low", 10 * r, 20 * r, 37 * r) is None  # 8 live pages cannot fit in [30, 37)
    assert (f.table.v2p == before).all() and (f.lo, f.hi) == (24, 32)


def test_leapfrog_with_overlap_uses_ordered_batches_and_data_follows():
    f = _float()
    f.commit(f.plan(10, 0, 60 * f.rows_per_page), np.arange(1, 11, dtype=np.int32))
    pages = f.table.v2p[1:11].copy()
    mem = np.zeros(200, np.int64)
    mem[pages] = np.arange(1, 11)  # page -> the id whose bytes it holds
    moves = f.relocate(f.lo + 3)  # overlapping shift by 3
    assert len(moves) == 4
    for m in moves:
        assert not np.isin(m.dst, m.src).any()
        mem[m.dst] = mem[m.src].copy()
    assert (mem[f.table.v2p[1:11]] == np.arange(1, 11)).all()
    assert not f.check() and not f.table.check()


def test_make_room_leapfrogs_whole_span_when_needed():
    f = _float()
    r = f.rows_per_page
    f.commit(f.plan(4, 10 * r, 18 * r), np.arange(1, 5, dtype=np.int32))  # [12, 16)
    moves = f.make_room("low", 20 * r, 10 * r, 60 * r)  # needs start >= 30: nothing can stay
    assert sum(len(m) for m in moves) == 4 and f.lo >= 30 and not f.check()
    assert f.lo == 30 + (60 - 30 - 4) // 2  # centred in what is left


def test_float_holes_alternate_ends_and_absorb_and_compact():
    f = _float()
    f.commit(f.plan(10, 0, 60 * f.rows_per_page), np.arange(1, 11, dtype=np.int32))
    lo = f.lo
    f.release(np.array([2, 3, 9], np.int32))  # holes lo+1, lo+2, lo+8
    assert f.absorb() == 0
    a = f.commit(f.plan(1, 0, 10**9), np.array([11], np.int32))
    b = f.commit(f.plan(1, 0, 10**9), np.array([12], np.int32))
    assert a.tolist() == [lo + 1] and b.tolist() == [lo + 8]  # low end, then high end
    f.release(np.array([10, 1], np.int32))  # both span ends: absorbable
    assert f.absorb() == 2 and (f.lo, f.hi) == (lo + 1, lo + 9)
    moves = f.compact("high")  # pack toward low: the hole at lo+2 is filled from the top
    assert sum(len(m) for m in moves) == 1 and f.nholes == 0 and (f.lo, f.hi) == (lo + 1, lo + 8)
    assert not f.check() and not f.table.check()


# ------------------------------------------------------------------------------ chain


def test_end_band_grows_through_empty_float_not_through_live_one():
    p = make_plan("sw")
    a = ChainAllocator(p, 2000)
    n = a.available_state_slots()
    s = a.alloc_state_slots(n)  # an empty float is transparent: state may take everything
    assert s is not None and a.alloc_token_pages(1) is None
    a.free_state_slots(s)
    a.check_invariants()
    v = a.alloc_token_pages(3)  # the window float now sits at the midpoint
    ext = a.bands[1].extent()
    s = a.alloc_state_slots(a.available_state_slots())
    assert a.bands[0].extent()[1] <= ext[0] or a.bands[1].extent() != ext  # moved or stopped below it
    a.check_invariants()
    assert a.leaks(v, s) == {}


def test_paired_joint_capacity_is_exact():
    for kind in ("w", "sw", "wv", "swv"):
        p = make_plan(kind)
        a = ChainAllocator(p, 3000)
        n = a.available_token_pages()
        per_page = sum(sp.rows_per_page for sp in p.token_pools)
        assert n <= (3000 - p.sink_rows) // per_page
        assert n >= (3000 - p.sink_rows) // per_page - len(p.subpools)  # only grid slivers lost
        v = a.alloc_token_pages(n)
        assert v is not None and v.size == n
        assert a.alloc_token_pages(1) is None and a.last_shortfall is not None
        assert "asked" in str(a.last_shortfall)
        a.check_invariants()


def test_window_pages_option_and_tombstones():
    p = make_plan("wv")
    a = ChainAllocator(p, 3000)
    w, v = p.windows[0].name, p.windows[1].name
    vids = a.alloc_token_pages(6, {w: 2, v: 0})
    full = a.translate_pages(vids[None], "full")[0]
    assert (full > 0).all()
    assert (a.translate_pages(vids[None], w)[0] > 0).tolist() == [False] * 4 + [True] * 2
    assert (a.translate_pages(vids[None], v)[0] == 0).all()
    a.release_window_pages(vids[4:5], w)
    assert a.translate_pages(vids[None], w)[0].tolist()[4] == 0
    assert a.bands[a.layout.index[w]].live == 1
    with pytest.raises(ValueError):
        a.release_window_pages(vids[4:5], w)  # already tombstoned
    assert a.bind_window_pages(vids[:2], v)  # rebinding tombstoned pages
    a.check_invariants()
    a.free_token_pages(vids)
    for sp in p.token_pools:
        assert a.bands[a.layout.index[sp.name]].live == 0
    a.check_invariants()


def test_free_errors_are_clear_and_change_nothing():
    p = make_plan("sw")
    a = ChainAllocator(p, 2000)
    v = a.alloc_token_pages(3)
    a.free_token_pages(v[:1])
    with pytest.raises(ValueError, match="double free"):
        a.free_token_pages(v[:2])
    with pytest.raises(ValueError, match="repeated"):
        a.free_token_pages([v[1], v[1]])
    with pytest.raises(ValueError, match="out of range"):
        a.free_state_slots([10**6])
    with pytest.raises(ValueError, match="not a window"):
        a.release_window_pages(v[1:], "full")
    a.check_invariants()
    assert a.live_token_pages().tolist() == sorted(v[1:].tolist())


def test_shortfall_ladder_flush_then_float_move():
    p = make_plan("sw")
    a = ChainAllocator(p, 2400)
    arena = Arena(a)
    slots = a.alloc_state_slots(40)
    arena.apply()
    arena.write("state", slots)
    toks = [alloc_write(arena, 2) for _ in range(12)]
    # free every other request: holes everywhere, then ask for all that is left jointly
    for v in toks[::2]:
        a.free_token_pages(v)
    a.free_state_slots(slots[::2])
    keep_tok = np.concatenate(toks[1::2])
    n = a.available_token_pages()
    assert a.alloc_token_pages(n + 1) is None and a.take_moves() == []  # hopeless: no copies spent
    v = alloc_write(arena, n)  # needs the ladder: flushes and a float move
    assert a.alloc_token_pages(1) is None
    a.check_invariants()
    for sp in p.token_pools:
        arena.verify(sp.name, keep_tok)
        arena.verify(sp.name, v)
    arena.verify("state", slots[1::2])
    # state asks for rows now held by the float: the float must move up (make room low)
    a.free_token_pages(v)
    s2 = a.alloc_state_slots(a.available_state_slots())
    assert s2 is not None
    arena.apply()
    a.check_invariants()
    for sp in p.token_pools:
        arena.verify(sp.name, keep_tok)


def test_ladder_reaches_layout_with_two_floats():
    p = make_plan("swv")
    a = ChainAllocator(p, 3000)
    arena = Arena(a)
    v1 = alloc_write(arena, 4)  # both floats placed mid-gap
    before = [a.bands[i].extent() for i in (1, 2)]
    m = a.available_state_slots()
    s = a.alloc_state_slots(m)  # only fits once both floats are pushed up against the full band
    assert s is not None and a.alloc_state_slots(1) is None
    arena.apply()
    arena.write("state", s)
    after = [a.bands[i].extent() for i in (1, 2)]
    assert after[0][0] > before[0][0] and after[1][0] > before[1][0]
    a.check_invariants()
    for sp in p.token_pools:
        arena.verify(sp.name, v1)
    a.free_state_slots(s[: m // 2])
    n = a.available_token_pages()
    assert n > 0
    v2 = alloc_write(arena, n)  # the floats move back down into the freed state rows
    a.check_invariants()
    for sp in p.token_pools:
        arena.verify(sp.name, np.concatenate([v1, v2]))
    arena.verify("state", s[m // 2:])


def test_static_mode_never_crosses_regions():
    p = make_plan("sw")
    regions = {"state": (0, 600), p.windows[0].name: (600, 1200), "full": (1200, 2400)}
    a = ChainAllocator(p, 2400, static_regions=regions)
    s = a.alloc_state_slots(a.available_state_slots())
    assert s is not None and a.bands[0].extent()[1] <= 600
    n = a.available_token_pages()
    v = a.alloc_token_pages(n)
    assert v is not None
    for i, b in enumerate(a.bands):
        lo, hi = b.extent()
        assert regions[b.name][0] <= lo and hi <= regions[b.name][1]
    assert n == 50  # full region: pages 50..99 of 24 rows; the window region holds 75 pages of 8
    a.free_state_slots(s)
    assert a.alloc_token_pages(1) is None  # freed state rows stay the state's
    a.check_invariants()
    with pytest.raises(ValueError, match="overlap"):
        ChainAllocator(p, 2400, static_regions={**regions, "full": (1100, 2400)})


def test_static_mode_with_sizing_regions():
    from umem_jax.memory.sizing import static_regions

    for kind in ("sw", "swv"):
        p = make_plan(kind)
        a = ChainAllocator(p, 5000, static_regions=static_regions(p, 5000))
        v = a.alloc_token_pages(a.available_token_pages())
        s = a.alloc_state_slots(a.available_state_slots())
        assert v is not None and s is not None and v.size > 0 and s.size > 0
        assert a.alloc_token_pages(1) is None and a.alloc_state_slots(1) is None
        a.check_invariants()


def test_eager_mode_leaves_no_holes():
    p = make_plan("sw")
    a = ChainAllocator(p, 2400, eager=True)
    arena = Arena(a)
    vs = [alloc_write(arena, 3) for _ in range(6)]
    a.free_token_pages(vs[1])
    a.free_token_pages(vs[3])
    arena.apply()
    assert all(b.nholes == 0 for b in a.bands)
    for sp in p.token_pools:
        arena.verify(sp.name, np.concatenate([vs[0], vs[2], vs[4], vs[5]]))
    a.check_invariants()


def test_usage_report_is_exact():
    p = make_plan("sw")
    a = ChainAllocator(p, 2400)
    v = a.alloc_token_pages(5)
    s = a.alloc_state_slots(3)
    a.free_token_pages(v[:1])  # a hole in the full band
    u = a.usage()
    rb = p.row_words * 2
    assert u.total_bytes == 2400 * rb and u.sink_bytes == p.sink_rows * rb
    assert u.subpools["full"].held == 4 and u.subpools["full"].held_bytes == 4 * p.full.page_bytes
    assert u.subpools["state"].held == 3
    live = 4 * p.full.rows_per_page + 4 * p.windows[0].rows_per_page + 3 * p.state.rows_per_page
    assert u.live_bytes == live * rb
    assert u.live_bytes + u.hole_bytes + u.free_bytes + u.sink_bytes == u.total_bytes
    assert u.token_pages_available == a.available_token_pages() > 0
    assert a.leaks(v[1:], s) == {}
    assert set(a.leaks(v[2:], s)) == {"token allocated but held by nobody"}


def test_check_invariants_catches_corruption():
    a = ChainAllocator(make_plan("sw"), 2000)
    v = a.alloc_token_pages(3)
    a.check_invariants()
    a.bands[-1].table.p2v[a.bands[-1].table.v2p[v[0]]] = v[1]
    with pytest.raises(AssertionError, match="inverse"):
        a.check_invariants()
