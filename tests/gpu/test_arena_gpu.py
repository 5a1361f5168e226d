"""Large arenas on the GPU: more than 2**31 elements (and > 4 GiB, where Triton switches to 64-bit
offsets); pages at the very top written, moved and read back exactly, in place."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from umem_jax import arena as am
from umem_jax.memory import full_attention, plan, recurrent_state, window_attention
from umem_jax.memory.declarations import mamba2_state_tensors

pytestmark = pytest.mark.gpu
GiB = 2**30


def _plan():
    """1024-word (2 KiB) rows: one K row per token; full pages of 16 tokens x 2 layers = 128 KiB."""
    st = mamba2_state_tensors(num_heads=8, head_dim=32, state_size=32, n_groups=1, conv_kernel=4)
    return plan([full_attention(0, 8, 128), full_attention(1, 8, 128), window_attention(2, 128, 8, 128),
                 recurrent_state(3, st, checkpoint_interval=64)], page_size=16)


SIZES = [5 * GiB, pytest.param(20 * GiB, marks=pytest.mark.slow)]


@pytest.fixture
def big_arena(request):
    p = _plan()
    rows = request.param // (p.row_words * 2)
    assert rows * p.row_words > 2**31 and rows < 2**31
    a = am.Arena.create(p, rows, debug_nan=True)
    yield a
    del a
    gc.collect()


def _u16(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


@pytest.mark.parametrize("big_arena", SIZES, indirect=True)
def test_top_pages_write_move_read(big_arena):
    a = big_arena
    p, rng = a.plan, np.random.default_rng(0)
    ps, n = p.page_size, a.num_pages("full")
    top = np.array([n - 1, n - 2, n - 3], np.int32)  # the last bytes of the arena
    T = len(top) * ps
    pages, slots = np.repeat(top, ps), np.tile(np.arange(ps, dtype=np.int32), len(top))
    k = jnp.asarray(rng.standard_normal((T, 8, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((T, 8, 128)), jnp.bfloat16)
    p0 = a.data.unsafe_buffer_pointer()
    a = am.write_kv(a, k, v, jnp.asarray(pages), jnp.asarray(slots), layer=1)
    kk, vv = am.read_kv(a, jnp.asarray(top[None]), layer=1)
    np.testing.assert_array_equal(_u16(kk[0]), _u16(k))
    np.testing.assert_array_equal(_u16(vv[0]), _u16(v))
    k0, _ = am.read_kv(a, jnp.asarray(top[None]), layer=0)  # the other layer was never written
    assert np.isnan(np.asarray(k0, np.float32)).all()

    # move the top page down to the first real page, and the next one within the top end
    low = p.first_page(p.full)
    a = am.apply_moves(a, [_Move("full", top[:2], np.array([low, n - 4], np.int32))])
    kk, _ = am.read_kv(a, jnp.array([[low, n - 4]], jnp.int32), layer=1)
    np.testing.assert_array_equal(_u16(kk[0]), _u16(k[: 2 * ps]))
    a = am.zero_pages(a, jnp.asarray(top[:1]), subpool="full")
    kk, _ = am.read_kv(a, jnp.asarray(top[None, :1]), layer=1)
    assert not _u16(kk).any()
    assert a.data.unsafe_buffer_pointer() == p0  # every call was in place


@pytest.mark.parametrize("big_arena", SIZES, indirect=True)
def test_top_state_slots_fp32(big_arena):
    a = big_arena
    sv = a.plan.state.state_view(3)
    top = a.num_pages("state") - 1
    slots = np.array([top, top - 5, 7], np.int32)
    rng = np.random.default_rng(1)
    tensors = {t.tensor.name: jnp.asarray(rng.standard_normal((3, *t.tensor.shape)).astype(np.float32), t.tensor.dtype)
               for t in sv.tensors}
    a = am.write_state(a, jnp.asarray(slots), tensors, layer=3)
    got = am.read_state(a, jnp.asarray(slots), layer=3)
    for name, x in tensors.items():
        np.testing.assert_array_equal(_u16(got[name]), _u16(x))


@pytest.mark.parametrize("big_arena", SIZES[:1], indirect=True)
def test_big_writers_compile_in_place(big_arena):
    ab = am.Arena.abstract(big_arena.plan, big_arena.num_rows)
    i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)
    kv = jax.ShapeDtypeStruct((16, 8, 128), jnp.bfloat16)
    for c in (am.write_kv.lower(ab, kv, kv, i32(16), i32(16), layer=0).compile(),
              am.move_pages.lower(ab, i32(64), i32(64), subpool="full").compile(),
              am.zero_pages.lower(ab, i32(64), subpool="full").compile()):
        am.check_in_place(c, ab, max_temp_bytes=256 * 2**20)


class _Move:
    def __init__(self, subpool, src, dst):
        self.subpool, self.src, self.dst = subpool, src, dst
