"""Defaults that fit (issue 20): at their CPU defaults the built-in models hold one request of the
max_model_len they advertise (capacity >= 1); where the context does not fit, the longest that
does is served and the advice names the interface in use; max_tokens that cannot fit beside the
prompt is refused in vLLM's words, unset it means the room left; each band is reported in its
own pages and bytes, held split into requests and cache; stats names say what they count."""

from __future__ import annotations

import json
import logging
import re

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_utils import tiny

from umem_jax import LLM, SamplingParams
from umem_jax.engine import fit
from umem_jax.engine.config import EngineConfig
from umem_jax.engine.fit import CPU_ARENA_BYTES, MAX_CPU_ARENA_BYTES, capacity, fit_context, fits
from umem_jax.memory.plan import plan as make_plan
from umem_jax.memory.sizing import ArenaSizeError
from umem_jax.models.registry import load_hf_config, model_class

# google/gemma-3-270m's text config, as the packaged GGUF converts to (loader.convert_gguf)
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3, "sliding_window": 512,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "dtype": "float32", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "max_position_embeddings": 32768}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3_270m")
    (d / "config.json").write_text(json.dumps(GEMMA3_270M))
    return d


def gemma_plan(gemma_dir):
    mc = load_hf_config(gemma_dir)
    return make_plan(model_class(mc.architecture).decls(mc, "float32"), page_size=16)


def served(engine) -> int:
    """Requests of the advertised max_model_len the idle arena holds at once."""
    return capacity(engine.demand, engine.max_model_len, engine.config.max_num_seqs)


# ------------------------------------------------------------------ defaults that fit


@pytest.mark.parametrize("name", ["tiny", "tiny-attention"])
def test_tiny_builtins_serve_their_context_in_the_least_cpu_arena(name, caplog):
    with caplog.at_level(logging.WARNING, logger="umem_jax"):
        e = LLM(model=name).llm_engine
    assert e.max_model_len == e.model.config.max_position_embeddings == 4096
    assert e.size.nbytes == CPU_ARENA_BYTES and served(e) >= 1
    assert not [r for r in caplog.records if "fit" in r.getMessage()]


def test_gemma3_270m_at_cpu_defaults_holds_a_request_of_its_max_model_len(gemma_dir, caplog, monkeypatch):
    # LLM(model="gemma3-270m") with nothing else set: same shapes, dummy weights (load_format="dummy").
    # What is checked here (the arena, max_model_len, capacity, the log) comes from the shapes alone,
    # never from a weight's value, so the 270M weights are filled with their init std instead of
    # drawn: JAX's threefry normal over 270M floats was most of this test (22 s of 23 alone at the
    # suite's -O0, ~57 s in a 2-worker CI run).  The weights still take their memory, which the
    # host-memory branch below reads.
    from umem_jax.models import layers

    monkeypatch.setattr(layers, "_normal", lambda key, shape, dtype, std: jnp.full(shape, std, dtype))
    with caplog.at_level(logging.WARNING, logger="umem_jax"):
        e = LLM(model=str(gemma_dir), load_format="dummy").llm_engine
    assert served(e) >= 1 and fits(e.demand, e.max_model_len)
    assert CPU_ARENA_BYTES < e.size.nbytes <= MAX_CPU_ARENA_BYTES  # 64 MiB holds no 32K request of it
    free = fit._host_free_bytes()
    if free is None or free // fit.HOST_FRACTION >= e.size.nbytes + (64 << 20):  # memory allows: the whole context
        assert e.max_model_len == 32768 and not caplog.records
    else:
        assert e.max_model_len < 32768 and "serving max_model_len" in caplog.text


def test_arena_short_of_the_context_serves_the_longest_that_fits(gemma_dir, monkeypatch, caplog):
    monkeypatch.setattr(fit, "_host_free_bytes", lambda: fit.HOST_FRACTION * CPU_ARENA_BYTES)  # a small host
    plan = gemma_plan(gemma_dir)
    for interface, keyword in (("python", "arena_bytes="), ("cli", "--arena-bytes")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="umem_jax"):
            f = fit_context(EngineConfig(interface=interface), plan, 32768, chunk=2048)
        n = f.max_model_len
        assert f.size.nbytes == CPU_ARENA_BYTES and 512 < n < 32768 and n % plan.page_size == 0
        assert fits(f.demand, n) and not fits(f.demand, n + plan.page_size)
        assert capacity(f.demand, n, 256) >= 1
        msg = caplog.text
        assert f"serving max_model_len={n:,}" in msg and keyword in msg
        assert "gpu" not in msg.lower()  # a CPU: no --gpu-memory-utilization advice
    assert "--max-num-batched-tokens" in msg and "max_num_batched_tokens=" not in msg


