"""Shared helpers for the recurrent-state tests (state_io, mamba2, gated_deltanet)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from umem_jax.memory import full_attention, plan, recurrent_state

POISON = 0xFFFF  # as bf16 a NaN, as an fp32 hi/lo pair a NaN: any stray read shows


def state_view(tensors, *, row_words=64, layers=2, layer=None):
    """A StateView for `tensors` in a small plan: `layers` state layers (the view is of `layer`,
    default the last, so the tensor rows do not start at row 0 of the slot)."""
    decls = [full_attention(0, 1, row_words)] + [recurrent_state(i + 1, tensors) for i in range(layers)]
    p = plan(decls, page_size=4, row_words=row_words)
    return p.state.state_view(layer if layer is not None else layers)


def poisoned_arena(view, num_slots, dtype=jnp.uint16):
    """Arena of `num_slots` slots (slot 0 = sink) plus a few spare rows, every word POISON."""
    rows = num_slots * view.rows_per_slot + 3
    w = np.full((rows, view.row_words), POISON, np.uint16)
    return jnp.asarray(w if dtype == jnp.uint16 else w.view(jnp.bfloat16))


def random_slots(rng, num_slots, batch, pad=1):
    """int32 [batch]: distinct real slots in random order, `pad` of the lanes 0 (padding)."""
    real = rng.choice(np.arange(1, num_slots), size=batch - pad, replace=False)
    s = np.concatenate([real, np.zeros(pad, np.int64)])
    rng.shuffle(s)
    return jnp.asarray(s, jnp.int32)


def slot_rows(view, slots):
    """Set of arena rows owned by the given (non-zero) slots."""
    out = set()
    for s in np.asarray(slots).tolist():
        if s:
            out.update(range(s * view.rows_per_slot, (s + 1) * view.rows_per_slot))
    return out


def assert_rows_untouched(before, after, keep_rows):
    """Every arena row not in `keep_rows` is bitwise unchanged."""
    b = np.asarray(before).view(np.uint16)
    a = np.asarray(after).view(np.uint16)
    mask = np.ones(b.shape[0], bool)
    mask[sorted(keep_rows)] = False
    bad = np.nonzero((a[mask] != b[mask]).any(axis=1))[0]
    assert bad.size == 0, f"rows outside the written slots changed: {np.nonzero(mask)[0][bad][:8]}"


def rel_err(x, ref):
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))
