"""Packing a step's inputs on the host: the metadata layout, the per-request row cache, and the
packing of one batch.

`Layout` says where each field of a step's packed int32 metadata sits; `RowCache` keeps what
each request contributes to every step it is in (virtual page ids, sampling words) as numpy
rows, so a step gathers its rows with one index instead of converting Python lists again;
`pack` fills a layout's buffer with a batch's rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.request import Request
from ..core.sampling_params import GREEDY_BELOW, SamplingParams
from .sampler import MODES, sampling_mode

FIELD_ALIGN = 64  # int32 words: 256 bytes
INT_SAMPLING = ("top_k", "seed", "step")
FLOAT_SAMPLING = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
# Per-request sampling words (floats bit-cast to int32), in the layout's order: fixed for a
# request's life (converted once), except `step`, which is filled in every step.
SAMPLING_FIELDS = INT_SAMPLING + FLOAT_SAMPLING
STEP_COLUMN = SAMPLING_FIELDS.index("step")
# The value of each per-row field in a padding row: greedy, no cuts, no penalties, nothing fed, banned or biased.
_PAD = {"src": -1, "ban": -1, "checkpoint_positions": -1, "top_p": 1.0, "repetition_penalty": 1.0, "bias_ids": -1}
FLOAT_FIELDS = FLOAT_SAMPLING + ("bias",)  # float32 fields, bit-cast into the int32 buffer
LOGIT_BIAS_BUCKETS = (16, 64, 300)  # bias columns a step may carry per row (the last: MAX_LOGIT_BIAS)


def logit_bias_bucket(n: int) -> int:
    """Bias columns of a step whose rows bias at most n token ids (0: none)."""
    return 0 if n <= 0 else next(b for b in LOGIT_BIAS_BUCKETS if b >= n)


def words(values, dtype) -> np.ndarray:
    """`values` as `dtype`, reinterpreted as int32 words (floats bit-cast, not converted)."""
    return np.asarray(values, dtype).view(np.int32)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape of one step: B rows of T tokens, page tables P wide, and where each field
    sits in the packed int32 metadata.  Hashable: the jitted step's static argument, so each
    layout compiles once."""

    B: int
    T: int
    P: int
    pools: tuple[str, ...]  # token sub-pools with a page table, full first
    max_batch: int  # length of the token output (the largest batch bucket)
    banned_per_row: int  # banned-token columns per row (min_tokens keeps stop ids out)
    penalties: bool = False
    checkpoints_per_row: int = 0  # state checkpoint columns (prefill with a prefix cache; 0: none)
    sampling: str = "greedy"  # the sampler's static mode (sampler.MODES): what the rows need at most
    logprobs: int | None = None  # top alternatives of a logprobs step (sampler.LOGPROB_BUCKETS); None: no logprobs
    prompt_logprobs: int | None = None  # top alternatives of a prefill that scores its tokens (prompt logprobs)
    logit_bias: int = 0  # bias columns per row (LOGIT_BIAS_BUCKETS; 0: no row biases a token)

    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        B, K = self.B, self.checkpoints_per_row
        out = [("tokens", (B, self.T)), ("src", (B,)), ("q_lens", (B,)), ("kv_lens", (B,)), ("slots", (B,))]
        out += [(f"table:{p}", (B, self.P)) for p in self.pools]
        if K:
            out += [("checkpoint_positions", (B, K)), ("checkpoint_slots", (B, K))]
        out += [(n, (B,)) for n in SAMPLING_FIELDS]
        out += [("ban", (B, self.banned_per_row))]
        if self.logit_bias:
            # and whether the row may sample only its listed ids (allowed_token_ids; 0: any)
            out += [("bias_ids", (B, self.logit_bias)), ("bias", (B, self.logit_bias)), ("bias_only", (B,))]
        if self.prompt_logprobs is not None:
            out += [("next", (B,))]  # the token after each row's chunk (its last token's target)
        return out

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Every field but the sampling block's later ones starts at a multiple of FIELD_ALIGN:
        unpack's slices are views of the meta buffer (no copy), and a kernel may require 256-byte
        aligned inputs (the Mosaic GPU prefill refuses an unaligned page-table view: "Input
        buffer 2 is not 256-byte aligned").  The sampling fields stay one block, which `launch`
        writes with one transposed copy."""
        out, at = {}, 0
        for name, shape in self.fields():
            if name not in SAMPLING_FIELDS[1:]:
                at = -(-at // FIELD_ALIGN) * FIELD_ALIGN
            out[name] = (at, shape)
            at += int(np.prod(shape))
        out["_size"] = (at, ())
        return out

    @property
    def size(self) -> int:
        return self.offsets["_size"][0]

    @functools.cached_property
    def spans(self) -> dict[str, tuple[int, int, tuple[int, ...]]]:
        """Field name -> (start, end, shape) in the meta buffer."""
        return {n: (at, at + int(np.prod(shape)), shape) for n, (at, shape) in self.offsets.items() if n != "_size"}

    @functools.cached_property
    def template(self) -> np.ndarray:
        """The meta buffer of an all-padding step: each step copies it and fills its rows."""
        out = np.zeros(self.size, np.int32)
        spans = self.spans
        for name, value in _PAD.items():
            if name in spans:
                a, b, _ = spans[name]
                out[a:b] = words(value, np.float32 if isinstance(value, float) else np.int32)
        a = self.sampling_start
        if [spans[f][:2] for f in SAMPLING_FIELDS] != [(a + j * self.B, a + (j + 1) * self.B)
                                                       for j in range(len(SAMPLING_FIELDS))]:
            raise AssertionError("Layout: the sampling fields must sit one after another (launch writes them as one block)")
        return out

    @property
    def sampling_start(self) -> int:
        """Offset of the sampling block: SAMPLING_FIELDS one after another, [B] words each."""
        return self.spans[SAMPLING_FIELDS[0]][0]

    def host_views(self, meta: np.ndarray) -> dict[str, np.ndarray]:
        """Writable numpy views of each field of a host meta buffer (floats as float32)."""
        views = {}
        for name, (a, b, shape) in self.spans.items():
            v = meta[a:b].reshape(shape)
            views[name] = v.view(np.float32) if name in FLOAT_FIELDS else v
        return views

    def unpack(self, meta: jax.Array) -> dict[str, jax.Array]:
        """The device-side inverse of host_views (static slices: free under jit)."""
        out = {}
        for name, (a, b, shape) in self.spans.items():
            v = meta[a:b].reshape(shape)
            out[name] = lax.bitcast_convert_type(v, jnp.float32) if name in FLOAT_FIELDS else v
        return out


def penalty_counts(rows, B: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Prompt and output token counts [B, V] f32 of a step's rows, for the penalty variant
    (host-built: the only per-step transfer besides meta, and only for batches that use
    penalties).  The engine reads back pending tokens first, so the output counts are complete."""
    prompt = np.zeros((B, vocab), np.float32)
    output = np.zeros((B, vocab), np.float32)
    for i, row in enumerate(rows):
        prompt[i] = np.bincount(row.req.prompt_token_ids, minlength=vocab)[:vocab]
        if row.req.output_token_ids:
            output[i] = np.bincount(row.req.output_token_ids, minlength=vocab)[:vocab]
    return jnp.asarray(prompt), jnp.asarray(output)


@dataclasses.dataclass(slots=True, eq=False)
class RowEntry:
    """What the row cache holds for one request: its row and what that row was built from."""

    row: int  # index into the cache's arrays
    req: Request
    pages: list[int]  # the page ids written into the row (a copy of req.pages then)
    params: SamplingParams  # the params object the sampling words were converted from
    seed: int


class RowCache:
    """Host copies of what each request contributes to every step it is in, kept between steps.

    A row per request (by identity) holds its virtual page ids, padded with -1 to `width`, and
    its sampling words.  The page row is checked against the request's `pages` list on every use
    (a C-level list comparison) and updated incrementally when pages were appended (a decode step
    gains at most one), rewritten when they changed otherwise (retraction, rollback).  Physical
    pages are NOT cached: the allocator's read table is gathered through the whole [B, P] block
    each step (one np.take per sub-pool), so moves, frees and window tombstones need no
    invalidation here.  Sampling words are rebuilt when the request's params object or seed
    changes.  Rows of requests no longer launched are reused when the cache is full (capacity
    doubles if one step needs more rows than it has).
    """

    def __init__(self, width: int, capacity: int):
        self.width = int(width)
        self.page_ids = np.full((capacity, self.width), -1, np.int32)
        self.sampling_words = np.zeros((capacity, len(SAMPLING_FIELDS)), np.int32)
        self.penalties = np.zeros(capacity, bool)  # the request's params use penalties
        self.sampling_mode = np.zeros(capacity, np.int8)  # index in sampler.MODES of what the params need
        self.logprobs = np.full(capacity, -1, np.int8)  # alternatives the request records per token (-1: none)
        self.bias_count = np.zeros(capacity, np.int16)  # token ids the request biases (logit_bias)
        # row -> (token ids, biases, only the ids allowed), for rows with logit_bias or allowed_token_ids
        self.biases: dict[int, tuple[np.ndarray, np.ndarray, bool]] = {}
        self.entries: dict[int, RowEntry] = {}  # by id(req)
        self.free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.page_ids.shape[0]

    def gather(self, reqs: list[Request], batch_rows) -> list[RowEntry]:
        """The entries of `reqs` (a step's requests), each up to date with its request."""
        entries = self.entries
        out = []
        for req in reqs:
            e = entries.get(id(req))
            if e is None or e.req is not req or e.params is not req.params or e.seed != req.seed:
                e = self.entry(req, batch_rows)
            if req.pages != e.pages:
                self.set_pages(e, req.pages)
            out.append(e)
        return out

    def entry(self, req: Request, batch_rows) -> RowEntry:
        """The entry of `req`, refreshed if its params or seed changed (pages: see `set_pages`)."""
        e = self.entries.get(id(req))
        if e is not None and e.req is req and e.params is req.params and e.seed == req.seed:
            return e
        if e is not None:
            row = e.row
        else:
            if not self.free:
                self._reclaim(batch_rows)
            row = self.free.pop()
        p = req.params
        t = p.temperature if p.temperature >= GREEDY_BELOW else 0.0  # greedy on the device too, every step kind
        self.sampling_words[row, :3] = (max(p.top_k, 0), req.seed, 0)
        self.sampling_words[row, 3:] = words([t, p.top_p, p.min_p, p.repetition_penalty,
                                              p.presence_penalty, p.frequency_penalty], np.float32)
        self.penalties[row] = p.has_penalties
        self.sampling_mode[row] = MODES.index(sampling_mode(t, max(p.top_k, 0), p.top_p, p.min_p))
        self.logprobs[row] = -1 if req.num_logprobs is None else req.num_logprobs
        ids, b = p.bias_ids, p.logit_bias or {}
        self.bias_count[row] = len(ids)
        if ids:  # allowed ids not biased are listed with a bias of 0
            self.biases[row] = (np.array(ids, np.int32), np.array([b.get(t, 0.0) for t in ids], np.float32),
                                p.allowed_token_ids is not None)
        else:
            self.biases.pop(row, None)
        self.page_ids[row] = -1
        e = RowEntry(row, req, [], p, req.seed)
        self.entries[id(req)] = e
        return e

    def set_pages(self, e: RowEntry, pages: list[int]) -> None:
        """Bring e's page ids up to `pages` (which differs from the copy e holds)."""
        n, old = len(pages), e.pages
        k = len(old)
        if n > self.width:
            raise ValueError(f"{n} is above the largest bucket {self.width}")
        row = self.page_ids[e.row]
        if n >= k and pages[:k] == old:  # grown: write only the new ids
            row[k:n] = pages[k:]
        else:
            row[:n] = pages
            row[n:] = -1
        e.pages = list(pages)

    def _reclaim(self, batch_rows) -> None:
        """Free the rows of requests not in this step; grow if that is not enough."""
        keep = {id(r.req) for r in batch_rows}
        for key in [k for k in self.entries if k not in keep]:
            self.free.append(self.entries.pop(key).row)
        if len(self.free) < max(1, len(batch_rows) - len(self.entries)) or not self.free:
            cap = self.capacity
            self.page_ids = np.concatenate([self.page_ids, np.full((cap, self.width), -1, np.int32)])
            self.sampling_words = np.concatenate([self.sampling_words, np.zeros_like(self.sampling_words)])
            self.penalties = np.concatenate([self.penalties, np.zeros_like(self.penalties)])
            self.sampling_mode = np.concatenate([self.sampling_mode, np.zeros_like(self.sampling_mode)])
            self.logprobs = np.concatenate([self.logprobs, np.full_like(self.logprobs, -1)])
            self.bias_count = np.concatenate([self.bias_count, np.zeros_like(self.bias_count)])
            self.free += range(2 * cap - 1, cap - 1, -1)


def pack(batch, lay: Layout, cache_rows: np.ndarray, row_cache: RowCache, allocator, pools, has_state: bool,
         banned_per_row: int) -> np.ndarray:
    """A ScheduledBatch's meta buffer: the layout's padding template with the batch's rows filled
    in (cache_rows: each row's entry in `row_cache`; page ids and state slots translated to
    physical ones by `allocator`, for every sub-pool in `pools`)."""
    rows, n, spans = batch.rows, len(batch.rows), lay.spans
    reqs = [row.req for row in rows]
    meta = lay.template.copy()

    def field(name):
        a, b, shape = spans[name]
        return meta[a:b].reshape(shape)

    num_output = [len(req.output_token_ids) + req.num_pending for req in reqs]  # req.num_output, inlined
    ends = np.array([row.end for row in rows], np.int32)
    if batch.kind == "decode":  # a pending input token is still on the device: the step takes it from there
        src = [req.pending_row if req.num_pending else -1 for req in reqs]
        field("src")[:n] = src
        host_rows = [i for i, s in enumerate(src) if s < 0]
        field("q_lens")[:n] = 1
    else:
        host_rows = range(n)
        field("q_lens")[:n] = ends - np.array([r.start for r in rows], np.int32)
    tokens = field("tokens")
    for i in host_rows:
        row = rows[i]
        tokens[i, : row.end - row.start] = row.req.token_ids(row.start, row.end)
    field("kv_lens")[:n] = ends
    page_ids = row_cache.page_ids[cache_rows, :lay.P]
    for p in pools:
        field(f"table:{p}")[:n] = allocator.translate_pages(page_ids, p, lay.P)
    if has_state:
        state = np.array([req.slots[0] if req.slots else -1 for req in reqs], np.int32)
        field("slots")[:n] = allocator.translate_slots(state)
    sampling = row_cache.sampling_words[cache_rows]  # [n, fields]: the fields sit one after another, [B] each
    sampling[:, STEP_COLUMN] = num_output
    a = lay.sampling_start
    meta[a:a + len(SAMPLING_FIELDS) * lay.B].reshape(len(SAMPLING_FIELDS), lay.B)[:, :n] = sampling.T
    if lay.checkpoints_per_row:
        _pack_checkpoints(rows, lay, field("checkpoint_positions"), field("checkpoint_slots"), allocator)
    if lay.prompt_logprobs is not None:  # the token after each chunk (a prompt's: its last chunk scores none)
        field("next")[:n] = [r.req.prompt_token_ids[r.end] if r.end < r.req.prompt_len else 0 for r in rows]
    ban = field("ban")
    for i, (row, k) in enumerate(zip(rows, num_output)):
        if row.sample and k < row.req.min_tokens:
            ids = row.req.stop_ids[:banned_per_row]
            ban[i, : len(ids)] = ids
    if lay.logit_bias:  # the biasing rows' arrays, made once per request (RowCache.entry)
        bias_ids, bias, only = field("bias_ids"), field("bias").view(np.float32), field("bias_only")
        for i, (row, r) in enumerate(zip(rows, cache_rows)):
            got = row_cache.biases.get(int(r)) if row.sample else None
            if got is not None:
                bias_ids[i, : got[0].size], bias[i, : got[0].size], only[i] = got
    return meta


def _pack_checkpoints(rows, lay: Layout, positions: np.ndarray, slots: np.ndarray, allocator) -> None:
    """Prefix-cache checkpoints of a prefill step: position in the chunk, physical state slot."""
    n, k = len(rows), lay.checkpoints_per_row
    ids = np.full((n, k), -1, np.int32)
    for i, row in enumerate(rows):
        for j, (pos, slot) in enumerate(row.checkpoints[:k]):
            positions[i, j], ids[i, j] = pos - row.start, slot
    slots[:n] = allocator.translate_slots(ids.reshape(-1)).reshape(n, k)


__all__ = ["FIELD_ALIGN", "FLOAT_FIELDS", "FLOAT_SAMPLING", "INT_SAMPLING", "LOGIT_BIAS_BUCKETS", "SAMPLING_FIELDS",
           "Layout", "RowCache", "RowEntry", "logit_bias_bucket", "pack", "penalty_counts"]
