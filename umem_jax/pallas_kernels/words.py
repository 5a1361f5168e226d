"""Values <-> 16-bit arena words.

The arena is one array of 16-bit words (uint16, or bfloat16).  Every value that lives in it is
stored as words:

* 16-bit dtypes (bf16, f16, u16, i16) are one word each: a same-width bitcast.
* 32-bit dtypes (f32, i32, u32) are two words each, stored as two *planes* along the last axis:
  ``[hi plane (n words) | lo plane (n words)]`` where hi = bits >> 16 and lo = bits & 0xffff.
  Planes (rather than interleaved hi/lo pairs) keep each plane a contiguous power-of-two run, so
  a kernel loads the hi and lo tiles with two plain vector loads and rebuilds the value with one
  shift and one or.

* float8 e4m3 K/V (``kv_cache_dtype="fp8_e4m3"``) is *half a plane*: two values per word, element
  ``2j`` in the low byte of word ``j`` and ``2j + 1`` in the high byte, i.e. the words' bytes in
  memory (little-endian) are exactly a ``float8_e4m3fn`` array ``[..., 2n]``.  Values are stored
  as ``x / scale``, saturated to +-448 (e4m3fn has no inf; a plain cast would give NaN), and read
  back as ``fp8 * scale``; a kernel unpacks a word tile into its even and odd elements with
  integer masks, a same-width u8 -> float8 bitcast and a float8 -> bf16/f32 convert (Triton:
  ``tt.fp_to_fp``, hardware on sm_89+), so a head's q . k is ``q_even . k_even + q_odd . k_odd``
  and no value is ever interleaved in registers.

Only same-width ``lax.bitcast_convert_type`` is used (u16 <-> bf16/f16/i16, u32 <-> f32/i32):
neither Pallas GPU backend lowers width-changing bitcasts, and on XLA a width-changing bitcast of
the arena costs a full pass.  Every function here is plain jnp/lax on values, so it works the
same in XLA code, inside Pallas kernel bodies (Triton lowering) and in interpret mode.

Shapes: ``encode(x[..., n]) -> words[..., planes * n]``; ``decode(words[..., planes * n], dtype)
-> x[..., n]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["FP8", "FP8_MAX", "WORD_DTYPES", "check_arena", "decode", "decode_fp8", "encode", "encode_fp8", "encode_np",
           "fp8_compute_dtype", "from_u16", "join_planes", "kernel_dtype", "kernel_view", "kv_value_dtype", "planes_of",
           "split_planes", "to_u16", "unpack_fp8"]

# Dtypes an arena may have: one 16-bit word per element.
WORD_DTYPES = (jnp.dtype(jnp.uint16), jnp.dtype(jnp.bfloat16))

FP8 = jnp.dtype(jnp.float8_e4m3fn)  # the fp8 K/V format (vLLM's / SGLang's "fp8_e4m3")
FP8_MAX = 448.0  # largest finite e4m3fn value: quantised K/V saturate here

_16 = {jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.uint16, jnp.int16)}
_32 = {jnp.dtype(d) for d in (jnp.float32, jnp.int32, jnp.uint32)}


def planes_of(dtype) -> int:
    """Words one element of `dtype` takes in the arena (bf16: 1, fp32: 2)."""
    d = jnp.dtype(dtype)
    if d in _16:
        return 1
    if d in _32:
        return 2
    raise ValueError(f"dtype {d} cannot be stored in the 16-bit arena (use bf16, f16, u16, i16, f32, i32, u32)")


def kv_value_dtype(planes: int, kv_dtype=None):
    """The dtype K/V values decode to: `kv_dtype` if given, else bf16 (1 plane) / f32 (2 planes)."""
    if kv_dtype is not None:
        kv_dtype = jnp.dtype(kv_dtype)
        if planes_of(kv_dtype) != planes:
            raise ValueError(f"kv_dtype {kv_dtype} takes {planes_of(kv_dtype)} planes, the view has {planes}")
        return kv_dtype
    return jnp.dtype(jnp.float32) if planes == 2 else jnp.dtype(jnp.bfloat16)


def check_arena(arena, row_words: int | None = None) -> None:
    """Static checks that `arena` is [num_rows, row_words] of 16-bit words (uint16 or bfloat16),
    with rows of `row_words` words when given (the view's width)."""
    if arena.ndim != 2:
        raise ValueError(f"arena must be [num_rows, row_words], got shape {arena.shape}")
    if jnp.dtype(arena.dtype) not in WORD_DTYPES:
        raise ValueError(f"arena dtype must be uint16 or bfloat16, got {arena.dtype}")
    if row_words is not None and arena.shape[1] != row_words:
        raise ValueError(f"arena rows are {arena.shape[1]} words, the view says {row_words}")


def _check_word_dtype(word_dtype):
    d = jnp.dtype(word_dtype)
    if d not in WORD_DTYPES:
        raise ValueError(f"arena word dtype must be uint16 or bfloat16, got {d}")
    return d


def to_u16(x):
    """Same-width view of a 16-bit array as uint16."""
    d = jnp.dtype(x.dtype)
    if d == jnp.uint16:
        return x
    if d not in _16:
        raise ValueError(f"to_u16 needs a 16-bit dtype, got {d}")
    return lax.bitcast_convert_type(x, jnp.uint16)


def from_u16(w, dtype):
    """Same-width view of uint16 words as `dtype` (a 16-bit dtype)."""
    d = jnp.dtype(dtype)
    if d not in _16:
        raise ValueError(f"from_u16 needs a 16-bit dtype, got {d}")
    return w if d == jnp.uint16 else lax.bitcast_convert_type(w, d)


def split_planes(x):
    """32-bit x -> (hi, lo) uint16 arrays of x's shape (bits >> 16, bits & 0xffff)."""
    d = jnp.dtype(x.dtype)
    if d not in _32:
        raise ValueError(f"split_planes needs a 32-bit dtype, got {d}")
    b = x if d == jnp.uint32 else lax.bitcast_convert_type(x, jnp.uint32)
    # astype(uint16) truncates modulo 2**16, which is the low half.
    return (b >> 16).astype(jnp.uint16), b.astype(jnp.uint16)


def join_planes(hi, lo, dtype=jnp.float32):
    """(hi, lo) 16-bit words -> 32-bit `dtype`; exact inverse of split_planes."""
    d = jnp.dtype(dtype)
    if d not in _32:
        raise ValueError(f"join_planes needs a 32-bit dtype, got {d}")
    b = (to_u16(hi).astype(jnp.uint32) << 16) | to_u16(lo).astype(jnp.uint32)
    return b if d == jnp.uint32 else lax.bitcast_convert_type(b, d)


def encode(x, word_dtype=jnp.uint16):
    """x[..., n] -> words[..., planes * n] of `word_dtype` (uint16 or bfloat16).

    32-bit values become ``[hi plane | lo plane]`` along the last axis.
    """
    wd = _check_word_dtype(word_dtype)
    if planes_of(x.dtype) == 1:
        w = to_u16(x)
    else:
        hi, lo = split_planes(x)
        w = jnp.concatenate([hi, lo], axis=-1)
    return from_u16(w, wd)


def decode(words, dtype):
    """words[..., planes * n] (uint16 or bfloat16) -> x[..., n] of `dtype`; inverse of encode."""
    w = to_u16(words)
    if planes_of(dtype) == 1:
        return from_u16(w, dtype)
    n2 = w.shape[-1]
    if n2 % 2:
        raise ValueError(f"two-plane decode needs an even last axis, got {n2}")
    return join_planes(w[..., : n2 // 2], w[..., n2 // 2 :], dtype)


def kernel_dtype(arena, interpret: bool):
    """The dtype `kernel_view(arena, interpret)` has."""
    return jnp.dtype(jnp.uint16) if interpret else jnp.dtype(arena.dtype)


def kernel_view(arena, interpret: bool):
    """The arena as a Pallas kernel should see it: as is on GPU, as uint16 in interpret mode.

    Triton loads/stores move bf16 bits exactly, and a whole-arena same-width bitcast is not
    guaranteed free in XLA (XLA:CPU emits it as an elementwise pass plus a temp the size of the
    arena), so the GPU path never bitcasts the arena.  Interpret mode runs the kernel as XLA on
    CPU, where a bf16 scatter canonicalises NaN bit patterns (fp32 lo planes often are such
    patterns), so there the kernel sees the uint16 view; tests are small, the pass is cheap.
    """
    if jnp.dtype(arena.dtype) != kernel_dtype(arena, interpret):
        return to_u16(arena)
    return arena


# ------------------------------------------------------------------------- fp8 (half a plane)


def encode_fp8(x, scale=1.0):
    """x[..., 2n] (any float) -> uint16 words[..., n]: x / scale in f32, saturated to +-FP8_MAX,
    rounded to e4m3fn (nearest even), element 2j in the low byte of word j, 2j + 1 in the high.

    `scale` broadcasts against x (a scalar, or e.g. [Hkv, 1] per kv head).  NaN stays NaN.
    """
    n2 = x.shape[-1]
    if n2 % 2:
        raise ValueError(f"fp8 packs two values per word: the last axis must be even, got {n2}")
    y = jnp.clip(x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32), -FP8_MAX, FP8_MAX)
    b = lax.bitcast_convert_type(y.astype(FP8), jnp.uint8).astype(jnp.uint16)
    b = b.reshape(*x.shape[:-1], n2 // 2, 2)
    return b[..., 0] | (b[..., 1] << 8)


def unpack_fp8(words, dtype=jnp.float32):
    """words[..., n] (uint16 or bfloat16) -> (even, odd), each [..., n] of `dtype`: the e4m3fn
    values in the low and the high byte of every word (unscaled).  Plain jnp on values (masks, a
    same-width uint8 -> float8 bitcast, one convert), so it runs in Triton kernel bodies too."""
    w = to_u16(words)
    as_value = lambda b: lax.bitcast_convert_type(b.astype(jnp.uint8), FP8).astype(dtype)
    return as_value(w & 0xFF), as_value(w >> 8)


# unpack_fp8_bits' values are the e4m3 values times 2**-8: the caller multiplies by this.
FP8_BITS_SCALE = 256.0


def unpack_fp8_bits(words):
    """words[..., n] (uint16 or bfloat16) -> (even, odd) float16 [..., n]: the e4m3fn values of the
    low and the high byte, each times 2**-8 (multiply by FP8_BITS_SCALE), by integer ops alone.

    An e4m3 byte `s eeee mmm` placed as the float16 `s 0eeee mmm0000000` is the same number
    scaled by 2**(7 - 15) (f16's exponent bias is 15, e4m3's 7), subnormals included: two masks,
    a shift and an or per element, no conversion instruction (Hopper has no e4m3 -> bf16 convert;
    e4m3 -> f16 -> f32 -> bf16 costs three per element, which bounds the fp8 decode kernel).
    The NaN byte (0x7f) maps to a finite value: the writer never stores NaN from finite inputs."""
    w = to_u16(words)
    even = ((w & 0x80) << 8) | ((w & 0x7F) << 7)
    odd = (w & 0x8000) | ((w >> 1) & 0x3F80)
    f16 = lambda b: lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16)
    return f16(even), f16(odd)


# One PTX convert turns a word's two e4m3 bytes into an f16 pair (sm_89+): the low half is the
# even element, the high half the odd one.  (Pallas' Triton lowering takes one asm result only.)
_E4M3X2_TO_F16X2 = "cvt.rn.f16x2.e4m3x2 $0, $1;"


def unpack_fp8_asm(words):
    """words[..., n] -> (even, odd) float16 [..., n], one `cvt.rn.f16x2.e4m3x2` per word (Triton
    inline PTX: Hopper and Ada GPUs only, never interpret mode)."""
    from jax.experimental.pallas import triton as pltr

    w = to_u16(words)
    # int32, not uint32: Triton's inline asm takes signless integers only.
    (pair,) = pltr.elementwise_inline_asm(_E4M3X2_TO_F16X2, args=[w], constraints="=r,h", pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.int32)])
    f16 = lambda b: lax.bitcast_convert_type(b.astype(jnp.uint16), jnp.float16)
    return f16(pair & 0xFFFF), f16((pair >> 16) & 0xFFFF)


