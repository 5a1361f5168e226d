"""Model configs: frozen dataclasses, and the normaliser that reads Hugging Face config.json.

One `ModelConfig` serves every family here (Gemma 3 text, the built-in tiny hybrid); fields a
family does not use keep their defaults.  Everything is hashable, so a config can be a static
argument of a jitted function.

Layer types use the transformers 5.x names: "full_attention", "sliding_attention" and
"linear_attention" (a Mamba2 state layer).  Hub files still carry older spellings
(`sliding_window_pattern`, `rope_theta` + `rope_local_base_freq` + `rope_scaling`, `torch_dtype`,
layer types "attention" / "mamba", a multimodal `text_config`); `from_hf_config` maps them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

FULL = "full_attention"
SLIDING = "sliding_attention"
MAMBA = "linear_attention"
LAYER_TYPES = (FULL, SLIDING, MAMBA)

# transformers' legacy remap (configuration_utils._LEGACY_LAYER_TYPE_REMAP), plus the short forms.
_LEGACY_LAYER_TYPES = {"attention": FULL, "full": FULL, "global": FULL, "sliding": SLIDING, "local": SLIDING,
                       "mamba": MAMBA, "mamba2": MAMBA}

_GEMMA3_ARCHS = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3TextModel")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type: inv_freq = 1 / (theta ** (2i / dim)) / factor."""

    theta: float
    rope_type: str = "default"  # "default" | "linear"
    factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ("default", "linear"):
            raise NotImplementedError(f"rope_type {self.rope_type!r} is not supported yet (default and linear are)")


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """Mamba2 mixer geometry (NemotronH / Bamba naming)."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 16


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    rope: tuple[tuple[str, RopeConfig], ...] = ()  # (layer type, rope) pairs; a tuple so it hashes
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    dtype: str = "float32"  # weights and activations
    bos_token_id: int | None = 2
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = 0
    max_position_embeddings: int = 131072
    mamba: MambaConfig | None = None

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}; known: {list(LAYER_TYPES)}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if MAMBA in self.layer_types and self.mamba is None:
            raise ValueError("linear_attention (Mamba2) layers need a MambaConfig")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for(self, layer_type: str) -> RopeConfig:
        for name, r in self.rope:
            if name == layer_type:
                return r
        raise KeyError(f"no RoPE parameters for {layer_type}")

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


def _layer_types(d: dict) -> tuple[str, ...]:
    n = d["num_hidden_layers"]
    if d.get("layer_types") is not None:
        types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in d["layer_types"])
    else:
        # Gemma 3 legacy: layer i is global iff (i + 1) % pattern == 0 (pattern 6 when absent).
        pattern = d.get("sliding_window_pattern") or 6
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    return types


def _rope_entry(p: dict | None, default_theta: float) -> RopeConfig:
    p = dict(p or {})
    kind = p.get("rope_type", p.get("type", "default"))
    return RopeConfig(float(p.get("rope_theta", default_theta)), kind, float(p.get("factor", 1.0)))


def _gemma3_rope(d: dict) -> tuple[tuple[str, RopeConfig], ...]:
    params = d.get("rope_parameters")
    if params and (FULL in params or SLIDING in params):  # 5.x: keyed by layer type
        full, local = params.get(FULL), params.get(SLIDING)
    else:  # hub: rope_theta (global), rope_local_base_freq (local), rope_scaling (global only)
        full = dict(params or {})
        full.update(d.get("rope_scaling") or {})
        local = None
    global_theta = d.get("rope_theta", 1_000_000.0)
    local_theta = d.get("rope_local_base_freq", 10_000.0)
    return ((FULL, _rope_entry(full, global_theta)), (SLIDING, _rope_entry(local, local_theta)))


def _dtype(d: dict) -> str:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported weight dtype {name}")
    return name


def _tuple_or_int(x):
    return tuple(x) if isinstance(x, list) else x


def from_hf_config(d: dict) -> ModelConfig:
    """Normalise a config.json dict (5.x or hub style) into a ModelConfig.

    Raises NotImplementedError naming the architecture when it is not one this package runs.
    """
    archs = d.get("architectures") or []
    arch = archs[0] if archs else None
    if "text_config" in d:  # multimodal wrapper: the text decoder's fields are nested
        text = dict(d["text_config"])
        text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", True))
        for k in ("dtype", "torch_dtype"):
            if k in d and k not in text:
                text[k] = d[k]
        text["architectures"] = archs
        d = text
    model_type = d.get("model_type")
    if arch in _GEMMA3_ARCHS or model_type in ("gemma3_text", "gemma3"):
        return _gemma3_config(d)
    if arch == "UmemTinyHybrid" or model_type == "umem_tiny_hybrid":
        from .tiny import tiny_config_from_dict  # the tiny model owns its own (de)serialisation
        return tiny_config_from_dict(d)
    if arch == "NemotronHForCausalLM" or model_type == "nemotron_h":
        from .nemotron_h import nemotron_h_config  # the family parses its own config.json fields
        return nemotron_h_config(d)
    if str(arch).startswith("Qwen3_5") or str(model_type).startswith("qwen3_5"):
        from .qwen3_5 import qwen3_5_config  # (it refuses the MoE variants by name)
        return qwen3_5_config(d)
    from .registry import supported_architectures

    raise NotImplementedError(
        f"architecture {arch or model_type!r} is not supported; supported: {', '.join(supported_architectures())}"
    )


def _gemma3_config(d: dict) -> ModelConfig:
    if d.get("use_bidirectional_attention"):
        raise NotImplementedError("Gemma 3 with use_bidirectional_attention (an encoder) is not a decoder we serve")
    if d.get("attention_bias"):
        raise NotImplementedError("Gemma 3 with attention_bias=True is not supported")
    hidden = d.get("hidden_size", 2304)
    heads = d.get("num_attention_heads", 8)
    return ModelConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=d.get("vocab_size", 262_208),
        hidden_size=hidden,
        intermediate_size=d.get("intermediate_size", 9216),
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads", 4),
        head_dim=d.get("head_dim") or 256,
        layer_types=_layer_types({"num_hidden_layers": 26, **d}),
        sliding_window=d.get("sliding_window", 4096),
        rope=_gemma3_rope(d),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        tie_word_embeddings=d.get("tie_word_embeddings", True),
        dtype=_dtype(d),
        bos_token_id=d.get("bos_token_id", 2),
        eos_token_id=_tuple_or_int(d.get("eos_token_id", 1)),
        pad_token_id=d.get("pad_token_id", 0),
        max_position_embeddings=d.get("max_position_embeddings", 131_072),
    )


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read `path/config.json` (or `path` itself when it is the file)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    return from_hf_config(json.loads(p.read_text()))


def to_hf_config(cfg: ModelConfig) -> dict:
    """A transformers 5.x config.json dict for a Gemma 3 config (from_hf_config's inverse), so a
    converted checkpoint loads in transformers too."""
    if cfg.architecture != "Gemma3ForCausalLM":
        raise NotImplementedError(f"to_hf_config: {cfg.architecture}")
    rope = {name: {"rope_type": r.rope_type, "rope_theta": r.theta, **({"factor": r.factor} if r.rope_type == "linear" else {})}
            for name, r in cfg.rope}
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window, "rope_parameters": rope, "rms_norm_eps": cfg.rms_norm_eps,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar, "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping, "hidden_activation": cfg.hidden_activation,
        "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": cfg.dtype, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos, "pad_token_id": cfg.pad_token_id,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