def test_given_max_model_len_that_does_not_fit_is_kept_with_the_advice(gemma_dir, caplog):
    plan = gemma_plan(gemma_dir)
    cfg = EngineConfig(arena_bytes=CPU_ARENA_BYTES, max_model_len=32768)
    with caplog.at_level(logging.WARNING, logger="umem_jax"):
        f = fit_context(cfg, plan, 32768, chunk=2048)
    assert f.max_model_len == 32768 and not fits(f.demand, 32768)
    longest = max(n for n in range(2, 32769, 16) if fits(f.demand, n))
    msg = caplog.text
    assert "capacity 0" in msg and "max_model_len=" in msg and "arena_bytes=" in msg and "gpu" not in msg.lower()
    at_most = int(msg.split("at most ")[1].split(" fits")[0].replace(",", ""))
    assert longest <= at_most < longest + 16 and fits(f.demand, at_most) and not fits(f.demand, at_most + 1)


def test_arena_bytes_below_one_block_is_refused_by_its_own_name(gemma_dir):
    plan = gemma_plan(gemma_dir)
    for interface, named in (("python", "arena_bytes=100 "), ("cli", "--arena-bytes 100 ")):
        with pytest.raises(ArenaSizeError, match=f"^{named}is less than one") as e:
            fit_context(EngineConfig(arena_bytes=100, interface=interface), plan, 32768, chunk=2048)
        assert "gpu" not in str(e.value).lower()


def test_gpu_advice_names_gpu_memory_utilization():
    size = type("S", (), {"budget_bytes": 1 << 30})()
    assert fit._more_memory(EngineConfig(), False, size) == "raise gpu_memory_utilization= (now 0.9)"
    assert fit._more_memory(EngineConfig(interface="cli"), False, size) == "raise --gpu-memory-utilization (now 0.9)"
    assert fit._more_memory(EngineConfig(arena_bytes=1 << 30), False, size).startswith("raise arena_bytes=")


# ------------------------------------------------------------------ max_tokens (offline; HTTP: tests/api)


@pytest.fixture(scope="module")
def short_llm():
    """The tiny hybrid in a small arena, max_model_len not given: derived from the arena."""
    return LLM(tiny(), arena_bytes=128 << 10, max_num_seqs=2, max_num_batched_tokens=32, batch_buckets=(2,),
               token_buckets=(32,))


def test_derived_max_model_len_runs_a_request_of_that_length(short_llm):
    e = short_llm.llm_engine
    n = e.max_model_len
    assert 64 < n < 4096 and served(e) >= 1
    prompt = np.random.default_rng(3).integers(3, 300, n - 4).tolist()
    out = short_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    unset = short_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert unset.outputs[0].token_ids == out.outputs[0].token_ids  # unset: up to the room left (4 here)
    assert e.stats()["num_retractions"] == 0


@pytest.mark.parametrize("max_tokens", [5, 10**9])
def test_max_tokens_over_the_room_is_refused_naming_max_model_len(short_llm, max_tokens):
    e = short_llm.llm_engine
    n = e.max_model_len
    prompt = [3 + i % 300 for i in range(n - 4)]  # room for 4
    want = (f"max_tokens={max_tokens} is too large: the prompt ({n - 4} tokens) and max_tokens must fit "
            f"max_model_len={n}, so at most 4 here")
    with pytest.raises(ValueError, match="^prompt 0: " + re.escape(want)):
        short_llm.generate([prompt, [5, 6, 7]], SamplingParams(max_tokens=max_tokens))
    with pytest.raises(ValueError, match=r"^max_tokens="):
        e.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    assert not e.has_unfinished_requests()  # nothing was queued, not even the good prompt


# ------------------------------------------------------------------ bands and stats names


