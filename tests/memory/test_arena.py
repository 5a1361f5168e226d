"""Arena: the pytree, in-place writers (compiled-program copy checks), exact data round-trips."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from umem_jax import arena as am
from umem_jax.memory import MHA, Full, LayerDecl, Part, full_attention, plan, recurrent_state, window_attention
from umem_jax.memory.declarations import mamba2_state_tensors

Move = collections.namedtuple("Move", "subpool src dst")  # duck type of memory.tables.Move
SDS = jax.ShapeDtypeStruct
ROWS = 4096


def _plan(kv_dtype="bfloat16"):
    """state (bf16 conv + fp32 ssm), window 64, full; 64-word rows; page size 8."""
    st = mamba2_state_tensors(num_heads=2, head_dim=8, state_size=8, n_groups=1, conv_kernel=4)
    full = LayerDecl(2, (Part(MHA(2, 32, dtype=kv_dtype), Full()),))
    return plan([window_attention(0, 64, 2, 32), recurrent_state(1, st, checkpoint_interval=32), full,
                 full_attention(3, 2, 32) if kv_dtype == "bfloat16" else LayerDecl(3, (Part(MHA(2, 32, dtype=kv_dtype), Full()),))],
                page_size=8, row_words=64)


PLAN = _plan()


def _pages(rng, arena, subpool, n, half=None):
    """n distinct real (non-sink) physical pages of `subpool`, random order; `half` 0/1 keeps
    them in the lower/upper half of the arena, so two sub-pools' grids do not overlap."""
    lo, hi = arena.plan.first_page(arena.plan[subpool]), arena.num_pages(subpool)
    if half is not None:
        mid = hi // 2
        lo, hi = (lo, mid) if half == 0 else (mid, hi)
    return rng.choice(np.arange(lo, hi), size=n, replace=False).astype(np.int32)