def decode_fp8(words, scale=1.0, dtype=jnp.float32):
    """words[..., n] -> x[..., 2n] of `dtype`: fp8 value * scale; inverse of encode_fp8 up to the
    e4m3 rounding.  `scale` broadcasts against the result."""
    even, odd = unpack_fp8(words, jnp.float32)
    x = jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], 2 * even.shape[-1])
    return (x * jnp.asarray(scale, jnp.float32)).astype(dtype)


def fp8_compute_dtype(q_dtype):
    """The dtype fp8 K/V tiles are dequantised to for the dots: f32 for an f32 query (parity
    runs), else bf16 (every e4m3 value is exact in bf16; the tensor-core dot of the bf16 path)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(q_dtype) == jnp.float32 else jnp.dtype(jnp.bfloat16)


def encode_np(x: np.ndarray, word_dtype=np.uint16) -> np.ndarray:
    """Host-side (numpy) twin of `encode`, for tests and loaders; returns uint16 words."""
    x = np.asarray(x)
    if x.dtype.itemsize == 2:
        w = x.view(np.uint16)
    elif x.dtype.itemsize == 4:
        b = x.view(np.uint32)
        w = np.concatenate([(b >> 16).astype(np.uint16), (b & 0xFFFF).astype(np.uint16)], axis=-1)
    else:
        raise ValueError(f"dtype {x.dtype} cannot be stored in the 16-bit arena")
    return w if np.dtype(word_dtype) == np.uint16 else w.view(word_dtype)
