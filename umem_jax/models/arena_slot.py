"""Where one layer's memory lives in the arena, found once per layer (statically) from the plan.

    slot = arena_slot(plan, layer, impl=..., interpret=...)
    y, arena = mixer(x, arena, batch, slot)      # Attention, Mamba2Mixer, GatedDeltaNet

The same lookup serves attention layers (their K/V rows in a window or full sub-pool) and
recurrent layers (their state tensors in the state sub-pool).
"""

from __future__ import annotations

import dataclasses

from ..memory.plan import KVView, Plan, StateView


@dataclasses.dataclass(frozen=True)
class ArenaSlot:
    """One layer's sub-pool (its name is the page_tables key) and its view there (KVView for K/V
    rows, StateView for state tensors), plus which kernel implementation to call (None: the
    kernels' default, Pallas on GPU)."""

    pool: str
    view: KVView | StateView
    impl: str | None = None
    interpret: bool = False
    # every row of the step decodes, also with T > 1 tokens (a speculative verify): mixers apply
    # no prefill-only rule (Mamba2's dt clamp) to any row
    decode_rows: bool = False

    @property
    def kernel_kw(self) -> dict:
        return {"impl": self.impl, "interpret": self.interpret}

    @property
    def fp8(self) -> bool:
        """Whether this layer's K/V rows are fp8 (then its kernels take the layer's k/v scales)."""
        return isinstance(self.view, KVView) and self.view.fp8


def arena_slot(plan: Plan, layer: int, model: str = "target", **kernel_kw) -> ArenaSlot:
    """Find the sub-pool holding `layer`'s memory (K/V rows or state tensors) and its view there."""
    pools = [pool for pool in plan.subpools if (model, layer) in pool.layers]
    if not pools:
        raise KeyError(f"the plan holds no memory for layer {model}:{layer}")
    if len(pools) > 1:
        raise KeyError(f"layer {model}:{layer} keeps parts in several sub-pools ({[p.name for p in pools]}); "
                       "a mixer reads one")
    pool = pools[0]
    view = pool.kv_view(layer, model) if pool.kv else pool.state_view(layer, model)
    return ArenaSlot(pool.name, view, **kernel_kw)


__all__ = ["ArenaSlot", "arena_slot"]
