"""Qwen3-Next text decoder (`qwen3_next`; Qwen3-Next-80B-A3B, Qwen3-Coder-Next).

The same network as Qwen3.5-MoE (qwen3_5_moe.py: gated DeltaNet and gated attention 3 : 1,
zero-centred RMSNorms, GDN gated norm w * norm(o) * silu(z), per-head [q | gate] query
projection, partial RoPE, softmax top-k router, sigmoid-gated shared expert), with three
differences transformers 5.23 spells out:
  * which layers are sparse: layer i has the MoE block unless i is in `mlp_only_layers` or
    (i + 1) % decoder_sparse_step != 0; the others a dense SwiGLU MLP of intermediate_size;
  * `norm_topk_prob` (default true) decides whether the k router weights are renormalised;
  * the gated DeltaNet's input projections are fused per key head.  `in_proj_qkvz` [2*Hk*Dk +
    2*Hv*Dv, d] holds, for each key head g in turn, q_g [Dk] | k_g [Dk] | v_g [r*Dv] | z_g [r*Dv]
    (r = Hv / Hk: the value heads g*r .. g*r + r - 1), and `in_proj_ba` [2*Hv, d] per key head
    b_g [r] | a_g [r].  Qwen3.5 keeps q | k | v of all heads in `in_proj_qkv` (the conv's channel
    order, the same in both) and z, b, a apart.  `checkpoint_to_params` permutes the rows into
    the Qwen3.5 tensors, so the mixer (gdn_mixer.GatedDeltaNet), its kernels and its
    tensor-parallel split are Qwen3.5's, unchanged: the same products, only in another row order.
Experts: the hub stores one tensor per expert (qwen3_5_moe.stack_experts reads it and the fused form).
"""

from __future__ import annotations

import jax.numpy as jnp

from .qwen3_5 import Qwen3_5Config, qwen3_5_fields
from .qwen3_5_moe import Qwen3_5MoeForCausalLM, moe_config

ARCHITECTURE = "Qwen3NextForCausalLM"

# transformers 5.23's Qwen3NextConfig defaults.
_NEXT_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
                  "num_key_value_heads": 2, "rope_theta": 10_000.0, "num_experts": 512, "num_experts_per_tok": 10,
                  "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}


def qwen3_next_config(d: dict) -> Qwen3_5Config:
    """A `qwen3_next` config.json dict -> config (sparse layers by mlp_only_layers / decoder_sparse_step)."""
    fields = qwen3_5_fields(d, _NEXT_DEFAULTS)
    moe = moe_config({**_NEXT_DEFAULTS, **d}, norm_topk_prob=bool(d.get("norm_topk_prob", True)))
    return Qwen3_5Config(architecture=ARCHITECTURE, moe=moe, mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                         decoder_sparse_step=d.get("decoder_sparse_step", 1), **fields)


def qwen3_next_80b_a3b_like(dtype: str = "bfloat16") -> Qwen3_5Config:
    """Qwen3-Next-80B-A3B with random weights (registry.build_random): 48 layers, 12 x (3 gated
    DeltaNet (16 key / 32 value heads x 128) -> 1 gated attention (16 q / 2 kv heads x 256, RoPE on
    64 dims)), hidden 2048, every layer an MoE of 512 experts (intermediate 512), 10 routed + 1
    shared, vocab 151936, untied; about 79.7B parameters.

    Where the figures come from: layers, hidden size, layout, head geometries, RoPE dimension, 512
    experts / 10 routed + 1 shared / intermediate 512 and the 262144 native context are the
    Qwen3-Next-80B-A3B-Instruct model card's; the shared expert's 512, conv kernel 4, vocab 151936,
    decoder_sparse_step 1, norm_topk_prob true and intermediate_size 5120 (used by no layer: none is
    in mlp_only_layers) are the values a public inventory of the Qwen3-Coder-Next config.json (the
    same architecture, 80B-A3B) lists.  rope_theta is left at the parser's default: it shapes no
    weight or memory, and the 80B's own value is not established here."""
    return qwen3_next_config({
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False, "partial_rotary_factor": 0.25,
        "max_position_embeddings": 262144, "dtype": dtype})


def split_gdn_projections(tensors: dict, prefix: str, cfg: Qwen3_5Config) -> None:
    """Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` under `prefix` (e.g. "layers.0.linear_attn.") ->
    Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, in place (module docstring)."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = hv // hk
    missing = [prefix + n for n in ("in_proj_qkvz.weight", "in_proj_ba.weight") if prefix + n not in tensors]
    if missing:
        raise KeyError(f"missing {len(missing)} tensor(s) of Qwen3-Next's fused GDN projections: {', '.join(missing)}")
    qkvz = jnp.asarray(tensors.pop(prefix + "in_proj_qkvz.weight"))
    ba = jnp.asarray(tensors.pop(prefix + "in_proj_ba.weight"))
    d = qkvz.shape[-1]
    if qkvz.shape != (hk * (2 * dk + 2 * r * dv), d) or ba.shape != (2 * hv, d):
        raise ValueError(f"{prefix}in_proj_qkvz / in_proj_ba have shapes {tuple(qkvz.shape)} / {tuple(ba.shape)}; "
                         f"the config gives {(hk * (2 * dk + 2 * r * dv), d)} / {(2 * hv, d)}")
    per_head = qkvz.reshape(hk, 2 * dk + 2 * r * dv, d)
    q, k = per_head[:, :dk], per_head[:, dk:2 * dk]
    v, z = per_head[:, 2 * dk:2 * dk + r * dv], per_head[:, 2 * dk + r * dv:]
    tensors[prefix + "in_proj_qkv.weight"] = jnp.concatenate(
        [q.reshape(hk * dk, d), k.reshape(hk * dk, d), v.reshape(hv * dv, d)])
    tensors[prefix + "in_proj_z.weight"] = z.reshape(hv * dv, d)
    ba = ba.reshape(hk, 2 * r, d)
    tensors[prefix + "in_proj_b.weight"] = ba[:, :r].reshape(hv, d)
    tensors[prefix + "in_proj_a.weight"] = ba[:, r:].reshape(hv, d)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's decoder; the checkpoint's fused GDN projections are split on load."""

    @classmethod
    def checkpoint_to_params(cls, cfg: Qwen3_5Config, tensors: dict) -> dict:
        tensors = super().checkpoint_to_params(cfg, tensors)
        for i in range(cfg.num_layers):
            prefix = f"layers.{i}.linear_attn."
            if prefix + "in_proj_qkvz.weight" in tensors or prefix + "in_proj_ba.weight" in tensors:
                split_gdn_projections(tensors, prefix, cfg)
        return tensors


__all__ = ["ARCHITECTURE", "Qwen3NextForCausalLM", "qwen3_next_80b_a3b_like", "qwen3_next_config",
           "split_gdn_projections"]
