"""The mixture-of-experts block: a router (router.py), E stacked expert MLPs, an optional shared expert.

    w, e = route(logits, cfg)                 [N, k] weights (fp32) and expert ids of every token
    y_n  = sum_j w[n, j] * expert_{e[n, j]}(x_n)  (+ shared_expert(x_n), optionally gated)

The routed experts and their dispatch (the rows path, the dispatch plan, the sorted grouped
path) are experts.py's `Experts`; this block adds the router and the shared expert.

The shared expert (Qwen3.5-MoE, Qwen3-Next, Nemotron-H) joins the routed ones once the model is
fused (MoE.fuse_projections): cut into pseudo-experts of their width, named by the router's extra
slots (weight: its gate's sigmoid, whose row joins the router's matmul), it runs in the same
expert GEMV launches at decode and as two dense matmuls elsewhere.

`moe_reference` is the dense per-token definition the dispatch is tested against.  Under tensor
parallelism (sharding.py) each device holds a slice of every expert's intermediate dimension
(gate_up column-parallel, [gate_r | up_r] per device; down row-parallel); `Experts.reduce_axis`
psums the partial sums, then the down bias is added once."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from .experts import Experts, few_rows_path
from .layers import MLP, Linear, UngatedMLP, fp32_precision
from .moe_config import EXPERT_KINDS, SCORINGS, MoEConfig, expert_activation
from .router import Router, route, route_weights

# $UMEM_JAX_SHARED_EXPERT: "apart" keeps a fused model's shared expert apart from the routed ones
# (its own MLP and gate, as before MoE.fuse_projections joined them); unset or "join": joined.
# Read when a model is fused; for measuring one against the other.
SHARED_ENV = "UMEM_JAX_SHARED_EXPERT"


# ----------------------------------------------------------------------------- the block


class MoE(nnx.Module):
    """gate (Router), experts (Experts), optional shared_expert (MLP / UngatedMLP) and
    shared_expert_gate (Linear d -> 1, sigmoid).

    fuse_projections() (after loading) cuts the shared expert into m = I_shared / I pseudo-experts
    of the routed experts' shape, `shared_first` [d, m, F] and `shared_down` [m, I, d], and gives
    its gate to the router's matmul: at decode the shared expert then rides in the routed experts'
    GEMV launches (Qwen3.5-MoE: 4 launches a layer fewer), and runs dense otherwise."""

    def __init__(self, hidden: int, cfg: MoEConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = Router(hidden, cfg, dtype=dtype, rngs=rngs)
        self.experts = Experts(hidden, cfg, dtype=dtype, rngs=rngs)
        self.shared_expert = nnx.data(None)
        self.shared_expert_gate = nnx.data(None)
        self.shared_first = nnx.data(None)  # the shared expert as pseudo-experts, once fuse_projections ran
        self.shared_down = nnx.data(None)
        if cfg.shared_intermediate_size:
            cls = MLP if cfg.shared_expert_kind == "swiglu" else UngatedMLP
            self.shared_expert = cls(hidden, cfg.shared_intermediate_size, cfg.activation, dtype=dtype, rngs=rngs)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = Linear(hidden, 1, dtype=dtype, rngs=rngs)

    def fuse_projections(self, donate: bool = False) -> bool:
        """Join the shared expert to the routed ones (class docstring), when it has their kind
        and activation, no biases, and a width that is a multiple of theirs (on this device);
        else leave it as it is.  Its MLP may be fused already (children fuse first)."""
        choice = os.environ.get(SHARED_ENV, "").strip().lower() or "join"
        if choice not in ("join", "apart"):
            raise ValueError(f"${SHARED_ENV}={choice!r}; known: join, apart")
        if self.shared_expert is None or choice == "apart":
            return False
        stacks = _shared_stacks(self.shared_expert, self.cfg, self.experts)
        gate = self.shared_expert_gate
        if stacks is None or (gate is not None and gate.bias is not None):
            return False
        self.shared_first, self.shared_down = nnx.Param(stacks[0]), nnx.Param(stacks[1])
        self.gate.join_shared(stacks[1].shape[-3], gate)
        if donate:
            self.shared_first[...].block_until_ready()
            self.gate.weight[...].block_until_ready()
            for leaf in jax.tree.leaves(nnx.state(self.shared_expert)) + (
                    [] if gate is None else jax.tree.leaves(nnx.state(gate))):
                leaf.delete()
        self.shared_expert = self.shared_expert_gate = None
        return True

    def shared(self, x: jax.Array, weights: jax.Array | None = None) -> jax.Array | None:
        """The shared expert's output [N, d] fp32 (times its gate), or None; once it is joined,
        from the router's shared slots' weights [N, m] (then this device's partial sum)."""
        if self.shared_first is not None:
            return self.experts.shared_dense(x, weights, (self.shared_first[...], self.shared_down[...]))
        if self.shared_expert is None:
            return None
        s = self.shared_expert(x).astype(jnp.float32)
        if self.shared_expert_gate is not None:
            s = s * jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))
        return s

    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """x [..., d]; valid [...] bool (padding rows: output zeros plus the shared expert,
        unused) -> [..., d] in x.dtype."""
        lead, d = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, d)
        ok = None if valid is None else jnp.broadcast_to(valid, lead).reshape(-1)
        weights, experts = self.gate(flat, ok)  # padding tokens name no expert: ids -1
        joined = None if self.shared_first is None else (self.shared_first[...], self.shared_down[...])
        out = self.experts(flat, weights, experts, ok, shared=joined, masked=True)
        if joined is None and (s := self.shared(flat)) is not None:
            out = out + s
        return out.astype(x.dtype).reshape(*lead, d)


