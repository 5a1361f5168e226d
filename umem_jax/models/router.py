"""An MoE block's router: logits x W^T in fp32, then the k experts each token picks and their weights.

    weights, experts = Router(x)            x [N, d] -> [N, k (+ shared slots)] fp32 / int32

Scoring (softmax, sigmoid, gpt-oss's top-k softmax), DeepSeek-style expert groups, the
correction bias that moves the selection only, renormalisation and routed scaling are `route`'s;
without groups it is one Pallas kernel on a GPU (pallas_kernels/route_topk.py).  Once an MoE
joined its shared expert to the routed ones (moe.MoE.fuse_projections) the router's matmul also
gives the shared expert's gate, and the choice names its pseudo-experts after the k picks.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from ..pallas_kernels.route_topk import MAX_EXPERTS as ROUTE_MAX_EXPERTS
from ..pallas_kernels.route_topk import (ROUTER_DOT_ENV, choice_of, route_backend, route_topk, route_topk_reference,
                                         scores_of, topk_weights)
from .layers import Linear, fp32_precision, normal_init
from .moe_config import MoEConfig


REDUCE_ROWS = 256  # rows up to which $UMEM_JAX_ROUTER_DOT=reduce applies (route_topk.ROUTER_DOT_ENV)


def _grouped_mask(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """[..., E] selection scores -> [..., E] bool: the experts of the topk_group groups whose
    top-2 scores (top-1 for groups of one) sum highest."""
    *lead, e = choice.shape
    groups = choice.reshape(*lead, n_group, e // n_group)
    group_score = jax.lax.top_k(groups, min(2, e // n_group))[0].sum(-1)  # [..., G]
    _, keep = jax.lax.top_k(group_score, topk_group)
    kept = jnp.any(keep[..., :, None] == jnp.arange(n_group), axis=-2)  # [..., G]
    return jnp.repeat(kept, e // n_group, axis=-1)


def route(logits: jax.Array, cfg: MoEConfig, correction_bias: jax.Array | None = None, *, shared: int = 0,
          shared_gate: bool = False, valid: jax.Array | None = None, logit_bias: jax.Array | None = None):
    """Router logits [..., E] (fp32; the router's bias included, or given as logit_bias [E (+ 1)]
    for the kernel to add as it loads them; with shared_gate [..., E + 1], the last
    column the shared expert's gate) -> (weights [..., k + shared] fp32, experts [..., k + shared]
    int32): the k picks, then `shared` slots naming the shared expert's pseudo-experts E.. (weight
    1, or the gate's sigmoid; route_topk.choice_of).  correction_bias [E] shifts the selection
    only (never the weights).  valid [...] bool: padding tokens name no expert (ids -1, weights 0).
    Without expert groups (and up to route_topk.MAX_EXPERTS experts) this is one Pallas kernel on
    a GPU (pallas_kernels/route_topk.py)."""
    logits = logits.astype(jnp.float32)
    E = cfg.num_experts
    kw = dict(scoring=cfg.scoring, norm_topk_prob=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
    if cfg.n_group > 1 and cfg.scoring != "topk_softmax":  # DeepSeek-style groups: mask the others, pick in XLA
        if logit_bias is not None:
            logits = logits + logit_bias.astype(jnp.float32)
        choice = scores_of(logits[..., :E], cfg.scoring)
        choice = choice if correction_bias is None else choice + correction_bias.astype(jnp.float32)
        choice = jnp.where(_grouped_mask(choice, cfg.n_group, cfg.topk_group), choice, -jnp.inf)
        experts = jax.lax.top_k(choice, cfg.top_k)[1].astype(jnp.int32)
        return choice_of(logits, experts, shared=shared, shared_gate=shared_gate, valid=valid, **kw)
    kw.update(k=cfg.top_k, correction_bias=correction_bias, shared=shared, shared_gate=shared_gate, valid=valid,
              logit_bias=logit_bias)
    if route_backend() == "pallas" and E <= ROUTE_MAX_EXPERTS:
        return route_topk(logits, interpret=jax.default_backend() != "gpu", **kw)
    return route_topk_reference(logits, **kw)


def route_weights(logits: jax.Array, experts: jax.Array, cfg: MoEConfig) -> jax.Array:
    """The weights `route` gives the experts [..., k] chosen, from the router logits [..., E] -> [..., k]
    fp32.  Apart from `route`, a check that forces one path's choice on another uses it."""
    return topk_weights(logits, experts, scoring=cfg.scoring, norm_topk_prob=cfg.norm_topk_prob,
                        scale=cfg.routed_scaling_factor)


