"""Bad batch arguments of the recurrent prefills (Mamba2, gated DeltaNet) get a ValueError that
names the argument, not a concatenate / vmap / broadcast error from deep inside the conv or the
scan (the slots, q_lens, reset and dt_min shapes were not checked against the chunk's batch)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from test_gated_deltanet import Case as GDNCase
from test_mamba2 import Case as MambaCase

from umem_jax.pallas_kernels.gated_deltanet import gdn_prefill
from umem_jax.pallas_kernels.mamba2 import mamba2_prefill

T = 3


def _gdn():
    case = GDNCase(2, 4, 16, 8, B=3, seed=3)
    qkv, a, b = case.inputs(T)
    return case, lambda **kw: gdn_prefill(case.arena, kw.pop("slots", case.slots), qkv, a, b,
                                          kw.pop("q_lens", jnp.full((case.B,), T, jnp.int32)), *case.params(),
                                          view=case.view, **kw)


def _mamba():
    case = MambaCase(4, 8, 16, 2, B=3, seed=3)
    xbc, dt = case.inputs(T)
    return case, lambda **kw: mamba2_prefill(case.arena, kw.pop("slots", case.slots), xbc, dt,
                                             kw.pop("q_lens", jnp.full((case.B,), T, jnp.int32)), *case.params(),
                                             view=case.view, **kw)


@pytest.mark.parametrize("family", [_gdn, _mamba], ids=["gdn", "mamba2"])
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_prefill_batch_mismatch_is_a_clear_error(family, impl):
    case, run = family()
    kw = dict(impl=impl, interpret=impl == "pallas")
    B = case.B
    run(**kw)  # the well-formed call runs
    with pytest.raises(ValueError, match=r"slots must be int32 \[3\]"):
        run(slots=case.slots[:-1], **kw)
    with pytest.raises(ValueError, match=r"q_lens must be int32 \[3\]"):
        run(q_lens=jnp.full((B + 1,), T, jnp.int32), **kw)
    with pytest.raises(ValueError, match=r"q_lens must be int32 \[3\]"):
        run(q_lens=jnp.full((B, 1), T, jnp.int32), **kw)
    with pytest.raises(ValueError, match=r"q_lens must be int32 \[3\]"):
        run(q_lens=jnp.full((B,), T, jnp.float32), **kw)
    with pytest.raises(ValueError, match=r"reset must be \[3\]"):
        run(reset=jnp.ones((B + 2,), bool), **kw)


def test_mamba2_prefill_dt_min_shape():
    case, run = _mamba()
    run(dt_min=jnp.zeros((case.B,), jnp.float32))  # one floor per row is fine
    with pytest.raises(ValueError, match=r"dt_min must be a scalar or \[3\]"):
        run(dt_min=jnp.zeros((case.B + 1,), jnp.float32))
