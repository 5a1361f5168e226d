"""Plan: group declared parts into sub-pools, order them into the chain, lay out entries.

The arena is `[num_rows, row_words]` 16-bit words.  Every sub-pool sees the arena as its own
grid of pages: physical page p of sub-pool s is rows `[s.page_row(p), s.page_row(p + 1))`, with
`s.page_row(p) = s.base_row + p * s.rows_per_page`.  Paged (K/V) grids start at row 0
(base_row 0), so their page 0 lies inside the sink.  The state grid is offset so that slot 1
starts right at the sink: base_row = sink_rows - rows_per_slot (negative when a slot is larger
than the sink).  Slot 0 is never addressed (kernels treat it as a padding lane that reads zeros
and writes nothing), so the sink is the largest *paged* page and no state slot is spent on it.
A page envelope is contiguous rows holding every layer of the sub-pool for `page_size` entries,
layer-major inside:

    KV page (page_size tokens):  [L0 K: page_size*mk rows][L0 V: page_size*mv rows][L1 K]...[L(n-1) V]
    state slot (one request):    [L0 t0 hi][L0 t0 lo][L0 t1 ...]...            (fp32 as 2 planes)

where a K row of one token is `mk = k_words / row_words` arena rows (mk = 1 whenever the K row
width is the arena row width, the common case) and a V row `mv` rows.  `row_words` defaults to the gcd of all
attention row widths so every attention row is a whole number of arena rows.

The chain orders sub-pools low to high bytes by retention: state, windows longest first, full.
The first takes the grow-up end, the last the grow-down end, the rest float between them.
"""

from __future__ import annotations

import dataclasses
import math
from functools import reduce

from .declarations import (
    MHA,
    SSM_STATE_TENSORS,
    WORD_BYTES,
    Full,
    LayerDecl,
    State,
    StateGeometry,
    Window,
    dtype_planes,
    is_fp8,
)
from .views import KVRows, KVView, StateRows, StateView

ROW_ALIGN_BYTES = 16


