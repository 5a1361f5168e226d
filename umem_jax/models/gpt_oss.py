"""gpt-oss text decoder (`gpt_oss`: gpt-oss-20b / 120b): sliding and full attention alternating,
attention sinks, a top-k-then-softmax MoE of clamped-SwiGLU experts in every layer.

    h = E[ids]
    per layer:  h = h + attn(RMSNorm(h))       sliding_attention (window 128) on even layers,
                                               full_attention on odd ones
                h = h + MoE(RMSNorm(h))
    logits = RMSNorm(h) W_lm^T                  (untied)

Attention: 64 q / 8 kv heads x 64 with biases on q/k/v/o, yarn RoPE (theta 150000, factor 32 over
an original 4096 context; cos and sin times yarn's attention factor), scale head_dim^-0.5, and a
learned logit per q head (`sinks`) that joins the softmax denominator only.  RMSNorm is the plain
x_hat * w.  MoE (moe.py): router logits x W^T + b, top-k of the logits, softmax over those k;
expert j: down(clamped_swiglu(x W_gu + b_gu)) + b_down with gate = min(g, 7), up = clip(u, -7, 7),
out = (up + 1) * gate * sigmoid(1.702 * gate).

Checkpoint -> parameters (`checkpoint_to_params`): the router `mlp.router.*` is our `mlp.gate.*`;
the experts' gate and up columns are interleaved in the checkpoint (gate = [..., ::2], up =
[..., 1::2]) and concatenated in ours (gate | up); the hub checkpoints keep the expert weights in
MXFP4 (`*_blocks` uint8: two e2m1 values a byte, 32 values a block along the input dim;
`*_scales` uint8 e8m0: the block's power of two, biased by 127; mxfp4.py), dequantised here into
the model dtype, layer by layer.  Everything else is the checkpoint's name without `model.`.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from .attention import Attention
from .causal_lm import CausalLM, ResidualLayer
from .config import (FULL, LEGACY_LAYER_TYPES, SLIDING, ModelConfig, RopeConfig, int_or_tuple, rope_from_params,
                     weight_dtype)
from .layers import RMSNorm
from .moe import MoE, MoEConfig
from .mxfp4 import dequantize_mxfp4

ARCHITECTURE = "GptOssForCausalLM"


@dataclasses.dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    """ModelConfig plus the MoE block and whether the attention projections carry biases."""

    moe: MoEConfig | None = None
    attention_bias: bool = True

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            raise ValueError(f"gpt-oss layer types must be {FULL} or {SLIDING}, got {bad}")
        super().__post_init__()
        if self.moe is None:
            raise ValueError("gpt-oss needs its MoEConfig (every layer's MLP is a mixture of experts)")


# ----------------------------------------------------------------------------- config.json


def _rope(d: dict) -> RopeConfig:
    """rope_parameters (5.x) or rope_scaling + rope_theta (the hub's 4.x config.json); transformers'
    gpt-oss default (yarn x32 over 4096, untruncated) when neither is given."""
    p = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if FULL in p or SLIDING in p:
        raise NotImplementedError("gpt-oss with RoPE parameters per layer type is not supported (one RoPE for "
                                  "every layer is)")
    if not p:
        p = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
             "original_max_position_embeddings": 4096}
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ("default", "linear", "yarn"):
        raise NotImplementedError(f"gpt-oss rope_type {kind!r} is not supported (yarn, default and linear are)")
    return rope_from_params(p, d.get("rope_theta", 150_000.0), d.get("max_position_embeddings", 131072),
                            d.get("original_max_position_embeddings"))


def _check_quantization(d: dict) -> None:
    q = d.get("quantization_config")
    if q and q.get("quant_method") != "mxfp4":
        raise NotImplementedError(f"gpt-oss quantization {q.get('quant_method')!r} is not supported (MXFP4 expert "
                                  "weights are, dequantised at load)")


def _dtype(d: dict) -> str:
    """The hub's config.json names no dtype; its tensors are bf16 (and MXFP4 experts), not the fp32
    that transformers (and weight_dtype) would assume."""
    return weight_dtype(d) if (d.get("dtype") or d.get("torch_dtype")) else "bfloat16"


def gpt_oss_config(d: dict) -> GptOssConfig:
    """A `gpt_oss` config.json dict -> config (transformers' GptOssConfig defaults where a key is absent)."""
    _check_quantization(d)
    n = d.get("num_hidden_layers", 36)
    if d.get("layer_types") is not None:
        types = tuple(LEGACY_LAYER_TYPES.get(t, t) for t in d["layer_types"])
    else:  # transformers' default: sliding on even layers, full on odd ones
        types = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    experts = d.get("num_local_experts", d.get("num_experts", 128))
    top_k = d.get("num_experts_per_tok", d.get("experts_per_token", 4))
    intermediate = d.get("intermediate_size", 2880)
    moe = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=intermediate, scoring="topk_softmax",
                    router_bias=True, expert_kind="gpt_oss", expert_bias=True,
                    swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))
    heads = d.get("num_attention_heads", 64)
    hidden = d.get("hidden_size", 2880)
    return GptOssConfig(
        architecture=ARCHITECTURE, vocab_size=d.get("vocab_size", 201088), hidden_size=hidden,
        intermediate_size=intermediate, num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads, layer_types=types, sliding_window=d.get("sliding_window", 128),
        rope=((FULL, _rope(d)), (SLIDING, _rope(d))), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
        hidden_activation=d.get("hidden_act", "silu"), tie_word_embeddings=d.get("tie_word_embeddings", False),
        dtype=_dtype(d), bos_token_id=d.get("bos_token_id"), eos_token_id=int_or_tuple(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"), max_position_embeddings=d.get("max_position_embeddings", 131072),
        moe=moe, attention_bias=d.get("attention_bias", True),
    )


def gpt_oss_20b_like(dtype: str = "bfloat16") -> GptOssConfig:
    """gpt-oss-20b's shape (its hub config.json): 24 layers alternating sliding (window 128) and
    full attention, 64 q / 8 kv heads x 64, hidden 2880, 32 experts top-4 of intermediate 2880,
    vocab 201088, yarn RoPE (theta 150000, x32 over 4096), sinks; about 20.9B parameters.  For
    benchmarks with random weights (registry.build_random) and its memory preset."""
    return gpt_oss_config({
        "architectures": [ARCHITECTURE], "model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "attention_bias": True,
        "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999, "dtype": dtype})


# ----------------------------------------------------------------------------- checkpoint -> parameters


def _np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _deinterleave(x: np.ndarray, axis: int) -> np.ndarray:
    """gate/up interleaved along `axis` (g0 u0 g1 u1 ...) -> concatenated (g0 g1 ... | u0 u1 ...)."""
    x = np.asarray(x)
    even = np.take(x, np.arange(0, x.shape[axis], 2), axis=axis)
    odd = np.take(x, np.arange(1, x.shape[axis], 2), axis=axis)
    return np.concatenate([even, odd], axis=axis)


_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.)(router|experts)\.(.+)$")


def _convert_experts(prefix: str, tensors: dict, dtype) -> dict:
    """One layer's `mlp.experts.*` (plain [E, d, 2I] interleaved, or MXFP4 blocks/scales [E, rows,
    G, 16] / [E, rows, G] with rows the output features) -> our `mlp.experts.*`."""
    out = {}
    for proj in ("gate_up_proj", "down_proj"):
        name = f"{prefix}experts.{proj}"
        gate_up = proj == "gate_up_proj"
        if f"{name}_blocks" in tensors or f"{name}_scales" in tensors:
            blocks, scales = tensors.pop(f"{name}_blocks", None), tensors.pop(f"{name}_scales", None)
            if blocks is None or scales is None:
                raise KeyError(f"{name}: MXFP4 needs both {proj}_blocks and {proj}_scales")
            blocks, scales = np.asarray(blocks), np.asarray(scales)
            if gate_up:  # de-interleave the output rows before dequantising: uint8, cheap
                blocks, scales = _deinterleave(blocks, 1), _deinterleave(scales, 1)
            out[name] = dequantize_mxfp4(blocks, scales, dtype)  # [E, in, out], as our experts hold it
        elif name in tensors:
            w = tensors.pop(name)
            out[name] = _deinterleave(w, -1) if gate_up else w
        if f"{name}_bias" in tensors:
            b = tensors.pop(f"{name}_bias")
            out[f"{name}_bias"] = _deinterleave(b, -1) if gate_up else b
    return out


class GptOssDecoderLayer(ResidualLayer):
    """h + attn(input_norm(h)), then h + MoE(post_attention_norm(h)); plain (x_hat * w) RMSNorms."""

    def __init__(self, cfg: GptOssConfig, layer: int, *, rngs: nnx.Rngs):
        dtype, d, eps = jnp.dtype(cfg.dtype), cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps=eps, offset=0.0, dtype=dtype)
        self.self_attn = Attention(cfg, layer, qk_norm=False, bias=cfg.attention_bias, sinks=True, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, offset=0.0, dtype=dtype)
        self.mlp = MoE(d, cfg.moe, dtype=dtype, rngs=rngs)

    @property
    def mixer(self) -> Attention:
        return self.self_attn

    def ffn(self, h: jax.Array, a: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        h, x = self.post_attention_layernorm.add(h, a)
        return h + self.mlp(x, valid)  # padding tokens take no expert rows

    def dense(self, h: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
        return self.ffn(h, self.self_attn.dense(self.input_layernorm(h), positions, valid), valid)

    def __call__(self, h: jax.Array, arena: jax.Array, batch, slot):
        a, arena = self.self_attn(self.input_layernorm(h), arena, batch, slot)
        return self.ffn(h, a, batch.valid()), arena


class GptOssForCausalLM(CausalLM):
    """gpt-oss layers in the shared decoder (embed_tokens, layers, norm, lm_head; plain final norm)."""

    final_norm_offset = 0.0

    def make_layer(self, cfg: GptOssConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return GptOssDecoderLayer(cfg, layer, rngs=rngs)

    @classmethod
    def checkpoint_to_params(cls, cfg: GptOssConfig, tensors: dict) -> dict:
        """Router renamed, experts' gate/up de-interleaved, MXFP4 experts dequantised (into
        cfg.dtype, one layer at a time); every other tensor as it is."""
        dtype = _np_dtype(cfg.dtype)
        tensors = dict(tensors)
        out = {}
        for name in sorted(tensors):
            if name not in tensors:  # taken with its layer's experts already
                continue
            m = _EXPERT.match(name)
            if m is None:
                out[name] = tensors.pop(name)
            elif m.group(2) == "router":
                out[f"{m.group(1)}gate.{m.group(3)}"] = tensors.pop(name)
            else:
                out.update(_convert_experts(m.group(1), tensors, dtype))
                if name in tensors:  # an expert tensor neither plain nor MXFP4: left for the loader to name
                    out[name] = tensors.pop(name)
        return out


__all__ = ["ARCHITECTURE", "GptOssConfig", "GptOssDecoderLayer", "GptOssForCausalLM", "gpt_oss_20b_like",
           "gpt_oss_config"]
