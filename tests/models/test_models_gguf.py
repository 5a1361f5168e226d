"""The GGUF path without the 270M package: write the tiny Gemma 3 fixture as a llama.cpp-style
GGUF (llama.cpp names, norms stored +1, dims reversed, two tensors Q8_0) and load it back."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from umem_jax.models.loader import convert_gguf, load_gguf, load_model

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gemma3_tiny"
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"}
Q8 = ("attn_output", "ffn_down")  # in-dim 64: a whole number of Q8_0 blocks of 32


def _gguf_name(hf: str) -> str:
    name = hf.removeprefix("model.").removesuffix(".weight")
    if name == "embed_tokens":
        return "token_embd.weight"
    if name == "norm":
        return "output_norm.weight"
    _, i, rest = name.split(".", 2)
    return f"blk.{i}.{_BLOCK[rest]}.weight"


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """Write the fixture as a GGUF; return the weights a correct reader must recover (HF names)."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(6)
    w.add_context_length(512)
    w.add_embedding_length(48)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(8)
    w.add_rope_freq_base(1e6)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_float32("gemma3.attention.scale", 24 ** -0.5)  # the fixture's query_pre_attn_scalar
    w.add_token_list([f"<t{i}>" for i in range(128)])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    expect = {}
    for hf, arr in sorted(load_file(FIXTURE / "model.safetensors").items()):
        name = _gguf_name(hf)
        if "norm" in name:
            arr = arr + np.float32(1.0)  # llama.cpp stores Gemma norms as 1 + w
            expect[hf] = arr - np.float32(1.0)
            w.add_tensor(name, arr)
        elif name.split(".")[-2] in Q8:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expect[hf] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape)
        else:
            w.add_tensor(name, arr)
            expect[hf] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("UMEM_JAX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gemma3.gguf"
    return path, write_tiny_gguf(path)


def test_gguf_weights_dequantised_unshifted_and_unreversed(tiny_gguf):
    path, expect = tiny_gguf
    out = convert_gguf(path)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(expect)
    for name, want in expect.items():
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6, err_msg=name)


def test_gguf_model_matches_fixture_logits(tiny_gguf):
    path, _ = tiny_gguf
    m = load_gguf(path)
    ref = load_model(FIXTURE)
    assert m.config.layer_types == ref.config.layer_types
    assert m.config.rope == ref.config.rope and m.config.attn_scale == pytest.approx(ref.config.attn_scale)
    e = np.load(FIXTURE / "expected.npz")
    toks = np.concatenate([e["long_prompt"], e["long_greedy"]])[None]
    lg = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))[0]
    # Two matrices per layer went through Q8_0: close to the fp32 fixture, not equal.
    assert np.abs(lg - e["long_logits"]).max() / np.abs(e["long_logits"]).max() < 2e-2
    assert convert_gguf(path) == convert_gguf(path)  # cached: the second call converts nothing


def test_gguf_conversion_is_moved_into_place_whole(tiny_gguf):
    """Two conversions at once into one cache folder (two test workers, two servers starting) and an
    interrupted one's leftovers: the folder ends complete, with the same weights, and no partial
    folder is left beside it."""
    from concurrent.futures import ThreadPoolExecutor

    path, expect = tiny_gguf
    out = path.parent / "cache" / path.stem
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"half written")  # an interrupted conversion, no .complete
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda _: convert_gguf(path), range(2))) == [out, out]
    assert (out / ".complete").exists() and not list(out.parent.glob("*.partial-*"))
    got = load_file(out / "model.safetensors")
    for name, want in expect.items():
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6, err_msg=name)


def test_gguf_file_reads_what_gguf_py_reads(tmp_path):
    """gguf_file.GGUFFile (the converter's reader) against gguf-py's GGUFReader on a file with
    every metadata type and plain and quantised tensors: the same keys in order, the same
    contents() and types, the same tensor names, types, shapes and data."""
    from umem_jax.models.gguf_file import GGUFFile

    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float64("t.f64", 0.1)
    w.add_string("t.str", "h\u00e9llo \U0001f642")
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, 0.25])
    w.add_token_list(["<pad>", "\u2581a", "", "\u6570\u5b66"])
    w.add_token_types([3, 1, 1, 6])
    rng = np.random.default_rng()
    w.add_tensor("a.weight", rng.standard_normal((3, 5), dtype=np.float32))
    w.add_tensor("b.weight", rng.standard_normal((2, 7)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs, ours = gguf.GGUFReader(str(path)), GGUFFile(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # gguf-py's header pseudo-fields
    assert list(ours.fields) == keys and len(keys) == 17
    for k in keys:
        want, got = theirs.fields[k].contents(), ours.fields[k].contents()
        assert got == want and type(got) is type(want), (k, got, want)
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], k
        assert ours.fields[k].types == tuple(theirs.fields[k].types), k
    assert ours.data_offset == theirs.data_offset and len(ours.tensors) == len(theirs.tensors) == 3
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert a.shape.dtype == b.shape.dtype and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_gguf_other_architecture_is_refused(tmp_path):
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NotImplementedError, match="GGUF architecture 'llama'"):
        convert_gguf(path, tmp_path / "out")


def test_gemma_tokenizer_from_vocabulary():
    """SentencePiece BPE semantics on a toy vocabulary: rank = file order, spaces as "▁", space-only
    tokens respelled, control tokens special, user-defined tokens whole, byte fallback, <bos>."""
    from umem_jax.models.tokenizer import gemma_tokenizer

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\n\n", "  ", "▁", "a", "b", "ab", "▁ab", "▁a", "ba"]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types = [3, 3, 3, 3, 4, 4] + [1] * 7 + [6] * 256
    tok = gemma_tokenizer(tokens, types, bos_id=2, unk_id=3)
    v = {t: i for i, t in enumerate(tokens)}
    # "▁ab" outranks "ba" (it comes first), and the space-only token "  " is respelled "▁▁".
    assert tok.encode("ab ab").ids == [2, v["ab"], v["▁ab"]]
    assert tok.encode("aba").ids == [2, v["ab"], v["a"]]
    assert tok.encode("a\n\nb").ids == [2, v["a"], v["\n\n"], v["b"]]  # user-defined: matched whole
    assert tok.encode("<eos>").ids == [2, 1]  # control: special
    assert tok.encode("é").ids == [2, v["<0xC3>"], v["<0xA9>"]]  # byte fallback
    assert tok.decode(tok.encode("ab ab é").ids) == "ab ab é"
    assert tok.token_to_id("▁▁") == 5