def _u16(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


# ---------------------------------------------------------------------------- the pytree


def test_pytree_flatten_unflatten():
    a = am.Arena.create(PLAN, 256)
    leaves, treedef = jax.tree_util.tree_flatten(a)
    assert len(leaves) == 1 and leaves[0] is a.data
    b = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(b, am.Arena) and b.plan == PLAN and b.dtype == jnp.uint16 and b.data is a.data
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
    assert paths == [".data"]
    # unflatten with non-array leaves (what transforms do) does not inspect them
    c = jax.tree_util.tree_unflatten(treedef, [None])
    assert c.data is None and c.plan is PLAN
    # plan and dtype are static: two arenas of different dtype have different treedefs
    bf = am.Arena.create(PLAN, 256, dtype=jnp.bfloat16)
    assert jax.tree_util.tree_structure(bf) != treedef


def test_create_properties_and_fill():
    a = am.Arena.create(PLAN, 512)
    assert (a.num_rows, a.row_words, a.nbytes) == (512, 64, 512 * 64 * 2)
    assert a.data.dtype == jnp.uint16 and not np.asarray(a.data).any()
    d = am.Arena.create(PLAN, 512, debug_nan=True)
    assert (np.asarray(d.data) == 0x7FC0).all()
    b = am.Arena.create(PLAN, 512, dtype=jnp.bfloat16, debug_nan=True)
    assert b.data.dtype == jnp.bfloat16 and np.isnan(np.asarray(b.data, np.float32)).all()
    assert (np.asarray(b.data).view(np.uint16) == 0x7FC0).all()
    assert "uint16[512, 64]" in repr(a)


def test_create_refusals():
    with pytest.raises(ValueError, match="int32"):
        am.Arena.create(PLAN, 2**31)  # refused before anything is allocated
    with pytest.raises(ValueError, match="uint16 or bfloat16"):
        am.Arena.create(PLAN, 256, dtype=jnp.float32)
    with pytest.raises(ValueError, match="sink"):
        am.Arena.create(PLAN, PLAN.sink_rows - 1)
    big = am.Arena.abstract(PLAN, 2**31 - 1)  # shape only: > 2**31 elements, fine
    assert big.nbytes == (2**31 - 1) * 64 * 2


# ------------------------------------------------------------------------ no copy of the arena


def _compiled_writers(ab):
    T, B = 12, 3
    k = SDS((T, 2, 32), jnp.bfloat16)
    i32 = lambda n: SDS((n,), jnp.int32)
    sv = ab.plan.state.state_view(1)
    tensors = {t.tensor.name: SDS((B, *t.tensor.shape), jnp.dtype(t.tensor.dtype)) for t in sv.tensors}
    n_moves = am.move_bucket(5)
    return {
        "write_kv": am.write_kv.lower(ab, k, k, i32(T), i32(T), layer=2).compile(),
        "write_state": am.write_state.lower(ab, i32(B), tensors, layer=1).compile(),
        "move_pages": am.move_pages.lower(ab, i32(n_moves), i32(n_moves), subpool="full").compile(),
        "zero_pages": am.zero_pages.lower(ab, i32(4), subpool="window64").compile(),
    }


# NOTE: with a bf16 arena the plain-JAX references work on its uint16 view (so fp32 lo planes that
# look like bf16 NaNs keep their bits), and XLA:CPU's MLIR fusion emitters materialise that
# whole-arena same-width bitcast-convert as a copy (jax 0.10.2); its loop emitters, which the
# tests' conftest picks for compile speed, keep it in place (so this passes there).  uint16, the
# default, stays in place either way.
BF16_COPIES = pytest.mark.xfail(jax.default_backend() == "cpu", strict=False,
                                reason="XLA:CPU copies a bf16 arena for its uint16 view")


@pytest.mark.parametrize("dtype", [jnp.uint16, pytest.param(jnp.bfloat16, marks=BF16_COPIES)])
def test_writers_compile_in_place(dtype):
    ab = am.Arena.abstract(PLAN, 8 * ROWS, dtype)
    page = PLAN.full.page_bytes
    for name, c in _compiled_writers(ab).items():
        # move/zero materialise the moved pages (+ index vectors): bounded by the pages, not the arena
        seen = am.check_in_place(c, ab, max_temp_bytes=4 * 16 * page)
        assert seen["alias_bytes"] >= ab.nbytes, name


def test_copy_check_catches_copies():
    ab = am.Arena.abstract(PLAN, ROWS)

    def write_then_read_old(arena, pages):  # reads the OLD arena after a newer one exists
        new = am.zero_pages(arena, pages, subpool="full")
        return new, arena.data[pages * 16].sum()

    i32 = SDS((4,), jnp.int32)
    bad = jax.jit(write_then_read_old, donate_argnames=("arena",)).lower(ab, i32).compile()
    with pytest.raises(AssertionError):
        am.check_in_place(bad, ab)
    not_donated = jax.jit(lambda a, p: am.zero_pages(a, p, subpool="full")).lower(ab, i32).compile()
    with pytest.raises(AssertionError, match="not aliased"):
        am.check_in_place(not_donated, ab)


def test_pointer_unchanged_after_donated_calls():
    rng = np.random.default_rng(0)
    a = am.Arena.create(PLAN, ROWS)
    p0 = a.data.unsafe_buffer_pointer()
    T = 8
    k = jnp.asarray(rng.standard_normal((T, 2, 32)), jnp.bfloat16)
    pages = jnp.asarray(_pages(rng, a, "full", T))
    slots = jnp.zeros(T, jnp.int32)
    old = a
    a = am.write_kv(a, k, k, pages, slots, layer=2)
    assert old.data.is_deleted() and a.data.unsafe_buffer_pointer() == p0
    sv = PLAN.state.state_view(1)
    tensors = {t.tensor.name: jnp.ones((2, *t.tensor.shape), t.tensor.dtype) for t in sv.tensors}
    a = am.write_state(a, jnp.array([3, 4], jnp.int32), tensors, layer=1)
    a = am.zero_pages(a, pages[:2], subpool="full")
    a = am.move_pages(a, pages[:2], pages[2:4], subpool="full")
    a = am.apply_moves(a, [Move("full", pages[4:6], pages[6:8]), Move("window64", [5], [6])])
    assert a.data.unsafe_buffer_pointer() == p0


# ------------------------------------------------------------------------------ round-trips


@pytest.mark.parametrize("dtype", [jnp.uint16, jnp.bfloat16])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_kv_round_trip(dtype, kv_dtype):
    p = _plan(kv_dtype)
    rng = np.random.default_rng(1)
    a = am.Arena.create(p, ROWS, dtype=dtype, debug_nan=True)
    ps, n_pages = p.page_size, 5
    layer_pages = {}
    want = {}
    full_pages = _pages(rng, a, "full", n_pages, half=1)  # full layers share token pages
    for layer, pool in ((0, "window64"), (2, "full"), (3, "full")):
        pg = full_pages if pool == "full" else _pages(rng, a, pool, n_pages, half=0)
        layer_pages[layer] = pg
        T = n_pages * ps - 3  # the last page keeps 3 unwritten slots
        pages = np.repeat(pg, ps)[:T]
        slots = np.tile(np.arange(ps), n_pages)[:T].astype(np.int32)
        order = rng.permutation(T)  # rows arrive in any order
        vdt = np.float32 if (kv_dtype == "float32" and pool == "full") else jnp.bfloat16
        k = (rng.standard_normal((T, 2, 32)) * 10).astype(vdt)
        v = (rng.standard_normal((T, 2, 32)) * 1e-3).astype(vdt)
        a = am.write_kv(a, jnp.asarray(k[order]), jnp.asarray(v[order]), jnp.asarray(pages[order]),
                        jnp.asarray(slots[order]), layer=layer)
        want[layer] = (k, v, T)
    for layer, (k, v, T) in want.items():
        kk, vv = am.read_kv(a, jnp.asarray(layer_pages[layer][None]), layer=layer)
        assert kk.shape == (1, n_pages * ps, 2, 32)
        np.testing.assert_array_equal(_u16(kk[0, :T]), _u16(k))
        np.testing.assert_array_equal(_u16(vv[0, :T]), _u16(v))
        assert np.isnan(np.asarray(kk[0, T:], np.float32)).all()  # debug fill shows in unwritten slots
        assert np.isnan(np.asarray(vv[0, T:], np.float32)).all()


def test_read_kv_explicit_view_and_errors():
    a = am.Arena.create(PLAN, 1024)
    view = PLAN.full.kv_view(3)
    k1, _ = am.read_kv(a, jnp.zeros((2, 3), jnp.int32), view=view)
    assert k1.shape == (2, 24, 2, 32)
    with pytest.raises(ValueError, match="layer= or view="):
        am.read_kv(a, jnp.zeros((1, 1), jnp.int32))
    with pytest.raises(KeyError, match="attention rows of layer target:1"):
        am.read_kv(a, jnp.zeros((1, 1), jnp.int32), layer=1)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_state_round_trip_fp32_planes(impl):
    rng = np.random.default_rng(2)
    a = am.Arena.create(PLAN, 1024, debug_nan=True)
    sv = PLAN.state.state_view(1)
    n_slots = a.num_pages("state")
    slots = rng.choice(np.arange(1, n_slots), size=4, replace=False).astype(np.int32)
    tensors = {}
    for t in sv.tensors:
        x = rng.standard_normal((4, *t.tensor.shape)) * np.float32(10.0) ** rng.integers(-30, 30, (4, *t.tensor.shape))
        tensors[t.tensor.name] = np.asarray(x, np.float32).astype(t.tensor.dtype)
    tensors["ssm"].reshape(-1)[:3] = [np.float32(1e-45), np.float32(-0.0), np.float32(3.4e38)]  # denormal, -0, big
    a = am.write_state(a, jnp.asarray(slots), {n: jnp.asarray(x) for n, x in tensors.items()}, layer=1, impl=impl,
                       interpret=impl == "pallas")
    got = am.read_state(a, jnp.asarray(slots), layer=1, impl=impl, interpret=impl == "pallas")
    for name, x in tensors.items():
        assert got[name].dtype == x.dtype
        np.testing.assert_array_equal(_u16(got[name]), _u16(x))  # bit-exact, fp32 through two planes
    unwritten = next(s for s in range(1, n_slots) if s not in slots)
    fresh = am.read_state(a, jnp.array([unwritten], jnp.int32), layer=1)
    assert np.isnan(np.asarray(fresh["ssm"])).all() and np.isnan(np.asarray(fresh["conv"], np.float32)).all()


def test_move_and_zero_pages():
    rng = np.random.default_rng(3)
    a = am.Arena.create(PLAN, ROWS)
    host = rng.integers(0, 2**16, size=(ROWS, 64), dtype=np.uint16)
    a = a.replace(jnp.asarray(host))
    rpp = PLAN.full.rows_per_page
    src, dst, zero = np.split(_pages(rng, a, "full", 9), 3)
    a = am.move_pages(a, jnp.asarray(src), jnp.asarray(dst), subpool="full")
    a = am.zero_pages(a, jnp.asarray(zero), subpool="full")
    want = host.copy()
    for s, d in zip(src, dst):
        want[d * rpp:(d + 1) * rpp] = host[s * rpp:(s + 1) * rpp]
    for z in zero:
        want[z * rpp:(z + 1) * rpp] = 0
    np.testing.assert_array_equal(np.asarray(a.data), want)


def test_apply_moves_in_order_and_padded(monkeypatch):
    rng = np.random.default_rng(4)
    host = rng.integers(0, 2**16, size=(ROWS, 64), dtype=np.uint16)
    a = am.Arena.create(PLAN, ROWS).replace(jnp.asarray(host))
    # batch 2 moves what batch 1 just wrote (a chain across batches: order matters)
    moves = [Move("full", np.array([10, 11, 12], np.int32), np.array([20, 21, 22], np.int32)),
             Move("full", np.array([20, 21], np.int32), np.array([30, 31], np.int32)),
             Move("window64", np.array([], np.int32), np.array([], np.int32)),
             Move("window64", np.arange(40, 57, dtype=np.int32), np.arange(60, 77, dtype=np.int32))]
    want = host.copy()
    for m in moves:
        rpp = PLAN[m.subpool].rows_per_page
        for s, d in zip(m.src, m.dst):
            want[d * rpp:(d + 1) * rpp] = want[s * rpp:(s + 1) * rpp]
    seen = []
    real = am.move_pages

    def spy(arena, src, dst, **kw):
        seen.append(len(src))
        return real(arena, src, dst, **kw)

    monkeypatch.setattr(am, "move_pages", spy)
    a = am.apply_moves(a, moves, PLAN)
    assert seen == [16, 16, 32]  # padded to buckets with 0 -> 0 pairs; empty batch skipped
    np.testing.assert_array_equal(np.asarray(a.data), want)


def test_apply_moves_refuses_bad_batches():
    a = am.Arena.create(PLAN, ROWS)
    for bad in (Move("full", [3, 4], [5, 5]),          # repeated destination
                Move("full", [3, 4], [4, 6]),          # a destination that is a source
                Move("full", [3], [10**6]),            # off the arena
                Move("full", [0], [7])):               # out of the sink
        with pytest.raises(ValueError):
            am.apply_moves(a, [bad])
        assert not a.data.is_deleted()  # refused on the host: nothing was donated
    with pytest.raises(ValueError, match="plan"):
        am.apply_moves(a, [], _plan("float32"))
    assert [am.move_bucket(n) for n in (1, 16, 17, 33, 4096, 4097)] == [16, 16, 32, 64, 4096, 8192]


# ------------------------------------------------------------------------- a user's own jit


def test_user_jit_with_donation():
    rng = np.random.default_rng(5)

    @functools.partial(jax.jit, donate_argnames=("arena",))
    def step(arena: am.Arena, k, v, pages, slots, page_table):
        arena = am.write_kv(arena, k, v, pages, slots, layer=3)     # write first ...
        k_all, _ = am.read_kv(arena, page_table, layer=3)          # ... then read the new arena
        return arena, k_all.astype(jnp.float32).sum()

    a = am.Arena.create(PLAN, ROWS)
    T = 8
    pg = _pages(rng, a, "full", 1)
    k = jnp.asarray(rng.standard_normal((T, 2, 32)), jnp.bfloat16)
    args = (k, k, jnp.asarray(np.repeat(pg, T)), jnp.arange(T, dtype=jnp.int32), jnp.asarray(pg[None]))
    am.check_in_place(step.lower(a, *args).compile(), a)
    p0 = a.data.unsafe_buffer_pointer()
    a, s = step(a, *args)
    assert a.data.unsafe_buffer_pointer() == p0 and isinstance(a, am.Arena) and a.plan == PLAN
    np.testing.assert_allclose(float(s), float(k.astype(jnp.float32).sum()), rtol=1e-5)


# ------------------------------------------------------------- with the host allocator


def test_data_follows_ids_through_allocator_moves():
    """Random allocs/frees/compactions by the ChainAllocator; after applying its moves, every live
    virtual page and slot reads back exactly what was last written to it.  Batches are padded
    with the sink (page/slot 0) to fixed shapes, as the engine does, so nothing recompiles."""
    chain = pytest.importorskip("umem_jax.memory.chain")
    rng = np.random.default_rng(6)
    ca = chain.ChainAllocator(PLAN, ROWS)
    a = am.Arena.create(PLAN, ROWS, debug_nan=True)
    ps, sv = PLAN.page_size, PLAN.state.state_view(1)
    NP, NS, WIDTH = 12, 4, 64  # pages and slots per write, page-table width of the reads
    pages_kv, slots_st, n_moves = {}, {}, 0
    tok_slots = jnp.asarray(np.tile(np.arange(ps, dtype=np.int32), NP))
    for step in range(6):
        vids = ca.alloc_token_pages(int(rng.integers(4, NP + 1)))
        sids = ca.alloc_state_slots(int(rng.integers(1, NS + 1)))
        assert vids is not None and sids is not None
        moves = ca.take_moves()  # a page may have been vacated for us: copy before writing
        n_moves += sum(len(m.src) for m in moves)
        a = am.apply_moves(a, moves)
        for layer, pool in ((0, "window64"), (2, "full")):
            phys = ca.translate_pages(vids[None], pool, NP)[0]  # sink-padded to NP
            kv = rng.standard_normal((2, NP * ps, 2, 32)).astype(jnp.bfloat16)
            a = am.write_kv(a, jnp.asarray(kv[0]), jnp.asarray(kv[1]), jnp.asarray(np.repeat(phys, ps)),
                            tok_slots, layer=layer)
            for j, v in enumerate(vids):
                pages_kv[(layer, int(v))] = kv[:, j * ps:(j + 1) * ps]
        st = {t.tensor.name: rng.standard_normal((NS, *t.tensor.shape)).astype(t.tensor.dtype) for t in sv.tensors}
        a = am.write_state(a, jnp.asarray(ca.translate_slots(sids, NS)), {n: jnp.asarray(x) for n, x in st.items()},
                           layer=1)
        for j, s in enumerate(sids):
            slots_st[int(s)] = {n: x[j] for n, x in st.items()}
        # free a random half of what is live, then compact
        gone = [v for v in sorted({v for _, v in pages_kv}) if rng.random() < 0.5]
        ca.free_token_pages(np.asarray(gone, np.int32))
        pages_kv = {k: x for k, x in pages_kv.items() if k[1] not in gone}
        gone_s = [s for s in slots_st if rng.random() < 0.5]
        ca.free_state_slots(np.asarray(gone_s, np.int32))
        slots_st = {s: x for s, x in slots_st.items() if s not in gone_s}
        ca.flush(urgent=bool(step % 2))
        moves = ca.take_moves()
        n_moves += sum(len(m.src) for m in moves)
        a = am.apply_moves(a, moves)
        for layer, pool in ((0, "window64"), (2, "full")):
            live = np.asarray(sorted(v for (l, v) in pages_kv if l == layer), np.int32)
            phys = ca.translate_pages(live[None], pool, WIDTH)
            k, v = am.read_kv(a, jnp.asarray(phys), layer=layer)
            for j, vid in enumerate(live):
                want = pages_kv[(layer, int(vid))]
                np.testing.assert_array_equal(_u16(k[0, j * ps:(j + 1) * ps]), _u16(want[0]))
                np.testing.assert_array_equal(_u16(v[0, j * ps:(j + 1) * ps]), _u16(want[1]))
        ids = np.asarray(sorted(slots_st), np.int32)
        got = am.read_state(a, jnp.asarray(ca.translate_slots(ids, WIDTH)), layer=1)
        for j, sid in enumerate(ids):
            for n, x in slots_st[int(sid)].items():
                np.testing.assert_array_equal(_u16(got[n][j]), _u16(x))
    ca.check_invariants()
    assert n_moves > 0  # the allocator did relocate pages, and the data followed