class PlanError(ValueError):
    """A model or option combination the arena refuses; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class SubPool:
    """All parts with one lifetime and one allocation unit, in one band of the arena."""

    name: str
    kind: str  # "state" | "window" | "full"
    lifetime: object
    geometry: object
    layers: tuple[tuple[str, int], ...]  # (model, layer index), in storage order
    page_size: int  # entries per page; 1 for state
    row_words: int
    rows_per_entry: int
    role: str  # "up" | "float" | "down"
    kv: tuple[KVRows, ...] = ()
    state: tuple[tuple[StateRows, ...], ...] = ()
    base_row: int = 0  # row of page 0 on this grid: 0, or the state grid's offset (Plan places it)

    @property
    def rows_per_page(self) -> int:
        return self.page_size * self.rows_per_entry

    def page_row(self, page: int) -> int:
        """First arena row of physical page `page` (works on numpy arrays too)."""
        return self.base_row + page * self.rows_per_page

    def page_ceil(self, row: int) -> int:
        """The first page of this grid starting at or above `row`."""
        return -(-(row - self.base_row) // self.rows_per_page)

    def page_floor(self, row: int) -> int:
        """The end of the pages ending at or below `row`: pages [.., page_floor(row)) lie below it."""
        return (row - self.base_row) // self.rows_per_page

    def num_pages(self, num_rows: int) -> int:
        """Pages of this grid inside an arena of `num_rows` rows, page 0 included."""
        return self.page_floor(num_rows)

    @property
    def entry_bytes(self) -> int:
        return self.rows_per_entry * self.row_words * WORD_BYTES

    @property
    def page_bytes(self) -> int:
        return self.rows_per_page * self.row_words * WORD_BYTES

    @property
    def window(self) -> int | None:
        return self.lifetime.window if isinstance(self.lifetime, Window) else None

    def _index(self, layer, model: str = "target") -> int:
        key = (model, layer)
        try:
            return self.layers.index(key)
        except ValueError:
            raise KeyError(f"sub-pool {self.name} holds no layer {model}:{layer}") from None

    def kv_rows(self, layer: int, model: str = "target") -> KVRows:
        if not self.kv:
            raise KeyError(f"sub-pool {self.name} holds no attention rows")
        return self.kv[self._index(layer, model)]

    def kv_view(self, layer: int, model: str = "target") -> KVView:
        rows, geometry = self.kv_rows(layer, model), self.geometry
        if not isinstance(geometry, MHA):
            raise NotImplementedError(f"kv_view of {geometry.describe()}")
        fp8 = is_fp8(geometry.dtype)
        return KVView(self.rows_per_page, self.page_size, rows.k_row, rows.v_row, geometry.num_kv_heads,
                      geometry.head_dim, geometry.v_head_dim or geometry.head_dim, self.row_words,
                      1 if fp8 else dtype_planes(geometry.dtype), fp8)

    def state_view(self, layer: int, model: str = "target") -> StateView:
        if not self.state:
            raise KeyError(f"sub-pool {self.name} holds no state")
        return StateView(self.rows_per_entry, self.row_words, self.state[self._index(layer, model)], self.base_row)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chain of sub-pools, low bytes to high, and the arena row shape."""

    subpools: tuple[SubPool, ...]
    row_words: int
    page_size: int

    def __post_init__(self):
        # Place the state grid: slot 1 starts at the sink (see the module docstring).
        state = self.subpools[0]
        if state.kind == "state":
            base = self.sink_rows - state.rows_per_page
            if state.base_row != base:
                object.__setattr__(self, "subpools", (dataclasses.replace(state, base_row=base), *self.subpools[1:]))

    @property
    def sink_rows(self) -> int:
        """Lowest rows: physical page 0 of every paged sub-pool, whose padding rows write there;
        so the largest paged page.  The state grid's slot 0 needs no rows (state kernels never
        touch it): its slot 1 starts right here."""
        return max(sp.rows_per_page for sp in self.subpools if sp.kind != "state")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sp.name for sp in self.subpools)

    def __getitem__(self, name: str) -> SubPool:
        for sp in self.subpools:
            if sp.name == name:
                return sp
        raise KeyError(f"no sub-pool {name!r}; the plan has {list(self.names)}")

    @property
    def full(self) -> SubPool:
        return self.subpools[-1]

    @property
    def windows(self) -> tuple[SubPool, ...]:
        return tuple(sp for sp in self.subpools if sp.kind == "window")

    @property
    def state(self) -> SubPool | None:
        return self.subpools[0] if self.subpools[0].kind == "state" else None

    @property
    def token_pools(self) -> tuple[SubPool, ...]:
        """Sub-pools a token page is allocated in, under one virtual page id (full first)."""
        return (self.full, *self.windows)

    def first_page(self, sp: SubPool) -> int:
        """First physical page of `sp` above the sink (1 for the state grid)."""
        return sp.page_ceil(self.sink_rows)

    def table(self) -> str:
        head = ("sub-pool", "kind", "layers", "entry bytes", "page bytes", "place", "direction")
        rows = []
        for sp in self.subpools:
            place = {"up": "low end", "down": "high end", "float": "float"}[sp.role]
            direction = {"up": "grows up", "down": "grows down", "float": "between neighbours"}[sp.role]
            rows.append((sp.name, sp.kind, _layer_list(sp.layers), f"{sp.entry_bytes:,}", f"{sp.page_bytes:,}",
                         place, direction))
        widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
        out = [line(head), line(tuple("-" * w for w in widths)), *map(line, rows)]
        out.append(f"arena rows of {self.row_words} x 16-bit words ({self.row_words * WORD_BYTES} B); "
                   f"page size {self.page_size} tokens; sink {self.sink_rows} rows")
        kv_dtypes = sorted({sp.geometry.dtype for sp in self.subpools if isinstance(sp.geometry, MHA)})
        if any(is_fp8(d) for d in kv_dtypes):
            out.append("K/V stored as float8 e4m3 (two values per 16-bit word, per-layer scales): half the "
                       "entry bytes of bf16")
        ssm = sorted({t.dtype for t in self.state.geometry.tensors if t.name in SSM_STATE_TENSORS}) if self.state else []
        if ssm and ssm != ["float32"]:
            out.append(f"recurrent state stored as {'/'.join(ssm)} (one 16-bit plane, computed in fp32): half the "
                       "bytes of an fp32 state")
        return "\n".join(out)


