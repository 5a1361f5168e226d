"""`umem-jax arena-demo`: the arena at work without a model -- a scripted workload through the
real allocators and the device arena, printing the plan and each band's occupancy after every
phase.

Each live page is stamped on the device with its virtual id; after every phase the demo reads
every live page back through the tables and checks the stamp, so relocations that lost data
would show.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .arena import Arena, apply_moves
from .memory.chain import ChainAllocator
from .memory.plan import Plan, plan
from .memory.sizing import size_arena, static_regions
from .models.presets import preset

BAR = 64


@functools.partial(jax.jit, donate_argnums=0)
def _stamp(data, rows, values):
    """Write values [N] into word 0 of arena rows [N] (row ids are page starts)."""
    return data.at[rows, 0].set(values.astype(data.dtype), mode="drop")


@jax.jit
def _read(data, rows):
    return data[rows, 0]


class Demo:
    def __init__(self, p: Plan, num_rows: int, regions=None):
        self.plan, self.alloc = p, ChainAllocator(p, num_rows, static_regions=regions)
        self.arena = Arena.create(p, num_rows)
        self.requests: dict[int, dict] = {}
        self.next_id = 1
        self.window = {sp.name: sp.window for sp in p.windows}

    # ------------------------------------------------------------------ workload primitives

    def admit(self, tokens: int) -> bool:
        """A request of `tokens` tokens: its token pages (window pages only for the last window)
        and one state slot.  False when the arena is full."""
        ps = self.plan.page_size
        n = -(-tokens // ps)
        wp = {name: min(n, -(-w // ps) + 1) for name, w in self.window.items()}
        if not self.alloc.can_fit(n, 1 if self.plan.state else 0, wp):
            return False
        vids = self.alloc.alloc_token_pages(n, wp)
        slot = self.alloc.alloc_state_slots(1) if self.plan.state else np.empty(0, np.int32)
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests[rid] = {"pages": vids, "slot": slot, "tokens": tokens}
        self._sync()
        self._stamp_pages(vids, slot)
        return True

    def finish(self, rid: int) -> None:
        r = self.requests.pop(rid)
        self.alloc.free_token_pages(r["pages"])
        if r["slot"].size:
            self.alloc.free_state_slots(r["slot"])

    def slide(self, rid: int, new_tokens: int) -> None:
        """Decode `new_tokens` more; pages that left every window are tombstoned there."""
        r = self.requests[rid]
        ps = self.plan.page_size
        before = len(r["pages"])
        r["tokens"] += new_tokens
        n = -(-r["tokens"] // ps) - before
        if n > 0:
            wp = {name: n for name in self.window}
            vids = self.alloc.alloc_token_pages(n, wp)
            if vids is None:
                raise RuntimeError(f"arena full while decoding request {rid}")
            r["pages"] = np.concatenate([r["pages"], vids])
            self._sync()
            self._stamp_pages(vids, np.empty(0, np.int32))
        for name, w in self.window.items():
            first_live = max(0, (r["tokens"] - w) // ps)
            old = r["pages"][:first_live]
            bound = old[self.alloc.translate_pages(old[None], name)[0] > 0] if old.size else old
            if bound.size:
                self.alloc.release_window_pages(bound, name)

    # ------------------------------------------------------------------ device side

    def _sync(self) -> int:
        moves = self.alloc.take_moves()
        if moves:
            self.arena = apply_moves(self.arena, moves, self.plan)
        return sum(int(m.src.size) for m in moves)

    def _rows(self, vids, subpool: str) -> np.ndarray:
        sp = self.plan[subpool]
        if sp.kind == "state":
            phys = self.alloc.translate_slots(vids)
        else:
            phys = self.alloc.translate_pages(np.asarray(vids)[None], subpool)[0]
        return sp.page_row(phys.astype(np.int64)), phys

    def _stamp_pages(self, pages, slots) -> None:
        for sp in self.plan.subpools:
            ids = slots if sp.kind == "state" else pages
            if not len(ids):
                continue
            rows, phys = self._rows(ids, sp.name)
            keep = phys > 0  # tombstoned window pages have no bytes
            stamp = np.asarray(ids)[keep] % 65521 + 1
            data = _stamp(self.arena.data, jnp.asarray(rows[keep], jnp.int32), jnp.asarray(stamp, jnp.uint16))
            self.arena = self.arena.replace(data)

    def verify(self) -> int:
        """Read every live page's stamp through the tables; return pages checked."""
        checked = 0
        for sp in self.plan.subpools:
            ids = np.concatenate([r["slot"] if sp.kind == "state" else r["pages"] for r in self.requests.values()]
                                 or [np.empty(0, np.int32)])
            if not ids.size:
                continue
            rows, phys = self._rows(ids, sp.name)
            keep = phys > 0
            got = np.asarray(_read(self.arena.data, jnp.asarray(rows[keep], jnp.int32)))
            want = (ids[keep] % 65521 + 1).astype(np.uint16)
            if (got != want).any():
                raise AssertionError(f"{sp.name}: {(got != want).sum()} pages lost their bytes after relocation")
            checked += int(keep.sum())
        self.alloc.check_invariants()
        return checked

    # ------------------------------------------------------------------ report

    def report(self, title: str) -> str:
        u = self.alloc.usage()
        lines = [f"\n== {title}", self.bar()]
        for name, s in u.subpools.items():
            unit = "slots" if s.kind == "state" else "pages"
            lines.append(f"  {name:<12} {s.role:<5} held {s.held:>6} {unit:<5} {s.held_bytes / 2**20:8.2f} MiB"
                         f"   holes {s.holes:>4}   available ~{s.available} {unit}")
        lines.append(f"  arena {u.total_bytes / 2**20:.2f} MiB: live {u.live_bytes / 2**20:.2f} MiB, "
                     f"holes {u.hole_bytes / 2**20:.2f} MiB, free gap {u.free_bytes / 2**20:.2f} MiB; "
                     f"{len(self.requests)} requests")
        return "\n".join(lines)

    def bar(self) -> str:
        return band_bar(self.alloc)


