"""mamba_ssm_dtype (issue 17, item 2): the recurrent state (Mamba2 ssm, gated DeltaNet recurrent)
stored as one bf16 plane instead of two fp32 planes, computed in fp32 in the kernels.

On the NemotronH and Qwen3.5 fixtures: the plan's state entry shrinks by exactly the recurrent
tensor's lo plane; both prompts, teacher-forced along the fp32-state run's tokens through the
arena, give logits within STATE_TOL of the fp32-state run; and the engine takes the option, the
CLI spelling of vLLM, and the checkpoint config's key when the option is "auto".
"""

from __future__ import annotations

import json

import pytest
from _model_arena import generate
from _model_fixtures import FIXTURES, PROMPTS, copy_fixture, expected, fixture_model, rel_err

from umem_jax.memory import plan as make_plan
from umem_jax.memory.declarations import SSM_STATE_TENSORS, WORD_BYTES, mamba_ssm_dtype, with_ssm_dtype

# max |logits(bf16 state) - logits(fp32 state)| / max |logits(fp32 state)| over every step of both
# prompts (16 tokens each after the prompt), one bf16 rounding of the state per token.  Measured
# (2026-12-04, CPU): 8.2e-4 NemotronH, 2.9e-2 Qwen3.5 (its random tiny DeltaNet amplifies the
# rounding: an fp16 state, 3 more mantissa bits, gives 4.4e-3 there; free-running, the short
# prompt's greedy tokens part after a few steps).  The same bound as the bf16-checkpoint tests.
STATE_TOL = 5e-2
FAMILIES = ["nemotron_h_tiny", "qwen3_5_tiny"]


def _plans(m, page_size=4):
    decls = m.decls(kv_dtype="float32")
    return (make_plan(with_ssm_dtype(decls, "float32"), page_size=page_size),
            make_plan(with_ssm_dtype(decls, "bfloat16"), page_size=page_size))


@pytest.mark.parametrize("name", FAMILIES)
def test_plan_state_entry_loses_the_lo_plane(name):
    p32, p16 = _plans(fixture_model(name))
    assert make_plan(fixture_model(name).decls(kv_dtype="float32"), page_size=4) == p32  # fp32 is the default
    s32, s16 = p32.state, p16.state
    lo_plane_rows = 0
    for layer32 in s32.state:
        for t in layer32:
            if t.tensor.name in SSM_STATE_TENSORS:
                assert t.planes == 2
                lo_plane_rows += t.rows_per_plane
    assert lo_plane_rows > 0
    assert s32.rows_per_entry - s16.rows_per_entry == lo_plane_rows
    assert s32.entry_bytes - s16.entry_bytes == lo_plane_rows * p32.row_words * WORD_BYTES
    for layer16 in s16.state:
        assert {t.tensor.name: t.planes for t in layer16 if t.tensor.name in SSM_STATE_TENSORS} \
            == {t.tensor.name: 1 for t in layer16 if t.tensor.name in SSM_STATE_TENSORS}
    assert "bfloat16 (one 16-bit plane" in p16.table() and "one 16-bit plane" not in p32.table()
    assert p32.full == p16.full and p32.sink_rows == p16.sink_rows  # K/V untouched


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_state_logits_close_to_fp32_state(name):
    m, e = fixture_model(name), expected(name)
    p32, p16 = _plans(m)
    prompts = [e[f"{n}_prompt"] for n in PROMPTS]
    run32 = generate(m, p32, prompts, 16, chunk=8)
    run16 = generate(m, p16, prompts, 16, chunk=8, teacher=run32.tokens)
    worst = 0.0
    for lg32, lg16 in zip(run32.logits, run16.logits):
        assert [pos for pos, _ in lg32] == [pos for pos, _ in lg16]
        worst = max(worst, *(rel_err(b, a) for (_, a), (_, b) in zip(lg32, lg16)))
    assert 0 < worst <= STATE_TOL, worst  # > 0: the state really was rounded
    # the state stays bf16 in the arena: the slot's rows are those of the smaller entry
    assert run16.arena.plan.state.rows_per_entry < run32.arena.plan.state.rows_per_entry


def test_option_values_and_checkpoint_key():
    assert mamba_ssm_dtype("auto") == "float32"
    assert mamba_ssm_dtype("auto", "bfloat16") == "bfloat16"
    assert mamba_ssm_dtype("float32", "bfloat16") == "float32"  # an explicit option wins
    with pytest.raises(ValueError, match="mamba_ssm_dtype must be one of"):
        mamba_ssm_dtype("fp8")
    with pytest.raises(ValueError, match="checkpoint's mamba_ssm_dtype"):
        mamba_ssm_dtype("auto", "int8")


@pytest.mark.parametrize("key,where", [("mamba_ssm_dtype", "text_config"), ("mamba_ssm_cache_dtype", "top")])
def test_engine_reads_the_checkpoint_config_when_auto(tmp_path, key, where):
    """Qwen3.5 checkpoints write mamba_ssm_dtype (multimodal ones under text_config), NemotronH
    mamba_ssm_cache_dtype: with mamba_ssm_dtype "auto" the engine stores what they name."""
    from umem_jax.engine import state_dtype
    from umem_jax.engine.config import EngineConfig

    d = copy_fixture(tmp_path, "qwen3_5_tiny")
    cfg = json.loads((d / "config.json").read_text())
    if where == "top":
        cfg[key] = "torch.bfloat16"
    else:
        cfg["text_config"] = {key: "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg))
    assert state_dtype.checkpoint_ssm_dtype(d) == "bfloat16"
    assert state_dtype.checkpoint_ssm_dtype(FIXTURES / "qwen3_5_tiny") is None
    assert state_dtype.resolve(EngineConfig(model=str(d)), None) == "bfloat16"
    assert state_dtype.resolve(EngineConfig(model=str(d), mamba_ssm_dtype="float32"), None) == "float32"
    assert state_dtype.resolve(EngineConfig(model=str(FIXTURES / "qwen3_5_tiny")), None) == "float32"
    with pytest.raises(ValueError, match="mamba_ssm_dtype"):
        EngineConfig(mamba_ssm_dtype="fp8")


def test_engine_serves_with_a_bf16_state():
    """LLM(..., mamba_ssm_dtype="bfloat16"): the engine's plan holds the bf16 state and greedy text
    comes out (the reference kernels on CPU); the CLI spells it --mamba-ssm-cache-dtype too."""
    from umem_jax import LLM, SamplingParams
    from umem_jax.cli import parser

    llm = LLM(str(FIXTURES / "nemotron_h_tiny"), mamba_ssm_dtype="bfloat16", max_num_seqs=2, arena_bytes=4 << 20,
              max_model_len=64, enable_prefix_caching=False)
    eng = llm.llm_engine
    rows = {t.tensor.name: t.planes for layer in eng.plan.state.state for t in layer}
    assert rows["ssm"] == 1
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    for flag in ("--mamba-ssm-dtype", "--mamba-ssm-cache-dtype"):  # SGLang's and vLLM's spellings
        assert parser().parse_args(["serve", "tiny", flag, "bfloat16"]).mamba_ssm_dtype == "bfloat16"
    assert parser().parse_args(["plan", "--mamba-ssm-cache-dtype", "bfloat16"]).mamba_ssm_dtype == "bfloat16"
