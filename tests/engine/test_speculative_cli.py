"""Speculative decoding from the command line (vLLM / SGLang flag names) and in /metrics."""

from __future__ import annotations

import argparse

import pytest

from umem_jax import cli
from umem_jax.engine.speculative_flags import from_flags


def _ns(**kw):
    fields = ("speculative_config", "speculative_method", "num_speculative_tokens", "speculative_num_draft_tokens",
              "speculative_draft_model", "speculative_min_acceptance")
    return argparse.Namespace(**{f: kw.get(f) for f in fields})


def test_flags_make_the_speculative_config():
    assert from_flags(_ns()) is None
    vllm = '{"method": "draft_model", "model": "m", "num_speculative_tokens": 4}'
    assert from_flags(_ns(speculative_config=vllm)) == {"method": "draft", "model": "m", "num_speculative_tokens": 4}
    # the separate flags override the JSON's fields
    assert from_flags(_ns(speculative_config=vllm, num_speculative_tokens=2))["num_speculative_tokens"] == 2
    # SGLang: STANDALONE is a separate draft, --speculative-num-draft-tokens counts the verified tokens (k + 1)
    got = from_flags(_ns(speculative_method="STANDALONE", speculative_num_draft_tokens=4, speculative_draft_model="d"))
    assert got == {"method": "draft", "model": "d", "num_speculative_tokens": 3}
    assert from_flags(_ns(speculative_method="NEXTN")) == {"method": "mtp"}
    assert from_flags(_ns(speculative_method="mtp", speculative_min_acceptance=0.0)) == {"method": "mtp",
                                                                                         "min_acceptance": 0.0}
    assert from_flags(_ns(speculative_config='{"method": "mtp", "min_acceptance": 0.5}'))["min_acceptance"] == 0.5
    with pytest.raises(ValueError, match="not JSON"):
        from_flags(_ns(speculative_config="{method"))
    with pytest.raises(ValueError, match=r"fields \['draft_tensor_parallel_size'\] are not supported"):
        from_flags(_ns(speculative_config='{"model": "m", "draft_tensor_parallel_size": 1}'))


def test_serve_and_generate_take_the_flags():
    for cmd in (["serve", "tiny"], ["generate", "tiny", "--prompt", "x"]):
        args = cli.parser().parse_args(cmd + ["--speculative-method", "draft", "--num-speculative-tokens", "2",
                                              "--speculative-draft-model", "tiny-attention"])
        assert from_flags(args) == {"method": "draft", "model": "tiny-attention", "num_speculative_tokens": 2}
        args = cli.parser().parse_args(cmd + ["--speculative-config", '{"model": "tiny-attention"}'])
        assert from_flags(args) == {"model": "tiny-attention"}
    serve = next(a for a in cli.parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    text = serve.format_help()
    assert "--speculative-draft-model" in text and "--num-speculative-tokens" in text and "--speculative-config" in text


def test_generate_with_a_draft_reports_acceptance(capsys):
    assert cli.main(["generate", "tiny-attention", "--prompt", "hello there", "--max-tokens", "6", "--arena-bytes",
                     str(1 << 20), "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--page-size", "4",
                     "--speculative-draft-model", "tiny-attention", "--num-speculative-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "[6 tokens, finish_reason=length]" in out
    # its own draft: every draft is the target's token
    assert "speculative: k=2," in out and "acceptance 1.00, per position [1.00, 1.00]" in out, out


def test_refused_speculation_exits_2_with_the_reason(capsys):
    assert cli.main(["generate", "tiny-attention", "--prompt", "x", "--arena-bytes", str(1 << 20),
                     "--speculative-method", "mtp"]) == 2
    assert "speculative method 'mtp': UmemTinyHybrid has no MTP layers" in capsys.readouterr().err


def test_metrics_count_drafts_and_acceptance_per_position():
    from umem_jax import LLM, SamplingParams
    from umem_jax.api.metrics import EngineMetrics

    llm = LLM("tiny-attention", arena_bytes=1 << 20, max_num_seqs=1, max_num_batched_tokens=16, page_size=4,
              speculative_config={"model": "tiny-attention", "num_speculative_tokens": 2})
    metrics = EngineMetrics("m")
    metrics.bind(llm.llm_engine)
    llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=7))
    metrics.snapshot(llm.llm_engine)
    st = llm.llm_engine.stats()["speculative"]
    text = metrics.render()[0].decode()
    assert f'umem:spec_decode_num_drafts_total{{model_name="m"}} {float(st["num_verify_rows"])}' in text
    assert f'umem:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(st["num_accepted_tokens"])}' in text
    for pos in (0, 1):
        assert f'umem:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}}' in text
    assert st["num_accepted_tokens"] == st["num_draft_tokens"] > 0
