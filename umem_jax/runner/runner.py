"""Runner: turns a scheduled batch into ONE jitted step over the arena, and owns the arena.

    step(params, arena, meta, prev_tokens[, counts]) -> (tokens [Bmax] int32, arena)

`meta` is one flat int32 array holding everything the step reads besides the weights: the
padded tokens, lengths, physical page tables of every token sub-pool, state slots (and, for
prefill with a prefix cache, state checkpoint positions and slots), sampling parameters
(floats bit-cast into the int32 words) and banned token ids.  It is built on the host
with numpy and sent in ONE host->device transfer.  `Layout` (static, hashable) says where each
field sits; it is the jit's static argument, so each bucket shape compiles once.

`prev_tokens` is the previous step's output, still on the device: a decode row whose input
token was sampled by that step takes it from there (`src` column), so the host launches step
N+1 before reading step N's tokens (JAX dispatch is asynchronous) and the device never waits
for the host between steps.  The arena is donated: XLA updates it in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..arena import Arena, apply_moves
from ..core.batch import Batch
from ..core.scheduled_batch import CHECKPOINTS_PER_ROW, Buckets, ScheduledBatch
from ..memory.chain import ChainAllocator
from .sampler import MODES, SamplingBatch, sample, sample_with_penalties, sampling_mode

FIELD_ALIGN = 64  # int32 words: 256 bytes
_INT_SAMPLING = ("top_k", "seed", "step")
_FLOAT_SAMPLING = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape of one step: B rows of T tokens, page tables P wide, and where each field
    sits in the packed int32 metadata."""

    B: int
    T: int
    P: int
    pools: tuple[str, ...]  # token sub-pools with a page table, full first
    bmax: int  # length of the token output (the largest batch bucket)
    nban: int  # banned-token columns per row (min_tokens)
    penalties: bool = False
    kc: int = 0  # state checkpoint columns per row (prefill with a prefix cache; 0: none)
    sampling: str = "greedy"  # the sampler's static mode (sampler.MODES): what the rows need at most

    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        B = self.B
        out = [("tokens", (B, self.T)), ("src", (B,)), ("q_lens", (B,)), ("kv_lens", (B,)), ("slots", (B,))]
        out += [(f"table:{p}", (B, self.P)) for p in self.pools]
        if self.kc:
            out += [("ck_pos", (B, self.kc)), ("ck_slots", (B, self.kc))]
        out += [(n, (B,)) for n in _INT_SAMPLING + _FLOAT_SAMPLING]
        out += [("ban", (B, self.nban))]
        return out

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Every field but the sampling block's later ones starts at a multiple of FIELD_ALIGN:
        unpack's slices are views of the meta buffer (no copy), and a kernel may require 256-byte
        aligned inputs (the Mosaic GPU prefill refused an unaligned page-table view on the H200:
        "Input buffer 2 is not 256-byte aligned").  The sampling fields stay one block."""
        out, at = {}, 0
        for name, shape in self.fields():
            if name not in _ROW_SAMPLING[1:]:  # the per-row sampling fields stay one block
                at = -(-at // FIELD_ALIGN) * FIELD_ALIGN
            out[name] = (at, shape)
            at += int(np.prod(shape))
        out["_size"] = (at, ())
        return out

    @property
    def size(self) -> int:
        return self.offsets["_size"][0]

    def host_views(self, meta: np.ndarray) -> dict[str, np.ndarray]:
        """Writable numpy views of each field of a host meta buffer (floats as float32)."""
        views = {}
        for name, (at, shape) in self.offsets.items():
            if name == "_size":
                continue
            v = meta[at:at + int(np.prod(shape))].reshape(shape)
            views[name] = v.view(np.float32) if name in _FLOAT_SAMPLING else v
        return views

    def unpack(self, meta: jax.Array) -> dict[str, jax.Array]:
        """The device-side inverse of host_views (static slices: free under jit)."""
        out = {}
        for name, (at, shape) in self.offsets.items():
            if name == "_size":
                continue
            v = lax.slice(meta, (at,), (at + int(np.prod(shape)),)).reshape(shape)
            out[name] = lax.bitcast_convert_type(v, jnp.float32) if name in _FLOAT_SAMPLING else v
        return out


# One jitted step per (model graph, params structure, plan, kernels): engines built on the same
# model share compilations (tests build several engines on one model).
_STEPS: dict = {}


def step_function(model, plan, impl: str | None, interpret: bool, treedef=None):
    """The jitted step.  With `treedef` (the params' pytree structure) it takes the params as
    their flat list of leaves: flattening the NNX State on every call is Python work per leaf,
    a flat list is flattened by the C++ dispatch path."""
    key = (model.graphdef, treedef, plan, impl, interpret, getattr(model, "mesh", None))
    if key not in _STEPS:
        forward = model.forward_fn(plan, impl=impl, interpret=interpret)

        def step(params, arena, meta, prev, counts, layout: Layout):
            if treedef is not None:
                params = jax.tree.unflatten(treedef, params)
            f = layout.unpack(meta)
            tokens, src = f["tokens"], f["src"]
            fed = jnp.take(prev, jnp.clip(src, 0, prev.shape[0] - 1))
            tokens = tokens.at[:, 0].set(jnp.where(src >= 0, fed, tokens[:, 0]))
            batch = Batch(tokens, f["q_lens"], f["kv_lens"], {p: f[f"table:{p}"] for p in layout.pools}, f["slots"],
                          f.get("ck_pos"), f.get("ck_slots"))
            logits, arena = forward(params, arena, batch)
            ban = f["ban"]  # [B, nban], -1 = none: min_tokens keeps stop tokens out
            rows = jnp.arange(layout.B)[:, None]
            logits = logits.at[rows, jnp.maximum(ban, 0)].min(jnp.where(ban >= 0, -jnp.inf, jnp.inf))
            samp = [f[n] for n in ("temperature", "top_k", "top_p", "min_p", "seed", "step", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty")]
            if layout.penalties:
                toks = sample_with_penalties(logits, counts[0], counts[1], *samp, mode=layout.sampling)
            else:
                toks = sample(logits, *samp, mode=layout.sampling)
            out = jnp.zeros((layout.bmax,), jnp.int32).at[: layout.B].set(toks.astype(jnp.int32))
            return out, arena

        _STEPS[key] = jax.jit(step, donate_argnums=(1,), static_argnums=(5,))
    return _STEPS[key]


@dataclasses.dataclass
class Launched:
    """A step in flight: its output tokens (a device array, not read yet) and its rows."""

    batch: ScheduledBatch
    tokens: jax.Array


# Per-request sampling words (floats bit-cast to int32) the row cache keeps, in the layout's
# order: fixed for a request's life (converted once), except `step`, filled in every step.
_ROW_SAMPLING = _INT_SAMPLING + _FLOAT_SAMPLING
_STEP_COL = _ROW_SAMPLING.index("step")
# The value of each per-row field in a padding row (SamplingBatch's padding: greedy, no cuts).
_PAD = {"src": -1, "ban": -1, "ck_pos": -1, "top_p": 1.0, "repetition_penalty": 1.0}


def _words(values, dtype) -> np.ndarray:
    return np.asarray(values, dtype).view(np.int32)


class RowCache:
    """Host copies of what each request contributes to every step it is in, kept between steps.

    A row per request (by identity) holds its virtual page ids, padded with -1 to `width`, and
    its sampling words.  A step gathers the rows of its requests with one numpy index instead of
    converting every request's Python lists again.  The page row is checked against the
    request's `pages` list on every use (a C-level list comparison) and updated incrementally
    when pages were appended (a decode step gains at most one), rewritten when they changed
    otherwise (retraction, rollback).  Physical pages are NOT cached: the allocator's read table
    is gathered through the whole [B, P] block each step (one np.take per sub-pool), so moves,
    frees and window tombstones need no invalidation here.  Sampling words are rebuilt when the
    request's params object or seed changes.  Rows of requests no longer launched are reused
    when the cache is full (capacity doubles if one step needs more rows than it has).
    """

    def __init__(self, width: int, capacity: int):
        self.width = int(width)
        self.vids = np.full((capacity, self.width), -1, np.int32)
        self.samp = np.zeros((capacity, len(_ROW_SAMPLING)), np.int32)
        self.pen = np.zeros(capacity, bool)  # the request's params use penalties
        self.mode = np.zeros(capacity, np.int8)  # index in sampler.MODES of what the params need
        self.entries: dict[int, list] = {}  # id(req) -> [row, req, pages (copy), params, seed]
        self.free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.vids.shape[0]

    def entry(self, req, batch_rows) -> list:
        """The entry of `req`, refreshed if its params or seed changed (pages: see `pages`)."""
        e = self.entries.get(id(req))
        if e is not None and e[1] is req and e[3] is req.params and e[4] == req.seed:
            return e
        if e is not None:
            row = e[0]
        else:
            if not self.free:
                self._reclaim(batch_rows)
            row = self.free.pop()
        p = req.params
        self.samp[row, :3] = (max(p.top_k, 0), req.seed, 0)
        self.samp[row, 3:] = _words([p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                                     p.frequency_penalty], np.float32)
        self.pen[row] = p.has_penalties
        self.mode[row] = MODES.index(sampling_mode(p.temperature, max(p.top_k, 0), p.top_p, p.min_p))
        self.vids[row] = -1
        e = [row, req, [], p, req.seed]
        self.entries[id(req)] = e
        return e

    def set_pages(self, e: list, pages: list) -> None:
        """Bring row e's page ids up to `pages` (which differs from the copy e holds)."""
        n, old = len(pages), e[2]
        k = len(old)
        if n > self.width:
            raise ValueError(f"{n} is above the largest bucket {self.width}")
        row = self.vids[e[0]]
        if n >= k and pages[:k] == old:  # grown: write only the new ids
            row[k:n] = pages[k:]
        else:
            row[:n] = pages
            row[n:] = -1
        e[2] = list(pages)

    def _reclaim(self, batch_rows) -> None:
        """Free the rows of requests not in this step; grow if that is not enough."""
        keep = {id(r.req) for r in batch_rows}
        for key in [k for k in self.entries if k not in keep]:
            self.free.append(self.entries.pop(key)[0])
        if len(self.free) < max(1, len(batch_rows) - len(self.entries)) or not self.free:
            cap = self.capacity
            self.vids = np.concatenate([self.vids, np.full((cap, self.width), -1, np.int32)])
            self.samp = np.concatenate([self.samp, np.zeros_like(self.samp)])
            self.pen = np.concatenate([self.pen, np.zeros_like(self.pen)])
            self.mode = np.concatenate([self.mode, np.zeros_like(self.mode)])
            self.free += range(2 * cap - 1, cap - 1, -1)


class Runner:
    def __init__(self, model, plan, num_rows: int, allocator: ChainAllocator, buckets: Buckets, *,
                 impl: str | None = None, interpret: bool = False, debug_nan: bool = False, nban: int = 4,
                 checkpoints: bool = False):
        self.model, self.plan, self.allocator, self.buckets = model, plan, allocator, buckets
        self.impl, self.interpret = impl, interpret
        self.pools = tuple(sp.name for sp in plan.token_pools)
        self.has_state = plan.state is not None
        self.kc = CHECKPOINTS_PER_ROW if checkpoints and self.has_state else 0  # prefill steps only
        self.vocab = model.config.vocab_size
        self.nban = nban
        self.bmax = buckets.batch[-1]
        self.arena = Arena.create(plan, num_rows, debug_nan=debug_nan, mesh=getattr(model, "mesh", None))
        self._params_src = None  # the params pytree the flat leaves below come from
        self._leaves()
        self._prev = jnp.zeros((self.bmax,), jnp.int32)
        if getattr(model, "mesh", None) is not None:  # as the step returns it, so the first step's shape is reused
            self._prev = jax.device_put(self._prev, jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec()))
        self._rows = RowCache(buckets.pages[-1], 2 * self.bmax)
        self._layouts: dict[tuple, tuple[Layout, np.ndarray, dict]] = {}
        self.shapes: set[Layout] = set()  # every step shape launched: each one compilation
        self._ready: set[Layout] = set()  # shapes launched or precompiled (a covering sampling mode is reused)
        self.num_moved_pages = 0  # pages relocated by compaction / float moves
        self.num_compactions = 0  # batches of relocations applied (one per step at most)
        self.relocated_bytes = 0
        self.num_copied_slots = 0  # state slots copied (prefix-cache checkpoints saved / restored)
        self.row_bytes = allocator.row_bytes

    @property
    def num_compilations(self) -> int:
        """Distinct step shapes this runner launched (each compiled once, or found compiled by
        an engine on the same model).  A steady workload stops growing it."""
        return len(self.shapes)

    def _leaves(self) -> list:
        """The params as a flat list of arrays (re-flattened if model.params was replaced)."""
        if self.model.params is not self._params_src:
            self._params_src = self.model.params
            self._params, treedef = jax.tree.flatten(self._params_src)
            self._step = step_function(self.model, self.plan, self.impl, self.interpret, treedef)
        return self._params

    def apply_moves(self, moves) -> None:
        """Relocations queued by the allocator, applied before the step that reads the pages."""
        if moves:
            self.arena = apply_moves(self.arena, moves, impl=self.impl, interpret=self.interpret)
            relocations = [m for m in moves if not m.copy]
            self.num_compactions += bool(relocations)
            self.num_moved_pages += sum(len(m) for m in relocations)
            self.relocated_bytes += sum(len(m) * m.rows_per_page for m in relocations) * self.row_bytes
            self.num_copied_slots += sum(len(m) for m in moves if m.copy)

    def layout(self, batch: ScheduledBatch, penalties: bool = False, sampling: str = "greedy") -> Layout:
        bk = self.buckets
        B = Buckets.pick(bk.batch, len(batch.rows))
        T = 1 if batch.kind == "decode" else Buckets.pick(bk.tokens, max(r.end - r.start for r in batch.rows))
        P = Buckets.pick(bk.pages, max(len(r.req.pages) for r in batch.rows))
        return self._shape(B, T, P, penalties, self.kc if batch.kind == "prefill" else 0, sampling)[0]

    def _shape(self, B: int, T: int, P: int, penalties: bool, kc: int = 0,
               sampling: str = "greedy") -> tuple[Layout, np.ndarray, dict]:
        """(layout, its padding template, where each field sits), made once per shape."""
        key = (B, T, P, penalties, kc, sampling)
        got = self._layouts.get(key)
        if got is None:
            lay = Layout(B, T, P, self.pools, self.bmax, self.nban, penalties, kc, sampling)
            template = np.zeros(lay.size, np.int32)
            spans = {n: (at, at + int(np.prod(shape)), shape) for n, (at, shape) in lay.offsets.items() if n != "_size"}
            for name, value in _PAD.items():
                if name not in spans:
                    continue
                a, b, _ = spans[name]
                template[a:b] = _words(value, np.float32 if isinstance(value, float) else np.int32)
            a = spans[_ROW_SAMPLING[0]][0]
            if [spans[f][:2] for f in _ROW_SAMPLING] != [(a + j * B, a + (j + 1) * B) for j in range(len(_ROW_SAMPLING))]:
                raise AssertionError("Layout: the sampling fields must sit one after another (launch writes them as one block)")
            got = self._layouts[key] = (lay, template, spans)
        return got

    def precompile(self, shapes, threads: int = 8, sampling=("greedy",)) -> int:
        """Compile step shapes ahead of use -> how many.  shapes: (B, T, P, kc) tuples, each
        compiled in every sampler mode of `sampling` (sampler.MODES; a step whose rows need a
        mode that was not compiled runs in a compiled mode that covers it, else compiles).

        Each shape is traced and lowered here (Python, one at a time), then XLA compiles them on
        `threads` threads at once (compilation releases the GIL; a 4B model's step takes tens of
        seconds to compile, so a few dozen shapes one by one would take many minutes).  The
        compiled executables land in JAX's caches, so the first launch of each shape compiles
        nothing."""
        import concurrent.futures

        leaves = self._leaves()
        lowered = []
        for b, t, p, kc in shapes:
            for mode in sampling:
                lay, template, _ = self._shape(b, t, p, False, kc, mode)
                lowered.append(self._step.lower(leaves, self.arena, template, self._prev, None, lay))
                self._ready.add(lay)
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(lambda low: low.compile(), lowered))
        return len(lowered)

    def launch(self, batch: ScheduledBatch) -> Launched:
        """Pack `batch` (after the scheduler allocated its memory and the moves were applied),
        launch the step without waiting, and mark the sampled tokens as pending.

        Per row, Python only reads the request's counters; everything [B]- or [B, P]-shaped is
        built by numpy from the row cache, into one int32 buffer: the step's only host->device
        copy (handed to the jitted call as numpy, so the copy happens in its C++ dispatch)."""
        rows = batch.rows
        decode = batch.kind == "decode"
        cache = self._rows
        entries = cache.entries
        reqs = [row.req for row in rows]
        es = [entries.get(id(req)) for req in reqs]
        for i, (req, e) in enumerate(zip(reqs, es)):
            if e is None or e[1] is not req or e[3] is not req.params or e[4] != req.seed:
                es[i] = e = cache.entry(req, rows)
            if req.pages != e[2]:
                cache.set_pages(e, req.pages)
        ix = [e[0] for e in es]
        nout = [len(req.output_token_ids) + req.num_pending for req in reqs]  # req.num_output
        if decode:  # a pending input token is still on the device: the step takes it from there
            src = [req.pending_row if req.num_pending else -1 for req in reqs]
            host_tokens = [i for i, s in enumerate(src) if s < 0]
        else:
            src, host_tokens = None, range(len(rows))
        state = [req.slots[0] if req.slots else -1 for req in reqs]
        sample = [row.sample for row in rows]
        banned = [i for i, (req, k, s) in enumerate(zip(reqs, nout, sample)) if s and k < req.min_tokens]
        n = len(rows)
        ix = np.array(ix, np.intp)
        smp = np.array(sample, bool)
        penalties = bool((cache.pen[ix] & smp).any())
        sampling = MODES[int(cache.mode[ix][smp].max(initial=0))]  # rows that sample nothing need nothing
        bk = self.buckets
        B = Buckets.pick(bk.batch, n)
        T = 1 if decode else Buckets.pick(bk.tokens, max(r.end - r.start for r in rows))
        P = Buckets.pick(bk.pages, max(len(e[2]) for e in es))
        kc = 0 if decode else self.kc
        lay, template, spans = self._shape(B, T, P, penalties, kc, sampling)
        if lay not in self._ready:  # a compiled step whose sampler covers these rows saves a compilation
            for mode in MODES[MODES.index(sampling) + 1:]:
                cover = self._shape(B, T, P, penalties, kc, mode)
                if cover[0] in self._ready:
                    lay, template, spans = cover
                    break
        meta = template.copy()

        def field(name):
            a, b, shape = spans[name]
            return meta[a:b].reshape(shape)

        ends = np.array([row.end for row in rows], np.int32)
        if decode:
            q = np.ones(n, np.int32)
        else:
            q = ends - np.array([r.start for r in rows], np.int32)
        if src is not None:
            field("src")[:n] = src
        tokens = field("tokens")
        for i in host_tokens:
            row = rows[i]
            tokens[i, : row.end - row.start] = row.req.token_ids(row.start, row.end)
        field("q_lens")[:n] = q
        field("kv_lens")[:n] = ends
        vids = cache.vids[ix, :P]
        for p in self.pools:
            field(f"table:{p}")[:n] = self.allocator.translate_pages(vids, p, P)
        if self.has_state:
            field("slots")[:n] = self.allocator.translate_slots(np.array(state, np.int32))
        samp = cache.samp[ix]  # [n, 9]: the sampling fields sit one after another, [B] each
        samp[:, _STEP_COL] = nout
        a = spans[_ROW_SAMPLING[0]][0]
        meta[a:a + len(_ROW_SAMPLING) * B].reshape(len(_ROW_SAMPLING), B)[:, :n] = samp.T
        if lay.kc:  # prefix-cache checkpoints (prefill only): position in the chunk, state slot
            ck_pos, ck_ids = field("ck_pos"), np.full((n, lay.kc), -1, np.int32)
            for i, row in enumerate(rows):
                for j, (pos, slot) in enumerate(row.checkpoints[: lay.kc]):
                    ck_pos[i, j], ck_ids[i, j] = pos - row.start, slot
            field("ck_slots")[:n] = self.allocator.translate_slots(ck_ids.reshape(-1)).reshape(n, lay.kc)
        if banned:
            ban = field("ban")
            for i in banned:
                ids = rows[i].req.stop_ids[: self.nban]
                ban[i, : len(ids)] = ids
        counts = self._counts(rows, lay.B) if penalties else None
        self.shapes.add(lay)
        self._ready.add(lay)
        if self.model.params is not self._params_src:
            self._leaves()
        tokens, self.arena = self._step(self._params, self.arena, meta, self._prev, counts, lay)
        self._prev = tokens
        if not tokens.is_fully_addressable:  # multi-host: read this host's replica
            tokens = tokens.addressable_data(0)
        for i, row in enumerate(rows):
            if row.sample:
                row.req.pending_row = i
                row.req.num_pending += 1
        return Launched(batch, tokens)

    def _counts(self, rows, B: int):
        """Prompt and output token counts [B, V] for the penalty variant (host-built: the only
        per-step transfer besides meta, and only for batches that use penalties).  The engine
        reads back pending tokens first, so the output counts are complete."""
        pc = np.zeros((B, self.vocab), np.float32)
        oc = np.zeros((B, self.vocab), np.float32)
        for i, row in enumerate(rows):
            pc[i] = np.bincount(row.req.prompt_token_ids, minlength=self.vocab)[: self.vocab]
            if row.req.output_token_ids:
                oc[i] = np.bincount(row.req.output_token_ids, minlength=self.vocab)[: self.vocab]
        return jnp.asarray(pc), jnp.asarray(oc)


__all__ = ["Launched", "Layout", "RowCache", "Runner", "step_function"]
