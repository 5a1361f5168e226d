"""The copy limit: the fastest device read + write pass this GPU reaches, measured several ways.

Every "x roofline" figure divides the bytes a step must move by this rate, so it must be the
real limit and not one op's figure.  Sessions before 8 used one XLA `x ^ 1` pass over uint16
(timing.copy_rate), which reached 3.33 TB/s on the H200 while our own decode kernel moved
3.72 TB/s in the same run: that limit was too low and every ratio against it too kind.

    lim = copy_limit(4 << 30, iters=10, trials=5)     # lim.bytes_per_s: the fastest variant
    lim.variants                                      # {name: TB/s} of every variant measured

Variants (each reads nbytes and writes nbytes; the fastest one is the limit):
  xla_xor       `x ^ 1` under jit (an XLA elementwise fusion), the old limit
  xla_copy      `jnp.copy(x)` under jit: XLA emits a device-to-device memcpy for it
  device_put    `jax.device_put(x, may_alias=False)`: PJRT's buffer copy on one device; reported,
                never the limit: it read above the card's peak in three runs (5.77 TB/s on an H200,
                4.18 and 3.68 on H100s, whose peaks are 4.8 and 3.35), so its timing does not see
                the whole copy
  pallas_copy   a Pallas Triton kernel, one (rows, 1024) uint32 block per program
  torch_copy    `dst.copy_(src)` in torch (cudaMemcpyAsync device to device), in a child process
                so its allocator does not share the card with JAX's preallocation; a peer figure

python -m benchmarks.copy_limit [--gib 4] [--no-torch]   prints every variant and the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from .timing import CopyRate, copy_rate, time_calls

UNTRUSTED = ("device_put",)  # variants reported but never taken as the limit (see the docstring)

_TORCH_CHILD = r"""
import json, sys, torch
n = int(sys.argv[1]) // 2
src = torch.ones(n, dtype=torch.int16, device="cuda"); dst = torch.empty_like(src)
iters, trials = int(sys.argv[2]), int(sys.argv[3])
dst.copy_(src); torch.cuda.synchronize()
ok = bool((dst == 1).all())
per = []
for _ in range(trials):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        dst.copy_(src)
    b.record(); torch.cuda.synchronize()
    per.append(a.elapsed_time(b) / 1e3 / iters)
print(json.dumps({"seconds": min(per), "exact": ok}))
"""


@dataclasses.dataclass
class CopyLimit(CopyRate):
    """The fastest variant's rate (CopyRate fields) plus every variant's TB/s and which one won."""

    variants: dict = dataclasses.field(default_factory=dict)  # name -> TB/s, or a "skipped: ..." string
    fastest: str = ""


def _rate(fn, x, moved: int, iters: int, trials: int, check) -> tuple[float, bool]:
    y = jax.block_until_ready(fn(x))
    exact = bool(check(y))
    del y
    t = time_calls(lambda: fn(x), iters=iters, trials=trials)
    return moved / t.best, exact


def _pallas_copy(rows: int):
    from jax.experimental import pallas as pl

    from umem_jax.pallas_kernels._compat import triton_params

    block = 32  # 32 x 1024 uint32 = 128 KiB a program: enough in flight per SM to hide latency

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    @jax.jit
    def copy(x):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(rows // block,),
            in_specs=[pl.BlockSpec((block, 1024), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((block, 1024), lambda i: (i, 0)),
            compiler_params=triton_params(num_warps=8, num_stages=1))(x)

    return copy


def _torch_rate(nbytes: int, iters: int, trials: int) -> tuple[float, bool] | str:
    try:
        import torch  # noqa: F401  (is it there at all)
    except ImportError:
        return "skipped: no torch"
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
    p = subprocess.run([sys.executable, "-c", _TORCH_CHILD, str(nbytes), str(iters), str(trials)],
                       capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        return f"skipped: torch child failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}"
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return 2 * (nbytes // 2) * 2 / r["seconds"], r["exact"]


def copy_limit(nbytes: int, *, iters: int, trials: int, torch_peer: bool = True) -> CopyLimit:
    """The fastest of the variants above over `nbytes` (read nbytes + write nbytes), best trial each.

    A variant that wrote wrong bytes is reported and never chosen.  On a machine without a GPU
    only the XLA variants run (the figure is then a CPU memory rate, for smoke runs)."""
    variants: dict = {}
    best: tuple[float, str] = (0.0, "")
    xor = copy_rate(nbytes, iters=iters, trials=trials, best=True)
    variants["xla_xor"] = xor.tbps if xor.exact else "WRONG"
    if xor.exact:
        best = (xor.bytes_per_s, "xla_xor")
    rows = max(nbytes // 4 // 1024, 32) // 32 * 32
    moved = rows * 1024 * 4 * 2
    x = jax.jit(lambda: jnp.full((rows, 1024), 7, jnp.uint32))()
    gpu = jax.devices()[0].platform == "gpu"
    cands = {"xla_copy": jax.jit(jnp.copy), "device_put": lambda v: jax.device_put(v, may_alias=False)}
    if gpu:
        cands["pallas_copy"] = _pallas_copy(rows)
    for name, fn in cands.items():
        try:
            rate, exact = _rate(fn, x, moved, iters, trials, lambda y: int(jnp.min(y)) == 7 == int(jnp.max(y)))
        except Exception as e:  # a variant this jax cannot build is reported, not fatal
            variants[name] = f"skipped: {type(e).__name__}: {str(e)[:80]}"
            continue
        variants[name] = rate / 1e12 if exact else "WRONG"
        if exact and rate > best[0] and name not in UNTRUSTED:
            best = (rate, name)
    del x
    if gpu and torch_peer:
        r = _torch_rate(moved // 2, iters, trials)
        if isinstance(r, str):
            variants["torch_copy"] = r
        else:
            variants["torch_copy"] = r[0] / 1e12 if r[1] else "WRONG"
            if r[1] and r[0] > best[0]:
                best = (r[0], "torch_copy")
    return CopyLimit(best[0], moved / best[0], moved, True, variants=variants, fastest=best[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="bytes read per pass (GiB)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch peer")
    a = ap.parse_args(argv)
    lim = copy_limit(int(a.gib * (1 << 30)), iters=a.iters, trials=a.trials, torch_peer=not a.no_torch)
    print(f"{'variant':<12} {'TB/s':>8}")
    for k, v in lim.variants.items():
        print(f"{k:<12} {v:>8.3f}" if isinstance(v, float) else f"{k:<12} {v}")
    print(f"copy limit: {lim.tbps:.3f} TB/s ({lim.fastest}), {jax.devices()[0].device_kind}, jax {jax.__version__}")


if __name__ == "__main__":
    main()
