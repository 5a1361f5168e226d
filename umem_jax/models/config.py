"""Model configs: frozen dataclasses every family shares, and the config.json helpers they parse with.

One `ModelConfig` serves every family; a family that needs more fields subclasses it, and fields
a family does not use keep their defaults.  Everything is hashable, so a config can be a static
argument of a jitted function.  Each family parses its own config.json (`gemma3.gemma3_config`,
`nemotron_h.nemotron_h_config`, ...); registry.from_hf_config picks the family.

Layer types use the transformers 5.x names: "full_attention", "sliding_attention" and
"linear_attention", which transformers gives every recurrent layer (here a Mamba2 or a gated
DeltaNet mixer, each keeping one state per request).
"""

from __future__ import annotations

import dataclasses
import math

FULL = "full_attention"
SLIDING = "sliding_attention"
RECURRENT = "linear_attention"
LAYER_TYPES = (FULL, SLIDING, RECURRENT)

# transformers' legacy remap (configuration_utils._LEGACY_LAYER_TYPE_REMAP), plus the short forms.
LEGACY_LAYER_TYPES = {"attention": FULL, "full": FULL, "global": FULL, "sliding": SLIDING, "local": SLIDING,
                      "mamba": RECURRENT, "mamba2": RECURRENT}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type: inv_freq = 1 / (theta ** (2i / dim)), then per rope_type:
    "linear" divides it by `factor`; "yarn" (NTK-by-parts) blends it with inv_freq / factor over a
    ramp of dims set by beta_fast / beta_slow rotations in original_max_position_embeddings, and
    scales cos and sin by `attention_scaling` (layers.rope_inv_freq).  Field names are
    transformers' rope_parameters keys."""

    theta: float
    rope_type: str = "default"  # "default" | "linear" | "yarn"
    factor: float = 1.0
    # yarn only
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # floor / ceil the ramp's ends (transformers' default when the key is absent)
    attention_factor: float | None = None  # None: from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        if self.rope_type not in ("default", "linear", "yarn"):
            raise NotImplementedError(f"rope_type {self.rope_type!r} is not supported yet (default, linear and "
                                      "yarn are)")
        if self.rope_type == "yarn" and self.original_max_position_embeddings <= 0:
            raise ValueError("yarn RoPE needs original_max_position_embeddings (the pretraining context length)")

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (yarn's mscale; 1 otherwise), as transformers derives it."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return float(get_mscale(self.factor))


def rope_from_params(p: dict, theta: float, max_position_embeddings: int,
                     original_max_position_embeddings: int | None = None) -> RopeConfig:
    """One layer type's RoPE from its transformers parameters (a 5.x `rope_parameters` entry or a
    hub `rope_scaling` dict; `theta` when it names none).  yarn as transformers reads it: the
    pretraining length from the entry (else `original_max_position_embeddings`, a top-level key in
    some configs, else max_position_embeddings), and a missing factor from the two lengths' ratio."""
    kind = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", theta))
    if kind != "yarn":
        return RopeConfig(theta, kind, float(p.get("factor") or 1.0))
    original = int(p.get("original_max_position_embeddings") or original_max_position_embeddings
                   or max_position_embeddings)
    factor = p.get("factor")
    return RopeConfig(
        theta, "yarn", float(factor if factor is not None else max_position_embeddings / original),
        original_max_position_embeddings=original, beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0), truncate=bool(p.get("truncate", True)),
        attention_factor=p.get("attention_factor"), mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"))


def rope_to_params(r: RopeConfig) -> dict:
    """rope_from_params' inverse: a transformers 5.x `rope_parameters` entry."""
    out = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type != "default":
        out["factor"] = r.factor
    if r.rope_type == "yarn":
        out.update(original_max_position_embeddings=r.original_max_position_embeddings, beta_fast=r.beta_fast,
                   beta_slow=r.beta_slow, truncate=r.truncate)
        out.update({k: getattr(r, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                    if getattr(r, k) is not None})
    return out


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
    # The checkpoint's multi-token-prediction head (models/mtp.py): how many MTP layers config.json
    # declares (Qwen3.5 mtp_num_hidden_layers, NemotronH num_nextn_predict_layers; 0: none) and the
    # layer types one of them runs, in order (Qwen3.5: one full-attention decoder layer).
    mtp_num_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}; known: {list(LAYER_TYPES)}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if RECURRENT in self.layer_types and self.mamba is None:
            raise ValueError("linear_attention (Mamba2) layers need a MambaConfig")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for(self, layer_type: str) -> RopeConfig | None:
        """The RoPE of a layer type (None: no positional encoding; a family may say so)."""
        for name, r in self.rope:
            if name == layer_type:
                return r
        raise KeyError(f"no RoPE parameters for {layer_type}")

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


# ----------------------------------------------------------------------------- config.json helpers


def text_config(d: dict) -> dict:
    """A multimodal wrapper's text decoder fields (its `text_config`, with the wrapper's tying,
    dtype and architectures carried in); a plain decoder's dict as it is."""
    if "text_config" not in d:
        return d
    text = dict(d["text_config"])
    text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", True))
    for k in ("dtype", "torch_dtype"):
        if k in d and k not in text:
            text[k] = d[k]
    text["architectures"] = d.get("architectures") or []
    return text


def weight_dtype(d: dict) -> str:
    """The checkpoint's weight dtype (5.x `dtype` or hub `torch_dtype`), checked."""
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported weight dtype {name}")
    return name


def int_or_tuple(x):
    """A token id, or a JSON list of them as a (hashable) tuple."""
    return tuple(x) if isinstance(x, list) else x