def _layer_list(layers) -> str:
    models = sorted({m for m, _ in layers})
    parts = []
    for m in models:
        idx = sorted(i for mm, i in layers if mm == m)
        runs, start, prev = [], idx[0], idx[0]
        for i in idx[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            if i is not None:
                start = prev = i
        text = ",".join(runs)
        parts.append(text if m == "target" else f"{m}:{text}")
    s = " ".join(parts)
    return s if len(s) <= 40 else s[:37] + "..."


def _kind(lifetime) -> str:
    return {Full: "full", Window: "window", State: "state"}[type(lifetime)]


def _pool_key(lifetime):
    # State parts form one sub-pool whatever their interval (checked below); windows split by length.
    return ("state",) if isinstance(lifetime, State) else (_kind(lifetime), getattr(lifetime, "window", 0))


def _chain_order(key) -> tuple[int, int]:
    """Low bytes to high by retention: state, windows longest first, full."""
    if key[0] == "state":
        return (0, 0)
    if key[0] == "window":
        return (1, -key[1])
    return (2, 0)


def plan(decls: list[LayerDecl], page_size: int = 16, row_words: int | None = None) -> Plan:
    """Group `decls` into the chain of sub-pools, or refuse with a PlanError that says why."""
    if page_size <= 0 or page_size & (page_size - 1):
        raise PlanError(f"page_size must be a power of two, got {page_size}")
    groups: dict[tuple, list] = {}
    for d in decls:
        for p in d.parts:
            groups.setdefault(_pool_key(p.lifetime), []).append((d, p))
    _refuse_unsupported(groups)
    row_words = _arena_row_words(groups, row_words)
    keys = sorted(groups, key=_chain_order)
    roles = ["up"] + ["float"] * (len(keys) - 2) + ["down"]
    subpools = tuple(_subpool(key, groups[key], role, page_size, row_words) for key, role in zip(keys, roles))
    return Plan(subpools, row_words, page_size)


def _refuse_unsupported(groups: dict[tuple, list]) -> None:
    """Raise a PlanError naming the cause and what to do, for groups the arena cannot hold."""
    if len(groups) < 2:
        only = next(iter(groups))[0] if groups else "nothing"
        raise PlanError(
            f"not a hybrid model: every layer keeps {only} memory, so there is only one kind of memory to "
            "share. Unified memory replaces the pools of hybrid models only; serve this model with an "
            "engine built for that one kind (paged attention, or a state-space model's own server)."
        )
    if ("full", 0) not in groups:
        raise PlanError(
            "no full-attention owner: no layer keeps full-attention KV. The full sub-pool mints the "
            "virtual page ids and takes the grow-down end of the arena; a model with only window and "
            "state layers is not supported."
        )
    for key, members in groups.items():
        geometries = {p.geometry for _, p in members}
        if len(geometries) > 1:
            by = {}
            for d, p in members:
                layer = f"{d.model}:{d.layer}" if d.model != "target" else str(d.layer)
                by.setdefault(p.geometry.describe(), []).append(layer)
            desc = "; ".join(f"{g} in layers {','.join(v[:6])}" for g, v in by.items())
            label = key[0] + (str(key[1]) if key[1:] and key[1] else "")  # the state key is ("state",)
            raise PlanError(
                f"two geometries in one sub-pool ({label}): {desc}. One sub-pool holds one "
                "geometry; give these layers a common geometry (same kv heads and head dims) or a "
                "different lifetime."
            )
        if key == ("state",):
            intervals = {p.lifetime.checkpoint_interval for _, p in members}
            if len(intervals) > 1:
                raise PlanError(f"state layers declare different checkpoint intervals {sorted(intervals)}; use one")
    for members in groups.values():
        geometry = members[0][1].geometry
        for words in geometry.row_words:
            if (words * WORD_BYTES) % ROW_ALIGN_BYTES:
                fix = ("Store its K/V as bf16 (kv_cache_dtype 'auto' or 'bfloat16': twice the bytes per row)."
                       if is_fp8(getattr(geometry, "dtype", "")) else "Serve this model without unified memory "
                       "(--memory-mode static does not lift this either).")
                raise PlanError(
                    f"row size of {geometry.describe()} is {words * WORD_BYTES} bytes, not a multiple of "
                    f"{ROW_ALIGN_BYTES}: the arena lays rows out in 16-byte units. {fix}"
                )


def _arena_row_words(groups: dict[tuple, list], row_words: int | None) -> int:
    """The arena row width: `row_words` if given and valid, else the gcd of every attention row."""
    attention_widths = [w for members in groups.values() for w in members[0][1].geometry.row_words]
    if row_words is None:
        row_words = reduce(math.gcd, attention_widths)
    elif any(w % row_words for w in attention_widths):
        raise PlanError(f"row_words={row_words} does not divide the attention row widths "
                        f"{sorted(set(attention_widths))}")
    if (row_words * WORD_BYTES) % ROW_ALIGN_BYTES:
        raise PlanError(f"arena row of {row_words} words is not a multiple of {ROW_ALIGN_BYTES} bytes")
    return row_words


def _subpool(key, members: list, role: str, page_size: int, row_words: int) -> SubPool:
    """The sub-pool of one group of parts, its entries laid out layer-major."""
    lifetime, geometry = members[0][1].lifetime, members[0][1].geometry
    layers = tuple(sorted({(d.model, d.layer) for d, _ in members}, key=lambda x: (x[0] != "target", x)))
    name = "state" if key[0] == "state" else ("full" if key[0] == "full" else f"window{key[1]}")
    if isinstance(geometry, StateGeometry):
        slots, row = [], 0
        for _ in layers:
            layer_rows = []
            for t in geometry.tensors:
                rows_per_plane = -(-t.numel // row_words)
                layer_rows.append(StateRows(row, t.planes, rows_per_plane, t))
                row += t.planes * rows_per_plane
            slots.append(tuple(layer_rows))
        return SubPool(name, "state", lifetime, geometry, layers, 1, row_words, row, role, state=tuple(slots))
    k_rows = geometry.row_words[0] // row_words  # arena rows of one token's K row
    v_rows = geometry.row_words[1] // row_words if isinstance(geometry, MHA) else 0  # MLA: V is a slice of K
    per_layer = page_size * (k_rows + v_rows)
    kv = tuple(KVRows(j * per_layer, j * per_layer + page_size * k_rows if v_rows else j * per_layer, k_rows, v_rows)
               for j in range(len(layers)))
    return SubPool(name, _kind(lifetime), lifetime, geometry, layers, page_size, row_words,
                   len(layers) * (k_rows + v_rows), role, kv=kv)


__all__ = ["KVRows", "KVView", "Plan", "PlanError", "StateRows", "StateView", "SubPool", "plan"]
