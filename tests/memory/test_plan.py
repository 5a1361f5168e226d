"""Planning: chain order, roles, entry layout and refusals."""

import pytest

from umem_jax.memory import (
    MHA,
    Full,
    LayerDecl,
    Part,
    PlanError,
    State,
    StateGeometry,
    StateTensor,
    Window,
    full_attention,
    gated_deltanet_state_tensors,
    mamba2_state_tensors,
    plan,
    recurrent_state,
    window_attention,
)


def gemma_like(n=12, window=512, kv=4, hd=256):
    return [full_attention(i, kv, hd) if i % 6 == 5 else window_attention(i, window, kv, hd) for i in range(n)]


def mamba_like(n=8, kv=8, hd=128):
    st = mamba2_state_tensors(num_heads=16, head_dim=64, state_size=128, n_groups=2, conv_kernel=4)
    return [full_attention(i, kv, hd) if i % 4 == 3 else recurrent_state(i, st, checkpoint_interval=256) for i in range(n)]


def test_swa_full_longest_window_takes_low_end():
    p = plan(gemma_like(), page_size=16)
    assert p.names == ("window512", "full")
    assert [sp.role for sp in p.subpools] == ["up", "down"]
    assert p.state is None and p.full.layers == (("target", 5), ("target", 11))
    assert p.row_words == 4 * 256


def test_state_full():
    p = plan(mamba_like(), page_size=16)
    assert p.names == ("state", "full")
    assert p.state.page_size == 1 and p.state.role == "up" and p.full.role == "down"
    assert len(p.state.layers) == 6


def test_state_window_full_window_floats():
    st = mamba2_state_tensors(4, 16, 16, 1, 4)
    decls = [window_attention(0, 64, 2, 64), recurrent_state(1, st), full_attention(2, 2, 64)]
    p = plan(decls, page_size=8)
    assert p.names == ("state", "window64", "full")
    assert [sp.role for sp in p.subpools] == ["up", "float", "down"]


def test_two_windows_ordered_longest_first_and_draft_window_adds_subpool():
    decls = gemma_like(6, window=1024, kv=2, hd=64)
    decls.append(window_attention(0, 128, 2, 64, model="draft"))
    p = plan(decls, page_size=16)
    assert p.names == ("window1024", "window128", "full")
    assert [sp.role for sp in p.subpools] == ["up", "float", "down"]
    assert p["window128"].layers == (("draft", 0),)
    # A draft layer with the target's window joins the target's sub-pool.
    decls.append(window_attention(1, 1024, 2, 64, model="draft"))
    assert ("draft", 1) in plan(decls)["window1024"].layers


def test_layer_with_attention_and_state_parts():
    st = gated_deltanet_state_tensors(2, 4, 16, 16, 4)
    both = LayerDecl(1, (Part(MHA(2, 64), Full()), Part(StateGeometry(st), State(64))))
    p = plan([window_attention(0, 32, 2, 64), both])
    assert p.names == ("state", "window32", "full")
    assert p.state.layers == (("target", 1),) and p.full.layers == (("target", 1),)


def test_kv_layout_is_layer_major_and_tiles_the_envelope():
    p = plan(gemma_like(12, kv=2, hd=64), page_size=16)
    sp = p["window512"]
    rows = set()
    for m, layer in sp.layers:
        r = sp.kv_rows(layer)
        for base, m_ in ((r.k_row, r.k_rows_per_token), (r.v_row, r.v_rows_per_token)):
            block = set(range(base, base + sp.page_size * m_))
            assert not rows & block
            rows |= block
    assert rows == set(range(sp.rows_per_page))
    v = sp.kv_view(0)
    assert (v.mk, v.mv, v.k_row, v.v_row) == (1, 1, 0, 16)
    assert sp.page_bytes == 16 * 10 * 2 * 2 * 64 * 2


def test_asymmetric_kv_and_gcd_row():
    decls = [LayerDecl(0, (Part(MHA(2, 192, 128), Window(64)),)), LayerDecl(1, (Part(MHA(2, 192, 128), Full()),))]
    p = plan(decls, page_size=4)
    assert p.row_words == 128  # gcd(384, 256)
    v = p.full.kv_view(1)
    assert (v.mk, v.mv) == (3, 2) and v.v_row == 4 * 3


