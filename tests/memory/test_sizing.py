"""Sizing: budget -> rows, page counts, the bs=1 floor, the static split.  Pure arithmetic."""

from __future__ import annotations

import types

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from umem_jax.memory import (
    MHA,
    ChainAllocator,
    Full,
    LayerDecl,
    Part,
    full_attention,
    plan,
    recurrent_state,
    window_attention,
)
from umem_jax.memory.declarations import mamba2_state_tensors
from umem_jax.memory.sizing import (
    ArenaSizeError,
    budget_bytes,
    check_bs1_floor,
    compiled_temp_bytes,
    request_pages,
    size_arena,
    static_regions,
)
from umem_jax.models.presets import nemotronh_8b_like, tiny_hybrid

GiB, MiB = 2**30, 2**20


def _three_kinds(page_size=16):
    st_ = mamba2_state_tensors(num_heads=4, head_dim=16, state_size=16, n_groups=1, conv_kernel=4)
    return plan([full_attention(0, 2, 64), window_attention(1, 512, 2, 64), window_attention(2, 128, 2, 64),
                 recurrent_state(3, st_, checkpoint_interval=64)], page_size=page_size)


def _narrow(row_head_dim=24):
    # 48-byte rows: 4096 is not a multiple of the row size
    return plan([full_attention(0, 1, row_head_dim), window_attention(1, 64, 1, row_head_dim)], page_size=16)


# ------------------------------------------------------------------------------ rows


def test_rows_and_pages_alone():
    p = _three_kinds()
    s = size_arena(p, 10 * MiB)
    assert s.row_bytes == p.row_words * 2 == 256
    assert s.num_rows == 10 * MiB // 256 and s.nbytes == 10 * MiB
    assert s.sink_rows == p.sink_rows == 32
    for sp in p.subpools:
        assert s.pages_alone[sp.name] == sp.num_pages(s.num_rows) - p.first_page(sp)
        # the last page ends inside the arena, the first starts above the sink
        assert sp.page_row(p.first_page(sp) + s.pages_alone[sp.name]) <= s.num_rows
        assert sp.page_row(p.first_page(sp)) >= p.sink_rows
    # the state grid starts at the sink: its slots tile the rest of the arena
    assert s.pages_alone["state"] == (s.num_rows - p.sink_rows) // p.state.rows_per_page
    assert s.tokens_alone("full") == s.pages_alone["full"] * 16
    assert s.tokens_alone("state") == s.pages_alone["state"]  # state: one slot per page
    text = s.summary()
    for word in ("full", "window512", "window128", "state", "tokens", "state slots", f"{s.nbytes:,}"):
        assert word in text


def test_pages_alone_is_what_the_allocator_gives_when_the_full_grid_leaves_a_tail():
    """Three full layers make a full page of 3 * 16 * 2 = 96 rows, which no power-of-two arena is a
    multiple of: the rows above the full grid's last page belong to no page of it, and the empty
    full band sits at that page boundary, so no other band reaches past it either.  The capacity
    report ("each band alone") must count the slots and pages the allocator really hands out."""
    st_ = mamba2_state_tensors(num_heads=4, head_dim=16, state_size=16, n_groups=1, conv_kernel=4)
    p = plan([recurrent_state(0, st_), window_attention(1, 64, 2, 64)] + [full_attention(i, 2, 64) for i in (2, 3, 4)],
             page_size=16)
    s = size_arena(p, 2 * MiB)
    top = p.full.page_row(p.full.num_pages(s.num_rows))
    assert top < s.num_rows  # the case: a tail of rows past the full grid
    alloc = ChainAllocator(p, s.num_rows)
    slots = alloc.available_state_slots()
    assert s.pages_alone["state"] == slots and alloc.alloc_state_slots(slots) is not None
    assert alloc.alloc_state_slots(1) is None
    assert s.pages_alone["full"] == p.full.num_pages(s.num_rows) - p.first_page(p.full)  # the full band reaches it
    window = p["window64"]
    assert window.page_row(p.first_page(window) + s.pages_alone["window64"]) <= top


def test_floor_to_4096_and_row():
    p = _three_kinds()
    s = size_arena(p, 100 * 4096 + 4000)
    assert s.nbytes == 100 * 4096
    q = _narrow()
    assert q.row_words * 2 == 48
    s = size_arena(q, 10 * MiB + 777)
    assert s.nbytes % 4096 == 0 and s.nbytes % 48 == 0 and s.nbytes <= 10 * MiB + 777
    assert 10 * MiB + 777 - s.nbytes < 12288  # lcm(4096, 48): floored by less than one unit


