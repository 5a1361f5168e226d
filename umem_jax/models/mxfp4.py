"""MXFP4 weights (OCP Microscaling, as the gpt-oss hub checkpoints store their experts) to plain arrays.

A weight W [out, in] is stored as
    blocks uint8 [out, in/32, 16]: 32 e2m1 (FP4) codes a block, two a byte, the low nibble first;
    scales uint8 [out, in/32]:     each block's power of two in e8m0 (2^(s - 127)),
with any leading dims (experts) in front.  `dequantize_mxfp4` gives the values in the (in, out)
layout a stacked expert holds ([..., in, out]), so a whole layer converts without transposing the
wide output: each slice's uint8 codes are read transposed (a quarter of the bf16 bytes), then
looked up.  For
bf16 and fp32 results the values are built as bit patterns: e2m1 magnitudes are 2^k * {1, 1.5}, so
scaling by 2^e adds e to the exponent field, exactly (no rounding, no float pass); other dtypes or
scales outside the normal range take an fp32 path.  `quantize_mxfp4` is the inverse, for tests
and fixtures.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# e2m1 code -> value: sign bit 3, then exponent and mantissa (the OCP MX spec's table).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
E8M0_BIAS = 127
BLOCK = 32  # values per scale
# dtype -> (bit-pattern type, exponent field shift, magnitude mask)
_BITS = {np.dtype(ml_dtypes.bfloat16): (np.uint16, 7, 0x7FFF), np.dtype(np.float32): (np.uint32, 23, 0x7FFFFFFF)}


def _check(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.ndim < 3 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match: blocks must be "
                         f"[..., out, G, {BLOCK // 2}] over scales [..., out, G]")


def dequantize_mxfp4(blocks, scales, dtype) -> np.ndarray:
    """blocks uint8 [..., out, G, 16], scales uint8 [..., out, G] -> [..., G * 32, out] in `dtype`
    (transformers' convert_moe_packed_tensors layout).  Exact for bf16 / fp32.  Converted a few
    blocks of one leading index at a time (~1M values): the temporaries stay small enough for the
    allocator to reuse, where whole-layer temporaries cost a page fault per 4 KiB each time."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    _check(blocks, scales)
    dtype = np.dtype(dtype)
    *lead, rows, groups, _ = blocks.shape
    blocks = blocks.reshape(-1, rows, groups, BLOCK // 2)
    scales = scales.reshape(-1, rows, groups)
    out = np.empty((blocks.shape[0], groups, BLOCK // 2, 2, rows), dtype)
    step = max(1, (1 << 20) // (rows * BLOCK))  # blocks (of every row) per slice
    for n in range(blocks.shape[0]):
        for g in range(0, groups, step):
            codes = blocks[n, :, g:g + step].transpose(1, 2, 0)  # [gs, 16, out]
            e = scales[n, :, g:g + step].T.astype(np.int32) - E8M0_BIAS  # [gs, out]
            out[n, g:g + step] = _values(codes, e, dtype)
    return out.reshape(*lead, groups * BLOCK, rows)


def _values(codes: np.ndarray, e: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """codes uint8 [gs, 16, out], exponents int32 [gs, out] -> [gs, 16, 2, out] in dtype."""
    # e2m1's nonzero exponents are -1..2: the result stays normal while -125 <= e <= 125.
    if dtype in _BITS and e.min() >= -125 and e.max() <= 125:
        bits, shift, magnitude = _BITS[dtype]
        lut = FP4_VALUES.astype(dtype).view(bits)
        vals = np.stack([lut[codes & 0x0F], lut[codes >> 4]], axis=-2)  # [gs, 16, 2, out]
        delta = (e << shift).astype(bits)[:, None, None, :]  # wraps mod 2^bits: adds a negative e too
        vals = np.where(vals & bits(magnitude), vals + delta, vals)  # zeros keep their (signed) zero
        return vals.view(dtype)
    vals = np.stack([FP4_VALUES[codes & 0x0F], FP4_VALUES[codes >> 4]], axis=-2)
    return np.ldexp(vals, e[:, None, None, :]).astype(dtype)


def quantize_mxfp4(w) -> tuple[np.ndarray, np.ndarray]:
    """dequantize_mxfp4's inverse: w [..., in, out] (in a multiple of 32) -> (blocks uint8
    [..., out, in/32, 16], scales uint8 [..., out, in/32]).  The OCP MX rule: a block's scale is
    2^(floor(log2 max|x|) - 2) (2 = e2m1's largest exponent), each value rounds to the nearest e2m1
    number (a tie to the smaller magnitude), |values| past 6 clamp to 6."""
    w = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., out, in]
    blocks = w.reshape(*w.shape[:-1], -1, BLOCK)
    amax = np.abs(blocks).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2, -E8M0_BIAS)
    e = np.clip(e, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)
    v = np.abs(blocks) / np.ldexp(np.float32(1), e)[..., None]
    # the nearest of the 8 magnitudes (argmin: the first, smaller one on a tie)
    mag = np.abs(v[..., None] - FP4_VALUES[:8]).argmin(-1).astype(np.uint8)
    codes = mag | np.where(np.signbit(blocks) & (mag > 0), 8, 0).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), (e + E8M0_BIAS).astype(np.uint8)


__all__ = ["BLOCK", "E8M0_BIAS", "FP4_VALUES", "dequantize_mxfp4", "quantize_mxfp4"]
