"""Gated DeltaNet state kernels: Pallas decode (interpret) vs reference, references vs a
per-token numpy loop written from Hugging Face's `torch_recurrent_gated_delta_rule` (in HF's
[Hv, Dk, Dv] orientation; the arena stores it transposed), chunked prefill continuity,
checkpoints, padding lanes and poison outside the slots."""

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

from umem_jax.memory import gated_deltanet_state_tensors
from umem_jax.pallas_kernels import recurrent
from umem_jax.pallas_kernels.gated_deltanet import gdn_decode, gdn_dims, gdn_prefill, pallas_supported
from umem_jax.pallas_kernels.state_io import write_state_reference

# ------------------------------------------------------------------- numpy oracle (HF math)


def _l2norm(x, eps=1e-6):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def hf_gdn(conv0, S0_hf, qkv, a, b, w, A_log, dt_bias, Hk, Hv, Dk, Dv):
    """Float64 per-token loop following HF (Qwen3.5): conv_state (B, C, K) rolled left, silu conv
    without bias; l2norm q, k; repeat_interleave over value heads; g, beta; the recurrent delta
    rule on S [B, Hv, Dk, Dv] (HF orientation).  conv0 [B, K-1, C] (oldest first).
    Returns o [B, T, Hv, Dv], conv [B, K-1, C], S [B, Hv, Dk, Dv]."""
    f = lambda x: np.asarray(x, np.float64)
    Bsz, T, C = qkv.shape
    K = w.shape[1]
    conv = np.zeros((Bsz, C, K))
    conv[:, :, 1:] = f(conv0).transpose(0, 2, 1)
    S = f(S0_hf).copy()
    r = Hv // Hk
    outs = []
    for t in range(T):
        conv = np.roll(conv, -1, axis=-1)
        conv[:, :, -1] = f(qkv[:, t])
        m = (conv * f(w)[None]).sum(-1)
        m = m / (1 + np.exp(-m))
        q = m[:, :Hk * Dk].reshape(Bsz, Hk, Dk)
        k = m[:, Hk * Dk:2 * Hk * Dk].reshape(Bsz, Hk, Dk)
        v = m[:, 2 * Hk * Dk:].reshape(Bsz, Hv, Dv)
        q, k = np.repeat(_l2norm(q), r, axis=1), np.repeat(_l2norm(k), r, axis=1)   # repeat_interleave
        q = q / np.sqrt(Dk)
        beta = 1 / (1 + np.exp(-f(b[:, t])))
        g = -np.exp(f(A_log)) * np_softplus(f(a[:, t]) + f(dt_bias))
        S = S * np.exp(g)[:, :, None, None]
        kv_mem = (S * k[..., None]).sum(-2)
        delta = (v - kv_mem) * beta[..., None]
        S = S + k[..., None] * delta[..., None, :]
        outs.append((S * q[..., None]).sum(-2))
    o = np.stack(outs, 1) if outs else np.zeros((Bsz, 0, Hv, Dv))
    return o, conv[:, :, 1:].transpose(0, 2, 1), S


class Case(StateCase):
    def __init__(self, Hk, Hv, Dk, Dv, K=4, row_words=64, num_slots=7, B=4, seed=0, dtype=jnp.float32,
                 arena_dtype=jnp.uint16, state_dtype="float32"):
        self.Hk, self.Hv, self.Dk, self.Dv = Hk, Hv, Dk, Dv
        conv_dtype = "float32" if dtype == jnp.float32 else "bfloat16"
        super().__init__(gated_deltanet_state_tensors(Hk, Hv, Dk, Dv, K, conv_dtype=conv_dtype), "recurrent",
                         row_words=row_words, num_slots=num_slots, B=B, seed=seed, dtype=dtype,
                         arena_dtype=arena_dtype, state_dtype=state_dtype)
        self.d = gdn_dims(self.view)
        r = lambda *s: self.rng.standard_normal(s).astype(np.float32)
        C = self.d.conv_dim
        self.w = jnp.asarray(r(C, K) * 0.5, dtype)
        self.A_log = jnp.asarray(r(Hv) * 0.5, jnp.float32)
        self.dt_bias = jnp.asarray(r(Hv) * 0.5, jnp.float32)
        self.set_states(jnp.asarray(r(B, K - 1, C), dtype),
                  jnp.asarray(r(B, Hv, Dv, Dk) * 0.3, jnp.float32))                  # arena orientation

    def inputs(self, T=None):
        lead = (self.B,) if T is None else (self.B, T)
        n = lambda *s: jnp.asarray(self.rng.standard_normal(s), self.dtype)
        return n(*lead, self.d.conv_dim), n(*lead, self.Hv), n(*lead, self.Hv)

    def params(self):
        return self.w, self.A_log, self.dt_bias

    def oracle(self, qkv, a, b, sl=slice(None), conv0=None, S0=None):
        """HF loop for lanes `sl`; returns S in the arena orientation [B, Hv, Dv, Dk]."""
        conv0 = self.conv0[sl] if conv0 is None else conv0
        S0 = self.S0[sl] if S0 is None else S0
        o, conv, S = hf_gdn(conv0, np.swapaxes(np.asarray(S0, np.float64), -1, -2), np.asarray(qkv, np.float64),
                            np.asarray(a, np.float64), np.asarray(b, np.float64), np.asarray(self.w, np.float64),
                            self.A_log, self.dt_bias, self.Hk, self.Hv, self.Dk, self.Dv)
        return o, conv, np.swapaxes(S, -1, -2)


