"""Runner: turns a scheduled batch into ONE jitted step over the arena, and owns the arena.

    step(params, arena, meta, prev_tokens[, counts]) -> (tokens [Bmax] int32, arena)

`meta` is one flat int32 array holding everything the step reads besides the weights: the
padded tokens, lengths, physical page tables of every token sub-pool, state slots, sampling
parameters (floats bit-cast into the int32 words) and banned token ids.  It is built on the host
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
from ..memory.chain import ChainAllocator
from ..models.batch import Batch
from .sampler import SamplingBatch, sample, sample_with_penalties
from .scheduler import Buckets, ScheduledBatch

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

    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        B = self.B
        out = [("tokens", (B, self.T)), ("src", (B,)), ("q_lens", (B,)), ("kv_lens", (B,)), ("slots", (B,))]
        out += [(f"table:{p}", (B, self.P)) for p in self.pools]
        out += [(n, (B,)) for n in _INT_SAMPLING + _FLOAT_SAMPLING]
        out += [("ban", (B, self.nban))]
        return out

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        out, at = {}, 0
        for name, shape in self.fields():
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


# One jitted step per (model graph, plan, kernels): engines built on the same model share
# compilations (tests build several engines on one model).
_STEPS: dict = {}


def step_function(model, plan, impl: str | None, interpret: bool):
    key = (model.graphdef, plan, impl, interpret)
    if key not in _STEPS:
        forward = model.forward_fn(plan, impl=impl, interpret=interpret)

        def step(params, arena, meta, prev, counts, layout: Layout):
            f = layout.unpack(meta)
            tokens, src = f["tokens"], f["src"]
            fed = jnp.take(prev, jnp.clip(src, 0, prev.shape[0] - 1))
            tokens = tokens.at[:, 0].set(jnp.where(src >= 0, fed, tokens[:, 0]))
            batch = Batch(tokens, f["q_lens"], f["kv_lens"], {p: f[f"table:{p}"] for p in layout.pools}, f["slots"])
            logits, arena = forward(params, arena, batch)
            ban = f["ban"]  # [B, nban], -1 = none: min_tokens keeps stop tokens out
            rows = jnp.arange(layout.B)[:, None]
            logits = logits.at[rows, jnp.maximum(ban, 0)].min(jnp.where(ban >= 0, -jnp.inf, jnp.inf))
            samp = [f[n] for n in ("temperature", "top_k", "top_p", "min_p", "seed", "step", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty")]
            if layout.penalties:
                toks = sample_with_penalties(logits, counts[0], counts[1], *samp)
            else:
                toks = sample(logits, *samp)
            out = jnp.zeros((layout.bmax,), jnp.int32).at[: layout.B].set(toks.astype(jnp.int32))
            return out, arena

        _STEPS[key] = jax.jit(step, donate_argnums=(1,), static_argnums=(5,))
    return _STEPS[key]


@dataclasses.dataclass
class Launched:
    """A step in flight: its output tokens (a device array, not read yet) and its rows."""

    batch: ScheduledBatch
    tokens: jax.Array


class Runner:
    def __init__(self, model, plan, num_rows: int, allocator: ChainAllocator, buckets: Buckets, *,
                 impl: str | None = None, interpret: bool = False, debug_nan: bool = False, nban: int = 4):
        self.model, self.plan, self.allocator, self.buckets = model, plan, allocator, buckets
        self.impl, self.interpret = impl, interpret
        self.pools = tuple(sp.name for sp in plan.token_pools)
        self.has_state = plan.state is not None
        self.vocab = model.config.vocab_size
        self.nban = nban
        self.bmax = buckets.batch[-1]
        self.arena = Arena.create(plan, num_rows, debug_nan=debug_nan)
        self._step = step_function(model, plan, impl, interpret)
        self._prev = jnp.zeros((self.bmax,), jnp.int32)
        self.shapes: set[Layout] = set()  # every step shape launched: each one compilation
        self.num_moved_pages = 0  # pages relocated by compaction / float moves
        self.relocated_bytes = 0
        self.row_bytes = allocator.row_bytes

    @property
    def num_compilations(self) -> int:
        """Distinct step shapes this runner launched (each compiled once, or found compiled by
        an engine on the same model).  A steady workload stops growing it."""
        return len(self.shapes)

    def apply_moves(self, moves) -> None:
        """Relocations queued by the allocator, applied before the step that reads the pages."""
        if moves:
            self.arena = apply_moves(self.arena, moves, impl=self.impl, interpret=self.interpret)
            self.num_moved_pages += sum(len(m) for m in moves)
            self.relocated_bytes += sum(len(m) * m.rows_per_page for m in moves) * self.row_bytes

    def layout(self, batch: ScheduledBatch, penalties: bool = False) -> Layout:
        bk = self.buckets
        B = Buckets.pick(bk.batch, len(batch.rows))
        T = 1 if batch.kind == "decode" else Buckets.pick(bk.tokens, max(r.end - r.start for r in batch.rows))
        P = Buckets.pick(bk.pages, max(len(r.req.pages) for r in batch.rows))
        return Layout(B, T, P, self.pools, self.bmax, self.nban, penalties)

    def launch(self, batch: ScheduledBatch) -> Launched:
        """Pack `batch` (after the scheduler allocated its memory and the moves were applied),
        launch the step without waiting, and mark the sampled tokens as pending."""
        rows = batch.rows
        penalties = any(r.sample and r.req.params.has_penalties for r in rows)
        lay = self.layout(batch, penalties)
        meta = np.zeros(lay.size, np.int32)
        v = lay.host_views(meta)
        v["src"][:] = -1
        vids = np.full((lay.B, lay.P), -1, np.int32)
        slot_ids = np.full((lay.B,), -1, np.int32)
        v["ban"][:] = -1
        params, seeds, steps = [], [], []
        for i, row in enumerate(rows):
            req = row.req
            n = row.end - row.start
            if req.num_pending and batch.kind == "decode":
                v["src"][i] = req.pending_row  # the token is still on the device
            else:
                v["tokens"][i, :n] = req.token_ids(row.start, row.end)
            v["q_lens"][i], v["kv_lens"][i] = n, row.end
            vids[i, : len(req.pages)] = req.pages
            if req.slots:
                slot_ids[i] = req.slots[0]
            params.append(req.params)
            seeds.append(req.seed)
            steps.append(req.num_output)
            if row.sample and req.num_output < req.min_tokens:
                ban = req.stop_ids[: self.nban]
                v["ban"][i, : len(ban)] = ban
        for p in self.pools:
            v[f"table:{p}"][:] = self.allocator.translate_pages(vids, p, lay.P)
        if self.has_state:
            v["slots"][:] = self.allocator.translate_slots(slot_ids, lay.B)
        sb = SamplingBatch.build(params, seeds, steps, lay.B)
        for name in _INT_SAMPLING + _FLOAT_SAMPLING:
            v[name][:] = getattr(sb, name)
        counts = self._counts(rows, lay.B) if penalties else None
        self.shapes.add(lay)
        tokens, self.arena = self._step(self.model.params, self.arena, jnp.asarray(meta), self._prev, counts, lay)
        self._prev = tokens
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


__all__ = ["Launched", "Layout", "Runner", "step_function"]
