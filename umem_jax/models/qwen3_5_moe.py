"""Qwen3.5-MoE text decoder (`qwen3_5_moe_text`; Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B, Qwen3.6-35B-A3B).

The Qwen3.5 decoder (qwen3_5.py: gated DeltaNet and gated attention 3 : 1, zero-centred RMSNorms,
partial RoPE) with every layer's MLP replaced by a sparse MoE block (moe.py):

    p = softmax(x W_gate^T) over E experts;  top-k of p, renormalised to sum 1 (always: the
    Qwen3.5-MoE router has no norm_topk_prob switch)
    y = sum_j p_j expert_j(x) + sigmoid(x w_sg^T) shared_expert(x)      experts and shared: SwiGLU

Checkpoints keep the experts in one of two layouts, both converted by `checkpoint_to_params` to
the MoE block's stacked (in, out) leaves (`mlp.experts.gate_up_proj` [E, d, 2I], gate then up;
`mlp.experts.down_proj` [E, I, d]):
  * one tensor per expert, `mlp.experts.{j}.gate_proj.weight` / `up_proj.weight` [I, d] and
    `down_proj.weight` [d, I]: what transformers 5.23's save_pretrained writes (it reverts its
    own fusion on save), and Qwen3-Next's hub layout;
  * fused, `mlp.experts.gate_up_proj` [E, 2I, d] and `mlp.experts.down_proj` [E, d, I]:
    transformers' in-memory Qwen3_5MoeExperts layout, in which the Qwen3.5-35B-A3B hub
    checkpoint stores them too (its tensors carry no per-expert index).  Both shapes are checked
    against the config: a pair stored the other way round ((in, out)) is refused, not misread
    (d == 2I and d == I cannot both hold, so one of the two shapes always tells).
The router (`mlp.gate.weight` [E, d]), the shared expert (`mlp.shared_expert.*`) and its gate
(`mlp.shared_expert_gate.weight` [1, d]) load by name; the multimodal checkpoints'
`model.language_model.*` prefix, `model.visual.*` and `mtp.*` are handled by the loader.
"""

from __future__ import annotations

import jax.numpy as jnp

from .moe import MoEConfig
from .qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM, qwen3_5_fields

ARCHITECTURE = "Qwen3_5MoeForCausalLM"

# transformers 5.23's Qwen3_5MoeTextConfig defaults (no dense MLP: intermediate_size is not one of its fields).
_MOE_DEFAULTS = {"vocab_size": 248320, "hidden_size": 2048, "intermediate_size": 0, "num_hidden_layers": 40,
                 "num_key_value_heads": 2, "rope_theta": 10_000.0, "num_experts": 256, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}


def moe_config(d: dict, *, norm_topk_prob: bool) -> MoEConfig | None:
    """The MoE fields of a Qwen3.5-MoE / Qwen3-Next config.json, the family's transformers defaults
    merged in by the caller -> MoEConfig; None when num_experts is 0 (transformers then builds
    dense MLPs).  The shared expert is gated whenever it exists (Qwen3NextSparseMoeBlock)."""
    if not d["num_experts"]:
        return None
    shared = d["shared_expert_intermediate_size"]
    return MoEConfig(
        num_experts=d["num_experts"], top_k=d["num_experts_per_tok"], intermediate_size=d["moe_intermediate_size"],
        scoring="softmax", norm_topk_prob=norm_topk_prob, activation=d.get("hidden_act", "silu"),
        shared_intermediate_size=shared, shared_expert_kind="swiglu", shared_expert_gate=bool(shared))


def qwen3_5_moe_config(d: dict) -> Qwen3_5Config:
    """A `qwen3_5_moe_text` config.json dict (the multimodal wrapper's text_config already
    unwrapped by registry.from_hf_config) -> config: every layer sparse."""
    if d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1:
        raise NotImplementedError("Qwen3.5-MoE with mlp_only_layers / decoder_sparse_step != 1 is not a "
                                  "transformers configuration (its layers are all sparse); Qwen3-Next has them")
    fields = qwen3_5_fields(d, _MOE_DEFAULTS)
    moe = moe_config({**_MOE_DEFAULTS, **d}, norm_topk_prob=True)
    if moe is None:
        raise ValueError("a Qwen3.5-MoE config needs num_experts > 0")
    return Qwen3_5Config(architecture=ARCHITECTURE, moe=moe, **fields)


