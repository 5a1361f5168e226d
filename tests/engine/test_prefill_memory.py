"""The prefill step updates the arena in place: its temporaries do not grow with the arena.

Compile-only checks (abstract weights, abstract arena): a prefill chunk with prefix-cache
checkpoints, compiled at two arena sizes.  If anything copied the arena (a scatter XLA cannot do
in place, a reader of an older arena version beside an aliased writer, a whole-arena view), the
compiled temporaries would grow by about the arena's growth.  Two programs:

  * the reference kernels (what runs on the CPU), for each hybrid family;
  * the GPU program's dataflow around the recurrent-state kernels: every `pallas_call` is replaced
    by an opaque custom call with the same operands, results and `input_output_aliases` (a CPU FFI
    target that is only compiled, never run), so XLA's copy insertion sees what it sees on the
    GPU: write_kv (aliased writer) and the attention reader, read_state (reader), the chunked
    scan in plain JAX, write_state (aliased writer), the checkpoint writes.  One difference: the
    attention prefill kernel reads a same-width bf16 view of the uint16 arena, a bitcast on the
    GPU but a whole-arena pass and temporary on XLA:CPU, so here its stand-in reads the arena
    itself.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from umem_jax.arena import Arena
from umem_jax.core.batch import Batch
from umem_jax.memory import plan as make_plan
from umem_jax.memory import size_arena
from umem_jax.models.config import FULL, RECURRENT, MambaConfig
from umem_jax.models.nemotron_h import nemotron_h_8b_like
from umem_jax.models.qwen3_5 import qwen3_5_4b_like
from umem_jax.models.registry import build_random
from umem_jax.models.tiny import tiny_config

MLP = "mlp"
B, T, K = 2, 64, 2  # rows, chunk tokens, checkpoints per row
ARENA_MIB = (8, 16)


def _nemotron(types):
    c = nemotron_h_8b_like("float32")
    return dataclasses.replace(c, vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                               head_dim=16, layer_types=types,
                               mamba=MambaConfig(num_heads=4, head_dim=16, state_size=16, n_groups=2, conv_kernel=4,
                                                 chunk_size=16))


def _qwen(types):
    c = qwen3_5_4b_like("float32")
    return dataclasses.replace(c, vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                               head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                               linear_value_head_dim=16, layer_types=types)


def _compiled(cfg, arena_mib: int, impl: str):
    model = build_random(cfg, "float32", abstract=True)
    plan = make_plan(model.decls(), page_size=16)
    arena = Arena.abstract(plan, size_arena(plan, arena_mib << 20).num_rows)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    batch = Batch(i32(B, T), i32(B), i32(B), {sp.name: i32(B, T // 16 + 1) for sp in plan.token_pools}, i32(B),
                  i32(B, K), i32(B, K))
    step = jax.jit(model.forward_fn(impl=impl), donate_argnums=1)
    return step.lower(model.params, arena, batch).compile(), arena


def _assert_in_place(cfg, impl: str):
    temps = []
    for mib in ARENA_MIB:
        compiled, arena = _compiled(cfg, mib, impl)
        mem = compiled.memory_analysis()
        assert mem.alias_size_in_bytes == arena.nbytes, (mib, mem)  # the donated arena is the output
        rows, words = arena.data.shape
        copies = [l for l in compiled.as_text().splitlines()
                  if re.search(rf"\[{rows},{words}\]", l) and re.search(r"\s(copy|copy-start)\(", l)]
        assert not copies, copies[:3]
        temps.append(mem.temp_size_in_bytes)
    grown = ((ARENA_MIB[1] - ARENA_MIB[0]) << 20)
    # Equal in practice; allow a few KiB of layout noise, far below one arena copy.
    assert abs(temps[1] - temps[0]) < grown // 64, (temps, grown)


@pytest.mark.parametrize("name,cfg", [
    ("nemotronh", _nemotron((RECURRENT, MLP, RECURRENT, FULL, MLP))),
    ("qwen3_5", _qwen((RECURRENT, RECURRENT, FULL))),
    ("tiny", tiny_config()),
])
def test_reference_prefill_is_in_place(name, cfg):
    _assert_in_place(cfg, "reference")


def _opaque_pallas_call(kernel, *, out_shape, input_output_aliases=None, **_):
    """pallas_call's signature; the kernel becomes a custom call with the same aliasing."""
    del kernel
    single = not isinstance(out_shape, (tuple, list))
    shapes = (out_shape,) if single else tuple(out_shape)

    def call(*args):
        out = jax.ffi.ffi_call(_STANDIN_TARGET, shapes, input_output_aliases=dict(input_output_aliases or {}))(*args)
        return out[0] if single else tuple(out)
    return call


# Any FFI target registered for the CPU will do: the program is compiled, never run.
_STANDIN_TARGET = "lapack_sgetrf_ffi"


def _opaque_prefill_attention(q, arena, page_table, q_lens, kv_lens, sinks, k_scale=None, v_scale=None, *, view,
                              **_):
    """The attention prefill kernel's call without its bf16 view of the arena (see the module doc)."""
    out = jax.ShapeDtypeStruct((*q.shape[:3], view.v_head_dim), q.dtype)
    return jax.ffi.ffi_call(_STANDIN_TARGET, out)(q, arena, page_table, q_lens, kv_lens)


@pytest.fixture
def opaque_pallas(monkeypatch):
    from jax.experimental import pallas as pl

    from umem_jax.pallas_kernels import paged_prefill

    probe = jax.jit(lambda x: jax.ffi.ffi_call(_STANDIN_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                               input_output_aliases={0: 0})(x), donate_argnums=0)
    try:
        probe.lower(jax.ShapeDtypeStruct((8,), jnp.float32)).compile()
    except Exception as e:  # noqa: BLE001 - a jaxlib without that CPU target: nothing to stand in with
        pytest.skip(f"no CPU FFI target {_STANDIN_TARGET!r} to stand in for the kernels: {e}")
    jax.clear_caches()  # no kernel wrapper keeps a trace of the real pallas_call
    monkeypatch.setattr(pl, "pallas_call", _opaque_pallas_call)
    monkeypatch.setattr(paged_prefill, "_paged_prefill_pallas", _opaque_prefill_attention)
    yield
    jax.clear_caches()


@pytest.mark.parametrize("name,cfg", [
    ("nemotronh", _nemotron((RECURRENT, MLP, RECURRENT, FULL, MLP))),
    ("qwen3_5", _qwen((RECURRENT, RECURRENT, FULL))),
    ("tiny", tiny_config()),
])
def test_gpu_prefill_dataflow_is_in_place(name, cfg, opaque_pallas):
    _assert_in_place(cfg, "pallas")
