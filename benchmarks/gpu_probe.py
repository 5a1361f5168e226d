"""Probe the GPU machine's JAX/Pallas environment in one short call (versions, Triton params,
an aliased row-indexed Pallas Triton kernel on a > 4 GiB uint16 arena, copy bandwidth)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
import jax.experimental.pallas.triton as pltr  # noqa: E402

print("pallas.triton names:", [n for n in dir(pltr) if not n.startswith("_")])
print("memory_stats:", {k: v for k, v in jax.devices()[0].memory_stats().items() if "bytes" in k})

ROWS, W = (5 << 30) // (1024 * 2), 1024  # 5 GiB uint16 arena, > 2**31 elements
arena = jax.jit(lambda: jnp.zeros((ROWS, W), jnp.uint16))()


def kernel(rows_ref, arena_in, arena_out):
    r = rows_ref[pl.program_id(0)]
    x = arena_in[r, :]
    arena_out[r, :] = x + jnp.uint16(7)


@jax.jit
def bump(arena, rows):
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(arena.shape, arena.dtype),
        grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY if hasattr(pl, "ANY") else None)] * 2,
        out_specs=pl.BlockSpec(memory_space=pl.ANY if hasattr(pl, "ANY") else None),
        input_output_aliases={1: 0},
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
    )(rows, arena)


bump_d = jax.jit(bump.__wrapped__ if hasattr(bump, "__wrapped__") else bump, donate_argnums=0)
rows = jnp.array([1, ROWS - 1, ROWS // 2], jnp.int32)
try:
    p0 = arena.unsafe_buffer_pointer()
    arena = bump_d(arena, rows)
    top = np.asarray(arena[ROWS - 1])
    print("pallas row kernel ok:", bool((top == 7).all()), "in place:", arena.unsafe_buffer_pointer() == p0)
except Exception as e:  # report and go on
    print("pallas row kernel FAILED:", type(e).__name__, str(e)[:2000])

x = jnp.ones((1 << 30,), jnp.uint16) * 3  # 2 GiB
cp = jax.jit(lambda a: a + jnp.uint16(1))
cp(x).block_until_ready()
t = []
for _ in range(10):
    t0 = time.perf_counter(); cp(x).block_until_ready(); t.append(time.perf_counter() - t0)
print(f"copy bandwidth (read+write): {2 * x.nbytes / np.median(t) / 1e12:.2f} TB/s")