def test_budget_bytes_cpu_and_fake_gpu():
    p = _narrow()
    cpu = types.SimpleNamespace(platform="cpu", memory_stats=lambda: None)
    with pytest.raises(ArenaSizeError, match="fixed_bytes"):
        budget_bytes(cpu)
    assert budget_bytes(cpu, fixed_bytes=10 * MiB + 5) == 10 * MiB
    assert budget_bytes(cpu, fixed_bytes=10 * MiB + 5, plan=p) % 12288 == 0

    gpu = types.SimpleNamespace(platform="gpu",
                                memory_stats=lambda: {"bytes_limit": 100 * GiB, "bytes_in_use": 16 * GiB})
    got = budget_bytes(gpu, fraction=0.9, temp_bytes=3 * GiB, reserve_bytes=GiB)
    assert got == (90 * GiB - 16 * GiB - 3 * GiB - GiB) // 4096 * 4096
    # explicit weights override the bytes in use; fixed_bytes overrides the measurement
    assert budget_bytes(gpu, fraction=1.0, weights_bytes=0) == 100 * GiB
    assert budget_bytes(gpu, fixed_bytes=5 * GiB) == 5 * GiB
    with pytest.raises(ArenaSizeError, match="gpu-memory-utilization"):
        budget_bytes(gpu, fraction=0.1)


def test_compiled_temp_bytes():
    c = lambda t: types.SimpleNamespace(memory_analysis=lambda: types.SimpleNamespace(temp_size_in_bytes=t))
    assert compiled_temp_bytes(c(10), c(300), c(7)) == 300
    assert compiled_temp_bytes() == 0


def test_large_arena_by_arithmetic():
    # more than 2**31 16-bit elements, fewer than 2**31 rows: sized exactly, nothing allocated
    p = plan(nemotronh_8b_like(), page_size=64)
    s = size_arena(p, 64 * GiB + 123)
    assert s.nbytes == 64 * GiB
    assert s.num_elements == 32 * GiB > 2**31
    assert s.num_rows < 2**31 and s.num_rows * p.row_words == s.num_elements
    assert s.pages_alone["full"] == s.num_rows // p.full.rows_per_page - p.first_page(p.full)
    s = size_arena(p, 1024 * GiB)  # a terabyte still fits int32 row ids with 2 KiB rows
    assert s.num_rows == 1024 * GiB // (p.row_words * 2)


def test_refuses_2_31_rows():
    p = plan([full_attention(0, 1, 8), window_attention(1, 64, 1, 8)], page_size=16)  # 16-byte rows
    assert p.row_words * 2 == 16
    size_arena(p, 16 * (2**31 - 1) // 4096 * 4096)  # just under: fine
    with pytest.raises(ArenaSizeError, match=r"int32 row ids.*row_words"):
        size_arena(p, 32 * GiB)


def test_measured_budget_stops_at_2_31_rows():
    """A budget measured from a large device (100 GiB free) for 16-byte rows would be 6.7e9 rows,
    which size_arena refuses (int32 row ids), so the engine could not start on the bigger card.
    Measured budgets stop at the most rows the ids address; an explicit fixed_bytes is kept as
    given (and refused by size_arena, which says why)."""
    p = plan([full_attention(0, 1, 8), window_attention(1, 64, 1, 8)], page_size=16)  # 16-byte rows
    gpu = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 100 * GiB, "bytes_in_use": 0})
    got = budget_bytes(gpu, fraction=1.0, plan=p)
    s = size_arena(p, got)
    assert s.num_rows <= 2**31 - 1 and s.num_rows > 2**31 - 1 - 4096  # all the rows ids can address
    assert got % 4096 == 0 and got % 16 == 0
    assert budget_bytes(gpu, fraction=1.0, plan=_three_kinds()) == 100 * GiB  # wide rows: nothing capped
    assert budget_bytes(gpu, fixed_bytes=32 * GiB, plan=p) == 32 * GiB


def test_refuses_below_one_page_each():
    p = _three_kinds()
    with pytest.raises(ArenaSizeError, match="sink plus one page"):
        size_arena(p, 8192)


# ---------------------------------------------------------------------------- bs=1 floor


