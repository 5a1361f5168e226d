"""The state grid starts at the sink (issue 17, item 3): the sink is the largest *paged* page,
state slot 1 starts right after it, slot 0 has no rows of its own.

Host: the real-shaped presets gain the state slot the old sink charged.  Device (CPU, reference
and Pallas interpret): every real slot written, relocated, copied and handed off keeps its bytes
under its id, and nothing outside the live slots is touched (the arena is poisoned, so a stray
write -- e.g. slot 0's would-be rows wrapping below row 0 onto the arena's top -- shows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from umem_jax import arena as am
from umem_jax.memory import ChainAllocator, full_attention, plan, recurrent_state, size_arena, window_attention
from umem_jax.memory.declarations import StateTensor, mamba2_state_tensors
from umem_jax.memory.sizing import budget_bytes
from umem_jax.models.presets import shape_decls

POISON = 0xFFFF


@pytest.mark.parametrize("name,gib", [("qwen3.5-4b-like", 4), ("nemotronh-8b-like", 3)])
def test_presets_sink_is_a_kv_page_and_the_slot_comes_back(name, gib):
    """Qwen3.5-4B- and NemotronH-8B-shaped plans at the docs' arena sizes: the sink was one whole
    state slot (1.2% / 3.2% of the arena); now it is the largest K/V page, and the state sub-pool
    alone holds one slot more (counted by the allocator itself, not only by sizing)."""
    p = plan(shape_decls(name), page_size=16)
    size = size_arena(p, budget_bytes(fixed_bytes=gib << 30, plan=p))
    st, n = p.state, size.num_rows
    paged = max(sp.rows_per_page for sp in p.subpools if sp.kind != "state")
    assert p.sink_rows == paged < st.rows_per_page
    old_sink_rows, old_slots = st.rows_per_page, n // st.rows_per_page - 1  # the grid from row 0, slot 0 charged
    assert old_sink_rows / n > (0.03 if "nemotron" in name else 0.01) > p.sink_rows / n * 10
    new_slots = (n - p.sink_rows) // st.rows_per_page
    assert size.pages_alone["state"] == new_slots == old_slots + 1
    alloc = ChainAllocator(p, n)
    assert alloc.available_state_slots() == new_slots
    vids = alloc.alloc_state_slots(new_slots)
    assert vids is not None and alloc.alloc_state_slots(1) is None
    phys = alloc.translate_slots(vids)
    assert sorted(phys.tolist()) == list(range(1, new_slots + 1))
    assert st.page_row(1) == p.sink_rows and st.page_row(new_slots + 1) <= n
    alloc.check_invariants()
    assert alloc.usage().sink_bytes == p.sink_rows * size.row_bytes


def _plan(big_slot: bool):
    """state + window 32 + full, 64-word rows, page size 4: K/V pages of 8 and 16 rows (sink 16);
    a state slot of 42 rows (grid base below row 0) or of 4 rows (base above it)."""
    st = mamba2_state_tensors(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4) if big_slot \
        else (StateTensor("h", (64,), "float32"), StateTensor("c", (64,), "bfloat16"))
    return plan([recurrent_state(0, st), window_attention(1, 32, 1, 64), full_attention(2, 2, 64)],
                page_size=4, row_words=64)


def _pattern(view, vids):
    """{name: [n, *shape]}: distinct exact values per virtual id (fp32 through two planes)."""
    out = {}
    for k, t in enumerate(view.tensors):
        numel = int(np.prod(t.tensor.shape))
        x = np.asarray(vids, np.float32)[:, None] * 1000 + k * 100 + np.arange(numel, dtype=np.float32)[None] / 8
        out[t.tensor.name] = jnp.asarray(x.reshape(len(vids), *t.tensor.shape), t.tensor.dtype)
    return out


def _check_slots(a, alloc, view, live, impl):
    """Every live virtual slot reads back its own pattern through the tables."""
    ids = np.asarray(sorted(live), np.int32)
    got = am.read_state(a, jnp.asarray(alloc.translate_slots(ids)), layer=0, impl=impl, interpret=impl == "pallas")
    want = _pattern(view, ids)
    for name, x in want.items():
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), np.asarray(x, np.float32), err_msg=name)


def _poisoned(p, num_rows):
    return am.Arena.create(p, num_rows).replace(jnp.full((num_rows, p.row_words), POISON, jnp.uint16))


def _untouched(a, lo, hi):
    rows = np.asarray(a.data)[lo:hi]
    bad = np.nonzero((rows != POISON).any(axis=1))[0]
    assert bad.size == 0, f"rows {(bad + lo)[:8].tolist()} outside the state slots were written"


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("big_slot", [True, False], ids=["base-below-0", "base-above-0"])
def test_every_slot_written_and_relocated_keeps_its_bytes(impl, big_slot):
    p = _plan(big_slot)
    st, view = p.state, p.state.state_view(0)
    assert (st.base_row < 0) == big_slot and st.page_row(1) == p.sink_rows
    num_rows = st.page_row(10) + st.rows_per_page - 1  # room for 9 slots and a sliver above them
    alloc = ChainAllocator(p, num_rows)
    n_slots = alloc.available_state_slots()  # up to the empty full band's anchor (its grid's top)
    assert n_slots >= 5 and st.page_row(n_slots + 1) < num_rows
    a = _poisoned(p, num_rows)
    kw = dict(impl=impl, interpret=impl == "pallas")
    vids = alloc.alloc_state_slots(n_slots)
    assert alloc.alloc_state_slots(1) is None
    # every real slot, and a padding lane (slot 0) that must write nowhere
    phys = np.concatenate([alloc.translate_slots(vids), [0]]).astype(np.int32)
    vals = {k: jnp.concatenate([x, jnp.full((1, *x.shape[1:]), 7, x.dtype)]) for k, x in _pattern(view, vids).items()}
    a = am.write_state(a, jnp.asarray(phys), vals, layer=0, **kw)
    _untouched(a, 0, p.sink_rows)
    _untouched(a, st.page_row(n_slots + 1), num_rows)
    live = set(vids.tolist())
    _check_slots(a, alloc, view, live, impl)
    # free every other slot from the bottom, compact (relocations), copy one slot into a new one
    gone = np.asarray(sorted(live)[:n_slots - 1:2], np.int32)
    alloc.free_state_slots(gone)
    live -= set(gone.tolist())
    alloc.flush(urgent=True)
    moves = alloc.take_moves()
    assert sum(len(m) for m in moves) > 0, "the compaction moved no slot"
    a = am.apply_moves(a, moves, **kw)  # padded with 0 -> 0 pairs: on the state grid they copy nothing
    _check_slots(a, alloc, view, live, impl)
    new = alloc.alloc_state_slots(1)
    src = max(live)
    alloc.copy_state_slots(np.asarray([src], np.int32), new)
    a = am.apply_moves(a, alloc.take_moves(), **kw)
    got = am.read_state(a, jnp.asarray(alloc.translate_slots(new)), layer=0, **kw)
    for name, x in _pattern(view, [src]).items():
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), np.asarray(x, np.float32))
    _check_slots(a, alloc, view, live, impl)
    _untouched(a, 0, p.sink_rows)
    _untouched(a, st.page_row(n_slots + 1), num_rows)
    alloc.check_invariants()


@pytest.mark.parametrize("big_slot", [True, False], ids=["base-below-0", "base-above-0"])
def test_handoff_envelopes_on_the_state_grid(big_slot):
    """engine/handoff.py's envelope gather / scatter on the state grid: padding lanes (slot 0)
    read nothing that matters and write nowhere (not onto the arena's top rows)."""
    from umem_jax.engine.handoff import read_envelopes, write_envelopes

    p = _plan(big_slot)
    st = p.state
    num_rows = st.page_row(6) + p.full.rows_per_page
    a = _poisoned(p, num_rows)
    rng = np.random.default_rng(0)
    env = rng.integers(0, POISON, (3, st.rows_per_page, p.row_words), dtype=np.uint16)  # 3 of a bucket of 4
    a = write_envelopes(a, np.array([5, 2, 3], np.int32), env, st.name)
    np.testing.assert_array_equal(read_envelopes(a, np.array([2, 5, 3], np.int32), st.name), env[[1, 0, 2]])
    data = np.asarray(a.data)
    for s, e in ((5, env[0]), (2, env[1]), (3, env[2])):
        np.testing.assert_array_equal(data[st.page_row(s):st.page_row(s + 1)], e)
    _untouched(a, 0, st.page_row(2))
    _untouched(a, st.page_row(4), st.page_row(5))
    _untouched(a, st.page_row(6), num_rows)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("big_slot", [True, False], ids=["base-below-0", "base-above-0"])
def test_slot_zero_is_padding_on_the_offset_grid(impl, big_slot):
    """Page moves and zeroing on the state grid: page 0 (padding pairs, padding lanes) touches no
    row.  The arena ends 2 rows past the top slot, so slot 0's would-be rows, wrapped below row 0,
    would land on the top slot -- the one the move writes."""
    p = _plan(big_slot)
    st = p.state
    top = 6
    num_rows = st.page_row(top + 1) + 2
    rng = np.random.default_rng(1)
    host = rng.integers(0, 1 << 16, (num_rows, p.row_words), dtype=np.uint16)
    kw = dict(impl=impl, interpret=impl == "pallas")
    a = am.Arena.create(p, num_rows).replace(jnp.asarray(host))
    a = am.apply_moves(a, [_Move(st.name, np.array([2], np.int32), np.array([top], np.int32))], **kw)  # + 15 pads
    want = host.copy()
    want[st.page_row(top):st.page_row(top + 1)] = host[st.page_row(2):st.page_row(3)]
    np.testing.assert_array_equal(np.asarray(a.data), want)
    a = am.zero_pages(a, jnp.array([0, 3, 0], jnp.int32), subpool=st.name, **kw)
    want[st.page_row(3):st.page_row(4)] = 0
    np.testing.assert_array_equal(np.asarray(a.data), want)


class _Move:
    """memory.tables.Move's duck type (apply_moves reads subpool, src, dst)."""

    def __init__(self, subpool, src, dst):
        self.subpool, self.src, self.dst = subpool, src, dst
