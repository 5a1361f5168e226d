"""Attention options and dtypes outside the contract get a clear ValueError on every path (the
reference called directly, the wrapper, the Pallas kernel), and a whole-number float window is a
window: before, the prefill kernel took window=2.5 into its integer block math (an obscure lax.div
dtype error) while its reference ran it silently, both kernels failed on window=8.0, and decode ran
an integer q."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import fill_kv, make_view, no_triton_deprecation, poisoned_arena, random_page_tables

from umem_jax.pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from umem_jax.pallas_kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_reference

IMPLS = [dict(impl="reference"), dict(impl="pallas", interpret=True)]


def _case():
    rng = np.random.default_rng(0)
    view = make_view(1, 16, 16, 8)
    arena = poisoned_arena(6 * view.rows_per_page, view.row_words)
    pt = random_page_tables(rng, 2, 2, 1, 6)
    lengths = np.array([13, 16], np.int32)
    arena, _, _ = fill_kv(arena, view, pt, lengths, rng)
    return view, arena, jnp.asarray(pt), jnp.asarray(lengths)


@pytest.mark.parametrize("kw", IMPLS, ids=["reference", "pallas"])
@pytest.mark.parametrize("window", [2.5, 0, -3, True])
def test_bad_window_is_refused_everywhere(kw, window):
    view, arena, pt, lengths = _case()
    q4 = jnp.zeros((2, 3, 2, 16), jnp.float32)
    ql = jnp.array([3, 2], jnp.int32)
    with no_triton_deprecation(), pytest.raises(ValueError, match="window must be a positive int"):
        paged_prefill_attention(q4, arena, pt, ql, lengths, view=view, window=window, **kw)
    with no_triton_deprecation(), pytest.raises(ValueError, match="window must be a positive int"):
        paged_decode_attention(q4[:, 0], arena, pt, lengths, view=view, window=window, **kw)


def test_prefill_reference_checks_its_options():
    view, arena, pt, lengths = _case()
    q4 = jnp.zeros((2, 3, 2, 16), jnp.float32)
    ql = jnp.array([3, 2], jnp.int32)
    with pytest.raises(ValueError, match="window"):
        paged_prefill_attention_reference(q4, arena, pt, ql, lengths, view=view, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        paged_prefill_attention_reference(q4, arena, pt, ql, lengths, view=view, softcap=0.0)


@pytest.mark.parametrize("kw", IMPLS, ids=["reference", "pallas"])
def test_decode_refuses_an_integer_query(kw):
    view, arena, pt, lengths = _case()
    with no_triton_deprecation(), pytest.raises(ValueError, match="q must be floating point"):
        paged_decode_attention(jnp.zeros((2, 2, 16), jnp.int32), arena, pt, lengths, view=view, **kw)


def test_whole_number_float_window_is_the_int_window():
    view, arena, pt, lengths = _case()
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32)
    q4 = jnp.asarray(rng.standard_normal((2, 3, 2, 16)), jnp.float32)
    ql = jnp.array([3, 2], jnp.int32)
    with no_triton_deprecation():
        want = paged_decode_attention_reference(q, arena, pt, lengths, view=view, window=5)
        got = paged_decode_attention(q, arena, pt, lengths, view=view, window=5.0, impl="pallas", interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
        want = paged_prefill_attention_reference(q4, arena, pt, ql, lengths, view=view, window=5)
        got = paged_prefill_attention(q4, arena, pt, ql, lengths, view=view, window=5.0, impl="pallas",
                                      interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
