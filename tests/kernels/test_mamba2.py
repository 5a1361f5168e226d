"""Mamba2 state kernels: Pallas decode (interpret) vs reference, references vs a per-token numpy
loop written from Hugging Face's NemotronH mixer, chunked prefill continuity, checkpoints,
padding lanes and poison outside the slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _state_utils import (
    CHECKPOINT_ALGOS,
    F32_TOL,
    PREFILL_ALGOS,
    StateCase,
    assert_rows_untouched,
    check_against_oracle,
    check_16bit_state,
    check_bf16_decode,
    check_decode,
    check_decode_lowers_for_cuda,
    check_prefill_lanes,
    check_two_chunks_and_decode,
    np_softplus,
    rel_err,
    slot_rows,
    state_view,
)

from umem_jax.memory import mamba2_state_tensors
from umem_jax.pallas_kernels import recurrent
from umem_jax.pallas_kernels.mamba2 import mamba2_decode, mamba2_dims, mamba2_prefill, pallas_supported
from umem_jax.pallas_kernels.state_io import write_state_reference

# ------------------------------------------------------------------- numpy oracle (HF math)


def hf_mamba2(conv0, S0, xbc, dt, w, bias, A_log, dt_bias, D, H, P, N, G, dt_min=None):
    """Per-token loop in float64, following HF: conv_state (B, C, K) rolled left with the new
    column last, out = silu(sum(conv_state * w) + bias); then the selective state update.
    conv0 [B, K-1, C] (our layout, oldest first); S0 [B, H, P, N]; xbc [B, T, C]; dt [B, T, H].
    Returns y [B, T, H, P], conv [B, K-1, C], S [B, H, P, N]."""
    f = lambda a: np.asarray(a, np.float64)
    Bsz, T, C = xbc.shape
    K = w.shape[1]
    conv = np.zeros((Bsz, C, K))
    conv[:, :, 1:] = f(conv0).transpose(0, 2, 1)
    S = f(S0).copy()
    A = -np.exp(f(A_log))
    ys = []
    for t in range(T):
        conv = np.roll(conv, -1, axis=-1)
        conv[:, :, -1] = f(xbc[:, t])
        o = (conv * f(w)[None]).sum(-1) + (f(bias) if bias is not None else 0.0)
        o = o / (1 + np.exp(-o))
        x = o[:, :H * P].reshape(Bsz, H, P)
        Bm = o[:, H * P:H * P + G * N].reshape(Bsz, G, N)
        Cm = o[:, H * P + G * N:].reshape(Bsz, G, N)
        hg = np.arange(H) // (H // G)
        d = np_softplus(f(dt[:, t]) + f(dt_bias))
        if dt_min is not None:
            d = np.clip(d, dt_min, None)
        dA = np.exp(d * A)
        S = S * dA[:, :, None, None] + (d[:, :, None] * x)[..., None] * Bm[:, hg][:, :, None, :]
        ys.append(np.einsum("bhpn,bhn->bhp", S, Cm[:, hg]) + f(D)[None, :, None] * x)
    y = np.stack(ys, 1) if ys else np.zeros((Bsz, 0, H, P))
    return y, conv[:, :, 1:].transpose(0, 2, 1), S


# ------------------------------------------------------------------------------ fixtures


class Case(StateCase):
    def __init__(self, H, P, N, G, K=4, row_words=64, num_slots=7, B=4, seed=0, dtype=jnp.float32,
                 arena_dtype=jnp.uint16, state_dtype="float32"):
        self.H, self.P, self.N, self.G, self.K = H, P, N, G, K
        conv_dtype = "float32" if dtype == jnp.float32 else "bfloat16"
        super().__init__(mamba2_state_tensors(H, P, N, G, K, conv_dtype=conv_dtype), "ssm", row_words=row_words,
                         num_slots=num_slots, B=B, seed=seed, dtype=dtype, arena_dtype=arena_dtype,
                         state_dtype=state_dtype)
        self.d = mamba2_dims(self.view)
        r = lambda *s: self.rng.standard_normal(s).astype(np.float32)
        C = self.d.conv_dim
        self.w = jnp.asarray(r(C, K) * 0.5, dtype)
        self.bias = jnp.asarray(r(C) * 0.1, dtype)
        self.A_log = jnp.asarray(r(H) * 0.5, jnp.float32)
        self.dt_bias = jnp.asarray(r(H) * 0.5 - 1.0, jnp.float32)
        self.D = jnp.asarray(r(H), jnp.float32)
        self.set_states(jnp.asarray(r(B, K - 1, C), dtype), jnp.asarray(r(B, H, P, N) * 0.5, jnp.float32))

    def inputs(self, T=None):
        lead = (self.B,) if T is None else (self.B, T)
        xbc = jnp.asarray(self.rng.standard_normal((*lead, self.d.conv_dim)), self.dtype)
        dt = jnp.asarray(self.rng.standard_normal((*lead, self.H)), self.dtype)
        return xbc, dt

    def params(self):
        return self.w, self.bias, self.A_log, self.dt_bias, self.D

    def oracle(self, xbc, dt, dt_min=None, conv0=None, S0=None):
        return hf_mamba2(self.conv0 if conv0 is None else conv0, self.S0 if S0 is None else S0,
                         np.asarray(xbc, np.float64), np.asarray(dt, np.float64), np.asarray(self.w, np.float64), np.asarray(self.bias, np.float64),
                         self.A_log, self.dt_bias, self.D, self.H, self.P, self.N, self.G, dt_min)


# ------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("H,P,N,G,row_words", [(4, 8, 16, 2, 64),    # ssm tile inside one row
                                               (2, 16, 32, 1, 128),   # conv blocks of 32
                                               (8, 8, 32, 4, 32)])    # ssm tile spans whole rows
def test_decode_pallas_matches_reference_and_hf(H, P, N, G, row_words):
    case = Case(H, P, N, G, row_words=row_words, seed=H + P)
    assert pallas_supported(case.view)
    xbc, dt = case.inputs()
    y_ref, a_ref = check_decode(case, mamba2_decode, (xbc, dt), case.params())
    check_against_oracle(case, y_ref, a_ref, case.oracle(xbc[:, None], dt[:, None]))


def test_decode_bf16_inputs_bf16_arena():
    case = Case(4, 8, 16, 2, row_words=64, dtype=jnp.bfloat16, arena_dtype=jnp.bfloat16, seed=3)
    xbc, dt = case.inputs()
    check_bf16_decode(case, mamba2_decode, (xbc, dt), case.params(), case.oracle(xbc[:, None], dt[:, None]))


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16"])
def test_16bit_ssm_state_close_to_fp32(state_dtype):
    """mamba_ssm_dtype bfloat16 / float16: the SSM state in one 16-bit plane, computed in fp32."""
    check_16bit_state(lambda sd: Case(4, 8, 16, 2, row_words=64, seed=13, state_dtype=sd), mamba2_decode,
                      mamba2_prefill, T=6, state_dtype=state_dtype)


# ------------------------------------------------------------------------------ prefill


@pytest.mark.parametrize("algo,chunk", PREFILL_ALGOS)
def test_prefill_matches_hf_loop_with_q_lens_and_dt_clamp(algo, chunk):
    case = Case(4, 8, 16, 2, row_words=64, B=4, seed=5)
    T = 6
    xbc, dt = case.inputs(T)
    q_lens = jnp.array([6, 3, 0, 1], jnp.int32)
    dt_min = 0.5  # large enough that the clamp bites
    y, arena = mamba2_prefill(case.arena, case.slots, xbc, dt, q_lens, *case.params(), view=case.view,
                              dt_min=dt_min, impl="reference", algo=algo, chunk_size=chunk)
    lane = lambda b, n: case.oracle(xbc[b:b + 1, :n], dt[b:b + 1, :n], dt_min, case.conv0[b:b + 1], case.S0[b:b + 1])
    check_prefill_lanes(case, y, arena, q_lens, lane)


def test_prefill_per_row_dt_min():
    """dt_min [B]: each row clamped by its own floor (0 = unclamped), as separate calls would."""
    case = Case(4, 8, 16, 2, row_words=64, B=3, seed=21)
    xbc, dt = case.inputs(5)
    q = jnp.array([5, 4, 5], jnp.int32)
    mins = jnp.array([0.0, 0.6, 0.3], jnp.float32)
    y, _ = mamba2_prefill(case.arena, case.slots, xbc, dt, q, *case.params(), view=case.view, dt_min=mins,
                          chunk_size=2)
    for b in np.nonzero(case.real)[0]:
        y_hf, _, _ = case.oracle(xbc[b:b + 1], dt[b:b + 1], float(mins[b]), case.conv0[b:b + 1], case.S0[b:b + 1])
        n = int(q[b])
        assert rel_err(np.asarray(y)[b, :n], y_hf[0, :n]) <= F32_TOL


def test_two_chunks_equal_one_and_decode_continues_prefill():
    case = Case(2, 16, 32, 1, row_words=128, B=3, seed=7)
    T1, T2 = 4, 3
    check_two_chunks_and_decode(case, mamba2_prefill, mamba2_decode, case.inputs(T1 + T2 + 1), case.params(), T1, T2)


@pytest.mark.parametrize("algo,chunk", CHECKPOINT_ALGOS)
def test_prefill_checkpoints(algo, chunk):
    case = Case(4, 8, 16, 2, row_words=64, B=3, num_slots=12, seed=9)
    T = 5
    xbc, dt = case.inputs(T)
    q_lens = jnp.array([5, 4, 2], jnp.int32)
    slots = jnp.array([3, 0, 7], jnp.int32)  # lane 1 is padding: its checkpoints must not be written
    case.slots = slots
    pos = jnp.array([[2, 0, -1], [1, 2, 3], [2, 5, 1]], jnp.int32)   # 5 > q_len in lane 2: padding
    ck = jnp.array([[4, 5, 0], [8, 9, 10], [11, 6, 1]], jnp.int32)
    arena = write_state_reference(case.arena0, slots, {"conv": case.conv0, "ssm": case.S0}, view=case.view)
    _, a = mamba2_prefill(arena, slots, xbc, dt, q_lens, *case.params(), view=case.view, checkpoint_positions=pos,
                          checkpoint_slots=ck, algo=algo, chunk_size=chunk)
    written = {3, 7, 4, 5, 11, 1}
    assert_rows_untouched(case.arena0, a, slot_rows(case.view, jnp.array(sorted(written))))
    for b, row in enumerate(np.asarray(pos)):
        for k, p_ in enumerate(row):
            s = int(ck[b, k])
            if s in (0, 6, 8, 9, 10):
                continue
            _, conv_hf, S_hf = case.oracle(xbc[b:b + 1, :p_], dt[b:b + 1, :p_], None, case.conv0[b:b + 1],
                                           case.S0[b:b + 1])
            conv, S = case.states(a, jnp.array([s], jnp.int32))
            assert rel_err(conv[0], conv_hf[0]) <= F32_TOL and rel_err(S[0], S_hf[0]) <= F32_TOL, (b, k)


def test_decode_rejects_bad_shapes():
    case = Case(4, 8, 16, 2)
    xbc, dt = case.inputs()
    with pytest.raises(ValueError, match="dt must be"):
        mamba2_decode(case.arena, case.slots, xbc, dt[:, :2], *case.params(), view=case.view, impl="reference")
    with pytest.raises(ValueError, match="xbc must be"):
        mamba2_decode(case.arena, case.slots, xbc[:, 1:], dt, *case.params(), view=case.view, impl="pallas",
                      interpret=True)


def test_decode_lowers_for_cuda():
    """NemotronH-8B-like layer: the decode cross-lowers to two Triton calls with the arena aliased."""
    view = state_view(mamba2_state_tensors(128, 64, 128, 8, 4), row_words=1024, layers=1)
    d = mamba2_dims(view)
    B = 8
    S = jax.ShapeDtypeStruct
    args = (S((1 << 24, 1024), jnp.uint16), S((B,), jnp.int32), S((B, d.conv_dim), jnp.bfloat16),
            S((B, d.heads), jnp.bfloat16), S((d.conv_dim, 4), jnp.bfloat16), S((d.conv_dim,), jnp.bfloat16),
            S((d.heads,), jnp.float32), S((d.heads,), jnp.float32), S((d.heads,), jnp.float32))
    check_decode_lowers_for_cuda(mamba2_decode, view, args)


def test_decode_reads_inputs_in_place_from_the_projection():
    """xBC and dt as recurrent.Cols of the in_proj output z | xBC | dt: both impls give exactly what
    the sliced inputs give, the kernels reading the columns in place."""
    case = Case(4, 8, 16, 2, row_words=64, seed=29)
    xbc, dt = case.inputs()
    B, C, H = xbc.shape[0], xbc.shape[1], dt.shape[1]
    z = jnp.asarray(np.random.default_rng(6).standard_normal((B, 32), np.float32))
    zxbcdt = jnp.concatenate([z, xbc, dt], axis=1)
    cols = (recurrent.Cols(zxbcdt, 32, C), recurrent.Cols(zxbcdt, 32 + C, H))
    for impl in ("reference", "pallas"):
        compiled = impl == "pallas" and jax.default_backend() == "gpu"
        kw = dict(view=case.view, impl=impl, interpret=impl == "pallas" and not compiled)
        y, arena = mamba2_decode(case.arena, case.slots, xbc, dt, *case.params(), **kw)
        y2, arena2 = mamba2_decode(case.arena, case.slots, *cols, *case.params(), **kw)
        np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(arena2), np.asarray(arena))
