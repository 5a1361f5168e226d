"""Compile the arena kernels' Triton IR to PTX/SASS for sm_90 without a GPU (a pre-flight check).

Cross-lowering (`lower(lowering_platforms=('cuda',))`) builds the Triton IR; XLA compiles it
only on the GPU.  This script takes the IR one step further on any machine:

  python benchmarks/triton_ptx_check.py dump /tmp/ttir           # this env (jax): writes *.ttir
  /path/to/venv-with-triton/bin/python benchmarks/triton_ptx_check.py compile /tmp/ttir

The second step needs only the `triton` wheel (pip install triton==3.6.0 in a separate venv; it
bundles ptxas) and prints, per kernel variant: shared memory, registers, spills, tensor-core
instructions and 16-byte async copies.  It is a check, not the GPU's compile: XLA ships its own
Triton, so a clean compile here is evidence, not proof.  Uses a private jax hook
(pallas_call_registration.lowering.lower_jaxpr_to_triton_module) to capture the IR.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


def dump(out_dir):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import warnings

    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import pallas_call_registration as reg

    from umem_jax.memory.plan import KVView
    from umem_jax.pallas_kernels import kv_write, paged_decode, relocate

    warnings.filterwarnings("ignore")
    os.makedirs(out_dir, exist_ok=True)
    orig = reg.lowering.lower_jaxpr_to_triton_module
    current = {}

    def hook(*a, **k):
        r = orig(*a, **k)
        with open(os.path.join(out_dir, current["name"] + ".ttir"), "w") as f:
            f.write(r.module.operation.get_asm())
        with open(os.path.join(out_dir, current["name"] + ".json"), "w") as f:
            json.dump(current["opts"], f)
        return r

    reg.lowering.lower_jaxpr_to_triton_module = hook

    def low(name, opts, fn, *args):
        current.update(name=name, opts=opts)
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))

    sds = jax.ShapeDtypeStruct
    big = sds((2**21 + 512, 1024), jnp.uint16)  # > 4 GiB: int64 offsets
    i64 = sds((64,), jnp.int32)
    low("move_1MiB", dict(num_warps=4, num_stages=1),
        lambda a, s, d: relocate.move_pages(a, s, d, rows_per_page=512, impl="pallas"), big, i64, i64)
    low("move_masked", dict(num_warps=4, num_stages=1),
        lambda a, s, d: relocate.move_pages(a, s, d, rows_per_page=12, impl="pallas"),
        sds((1200, 1536), jnp.bfloat16), i64, i64)
    low("zero_1MiB", dict(num_warps=4, num_stages=1),
        lambda a, s: relocate.zero_pages(a, s, rows_per_page=512, impl="pallas"), big, i64)

    def view(Hkv, D, ps, planes=1, W=None):
        W = W or planes * Hkv * D
        m = planes * Hkv * D // W
        return KVView(rows_per_page=2 * 2 * ps * m, page_size=ps, k_row=2 * ps * m, v_row=3 * ps * m,
                      num_kv_heads=Hkv, head_dim=D, v_head_dim=D, row_words=W, planes=planes)

    v = view(8, 128, 16)
    kk = sds((64, 8, 128), jnp.bfloat16)
    low("write_kv", dict(num_warps=4, num_stages=1),
        lambda a, k, vv, p, s: kv_write.write_kv(a, k, vv, p, s, view=v, impl="pallas"), big, kk, kk, i64, i64)
    for name, (Hkv, G, D, ps, planes, W, bt, nw, ns) in {
        "decode_g4_d128_bt128_w4_s2": (8, 4, 128, 16, 1, None, 128, 4, 2),
        "decode_g4_d128_bt128_w4_s3": (8, 4, 128, 16, 1, None, 128, 4, 3),
        "decode_g4_d128_bt64_w4_s3": (8, 4, 128, 16, 1, None, 64, 4, 3),
        "decode_g4_d128_bt64_w8_s4": (8, 4, 128, 16, 1, None, 64, 8, 4),
        "decode_g1_d128_bt64_w4_s3": (8, 1, 128, 16, 1, None, 64, 4, 3),
        "decode_g8_d256_ps64_bt32": (8, 8, 256, 64, 1, None, 32, 4, 3),
        "decode_g4_d64_ps32_mk4": (4, 4, 64, 32, 1, 64, 128, 4, 2),
        "decode_fp32_planes_bt32": (8, 4, 128, 16, 2, None, 32, 4, 2),
    }.items():
        vv = view(Hkv, D, ps, planes, W)
        arena = sds((2**33 // (2 * vv.row_words) + 64, vv.row_words), jnp.uint16)
        q = sds((64, Hkv * G, D), jnp.bfloat16)
        pt, ln, sk = sds((64, 256), jnp.int32), sds((64,), jnp.int32), sds((Hkv * G,), jnp.float32)
        low(name, dict(num_warps=nw, num_stages=ns),
            lambda q, a, pt, ln, sk, vv=vv, bt=bt, nw=nw, ns=ns: paged_decode.paged_decode_attention(
                q, a, pt, ln, view=vv, window=300, softcap=30.0, sinks=sk, impl="pallas", block_tokens=bt,
                num_warps=nw, num_stages=ns), q, arena, pt, ln, sk)
    print(f"wrote Triton IR for {len(os.listdir(out_dir)) // 2} kernels to {out_dir}")


def compile_all(in_dir):
    import glob

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nvc

    target = GPUTarget("cuda", 90, 32)
    ptxas = nvc.get_ptxas(90).path
    bad = 0
    print(f"triton {triton.__version__}, sm_90")
    for path in sorted(glob.glob(os.path.join(in_dir, "*.ttir"))):
        name = os.path.basename(path)[:-5]
        opts = json.load(open(path[:-5] + ".json"))
        try:
            k = triton.compile(path, target=target, options=opts)
            ptx = k.asm["ptx"]
            ptx_path = path[:-5] + ".ptx"
            open(ptx_path, "w").write(ptx)
            r = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx_path, "-o", path[:-5] + ".cubin"],
                               capture_output=True, text=True)
            regs = re.search(r"Used (\d+) registers", r.stderr)
            spill = re.search(r"(\d+) bytes spill stores", r.stderr)
            print(f"OK   {name:<32} smem={k.metadata.shared:>7} regs={regs and regs.group(1)} "
                  f"spill={spill and spill.group(1)} mma={len(re.findall(r'mma', ptx))} "
                  f"cp.async={len(re.findall(r'cp.async', ptx))} ld.v4={len(re.findall(r'ld.global[^;]*v4', ptx))} "
                  f"{opts}")
        except Exception as e:  # noqa: BLE001
            bad += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}")
    return bad


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "compile"):
        sys.exit(__doc__)
    sys.exit(dump(sys.argv[2]) if sys.argv[1] == "dump" else (1 if compile_all(sys.argv[2]) else 0))
