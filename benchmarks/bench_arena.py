"""Arena scaling benchmark: does a 64 GiB arena cost the same per operation as a 1 GiB one?

For each arena size (uint16; the large one has > 2**31 elements) it:
  * allocates the arena on the device (jitted fill, no host copy);
  * times a donated one-page K/V write into the TOP page, and a 4096-page move (random pages
    spread over the whole arena, the top one included), both in place;
  * reads the top pages back and checks them bit-exactly (write, then moved pages);
  * reads `peak_bytes_in_use` against the arena's bytes.
Goals: time ratio 64G/1G within 10%; peak device memory within 1% of the arena.

    python3 -m benchmarks.bench_arena             # GPU: 1 GiB and 64 GiB, 64 KiB pages
    python3 -m benchmarks.bench_arena --small     # CPU check: 8 MiB and 64 MiB, 16 KiB pages
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from umem_jax import arena as am
from umem_jax.memory import full_attention, plan, window_attention

from .report import RowLog, format_table, json_path
from .timing import Chain, time_calls

GiB, MiB, KiB = 2**30, 2**20, 2**10


def make_plan(heads: int, head_dim: int, page_size: int = 16):
    """One full layer (one K row = one arena row) plus a window layer (a hybrid plan needs two
    kinds).  A full page envelope = page_size tokens x (K + V) rows."""
    return plan([full_attention(0, heads, head_dim), window_attention(1, 128, heads, head_dim)],
                page_size=page_size, row_words=heads * head_dim)


def timed(fn, arena, iters: int, repeats: int = 5):
    """Median seconds per call of `arena = fn(arena)` (donated; calls chain on the device)
    -> (seconds, the newest arena)."""
    chain = Chain(fn, arena)
    t = time_calls(chain, iters=iters, trials=repeats, warmup=0)
    return t.median, chain.value


def _u16(x):
    return np.asarray(x).view(np.uint16)


def run_size(p, nbytes: int, n_moves: int, iters: int, impl, rng) -> dict:
    dev = jax.devices()[0]
    rows = nbytes // (p.row_words * 2)
    stats0 = dev.memory_stats()
    base = stats0["bytes_in_use"] if stats0 else 0
    arena = am.Arena.create(p, rows)
    sp, ps = p.full, p.page_size
    n_pages = arena.num_pages("full")
    ptr = arena.data.unsafe_buffer_pointer()

    # --- a donated one-page write into the top page
    top = n_pages - 1
    k = jnp.asarray(rng.standard_normal((ps, *k_shape(p))), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((ps, *k_shape(p))), jnp.bfloat16)
    pages = jnp.full((ps,), top, jnp.int32)
    slots = jnp.arange(ps, dtype=jnp.int32)
    write = lambda a: am.write_kv(a, k, v, pages, slots, layer=0, impl=impl)
    t_write, arena = timed(write, arena, iters)
    kk, vv = am.read_kv(arena, jnp.array([[top]], jnp.int32), layer=0)
    write_ok = bool((_u16(kk[0]) == _u16(k)).all() and (_u16(vv[0]) == _u16(v)).all())

    # --- a 4096-page move over the whole arena; the top page is the first source
    ids = rng.choice(np.arange(p.first_page(sp), n_pages - 1), size=2 * n_moves - 1, replace=False)
    src = np.concatenate([[top], ids[: n_moves - 1]]).astype(np.int32)
    dst = ids[n_moves - 1:].astype(np.int32)
    j = int(np.argmax(dst))
    dst[[0, j]] = dst[[j, 0]]  # the top page goes to the highest destination
    probe = np.array([0, 1, n_moves // 2, n_moves - 1])  # moves whose data is checked
    for i in probe[1:]:  # distinct data in the probed sources (the top page has the write above)
        kv = jnp.asarray(rng.standard_normal((2, ps, *k_shape(p))), jnp.bfloat16)
        arena = am.write_kv(arena, kv[0], kv[1], jnp.full((ps,), src[i], jnp.int32), slots, layer=0, impl=impl)
    want = am.read_kv(arena, jnp.asarray(src[probe][None]), layer=0)
    want = [_u16(x) for x in want]
    src_d, dst_d = jnp.asarray(src), jnp.asarray(dst)
    move = lambda a: am.move_pages(a, src_d, dst_d, subpool="full", impl=impl)
    t_move, arena = timed(move, arena, max(1, iters // 4))
    got = am.read_kv(arena, jnp.asarray(dst[probe][None]), layer=0)
    move_ok = all((_u16(g) == w).all() for g, w in zip(got, want))

    ab = am.Arena.abstract(p, rows)
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in (
        ("write", am.write_kv.lower(ab, k, v, pages, slots, layer=0, impl=impl).compile()),
        ("move", am.move_pages.lower(ab, src_d, dst_d, subpool="full", impl=impl).compile()))}
    stats = dev.memory_stats()
    peak = (stats["peak_bytes_in_use"] - base) if stats else None
    out = {
        "arena_bytes": arena.nbytes, "rows": rows, "elements": rows * p.row_words, "page_bytes": sp.page_bytes,
        "n_moves": n_moves, "write_s": t_write, "move_s": t_move,
        "move_GBps": 2 * n_moves * sp.page_bytes / t_move / 1e9,
        "peak_over_arena": None if peak is None else peak / arena.nbytes - 1.0,
        "temp_bytes": temp, "in_place": arena.data.unsafe_buffer_pointer() == ptr,
        "top_write_exact": write_ok, "top_move_exact": bool(move_ok),
    }
    arena.data.delete()  # free before the next size so peaks do not add up
    return out


def k_shape(p):
    g = p.full.geometry
    return (g.num_kv_heads, g.head_dim)


def _size(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes that run on CPU (8 MiB, 64 MiB)")
    ap.add_argument("--impl", choices=("pallas", "reference"), default=None, help="kernel implementation")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--json", default=None, help="rows here (default $OUT/bench_arena.json if $OUT is set)")
    args = ap.parse_args(argv)

    if args.small:
        p, sizes, n_moves = make_plan(1, 128, page_size=32), (8 * MiB, 64 * MiB), 128  # 16 KiB pages
    else:
        p, sizes, n_moves = make_plan(8, 128), (1 * GiB, 64 * GiB), 4096  # 64 KiB pages
    assert 16 * KiB <= p.full.page_bytes <= MiB
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; impl={args.impl or 'default'}; "
          f"page {p.full.page_bytes // KiB} KiB; {n_moves} moves", flush=True)
    results = []
    for nbytes in sizes:
        r = run_size(p, nbytes, n_moves, args.iters, args.impl, rng)
        results.append(r)
        print(f"  {_size(nbytes)} done: {json.dumps(r)}", flush=True)

    head = ("arena", "elements", "write us", f"move{n_moves} us", "move GB/s", "peak-arena", "temp write/move",
            "in place", "top exact")
    rows = []
    for r in results:
        peak = "n/a" if r["peak_over_arena"] is None else f"{100 * r['peak_over_arena']:+.2f}%"
        rows.append((_size(r["arena_bytes"]), f"{r['elements']:,}", f"{r['write_s'] * 1e6:.1f}",
                     f"{r['move_s'] * 1e6:.1f}", f"{r['move_GBps']:.1f}", peak,
                     f"{r['temp_bytes']['write'] / MiB:.1f}/{r['temp_bytes']['move'] / MiB:.1f} MiB",
                     str(r["in_place"]), str(r["top_write_exact"] and r["top_move_exact"])))
    print()
    print(format_table(list(head), rows, left=0))
    small, large = results
    rw, rm = large["write_s"] / small["write_s"], large["move_s"] / small["move_s"]
    ok_ratio = rw <= 1.10 and rm <= 1.10
    peaks = [r["peak_over_arena"] for r in results if r["peak_over_arena"] is not None]
    ok_peak = all(x <= 0.01 for x in peaks) if peaks else None
    print(f"ratio {_size(large['arena_bytes'])}/{_size(small['arena_bytes'])}: write {rw:.3f}, move {rm:.3f} "
          f"(goal <= 1.10: {'met' if ok_ratio else 'NOT met'}); peak within 1% of the arena: "
          f"{'n/a (no memory_stats)' if ok_peak is None else ('met' if ok_peak else 'NOT met')}")
    exact = all(r["top_write_exact"] and r["top_move_exact"] and r["in_place"] for r in results)
    log = RowLog(json_path(args.json, "bench_arena"), jax=jax.__version__, device=jax.devices()[0].device_kind,
                 ratio_write=rw, ratio_move=rm)
    for r in results:
        log.add(r)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