def qwen3_5_35b_a3b_like(dtype: str = "bfloat16") -> Qwen3_5Config:
    """Qwen3.5-35B-A3B's text decoder with random weights (registry.build_random): 40 layers, 10 x (3
    gated DeltaNet (16 key / 32 value heads x 128, conv 4) -> 1 gated attention (16 q / 2 kv heads x
    256, RoPE on 64 dims)), hidden 2048, each layer an MoE of 256 experts (intermediate 512), 8
    routed + 1 shared (512, sigmoid-gated), vocab 248320, untied LM head; about 34.7B parameters.

    Where the figures come from: layers, hidden size, the layout, both head geometries, the RoPE
    dimension, 256 experts / 8 routed + 1 shared / intermediate 512 and the 248320 vocabulary are
    the Qwen3.6-35B-A3B model card's (the same architecture and model_type as Qwen3.5-35B-A3B,
    transformers' model doc says); shared_expert_intermediate_size 512, conv kernel 4, rope_theta
    1e7, partial_rotary_factor 0.25, tie_word_embeddings false and eos 248044 are the values a public
    inventory of the Qwen3.5-35B-A3B snapshot's config.json lists; the native context 262144 is the
    model card's.  Every one also equals transformers 5.23's Qwen3_5MoeTextConfig default (documented
    as Qwen/Qwen3.5-35B-A3B's), except rope_theta and max_position_embeddings (there 1e4 and 32768)."""
    return qwen3_5_moe_config({
        "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "eos_token_id": 248044, "dtype": dtype})


# ------------------------------------------------------------------------------- checkpoint layouts


def stack_experts(tensors: dict, prefix: str, num_experts: int, intermediate: int, hidden: int) -> None:
    """Replace one sparse block's expert tensors (under `prefix`, e.g. "layers.3.mlp.experts.") by
    our stacked `gate_up_proj` [E, d, 2I] and `down_proj` [E, I, d], in place; the block's other
    tensors stay.  Per-expert and fused checkpoints are both read (module docstring)."""
    fused, down = prefix + "gate_up_proj", prefix + "down_proj"
    if fused in tensors or down in tensors:
        want = {fused: (num_experts, 2 * intermediate, hidden), down: (num_experts, hidden, intermediate)}
        got = {n: tuple(tensors[n].shape) if n in tensors else "missing" for n in want}
        if got != want:
            raise ValueError(f"fused experts {', '.join(f'{n} {got[n]}' for n in want)}; transformers' layout is "
                             f"{want[fused]} (gate rows, then up rows) and {want[down]}")
        tensors[fused] = jnp.swapaxes(jnp.asarray(tensors.pop(fused)), 1, 2)  # [E, 2I, d] (out, in) -> [E, d, 2I]
        tensors[down] = jnp.swapaxes(jnp.asarray(tensors.pop(down)), 1, 2)  # [E, d, I] -> [E, I, d]
        return
    names = [f"{prefix}{j}.{p}.weight" for j in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    present = [n for n in names if n in tensors]
    if not present:
        return  # neither layout: loader.build names the missing parameters
    if len(present) < len(names):
        missing = sorted(set(names) - set(present))
        raise KeyError(f"missing {len(missing)} tensor(s) of the per-expert layout: {', '.join(missing[:8])}")
    take = lambda j, p: jnp.asarray(tensors.pop(f"{prefix}{j}.{p}.weight")).T  # noqa: E731  (out, in) -> (in, out)
    tensors[fused] = jnp.stack([jnp.concatenate([take(j, "gate_proj"), take(j, "up_proj")], axis=1)
                                for j in range(num_experts)])
    tensors[down] = jnp.stack([take(j, "down_proj") for j in range(num_experts)])


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 layers with MoE feed-forward blocks (the config's `moe`, `is_sparse`)."""

    @classmethod
    def checkpoint_to_params(cls, cfg: Qwen3_5Config, tensors: dict) -> dict:
        """Stack every sparse layer's experts (either checkpoint layout); the rest loads by name.
        Without a shared expert (shared_expert_intermediate_size 0) transformers still builds and
        saves a zero-width one and its [1, d] gate, whose product is 0: those are dropped."""
        tensors = dict(tensors)
        for i in range(cfg.num_layers):
            if cfg.is_sparse(i):
                stack_experts(tensors, f"layers.{i}.mlp.experts.", cfg.moe.num_experts, cfg.moe.intermediate_size,
                              cfg.hidden_size)
                if not cfg.moe.shared_intermediate_size:
                    drop_empty_shared_expert(tensors, f"layers.{i}.mlp.")
        return tensors


def drop_empty_shared_expert(tensors: dict, prefix: str) -> None:
    """Remove a zero-width shared expert (`{prefix}shared_expert.*`, every tensor empty) and its
    gate from `tensors`; a shared expert with weights is left, for the loader to refuse as
    unexpected (the config says there is none)."""
    shared = [k for k in tensors if k.startswith(prefix + "shared_expert.")]
    if shared and all(0 in tensors[k].shape for k in shared):
        for k in shared:
            del tensors[k]
        tensors.pop(prefix + "shared_expert_gate.weight", None)


__all__ = ["ARCHITECTURE", "Qwen3_5MoeForCausalLM", "drop_empty_shared_expert", "moe_config", "qwen3_5_35b_a3b_like",
           "qwen3_5_moe_config", "stack_experts"]
