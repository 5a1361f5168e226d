"""Tiny checkpoints with MTP weights for the speculative method "mtp" tests: a copy of a committed
family fixture (tests/fixtures/<name>) whose config.json declares one MTP layer and whose
model.safetensors gains random `mtp.*` tensors under the checkpoint's own names and layouts
(Qwen: fused experts [E, 2I, d] / [E, d, I]; NemotronH: enorm / hnorm / eh_proj /
final_layernorm, `shared_experts`, fused experts [E, I, d] / [E, d, I]).  Made in the test's
temporary directory, never committed: the committed fixtures stay as transformers wrote them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

FIXTURES = Path(__file__).parent / "fixtures"
# config.json keys that declare one MTP layer, per fixture family
_DECLARE = {"nemotron": {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"]},
            "qwen": {"mtp_num_hidden_layers": 1}}


def _checkpoint_name(path: str, nemotron: bool, last: int) -> str:
    """Our MTP parameter path -> the checkpoint's name (without the mtp. prefix)."""
    if nemotron:
        path = {"pre_fc_norm_embedding.weight": "layers.0.enorm.weight", "pre_fc_norm_hidden.weight":
                "layers.0.hnorm.weight", "fc.weight": "layers.0.eh_proj.weight",
                "norm.weight": f"layers.{last}.final_layernorm.weight"}.get(path, path)
        path = path.replace(".mixer.shared_expert.", ".mixer.shared_experts.")
    return path


def write_mtp_checkpoint(dest: Path, name: str, seed: int = 0) -> Path:
    """dest/<name>_mtp: the fixture `name` plus a random MTP head (module doc) -> its directory."""
    from safetensors.numpy import load_file, save_file

    from umem_jax.models import mtp
    from umem_jax.models.loader import load_model

    d = Path(dest) / f"{name}_mtp"
    if (d / "config.json").exists():
        return d
    shutil.copytree(FIXTURES / name, d)
    nemotron = name.startswith("nemotron")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(_DECLARE["nemotron" if nemotron else "qwen"])
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    target = load_model(d)  # reads no mtp.* yet (there are none)
    head = mtp.random_head(target, seed)
    rng = np.random.default_rng(seed)
    tensors = load_file(d / "model.safetensors")
    last = len(target.config.mtp_layer_types) - 1
    for path, var in nnx.to_flat_state(head.params):
        name_ = ".".join(map(str, path))
        if name_.endswith((".k_scale", ".v_scale")):
            continue  # absent: 1.0 (loader.kv_scales)
        a = np.asarray(jax.device_get(var.get_value()), np.float32)
        if a.ndim == 1:  # norms: random, not their init, so a wrong offset or order shows
            a = a + 0.2 * rng.standard_normal(a.shape).astype(np.float32)
        else:  # larger than the 0.02 init, so the head's attention and experts matter
            a = a * 5.0
        if name_.endswith(("experts.gate_up_proj", "experts.down_proj", "experts.up_proj")):
            a = np.swapaxes(a, 1, 2)  # ours (in, out) -> the fused checkpoint layout (out, in)
        tensors["mtp." + _checkpoint_name(name_, nemotron, last)] = np.ascontiguousarray(a)
    save_file(tensors, d / "model.safetensors")
    return d


__all__ = ["FIXTURES", "write_mtp_checkpoint"]