def test_state_layout_planes_and_padding():
    st = (StateTensor("conv", (3, 100), "bfloat16"), StateTensor("ssm", (2, 8, 16), "float32"))
    p = plan([recurrent_state(0, st), full_attention(1, 1, 64)])
    sv = p.state.state_view(0)
    conv, ssm = sv["conv"], sv["ssm"]
    assert p.row_words == 64
    assert (conv.row, conv.planes, conv.rows_per_plane) == (0, 1, 5)  # 300 words -> 5 rows of 64
    assert (ssm.row, ssm.planes, ssm.rows_per_plane) == (5, 2, 4)  # 256 fp32 -> 2 planes x 4 rows
    assert sv.rows_per_slot == 13 and p.state.rows_per_page == 13


@pytest.mark.parametrize("decls", [mamba_like(), gemma_like(),
                                   # a state slot smaller than the K/V page: its grid starts above row 0
                                   [recurrent_state(0, (StateTensor("s", (64,), "float32"),)), full_attention(1, 2, 64)]],
                         ids=["state-larger", "no-state", "state-smaller"])
def test_sink_is_the_largest_paged_page_and_slot_one_starts_at_it(decls):
    """The sink holds page 0 of every paged (K/V) sub-pool, not a state slot: the state grid is
    offset so that slot 1 starts right at the sink (slot 0 is never addressed)."""
    p = plan(decls, page_size=16)
    assert p.sink_rows == max(sp.rows_per_page for sp in p.subpools if sp.kind != "state")
    for sp in p.subpools:
        first = p.first_page(sp)
        assert sp.page_row(first) >= p.sink_rows > sp.page_row(first - 1)
        assert sp.page_ceil(sp.page_row(first)) == first == sp.page_floor(sp.page_row(first + 1) - 1)
        if sp.kind == "state":
            assert first == 1 and sp.page_row(1) == p.sink_rows == sp.base_row + sp.rows_per_page
            assert sp.state_view(sp.layers[0][1]).slot_row(1) == p.sink_rows
        else:
            assert sp.base_row == 0
    if p.state is not None:
        assert p.state.rows_per_page != p.sink_rows  # both signs of the offset are covered


def test_table_names_every_column():
    text = plan(mamba_like()).table()
    for word in ("sub-pool", "kind", "layers", "entry bytes", "page bytes", "place", "direction",
                 "state", "full", "grows up", "grows down", "low end", "high end"):
        assert word in text


@pytest.mark.parametrize(
    "decls, match",
    [
        ([full_attention(i, 2, 64) for i in range(4)], "not a hybrid model"),
        ([window_attention(i, 64, 2, 64) for i in range(4)], "not a hybrid model"),
        ([window_attention(0, 64, 2, 64), recurrent_state(1, mamba2_state_tensors(4, 16, 16, 1, 4))],
         "no full-attention owner"),
        ([window_attention(0, 64, 2, 64), full_attention(1, 2, 64), full_attention(2, 4, 64)], "two geometries"),
        ([window_attention(0, 64, 1, 4), full_attention(1, 1, 4)], "not a multiple of 16"),
        # two state geometries (Mamba2 beside gated DeltaNet, or a draft's other state): the
        # state key has no window length, which the message once indexed (IndexError)
        ([recurrent_state(0, mamba2_state_tensors(4, 16, 16, 1, 4)),
          recurrent_state(1, gated_deltanet_state_tensors(2, 4, 16, 16, 4)), full_attention(2, 2, 64)],
         r"two geometries in one sub-pool \(state\)"),
    ],
)
def test_refusals_name_the_cause(decls, match):
    with pytest.raises(PlanError, match=match):
        plan(decls)


def test_bad_page_size_and_row_words():
    with pytest.raises(PlanError, match="power of two"):
        plan(gemma_like(), page_size=12)
    with pytest.raises(PlanError, match="does not divide"):
        plan(gemma_like(kv=1, hd=64), row_words=48)


def test_state_and_attention_lifetimes_must_match_geometry():
    with pytest.raises(ValueError, match="State lifetime"):
        Part(MHA(2, 64), State())
    with pytest.raises(ValueError, match="Full or Window"):
        Part(StateGeometry((StateTensor("s", (4,)),)), Full())
