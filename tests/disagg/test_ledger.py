"""The decode side's ledger (generations, fencing, expiry) and the wire format, without engines."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest

from umem_jax.disagg import ledger as lg
from umem_jax.disagg.wire import max_body_bytes, pack, unpack
from umem_jax.engine.handoff import Envelopes, TransferPlan


def test_only_the_live_generation_may_write():
    led = lg.Ledger("e1")
    t = led.new("a", 10.0)
    assert t.generation == "e1-1" and led.live() == 1
    assert led.writable("a", t.generation) is t
    assert "stale generation" in led.writable("a", "e0-1")  # meant for an earlier incarnation
    assert "no transfer b" in led.writable("b", "e1-1")
    led.end(t, lg.CANCELLED)
    assert led.live() == 0
    assert "cancelled" in led.writable("a", t.generation)  # a late write after the fence
    t2 = led.new("a", 10.0)  # the id reserved again: a new generation, the old one stays fenced
    assert t2.generation == "e1-2" and "replaced" in led.writable("a", "e1-1")
    assert led.writable("a", "e1-2") is t2
    assert led.counts["dropped_writes"] == 4
    with pytest.raises(ValueError, match="already reserved"):
        led.new("a", 1.0)


def test_expiry_and_restart_epochs():
    led = lg.Ledger()
    t = led.new("x", 0.5)
    assert led.due(t.deadline - 0.1) == [] and led.due(t.deadline) == [t]
    led.end(t, lg.EXPIRED)
    assert led.due(t.deadline + 1) == [] and led.counts["expired"] == 1
    assert lg.Ledger().epoch != led.epoch  # a restarted worker drops the old generations


def test_wire_round_trip_and_no_pickles():
    rng = np.random.default_rng(0)
    plan = TransferPlan(37, {"full": (0, 10), "window16": (5, 10)}, 1)
    env = Envelopes("abc", plan, 42, {"full": rng.integers(0, 65535, (10, 8, 64), dtype=np.uint16),
                                      "window16": rng.integers(0, 65535, (5, 24, 64), dtype=np.uint16)},
                    rng.integers(0, 65535, (1, 84, 64), dtype=np.uint16))
    got = unpack(pack(env))
    assert got.fingerprint == "abc" and got.plan == plan and got.first_token == 42
    assert all(np.array_equal(got.pages[k], env.pages[k]) for k in env.pages) and np.array_equal(got.state, env.state)
    buf = io.BytesIO()
    np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
    for bad in (b"not npz", pickle.dumps(env), buf.getvalue()):
        with pytest.raises(ValueError, match="not a page-envelope body"):
            unpack(bad)


@pytest.mark.parametrize("tokens", [1, 37, 64, 65, 250])
def test_max_body_bytes_bounds_the_packed_envelopes(tokens):
    """The decode worker's body limit comes from max_body_bytes: every packed transfer of up to
    that many tokens fits it, and it is not far over (the envelopes plus HEAD_BYTES)."""
    from umem_jax.disagg.wire import HEAD_BYTES
    from umem_jax.memory import plan as make_plan
    from umem_jax.models.presets import preset

    plan = make_plan(preset("tiny-hybrid"), page_size=4)
    tp = TransferPlan.of(plan, tokens)
    pages = {k: np.ones((end - first, plan[k].rows_per_page, plan.row_words), np.uint16)
             for k, (first, end) in tp.pages.items()}
    env = Envelopes("f" * 16, tp, 7, pages, np.ones((1, plan.state.rows_per_page, plan.row_words), np.uint16))
    body, limit = len(pack(env)), max_body_bytes(plan, tokens)
    assert env.nbytes < body <= limit == env.nbytes + HEAD_BYTES
    assert max_body_bytes(plan, tokens + 40) > limit  # longer prompts, more pages
