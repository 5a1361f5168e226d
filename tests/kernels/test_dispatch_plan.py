"""The MoE dispatch plan (pallas_kernels/dispatch_plan.py), interpreted on CPU (and compiled on a
GPU), against its argsort reference: ids out of range, padding tokens, every row on one expert,
row counts that are no multiple of a block; and the grouped matmul's plan mode (one program a
group, rows gathered by token, bias) against the row-by-row definition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umem_jax.pallas_kernels.dispatch_plan import dispatch_plan, dispatch_plan_reference
from umem_jax.pallas_kernels.grouped_matmul import grouped_matmul

_plan = jax.jit(dispatch_plan, static_argnames=("num_experts", "repeat", "block", "chunk", "interpret"))


def random_ids(rng, tokens, k, E, junk=0.1):
    """Each token's k distinct experts (as a router picks), a `junk` share of ids out of range."""
    ids = np.stack([rng.permutation(E)[:k] if k <= E else rng.integers(0, E, k) for _ in range(tokens)])
    bad = rng.random(ids.shape) < junk
    ids[bad] = rng.choice([-1, E, E + 7], bad.sum())
    return jnp.asarray(ids.reshape(-1), jnp.int32)


def check_plan(got, ids, E, valid, k):
    """Exactly the reference, and what each output means: pos a permutation ordering the rows by
    key (stably), token the row's token, [first, end) each expert's rows."""
    want = dispatch_plan_reference(ids, E, valid, repeat=k)
    for name, a, b in zip(("pos", "token", "first", "end"), got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    pos, token, first, end = (np.asarray(a) for a in got)
    R = ids.shape[0]
    assert sorted(pos.tolist()) == list(range(R))
    key = np.where((np.asarray(ids) >= 0) & (np.asarray(ids) < E), np.asarray(ids), E)
    if valid is not None:
        key = np.where(np.repeat(np.asarray(valid), k), key, E)
    order = np.empty(R, int)
    order[pos] = np.arange(R)
    assert np.all(np.diff(key[order]) >= 0) and np.all(token == order // k)
    for g in range(E + 1):
        rows = order[first[g]:end[g]]
        assert np.all(key[rows] == g) and len(rows) == np.sum(key == g)
    assert first[0] == 0 and end[E] == R and np.all(first[1:] == end[:-1])


@pytest.mark.parametrize("tokens,k,E,block,chunk", [
    (1, 1, 1, 32, 256),        # one row, one expert
    (7, 3, 5, 4, 8),           # rows no multiple of the block or the chunk; several chunks
    (64, 4, 32, 32, 256),      # gpt-oss-20b at B = 64
    (37, 6, 128, 16, 64),      # Nemotron-3-Nano's 128 experts, 222 rows, expert blocks past E
    (64, 8, 256, 32, 256),     # Qwen3.5-MoE at B = 64
])
def test_plan_matches_reference(tokens, k, E, block, chunk):
    rng = np.random.default_rng(tokens * 1000 + E)
    ids = random_ids(rng, tokens, k, E)
    for valid in (None, jnp.asarray(rng.random(tokens) < 0.7)):
        got = _plan(ids, num_experts=E, valid=valid, repeat=k, block=block, chunk=chunk, interpret=True)
        check_plan(got, ids, E, valid, k)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.3, 1.0]), st.booleans())
def test_plan_on_random_routings(seed, junk, skew):
    """40 tokens x 3 of 9 experts (one compile): random, skewed onto one expert, or all junk."""
    rng = np.random.default_rng(seed)
    ids = random_ids(rng, 40, 3, 9, junk)
    if skew:
        ids = jnp.where(jnp.asarray(rng.random(120) < 0.8), 4, ids)
    valid = jnp.asarray(rng.random(40) < 0.8)
    check_plan(_plan(ids, num_experts=9, valid=valid, repeat=3, block=16, chunk=32, interpret=True), ids, 9, valid, 3)


