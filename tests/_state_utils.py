"""Shared helpers for the recurrent-state tests (state_io, mamba2, gated_deltanet; CPU and GPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from umem_jax.memory import full_attention, plan, recurrent_state
from umem_jax.pallas_kernels.state_io import read_state_reference, write_state_reference

POISON = 0xFFFF  # as bf16 a NaN, as an fp32 hi/lo pair a NaN: any stray read shows


def state_view(tensors, *, row_words=64, layers=2, layer=None):
    """A StateView for `tensors` in a small plan: `layers` state layers (the view is of `layer`,
    default the last, so the tensor rows do not start at row 0 of the slot)."""
    decls = [full_attention(0, 1, row_words)] + [recurrent_state(i + 1, tensors) for i in range(layers)]
    p = plan(decls, page_size=4, row_words=row_words)
    return p.state.state_view(layer if layer is not None else layers)


def poisoned_arena(view, num_slots, dtype=jnp.uint16):
    """Arena of `num_slots` slots (slot 0 = padding: on the plan's grid it has no rows, slot 1
    starts at the sink) plus a few spare rows, every word POISON."""
    rows = view.slot_row(num_slots) + 3
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
            out.update(range(view.slot_row(s), view.slot_row(s + 1)))
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


# --------------------------------------------------------------------------- the recurrent kernels
# What the Mamba2 and gated DeltaNet tests share: a case of live states in random slots of a
# poisoned arena, and the checks both families' decode and prefill must pass.

F32_TOL = 1e-5
BF16_TOL = 1e-2
# A 16-bit recurrent state (mamba_ssm_dtype bfloat16 / float16) against the fp32 state: the same fp32
# math, from a state rounded to 16 bits when written (2**-9 relative for bf16) and once more per
# token or chunk.  Measured on these cases (a decode token, a 6-token prefill): at most 3.6e-3 for
# bf16, 5.1e-4 for fp16.
STATE16_TOL = 1e-2

# The prefill scans to test: per token, and chunked with chunks shorter than and as long as T.
PREFILL_ALGOS = [pytest.param("scan", 64, id="scan"), pytest.param("chunked", 4, id="chunked4"),
                 pytest.param("chunked", 64, id="chunked64")]
CHECKPOINT_ALGOS = [pytest.param("scan", 64, id="scan"), pytest.param("chunked", 2, id="chunked2")]


def np_softplus(x):
    """torch's softplus (threshold 20) in numpy."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


class StateCase:
    """A state view of `tensors` whose recurrent tensor is `state`, `arena0` all POISON, B lanes of
    slots (one of them padding) drawn from `rng`.  Subclasses draw their parameters and initial
    states next, then call `set_states(conv0, S0)`."""

    def __init__(self, tensors, state: str, *, row_words, num_slots, B, seed, dtype, arena_dtype,
                 state_dtype="float32"):
        self.state = state
        tensors = tuple(dataclasses.replace(t, dtype=state_dtype) if t.name == state else t for t in tensors)
        self.view = state_view(tensors, row_words=row_words)
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.B = B
        self.arena0 = poisoned_arena(self.view, num_slots, arena_dtype)
        self.slots = random_slots(self.rng, num_slots, B, pad=1)

    def set_states(self, conv0, S0):
        """Live states conv0 [B, K-1, C] and S0 in every real slot; poison everywhere else."""
        self.conv0, self.S0 = conv0, S0
        self.arena = write_state_reference(self.arena0, self.slots, {"conv": conv0, self.state: S0}, view=self.view)

    @property
    def real(self):
        return np.asarray(self.slots) != 0

    def states(self, arena, slots=None):
        """(conv, recurrent tensor) float64 of `slots` (default the case's)."""
        st = read_state_reference(arena, self.slots if slots is None else slots, view=self.view)
        return np.asarray(st["conv"], np.float64), np.asarray(st[self.state], np.float64)


