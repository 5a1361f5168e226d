"""Host cost of the arena allocator: one decode step of 256 requests, and a 4096-page flush.

Decode step (what the scheduler does on the host each step, allocator part only):
  every request grows by one token; those starting a new page get one (one joint full + window
  allocation for the batch), the window page that slid out is released (tombstoned), requests
  that reach their length are freed and replaced by a new prompt, and the batch's page tables
  are translated: full [256, max_pages] and window [256, window_pages].
Flush: an urgent flush that moves 4096 full-attention pages into holes (plus take_moves).

Model: Gemma-3-like, 5 window layers (1024 tokens) per full layer, 8 KV heads x 128, page 16,
on a 64 GiB arena.

    python3 -m benchmarks.bench_allocator [--steps N] [--clock cpu]

--clock cpu times with this thread's CPU time, which leaves out preemption on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from umem_jax.memory import ChainAllocator, full_attention, plan, window_attention

from .report import format_table

PAGE, WINDOW, BATCH = 16, 1024, 256
MAX_LEN, PROMPT = 4096, 1024
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


def gemma_like_plan():
    decls = []
    for layer in range(36):
        if layer % 6 == 5:
            decls.append(full_attention(layer, 8, 128))
        else:
            decls.append(window_attention(layer, WINDOW, 8, 128))
    return plan(decls, page_size=PAGE)


def stats(ns: list[int]) -> tuple[float, float]:
    a = np.asarray(ns) / 1e6
    return float(np.median(a)), float(np.percentile(a, 99))


def bench_decode(steps: int, clock=time.perf_counter_ns) -> list[tuple[int, int, int]]:
    """-> per step (total, allocator work, translation) in ns."""
    p = gemma_like_plan()
    rows = (64 << 30) // (p.row_words * 2)
    a = ChainAllocator(p, rows)
    wname = p.windows[0].name
    max_pages = MAX_LEN // PAGE
    win_pages = WINDOW // PAGE + 1
    table = np.full((BATCH, max_pages), -1, np.int32)  # the engine's request -> virtual page table
    rng = np.random.default_rng(0)
    lens = rng.integers(PROMPT, MAX_LEN, BATCH)  # staggered, so ~BATCH / PAGE new pages a step
    npages = np.zeros(BATCH, np.int64)
    released = np.zeros(BATCH, np.int64)  # leading pages whose window page is gone

    def start(r: int, length: int):
        n = -(-length // PAGE)
        keep = min(n, win_pages)
        vids = a.alloc_token_pages(n, {wname: keep})  # early prompt pages never need window rows
        assert vids is not None
        table[r, :n] = vids
        table[r, n:] = -1
        npages[r], released[r] = n, n - keep

    for r in range(BATCH):
        start(r, int(lens[r]))
    a.take_moves()
    times = []
    win_cols = np.arange(win_pages)
    row_base = (np.arange(BATCH) * max_pages)[:, None]
    for _ in range(steps):
        t0 = clock()
        lens += 1
        done = np.flatnonzero(lens > MAX_LEN)
        for r in done:  # finished: free everything, admit a new prompt in its place
            a.free_token_pages(table[r, :npages[r]])
            lens[r] = PROMPT
            start(r, PROMPT)
        need = np.flatnonzero((lens - 1) % PAGE == 0)
        if done.size:
            need = need[~np.isin(need, done)]
        if need.size:
            assert a.can_fit(need.size)
            vids = a.alloc_token_pages(need.size)
            table[need, npages[need]] = vids
            npages[need] += 1
            slide = need[npages[need] - released[need] > win_pages]
            if slide.size:
                a.release_window_pages(table[slide, released[slide]], wname)
                released[slide] += 1
        moves = a.take_moves()  # (applied on the device by the caller)
        t1 = clock()
        full_phys = a.translate_pages(table, "full", max_pages)
        # the window kernel reads the last win_pages pages of each request (-1 before the start)
        cols = npages[:, None] - win_pages + win_cols
        win_vids = table.ravel().take(row_base + np.maximum(cols, 0))
        win_vids[cols < 0] = -1
        win_phys = a.translate_pages(win_vids, wname, win_pages)
        t2 = clock()
        times.append((t2 - t0, t1 - t0, t2 - t1))
    a.check_invariants()
    assert full_phys.shape == (BATCH, max_pages) and win_phys.shape == (BATCH, win_pages) and moves is not None
    return times


def bench_flush(reps: int, clock=time.perf_counter_ns) -> list[int]:
    p = gemma_like_plan()
    a = ChainAllocator(p, (64 << 30) // (p.row_words * 2))
    times = []
    for _ in range(reps):
        v = a.alloc_token_pages(8192, {p.windows[0].name: 0})
        a.free_token_pages(v[:4096])  # the 4096 pages nearest the anchor: 4096 survivors move
        t0 = clock()
        a.flush(urgent=True)
        moves = a.take_moves()
        times.append(clock() - t0)
        assert sum(len(m) for m in moves) == 4096, [len(m) for m in moves]
        a.free_token_pages(a.live_token_pages())
        a.flush(urgent=True)
        a.take_moves()
    a.check_invariants()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--flush-reps", type=int, default=50)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args(argv)
    clock = CLOCKS[args.clock]
    dec = np.asarray(bench_decode(args.steps, clock))
    fl = stats(bench_flush(args.flush_reps, clock))
    rows = [("decode step, 256 requests: total", stats(dec[:, 0])),
            ("  alloc + window release + frees/admits", stats(dec[:, 1])),
            ("  translate full [256,256] + window [256,65]", stats(dec[:, 2])),
            ("urgent flush moving 4096 pages", fl)]
    print(format_table([f"operation ({args.clock} clock)", "median ms", "p99 ms"],
                       [[name, f"{med:.3f}", f"{p99:.3f}"] for name, (med, p99) in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
