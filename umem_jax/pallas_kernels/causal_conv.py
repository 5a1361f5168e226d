"""Depthwise causal conv1d over a request's conv state: shared by Mamba2 and gated DeltaNet.

The conv state of a layer is the tensor "conv" [K-1, C] of its state slot (the last K-1
pre-conv inputs, oldest first; K = conv kernel width, C = channels).  Hugging Face keeps K
columns; the oldest of those is never read again, so K-1 is enough.

For one new input x_t [C]:   window = [state[0], ..., state[K-2], x_t]            [K, C]
                             out_t  = act(sum_k weight[:, k] * window[k] + bias)   [C]
                             state' = window[1:]
`weight` is Hugging Face's conv1d weight squeezed to [C, K]; the math runs in fp32 (HF runs it in
the model dtype; the difference is one bf16 rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._compat import pltr
from .launch import ANY, pow2_divisor
from .state_io import block_fits, load_block, store_block

__all__ = ["activate", "conv_block", "conv_decode_pallas", "conv_decode_reference", "conv_prefill_reference"]


def activate(x, activation):
    if activation is None:
        return x
    if activation == "silu":
        return x * jax.nn.sigmoid(x)
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def _f32(x):
    return x.astype(jnp.float32)


def conv_decode_reference(state, x, weight, bias=None, activation="silu"):
    """state [B, K-1, C], x [B, C], weight [C, K], bias [C] | None ->
    (out fp32 [B, C], new state fp32 [B, K-1, C])."""
    window = jnp.concatenate([_f32(state), _f32(x)[:, None, :]], axis=1)   # [B, K, C]
    out = jnp.einsum("bkc,ck->bc", window, _f32(weight), precision="highest")
    if bias is not None:
        out = out + _f32(bias)
    return activate(out, activation), window[:, 1:]


def conv_prefill_reference(state, x, q_lens, weight, bias=None, activation="silu", positions=None):
    """Causal conv over a padded chunk that continues from `state`.

    state [B, K-1, C]; x [B, T, C] (tokens j >= q_lens[b] are padding); weight [C, K].
    positions: optional int32 [B, n] token counts p in [0, q_len] -> also the conv state after
    the first p tokens of the chunk.  Returns (out fp32 [B, T, C] (padding rows are garbage for
    the caller to mask), final state fp32 [B, K-1, C], states at positions fp32 [B, n, K-1, C]
    or None).
    """
    history = state.shape[1]
    T = x.shape[1]
    full = jnp.concatenate([_f32(state), _f32(x)], axis=1)               # [B, K-1+T, C]
    w = _f32(weight)
    out = sum(full[:, k: k + T, :] * w[:, k] for k in range(history + 1))
    if bias is not None:
        out = out + _f32(bias)

    def take(f, p):  # the K-1 inputs before position p of the chunk: full[p : p + K-1]
        return jax.lax.dynamic_slice_in_dim(f, p, history, axis=0)

    final = jax.vmap(take)(full, q_lens.astype(jnp.int32))
    at = None
    if positions is not None:
        pos = jnp.clip(positions.astype(jnp.int32), 0, T)
        at = jax.vmap(lambda f, positions_row: jax.vmap(lambda p: take(f, p))(positions_row))(full, pos)
    return activate(out, activation), final, at


# --------------------------------------------------------------------------- Pallas decode


def conv_block(view, rows, C: int, cap: int = 1024) -> int:
    """Channels per program: a power of two dividing C whose runs sit inside one arena row."""
    block = pow2_divisor(C, cap)
    while block > 1 and not (view.row_words % block == 0 and block_fits(view, block)):
        block //= 2
    return block


def _conv_kernel(slots_ref, x_ref, w_ref, *rest, view, rows, C, K, block, has_bias, activation, x_start):
    if has_bias:
        b_ref, arena_in, out_ref, arena_ref = rest
    else:
        arena_in, out_ref, arena_ref = rest
    del arena_in  # aliased with arena_ref
    b, c = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[b]
    c0 = pl.multiple_of(c * block, block)
    dst = out_ref.at[b, pl.ds(c0, block)]

    @pl.when(slot == 0)
    def _():  # padding lane: no state read or write, output 0
        pltr.store(dst, jnp.zeros((block,), out_ref.dtype))

    @pl.when(slot != 0)
    def _():
        window = [load_block(arena_ref, slot, view, rows, t * C + c0, (block,), jnp.float32) for t in range(K - 1)]
        window.append(pltr.load(x_ref.at[b, pl.ds(x_start + c0, block)]).astype(jnp.float32))
        acc = (pltr.load(b_ref.at[pl.ds(c0, block)]).astype(jnp.float32) if has_bias
               else jnp.zeros((block,), jnp.float32))
        for k in range(K):
            # column k of HF's [C, K] weight: a strided load of a tiny, cache-resident array (no
            # per-step transpose in XLA)
            acc = acc + pltr.load(w_ref.at[pl.ds(c0, block), jnp.int32(k)]).astype(jnp.float32) * window[k]
        for t in range(K - 1):
            store_block(arena_ref, slot, view, rows, t * C + c0, window[t + 1])
        pltr.store(dst, activate(acc, activation).astype(out_ref.dtype))


def conv_decode_pallas(words, slots, x, weight, bias, *, view, rows, activation="silu", interpret=False,
                       block=None, compiler_params=None, x_start=0):
    """Pallas conv decode on a uint16 arena view `words`, in place on the conv state `rows`
    (a StateRows of shape [K-1, C]).  x [B, W]: the input is its columns x_start .. x_start + C
    (read in place); weight [C, K]; bias [C] | None.
    Returns (out fp32 [B, C], words).  Padding lanes (slot 0): out 0, state untouched."""
    B, C, K = x.shape[0], weight.shape[0], weight.shape[1]
    if not 0 <= x_start <= x.shape[1] - C:
        raise ValueError(f"conv input columns {x_start}..{x_start + C} outside x {list(x.shape)}")
    block = block or conv_block(view, rows, C)
    if C % block or view.row_words % block:
        raise ValueError(f"conv block {block} must divide the channels {C} and the row width {view.row_words}")
    args = [slots, x, weight] + ([bias] if bias is not None else []) + [words]
    out, words = pl.pallas_call(
        functools.partial(_conv_kernel, view=view, rows=rows, C=C, K=K, block=block, has_bias=bias is not None,
                          activation=activation, x_start=int(x_start)),
        grid=(B, C // block),
        in_specs=[ANY] * len(args),
        out_specs=(ANY, ANY),
        out_shape=(jax.ShapeDtypeStruct((B, C), jnp.float32), jax.ShapeDtypeStruct(words.shape, words.dtype)),
        input_output_aliases={len(args) - 1: 1},
        compiler_params=compiler_params,
        interpret=interpret,
        name="conv_decode",
    )(*args)
    return out, words