def check_decode(case, decode, inputs, params):
    """Pallas decode (interpret) vs the reference: outputs (0 on padding lanes), states, no row
    outside the real slots touched.  Returns (out, arena) of the reference."""
    out_ref, a_ref = decode(case.arena, case.slots, *inputs, *params, view=case.view, impl="reference")
    out_pal, a_pal = decode(case.arena, case.slots, *inputs, *params, view=case.view, impl="pallas",
                            interpret=True)
    out_pal = np.asarray(out_pal)
    assert np.isfinite(out_pal).all(), "unwritten or poisoned output"
    assert rel_err(out_pal, out_ref) <= F32_TOL
    assert not out_pal[~case.real].any(), "padding lanes output 0"
    for impl_arena in (a_ref, a_pal):
        assert_rows_untouched(case.arena, impl_arena, slot_rows(case.view, case.slots))
        assert_rows_untouched(case.arena0, impl_arena, slot_rows(case.view, case.slots))  # sink and spare rows
    for got, want in zip(case.states(a_pal), case.states(a_ref)):
        assert rel_err(got[case.real], want[case.real]) <= F32_TOL
    return out_ref, a_ref


def check_against_oracle(case, out, arena, oracle, tol=F32_TOL):
    """One decode token (out [B, ...], arena) vs the numpy oracle's (out [B, 1, ...], conv, S)."""
    out_hf, conv_hf, S_hf = oracle
    conv, S = case.states(arena)
    real = case.real
    assert rel_err(np.asarray(out, np.float32)[real], out_hf[real, 0]) <= tol
    assert rel_err(conv[real], conv_hf[real]) <= tol
    assert rel_err(S[real], S_hf[real]) <= tol


def check_bf16_decode(case, decode, inputs, params, oracle):
    """bf16 activations, conv state and arena: Pallas vs reference and both vs the oracle within
    bf16 tolerance; the dtypes stay bf16."""
    out_ref, _ = decode(case.arena, case.slots, *inputs, *params, view=case.view, impl="reference")
    out_pal, a_pal = decode(case.arena, case.slots, *inputs, *params, view=case.view, impl="pallas",
                            interpret=True)
    assert out_pal.dtype == jnp.bfloat16 and a_pal.dtype == jnp.bfloat16
    assert rel_err(np.asarray(out_pal, np.float32), np.asarray(out_ref, np.float32)) <= BF16_TOL
    assert_rows_untouched(case.arena, a_pal, slot_rows(case.view, case.slots))
    out_hf, _, S_hf = oracle
    for out in (out_ref, out_pal):
        assert rel_err(np.asarray(out, np.float32)[case.real], out_hf[case.real, 0]) <= BF16_TOL
    assert rel_err(case.states(a_pal)[1][case.real], S_hf[case.real]) <= BF16_TOL


def check_prefill_lanes(case, out, arena, q_lens, oracle_lane):
    """A prefill's (out [B, T, ...], arena) lane by lane vs `oracle_lane(b, n) -> (out, conv, S)`
    of the lane's first n = q_len tokens; padding lanes and tokens output 0."""
    out = np.asarray(out)
    conv, S = case.states(arena)
    assert_rows_untouched(case.arena0, arena, slot_rows(case.view, case.slots))
    for b in range(case.B):
        if not case.real[b]:
            assert not out[b].any()
            continue
        n = int(q_lens[b])
        out_hf, conv_hf, S_hf = oracle_lane(b, n)
        if n:
            assert rel_err(out[b, :n], out_hf[0]) <= F32_TOL
        assert not out[b, n:].any(), "padding tokens output 0"
        assert rel_err(conv[b], conv_hf[0]) <= F32_TOL
        assert rel_err(S[b], S_hf[0]) <= F32_TOL


def check_two_chunks_and_decode(case, prefill, decode, inputs, params, T1, T2):
    """inputs [B, T1 + T2 + 1, ...]: a prefill of T1 + T2 tokens == the same tokens in two chunks
    (the second padded to T1), and a Pallas decode of the next token == a prefill one token longer."""
    B, real = case.B, case.real
    full = jnp.full((B,), T1 + T2, jnp.int32)
    reset = jnp.ones((B,), bool)
    out_one, a_one = prefill(case.arena, case.slots, *[x[:, :T1 + T2] for x in inputs], full, *params,
                             view=case.view, reset=reset)
    out1, a2 = prefill(case.arena, case.slots, *[x[:, :T1] for x in inputs], jnp.full((B,), T1, jnp.int32),
                       *params, view=case.view, reset=reset)
    pad = lambda x: jnp.pad(x[:, T1:T1 + T2], ((0, 0), (0, T1 - T2), (0, 0)))
    out2, a2 = prefill(a2, case.slots, *[pad(x) for x in inputs], jnp.full((B,), T2, jnp.int32), *params,
                       view=case.view)
    assert rel_err(np.asarray(out1)[real], np.asarray(out_one)[real, :T1]) <= F32_TOL
    assert rel_err(np.asarray(out2)[real, :T2], np.asarray(out_one)[real, T1:]) <= F32_TOL
    for got, want in zip(case.states(a2), case.states(a_one)):
        assert rel_err(got[real], want[real]) <= F32_TOL
    out_dec, a3 = decode(a_one, case.slots, *[x[:, -1] for x in inputs], *params, view=case.view, impl="pallas",
                         interpret=True)
    out_long, a_long = prefill(case.arena, case.slots, *inputs, full + 1, *params, view=case.view, reset=reset)
    assert rel_err(np.asarray(out_dec)[real], np.asarray(out_long)[real, -1]) <= F32_TOL
    for got, want in zip(case.states(a3), case.states(a_long)):
        assert rel_err(got[real], want[real]) <= F32_TOL