def test_bands_in_their_own_pages_split_into_requests_and_cache(short_llm):
    e = short_llm.llm_engine
    p = np.random.default_rng(4).integers(3, 300, 80).tolist()
    short_llm.generate([p, p[:70]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    st = e.stats()
    a, layout = e.allocator, e.allocator.layout
    cache_held = st["prefix_cache"]["held"]
    for i, band in enumerate(a.bands):
        b = st["bands"][band.name]
        assert b["held"] == st["held"][band.name] == b["requests"] + b["cache"]
        assert b["requests"] == 0 and b["cache"] == cache_held.get(band.name, 0)  # idle: all the cache's
        for k in ("held", "requests", "cache", "available"):
            assert b[f"{k}_bytes"] == b[k] * e.plan[band.name].page_bytes
        n = b["available"]  # what this band alone can take: n fits, n + 1 does not
        if i == layout.state:
            assert a.can_fit(state_slots=n) and not a.can_fit(state_slots=n + 1)
        elif i == layout.full:
            none = {w.name: 0 for w in e.plan.windows}
            assert a.can_fit(token_pages=n, window_pages=none) and not a.can_fit(token_pages=n + 1, window_pages=none)
        else:
            assert layout.fits({i: n}) and not layout.fits({i: n + 1})
    assert st["bands"]["full"]["cache"] > 0  # the prompts' whole pages stay cached
    sizes = {e.plan[k].page_bytes for k in st["bands"]}
    assert len(sizes) > 1  # the bands' pages differ in size: the per-band counts are not one number
    assert st["evictable_bytes"] == sum(b["cache_bytes"] for b in st["bands"].values())


def test_stats_names_say_what_they_count(short_llm):
    e = short_llm.llm_engine
    before = e.stats()["prefix_cache"]
    p = np.random.default_rng(5).integers(3, 300, 40).tolist()
    short_llm.generate([p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    short_llm.generate([p], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    st = e.stats()
    pc = st["prefix_cache"]
    assert pc["queries"] - before["queries"] == 2  # requests looked up
    assert pc["query_tokens"] - before["query_tokens"] >= 2 * 40 - 2  # their prompt tokens
    assert st["prefix_cache_query_tokens"] == pc["query_tokens"] and st["prefix_cache_hit_tokens"] == pc["hit_tokens"]
    assert pc["hit_tokens"] - before["hit_tokens"] >= 32  # the second found the first's whole pages
    assert "prefix_cache_queries" not in st and "prefix_cache_hits" not in st


@pytest.mark.parametrize("kw,match", [
    (dict(kernel_impl="foo"), "kernel_impl must be"),
    (dict(max_model_len=0), "max_model_len must be an int >= 1"),
    (dict(max_model_len=-5), "max_model_len must be an int >= 1"),
    (dict(extra_state_slots=-1), "extra_state_slots must be an int >= 0"),
    (dict(max_prefill_streak=0), "max_prefill_streak must be an int >= 1"),
    (dict(checkpoint_interval=-3), "checkpoint_interval must be an int >= 1"),
    (dict(new_token_ratio=-1.0), r"new_token_ratio must be in \[0, 1\]"),
    (dict(swa_full_tokens_ratio=-0.5), "swa_full_tokens_ratio must be a number > 0"),
    (dict(mamba_full_memory_ratio=float("nan")), "mamba_full_memory_ratio must be a number > 0"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be an int"),
    (dict(page_size=4.0), "page_size must be an int"),
    (dict(arena_bytes=True), "arena_bytes must be an int"),
    (dict(dtype="int8"), "dtype must be float32, bfloat16 or float16"),
])
def test_impossible_options_are_refused_naming_them(kw, match):
    """Refused when the config is made (LLM() / the CLI), with the option's name and its range:
    never accepted and ignored, nor left to fail the first request (and the engine with it)."""
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_weight_dtype_takes_vllm_names():
    assert [EngineConfig(dtype=d).dtype for d in ("auto", "half", "bf16", "float", "float16", None)] == \
        [None, "float16", "bfloat16", "float32", "float16", None]
    assert EngineConfig(arena_bytes=np.int64(1 << 20), swa_full_tokens_ratio=2).arena_bytes == 1 << 20
