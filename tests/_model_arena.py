"""Test harness: run a model through the arena path with hand-rolled page allocation.

`HandPager` hands out physical pages the way the host allocator will: each paged sub-pool
gets its own band of the arena, pages come from a LIFO free list (so freed pages are reused
at once), and window pages whose tokens left every future query's window are tombstoned
(table entry 0) and freed.  `generate` drives chunked prefill (prefill rows and decoding rows
mixed in one padded chunk, as the scheduler will) and then T == 1 decode steps, over a batch
with an extra all-padding row.  A plan with a state sub-pool gets one more band, from which each
request takes one state slot for its lifetime (padding rows use slot 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from umem_jax.arena import Arena
from umem_jax.core.batch import make_batch


class HandPager:
    def __init__(self, plan, num_rows: int):
        self.plan = plan
        paged = [sp for sp in plan.subpools if sp.kind != "state"]
        state = plan.state
        # Split the rows above the sink evenly between the paged sub-pools and the state sub-pool
        # (bands never overlap).
        lo, span = plan.sink_rows, (num_rows - plan.sink_rows) // (len(paged) + (state is not None))
        self.free = {}
        for i, sp in enumerate(paged):
            start, end = lo + i * span, lo + (i + 1) * span
            first, last = -(-start // sp.rows_per_page), end // sp.rows_per_page
            assert last - first >= 4, f"band of {sp.name} too small"
            self.free[sp.name] = list(range(last - 1, first - 1, -1))
        self.tables: dict[int, dict[str, list[int]]] = {}
        self.freed_count = 0
        self.state_free, self.slots = [], {}
        if state is not None:  # the last band: state slots, one per request
            start, end = lo + len(paged) * span, lo + (len(paged) + 1) * span
            first, last = state.page_ceil(start), state.page_floor(end)  # on its grid (from the sink)
            assert last - first >= 4, "band of the state sub-pool too small"
            self.state_free = list(range(last - 1, first - 1, -1))

    def slot(self, req: int) -> int:
        """The request's state slot (taken at its first step), or 0 when the plan has no state."""
        if req not in self.slots:
            self.slots[req] = self.state_free.pop() if self.plan.state is not None else 0
        return self.slots[req]

    def ensure(self, req: int, length: int):
        """Map every token page of positions < length in every paged sub-pool."""
        tabs = self.tables.setdefault(req, {name: [] for name in self.free})
        n = -(-length // self.plan.page_size)
        for name, tab in tabs.items():
            while len(tab) < n:
                tab.append(self.free[name].pop())

    def retire(self, req: int, next_pos: int):
        """Tombstone and free window pages no query at position >= next_pos can see."""
        ps = self.plan.page_size
        for sp in self.plan.windows:
            first_needed = next_pos - sp.window + 1
            tab = self.tables.get(req, {}).get(sp.name, [])
            for i, page in enumerate(tab):
                if page and (i + 1) * ps <= first_needed:
                    self.free[sp.name].append(page)
                    tab[i] = 0
                    self.freed_count += 1

    def table(self, reqs, width: int) -> dict[str, np.ndarray]:
        out = {}
        for name in self.free:
            t = np.zeros((len(reqs), width), np.int32)
            for b, r in enumerate(reqs):
                if r is not None:
                    row = self.tables[r][name]
                    t[b, :len(row)] = row
            out[name] = t
        return out


@dataclasses.dataclass
class Run:
    tokens: list  # per request: generated tokens
    logits: list  # per request: [(position of the token whose logits these are, logits [V])]
    freed_pages: int
    arena: object = None  # the Arena after the last step
    state_slots: dict = None  # request -> its state slot


def generate(model, plan, prompts, n_new: int, *, chunk: int, num_rows: int = 2048, teacher=None,
             debug_nan: bool = True, dtype="uint16", max_len: int = 128, **kernel_kw) -> Run:
    """Greedy-generate n_new tokens per prompt through model.jit_forward over one Arena.

    teacher: per request, the tokens to feed instead of the argmax (teacher forcing).
    The batch has len(prompts) + 1 rows; the last is always padding.
    """
    arena = Arena.create(plan, num_rows, dtype=dtype, debug_nan=debug_nan, mesh=getattr(model, "mesh", None))
    step = model.jit_forward(**kernel_kw)
    pager = HandPager(plan, num_rows)
    n = len(prompts)
    seqs = [list(map(int, p)) for p in prompts]
    cached = [0] * n
    out_tokens = [[] for _ in range(n)]
    out_logits = [[] for _ in range(n)]
    width = -(-max_len // plan.page_size)
    while any(len(t) < n_new for t in out_tokens):
        prefilling = [cached[i] < len(prompts[i]) for i in range(n)]
        t = chunk if any(prefilling) else 1
        toks = np.zeros((n + 1, t), np.int32)
        q_lens = np.zeros(n + 1, np.int32)
        kv_lens = np.zeros(n + 1, np.int32)
        for i in range(n):
            if len(out_tokens[i]) >= n_new:
                continue
            new = seqs[i][cached[i]:cached[i] + (t if prefilling[i] else 1)]
            toks[i, :len(new)] = new
            q_lens[i], kv_lens[i] = len(new), cached[i] + len(new)
            pager.retire(i, cached[i])  # the chunk's first query sits at position cached[i]
            pager.ensure(i, kv_lens[i])
        tables = pager.table([i if q_lens[i] else None for i in range(n)] + [None], width)
        slots = np.array([pager.slot(i) if q_lens[i] else 0 for i in range(n)] + [0], np.int32)
        batch = make_batch(toks, q_lens, kv_lens, tables, slots)
        logits, arena = step(model.params, arena, batch)
        logits = np.asarray(logits)
        for i in range(n):
            if q_lens[i] == 0:
                continue
            cached[i] = kv_lens[i]
            if cached[i] < len(prompts[i]):
                continue  # mid-prompt chunk: its logits predict a prompt token
            out_logits[i].append((cached[i] - 1, logits[i]))
            nxt = int(teacher[i][len(out_tokens[i])]) if teacher is not None else int(logits[i].argmax())
            out_tokens[i].append(nxt)
            seqs[i].append(nxt)
        assert np.all(logits[n] == logits[n]), "padding row produced NaN"
    return Run(out_tokens, out_logits, pager.freed_count, arena, dict(pager.slots))
