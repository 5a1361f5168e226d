"""What the Mamba2 and gated DeltaNet state kernels share.

Both families keep, per layer and request slot, a conv state "conv" [K-1, conv_dim] and one
recurrent tensor (Mamba2 "ssm" [H, P, N], gated DeltaNet "recurrent" [Hv, Dv, Dk]), stored fp32 or
16-bit (STATE_DTYPES) and always computed in fp32: read, decoded to fp32, updated, rounded back to
the stored dtype when written (once per decode token; once per prefill chunk and checkpoint).  A decode
token is the causal conv over the conv state, then a per-head update of the recurrent tensor; a
prefill chunk is the conv over the chunk, then a scan (per token or chunked) from the slot's
state, optionally also writing checkpoints: the state after the first p tokens of the chunk, into
further slots.  The family modules supply the math (a step function, a scan core, a decode
kernel body); this module reads and writes the arena around it.

Shapes: slots int32 [B] (0 = padding lane: output 0, no state touched); checkpoint positions and
checkpoint slots int32 [B, C] (C checkpoints per row; position -1 or slot 0 is padding).

A decode token's per-row inputs (the conv input, the gates) are slices of one input projection.
Handed over as `Cols(src, start, width)`, columns start..start+width of src [B, W], the Pallas
decode kernels read them in place: at batch 1 each slice XLA materialises is a copy launch of
about 1.1 us (three or four a layer, benchmarks/RESULTS.md session 20 traces).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr, triton_params
from .causal_conv import conv_decode_pallas, conv_decode_reference, conv_prefill_reference
from .launch import ANY, resolve_impl
from .state_io import block_fits, check_slots, read_state, read_state_reference, write_state, write_state_reference
from .words import from_u16, to_u16

STATE_DTYPES = ("float32", "bfloat16", "float16")  # what the recurrent tensor may be stored as

__all__ = ["STATE_DTYPES", "Cols", "as_array", "check_prefill_batch", "check_shapes", "checkpoint_args", "decode_impl",
           "decode_pallas", "decode_reference", "from_chunks", "initial_checkpoints", "prefill", "scan_tokens",
           "softplus", "src_start", "tile_rows", "to_chunks"]


@jax.tree_util.register_pytree_node_class
class Cols:
    """Columns start .. start + width of src [..., W]: a decode input read in place.  A pytree whose
    one leaf is src: start and width are static, so a jitted kernel wrapper takes it as an argument
    and compiles once per window."""

    def __init__(self, src: jax.Array, start: int, width: int):
        self.src, self.start, self.width = src, int(start), int(width)

    def tree_flatten(self):
        return (self.src,), (self.start, self.width)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(leaves[0], *aux)

    @property
    def shape(self):
        return (*self.src.shape[:-1], self.width)

    @property
    def dtype(self):
        return self.src.dtype


def as_array(v) -> jax.Array:
    """A decode input (an array or Cols) as an array: Cols sliced (an XLA copy)."""
    return jax.lax.slice_in_dim(v.src, v.start, v.start + v.width, axis=-1) if isinstance(v, Cols) else v


def src_start(v) -> tuple[jax.Array, int]:
    """A decode input (an array or Cols) -> (the array a kernel reads, its first column there)."""
    if not isinstance(v, Cols):
        return v, 0
    if not 0 <= v.start <= v.src.shape[-1] - v.width:
        raise ValueError(f"columns {v.start}..{v.start + v.width} outside an input of {v.src.shape[-1]}")
    return v.src, int(v.start)


def softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20): x above 20, else log1p(exp(x))."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def check_shapes(want: dict, got: dict) -> None:
    """Every array got[name] has the shape want[name] and a floating dtype."""
    for name, shape in want.items():
        if tuple(got[name].shape) != tuple(shape):
            raise ValueError(f"{name} must be {list(shape)}, got {list(got[name].shape)}")
        if not jnp.issubdtype(got[name].dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {got[name].dtype}")


# --------------------------------------------------------------------------- decode


def decode_impl(impl: str | None, interpret: bool, supported) -> str:
    """`resolve_impl`, except that a defaulted pallas falls back to the reference where the
    layout has no Pallas tile (`supported()` is False); an explicit impl is kept."""
    chosen = resolve_impl(impl, interpret)
    if chosen == "pallas" and impl is None and not supported():
        chosen = "reference"
    return chosen


def decode_reference(arena, slots, x, conv_weight, conv_bias, *, view, state_name: str, step):
    """Plain-JAX decode token: read the slots' state (one XLA gather), conv, then
    `step(S, xc) -> (out fp32 [B, heads, rows], S')` on the recurrent tensor named `state_name`,
    write both back (one scatter).  Returns (out in x's dtype, padding lanes 0; arena)."""
    tensors = read_state_reference(arena, slots, view=view)
    xc, conv = conv_decode_reference(tensors["conv"], x, conv_weight, conv_bias)
    out, S = step(tensors[state_name].astype(jnp.float32), xc)  # fp32 math for a 16-bit state too
    arena = write_state_reference(arena, slots, {"conv": conv, state_name: S}, view=view)
    out = jnp.where((slots != 0)[:, None, None], out, 0.0)
    return out.astype(x.dtype), arena


def tile_rows(view, rows: int, row_len: int, target: int = 4096) -> int | None:
    """Rows of one decode program's tile of a [rows, row_len] head of the recurrent tensor: a
    power of two dividing `rows` whose [tile, row_len] run is one block (state_io.block_fits),
    about `target` elements; None if there is none."""
    tile = 1
    while rows % (tile * 2) == 0 and tile * 2 * row_len <= target:
        tile *= 2
    while tile >= 1:
        if block_fits(view, tile * row_len):
            return tile
        tile //= 2
    return None


def _head_program(slots_ref, *refs, update, block: int):
    """Program (b, h, i): rows [i*block, (i+1)*block) of head h of lane b's recurrent tensor.
    `update(b, h, slot, row0, *input_refs, arena_ref)` updates them in the arena and returns
    their output [block]; a padding lane stores 0 and touches no state."""
    *input_refs, arena_in, out_ref, arena_ref = refs
    del arena_in  # aliased with arena_ref
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[b]
    row0 = pl.multiple_of(i * block, block)
    dst = out_ref.at[b, h, pl.ds(row0, block)]

    @pl.when(slot == 0)
    def _():
        pltr.store(dst, jnp.zeros((block,), out_ref.dtype))

    @pl.when(slot != 0)
    def _():
        pltr.store(dst, update(b, h, slot, row0, *input_refs, arena_ref).astype(out_ref.dtype))


def decode_pallas(arena, slots, x, conv_weight, conv_bias, head_inputs, *, view, update, heads: int, rows: int,
                  block: int, name: str, interpret: bool, conv_block_c, num_warps: int, num_stages: int,
                  x_start: int = 0):
    """Pallas decode token: the conv kernel, then one `_head_program` per (lane, head, block of
    `block` rows), both in place on the arena's uint16 words.  x [B, W]: the conv input is its
    columns x_start .. x_start + conv_dim.  `update` gets the refs of the conv output xc fp32
    [B, conv_dim] and of `head_inputs`, then the arena.
    Returns (out [B, heads, rows] in x's dtype, arena)."""
    dtype = arena.dtype
    words = to_u16(arena)  # integer words only: see state_io._U16_NOTE
    params = triton_params(num_warps=num_warps, num_stages=num_stages)
    xc, words = conv_decode_pallas(words, slots, x, conv_weight, conv_bias, view=view, rows=view["conv"],
                                   interpret=interpret, block=conv_block_c, compiler_params=params, x_start=x_start)
    args = (slots, xc, *head_inputs, words)
    B = slots.shape[0]
    out, words = pl.pallas_call(
        functools.partial(_head_program, update=update, block=block),
        grid=(B, heads, rows // block),
        in_specs=[ANY] * len(args),
        out_specs=(ANY, ANY),
        out_shape=(jax.ShapeDtypeStruct((B, heads, rows), x.dtype),
                   jax.ShapeDtypeStruct(words.shape, words.dtype)),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(*args)
    return out, from_u16(words, dtype)


# --------------------------------------------------------------------------- prefill


def check_prefill_batch(B: int, slots, q_lens, reset) -> None:
    """slots int32 [B], q_lens integer [B] and reset [B] | None against the chunk's batch B.  Without
    this a mismatch surfaced deep in the conv or the scan as a concatenate / vmap / broadcast error
    that named none of them."""
    check_slots(slots)
    if slots.shape[0] != B:
        raise ValueError(f"slots must be int32 [{B}] (one per row of the chunk), got {slots.dtype}{list(slots.shape)}")
    if q_lens.shape != (B,) or not jnp.issubdtype(q_lens.dtype, jnp.integer):
        raise ValueError(f"q_lens must be int32 [{B}], got {q_lens.dtype}{list(q_lens.shape)}")
    if reset is not None and jnp.shape(reset) != (B,):
        raise ValueError(f"reset must be [{B}] (one flag per row) or None, got shape {list(jnp.shape(reset))}")


def checkpoint_args(checkpoint_positions, checkpoint_slots, q_lens):
    """Normalise checkpoint args: positions outside [0, q_len] or slot <= 0 are padding (slot 0)."""
    if checkpoint_positions is None:
        return None, None
    pos = checkpoint_positions.astype(jnp.int32)
    slots = checkpoint_slots.astype(jnp.int32)
    if pos.shape != slots.shape or pos.ndim != 2 or pos.shape[0] != q_lens.shape[0]:
        raise ValueError(f"checkpoint_positions and checkpoint_slots must both be [B, K], got {pos.shape} "
                         f"{slots.shape}")
    valid = (pos >= 0) & (pos <= q_lens[:, None]) & (slots > 0)
    return jnp.where(valid, pos, 0), jnp.where(valid, slots, 0)


def _reset(state: dict, reset):
    """The state tensors, zeroed in the lanes where reset [B] is set (a request's first chunk)."""
    if reset is None:
        return state
    keep = ~reset.astype(bool)
    return {k: jnp.where(keep.reshape(-1, *([1] * (v.ndim - 1))), v, jnp.zeros((), v.dtype)) for k, v in state.items()}


# A chunk of at most this many tokens (a speculative verify's k+1) runs the per-token recurrence,
# unrolled, instead of the chunked form, whose triangular solve and ~10 small einsums per layer may
# cost more than a few token steps at B = 1.  0 (the default): always chunked, until the GPU decides
# (benchmarks/RESULTS.md's list: the B = 1 verify costs 1.59x a decode step).  UMEM_JAX_SHORT_SCAN
# sets it when the process starts.
SHORT_SCAN_TOKENS = int(os.environ.get("UMEM_JAX_SHORT_SCAN", "0"))
UNROLL_TOKENS = 8  # a scan over at most this many tokens is unrolled (one straight-line program)


def prefill_algo(algo: str | None, tokens: int) -> str:
    """The prefill algorithm for a chunk of `tokens`: `algo` if given, else "scan" up to
    SHORT_SCAN_TOKENS and "chunked" above."""
    if algo is not None:
        return algo
    return "scan" if tokens <= SHORT_SCAN_TOKENS else "chunked"


def initial_checkpoints(S0, pos):
    """Checkpoints before the chunk's first token: S0 [B, ...] where p == 0, else zeros
    -> [B, C, ...]; None without checkpoints."""
    if pos is None:
        return None
    return jnp.where((pos == 0)[:, :, None, None, None], S0[:, None], jnp.zeros((), jnp.float32))


def scan_tokens(S0, step, inputs, q_lens, pos):
    """The exact per-token recurrence (lax.scan over T): `step(S, *inputs_t) -> (out_t, S')` on
    the [B, ...] token slices of `inputs` (each [B, T, ...]); tokens t >= q_len leave S as it is.
    S0 [B, heads, a, b]; pos [B, C] | None -> (out [B, T, ...], S, checkpoints [B, C, heads, a, b]
    | None)."""
    T = inputs[0].shape[1]

    def body(carry, inp):
        S, checkpoints = carry
        t, *inputs_t = inp
        out, S_new = step(S, *inputs_t)
        S = jnp.where((t < q_lens)[:, None, None, None], S_new, S)
        if checkpoints is not None:  # checkpoint p = t + 1: the state after token t
            checkpoints = jnp.where((pos == t + 1)[:, :, None, None, None], S[:, None], checkpoints)
        return (S, checkpoints), out

    xs = (jnp.arange(T, dtype=jnp.int32), *(jnp.swapaxes(a, 0, 1) for a in inputs))
    (S, checkpoints), outs = jax.lax.scan(body, (S0, initial_checkpoints(S0, pos)), xs,
                                          unroll=T if T <= UNROLL_TOKENS else 1)
    return jnp.swapaxes(outs, 0, 1), S, checkpoints


def to_chunks(a, L: int):
    """[B, T, ...] -> [ceil(T / L), B, L, ...], zero-padded to whole chunks (the scans give
    padding tokens zero decay and zero input, so the zeros are inert)."""
    B, T = a.shape[:2]
    n = -(-T // L)
    a = jnp.pad(a, ((0, 0), (0, n * L - T)) + ((0, 0),) * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(B, n, L, *a.shape[2:]), 1, 0)


def from_chunks(outs, T: int):
    """Inverse of to_chunks for the scan's outputs: [n, B, L, ...] -> [B, T, ...]."""
    n, B, L = outs.shape[:3]
    return jnp.moveaxis(outs, 0, 1).reshape(B, n * L, *outs.shape[3:])[:, :T]


def chunk_checkpoints(pos, c, L: int):
    """Which checkpoints fall inside chunk c: the state after local token pos - c*L - 1.
    Returns (inside bool [B, C], that token clipped into [0, L) int32 [B, C])."""
    local = pos - c * L - 1
    return (local >= 0) & (local < L), jnp.clip(local, 0, L - 1)


def prefill(arena, slots, x, q_lens, conv_weight, conv_bias, *, view, state_name: str, reset, checkpoint_positions,
            checkpoint_slots, state_impl, interpret, algo, core):
    """One padded chunk per request from the state in its slot.

    x [B, T, conv_dim] (the conv input); q_lens [B]; `core(S0, xc, q_lens, pos) -> (out
    [B, T, heads, rows], S, checkpoints | None)` runs the family's scan over the conv output xc
    fp32 [B, T, conv_dim] from S0 (the recurrent tensor named `state_name`).  Writes the final conv
    and recurrent state back to `slots` and the checkpoints to their slots.  Returns (out in x's
    dtype, 0 past q_len and in padding lanes; arena)."""
    if algo not in ("scan", "chunked"):
        raise ValueError(f"algo must be 'scan' or 'chunked', got {algo!r}")
    B, T = x.shape[:2]
    check_prefill_batch(B, slots, q_lens, reset)
    q_lens = q_lens.astype(jnp.int32)
    pos, checkpoint_ids = checkpoint_args(checkpoint_positions, checkpoint_slots, q_lens)
    tensors = _reset(read_state(arena, slots, view=view, impl=state_impl, interpret=interpret), reset)
    xc, conv_final, conv_at = conv_prefill_reference(tensors["conv"], x, q_lens, conv_weight, conv_bias, positions=pos)
    out, S, checkpoints = core(tensors[state_name].astype(jnp.float32), xc, q_lens, pos)  # fp32 carry
    valid = (jnp.arange(T)[None, :] < q_lens[:, None]) & (slots != 0)[:, None]
    out = jnp.where(valid[:, :, None, None], out, 0.0).astype(x.dtype)
    arena = write_state(arena, slots, {"conv": conv_final, state_name: S}, view=view, impl=state_impl,
                        interpret=interpret)
    if pos is not None:
        per_row = pos.shape[1]
        checkpoint_ids = jnp.where((slots != 0)[:, None], checkpoint_ids, 0)
        arena = write_state(arena, checkpoint_ids.reshape(-1),
                            {"conv": conv_at.reshape(B * per_row, *conv_at.shape[2:]),
                             state_name: checkpoints.reshape(B * per_row, *checkpoints.shape[2:])},
                            view=view, impl=state_impl, interpret=interpret)
    return out, arena
