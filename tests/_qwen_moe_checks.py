"""Checks the Qwen MoE fixture families (qwen3_5_moe_tiny, qwen3_next_tiny) share: the fused expert
checkpoint layout built from the committed per-expert one, and the engine run (chunked prefill,
retraction, a prefix-cache hit) against transformers' greedy tokens."""

from __future__ import annotations

import re

import numpy as np
from _model_fixtures import FIXTURES, copy_fixture, expected

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors: dict) -> dict:
    """Per-expert checkpoint tensors -> transformers' fused module layout: `mlp.experts.gate_up_proj`
    [E, 2I, d] (gate rows, then up rows) and `mlp.experts.down_proj` [E, d, I] per sparse layer."""
    out, experts = {}, {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for block, per in experts.items():
        ids = sorted(per)
        assert ids == list(range(len(ids))), f"{block}: experts {ids}"
        out[f"{block}.gate_up_proj"] = np.stack([np.concatenate([per[j]["gate_proj"], per[j]["up_proj"]]) for j in ids])
        out[f"{block}.down_proj"] = np.stack([per[j]["down_proj"] for j in ids])
    return out


def fused_checkpoint(tmp_path, name: str):
    """A copy of the fixture whose experts are stored fused (fuse_experts)."""
    from safetensors.numpy import load_file, save_file

    d = copy_fixture(tmp_path, name)
    save_file(fuse_experts(load_file(d / "model.safetensors")), d / "model.safetensors")
    return d


def engine_run(name: str):
    """The fixture's two prompts, twice each, through an LLM engine whose arena is too small for
    them all (new_token_ratio=0: decode outgrows it, so a request is retracted and recomputed),
    prefilled in chunks of 16; then the long prompt twice more (the second a prefix-cache hit).
    -> (engine LLM, expected, the four outputs, the hit)."""
    from umem_jax import LLM, SamplingParams
    from umem_jax.models.loader import load_model

    e = expected(name)
    llm = LLM(load_model(str(FIXTURES / name)), arena_bytes=40000, max_num_seqs=4, max_num_batched_tokens=16,
              page_size=4, max_model_len=128, batch_buckets=(4,), token_buckets=(16,), page_buckets=(32,),
              new_token_ratio=0.0, kv_cache_dtype="float32",
              exact_fixed_length_reservation=False)  # fixed-length requests retract only under the ratio rule
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [e["short_prompt"].tolist(), e["long_prompt"].tolist()]
    outs = llm.generate(prompts + prompts, greedy)
    llm.generate(prompts[1], greedy)
    hit = llm.generate(prompts[1], greedy)[0]
    return llm, e, outs, hit
