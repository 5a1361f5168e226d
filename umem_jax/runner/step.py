"""The step: one jitted launch of the model over the arena, then the sampler.

    tokens [max_batch] int32, arena = jit_step(params, arena, meta, prev, counts, layout=..., model=...)

`meta` is the packed int32 metadata `layout` describes (packing.Layout); `prev` is the previous
step's output, still on the device: a decode row whose input token that step sampled takes it
from there (`src` column), so the host launches step N+1 before reading step N's tokens and
the device never waits for the host between steps.  The arena is donated: XLA updates it in
place.  Neither the step nor the sampler holds a conditional (see sampler.py), so nothing in it
makes the host wait.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..core.batch import Batch
from .packing import Layout
from .sampler import sample, sample_with_penalties

_SAMPLER_ARGS = ("temperature", "top_k", "top_p", "min_p", "seed", "step", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


@dataclasses.dataclass(frozen=True, eq=False)
class StepModel:
    """The model half of the step's static arguments: its forward over the arena and the
    structure of its params.  Hashed by identity, and made once per (model graph, params
    structure, plan, kernels, mesh) by `step_model`, so engines on one model share every
    compiled step."""

    forward: Callable  # forward(params, arena, Batch) -> (logits [B, V] fp32, arena)
    treedef: Any  # the params' pytree structure: the step takes them as their flat list of leaves


_STEP_MODELS: dict = {}


def step_model(model, plan, impl: str | None, interpret: bool, treedef) -> StepModel:
    """The StepModel of `model` (whose params flatten to `treedef`) over `plan`'s arena."""
    key = (model.graphdef, treedef, plan, impl, interpret, getattr(model, "mesh", None))
    got = _STEP_MODELS.get(key)
    if got is None:
        got = _STEP_MODELS[key] = StepModel(model.forward_fn(plan, impl=impl, interpret=interpret), treedef)
    return got


def step(params: list, arena, meta: jax.Array, prev: jax.Array, counts, *, layout: Layout,
         model: StepModel) -> tuple[jax.Array, Any]:
    """One step -> (tokens [max_batch] int32, rows past B zero; the arena).

    params: the flat list of leaves (flattening the NNX State on every call is Python work per
    leaf; a flat list is flattened by the C++ dispatch path).  counts: (prompt, output) token
    counts, each [B, V] f32, for a layout with penalties, else None."""
    params = jax.tree.unflatten(model.treedef, params)
    f = layout.unpack(meta)
    tokens, src = f["tokens"], f["src"]
    fed = jnp.take(prev, jnp.clip(src, 0, prev.shape[0] - 1))
    tokens = tokens.at[:, 0].set(jnp.where(src >= 0, fed, tokens[:, 0]))
    batch = Batch(tokens, f["q_lens"], f["kv_lens"], {p: f[f"table:{p}"] for p in layout.pools}, f["slots"],
                  f.get("checkpoint_positions"), f.get("checkpoint_slots"))
    logits, arena = model.forward(params, arena, batch)
    ban = f["ban"]  # [B, banned_per_row], -1 = none: min_tokens keeps stop tokens out
    rows = jnp.arange(layout.B)[:, None]
    logits = logits.at[rows, jnp.maximum(ban, 0)].min(jnp.where(ban >= 0, -jnp.inf, jnp.inf))
    sampling = [f[n] for n in _SAMPLER_ARGS]
    if layout.penalties:
        toks = sample_with_penalties(logits, counts[0], counts[1], *sampling, mode=layout.sampling)
    else:
        toks = sample(logits, *sampling, mode=layout.sampling)
    out = jnp.zeros((layout.max_batch,), jnp.int32).at[: layout.B].set(toks.astype(jnp.int32))
    return out, arena


jit_step = jax.jit(step, donate_argnums=(1,), static_argnames=("layout", "model"))


__all__ = ["StepModel", "jit_step", "step", "step_model"]
