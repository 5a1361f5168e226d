"""paged_short_extend_attention (a verify's few queries as decode rows) against the prefill
reference on the same poisoned arenas: any GQA ratio, head dims 64-256, windows over tombstoned
pages, softcap and sinks, fp32 planes and fp8, padding rows; through the decode reference and
the Triton decode kernel in interpret mode; and when a chunk takes it.  The attention layer's
use of it runs in every speculative test (a verify of k + 1 = 4 queries at small B)."""

from __future__ import annotations

import pytest
from _prefill_utils import assert_close, prefill_case

from umem_jax.pallas_kernels import short_extend
from umem_jax.pallas_kernels.short_extend import paged_short_extend_attention, short_extend_applies

# name, Hkv, G, D, page size, T, P, rows [(prefix, q_len)], options
CASES = [
    ("bf16_gqa4_verify", 2, 4, 64, 16, 4, 8, [(40, 4), (7, 4), (0, 3), (5, 0)], {}),
    ("bf16_gqa6_d128_window_tomb", 1, 6, 128, 16, 4, 12, [(100, 4), (30, 2), (130, 4)],
     dict(window=24, tombstone=True)),
    ("bf16_gqa3_d80_softcap_sinks", 2, 3, 80, 32, 3, 4, [(60, 3), (1, 3), (90, 1)],
     dict(softcap=5.0, use_sinks=True, scale=0.2)),
    ("bf16_gqa5_d96_p64", 1, 5, 96, 64, 8, 3, [(120, 8), (10, 5)], {}),
    ("bf16_gqa8_d256", 1, 8, 256, 16, 4, 6, [(70, 4), (0, 4)], {}),
    ("f32_mha_planes", 2, 1, 64, 16, 2, 8, [(33, 2), (70, 1), (0, 2)], dict(fp32=True)),
    ("fp8_gqa4", 2, 4, 128, 16, 4, 8, [(50, 4), (3, 2)], dict(fp8=True)),
]


def _case(name, Hkv, G, D, ps, T, P, rows, opts):
    return prefill_case(name, Hkv, G, D, ps, T, P, rows, **opts)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_short_extend_matches_the_prefill_reference(case, impl):
    q, arena, pt, q_lens, kv_lens, kw, ref = _case(*case)
    fp32, fp8 = case[-1].get("fp32", False), case[-1].get("fp8", False)
    run = dict(impl="reference") if impl == "reference" else dict(interpret=True)
    out = paged_short_extend_attention(q, arena, pt, q_lens, kv_lens, **kw, **run)
    assert out.shape == ref.shape and out.dtype == q.dtype
    # padding rows (q_len 0, and queries past q_len whose q is NaN) come out exactly 0
    assert_close(out, ref, q_lens, fp32=fp32, tol=3e-2 if fp8 else None)


def test_short_extend_rejects_mismatched_rows():
    q, arena, pt, q_lens, kv_lens, kw, _ = _case(*CASES[0])
    with pytest.raises(ValueError, match="page_table"):
        paged_short_extend_attention(q, arena, pt[:1], q_lens, kv_lens, **kw, impl="reference")


def test_when_a_chunk_runs_as_decode_rows(monkeypatch):
    monkeypatch.delenv(short_extend.SHORT_EXTEND_ENV, raising=False)
    monkeypatch.setattr(short_extend.jax, "default_backend", lambda: "gpu")
    assert short_extend_applies(1, 4, 4) and short_extend_applies(8, 8, 8)  # a verify at small B
    assert not short_extend_applies(1, 1, 4)  # a decode step is one already
    assert not short_extend_applies(1, 9, 4)  # longer chunks are prefills
    assert not short_extend_applies(64, 4, 8)  # 512 prefill programs fill the GPU: K/V read once
    assert short_extend_applies(64, 4, 8, "decode") and not short_extend_applies(1, 4, 4, "prefill")
    monkeypatch.setattr(short_extend.jax, "default_backend", lambda: "cpu")
    assert not short_extend_applies(1, 4, 4)  # the references have no idle SMs: auto keeps the prefill form
    assert short_extend_applies(1, 4, 4, "decode")
    monkeypatch.setenv(short_extend.SHORT_EXTEND_ENV, "prefill")
    assert not short_extend_applies(1, 4, 4)
    monkeypatch.setenv(short_extend.SHORT_EXTEND_ENV, "fast")
    with pytest.raises(ValueError, match="UMEM_JAX_SHORT_EXTEND"):
        short_extend_applies(1, 4, 4)


def test_the_runner_keeps_a_step_per_trace_time_choice(monkeypatch):
    """The choice is read when a step is traced, and JAX reuses a trace by its static arguments:
    the runner's step object (a static argument) is keyed on the choice, so a step traced under
    one value is never run under another (runner.step_key)."""
    import jax

    from umem_jax.memory import plan as make_plan
    from umem_jax.models.loader import load_model
    from umem_jax.runner.runner import step_model

    model = load_model("tiny-attention")
    plan = make_plan(model.decls(), page_size=4)
    treedef = jax.tree.structure(model.params)
    make = lambda: step_model(model, plan, "reference", False, treedef)
    monkeypatch.delenv(short_extend.SHORT_EXTEND_ENV, raising=False)
    auto = make()
    assert make() is auto  # engines on one model share their compiled steps
    monkeypatch.setenv(short_extend.SHORT_EXTEND_ENV, "decode")
    decode = make()
    assert decode is not auto and make() is decode
    monkeypatch.setenv("UMEM_JAX_DECODE", "triton")
    assert make() is not decode
    monkeypatch.delenv(short_extend.SHORT_EXTEND_ENV)
    monkeypatch.delenv("UMEM_JAX_DECODE")
    assert make() is auto
