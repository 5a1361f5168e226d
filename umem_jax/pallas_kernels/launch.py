"""How an arena kernel is launched: which implementation runs, power-of-two tile sizes, and the
in-place pallas_call that the row-copy kernels (kv_write, relocate) share.

Every Pallas kernel here passes its Triton compiler params explicitly (`_compat.triton_params`):
that is what selects the Triton lowering over Mosaic GPU.
"""

from __future__ import annotations

import os

import jax
from jax.experimental import pallas as pl

from ._compat import triton_params
from .words import from_u16, kernel_view

__all__ = ["ANY", "IMPLS", "choose_num_splits", "in_place_call", "kernel_or_xla", "pow2_ceil", "pow2_divisor",
           "pow2_floor", "resolve_impl"]

IMPLS = ("pallas", "reference")

# Operands stay in global memory; the kernel indexes them itself (row vectors, pl.ds windows).
ANY = pl.BlockSpec(memory_space=pl.ANY)


def resolve_impl(impl: str | None, interpret: bool = False) -> str:
    """`impl` or the default: pallas on GPU (or when interpreting), reference elsewhere."""
    if impl is None:
        return "pallas" if (interpret or jax.default_backend() == "gpu") else "reference"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def kernel_or_xla(env: str) -> str:
    """"pallas" or "xla", from $env: "pallas", "xla", or unset / "auto": the kernel on a GPU, XLA
    elsewhere (where the kernel would only be interpreted).  Read when a step is traced."""
    choice = os.environ.get(env, "").strip().lower() or "auto"
    if choice not in ("auto", "pallas", "xla"):
        raise ValueError(f"${env}={choice!r}; known: auto, pallas, xla")
    if choice == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return choice


def pow2_divisor(n: int, cap: int = 1024) -> int:
    """Largest power of two dividing `n`, at most `cap` (Triton blocks are powers of two)."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def pow2_floor(n: int) -> int:
    """Largest power of two <= max(n, 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def in_place_call(kernel, arena, *operands, grid, name: str, interpret: bool, num_warps: int):
    """Run `kernel(*operand_refs, arena_in_ref, arena_out_ref)` over `grid`, every ref in global
    memory and the arena aliased in -> out, so under a donating jit it is updated in place.

    The kernel sees the arena as `words.kernel_view` gives it (its own dtype on GPU, uint16 in
    interpret mode; operands it stores into the arena must have `kernel_dtype(arena, interpret)`);
    the returned arena has the caller's dtype again.
    """
    view = kernel_view(arena, interpret)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[ANY] * (len(operands) + 1),
        out_specs=ANY,
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={len(operands): 0},
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*operands, view)
    return out if out.dtype == arena.dtype else from_u16(out, arena.dtype)


def _num_sms() -> int:
    try:
        d = jax.devices()[0]
        return int(getattr(d, "core_count", 0) or 132) if d.platform == "gpu" else 132
    except Exception:  # pragma: no cover
        return 132


def choose_num_splits(batch: int, kv_heads: int, visible_blocks: int, num_sms: int | None = None,
                      waves: int = 4, min_blocks_per_split: int = 4) -> int:
    """Split-K count that gives about `waves` programs per SM, keeping >= min_blocks_per_split
    blocks of pages per split (fewer splits when B * Hkv already fills the GPU)."""
    num_sms = _num_sms() if num_sms is None else num_sms
    want = -(-waves * num_sms // max(batch * kv_heads, 1))
    cap = max(1, visible_blocks // min_blocks_per_split)
    return int(max(1, min(want, cap)))