@pytest.mark.parametrize("Hk,Hv,Dk,Dv,row_words", [(2, 4, 16, 8, 64),     # GQA 2, tile inside a row
                                                   (2, 2, 32, 16, 64),    # no GQA, tile spans rows
                                                   (1, 3, 16, 16, 128)])  # odd value-head count
def test_decode_pallas_matches_reference_and_hf(Hk, Hv, Dk, Dv, row_words):
    case = Case(Hk, Hv, Dk, Dv, row_words=row_words, seed=Hv + Dk)
    assert pallas_supported(case.view)
    qkv, a, b = case.inputs()
    o_ref, a_ref = check_decode(case, gdn_decode, (qkv, a, b), case.params())
    check_against_oracle(case, o_ref, a_ref, case.oracle(qkv[:, None], a[:, None], b[:, None]))


def test_decode_bf16_inputs_bf16_arena():
    case = Case(2, 4, 16, 8, row_words=64, dtype=jnp.bfloat16, arena_dtype=jnp.bfloat16, seed=11)
    qkv, a, b = case.inputs()
    check_bf16_decode(case, gdn_decode, (qkv, a, b), case.params(), case.oracle(qkv[:, None], a[:, None], b[:, None]))


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16"])
def test_16bit_recurrent_state_close_to_fp32(state_dtype):
    """mamba_ssm_dtype bfloat16 / float16: the recurrent matrix in one 16-bit plane, computed in fp32."""
    check_16bit_state(lambda sd: Case(2, 4, 16, 8, row_words=64, seed=17, state_dtype=sd), gdn_decode, gdn_prefill,
                      T=6, state_dtype=state_dtype)


@pytest.mark.parametrize("algo,chunk", PREFILL_ALGOS)
def test_prefill_matches_hf_loop_with_q_lens(algo, chunk):
    case = Case(2, 4, 16, 8, row_words=64, B=4, seed=13)
    T = 6
    qkv, a, b = case.inputs(T)
    q_lens = jnp.array([6, 0, 2, 5], jnp.int32)
    o, arena = gdn_prefill(case.arena, case.slots, qkv, a, b, q_lens, *case.params(), view=case.view,
                           impl="reference", algo=algo, chunk_size=chunk)
    lane = lambda i, n: case.oracle(qkv[i:i + 1, :n], a[i:i + 1, :n], b[i:i + 1, :n], slice(i, i + 1))
    check_prefill_lanes(case, o, arena, q_lens, lane)


def test_two_chunks_equal_one_and_decode_continues_prefill():
    case = Case(2, 2, 32, 16, row_words=64, B=3, seed=17)
    T1, T2 = 4, 2
    check_two_chunks_and_decode(case, gdn_prefill, gdn_decode, case.inputs(T1 + T2 + 1), case.params(), T1, T2)


@pytest.mark.parametrize("algo,chunk", CHECKPOINT_ALGOS)
def test_prefill_checkpoints_and_reset(algo, chunk):
    case = Case(2, 4, 16, 8, row_words=64, B=2, num_slots=8, seed=19)
    T = 4
    qkv, a, b = case.inputs(T)
    slots = jnp.array([2, 5], jnp.int32)
    arena = write_state_reference(case.arena0, slots, {"conv": case.conv0[:2], "recurrent": case.S0[:2]},
                                  view=case.view)
    q_lens = jnp.array([4, 3], jnp.int32)
    reset = jnp.array([False, True])
    pos = jnp.array([[0, 3], [3, -1]], jnp.int32)
    ck = jnp.array([[1, 3], [4, 6]], jnp.int32)
    _, out = gdn_prefill(arena, slots, qkv[:2], a[:2], b[:2], q_lens, *case.params(), view=case.view, reset=reset,
                         checkpoint_positions=pos, checkpoint_slots=ck, algo=algo, chunk_size=chunk)
    assert_rows_untouched(case.arena0, out, slot_rows(case.view, jnp.array([2, 5, 1, 3, 4])))
    zero_conv = jnp.zeros_like(case.conv0[:1])
    zero_S = jnp.zeros_like(case.S0[:1])
    for lane, p_, s in ((0, 0, 1), (0, 3, 3), (1, 3, 4), (0, 4, 2), (1, 3, 5)):
        init = ({} if lane == 0 else {"conv0": zero_conv, "S0": zero_S})
        _, conv_hf, S_hf = case.oracle(qkv[lane:lane + 1, :p_], a[lane:lane + 1, :p_], b[lane:lane + 1, :p_],
                                       slice(lane, lane + 1), **init)
        conv, S = case.states(out, jnp.array([s], jnp.int32))
        assert rel_err(conv[0], conv_hf[0]) <= F32_TOL and rel_err(S[0], S_hf[0]) <= F32_TOL, (lane, p_, s)


