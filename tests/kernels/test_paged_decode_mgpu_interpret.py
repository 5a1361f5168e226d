"""paged_decode_attention_mgpu (Mosaic GPU) in jax's GPU interpreter on CPU (jax >= 0.11; skipped
on older jax, CI's 0.10 included), against the plain-JAX reference over poisoned arenas: bf16 and
fp8 (e4m3, per-kv-head scales) K/V, one to three consumer warpgroups, windows over tombstoned
pages, sinks, soft-cap, fixed splits with empty ones, GQA ratios that are no power of two.

The interpreter simulates shared memory, the TMA copies and the barriers ("races" cases also
detect data races between the warpgroups), so the producer/consumer protocol, the ring's slot
ownership with several consumers, page addressing, masks and the split combine are the compiled
kernel's own code.  Two differences, both in `_body`: P reaches the P V product through shared
memory (the interpreter's wgmma takes no register operand), and an fp8 slot is unpacked from its
words (the interpreter keeps a RefUnion's views apart).  The compiled kernel runs in
tests/gpu/test_decode_mgpu_gpu.py; its lowering in test_paged_decode_mgpu.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import close_fp8, decode_case, fp8_decode_case

from umem_jax.pallas_kernels.paged_decode import paged_decode_attention_reference
from umem_jax.pallas_kernels.paged_decode_mgpu import (MAX_CONSUMERS, DecodeMgpuConfig, check_decode_mgpu_supported,
                                                       consumer_registers, paged_decode_attention_mgpu, smem_bytes)
from umem_jax.pallas_kernels.paged_prefill_mgpu import mgpu_available

HAVE_MGPU, WHY_NOT = mgpu_available()
needs_interpreter = pytest.mark.skipif(
    not HAVE_MGPU, reason="jax's GPU interpreter for Mosaic GPU kernels needs jax >= 0.11 (CI's CPU runs 0.10; "
    f"scripts/lower_on_jax011.sh runs these): {WHY_NOT}")

# (name, G, D, ps, ctx_max, window, softcap, sinks, fp8, tuning)
CASES = [
    ("bf16_one", 4, 64, 16, 300, None, None, False, False, {"block_kv": 64, "ring_slots": 2, "consumers": 1}),
    ("bf16_two_window_sinks", 6, 64, 16, 400, 100, None, True, False,
     {"block_kv": 64, "ring_slots": 2, "consumers": 2}),
    ("bf16_three_softcap", 3, 64, 32, 500, None, 20.0, False, False,
     {"block_kv": 64, "ring_slots": 3, "consumers": 3}),
    ("bf16_three_races", 2, 64, 16, 260, None, None, False, False,
     {"block_kv": 64, "ring_slots": 3, "consumers": 3, "interpret": "races"}),
    ("bf16_two_splits_empty", 5, 64, 16, 200, 64, None, False, False,
     {"block_kv": 64, "ring_slots": 2, "consumers": 2, "num_splits": 5}),
    ("fp8_two", 6, 128, 16, 400, None, None, False, True, {"block_kv": 64, "ring_slots": 2, "consumers": 2}),
    ("fp8_three_window_sinks", 6, 64, 16, 450, 150, None, True, True,
     {"block_kv": 64, "ring_slots": 3, "consumers": 3}),
    ("fp8_three_splits_races", 4, 64, 16, 330, None, 30.0, False, True,
     {"block_kv": 64, "ring_slots": 3, "consumers": 3, "num_splits": 2, "interpret": "races"}),
    ("fp8_one_page_over_block", 1, 64, 128, 300, None, None, True, True,
     {"block_kv": 64, "ring_slots": 2, "consumers": 1}),
    # transposed scores (S^T = K Q^T, O^T += V^T P^T): the q heads as N columns
    ("fp8_t_two", 4, 128, 16, 400, None, None, False, True,
     {"block_kv": 64, "ring_slots": 2, "consumers": 2, "transposed": True}),
    ("fp8_t_two_window_sinks_softcap", 6, 64, 16, 450, 150, 20.0, True, True,
     {"block_kv": 64, "ring_slots": 4, "consumers": 2, "transposed": True}),
    ("fp8_t_g20_splits_races", 20, 64, 32, 330, None, None, False, True,
     {"block_kv": 64, "ring_slots": 2, "consumers": 1, "num_splits": 3, "transposed": True, "interpret": "races"}),
    ("fp8_t_g1_page_over_block", 1, 128, 128, 300, 70, None, False, True,
     {"block_kv": 64, "ring_slots": 2, "consumers": 1, "transposed": True}),
]


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreter_matches_reference(case):
    name, G, D, ps, ctx_max, window, softcap, sinks, fp8, tuning = case
    tuning = dict(tuning)
    interpret = tuning.pop("interpret", True)
    seed = sum(map(ord, name))
    if fp8:
        view, arena, pt, ln, q, ks, vs = fp8_decode_case(seed, B=4, Hkv=2, G=G, D=D, ps=ps, ctx_max=ctx_max,
                                                         window=window)
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        view, arena, pt, ln, q = decode_case(seed, B=4, Hkv=2, G=G, D=D, ps=ps, ctx_max=ctx_max, window=window)
        scales = {}
    sk = jnp.asarray(np.random.default_rng(seed).standard_normal(q.shape[1]) * 2, jnp.float32) if sinks else None
    kw = dict(view=view, window=window, softcap=softcap, sinks=sk, **scales)
    got = paged_decode_attention_mgpu(q, arena, pt, ln, **kw, **tuning, interpret=interpret)
    ref = paged_decode_attention_reference(q, arena, pt, ln, **kw)
    if fp8:
        close_fp8(got, ref)
    else:
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert np.isfinite(ref).all() and np.isfinite(got).all(), "a poisoned row was read"
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[np.asarray(ln) == 0], 0.0)


def test_three_consumers_config():
    """Up to three consumers (each with 152 registers a thread beside the producer's 40: the CTA's
    64K), the ring split evenly between them, and the shared-memory budget counting each one's
    tiles (fp8 at D = 128 fits three in 64-token blocks, not in 128-token ones)."""
    from _kernel_utils import make_view

    assert [consumer_registers(c) for c in range(1, MAX_CONSUMERS + 1)] == [232, 232, 152]
    assert 3 * 128 * consumer_registers(3) + 128 * 40 <= 64 * 1024
    view = make_view(2, 128, page_size=16)
    q = jnp.zeros((1, 12, 128), jnp.bfloat16)
    check_decode_mgpu_supported(q, view, DecodeMgpuConfig(64, 3, None, 3))
    with pytest.raises(NotImplementedError, match="divide ring_slots"):
        check_decode_mgpu_supported(q, view, DecodeMgpuConfig(64, 4, None, 3))
    with pytest.raises(NotImplementedError, match="consumers must be 1 to 3"):
        check_decode_mgpu_supported(q, view, DecodeMgpuConfig(64, 4, None, 4))
    assert smem_bytes(128, DecodeMgpuConfig(64, 3, None, 3), fp8=True) <= 227 * 1024
    assert smem_bytes(128, DecodeMgpuConfig(128, 3, None, 3), fp8=True) > 227 * 1024