def test_request_pages():
    p = _three_kinds(page_size=16)
    need = request_pages(p, 4096)
    assert need == {"state": 3, "window512": 512 // 16 + 1, "window128": 128 // 16 + 1, "full": 256}
    short = request_pages(p, 100, checkpoint_slots=0)  # windows capped at the request's own pages
    assert short == {"state": 1, "window512": 7, "window128": 7, "full": 7}


def test_bs1_floor_exact_and_message():
    p = _three_kinds()
    need = request_pages(p, 4096)
    # chain layout: sink, state, window512, window128 grown up; full at the top
    rows = p.sink_rows + need["state"] * p.state.rows_per_page  # the state grid starts at the sink
    for name in ("window512", "window128"):
        rpp = p[name].rows_per_page
        rows = -(-rows // rpp) * rpp + need[name] * rpp
    rows = (-(-rows // p.full.rows_per_page) + need["full"]) * p.full.rows_per_page
    check_bs1_floor(p, rows, max_model_len=4096)
    with pytest.raises(ArenaSizeError) as e:
        check_bs1_floor(p, rows - 1, max_model_len=4096)
    msg = str(e.value)
    for text in ("bs=1", "max_model_len=4,096", f"{rows * 256:,} B", f"{(rows - 1) * 256:,} B",
                 "--gpu-memory-utilization", "--max-model-len", "page size", "checkpoint count",
                 "3 state slots (working + 2 checkpoints)", "window 512 + 1 page", "256 pages"):
        assert text in msg, text
    # the "at most N fits" it names really is the largest context that fits
    fits = int(msg.split("at most ")[1].split(" fits")[0].replace(",", ""))
    check_bs1_floor(p, rows - 1, max_model_len=fits)
    with pytest.raises(ArenaSizeError):
        check_bs1_floor(p, rows - 1, max_model_len=fits + p.page_size)


def test_size_arena_checks_floor():
    p = _three_kinds()
    with pytest.raises(ArenaSizeError, match="bs=1"):
        size_arena(p, 1 * MiB, max_model_len=32768)
    size_arena(p, 64 * MiB, max_model_len=32768)


# ---------------------------------------------------------------------------- static split


def _check_regions(p, num_rows, regions):
    assert list(regions) == list(p.names)  # chain order
    prev_hi = p.sink_rows
    for sp in p.subpools:
        lo, hi = regions[sp.name]
        assert (lo - sp.base_row) % sp.rows_per_page == 0 and (hi - sp.base_row) % sp.rows_per_page == 0  # on its grid
        assert prev_hi <= lo < hi <= num_rows  # above the sink, no overlap, inside
        assert lo - prev_hi < sp.rows_per_page  # no page-sized gap left unused
        prev_hi = hi
    assert num_rows - prev_hi < p.full.rows_per_page  # the full region takes the top


@settings(max_examples=40, deadline=None)
@given(mb=st.integers(2, 4096), swa=st.floats(0.1, 4.0), mamba=st.floats(0.1, 4.0))
@example(mb=207, swa=3.557945297641679, mamba=1.3802400636755896)
def test_static_regions_tile_and_ratios(mb, swa, mamba):
    p = _three_kinds()
    s = size_arena(p, mb * MiB)
    r = static_regions(p, s.num_rows, swa_full_tokens_ratio=swa, mamba_full_memory_ratio=mamba)
    _check_regions(p, s.num_rows, r)
    pages = {sp.name: (r[sp.name][1] - r[sp.name][0]) // sp.rows_per_page for sp in p.subpools}
    full_tokens = pages["full"] * 16
    win = {n: pages[n] * 16 for n in ("window512", "window128")}
    state_bytes = pages["state"] * p.state.entry_bytes
    # Ratios hold up to page rounding: a page (or slot) of the region itself, and the full region
    # takes the rows left over, so it moves by up to one page of every other region (in rows) plus
    # one of its own (hypothesis found 2.2 full pages with a 19-row state slot and two windows).
    others = sum(sp.rows_per_page for sp in p.subpools if sp.name != "full")
    slack = (1.0 + others / p.full.rows_per_page) / max(pages["full"], 1)
    tol = lambda n: 1.0 / max(n, 1) + slack
    assert abs(sum(win.values()) / full_tokens - swa) <= swa * (tol(pages["window128"]) + tol(pages["window512"]))
    assert abs(state_bytes / (full_tokens * p.full.entry_bytes) - mamba) <= mamba * tol(pages["state"])
    # several windows share in proportion to their lengths (512 : 128)
    if pages["window128"] >= 20:
        assert abs(win["window512"] / win["window128"] - 4.0) <= 4.0 * 2 * tol(pages["window128"])


def test_static_regions_defaults_and_summary():
    p = plan(tiny_hybrid(), page_size=16)
    s = size_arena(p, 64 * MiB)
    r = static_regions(p, s.num_rows)
    _check_regions(p, s.num_rows, r)
    text = s.summary(r)
    assert "static rows" in text and "static capacity" in text
    check_bs1_floor(p, s.num_rows, max_model_len=4096, static_regions=r)
    with pytest.raises(ArenaSizeError, match="static split"):
        check_bs1_floor(p, s.num_rows, max_model_len=10**6, static_regions=r)


def test_static_regions_two_kinds_and_too_small():
    p = plan([full_attention(0, 2, 64), window_attention(1, 256, 2, 64)], page_size=16)  # no state
    s = size_arena(p, 8 * MiB)
    r = static_regions(p, s.num_rows, swa_full_tokens_ratio=0.5)
    _check_regions(p, s.num_rows, r)
    w, f = ((r[n][1] - r[n][0]) for n in ("window256", "full"))
    assert abs(w / f - 0.5) < 0.01
    with pytest.raises(ArenaSizeError, match="no page"):
        static_regions(p, s.num_rows, swa_full_tokens_ratio=1e-6)


def test_fp32_kv_rows_size():
    # fp32 KV: each row is two planes, so rows are twice the words
    p = plan([LayerDecl(0, (Part(MHA(2, 64, dtype="float32"), Full()),)), window_attention(1, 64, 2, 128)],
             page_size=16)
    s = size_arena(p, 4 * MiB)
    assert s.nbytes == 4 * MiB and s.pages_alone["full"] == s.num_rows // p.full.rows_per_page - p.first_page(p.full)