def band_bar(alloc: ChainAllocator) -> str:
    """One character per 1/64 of the arena: '#' sink, the sub-pool's initial, '.' free."""
    cells = ["."] * BAR
    rows = alloc.num_rows
    spans = [("#", (0, alloc.plan.sink_rows))]
    for name, s in alloc.usage().subpools.items():
        if s.span is not None and s.span[1] > s.span[0]:
            spans.append((name[0].upper(), s.span))
    for ch, (lo, hi) in spans:
        for c in range(lo * BAR // rows, max(lo * BAR // rows + 1, -(-hi * BAR // rows))):
            cells[min(c, BAR - 1)] = ch
    return "  [" + "".join(cells) + "]"


def run(model: str = "tiny-hybrid", budget_mib: float = 4.0, page_size: int = 16, memory_mode: str = "unified",
        seed: int = 0, out=print) -> Demo:
    """The scripted workload: a burst of short requests, a shift to long prompts, window slides,
    compaction, and a return to idle with every page accounted for."""
    rng = np.random.default_rng(seed)
    p = plan(preset(model), page_size=page_size)
    size = size_arena(p, int(budget_mib * 2**20))
    regions = static_regions(p, size.num_rows) if memory_mode == "static" else None
    out(p.table())
    out(size.summary(regions))
    demo = Demo(p, size.num_rows, regions)
    out(demo.report("start: empty arena (S state, W window, F full)"))

    short = 0
    while demo.admit(int(rng.integers(32, 96))):
        short += 1
    out(demo.report(f"phase 1: {short} short requests until the arena is full"))

    for rid in list(demo.requests)[::2]:
        demo.finish(rid)
    demo.alloc.flush()
    moved = demo._sync()
    out(demo.report(f"phase 2: half of them finish; flush moved {moved} pages"))

    long = 0
    while demo.admit(int(rng.integers(300, 600))):
        long += 1
    out(demo.report(f"phase 3: {long} long prompts take the freed bytes"))

    for rid in list(demo.requests)[: len(demo.requests) // 3]:
        demo.finish(rid)
    decoded = 0
    for _ in range(8):  # decode steps of 16 tokens: windows slide, old window pages are released
        for rid in list(demo.requests):
            try:
                demo.slide(rid, 16)
                decoded += 16
            except RuntimeError:
                break
    out(demo.report(f"phase 4: a third finish, the rest decode {decoded} tokens; pages that left the window "
                    "are released from the window band"))

    for rid in list(demo.requests)[: len(demo.requests) // 2]:
        demo.finish(rid)
    demo.alloc.flush(urgent=True)
    moved = demo._sync()
    checked = demo.verify()
    out(demo.report(f"phase 5: half finish, urgent compaction moved {moved} pages; "
                    f"{checked} live pages read back intact"))

    for rid in list(demo.requests):
        demo.finish(rid)
    demo.alloc.flush(urgent=True)
    demo._sync()
    leaks = demo.alloc.leaks()
    demo.alloc.check_invariants()
    out(demo.report("idle: every request finished"))
    out(f"  invariants hold; leaks: {leaks or 'none'}")
    return demo
