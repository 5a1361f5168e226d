"""The prefill parity harness (benchmarks/engine_parity.py --prefill): the served trace's requests
generated under two prefill kernels in one process, each differing sequence reported with its
first differing step and the dense margin there.  On the CPU the engine runs the references, so
both runs agree; a second run whose tokens are altered stands in for a kernel that differs."""

from __future__ import annotations

import json
import os

from benchmarks import engine_parity

from umem_jax import LLM
from umem_jax.bench.sweep import load_bench_model
from umem_jax.pallas_kernels.paged_prefill import BLOCK_K_ENV, PREFILL_ENV


def test_the_trace_agrees_with_itself(tmp_path, monkeypatch):
    monkeypatch.setenv(PREFILL_ENV, "triton")
    out = tmp_path / "rows.json"
    assert engine_parity.main(["--prefill", "mgpu", "--small", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    runs = [r for r in rows if "env" in r]  # a row a run: which kernels its traced prefills took
    assert [r["env"] for r in runs] == ["triton", "mgpu"] and all(r["seconds"] > 0 for r in runs)
    summary = [r for r in rows if "requests" in r]
    outputs = [r for r in rows if "outputs" in r]  # a row a run: its tokens and first logprobs
    rows = [r for r in rows if "env" not in r and "requests" not in r and "outputs" not in r]
    prompts, outs, _ = engine_parity.trace_requests("tiny", "shifting", 256, small=True)
    assert [r["arm"] for r in outputs] == ["triton", "mgpu"]
    assert [len(t) for t in outputs[0]["outputs"]["tokens"]] == outs
    assert outputs[0]["outputs"] == outputs[1]["outputs"]
    assert len(summary) == 1 and summary[0]["backend"] == "mgpu"
    assert summary[0]["same"] == summary[0]["requests"] == summary[0]["first_token_same"] == len(prompts)
    assert summary[0]["mean_agreeing_share"] == 1.0
    assert len(rows) == len(prompts) == len(outs) >= 8 and all(r["same"] for r in rows)
    assert [r["prompt_len"] for r in rows] == [len(p) for p in prompts]
    assert {r["backend"] for r in rows} == {"mgpu"}
    assert max(map(len, prompts)) > 4 * min(map(len, prompts))  # short and long requests both
    assert os.environ[PREFILL_ENV] == "triton"  # restored after the two runs, as is the kernel choice it watched
    from umem_jax.pallas_kernels import paged_prefill

    assert paged_prefill.prefill_backend.__name__ == "prefill_backend"


def test_a_differing_token_is_reported_with_its_step_and_margin(tmp_path, monkeypatch):
    """The second run's request 1 gets another token at step 2 (and the rest as generated):
    the harness fails, names step 2 and both tokens, and gives the dense margin there."""
    real = LLM.generate

    def altered(self, prompts, params=None, **kw):
        res = real(self, prompts, params, **kw)
        ids = res[1].outputs[0].token_ids
        if os.environ.get(PREFILL_ENV) == "mgpu" and len(ids) > 2:  # not the warm prefill pass (one token)
            ids[2] = (ids[2] + 1) % self.llm_engine.model.config.vocab_size
        return res

    monkeypatch.setattr(LLM, "generate", altered)
    log = engine_parity.RowLog(str(tmp_path / "rows.json"))
    assert not engine_parity.prefill_parity("tiny", "mgpu", "shifting", None, True, 4096, log)
    bad = [r for r in log.rows if "env" not in r and "requests" not in r and "outputs" not in r and not r["same"]]
    assert len(bad) == 1 and bad[0]["prompt"] == 1 and bad[0]["step"] == 2
    assert bad[0]["other_token"] != bad[0]["triton_token"]
    assert bad[0]["margin"] >= 0.0 and bad[0]["logit_spread"] > 0.0


def test_the_null_runs_triton_twice_with_two_kv_blocks(tmp_path, monkeypatch):
    """--prefill triton: the same kernel with its default K/V block and with half of it (null_block_k), each
    run under its own $UMEM_JAX_PREFILL_BLOCK_K (on the CPU's fp32 references nothing differs);
    each run times its prefill twice more, the second warm."""
    seen = []
    real = LLM.generate

    def watched(self, prompts, params=None, **kw):
        seen.append(os.environ.get(BLOCK_K_ENV))
        return real(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", watched)
    log = engine_parity.RowLog(str(tmp_path / "rows.json"))
    assert engine_parity.prefill_parity("tiny", "triton", "shifting", None, True, 4096, log, requests=6)
    runs = [r for r in log.rows if "env" in r]
    bk = engine_parity.null_block_k(load_bench_model("tiny", "float32").config)
    assert [(r["env"], r["arm"], r["block_k"]) for r in runs] == [
        ("triton", "triton", None), ("triton", f"triton/bk{bk}", bk)]
    assert seen == ["", "", ""] + [str(bk)] * 3  # the trace, then the prefill twice
    assert all(r["prefill_seconds"] > 0 and r["prefill_first_pass_seconds"] > 0 for r in runs)
    summary, = [r for r in log.rows if "requests" in r]
    assert summary["requests"] == summary["same"] == summary["first_token_same"] == 6
    assert summary["first_logprob_diff_max"] < 1e-4
    assert {r["backend"] for r in log.rows if "backend" in r} == {f"triton/bk{bk}"}
    assert BLOCK_K_ENV not in os.environ or os.environ[BLOCK_K_ENV] == ""


def test_null_and_backend_in_one_process(tmp_path):
    """--prefill mgpu --null: three runs, both compared with Triton; the verdict is the backend's."""
    assert [a.name for a in engine_parity.arms("auto", True)] == ["triton", "triton/bk64", "auto"]
    assert [a.block_k for a in engine_parity.arms("auto", True)] == [None, 64, None]
    assert [a.name for a in engine_parity.arms("auto", False)] == ["triton", "auto"]
    log = engine_parity.RowLog(str(tmp_path / "rows.json"))
    assert engine_parity.prefill_parity("tiny", "mgpu", "shifting", None, True, 4096, log, requests=4, null=True)
    bk = engine_parity.null_block_k(load_bench_model("tiny", "float32").config)
    assert [r["backend"] for r in log.rows if "requests" in r] == [f"triton/bk{bk}", "mgpu"]


def _summary(backend, median, worst, share):
    return dict(backend=backend, first_logprob_diff_median=median, first_logprob_diff_max=worst,
                mean_agreeing_share=share, same=0, requests=48)


def test_the_rounding_verdict_holds_a_kernel_to_the_null():
    """Within the null: logprob differences up to LOGPROB_SLACK x the null's and a share before the
    first difference of at least SHARE_FLOOR x the null's; each bound alone fails it."""
    null = _summary("triton/bk64", 0.02, 0.08, 0.12)
    ok, reasons = engine_parity.rounding_verdict(null, _summary("auto", 0.019, 0.085, 0.099))
    assert ok and len(reasons) == 3 and all(r.endswith("(yes)") for r in reasons)
    for bad in (_summary("auto", 0.031, 0.085, 0.12), _summary("auto", 0.02, 0.13, 0.12),
                _summary("auto", 0.02, 0.08, 0.09)):
        ok, reasons = engine_parity.rounding_verdict(null, bad)
        assert not ok and sum(r.endswith("(NO)") for r in reasons) == 1


def test_against_an_earlier_run(tmp_path, capsys):
    """--prefill triton --against JSON: this run's null judges the kernel of an earlier run's JSON."""
    earlier = tmp_path / "earlier.json"
    assert engine_parity.main(["--prefill", "mgpu", "--small", "--requests", "3", "--no-warm",
                               "--json", str(earlier)]) == 0
    capsys.readouterr()
    assert engine_parity.main(["--prefill", "triton", "--small", "--requests", "3", "--no-warm",
                               "--json", str(tmp_path / "null.json"), "--against", str(earlier)]) == 0
    out = capsys.readouterr().out
    assert "rounding verdict, mgpu against the null triton/bk" in out and "within the null's rounding" in out


def test_the_null_halves_the_default_kv_block():
    """The null's block for a model: half the Triton kernel's default for its head dim and GQA."""
    from types import SimpleNamespace as NS

    # head dim 128 (Nemotron-3-Nano-like), then 256 (Gemma-3-4B-like, Qwen3.5-4B-like)
    assert engine_parity.null_block_k(NS(num_heads=32, num_kv_heads=8, head_dim=128)) == 64
    assert engine_parity.null_block_k(NS(num_heads=8, num_kv_heads=4, head_dim=256)) == 16
    assert engine_parity.null_block_k(NS(num_heads=24, num_kv_heads=4, head_dim=80)) >= 16
