"""Where do two consumers of the transposed fp8 decode go wrong (issue 17 item 4)?

The Mosaic decode's transposed form (S^T = K Q^T) is right with one consumer and wrong with two on
the GPU, while jax's GPU interpreter passes both.  This probe takes the kernel's partials before
they are combined (`decode_partials`: each split's and consumer's O, max and sum) and compares every
part with numpy's partial over the same blocks (block lo + j to consumer j % C), so a run says which
consumer, which quantity (O, the max, the sum) and which blocks' share is wrong, for a few tilings
beside the controls (one transposed consumer, two untransposed).  Prints one line per tiling:

    python3 -m benchmarks.probe_transposed [--interpret] [--ctx 2048] [--batch 8]
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax.pallas_kernels.kv_write import read_kv_reference
from umem_jax.pallas_kernels.paged_decode_mgpu import DecodeMgpuConfig, decode_partials

from .bench_decode_mgpu import Shape, fp8_setup

_LOG2E = 1.4426950408889634

# (label, config): the controls first
TILINGS = [
    ("1 consumer, transposed 128x2", DecodeMgpuConfig(128, 2, 1, 1, 128, True)),
    ("2 consumers, untransposed 128x2", DecodeMgpuConfig(128, 2, 1, 2, 128, False)),
    ("2 consumers, transposed 128x2", DecodeMgpuConfig(128, 2, 1, 2, 128, True)),
    ("2 consumers, transposed 128x4", DecodeMgpuConfig(128, 4, 1, 2, 128, True)),
    ("2 consumers, transposed 64x4, 2 splits", DecodeMgpuConfig(64, 4, 2, 2, 128, True)),
]


def expected_partials(q, k, v, lengths, cfg: DecodeMgpuConfig, G: int):
    """numpy's partials in decode_partials' form: q f32 [B, Hkv, G, D] (as the kernel rounds it), k, v
    f32 [B, S, Hkv, D] -> o [B, Hkv, parts, G, D], m (log2 units), l [B, Hkv, parts, G]."""
    B, _, Hkv, D = k.shape
    bkv, C, S = cfg.block_kv, cfg.consumers, cfg.num_splits
    o = np.zeros((B, Hkv, S * C, G, D))
    m = np.full((B, Hkv, S * C, G), -1e30)
    l = np.zeros((B, Hkv, S * C, G))
    for b in range(B):
        end = -(-int(lengths[b]) // bkv)
        per = -(-end // S)
        for split in range(S):
            lo, hi = split * per, min(split * per + per, end)
            for ci in range(C):
                toks = np.concatenate([np.arange(kb * bkv, min(kb * bkv + bkv, int(lengths[b])))
                                       for kb in range(lo + ci, hi, C)] or [np.zeros(0, int)])
                if not len(toks):
                    continue
                s = np.einsum("hgd,thd->hgt", q[b], k[b, toks]) / math.sqrt(D) * _LOG2E
                mx = s.max(-1)
                p = np.exp2(s - mx[..., None])
                part = split * C + ci
                m[b, :, part], l[b, :, part] = mx, p.sum(-1)
                o[b, :, part] = np.einsum("hgt,thd->hgd", p, v[b, toks]) / p.sum(-1)[..., None]
    return o, m, l


def probe(label, cfg, inputs, interpret) -> str:
    view, arena, pt, ln, q, k, v, qf = inputs
    G = q.shape[1] // view.num_kv_heads
    try:
        got = jax.jit(lambda q, a, p, n: decode_partials(q, a, p, n, None, view=view, window=None, softcap=None,
                                                         scale=None, kv_dtype=None, cfg=cfg,
                                                         interpret=interpret))(q, arena, pt, ln)
        go, gm, gl = (np.asarray(x, np.float64) for x in got)
    except Exception as e:  # noqa: BLE001 - one tiling's failure must not end the probe
        return f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}"
    eo, em, el = expected_partials(qf, k, v, np.asarray(ln), cfg, G)
    live = el > 0
    do = np.abs(go - eo).max(axis=(-1,))  # [B, Hkv, parts, G]
    dm = np.where(live, np.abs(gm - em), 0.0)
    dl = np.where(live, np.abs(gl - el) / np.maximum(el, 1e-30), np.abs(gl))
    bad = (do > 3e-2) | (dm > 1e-2) | (dl > 1e-2)
    C = cfg.consumers
    per_consumer = [int(bad[:, :, c::C].sum()) for c in range(C)]
    total = bad[:, :, 0::C].size
    norm = np.linalg.norm(go, axis=-1) / np.maximum(np.linalg.norm(eo, axis=-1), 1e-30)
    where = np.argwhere(bad)[:4].tolist()
    return (f"{label}: o err {do.max():.3g}, m err {dm.max():.3g}, l rel err {dl.max():.3g}; wrong (b, h, part, g) "
            f"rows by consumer {per_consumer} of {total} each; |o| got/expected on wrong rows "
            f"{np.round(np.quantile(norm[bad], [0, .5, 1]), 3).tolist() if bad.any() else '-'}; "
            f"o wrong {int((do > 3e-2).sum())}, m wrong {int((dm > 1e-2).sum())}, l wrong {int((dl > 1e-2).sum())}; "
            f"first {where}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="jax's GPU interpreter (CPU, jax >= 0.11)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    a = ap.parse_args(argv)
    s = Shape("probe", a.batch, a.ctx, 4 * a.kv_heads, a.kv_heads, 128, fp8=True)
    view, arena, pt, _, q, _, _ = fp8_setup(jax.random.PRNGKey(3), s)
    ln = jnp.asarray(np.random.default_rng(0).integers(a.ctx // 2, a.ctx + 1, a.batch), jnp.int32)
    k, v = (np.asarray(x, np.float64) for x in read_kv_reference(arena, pt, view=view))
    # the kernel's q: f16 (k_scale 1)
    qf = np.asarray(q.astype(jnp.float16), np.float64).reshape(a.batch, a.kv_heads, -1, 128)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; B={a.batch} ctx<={a.ctx} "
          f"lengths {np.asarray(ln).tolist()}", flush=True)
    for label, cfg in TILINGS:
        print(probe(label, cfg, (view, arena, pt, ln, q, k, v, qf), a.interpret), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
