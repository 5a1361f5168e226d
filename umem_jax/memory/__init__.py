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
