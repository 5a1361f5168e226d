"""The plan of a target and its speculative draft as one model (issue 16): the draft's layers
fuse into the target's sub-pools where lifetime and geometry match; a window length the target
lacks becomes its own window sub-pool (a float); what cannot be placed is refused by name."""

from __future__ import annotations

import pytest

from umem_jax.memory.declarations import MHA, Full, LayerDecl, Part, Window
from umem_jax.memory.plan import PlanError, plan

KV = MHA(2, 16, dtype="bfloat16")


def _decls(types, model="target", kv=KV):
    return [LayerDecl(i, (Part(kv, Full() if t == "full" else Window(t)),), model) for i, t in enumerate(types)]


def test_draft_window_gets_its_own_float_and_fuses_full():
    target = _decls([1024, 1024, "full", 1024, "full"])
    draft = _decls([512, 512, "full"], model="draft")
    p = plan(target + draft, page_size=16)
    assert [sp.name for sp in p.subpools] == ["window1024", "window512", "full"]
    assert [sp.role for sp in p.subpools] == ["up", "float", "down"]
    assert p["full"].layers == (("target", 2), ("target", 4), ("draft", 2))  # one envelope for both models
    assert p["window512"].layers == (("draft", 0), ("draft", 1))
    assert p["window1024"].layers == (("target", 0), ("target", 1), ("target", 3))
    # the draft's full rows sit after the target's in the same page envelope
    rows = [p["full"].kv_rows(2, "target"), p["full"].kv_rows(4, "target"), p["full"].kv_rows(2, "draft")]
    assert rows[0].k_row < rows[1].k_row < rows[2].k_row
    assert p["full"].page_bytes == 3 * plan(_decls([1024, "full"]), page_size=16)["full"].page_bytes
    assert {sp.name for sp in p.token_pools} == {"full", "window1024", "window512"}


def test_draft_window_of_the_targets_length_fuses():
    p = plan(_decls([512, "full"]) + _decls([512, "full"], model="draft"), page_size=16)
    assert [sp.name for sp in p.subpools] == ["window512", "full"]
    assert p["window512"].layers == (("target", 0), ("draft", 0))


def test_draft_of_another_geometry_is_refused_naming_its_layers():
    other = MHA(1, 32, dtype="bfloat16")
    with pytest.raises(PlanError, match=r"two geometries in one sub-pool \(full\).*draft:1"):
        plan(_decls([512, "full"]) + _decls([256, "full"], model="draft", kv=other), page_size=16)
