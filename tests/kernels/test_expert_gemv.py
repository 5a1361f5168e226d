"""The few-rows expert GEMM (pallas_kernels/expert_gemv.py), interpreted on CPU (and compiled on a
GPU), against its row-by-row reference: 1..16 rows, experts repeated across rows (one slot
computes them all), rows reading their token's x (repeat), padding rows (ids -1, E, beyond) that
must come back zero without their x being read, K and N no multiple of any block, K splits that
run past K, fp32 and bf16, gpt-oss biases.  Fresh random data per case.  Interpret mode leaves
unwritten output elements NaN (checked below), so the raw partial sums being finite shows every
element was written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_utils import cuda_lowering, no_triton_deprecation
from jax.experimental import pallas as pl

from umem_jax.pallas_kernels._compat import pltr, triton_params
from umem_jax.pallas_kernels.expert_gemv import (MAX_ROWS, default_config, expert_gemv, expert_gemv_partials,
                                                 expert_gemv_reference)
from umem_jax.pallas_kernels.launch import ANY

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def case(seed, R, K, N, E, ids, dtype=jnp.float32, bias=False):
    """Random x [R, K], w [E, K, N] (and bias [E, N]); padding rows' x is NaN: never to be read."""
    rng = np.random.default_rng(seed)
    ids = np.asarray(ids, np.int32)
    x = rng.standard_normal((R, K), np.float32)
    x[(ids < 0) | (ids >= E)] = np.nan
    w = rng.standard_normal((E, K, N), np.float32) / np.sqrt(K)
    b = rng.standard_normal((E, N), np.float32) if bias else None
    as_dev = lambda a: None if a is None else jnp.asarray(a).astype(dtype)
    return as_dev(x), jnp.asarray(ids), as_dev(w), as_dev(b)


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def test_interpret_mode_poisons_unwritten_output():
    """The premise of the checks below: an output element no program stores comes back NaN."""
    def kernel(o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            pltr.store(o_ref.at[0, jnp.arange(8)], jnp.ones((8,), jnp.float32))

    out = pl.pallas_call(kernel, grid=(2,), in_specs=[], out_specs=ANY, compiler_params=triton_params(),
                         out_shape=jax.ShapeDtypeStruct((2, 8), jnp.float32), interpret=True)()
    assert np.all(np.asarray(out)[0] == 1) and np.all(np.isnan(np.asarray(out)[1]))


# (R, K, N, E, ids, tuning): blocks small enough that every case has several column blocks and K chunks
CASES = [
    (1, 40, 24, 3, [2], {"block_n": 16, "block_k": 16, "k_splits": 1}),           # one row, K and N ragged
    (4, 72, 40, 6, [5, 0, 3, 1], {"block_n": 16, "block_k": 16, "k_splits": 2}),  # one token, top-4
    (6, 64, 48, 4, [1, 3, 1, 1, 0, 3], {"block_n": 32, "block_k": 16, "k_splits": 3}),  # repeats; splits past K
    (9, 48, 32, 5, [2, -1, 0, 5, 2, 99, 0, 4, -7], {"block_n": 16, "block_k": 32, "k_splits": 2}),  # padding rows
    (16, 32, 16, 3, [1] * 16, {"block_n": 16, "block_k": 16, "k_splits": 2}),    # every row on one expert
    (16, 56, 20, 8, [-1] * 16, {"block_n": 16, "block_k": 16, "k_splits": 1}),   # nothing routed: zeros
    (12, 96, 64, 16, [3, 9, 9, 14, 0, 3, 7, 1, 12, 12, 5, 3], {}),               # the default blocks
]


def run(x, ids, w, b, tuning):
    parts = expert_gemv_partials(x, ids, w, b, interpret=True, **tuning)
    return np.asarray(parts), expert_gemv(x, ids, w, b, interpret=True, **tuning)


@pytest.mark.parametrize("R,K,N,E,ids,tuning", CASES)
def test_matches_reference_fp32(R, K, N, E, ids, tuning):
    bias = R % 2 == 1 or R == 4  # gpt-oss biases on half the cases (1, 4, 9 rows), added once over the splits
    x, ids_, w, b = case(R * 7 + K + int(bias), R, K, N, E, ids, bias=bias)
    parts, got = run(x, ids_, w, b, tuning)
    want = expert_gemv_reference(x, ids_, w, b)
    S = tuning.get("k_splits", default_config(R, K, N, w.dtype)["k_splits"])
    assert parts.shape == (S, R, N) and np.all(np.isfinite(parts))  # every element written
    assert got.shape == (R, N) and got.dtype == jnp.float32
    pad = (np.asarray(ids) < 0) | (np.asarray(ids) >= E)
    assert np.all(parts[:, pad] == 0)  # padding rows: exact zeros, their NaN x never read
    if not pad.all():
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("R,K,N,E,ids,tuning", [CASES[2], CASES[3], CASES[6]])
def test_matches_reference_bf16(R, K, N, E, ids, tuning):
    """bf16 x and weights: the same bf16 inputs with exact products and fp32 sums on both sides;
    bf16 out rounds once."""
    x, ids_, w, b = case(R + 100, R, K, N, E, ids, jnp.bfloat16, bias=True)
    parts, got = run(x, ids_, w, b, tuning)
    want = expert_gemv_reference(x, ids_, w, b)
    assert np.all(np.isfinite(parts)) and rel(got, want) < 1e-5
    low = expert_gemv(x, ids_, w, b, out_dtype=jnp.bfloat16, interpret=True, **tuning)
    assert low.dtype == jnp.bfloat16 and rel(low, want) < 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_repeat_reads_each_tokens_row(dtype):
    """repeat=k: row r reads x[r // k] (an MoE token's k rows), no repeated copy of x; a padded
    token (NaN x) names no expert in any of its rows."""
    k, tokens = 4, 3
    ids = [2, 0, 5, 1, 6, 6, 6, 6, 3, 2, 1, 0]
    x, ids_, w, b = case(11, tokens * k, 40, 24, 6, ids, dtype, bias=True)
    x = x[::k]  # one row per token; the padded token 1 keeps its NaN row
    parts = np.asarray(expert_gemv_partials(x, ids_, w, b, repeat=k, interpret=True, block_n=16, block_k=16,
                                            k_splits=2))
    got = parts.sum(0)
    want = expert_gemv_reference(x, ids_, w, b, repeat=k)
    assert np.all(np.isfinite(parts)) and np.all(got[4:8] == 0) and rel(got, want) < 1e-5
    np.testing.assert_array_equal(want, expert_gemv_reference(jnp.repeat(x, k, axis=0), ids_, w, b))


@pytest.mark.parametrize("shared_axis", [0, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shared_pseudo_experts_follow_the_routed(dtype, shared_axis):
    """shared=[m, K, N] (or [K, m, N], shared_axis=1): ids E .. E+m-1 read the shared matrices (no
    bias, even where the routed experts have one), tokens naming the same shared slot share one
    read; ids past E+m and negative ones are padding (exact zeros, their NaN x never read)."""
    k, m, E, K, N = 3, 2, 5, 40, 24
    ids = [4, 0, 2, 5, 6,   1, 1, 3, 5, 6,   -1, -1, -1, -1, -1,   0, 4, 2, 7, 6]  # 4 tokens x (k + m)
    rng = np.random.default_rng(5)
    x, ids_, w, b = case(13, 4 * (k + m), K, N, E, ids, dtype, bias=True)
    x = jnp.asarray(rng.standard_normal((4, K), np.float32)).astype(dtype).at[2].set(jnp.nan)  # token 2 padded
    stack = jnp.asarray(rng.standard_normal((m, K, N), np.float32) / np.sqrt(K)).astype(dtype)
    shared = jnp.moveaxis(stack, 0, shared_axis)
    with no_triton_deprecation():
        parts = np.asarray(expert_gemv_partials(x, ids_, w, b, repeat=k + m, shared=shared, shared_axis=shared_axis,
                                                interpret=True, block_n=16, block_k=16, k_splits=2))
    got = parts.sum(0)
    want = expert_gemv_reference(x, ids_, w, b, repeat=k + m, shared=shared, shared_axis=shared_axis)
    assert np.all(np.isfinite(parts))  # every element written
    assert np.all(got[10:15] == 0) and np.all(got[18] == 0)  # the padded token; id 7 = E + m: padding
    assert rel(got, want) < 1e-5
    xf, sf = np.asarray(x, np.float32), np.asarray(stack, np.float32)
    for r, t in ((3, 0), (4, 0), (8, 1), (9, 1), (19, 3)):  # shared rows: x @ shared[id - E], no bias
        assert rel(got[r], xf[t] @ sf[ids[r] - E]) < (1e-5 if dtype == jnp.float32 else 1e-2)
    with pytest.raises(ValueError, match="shared must be"):
        expert_gemv(x, ids_, w, b, repeat=k + m, shared=shared[..., :-1], shared_axis=shared_axis, interpret=True)
    with pytest.raises(ValueError, match="shared must be"):  # the other layout's shape
        expert_gemv(x, ids_, w, b, repeat=k + m, shared=stack if shared_axis else stack.swapaxes(0, 1),
                    shared_axis=shared_axis, interpret=True)


PROLOGUES = [("swiglu", "silu"), ("ungated", "relu2"), ("gpt_oss", "silu")]


@pytest.mark.parametrize("kind,act", PROLOGUES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prologue_activates_the_input_as_it_loads(kind, act, dtype):
    """prologue=f: the kernel reads the first projection's fp32 output h [R, 2K] (gate | up; [R, K]
    ungated) and multiplies f(gate, up), rounded to w's dtype, as the XLA chain (activation, cast,
    then the kernel) would; K ragged against the blocks, splits past K, shared rows, padding rows
    (NaN h, never read)."""
    from umem_jax.models.moe_config import expert_prologue

    f = expert_prologue(kind, act, 1.702, 7.0)
    gated = kind != "ungated"
    R, K, N, E, m = 6, 40, 24, 5, 1
    ids = jnp.asarray([3, 0, 5, 3, -1, 1], jnp.int32)  # 5 = E: the shared pseudo-expert
    rng = np.random.default_rng(len(kind) + len(act))
    h = rng.standard_normal((R, 2 * K if gated else K), np.float32) * 3.0
    h[4] = np.nan
    h = jnp.asarray(h)
    w = jnp.asarray(rng.standard_normal((E, K, N), np.float32) / np.sqrt(K)).astype(dtype)
    shared = jnp.asarray(rng.standard_normal((m, K, N), np.float32) / np.sqrt(K)).astype(dtype)
    with no_triton_deprecation():
        parts = np.asarray(expert_gemv_partials(h, ids, w, shared=shared, prologue=f, gated=gated, interpret=True,
                                                block_n=16, block_k=16, k_splits=2))
    got = parts.sum(0)
    a = f(h[:, :K], h[:, K:] if gated else None).astype(dtype)
    want = expert_gemv_reference(a, ids, w, shared=shared)
    assert np.all(np.isfinite(parts)) and np.all(got[4] == 0)
    assert rel(got, want) < 1e-5
    np.testing.assert_allclose(expert_gemv_reference(h, ids, w, shared=shared, prologue=f, gated=gated), want)
    with pytest.raises(ValueError, match="columns"):
        expert_gemv(h[:, :-1], ids, w, prologue=f, gated=gated, interpret=True)


def test_jit_with_traced_ids_one_compile():
    """Under jit the ids are traced values: one compile serves every routing."""
    x, _, w, b = case(3, 8, 40, 24, 6, [0] * 8, bias=True)
    f = jax.jit(lambda x, ids, w, b: expert_gemv(x, ids, w, b, interpret=True, block_n=16, block_k=16, k_splits=2))
    for ids in ([0, 1, 2, 3, 4, 5, 0, 1], [5] * 8, [2, 2, 6, -1, 2, 0, 0, 3]):
        ids = jnp.asarray(ids, jnp.int32)
        assert rel(f(x, ids, w, b), expert_gemv_reference(x, ids, w, b)) < 1e-5
    assert f._cache_size() == 1


def test_default_config_splits_k_for_few_programs():
    gpt = default_config(4, 2880, 5760, jnp.bfloat16)  # gpt-oss-20b gate_up at one token: 360 programs
    assert gpt["block_n"] == 64 and gpt["block_k"] == 128 and gpt["k_splits"] == 1
    small = default_config(1, 512, 256, jnp.bfloat16)  # 4 column blocks: split K until ~TARGET_PROGRAMS
    assert small["k_splits"] == 2  # K = 4 chunks: each split keeps >= 2 of them
    assert default_config(2, 4096, 512, jnp.bfloat16)["k_splits"] == 8  # 16 programs a split
    assert default_config(64, 4096, 8192, jnp.float32)["block_k"] == 64


@pytest.mark.parametrize("args,kw,match", [
    (((4, 12), (4,), (3, 16, 8)), {}, "K=12"),
    (((4, 16), (5,), (3, 16, 8)), {}, "ids must be"),
    (((MAX_ROWS + 1, 16), (MAX_ROWS + 1,), (3, 16, 8)), {}, "grouped_matmul"),
    (((4, 16), (4,), (3, 16, 8)), {"bias": (3, 9)}, "bias"),
    (((4, 16), (4,), (3, 16, 8)), {"block_k": 24}, "powers of two"),
    (((4, 16), (4,), (3, 16, 8)), {"repeat": 2}, "x's rows \\* repeat"),
])
def test_bad_shapes_are_refused(args, kw, match):
    x, ids, w = (jnp.zeros(s, jnp.int32 if i == 1 else jnp.float32) for i, s in enumerate(args))
    bias = jnp.zeros(kw.pop("bias"), jnp.float32) if "bias" in kw else None
    with pytest.raises(ValueError, match=match):
        expert_gemv(x, ids, w, bias, interpret=True, **kw)


def test_lowers_for_cuda_at_real_shapes():
    """The Triton kernel builds for CUDA (cross-lowered): gpt-oss-20b gate_up with bias, and
    weights over 4 GiB (Pallas then addresses them with int64 offsets)."""
    S = jax.ShapeDtypeStruct
    for R, K, N, E, bias, m in [(4, 2880, 5760, 32, True, 0), (2, 4096, 2048, 512, False, 0),
                                (9, 2048, 1024, 256, False, 1)]:  # the last with Qwen3.5-MoE's shared expert
        args = [S((R, K), jnp.bfloat16), S((R,), jnp.int32), S((E, K, N), jnp.bfloat16)]
        args += [S((E, N), jnp.bfloat16)] if bias else []
        fn = lambda *a: expert_gemv_partials(*a)  # noqa: E731
        if m:
            args, fn = args + [S((m, K, N), jnp.bfloat16)], lambda x, i, w, s: expert_gemv_partials(x[:1], i, w, repeat=9,
                                                                                                     shared=s)
        with no_triton_deprecation():
            text = cuda_lowering(fn, *args)
        if text is None:
            pytest.skip("this jax cannot cross-lower for CUDA without a GPU")
        assert "umem_expert_gemv" in text


@pytest.mark.gpu
@pytest.mark.parametrize("R,K,N,E,bias", [(4, 2880, 5760, 8, True), (16, 2048, 1024, 24, False),
                                          (3, 512, 2048, 6, False)])
def test_triton_kernel_on_gpu(R, K, N, E, bias):
    """The compiled kernel (default blocks) against the reference on the device: gpt-oss-20b and
    Qwen3.5-35B-A3B-like projections (fewer experts), repeated experts and padding rows."""
    ids = np.random.default_rng(R).integers(0, E, R)
    ids[R // 2] = ids[0]  # a repeated expert
    ids[-1] = E  # a padding row
    x, ids_, w, b = case(R, R, K, N, E, ids, jnp.bfloat16, bias=bias)
    parts = np.asarray(expert_gemv_partials(x, ids_, w, b))
    got = expert_gemv(x, ids_, w, b)
    want = expert_gemv_reference(x, ids_, w, b)
    assert np.all(np.isfinite(parts)) and np.all(parts[:, -1] == 0)
    assert rel(got[:-1], want[:-1]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("R,K,N,E,m,axis", [(9, 2048, 1024, 16, 1, 1), (8, 2688, 1856, 12, 2, 1),
                                             (8, 2688, 1856, 12, 2, 0), (18, 2048, 512, 8, 1, 1)])
def test_triton_kernel_with_shared_on_gpu(R, K, N, E, m, axis):
    """The compiled kernel with the shared pseudo-experts (Qwen3.5-MoE's gate_up at one and two
    tokens, Nemotron's up; [K, m, N] as the models store a first projection, and [m, K, N]): a
    token's routed rows then its m shared rows, a padding row last."""
    k = R // 2 if R == 18 else R - m
    per = k + m if R != 18 else R // 2
    rng = np.random.default_rng(R + m)
    ids = np.concatenate([np.concatenate([rng.choice(E, per - m, replace=False), E + np.arange(m)])
                          for _ in range(R // per)]).astype(np.int32)
    ids[-1] = E + m  # a padding row
    x, ids_, w, _ = case(R + 7, R // per, K, N, E, ids[::per])
    shared = jnp.asarray(rng.standard_normal((m, K, N), np.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    shared = jnp.moveaxis(shared, 0, axis)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    ids_ = jnp.asarray(ids)
    parts = np.asarray(expert_gemv_partials(x, ids_, w, repeat=per, shared=shared, shared_axis=axis))
    got = expert_gemv(x, ids_, w, repeat=per, shared=shared, shared_axis=axis)
    want = expert_gemv_reference(x, ids_, w, repeat=per, shared=shared, shared_axis=axis)
    assert np.all(np.isfinite(parts)) and np.all(parts[:, -1] == 0)
    assert rel(got[:-1], want[:-1]) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kind,act,K,N", [("swiglu", "silu", 512, 2048), ("ungated", "relu2", 1856, 2688),
                                          ("gpt_oss", "silu", 2880, 2880)])
def test_prologue_on_gpu(kind, act, K, N):
    """The compiled kernel with each expert activation as its prologue (the down projections of
    Qwen3.5-MoE, Nemotron and gpt-oss at one token), against the XLA activation then the kernel."""
    from umem_jax.models.moe_config import expert_prologue

    f = expert_prologue(kind, act, 1.702, 7.0)
    gated = kind != "ungated"
    R, E = 8, 16
    rng = np.random.default_rng(K)
    ids = jnp.asarray(np.append(rng.choice(E, R - 1, replace=False), -1), jnp.int32)
    h = jnp.asarray(rng.standard_normal((R, 2 * K if gated else K), np.float32) * 2.0)
    w = jnp.asarray(rng.standard_normal((E, K, N), np.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    got = expert_gemv(h, ids, w, prologue=f, gated=gated)
    a = f(h[:, :K], h[:, K:] if gated else None).astype(jnp.bfloat16)
    want = expert_gemv(a, ids, w)
    assert np.all(np.asarray(got)[-1] == 0)
    assert rel(got[:-1], want[:-1]) < 2e-3

