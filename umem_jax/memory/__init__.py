"""Host-side memory code: declarations -> plan -> sizing -> allocators and tables."""

from .band import EndBand
from .chain import ArenaUsage, ChainAllocator, Shortfall, SubPoolUsage
from .declarations import (
    MHA,
    MLA,
    Full,
    LayerDecl,
    Part,
    State,
    StateGeometry,
    StateTensor,
    Window,
    full_attention,
    gated_deltanet_state_tensors,
    mamba2_state_tensors,
    recurrent_state,
    window_attention,
)
from .floating import FloatBand
from .plan import KVRows, KVView, Plan, PlanError, StateRows, StateView, SubPool, plan
from .sizing import ArenaSize, ArenaSizeError, budget_bytes, check_bs1_floor, size_arena, static_regions
from .tables import IdPool, Move, PageTable, ordered_batches

__all__ = [
    "MHA",
    "MLA",
    "ArenaSize",
    "ArenaSizeError",
    "ArenaUsage",
    "ChainAllocator",
    "EndBand",
    "FloatBand",
    "Full",
    "IdPool",
    "KVRows",
    "KVView",
    "LayerDecl",
    "Move",
    "PageTable",
    "Part",
    "Plan",
    "PlanError",
    "Shortfall",
    "State",
    "StateGeometry",
    "StateRows",
    "StateTensor",
    "StateView",
    "SubPool",
    "SubPoolUsage",
    "Window",
    "budget_bytes",
    "check_bs1_floor",
    "full_attention",
    "gated_deltanet_state_tensors",
    "mamba2_state_tensors",
    "ordered_batches",
    "plan",
    "recurrent_state",
    "size_arena",
    "static_regions",
    "window_attention",
]