def _shared_stacks(mlp, cfg: MoEConfig, experts: Experts):
    """The shared expert (MLP or UngatedMLP, fused or not; leaves may lead with [tp]) as m
    pseudo-experts of the routed width I -> (first [..., d, m, F], down [..., m, I, d]), or None
    if it cannot join.  Chunk j holds intermediate columns [jI, (j+1)I): the activation is per
    column, so the chunks' down products sum to the shared expert's output."""
    gated = isinstance(mlp, MLP)
    if cfg.expert_kind != ("swiglu" if gated else "ungated") or mlp.act != cfg.activation:
        return None
    parts = [mlp.gate_up] if gated and mlp.gate_up is not None else (
        [mlp.gate_proj, mlp.up_proj] if gated else [mlp.up_proj])
    if any(p.bias is not None for p in parts + [mlp.down_proj]):
        return None
    down = mlp.down_proj.weight[...]  # [..., d, Is] (out, in)
    width, I = down.shape[-1], experts.down_proj[...].shape[-2]
    if width % I or down.dtype != experts.down_proj.dtype:
        return None
    rows = [p.weight[...] for p in parts]  # (out, in): gate_up [..., 2 Is, d], or gate and up [..., Is, d]
    if len(rows) == 1 and gated:
        rows = [rows[0][..., :width, :], rows[0][..., width:, :]]
    cols = lambda w, j: jnp.swapaxes(w[..., j * I:(j + 1) * I, :], -1, -2)  # noqa: E731  [..., d, I]
    m = width // I
    first = jnp.stack([jnp.concatenate([cols(w, j) for w in rows], axis=-1) for j in range(m)], axis=-2)
    down = jnp.stack([jnp.swapaxes(down[..., :, j * I:(j + 1) * I], -1, -2) for j in range(m)], axis=-3)
    return first, down


def moe_reference(moe: MoE, x: jax.Array) -> jax.Array:
    """The dense per-token definition: x [..., d] -> [..., d] in x.dtype.  Each token's k
    experts' weights are gathered ([N, k, d, 2I]) and applied by einsum; no sorting, no
    ragged_dot.  Memory grows with N*k*d*I: tests and small shapes only."""
    cfg, ex = moe.cfg, moe.experts
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    weights, experts = moe.gate(flat)
    shared_w = weights[:, cfg.top_k:]
    weights, experts = weights[:, :cfg.top_k], experts[:, :cfg.top_k]
    w1 = jnp.take(ex.first, experts, axis=0)  # [N, k, d, F]
    h = jnp.einsum("nd,nkdf->nkf", flat, w1, precision=fp32_precision(flat, w1), preferred_element_type=jnp.float32)
    if cfg.expert_bias:
        h = h + jnp.take(ex.first_bias(), experts, axis=0).astype(jnp.float32)
    a = expert_activation(h, cfg).astype(ex.down_proj.dtype)
    w2 = jnp.take(ex.down_proj[...], experts, axis=0)  # [N, k, I, d]
    y = jnp.einsum("nki,nkid->nkd", a, w2, precision=fp32_precision(a, w2), preferred_element_type=jnp.float32)
    if cfg.expert_bias:
        y = y + jnp.take(ex.down_proj_bias[...], experts, axis=0).astype(jnp.float32)
    out = jnp.einsum("nk,nkd->nd", weights, y, precision=fp32_precision(weights, y))
    s = moe.shared(flat, shared_w)
    if s is not None:
        out = out + s
    return out.astype(x.dtype).reshape(*lead, d)


__all__ = ["EXPERT_KINDS", "SCORINGS", "Experts", "MoE", "MoEConfig", "Router", "expert_activation",
           "few_rows_path", "moe_reference", "route", "route_weights"]