def check_decode_lowers_for_cuda(decode, view, args):
    """The decode cross-lowers for CUDA to two Triton calls (conv, then the state update) with the
    arena aliased; skipped where this jax wants GPU info to lower Triton without a GPU."""
    f = jax.jit(lambda *a: decode(*a, view=view, impl="pallas"), donate_argnums=0)
    try:
        txt = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:
        if "abstract" in str(e).lower() or "device" in str(e).lower():
            pytest.skip(f"cannot cross-lower for CUDA on this jax: {e}")
        raise
    assert txt.count("__gpu$xla.gpu.triton") == 2 and "output_operand_aliases" in txt


def check_16bit_state(make_case, decode, prefill, T: int, state_dtype="bfloat16"):
    """The recurrent tensor stored as one 16-bit plane (`make_case(state_dtype)`) against the fp32
    two-plane state of the same draws (`make_case("float32")`): half the words per slot; the Pallas
    decode equals the reference on it (the same fp32 math from the same words); decode and a
    T-token chunked prefill stay within STATE16_TOL of the fp32 state's outputs and states; the
    state stays 16-bit in the arena; padding lanes and rows outside the slots are untouched."""
    c32, c16 = make_case("float32"), make_case(state_dtype)
    rows16, rows32 = c16.view[c16.state], c32.view[c32.state]
    assert (rows16.planes, rows32.planes) == (1, 2) and rows16.rows_per_plane == rows32.rows_per_plane
    assert c16.view.rows_per_slot < c32.view.rows_per_slot
    real = c16.real
    inputs = c32.inputs()
    out_ref, a_ref = decode(c16.arena, c16.slots, *inputs, *c16.params(), view=c16.view, impl="reference")
    out_pal, a_pal = decode(c16.arena, c16.slots, *inputs, *c16.params(), view=c16.view, impl="pallas",
                            interpret=True)
    assert rel_err(out_pal, out_ref) <= F32_TOL and not np.asarray(out_pal)[~real].any()
    for a in (a_ref, a_pal):
        assert_rows_untouched(c16.arena, a, slot_rows(c16.view, c16.slots))
    st = read_state_reference(a_pal, c16.slots, view=c16.view)[c16.state]
    assert st.dtype == jnp.dtype(state_dtype)
    ulp = 2.0 ** -(7 if state_dtype == "bfloat16" else 10)  # one rounding of the stored state, at most
    assert rel_err(c16.states(a_pal)[1][real], c16.states(a_ref)[1][real]) <= ulp
    out32, a32 = decode(c32.arena, c32.slots, *inputs, *c32.params(), view=c32.view, impl="reference")
    assert rel_err(np.asarray(out_ref)[real], np.asarray(out32)[real]) <= STATE16_TOL
    assert rel_err(c16.states(a_ref)[1][real], c32.states(a32)[1][real]) <= STATE16_TOL
    seq = c32.inputs(T)
    q_lens = jnp.full((c16.B,), T, jnp.int32)
    y16, a16 = prefill(c16.arena, c16.slots, *seq, q_lens, *c16.params(), view=c16.view, chunk_size=4)
    y32, a32 = prefill(c32.arena, c32.slots, *seq, q_lens, *c32.params(), view=c32.view, chunk_size=4)
    assert rel_err(np.asarray(y16)[real], np.asarray(y32)[real]) <= STATE16_TOL
    for got, want in zip(c16.states(a16), c32.states(a32)):
        assert rel_err(got[real], want[real]) <= STATE16_TOL
    assert_rows_untouched(c16.arena, a16, slot_rows(c16.view, c16.slots))
