"""MoEConfig: one MoE block's shape and routing, as a family's ModelConfig carries it (field `moe`)
and as tensor / expert parallelism rewrites it per device (sharding.local_config), and the expert
activation its expert_kind names.  The block itself: moe.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .layers import activation

SCORINGS = ("softmax", "topk_softmax", "sigmoid")
EXPERT_KINDS = ("swiglu", "gpt_oss", "ungated")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE block's shape and routing (hashable: a field `moe` of a family's ModelConfig).

    scoring: "softmax"      p = softmax(logits) over all E, top-k of p            (Qwen3-MoE/Next/3.5)
             "topk_softmax" top-k of logits, softmax over the k chosen            (gpt-oss)
             "sigmoid"      s = sigmoid(logits), top-k of s + correction bias,
                            weights s of the chosen                                (Nemotron-H, DeepSeek-V3)
    norm_topk_prob renormalises the k weights to sum 1 (softmax / sigmoid); routed_scaling_factor
    multiplies them after.  n_group > 1: keep the topk_group groups of E/n_group experts with the
    largest sum of their top-2 selection scores, then pick top-k inside them.
    expert_kind: "swiglu" act(gate) * up; "gpt_oss" the clamped SwiGLU (swiglu_limit, swiglu_alpha,
    (up + 1)); "ungated" act(up).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    score_correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    expert_kind: str = "swiglu"
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    shared_intermediate_size: int = 0
    shared_expert_kind: str = "swiglu"
    shared_expert_gate: bool = False
    # Expert parallelism (sharding.py): the routed experts are split whole over this many devices,
    # each holding local_experts of them at full width; the router still scores all num_experts.
    expert_shards: int = 1

    @property
    def local_experts(self) -> int:
        """Routed experts one device holds: num_experts, or its share under expert parallelism."""
        return self.num_experts // self.expert_shards

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise NotImplementedError(f"MoE scoring {self.scoring!r}; supported: {SCORINGS}")
        if self.expert_kind not in EXPERT_KINDS:
            raise NotImplementedError(f"MoE expert_kind {self.expert_kind!r}; supported: {EXPERT_KINDS}")
        if self.shared_expert_kind not in ("swiglu", "ungated"):
            raise NotImplementedError(f"MoE shared_expert_kind {self.shared_expert_kind!r}; supported: swiglu, ungated")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.expert_shards < 1 or self.num_experts % self.expert_shards:
            raise ValueError(f"MoE num_experts={self.num_experts} must split evenly over expert_shards="
                             f"{self.expert_shards} devices (expert parallelism holds whole experts)")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"MoE n_group={self.n_group} must divide num_experts={self.num_experts}")
        if self.n_group > 1 and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"MoE topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"MoE top_k={self.top_k} exceeds the experts of topk_group={self.topk_group} groups")


@functools.lru_cache(maxsize=None)
def expert_prologue(kind: str, act: str, alpha: float, limit: float):
    """The expert's activation as f(gate, up or None) -> [..., I]: one function object per
    (kind, activation, gpt-oss alpha and limit), so the expert GEMV, which runs it as it loads its
    input (pallas_kernels/expert_gemv.py `prologue`), compiles once per kind."""
    f = activation(act)
    if kind == "ungated":
        return lambda gate, up: f(gate)
    if kind == "swiglu":
        return lambda gate, up: f(gate) * up

    def gpt_oss(gate, up):  # clamp, then gate * sigmoid(alpha * gate) * (up + 1)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * (gate * jax.nn.sigmoid(alpha * gate))

    return gpt_oss


def activation_of(cfg: MoEConfig):
    """cfg's expert_prologue."""
    return expert_prologue(cfg.expert_kind, cfg.activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))


def expert_activation(h: jax.Array, cfg: MoEConfig) -> jax.Array:
    """The expert's hidden activation: h [..., 2I] (gate | up) or [..., I] (ungated) -> [..., I]."""
    if cfg.expert_kind == "ungated":
        return activation_of(cfg)(h, None)
    i = h.shape[-1] // 2
    return activation_of(cfg)(h[..., :i], h[..., i:])


__all__ = ["EXPERT_KINDS", "SCORINGS", "MoEConfig", "activation_of", "expert_activation", "expert_prologue"]
