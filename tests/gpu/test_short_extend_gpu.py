"""paged_short_extend_attention (a verify's k + 1 queries as split-K decode rows) on a real GPU:
the compiled decode kernels (Triton, and Mosaic GPU where the decode takes it) against the plain-JAX
prefill reference at verify shapes (B = 1-8, T = 2-8, contexts up to 32K, any GQA ratio, windows over
tombstoned pages, sinks, fp32 planes, fp8), on poisoned arenas (skipped without an NVIDIA GPU).

Run on the GPU machine:  python -m pytest -q tests/gpu/test_short_extend_gpu.py
"""

from __future__ import annotations

import jax
import pytest
from _prefill_utils import assert_close, prefill_case

from umem_jax.pallas_kernels.short_extend import paged_short_extend_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU (compiled decode kernels)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# name, Hkv, G, D, page size, T, P, rows [(prefix, q_len)], options
CASES = [
    # Qwen3.5-4B-like attention at a B = 1 verify (k = 3), fp32 planes as the benchmark's model
    ("qwen35_fp32_verify", 4, 4, 256, 16, 4, 64, [(512, 4)], dict(fp32=True)),
    ("qwen35_bf16_b8", 4, 4, 256, 16, 4, 2100, [(1000 * i % 32000 + 17, 4) for i in range(8)], {}),
    # GQA 6 and a window over tombstoned pages with sinks (gpt-oss-like), a partial verify (q_len 2 of 8)
    ("gqa6_window_sinks", 2, 6, 64, 16, 8, 300, [(4000, 8), (130, 2), (0, 5)],
     dict(window=128, tombstone=True, use_sinks=True)),
    ("gemma_softcap_d256", 1, 8, 256, 16, 4, 80, [(900, 4), (1200, 3)], dict(window=512, softcap=50.0)),
    ("fp8_gqa4", 8, 4, 128, 16, 4, 300, [(4095, 4), (33, 4), (2000, 1)], dict(fp8=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_short_extend_matches_the_reference_on_the_gpu(case):
    name, Hkv, G, D, ps, T, P, rows, opts = case
    q, arena, pt, q_lens, kv_lens, kw, ref = prefill_case(name, Hkv, G, D, ps, T, P, rows, **opts)
    out = jax.block_until_ready(paged_short_extend_attention(q, arena, pt, q_lens, kv_lens, **kw, impl="pallas"))
    assert_close(out, ref, q_lens, fp32=opts.get("fp32", False), tol=3e-2 if opts.get("fp8") else None)
