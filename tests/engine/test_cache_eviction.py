"""When the scheduler evicts the prefix cache: only for a need that eviction can make fit.

While requests run, a need that would not fit even with every evictable entry gone evicts
nothing (fits_or_evict's `could_fit` check, against the cache's reclaimable pages): the running
requests will give memory back, and a flushed cache would only cost later hits (SGLang admits
against free + evictable tokens in the same way)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_scheduler import make

from umem_jax.scheduler import prefix_sharing


def _cached_then_decoding():
    """Three finished short requests (their pages cached) and a long one decoding."""
    sim = make(190 << 10, max_num_seqs=8, cache=True, early=False)
    for _ in range(3):
        sim.add(24, 2)
    while sim.sch.has_work():
        sim.step()
    a = sim.add(100, 60)
    while not a.decode_ready:
        sim.step()
    return sim, a


def _drain(sim):
    """Run to the end; with the cache emptied, every page and slot is free again."""
    while sim.sch.has_work():
        sim.step()
    assert sim.sch.cache.clear() and not sim.alloc.leaks()


@pytest.mark.parametrize("length, admitted_at_once", [(300, True), (400, False)])
def test_a_failed_admission_keeps_the_cache(length, admitted_at_once):
    """A 300-token prompt fits once the cache is evicted: it is, and the prompt starts at once.
    A 400-token one does not fit even then: it waits for the decoder, and the cache keeps every
    entry meanwhile (before, the first failed try evicted all 29 evictable pages)."""
    sim, a = _cached_then_decoding()
    cached = sim.sch.cache.num_pages
    b = sim.add(length, 4)
    waited = 0
    while b.status.name == "WAITING":
        sim.step()
        waited += 1
        if b.status.name == "WAITING":
            assert sim.sch.cache.num_pages >= cached
    assert (waited <= 2) == admitted_at_once
    _drain(sim)
    assert b.num_output == 4 and a.num_output == 60


def test_eviction_is_skipped_only_where_it_could_not_help(monkeypatch):
    """Random traffic with the cache under pressure: whenever fits_or_evict skips evicting
    (could_fit says no while requests run), evicting everything in a copy does not make the need
    fit either; and it was skipped at least once, so the check is exercised."""
    skipped = []
    could_fit = prefix_sharing.PrefixSharing.could_fit

    def checked(self, need, reclaimable):
        got = could_fit(self, need, reclaimable)
        if not got:
            probe = copy.deepcopy(self)
            probe.cache.evict()
            assert not probe.demand.fits(probe.allocator, need), (need, reclaimable)
            skipped.append(need)
        return got

    monkeypatch.setattr(prefix_sharing.PrefixSharing, "could_fit", checked)
    rng = np.random.default_rng(7)
    sim = make(150 << 10, max_num_seqs=8, cache=True, early=bool(rng.integers(2)))
    shared = [int(x) for x in rng.integers(3, 250, 40)]
    for _ in range(30):
        L = int(rng.integers(8, 260))
        head = int(rng.integers(0, min(40, L))) if rng.random() < 0.5 else 0  # some prompts share a prefix
        sim.add(L, int(rng.integers(1, 40)), tokens=shared[:head] + [int(x) for x in rng.integers(3, 250, L - head)])
        for _ in range(int(rng.integers(0, 6))):
            if sim.sch.has_work():
                sim.step()
    _drain(sim)
    assert skipped