class Router(nnx.Module):
    """logits = x W^T (+ bias), in fp32; W [E, d]; e_score_correction_bias [E] for selection.
    Once the MoE joined its shared expert to the routed ones (MoE.fuse_projections) W is [E + 1, d]
    when the shared expert is gated (its gate's row last) and the choice carries `shared_slots`
    more slots (route's `shared`)."""

    def __init__(self, hidden: int, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs):
        e = cfg.num_experts
        self.weight = nnx.Param(normal_init(rngs, (e, hidden), dtype))
        self.bias = nnx.Param(jnp.zeros((e,), dtype)) if cfg.router_bias else nnx.data(None)
        # fp32 whatever the model dtype (checkpoints keep it so): it picks experts by differences
        # that bf16 would round away.
        self.e_score_correction_bias = (nnx.Param(jnp.zeros((e,), jnp.float32)) if cfg.score_correction_bias
                                        else nnx.data(None))
        self.cfg = cfg
        self.shared_slots = 0  # static: the shared expert's pseudo-experts the choice names (join_shared)
        self.shared_gated = False  # static: W's last row is the shared expert's gate

    def join_shared(self, slots: int, gate: Linear | None) -> None:
        """Name `slots` shared pseudo-experts after the picks; take the shared expert's gate
        (Linear d -> 1, no bias) as W's last row, so one matmul gives both (a launch saved per
        layer at decode, and the gate's logit in fp32)."""
        if gate is not None:
            w = self.weight[...]
            self.weight = nnx.Param(jnp.concatenate([w, gate.weight[...].astype(w.dtype)], axis=-2))
            if self.bias is not None:
                self.bias = nnx.Param(jnp.concatenate([self.bias[...], jnp.zeros((1,), self.bias.dtype)]))
        self.shared_slots, self.shared_gated = int(slots), gate is not None

    def choice(self, logits: jax.Array, experts: jax.Array, valid: jax.Array | None = None):
        """The choice __call__ would give if it had picked experts [..., k] (e.g. ones a check
        forces) from its logits [..., E (+ 1)] -> (weights, experts) [..., k + shared_slots]."""
        cfg = self.cfg
        return choice_of(logits, experts, scoring=cfg.scoring, norm_topk_prob=cfg.norm_topk_prob,
                         scale=cfg.routed_scaling_factor, shared=self.shared_slots, shared_gate=self.shared_gated,
                         valid=valid)

    def logits(self, x: jax.Array, with_bias: bool = True) -> jax.Array:
        """x [..., d] -> x W^T [..., E (+ 1)] fp32, plus the router's bias unless with_bias is False."""
        w = self.weight[...]
        rows = math.prod(x.shape[:-1])
        if 1 < rows <= REDUCE_ROWS and os.environ.get(ROUTER_DOT_ENV, "").strip().lower() == "reduce":
            # a decode batch's [N, d] x [d, E]: XLA's GEMM splits K and pads both operands for it
            # (four launches around the product); one reduction fusion instead, in fp32
            out = jnp.sum(x[..., None, :].astype(jnp.float32) * w.astype(jnp.float32), axis=-1)
        else:
            out = jnp.einsum("...d,ed->...e", x, w, precision=fp32_precision(x, w), preferred_element_type=jnp.float32)
        return out if self.bias is None or not with_bias else out + self.bias[...].astype(jnp.float32)

    def __call__(self, x: jax.Array, valid: jax.Array | None = None):
        """x [..., d], valid [...] bool or None -> (weights [..., k + shared_slots] fp32, experts
        [..., k + shared_slots] int32; a token that is not valid names no expert: ids -1)."""
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        # The router's own bias goes to route(), which has the kernel add it as it loads the logits
        # (an XLA add after the matmul was a launch of its own in every MoE layer: gpt-oss).
        logit_bias = None if self.bias is None else self.bias[...]
        return route(self.logits(x, with_bias=False), self.cfg, bias, shared=self.shared_slots,
                     shared_gate=self.shared_gated, valid=valid, logit_bias=logit_bias)


__all__ = ["Router", "route", "route_weights"]
