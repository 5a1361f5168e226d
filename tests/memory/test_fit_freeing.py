"""ChainAllocator.can_fit(..., freed=): whether a need fits once some live pages were released,
asked before releasing them (the prefix cache's evictable entries, checked before evicting).

On random arenas (unified lazy / eager and static, with windows and state) the answer must equal
can_fit after actually releasing those pages, for random needs."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from umem_jax.memory import ChainAllocator

from test_allocator_machine import PLANS, static_regions


def _fill(a: ChainAllocator, plan, rng) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random groups of token pages (some with window pages released) and state slots, until
    an allocation fails -> the groups."""
    groups = []
    for _ in range(200):
        n = int(rng.integers(1, 12))
        vids = a.alloc_token_pages(n)
        slots = a.alloc_state_slots(int(rng.integers(0, 3))) if plan.state is not None else np.empty(0, np.int32)
        if vids is None or slots is None:
            break
        for w in plan.windows:  # a window keeps only its last pages
            k = int(rng.integers(0, n + 1))
            if k:
                a.release_window_pages(vids[:k], w.name)
        groups.append((vids, slots))
        if rng.random() < 0.25 and groups:  # some traffic, so bands have holes
            v, s = groups.pop(int(rng.integers(len(groups))))
            a.free_token_pages(v)
            if s.size:
                a.free_state_slots(s)
    return groups


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["sw", "swv", "wv", "s"]), mode=st.sampled_from(["lazy", "eager", "static"]),
       rows=st.integers(600, 2500), seed=st.integers(0, 2**31 - 1))
def test_fit_once_freed_equals_fit_after_freeing(kind, mode, rows, seed):
    rng = np.random.default_rng(seed)
    plan = PLANS[kind]
    regions = static_regions(plan, rows, [1 + int(x) for x in rng.integers(0, 4, len(plan.subpools))]) \
        if mode == "static" else None
    a = ChainAllocator(plan, rows, static_regions=regions, eager=mode == "eager")
    groups = _fill(a, plan, rng)
    a.take_moves()
    chosen = [g for g in groups if rng.random() < 0.5]
    freed = {plan.full.name: sum(len(v) for v, _ in chosen)}
    for w in plan.windows:
        freed[w.name] = sum(int((a.bands[a.layout.index[w.name]].table.v2p[v] > 0).sum()) for v, _ in chosen)
    if plan.state is not None:
        freed[plan.state.name] = sum(len(s) for _, s in chosen)
    after = copy.deepcopy(a)
    for v, s in chosen:
        after.free_token_pages(v)
        if s.size:
            after.free_state_slots(s)
    for _ in range(40):
        n = int(rng.integers(0, 2 * max(1, freed[plan.full.name]) + 8))
        windows = {w.name: int(rng.integers(0, n + 1)) for w in plan.windows}
        slots = int(rng.integers(0, 4)) if plan.state is not None else 0
        want = after.can_fit(n, slots, windows)
        assert a.can_fit(n, slots, windows, freed=freed) == want, (n, slots, windows, freed)
