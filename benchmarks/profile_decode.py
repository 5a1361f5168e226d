"""The paged decode kernels under Nsight Compute: where the Mosaic GPU kernel's time goes where it
trails the Triton one (fp8 K/V, head dim 80; issue 17 item 4, RESULTS.md's GPU list).

    ncu --clock-control none --profile-from-start off --section WarpStateStats ... \\
        python3 -m benchmarks.profile_decode --only fp8,gqa6_d80

Per shape (bench_decode_mgpu's SHAPES, the same inputs): each variant (Triton; the Mosaic kernel at
its default tiling; with fp8 also the whole-row dequantisation chunks) is compiled and run first,
checked against the reference, and then called once more inside cuProfilerStart/Stop, so a
profiler started with --profile-from-start off sees that call's kernels and nothing of the setup.
Without a profiler the calls still run (cuProfilerStart is a no-op), so the script doubles as a
quick check that every variant compiles on the card.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import warnings

import jax

from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

from .bench_decode_mgpu import SHAPES, shape_inputs
from .decode_peers import max_err


def _profiler():
    """(start, stop) of the CUDA profiler API (the driver's cuProfilerStart/Stop), or no-ops."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        return cuda.cuProfilerStart, cuda.cuProfilerStop
    except OSError:
        return (lambda: 0), (lambda: 0)


def variants(s):
    """(name, paged_decode_attention keyword arguments) profiled for shape s."""
    out = [("triton", dict(backend="triton")), ("mgpu", dict(backend="mgpu"))]
    if s.fp8 and s.D <= 128:  # whole-row dequantisation chunks
        out.append(("mgpu_cols", dict(backend="mgpu", mgpu_config=dict(dequant_cols=s.D))))
    return out


def _call(kw, extra):
    extra = dict(extra)
    cfg = extra.pop("mgpu_config", None)
    if cfg is None:
        return jax.jit(lambda q, a_, p, l: paged_decode_attention(q, a_, p, l, impl="pallas", **kw, **extra))
    from umem_jax.pallas_kernels.paged_decode_mgpu import paged_decode_attention_mgpu

    return jax.jit(lambda q, a_, p, l: paged_decode_attention_mgpu(q, a_, p, l, **kw, **cfg))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="fp8,gqa6_d80", help="comma list of bench_decode_mgpu shape names")
    ap.add_argument("--variants", default="triton,mgpu,mgpu_cols",
                    help="comma list of kernels to profile (one process each keeps a failure from losing the others)")
    a = ap.parse_args(argv)
    silence_triton_deprecation()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if jax.default_backend() != "gpu":
        print("profile_decode needs a Hopper GPU")
        return 0
    start, stop = _profiler()
    names = a.only.split(",")
    for s in (s for s in SHAPES if s.name in names):
        kw, arena, pt, ln, q, _ = shape_inputs(s)
        ref = jax.jit(lambda q, a_, p, l: paged_decode_attention_reference(q, a_, p, l, **kw))(q, arena, pt, ln)
        for label, extra in (v for v in variants(s) if v[0] in a.variants.split(",")):
            f = _call(kw, extra)
            try:
                err = max_err(f(q, arena, pt, ln), ref)
                jax.block_until_ready(f(q, arena, pt, ln))
            except Exception as e:  # noqa: BLE001 - one failure must not end a one-shot GPU run
                print(f"{s.name} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print(f"== profiled: {s.name} ({s.label()}) {label}, max err {err:.2e}", flush=True)
            start()
            jax.block_until_ready(f(q, arena, pt, ln))
            stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