def test_bad_arguments_are_refused():
    ids = jnp.zeros((6,), jnp.int32)
    with pytest.raises(ValueError, match="int32"):
        dispatch_plan(ids.astype(jnp.int16), 4, interpret=True)
    with pytest.raises(ValueError, match="whole number"):
        dispatch_plan(ids, 4, repeat=4, interpret=True)
    with pytest.raises(ValueError, match="valid"):
        dispatch_plan(ids, 4, jnp.ones((5,), bool), repeat=2, interpret=True)


def planned_reference(x, w, token, first, end, bias=None):
    """Row r of group g (first[g] <= r < end[g]): x[token[r]] @ w[g] (+ bias[g]) in fp32; the
    padding tail (g = G): zeros."""
    x, w, token, first, end = (np.asarray(a, np.float64) if i < 2 else np.asarray(a)
                               for i, a in enumerate((x, w, token, first, end)))
    G, _, N = w.shape
    out = np.zeros((token.shape[0], N))
    for g in range(G):
        for r in range(first[g], end[g]):
            out[r] = x[token[r]] @ w[g] + (0 if bias is None else np.asarray(bias, np.float64)[g])
    return out


@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_matmul_plan_mode(with_bias):
    """The plan's ranges, x gathered by token, groups larger than block_m (several row blocks in
    one program), empty groups, and the padding tail: every output row written (NaN-poisoned
    interpret outputs would show)."""
    rng = np.random.default_rng(3)
    tokens, k, E, K, N = 23, 3, 6, 40, 72
    ids = jnp.asarray(np.where(rng.random(tokens * k) < 0.5, 2, rng.integers(0, E + 1, tokens * k)), jnp.int32)
    valid = jnp.asarray(rng.random(tokens) < 0.8)
    pos, token, first, end = dispatch_plan_reference(ids, E, valid, repeat=k)
    x = jnp.asarray(rng.standard_normal((tokens, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, K, N)) / np.sqrt(K), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((E, N)), jnp.float32) if with_bias else None
    got = grouped_matmul(x, w, plan=(first, end), token=token, bias=bias, block_m=16, block_n=32, block_k=16,
                         interpret=True)
    want = planned_reference(x, w, token, first, end, bias)
    assert got.shape == (tokens * k, N) and np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert int(np.asarray(end)[2] - np.asarray(first)[2]) > 16  # expert 2 took several row blocks


def test_grouped_matmul_plan_arguments_are_checked():
    x, w = jnp.zeros((4, 8)), jnp.zeros((3, 8, 8))
    ranges = (jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="not both"):
        grouped_matmul(x, w, jnp.zeros((3,), jnp.int32), plan=ranges, interpret=True)
    with pytest.raises(ValueError, match="plan ranges"):
        grouped_matmul(x, w, plan=(ranges[0][:3], ranges[1][:3]), interpret=True)
    with pytest.raises(ValueError, match="bias"):
        grouped_matmul(x, w, plan=ranges, bias=jnp.zeros((3, 4)), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,k,E,K", [(64, 4, 32, 2880), (64, 6, 128, 2688), (64, 8, 256, 2048), (1, 8, 512, 2048)])
def test_compiled_on_gpu(tokens, k, E, K):
    """The compiled plan at the MoE families' B = 64 shapes (and Qwen3-Next's 512 experts) against
    the reference, then the plan-mode grouped matmul (bf16, bias) on its ranges."""
    rng = np.random.default_rng(E)
    ids = random_ids(rng, tokens, k, E)
    valid = jnp.asarray(rng.random(tokens) < 0.9)
    got = dispatch_plan(ids, E, valid, repeat=k)
    check_plan(got, ids, E, valid, k)
    pos, token, first, end = got
    x = jnp.asarray(rng.standard_normal((tokens, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((E, K, 256)) / np.sqrt(K), jnp.bfloat16)  # N cut: the reference loops
    bias = jnp.asarray(rng.standard_normal((E, 256)), jnp.bfloat16)
    y = grouped_matmul(x, w, plan=(first, end), token=token, bias=bias, out_dtype=jnp.float32)
    want = planned_reference(x.astype(jnp.float32), w.astype(jnp.float32), token, first, end, bias.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-2, atol=2e-2)
