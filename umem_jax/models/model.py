"""Model: a loaded model as the engine holds it -- config, NNX graph definition, params pytree.

The NNX module is split once at load (`nnx.split`); the params are a plain pytree handed to a
`jax.jit`-ed pure function that merges the graph inside, so nothing walks NNX objects per step.

    model = load_model("path/or/name")                 # loader.py
    plan = umem_jax.memory.plan(model.decls(), page_size=16)
    arena = umem_jax.arena.Arena.create(plan, num_rows)
    step = model.jit_forward()                         # arena donated
    logits, arena = step(model.params, arena, batch)   # logits [B, V] fp32; rebind the arena
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from ..arena import Arena
from ..core.batch import Batch
from ..memory.declarations import LayerDecl
from ..memory.plan import Plan
from .config import ModelConfig


@dataclasses.dataclass
class Model:
    config: ModelConfig
    graphdef: Any  # nnx.GraphDef of the family's module
    params: Any  # nnx.State: the weights, a pytree of arrays
    module_cls: type
    tokenizer_path: Path | None = None  # tokenizer.json, when the source had one
    source: Path | None = None  # the checkpoint directory it was loaded from (an MTP head is read there too)

    @classmethod
    def from_module(cls, module: nnx.Module, **kw) -> Model:
        graphdef, params = nnx.split(module)
        return cls(module.config, graphdef, params, type(module), **kw)

    def fuse_projections(self, *, donate: bool = False) -> Model:
        """The same model with every group of column projections that read one input (attention
        q|k|v, MLP gate|up, gated-DeltaNet qkv|z|b|a) as one matmul over stacked weights.

        Done once after loading (the checkpoint keeps its own names); the stacked copies replace
        the parts, whose arrays are freed when the caller drops this Model -- or at once, layer by
        layer, with donate=True (this Model's params are then unusable: the engine donates a
        model it loaded itself, so the weights never exist twice).  Same math: each
        output column is the same dot product.  Modules without a `fuse_projections` method
        (Mamba2's in_proj is one matmul already) are left as they are; a fused model comes back as is.
        """
        module = nnx.merge(self.graphdef, self.params)
        iter_modules = getattr(nnx, "iter_modules", None) or (lambda m: m.iter_modules())
        fusable = [sub for _, sub in iter_modules(module) if hasattr(sub, "fuse_projections")]
        if not sum(sub.fuse_projections(donate) for sub in fusable):  # nothing to fuse, or fused already
            return self
        graphdef, params = nnx.split(module)
        return dataclasses.replace(self, graphdef=graphdef, params=params)

    @property
    def param_bytes(self) -> int:
        """Device bytes of the weights (for sizing the arena from what is left)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.params))

    def decls(self, kv_dtype: str = "bfloat16") -> list[LayerDecl]:
        """What every layer keeps in the arena; kv_dtype "float32" stores K/V as two planes."""
        return self.module_cls.decls(self.config, kv_dtype)

    def forward_fn(self, plan: Plan | None = None, *, impl: str | None = None, interpret: bool = False,
                   **model_kw) -> Callable:
        """Pure `forward(params, arena, batch) -> (logits [B, V] fp32, arena)`.

        `arena` is an `umem_jax.arena.Arena` (its static plan says where every layer's rows
        are) or a raw [num_rows, row_words] array laid out by `plan`; the same kind comes back.
        impl/interpret choose the kernels ("pallas" | "reference"; default pallas on GPU).
        """
        graphdef = self.graphdef

        def forward(params, arena, batch: Batch):
            module = nnx.merge(graphdef, params)
            if isinstance(arena, Arena):
                logits, data = module(arena.data, batch, arena.plan, impl=impl, interpret=interpret, **model_kw)
                return logits, arena.replace(data)
            if plan is None:
                raise ValueError("a raw arena array needs the plan: forward_fn(plan)")
            return module(arena, batch, plan, impl=impl, interpret=interpret, **model_kw)

        return forward

    def jit_forward(self, plan: Plan | None = None, **kernel_kw) -> Callable:
        """`forward_fn(plan)` under jit with the arena donated (updated in place).  Its params may
        be the State or its flat leaves (`jax.tree.leaves(model.params)`, the cheap way to call it
        in a loop: jit flattens a list in C++, while the State's leaves are visited in Python,
        ~1 ms a call for the ~700 leaves of the MoE presets, a third of a B = 1 decode step)."""
        forward, treedef = self.forward_fn(plan, **kernel_kw), jax.tree.structure(self.params)

        def step(params, arena, batch):
            if isinstance(params, list):  # static: a list and a State trace apart
                params = jax.tree.unflatten(treedef, params)
            return forward(params, arena, batch)

        return jax.jit(step, donate_argnums=1)

    @functools.cached_property
    def dense_logits(self) -> Callable:
        """Jitted cache-free forward: (params, tokens [B, T]) -> logits [B, T, V] fp32."""
        graphdef = self.graphdef
        return jax.jit(lambda params, tokens: nnx.merge(graphdef, params).dense(tokens))
