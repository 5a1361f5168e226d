"""Static views of where one layer's rows sit in the arena, for kernels (hashable: static
arguments of jitted functions).  plan.py builds them; its docstring describes the layout."""

from __future__ import annotations

import dataclasses

from .declarations import StateTensor


@dataclasses.dataclass(frozen=True)
class KVRows:
    """Where one attention layer's rows sit inside a page envelope (row offsets)."""

    k_row: int  # first row of this layer's K tile
    v_row: int  # first row of its V tile (== k_row for MLA, which has no V)
    k_rows_per_token: int  # arena rows of one token's K row
    v_rows_per_token: int  # of its V row (0 for MLA)


@dataclasses.dataclass(frozen=True)
class StateRows:
    """Where one state tensor of one layer sits inside a state slot."""

    row: int  # first row of the first plane
    planes: int  # 1 for 16-bit dtypes, 2 for fp32 (hi plane then lo plane)
    rows_per_plane: int  # ceil(numel / row_words); the last row is zero-padded
    tensor: StateTensor


@dataclasses.dataclass(frozen=True)
class KVView:
    """Static description of one attention layer's rows in its sub-pool, for kernels.

    K row of token t of physical page p: arena rows
    `p*rows_per_page + k_row + t*mk ... + mk` (mk = k_words // row_words), likewise V.
    Hashable, so it can be a static argument of jitted functions.
    """

    rows_per_page: int
    page_size: int
    k_row: int
    v_row: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    row_words: int
    planes: int = 1  # 1: bf16/fp16 rows; 2: fp32 rows stored as [hi plane | lo plane]
    fp8: bool = False  # float8 e4m3 rows (planes == 1): two values per word, half a plane (words.py)

    def head_words(self, dim: int) -> int:
        """Words one kv head of `dim` values takes in one plane: dim, or dim / 2 for fp8."""
        return dim // 2 if self.fp8 else dim

    @property
    def k_words(self) -> int:
        """Words of one token's K row, every head and plane."""
        return self.planes * self.num_kv_heads * self.head_words(self.head_dim)

    @property
    def v_words(self) -> int:
        return self.planes * self.num_kv_heads * self.head_words(self.v_head_dim)

    @property
    def mk(self) -> int:
        """Arena rows of one token's K row (the kernels' stride per token)."""
        return self.k_words // self.row_words

    @property
    def mv(self) -> int:
        """Arena rows of one token's V row."""
        return self.v_words // self.row_words


@dataclasses.dataclass(frozen=True)
class StateView:
    """Static description of one layer's state tensors in a state slot, for kernels.

    Tensor `name` of the layer in physical slot s >= 1: plane k (0 = hi or only, 1 = lo) is arena
    rows `base_row + s*rows_per_slot + row + k*rows_per_plane ... + rows_per_plane`, flattened
    row-major, zero-padded to whole rows.  Slot 0 is padding and has no rows (with a negative
    base_row its would-be rows start below row 0): never compute its rows unmasked.
    """

    rows_per_slot: int
    row_words: int
    tensors: tuple[StateRows, ...]
    base_row: int = 0  # first row of slot 0's grid position (SubPool.base_row)

    def slot_row(self, slot: int) -> int:
        """First arena row of real slot `slot` (>= 1)."""
        return self.base_row + slot * self.rows_per_slot

    def __getitem__(self, name: str) -> StateRows:
        for t in self.tensors:
            if t.tensor.name == name:
                return t
        raise KeyError(name)


__all__ = ["KVRows", "KVView", "StateRows", "StateView"]