@pytest.mark.parametrize("short_scan", [0, 8])
def test_default_algo_follows_short_scan_tokens(short_scan, monkeypatch):
    """algo=None: a chunk of at most SHORT_SCAN_TOKENS tokens (a verify's k+1) takes the unrolled
    per-token scan, a longer one the chunked form; either way the state, checkpoints and outputs
    are those of the explicit algorithm, bit for bit, and both agree with each other in fp32."""
    monkeypatch.setattr(recurrent, "SHORT_SCAN_TOKENS", short_scan)
    case = Case(2, 4, 16, 8, row_words=64, B=2, num_slots=8, seed=np.random.randint(1 << 30))
    slots = jnp.array([2, 5], jnp.int32)
    arena0 = write_state_reference(case.arena0, slots, {"conv": case.conv0[:2], "recurrent": case.S0[:2]},
                                   view=case.view)
    q_lens = jnp.array([4, 3], jnp.int32)
    pos = jnp.array([[1, 3], [2, -1]], jnp.int32)
    ck = jnp.array([[1, 3], [4, 0]], jnp.int32)

    def run(inputs, algo):
        qkv, a, b = inputs
        return gdn_prefill(arena0, slots, qkv[:2], a[:2], b[:2], q_lens, *case.params(), view=case.view,
                           checkpoint_positions=pos, checkpoint_slots=ck, algo=algo, chunk_size=2)

    for T in (4, 12):
        inputs = case.inputs(T)
        (o, arena), (o_chunk, arena_chunk) = run(inputs, None), run(inputs, "chunked")
        want_o, want_arena = run(inputs, "scan") if T <= short_scan else (o_chunk, arena_chunk)
        np.testing.assert_array_equal(np.asarray(o), np.asarray(want_o))
        np.testing.assert_array_equal(np.asarray(arena), np.asarray(want_arena))
        assert rel_err(o, o_chunk) <= F32_TOL
        written = jnp.array([1, 3, 4, 2, 5], jnp.int32)  # the checkpoints, then the rows' own slots
        for got, want in zip(case.states(arena, written), case.states(arena_chunk, written)):
            assert rel_err(got, want) <= F32_TOL


def test_decode_lowers_for_cuda():
    """Qwen3.5-4B-like layer: the decode cross-lowers to two Triton calls with the arena aliased."""
    view = state_view(gated_deltanet_state_tensors(16, 32, 128, 128, 4), row_words=1024, layers=1)
    d = gdn_dims(view)
    B = 8
    S = jax.ShapeDtypeStruct
    args = (S((1 << 24, 1024), jnp.uint16), S((B,), jnp.int32), S((B, d.conv_dim), jnp.bfloat16),
            S((B, d.v_heads), jnp.bfloat16), S((B, d.v_heads), jnp.bfloat16), S((d.conv_dim, 4), jnp.bfloat16),
            S((d.v_heads,), jnp.float32), S((d.v_heads,), jnp.float32))
    check_decode_lowers_for_cuda(gdn_decode, view, args)


def test_decode_reads_inputs_in_place_from_one_projection():
    """qkv, a and b as recurrent.Cols of one wider [B, W] projection (the fused qkv | z | b | a the
    model hands over): both impls give exactly what the sliced inputs give, with the kernels reading
    the columns in place; columns outside the input are refused."""
    case = Case(2, 4, 16, 8, row_words=64, seed=23)
    qkv, a, b = case.inputs()
    B, C, H = qkv.shape[0], qkv.shape[1], a.shape[1]
    z = jnp.asarray(np.random.default_rng(5).standard_normal((B, 24), np.float32))
    wide = jnp.concatenate([qkv, z, b, a], axis=1)  # the fused projection's order
    cols = (recurrent.Cols(wide, 0, C), recurrent.Cols(wide, C + 24 + H, H), recurrent.Cols(wide, C + 24, H))
    for impl in ("reference", "pallas"):
        compiled = impl == "pallas" and jax.default_backend() == "gpu"
        kw = dict(view=case.view, impl=impl, interpret=impl == "pallas" and not compiled)
        o, arena = gdn_decode(case.arena, case.slots, qkv, a, b, *case.params(), **kw)
        o2, arena2 = gdn_decode(case.arena, case.slots, *cols, *case.params(), **kw)
        np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(arena2), np.asarray(arena))
    with pytest.raises(ValueError, match="outside"):
        past = recurrent.Cols(wide, wide.shape[1] - C + 1, C)
        gdn_decode(case.arena, case.slots, past, a, b, *case.params(), view=case.view, impl="pallas", interpret=True)
