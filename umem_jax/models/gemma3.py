"""Gemma 3 text decoder (`gemma3_text`): 5 sliding-window layers to 1 global, q/k norm, sandwich norms.

    h = E[ids] * sqrt(d)                       (the scale cast to the weight dtype first)
    per layer:  h += post_attn_norm(attn(input_norm(h)))
                h += post_ffw_norm(mlp(pre_ffw_norm(h)))
    logits = final_norm(h) E^T                  (tied), optionally softcapped

Parameter paths match the checkpoint names with the `model.` prefix dropped
(`layers.3.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`
when untied), so loading is a rename.

config.json: the 5.x keys (`layer_types`, `rope_parameters` keyed by layer type, `dtype`) and the
hub's older spellings (`sliding_window_pattern`, `rope_theta` + `rope_local_base_freq` +
`rope_scaling`, `torch_dtype`) both parse; `gemma3_config_to_dict` writes the 5.x form back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Attention
from .causal_lm import CausalLM, ResidualLayer
from .config import (FULL, LEGACY_LAYER_TYPES, SLIDING, ModelConfig, RopeConfig, int_or_tuple, rope_from_params,
                     rope_to_params, weight_dtype)
from .layers import MLP, RMSNorm

ARCHITECTURE = "Gemma3ForCausalLM"

# ----------------------------------------------------------------------------- config.json


def _layer_types(d: dict) -> tuple[str, ...]:
    n = d.get("num_hidden_layers", 26)
    if d.get("layer_types") is not None:
        types = tuple(LEGACY_LAYER_TYPES.get(t, t) for t in d["layer_types"])
    else:
        # Hub files: layer i is global iff (i + 1) % pattern == 0 (pattern 6 when absent).
        pattern = d.get("sliding_window_pattern") or 6
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    return types


def _rope(d: dict) -> tuple[tuple[str, RopeConfig], ...]:
    params = d.get("rope_parameters")
    if params and (FULL in params or SLIDING in params):  # 5.x: keyed by layer type
        full, local = params.get(FULL), params.get(SLIDING)
    else:  # hub: rope_theta (global), rope_local_base_freq (local), rope_scaling (global only)
        full = dict(params or {})
        full.update(d.get("rope_scaling") or {})
        local = None
    max_pos, original = d.get("max_position_embeddings", 131_072), d.get("original_max_position_embeddings")
    return ((FULL, rope_from_params(dict(full or {}), d.get("rope_theta", 1_000_000.0), max_pos, original)),
            (SLIDING, rope_from_params(dict(local or {}), d.get("rope_local_base_freq", 10_000.0), max_pos, original)))


def gemma3_config(d: dict) -> ModelConfig:
    """A `gemma3_text` config.json dict (a multimodal wrapper's text_config already unwrapped) -> config."""
    if d.get("use_bidirectional_attention"):
        raise NotImplementedError("Gemma 3 with use_bidirectional_attention (an encoder) is not a decoder we serve")
    if d.get("attention_bias"):
        raise NotImplementedError("Gemma 3 with attention_bias=True is not supported")
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=d.get("vocab_size", 262_208),
        hidden_size=d.get("hidden_size", 2304),
        intermediate_size=d.get("intermediate_size", 9216),
        num_heads=d.get("num_attention_heads", 8),
        num_kv_heads=d.get("num_key_value_heads", 4),
        head_dim=d.get("head_dim") or 256,
        layer_types=_layer_types(d),
        sliding_window=d.get("sliding_window", 4096),
        rope=_rope(d),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        # Read but never applied by transformers' Gemma 3 (Gemma 2 applied it; Gemma 3's released
        # configs set null): a checkpoint trained there computed without it, so it is ignored here too.
        attn_logit_softcapping=None,
        final_logit_softcapping=d.get("final_logit_softcapping"),
        hidden_activation=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        tie_word_embeddings=d.get("tie_word_embeddings", True),
        dtype=weight_dtype(d),
        bos_token_id=d.get("bos_token_id", 2),
        eos_token_id=int_or_tuple(d.get("eos_token_id", 1)),
        pad_token_id=d.get("pad_token_id", 0),
        max_position_embeddings=d.get("max_position_embeddings", 131_072),
    )


def gemma3_config_to_dict(cfg: ModelConfig) -> dict:
    """A transformers 5.x config.json dict (gemma3_config's inverse), so a converted checkpoint
    loads in transformers too."""
    rope = {name: rope_to_params(r) for name, r in cfg.rope}
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    return {
        "architectures": [ARCHITECTURE], "model_type": "gemma3_text", "vocab_size": cfg.vocab_size,
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


def gemma3_4b_like(dtype: str = "bfloat16") -> ModelConfig:
    """Gemma-3-4B's text decoder shape: 34 layers (5 sliding w=1024 : 1 global), hidden 2560, GeGLU
    10240, 8 q / 4 kv heads x 256, vocab 262144, tied, 128K positions (global RoPE linear x8).
    For benchmarks with random weights (registry.build_random) and its memory preset."""
    return gemma3_config({
        "architectures": [ARCHITECTURE], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 131072, "dtype": dtype})


# ----------------------------------------------------------------------------- the model


class DecoderLayer(ResidualLayer):
    """One Gemma 3 block: attention then MLP, each wrapped in a pre- and a post-norm."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        dtype, d, eps = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, cfg.intermediate_size, cfg.hidden_activation, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = RMSNorm(d, eps=eps, dtype=dtype)

    @property
    def mixer(self) -> Attention:
        return self.self_attn

    def post_mixer(self, a: jax.Array) -> jax.Array:
        return self.post_attention_layernorm(a)

    def ffn(self, h: jax.Array, a: jax.Array) -> jax.Array:
        h, x = self.pre_feedforward_layernorm.add(h, a)
        return h + self.post_feedforward_layernorm(self.mlp(x))


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 blocks in the shared decoder, embeddings scaled by sqrt(d)."""

    scale_embeddings = True

    def make_layer(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return DecoderLayer(cfg, layer, rngs=rngs)


__all__ = ["ARCHITECTURE", "DecoderLayer", "Gemma3ForCausalLM", "gemma3_4b_like", "gemma3_config",
           "gemma3_config_to_dict"]
