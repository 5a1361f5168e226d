"""Probe (GPU, session 37): does the fp8 scores' low q part reach the scores, and would the form pay?

  python3 -m benchmarks.probe_fp8_scores

On bench_decode_mgpu's fp8 shape (B = 64, ctx 4096, D = 128): (1) the fp8 decode with q's low
part zeroed against the full split, both against the reference: if they agree, the low part never
reached the scores; (2) Triton, the Mosaic default and four fp8-scores tilings timed, errors
included."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.pallas_kernels import paged_decode_mgpu as m
from umem_jax.pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

from .bench_decode_mgpu import SHAPES, shape_inputs
from .decode_peers import max_err
from .timing import time_calls

orig = m.split_fp8


def hi_only(x, rows):
    parts, unit = orig(x, rows)
    return parts.at[:, :, 1].set(jnp.zeros_like(parts[:, :, 1])), unit


def main():
    s = next(x for x in SHAPES if x.name == "fp8")
    kw, arena, pt, ln, q, nbytes = shape_inputs(s)
    ref = np.asarray(paged_decode_attention_reference(q, arena, pt, ln, **kw), np.float32)
    for t in (dict(block_kv=128, ring_slots=2, consumers=2), dict(block_kv=64, ring_slots=2, consumers=1, num_splits=1)):
        outs = {}
        for tag, split in (("full", orig), ("hi only", hi_only)):
            m.split_fp8 = split
            jax.clear_caches()
            outs[tag] = np.asarray(m.paged_decode_attention_mgpu(q, arena, pt, ln, **kw, **t, fp8_scores=True),
                                   np.float32)
            print(f"{tag:8s} {t}: max err {np.abs(outs[tag] - ref).max():.4f}", flush=True)
        print(f"   full == hi only: {np.array_equal(outs['full'], outs['hi only'])}", flush=True)
    m.split_fp8 = orig
    jax.clear_caches()
    calls = {"triton": lambda: paged_decode_attention(q, arena, pt, ln, impl="pallas", backend="triton", **kw),
             "mgpu default": lambda: paged_decode_attention(q, arena, pt, ln, impl="pallas", backend="mgpu", **kw)}
    for bkv, slots, c, tr in ((128, 2, 2, False), (128, 4, 2, False), (64, 3, 3, False), (128, 2, 1, True)):
        calls[f"fp8_scores {bkv}x{slots} c{c}{' transposed' if tr else ''}"] = functools.partial(
            m.paged_decode_attention_mgpu, q, arena, pt, ln, **kw, block_kv=bkv, ring_slots=slots, consumers=c,
            dequant_cols=128, transposed=tr, fp8_scores=True)
    rows = []
    for name, f in calls.items():
        try:
            err = max_err(f(), ref)
            t = time_calls(f, iters=20, trials=5).median
        except Exception as e:  # noqa: BLE001
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append((name, t, err))
        print(f"{name}: {t * 1e6:.1f} us {nbytes / t / 1e12:.3f} TB/s err {err:.2e}", flush=True)
    tri = next((t for n, t, _ in rows if n == "triton"), None)
    print("\nkernel | us | x Triton | err")
    for n, t, e in rows:
        print(f"{n} | {t * 1e6:.1f} | {tri / t if tri else float('nan'):.3f} | {e:.1e}")


if __name__ == "__main__":
    main()
