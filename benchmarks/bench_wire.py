"""The host side of a page-envelope transfer, both transports, on this machine (no GPU, no server):
pack + unpack of an npz body (http; the HTTP POST itself comes on top) against the copy into a
shared-memory segment (fresh, and reused as the prefill worker's pool reuses them) and out of it
(shm), for envelope sets of the sizes bench_disagg moves on the H200
(Qwen3.5-4B-like: 68 / 119 / 320 MB at 512 / 2048 / 8192 prompt tokens).

    python3 -m benchmarks.bench_wire [--mb 68,119,320] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from umem_jax.disagg.wire import SegmentPool, pack, pack_shm, unpack, unpack_shm
from umem_jax.engine.handoff import Envelopes, TransferPlan

from .report import format_table


def envelopes(mb: float) -> Envelopes:
    """~mb MB: a 51 MB state slot (as the 4B model's) plus full-attention pages for the rest."""
    rng = np.random.default_rng(0)
    row_words, rows_per_page = 4096, 64
    state_rows = min(int(51e6 / 2 / row_words), int(mb * 1e6 / 2 / row_words))
    pages = max(1, int((mb * 1e6 / 2 / row_words - state_rows) // rows_per_page))
    full = rng.integers(0, 1 << 16, size=(pages, rows_per_page, row_words), dtype=np.uint16)
    state = rng.integers(0, 1 << 16, size=(1, state_rows, row_words), dtype=np.uint16)
    return Envelopes("fp", TransferPlan(pages * 16, {"full": (0, pages)}, 1), 7, {"full": full}, state)


def best_of(repeats: int, fn) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", default="68,119,320")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    rows = []
    for mb in (float(x) for x in a.mb.split(",")):
        env = envelopes(mb)
        body = pack(env)
        t_pack = best_of(a.repeats, lambda: pack(env))
        t_unpack = best_of(a.repeats, lambda: unpack(body))

        pool = SegmentPool()

        def shm_in():
            seg, ref = pack_shm(env, pool)
            pool.give(seg)
            return ref

        t_new = best_of(1, lambda: pool.drop(pack_shm(env, SegmentPool())[0]))  # a fresh segment: page faults
        ref = json.loads(json.dumps(shm_in()))
        t_in = best_of(a.repeats, shm_in)  # a reused one, as the prefill worker's pool gives
        t_out = best_of(a.repeats, lambda: unpack_shm(ref))
        pool.close()
        gb = env.nbytes / 1e9
        rows.append([f"{env.nbytes / 1e6:.0f}", f"{t_pack * 1e3:.1f}", f"{t_unpack * 1e3:.1f}",
                     f"{gb / (t_pack + t_unpack):.2f}", f"{t_new * 1e3:.1f}", f"{t_in * 1e3:.1f}", f"{t_out * 1e3:.1f}",
                     f"{gb / (t_in + t_out):.2f}", f"{(t_pack + t_unpack) / (t_in + t_out):.1f}"])
    print(format_table(["MB", "npz pack ms", "npz unpack ms", "npz GB/s", "shm in (new segment) ms",
                        "shm in (reused) ms", "shm out ms", "shm GB/s", "shm speed-up"], rows))


if __name__ == "__main__":
    main()
