"""The two ways page envelopes travel (disagg/wire.py): an npz body and a shared-memory segment.
Both give back the same envelopes bit for bit (NaN payloads included); segments are reused by
the prefill side's pool, which keeps a bounded number and unlinks the rest; a reference to a
segment that is not on this host, or that is not an envelope segment, or whose arrays run past
it, is refused with the reason; "auto" picks shm only for a loopback decode URL."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from umem_jax.disagg.wire import (SHM_PREFIX, NoSegment, SegmentPool, pack, pack_shm, transport_for, unpack,
                                  unpack_shm)
from umem_jax.engine.handoff import Envelopes, TransferPlan


def _env(seed: int, state: bool = True) -> Envelopes:
    rng = np.random.default_rng(seed)
    words = lambda *shape: rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16)
    pages = {"full": words(5, 24, 16), "win64": words(2, 24, 16)}
    pages["full"][0, 0, :4] = [0xFFFF, 0x7FC1, 0xFF81, 0x7F81]  # NaN payloads must survive
    plan = TransferPlan(70, {"full": (0, 5), "win64": (3, 5)}, 1 if state else 0)
    return Envelopes("fp-123", plan, 17, pages, words(1, 40, 16) if state else None)


def _same(a: Envelopes, b: Envelopes) -> None:
    assert (a.fingerprint, a.plan, a.first_token) == (b.fingerprint, b.plan, b.first_token)
    assert a.pages.keys() == b.pages.keys()
    for k in a.pages:
        assert a.pages[k].dtype == b.pages[k].dtype == np.uint16
        np.testing.assert_array_equal(a.pages[k], b.pages[k])
    assert (a.state is None) == (b.state is None)
    if a.state is not None:
        np.testing.assert_array_equal(a.state, b.state)


@pytest.mark.parametrize("state", [True, False])
def test_npz_body_round_trip(state):
    env = _env(0, state)
    _same(env, unpack(pack(env)))
    with pytest.raises(ValueError, match="not a page-envelope body"):
        unpack(b"not an npz")


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("state", [True, False])
def test_shared_memory_round_trip_and_reuse(state):
    pool = SegmentPool(keep=1)
    env = _env(1, state)
    seg, ref = pack_shm(env, pool)
    ref = json.loads(json.dumps(ref))  # as it crosses the POST
    assert ref["shm"].startswith(SHM_PREFIX) and _segment_exists(ref["shm"])
    got = unpack_shm(ref)
    _same(env, got)
    got.pages["full"][...] = 0  # a copy: nothing maps the segment any more
    pool.give(seg)
    seg2, ref2 = pack_shm(_env(2, state), pool)  # the segment is reused, its bytes overwritten
    assert ref2["shm"] == ref["shm"]
    _same(_env(2, state), unpack_shm(ref2))
    pool.give(seg2)
    other, _ = pack_shm(_env(3), SegmentPool())  # another pool's segment is its own
    small = pool.take(1)  # a 64 MiB segment serves a 1-byte transfer too (within 2x + 64 MiB)
    assert small.name == ref["shm"] != other.name
    pool.drop(other)
    pool.drop(small)
    assert not _segment_exists(ref["shm"]) and not _segment_exists(other.name)
    with pytest.raises(NoSegment, match="not on this host"):
        unpack_shm(ref)


def test_pool_keeps_at_most_keep_and_closes():
    pool = SegmentPool(keep=2)
    segs = [pool.take(1000) for _ in range(3)]
    names = [s.name for s in segs]
    for s in segs:
        pool.give(s)
    assert [s.name for s in pool.free] == names[1:] and not _segment_exists(names[0])
    assert pool.take(10 * SegmentPool.GRAIN).size == 10 * SegmentPool.GRAIN  # none fits: a new one
    pool.close()
    assert not any(_segment_exists(n) for n in names)


def test_no_room_in_dev_shm_is_an_oserror_not_a_crash(monkeypatch):
    """A /dev/shm too small for a segment (64 MiB in a default container) fails when the segment is
    made, with OSError (the prefill worker then sends an npz body), never by SIGBUS on a write."""
    import umem_jax.disagg.wire as wire

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wire.os, "posix_fallocate", full)
    pool, made = SegmentPool(), set(wire._MADE_HERE)
    with pytest.raises(OSError, match="no room for a 64 MiB shared-memory segment"):
        pack_shm(_env(4), pool)
    assert not pool.free and wire._MADE_HERE == made  # the segment it made was unlinked again


def test_bad_references_are_refused():
    pool = SegmentPool()
    env = _env(2)
    with pytest.raises(ValueError, match="not a page-envelope segment"):
        unpack_shm({"shm": "psm_other_app", "arrays": [], "head": {}})
    with pytest.raises(ValueError, match="not a shared-memory envelope reference"):
        unpack_shm({"arrays": []})
    seg, ref = pack_shm(env, pool)
    ref["arrays"][0]["offset"] = seg.size  # past the end
    with pytest.raises(ValueError, match="past the segment"):
        unpack_shm(ref)
    ref["arrays"][0].update(offset=0, dtype="float64")
    with pytest.raises(ValueError, match="float64"):
        unpack_shm(ref)
    pool.drop(seg)
    with pytest.raises(NoSegment):
        unpack_shm({"shm": SHM_PREFIX + "0" * 24, "arrays": [], "head": {}})


def test_transport_choice():
    assert transport_for("auto", "http://127.0.0.1:8001") == "shm"
    assert transport_for("auto", "http://localhost:8001/") == "shm"
    assert transport_for("auto", "http://10.0.0.7:8001") == "http"
    assert transport_for("auto", "http://decode-0.cluster:8001") == "http"
    assert transport_for("http", "http://127.0.0.1:1") == "http"
    assert transport_for("shm", "http://10.0.0.7:1") == "shm"  # asked for: a 422 falls back to http
    with pytest.raises(ValueError, match="transport"):
        transport_for("rdma", "http://127.0.0.1:1")
