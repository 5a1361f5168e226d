"""Holes are reused before the gap grows (issue 17, item 3), in every kind of band: the grow-up
end (state slots), a float (window pages) and the grow-down end (full-attention pages), unified
and static.  Free requests from the middle of each band (lazy: their pages become holes), then
allocate again: the new ids land exactly on the freed pages, no band's span moves, the free gap
is unchanged and nothing is copied; asking for more than the holes takes every hole and grows
the gap side by the remainder only."""

from __future__ import annotations

import numpy as np
import pytest

from umem_jax.memory import ChainAllocator, size_arena, static_regions
from umem_jax.memory import plan as make_plan
from umem_jax.models.tiny import TinyHybrid, tiny_config


def _allocator(mode: str) -> ChainAllocator:
    p = make_plan(TinyHybrid.decls(tiny_config(), "float32"), page_size=4)
    rows = size_arena(p, 1 << 20).num_rows
    assert [(sp.kind, sp.role) for sp in p.subpools] == [("state", "up"), ("window", "float"), ("full", "down")]
    return ChainAllocator(p, rows, static_regions=static_regions(p, rows) if mode == "static" else None)


def _physical(a: ChainAllocator, tokens, slots) -> dict[str, set[int]]:
    """The physical pages of token ids `tokens` in every token band, and of state slots `slots`."""
    out = {b.name: set(a.translate_pages(np.asarray(tokens, np.int32), b.name).tolist())
           for b in a.bands if b.subpool.kind != "state"}
    out[a.bands[0].name] = set(a.translate_slots(np.asarray(slots, np.int32)).tolist())
    return out


@pytest.mark.parametrize("mode", ["unified", "static"])
def test_holes_are_taken_before_the_gap_grows(mode):
    a = _allocator(mode)
    tokens = [a.alloc_token_pages(5) for _ in range(6)]  # every id with its window page
    slots = [a.alloc_state_slots(2) for _ in range(6)]
    a.take_moves()
    freed_tokens, freed_slots = np.concatenate(tokens[1:4:2]), np.concatenate(slots[1:4:2])
    freed = _physical(a, freed_tokens, freed_slots)
    before = a.usage()
    a.free_token_pages(freed_tokens)
    a.free_state_slots(freed_slots)
    extents = [b.extent() for b in a.bands]
    assert all(b.nholes == len(freed[b.name]) == 10 if b.subpool.kind != "state" else b.nholes == 4 for b in a.bands)
    gap = a.usage().free_bytes

    again_tokens, again_slots = a.alloc_token_pages(10), a.alloc_state_slots(4)
    assert _physical(a, again_tokens, again_slots) == freed  # exactly the holes, in every band
    after = a.usage()
    assert [b.extent() for b in a.bands] == extents and all(b.nholes == 0 for b in a.bands)
    assert after.free_bytes == gap == before.free_bytes and after.hole_bytes == 0
    assert after.live_bytes == before.live_bytes and not a.take_moves()
    a.check_invariants()

    # more than the holes: every hole first, then the span grows by the remainder alone
    a.free_token_pages(again_tokens[:3])
    a.free_state_slots(again_slots[:1])
    more_tokens, more_slots = a.alloc_token_pages(5), a.alloc_state_slots(3)
    assert all(b.nholes == 0 for b in a.bands) and not a.take_moves()
    grown = [(hi - lo) - (e[1] - e[0]) for b, e in zip(a.bands, extents) for lo, hi in [b.extent()]]
    rows = [b.rows_per_page for b in a.bands]
    assert grown == [2 * rows[0], 2 * rows[1], 2 * rows[2]]
    assert a.usage().free_bytes == gap - sum(grown) * a.row_bytes
    a.check_invariants()
