"""The architecture table: what a checkpoint's config.json names -> the model class and its config parser.

Keys are the names config.json lists under `architectures` (and the built-in "UmemTinyHybrid").
Each class is an nnx.Module built as `cls(config, rngs=...)` with `decls(config, kv_dtype)` and a
forward `module(arena, batch, plan)`; each parser takes the config.json dict (a multimodal
wrapper's `text_config` already unwrapped) and refuses, naming it, what the family does not serve.

    cfg = load_hf_config(path)                      # config.json -> the family's config
    module = model_class(cfg.architecture)(cfg, rngs=nnx.Rngs(0))
    model = build_random("qwen3.5-4b-like")         # a realistic shape with random weights
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from .config import ModelConfig, text_config
from .gemma3 import Gemma3ForCausalLM, gemma3_4b_like, gemma3_config, gemma3_config_to_dict
from .gpt_oss import GptOssForCausalLM, gpt_oss_20b_like, gpt_oss_config
from .model import Model
from .nemotron_h import NemotronHForCausalLM, nemotron_3_nano_30b_a3b_like, nemotron_h_8b_like, nemotron_h_config
from .qwen3_5 import Qwen3_5ForCausalLM, qwen3_5_4b_like, qwen3_5_config
from .qwen3_5_moe import Qwen3_5MoeForCausalLM, qwen3_5_35b_a3b_like, qwen3_5_moe_config
from .qwen3_next import Qwen3NextForCausalLM, qwen3_next_80b_a3b_like, qwen3_next_config
from .tiny import TinyHybrid, tiny_config_from_dict, tiny_config_to_dict


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_class: type
    parse_config: Callable[[dict], ModelConfig]  # config.json dict -> config
    config_to_dict: Callable[[ModelConfig], dict] | None = None  # its inverse, for save_pretrained


_GEMMA3 = Architecture(Gemma3ForCausalLM, gemma3_config, gemma3_config_to_dict)
_QWEN3_5 = Architecture(Qwen3_5ForCausalLM, qwen3_5_config)
_QWEN3_5_MOE = Architecture(Qwen3_5MoeForCausalLM, qwen3_5_moe_config)

ARCHITECTURES: dict[str, Architecture] = {
    "Gemma3ForCausalLM": _GEMMA3,
    # The multimodal Gemma 3 checkpoints (4b and up) carry the same text decoder.
    "Gemma3ForConditionalGeneration": _GEMMA3,
    "GptOssForCausalLM": Architecture(GptOssForCausalLM, gpt_oss_config),
    "UmemTinyHybrid": Architecture(TinyHybrid, tiny_config_from_dict, tiny_config_to_dict),
    "NemotronHForCausalLM": Architecture(NemotronHForCausalLM, nemotron_h_config),
    "Qwen3_5ForCausalLM": _QWEN3_5,
    # The multimodal Qwen3.5 checkpoints: the same text decoder under model.language_model.
    "Qwen3_5ForConditionalGeneration": _QWEN3_5,
    "Qwen3_5MoeForCausalLM": _QWEN3_5_MOE,
    "Qwen3_5MoeForConditionalGeneration": _QWEN3_5_MOE,  # Qwen3.5-35B-A3B etc.: text decoder only
    "Qwen3NextForCausalLM": Architecture(Qwen3NextForCausalLM, qwen3_next_config),
}

# Other names a config.json gives (as `architectures[0]` or `model_type`) -> the architecture
# whose parser reads it.
_CONFIG_NAMES = {
    "Gemma3TextModel": "Gemma3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
    "umem_tiny_hybrid": "UmemTinyHybrid",
    "gpt_oss": "GptOssForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def _unsupported(name) -> NotImplementedError:
    supported = ", ".join(supported_architectures())
    return NotImplementedError(f"architecture {name!r} is not supported; supported: {supported}")


def _architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise _unsupported(name)
    return ARCHITECTURES[name]


def model_class(architecture: str) -> type:
    return _architecture(architecture).model_class


# ----------------------------------------------------------------------------- config.json


def from_hf_config(d: dict) -> ModelConfig:
    """Normalise a config.json dict (5.x or hub style) into the family's config.

    Raises NotImplementedError naming the architecture when it is not one this package runs.
    """
    d = text_config(d)  # a multimodal wrapper: the text decoder's fields are nested
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    model_type = d.get("model_type")
    for name in (arch, model_type):
        name = _CONFIG_NAMES.get(name, name)
        if name in ARCHITECTURES:
            return ARCHITECTURES[name].parse_config(d)
    if arch is None and model_type is None:
        raise ValueError("config.json names no architecture: it has neither `architectures` nor `model_type`; "
                         f"supported: {', '.join(supported_architectures())}")
    raise _unsupported(arch or model_type)


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read `path/config.json` (or `path` itself when it is the file)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        raw = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not a JSON config: {e}") from None
    return from_hf_config(raw)


def config_to_dict(cfg: ModelConfig) -> dict:
    """The config.json content from_hf_config reads back as `cfg`."""
    write = _architecture(cfg.architecture).config_to_dict
    if write is None:
        raise NotImplementedError(f"writing a {cfg.architecture} config.json is not supported")
    return write(cfg)


# ------------------------------------------------------------------ random weights, real shapes

# Name -> config factory f(dtype) -> ModelConfig; presets.py gives the same names to their memory.
SHAPES: dict[str, Callable[..., ModelConfig]] = {
    "gemma3-4b-like": gemma3_4b_like,
    "gpt-oss-20b-like": gpt_oss_20b_like,
    "nemotronh-8b-like": nemotron_h_8b_like,
    "nemotron-3-nano-30b-a3b-like": nemotron_3_nano_30b_a3b_like,
    "qwen3.5-4b-like": qwen3_5_4b_like,
    "qwen3.5-35b-a3b-like": qwen3_5_35b_a3b_like,
    "qwen3-next-80b-a3b-like": qwen3_next_80b_a3b_like,
}


def random_shape_names() -> list[str]:
    return sorted(SHAPES)


def build_random(name_or_config, dtype: str = "bfloat16", *, seed: int = 0, abstract: bool = False) -> Model:
    """A Model of a realistic shape with random weights, for benchmarks (no checkpoint needed).

    name_or_config: a name from `random_shape_names()` or a ModelConfig.  The weights are made
    on the default device (an 8B model in bf16 is 16 GB: nothing goes through the host).
    abstract=True gives jax.ShapeDtypeStruct leaves instead (weight bytes for sizing, no memory).
    """
    import jax
    from flax import nnx

    if isinstance(name_or_config, str):
        if name_or_config not in SHAPES:
            raise ValueError(f"unknown model shape {name_or_config!r}; choose one of {sorted(SHAPES)}")
        cfg = SHAPES[name_or_config](dtype)
    else:
        cfg = dataclasses.replace(name_or_config, dtype=dtype)
    cls = model_class(cfg.architecture)
    # unsafe_rbg: one RNG op per weight instead of a hash expanded per weight; the values only
    # need to be random.
    build = lambda: cls(cfg, rngs=nnx.Rngs(jax.random.key(seed, impl="unsafe_rbg")))
    if abstract:
        graphdef, params = nnx.split(nnx.eval_shape(build))  # ShapeDtypeStruct leaves
        return Model(cfg, graphdef, params, cls)
    graphdef, params = nnx.split(build())  # eagerly: layers.normal_init says why
    return Model(cfg, graphdef, params, cls)


__all__ = [
    "ARCHITECTURES",
    "SHAPES",
    "Architecture",
    "build_random",
    "config_to_dict",
    "from_hf_config",
    "load_hf_config",
    "model_class",
    "random_shape_names",
    "supported_architectures",
]
