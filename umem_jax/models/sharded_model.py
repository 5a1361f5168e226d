"""ShardedModel: a Model split over a `tp` mesh axis, its forward run under shard_map.

    model = shard_model(load_model(path), tp=2)        # weights moved to their devices once
    plan = umem_jax.memory.plan(model.decls())         # the PER-DEVICE plan (local heads)
    arena = Arena.create(plan, num_rows, mesh=model.mesh)          # [tp, rows, words], P("tp")
    logits, arena = model.jit_forward()(model.params, arena, batch)  # arena donated, in place

It is a `Model` (engine, runner and sampler take it unchanged): `config` is the per-device config
(sharding.local_config), `graphdef` the per-device module with its row-parallel Linears marked,
`params` the same pytree as the unsplit model's with every split leaf stacked [tp, *local]
(NamedSharding P("tp")) and every other leaf replicated (P()).  `forward_fn` wraps the unsplit
forward in shard_map: each device sees its [rows, words] arena shard, its weight slices, and the
replicated batch (page tables, slots: one host decision for all devices); logits leave
replicated, so sampling runs the same on every device.  The per-device module is the family's
own class built from the per-device config, split by sharding.py's per-layer rules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..arena import Arena
from ..memory.plan import Plan
from ..parallel.collectives import TP_AXIS
from ..parallel.mesh import shard_map, tp_mesh
from .config import ModelConfig
from .model import Model
from .sharding import local_config, mark_local, split_indices


@dataclasses.dataclass
class ShardedModel(Model):
    mesh: Any = None  # jax.sharding.Mesh with one axis "tp"
    stacked: tuple[bool, ...] = ()  # per params leaf (jax.tree.leaves order): split [tp, ...] or replicated
    full_config: ModelConfig | None = None  # the unsplit model's config

    @property
    def tp(self) -> int:
        return int(self.mesh.shape[TP_AXIS])

    @property
    def param_bytes(self) -> int:
        """Weight bytes ONE device holds (its slices plus the replicated leaves)."""
        leaves = jax.tree.leaves(self.params)
        return sum(x.nbytes // self.tp if s else x.nbytes for x, s in zip(leaves, self.stacked))

    def fuse_projections(self, *, donate: bool = False) -> ShardedModel:
        """Model.fuse_projections on the per-device module.  The fused weights are column-parallel
        like their parts: stacked [tp, sum(out_local), in], concatenated per device (axis -2) and
        kept on the tp axis, so device r's fused matrix holds exactly its heads' rows."""
        flags = {_name(p): s for (p, _), s in zip(jax.tree_util.tree_flatten_with_path(self.params)[0], self.stacked)}
        fused = Model.fuse_projections(self, donate=donate)
        if fused is self:
            return self
        got, treedef = jax.tree_util.tree_flatten_with_path(fused.params)
        leaves, stacked = [], []
        for path, x in got:
            s = flags.get(_name(path), True)  # a new leaf is a fused column-parallel weight: split
            leaves.append(jax.device_put(x, NamedSharding(self.mesh, P(TP_AXIS) if s else P())))
            stacked.append(s)
        return dataclasses.replace(fused, params=jax.tree.unflatten(treedef, leaves), stacked=tuple(stacked))

    def _specs(self) -> list:
        return [P(TP_AXIS) if s else P() for s in self.stacked]

    def _local_params(self, leaves, treedef):
        """Inside shard_map: [1, *local] split leaves -> [*local]; the per-device params pytree."""
        return jax.tree.unflatten(treedef, [x[0] if s else x for x, s in zip(leaves, self.stacked)])

    def forward_fn(self, plan: Plan | None = None, *, impl: str | None = None, interpret: bool = False,
                   **model_kw) -> Callable:
        """Pure `forward(params, arena, batch) -> (logits [B, V] fp32, arena)`, as Model's, over
        the sharded arena: an Arena made with mesh=self.mesh, or a raw [tp, rows, words] array
        laid out by `plan`.  model_kw: the module's forward options, as Model.forward_fn's (a
        draft's memory_model, a verify's all_positions / decode_rows); what the module returns
        first (logits, or a tuple with hiddens) leaves replicated."""
        mesh = self.mesh

        def forward(params, arena, batch):
            layout = arena.plan if isinstance(arena, Arena) else plan
            if layout is None:
                raise ValueError("a raw arena array needs the plan: forward_fn(plan)")
            if isinstance(arena, Arena) and arena.mesh != mesh:
                raise ValueError("the arena is not sharded over this model's mesh: Arena.create(..., mesh=model.mesh)")
            # the unsplit math, per device
            local = Model.forward_fn(self, layout, impl=impl, interpret=interpret, **model_kw)
            leaves, treedef = jax.tree.flatten(params)

            def body(leaves, data, batch):
                logits, data = local(self._local_params(leaves, treedef), data[0], batch)
                return logits, data[None]

            sharded = shard_map(body, mesh, in_specs=(self._specs(), P(TP_AXIS), P()), out_specs=(P(), P(TP_AXIS)))
            data = arena.data if isinstance(arena, Arena) else arena
            logits, data = sharded(leaves, data, batch)
            return logits, (arena.replace(data) if isinstance(arena, Arena) else data)

        return forward

    @functools.cached_property
    def dense_logits(self) -> Callable:
        """Jitted cache-free forward over the split weights: (params, tokens [B, T]) -> logits
        [B, T, V] fp32, replicated."""
        graphdef = self.graphdef

        def run(params, tokens):
            leaves, treedef = jax.tree.flatten(params)

            def body(leaves, tokens):
                return nnx.merge(graphdef, self._local_params(leaves, treedef)).dense(tokens)

            return shard_map(body, self.mesh, in_specs=(self._specs(), P()), out_specs=P())(leaves, tokens)

        return jax.jit(run)


def shard_model(model: Model, tp: int, devices=None, *, expert_parallel: bool = False) -> ShardedModel:
    """Split `model` over a `tp` mesh (the first tp devices, or `devices`) -> ShardedModel.
    expert_parallel: MoE layers' routed experts split whole over the devices instead of by their
    intermediate columns (sharding.py); nothing changes for a model without MoE layers.

    Raises ValueError when tp does not split the model into whole heads (sharding.check_tp) or
    the model has a weight whose per-device shape no rule explains (a module this package does
    not know how to split).  The unsplit params are only read.
    """
    if isinstance(model, ShardedModel):
        raise ValueError("the model is already sharded")  # noqa: TRY004 (every refusal here is a ValueError)
    cfg = local_config(model.config, tp, expert_parallel)
    mesh = tp_mesh(tp, devices)
    full = nnx.merge(model.graphdef, model.params)
    try:
        local = nnx.eval_shape(lambda: model.module_cls(cfg, rngs=nnx.Rngs(0)))
    except TypeError as e:
        raise ValueError(f"tensor parallelism builds the per-device module as {model.module_cls.__name__}(config, "
                         f"rngs=...); that failed: {e}") from None
    mark_local(local, full, tp, expert_parallel)
    graphdef, shapes = nnx.split(local)
    rules = split_indices(full, tp, expert_parallel)
    got, treedef = jax.tree_util.tree_flatten_with_path(model.params)
    want = jax.tree.leaves(shapes)
    if len(got) != len(want):
        raise ValueError(f"the per-device module has {len(want)} weights, the model {len(got)}")
    leaves, stacked = [], []
    for (path, x), wanted in zip(got, want):
        name = _name(path)
        rule = rules.get(name)
        if rule is None:
            out = _replicated(x, mesh)
        else:
            out = _stacked(x, *rule, mesh)
        local_shape = out.shape[1:] if rule is not None else out.shape
        if tuple(local_shape) != tuple(wanted.shape):
            raise ValueError(f"weight {'.'.join(map(str, name))}: a device of the {tp}-way split needs shape "
                             f"{tuple(wanted.shape)}, splitting gives {tuple(local_shape)} (no rule for this module?)")
        leaves.append(out)
        stacked.append(rule is not None)
    params = jax.tree.unflatten(treedef, leaves)
    return ShardedModel(cfg, graphdef, params, model.module_cls, tokenizer_path=model.tokenizer_path,
                        source=model.source, mesh=mesh, stacked=tuple(stacked), full_config=model.config)


def _name(path) -> tuple:
    """A pytree key path -> the param's module path, e.g. ("layers", 0, "self_attn", "q_proj", "weight")."""
    out = []
    for k in path:
        key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        out.append(key)
    return tuple(out[:-1]) if out and out[-1] == "value" else tuple(out)


def _replicated(x, mesh) -> jax.Array:
    """x on every device of the mesh (put per device: works when the mesh spans processes)."""
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, P()), lambda index: host[index])


def _stacked(x, axis: int, idx: list[np.ndarray], mesh) -> jax.Array:
    """[tp, *local]: row r = x's slice idx[r] along `axis`, on device r (P("tp")).

    The slices are cut on the host (numpy, one leaf at a time): no per-shape compilation, and
    each device receives only its own slice.
    """
    host = np.asarray(x)
    local = list(host.shape)
    local[axis] = len(idx[0])
    part = lambda index: np.stack([np.take(host, idx[r], axis=axis) for r in range(len(idx))[index[0]]])
    return jax.make_array_from_callback((len(idx), *local), NamedSharding(mesh, P(TP_AXIS)), part)


__all__ = ["ShardedModel", "shard_model"]
