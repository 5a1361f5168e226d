"""Gemma 3 GGUF files (llama.cpp's) as Hugging Face directories: the metadata as a ModelConfig,
the tensors dequantised under our names, and the one-time conversion into config.json, fp32
model.safetensors and tokenizer.json that the loader caches (loader.convert_gguf)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .config import FULL, SLIDING, ModelConfig, RopeConfig
from .gemma3 import ARCHITECTURE as GEMMA3
from .gemma3 import gemma3_config_to_dict

# llama.cpp tensor names (per block) -> ours.
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _gguf_name(name: str) -> str:
    stem, _, leaf = name.rpartition(".")
    if stem.startswith("blk."):
        _, idx, part = stem.split(".", 2)
        if part not in _GGUF_BLOCK:
            raise KeyError(f"GGUF tensor {name}: unknown block tensor {part!r}")
        return f"layers.{idx}.{_GGUF_BLOCK[part]}.{leaf}"
    if stem not in _GGUF_TOP:
        raise KeyError(f"GGUF tensor {name}: unknown tensor")
    return f"{_GGUF_TOP[stem]}.{leaf}"


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    """Gemma 3 config from GGUF metadata, with the defaults transformers assumes for what GGUF omits."""
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (gemma3 is)")
    gemma3 = lambda key, default=None: _field(reader, f"gemma3.{key}", default)
    num_layers, hidden, heads = gemma3("block_count"), gemma3("embedding_length"), gemma3("attention.head_count")
    head_dim = gemma3("attention.key_length", hidden // heads)
    # An explicit attention.scale wins; else llama.cpp's rule: the 27B model (62 blocks) scales
    # queries by (d / heads) ** -0.5, the others by head_dim ** -0.5.
    scale = gemma3("attention.scale")
    query_pre_attn_scalar = float(scale) ** -2 if scale else (hidden // heads if num_layers == 62 else head_dim)
    scaling = gemma3("rope.scaling.type")
    factor = gemma3("rope.scaling.factor", 1.0)
    full_rope = RopeConfig(float(gemma3("rope.freq_base", 1e6)), "linear" if scaling == "linear" else "default",
                           float(factor) if scaling == "linear" else 1.0)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        architecture=GEMMA3, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=gemma3("feed_forward_length"), num_heads=heads,
        num_kv_heads=gemma3("attention.head_count_kv"), head_dim=head_dim,
        layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)),
        sliding_window=gemma3("attention.sliding_window", 4096),
        rope=((FULL, full_rope), (SLIDING, RopeConfig(10_000.0))),
        rms_norm_eps=float(gemma3("attention.layer_norm_rms_epsilon", 1e-6)),
        query_pre_attn_scalar=query_pre_attn_scalar,
        tie_word_embeddings=tied, bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", 2),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", 1),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", 0),
        max_position_embeddings=gemma3("context_length", 131072),
    )


def gguf_tensors(reader) -> dict[str, np.ndarray]:
    """Every tensor of a Gemma 3 GGUF as fp32 numpy under our parameter names: dequantised,
    dims reversed (GGUF lists ne0, the fastest dim, first), and the 1 that llama.cpp adds to
    every Gemma norm weight subtracted."""
    import gguf

    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
        if "norm" in t.name:
            w = w - 1.0
        tensors[_gguf_name(t.name)] = w
    return tensors


def convert_gguf(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Convert a Gemma 3 GGUF once into a Hugging Face directory (config.json, fp32
    model.safetensors, tokenizer.json built from the GGUF's vocabulary) at `out` and return it.

    Converting takes a while (dequantising, building the tokenizer's merges: ~15 s for the 270M
    model on 2 cores), so the result is kept: `out` is reused while it is complete (the loader's
    convert_gguf puts it in cache_dir()/<gguf stem>/).  transformers loads the directory too, which is what the parity tests
    compare against.  The file is read by gguf_file.GGUFFile, not gguf.GGUFReader, whose
    per-element parsing of the 262k-token vocabulary alone took ~30 s.
    """
    from safetensors.numpy import save_file

    from .gguf_file import GGUFFile

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(path)
    out = Path(out)
    done = out / ".complete"
    if done.exists():
        return out
    # One process converts at a time (a lock beside the folder: two test workers or two servers
    # starting at once), into a folder of its own renamed into place whole, so a reader never meets
    # half-written files and an interrupted conversion leaves nothing that passes for one.
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():  # converted by the process that held the lock before
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
        try:
            reader = GGUFFile(path)
            cfg = gguf_config(reader)
            tensors = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in gguf_tensors(reader).items()}
            save_file(tensors, str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text(json.dumps(gemma3_config_to_dict(cfg), indent=2))
            if "tokenizer.ggml.model" in reader.fields:
                from .tokenizer import write_gguf_tokenizer

                write_gguf_tokenizer(reader, tmp)
            (tmp / ".complete").write_text(str(path))
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users of a shared cache_dir
            shutil.rmtree(out, ignore_errors=True)  # an interrupted conversion's leftovers, if any
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
