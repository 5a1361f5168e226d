"""models/checkpoint.py: safetensors files read one tensor at a time give exactly what the
safetensors library gives (names, dtypes, shapes, bytes), for every dtype a checkpoint ships."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from umem_jax.models.checkpoint import header, read_safetensors


def _tensors(rng) -> dict[str, np.ndarray]:
    return {
        "model.embed_tokens.weight": rng.standard_normal((37, 8)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((8, 5)).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.k_scale": np.asarray(0.5, np.float32),  # a scalar: shape ()
        "model.norm.weight": rng.standard_normal(8).astype(np.float16),
        "model.experts.blocks": rng.integers(0, 255, (3, 2, 16), dtype=np.uint8),
        "model.ids": rng.integers(-5, 5, 6).astype(np.int64),
        "mtp.fc.weight": rng.standard_normal((2, 2)).astype(np.float32),
    }


def test_every_tensor_equals_the_librarys(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file(_tensors(np.random.default_rng(0)), str(f), metadata={"format": "pt"})
    got = read_safetensors(f)
    with safe_open(str(f), framework="flax") as fh:
        names = sorted(fh.keys())  # noqa: SIM118
        want = {k: fh.get_tensor(k) for k in names}
    assert sorted(got) == names
    for k in names:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(np.asarray(got[k]).reshape(-1).view(np.uint8),
                                      np.asarray(want[k]).reshape(-1).view(np.uint8))
    head, base = header(f)
    assert "__metadata__" not in head and base > 8


def test_rename_keeps_and_skips(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file(_tensors(np.random.default_rng(1)), str(f))
    got = read_safetensors(f, lambda k: None if k.startswith("mtp.") else k.removeprefix("model."))
    assert "fc.weight" not in got and "mtp.fc.weight" not in got
    assert set(got) == {k.removeprefix("model.") for k in _tensors(np.random.default_rng(1)) if not k.startswith("mtp.")}


def _write(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file by the format's layout (for dtypes the library's numpy API cannot write)."""
    head, blobs, at = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        head[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_fp8_tensors_keep_their_bytes(tmp_path):
    rng = np.random.default_rng(2)
    e4m3 = rng.standard_normal((4, 6)).astype(ml_dtypes.float8_e4m3fn)
    e5m2 = rng.standard_normal(5).astype(ml_dtypes.float8_e5m2)
    f = tmp_path / "fp8.safetensors"
    _write(f, {"k": ("F8_E4M3", e4m3), "v": ("F8_E5M2", e5m2)})
    got = read_safetensors(f)
    assert got["k"].dtype == e4m3.dtype and got["v"].dtype == e5m2.dtype
    np.testing.assert_array_equal(np.asarray(got["k"]).view(np.uint8), e4m3.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got["v"]).view(np.uint8), e5m2.view(np.uint8))


def test_a_dtype_it_cannot_read_is_named(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"w": np.zeros(2, np.float32)}, str(f))
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = raw[8:8 + n].replace(b'"F32"', b'"F4X"')  # same length: the offsets stay right
    f.write_bytes(raw[:8] + head + raw[8 + n:])
    with pytest.raises(ValueError, match="tensor w has dtype F4X"):
        read_safetensors(f)
