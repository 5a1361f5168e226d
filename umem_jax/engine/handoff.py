"""Handoff: a request's memory out of one engine and into another (prefill/decode disaggregation).

The unit of transfer is the page envelope (DESIGN.md): after its prefill, a request's memory
is its full-attention pages, the window pages its future queries still attend, and its state
slot -- whole envelopes, read from the arena by physical page id (rows [page_row(p),
page_row(p + 1)) of the sub-pool's grid: plan.py) and written into the receiver's arena at the
pages ITS allocator reserved.  Both sides derive the same `TransferPlan` from the token count and the memory plan,
so the sender never says where to write, and an arena of another size works.

    prefill engine                              decode engine
    hold_after_prefill(rid); add_request(rid)   reserve(prompt ids, params, rid, computed)
    ... steps until rid finishes (1 token) ...
    env = export(rid)          -- bytes -->     install(rid, env)   (now decoding)
    release(rid)  (on the receiver's ack)       release(rid)        (only a cancelled reservation)

Every method runs on the engine's thread, between steps.  Pending page moves are applied first,
so the virtual -> physical translation and the bytes agree.  Not supported yet (refused by
name): tensor parallelism, speculative decoding, logprobs, n / best_of.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import numpy as np

from ..arena import Arena, move_bucket
from ..core.request import Request, RequestStatus
from ..core.sampling_params import SamplingParams
from ..memory.plan import Plan
from ..scheduler import held
from .detokenizer import IncrementalDetokenizer
from .fit import fit_max_tokens


def plan_fingerprint(plan: Plan, dtype, model_config=None) -> str:
    """A short hash of everything that fixes the bytes of a page envelope: the plan (every
    sub-pool's layers, geometry, rows per entry, row words, page size) and the arena dtype; and of
    the model's config when given, since two models of one plan (another vocabulary, MLP width,
    RoPE) read the same bytes differently: decoding one's envelopes on the other is silent garbage."""
    return hashlib.sha256(f"{plan!r}|{np.dtype(dtype).name}|{model_config!r}".encode()).hexdigest()[:16]


def plan_mismatch(theirs: str, ours: str) -> str:
    """Why envelopes of fingerprint `theirs` cannot go into an engine of fingerprint `ours`."""
    return (f"page envelopes of another memory plan ({theirs}, this engine's is {ours}): both engines must "
            f"run the same model, page size and K/V dtype")


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """Which logical pages of a request with `computed` tokens move: page indices per token
    sub-pool (full: all; window w: those from its first attended page) and the state slots."""

    computed: int
    pages: dict[str, tuple[int, int]]  # sub-pool -> [first, end) page indices of the request
    state_slots: int

    @classmethod
    def of(cls, plan: Plan, computed: int) -> TransferPlan:
        n = -(-computed // plan.page_size)
        windows = tuple((sp.name, sp.window) for sp in plan.windows)
        pages = {plan.full.name: (0, n)}
        pages.update({w: (f, n) for w, f in held.window_firsts(computed, plan.page_size, windows).items()})
        return cls(computed, pages, 1 if plan.state is not None else 0)


@dataclasses.dataclass
class Envelopes:
    """A request's memory on the host: pages[sub-pool] uint16 [n, rows_per_page, row_words] in
    the order of `plan.pages`, state uint16 [slots, rows_per_entry, row_words] (or None)."""

    fingerprint: str
    plan: TransferPlan
    first_token: int
    pages: dict[str, np.ndarray]
    state: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.pages.values()) + (0 if self.state is None else self.state.nbytes)


# ------------------------------------------------------------------------------ device side
# One gather / one scatter per sub-pool and padded page count (move_bucket): few shapes.

def _rows(pages, rows_per_page: int, base_row: int, pad_row: int):
    """int32 [N] pages -> [N, rows_per_page] rows; padding (page 0) -> `pad_row`: on the state
    grid page 0 has no rows of its own (they may start below row 0)."""
    rows = base_row + pages[:, None] * rows_per_page + jax.numpy.arange(rows_per_page, dtype=pages.dtype)[None]
    return jax.numpy.where((pages != 0)[:, None], rows, pad_row)


@functools.partial(jax.jit, static_argnames=("rows_per_page", "base_row"))
def _read(data, pages, *, rows_per_page: int, base_row: int):
    return data[_rows(pages, rows_per_page, base_row, 0)]  # [N, rows_per_page, row_words]; padding reads row 0


@functools.partial(jax.jit, static_argnames=("rows_per_page", "base_row"), donate_argnames=("data",))
def _write(data, pages, values, *, rows_per_page: int, base_row: int):
    rows = _rows(pages, rows_per_page, base_row, data.shape[0])  # padding: out of range, dropped
    return data.at[rows].set(values.astype(data.dtype), mode="drop")


def read_envelopes(arena: Arena, physical: np.ndarray, subpool: str) -> np.ndarray:
    """Physical pages (or slots) of `subpool` -> their envelopes on the host, uint16 [n,
    rows_per_page, row_words]."""
    sp = arena.plan[subpool]
    n = len(physical)
    ids = np.zeros(move_bucket(n, 4), np.int32)  # padding lanes: page 0, read as row 0 and dropped
    ids[:n] = physical
    out = np.asarray(_read(arena.data, ids, rows_per_page=sp.rows_per_page, base_row=sp.base_row))[:n]
    return out.view(np.uint16) if out.dtype != np.uint16 else out


def write_envelopes(arena: Arena, physical: np.ndarray, values: np.ndarray, subpool: str) -> Arena:
    """Write envelopes uint16 [n, rows_per_page, row_words] into physical pages of `subpool`;
    donates `arena`."""
    sp = arena.plan[subpool]
    n = len(physical)
    b = move_bucket(n, 4)
    ids = np.zeros(b, np.int32)  # padding lanes: page 0, written nowhere
    ids[:n] = physical
    vals = np.zeros((b, sp.rows_per_page, arena.row_words), np.uint16)
    vals[:n] = values
    vals = vals.view(jax.numpy.bfloat16) if arena.dtype == jax.numpy.bfloat16 else vals
    return arena.replace(_write(arena.data, ids, vals, rows_per_page=sp.rows_per_page, base_row=sp.base_row))


# ------------------------------------------------------------------------------ the engine's side
class Handoff:
    """The engine's export / import hooks (engine.handoff)."""

    def __init__(self, engine):
        self.engine = engine
        self.fingerprint = plan_fingerprint(engine.plan, engine.runner.arena.dtype, engine.model.config)
        self._hold: set[str] = set()  # requests to hold when their one prefill token is out

    @property
    def held(self) -> dict[str, Request]:
        return self.engine.scheduler.held

    def check_supported(self, params: SamplingParams) -> None:
        """Refuse what a handoff cannot carry yet, by name."""
        eng = self.engine
        if eng.runner.arena.mesh is not None:
            raise NotImplementedError("disaggregation with tensor parallelism is not supported yet")
        if eng.config.speculative_config is not None:
            raise NotImplementedError("disaggregation with speculative decoding is not supported yet")
        if (params.logprobs is not None or params.prompt_logprobs is not None or params.n != 1
                or (params.best_of or 1) != 1):
            raise ValueError("disaggregation supports n=1 without logprobs or prompt_logprobs for now")

    # -------------------------------------------------------------- prefill side
    def hold_after_prefill(self, request_id: str) -> None:
        """When `request_id` finishes by length (its max_tokens), keep its memory for `export`."""
        self._hold.add(str(request_id))

    def keeps(self, req: Request) -> bool:
        """Whether `req`'s memory is to be held when it finishes (never given back early)."""
        return req.request_id in self._hold

    def finish(self, req: Request, status: RequestStatus) -> bool:
        """Engine._finish's hook -> True when the request was held instead of freed."""
        if req.request_id not in self._hold:
            return False
        self._hold.discard(req.request_id)
        if status != RequestStatus.FINISHED_LENGTH:
            return False
        held.hold(self.engine.scheduler, req)
        return True

    def export(self, request_id: str) -> Envelopes:
        """A held request's memory as envelopes (it stays held: `release` frees it)."""
        eng = self.engine
        req = self.held[request_id]
        plan = TransferPlan.of(eng.plan, req.num_computed)
        self._apply_moves()
        pages = {}
        for name, (first, end) in plan.pages.items():
            if name != eng.plan.full.name and req.window_start[name] > first:
                raise AssertionError(f"{request_id}: {name} pages from {first} are needed but only "
                                     f"{req.window_start[name]}.. are bound")
            phys = eng.allocator.translate_pages(np.asarray(req.pages[first:end], np.int32), name)
            pages[name] = read_envelopes(eng.runner.arena, phys, name)
        state = None
        if plan.state_slots:
            phys = eng.allocator.translate_slots(np.asarray(req.slots[:plan.state_slots], np.int32))
            state = read_envelopes(eng.runner.arena, phys, eng.plan.state.name)
        return Envelopes(self.fingerprint, plan, int(req.output_token_ids[-1]), pages, state)

    # -------------------------------------------------------------- decode side
    def reserve(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> Request | None:
        """Take the memory of the prompt's tokens for an incoming request -> the held request, or
        None when it does not fit now (retry later).  Bad input raises ValueError."""
        eng = self.engine
        self.check_supported(params)
        req = eng.prepare(list(prompt_token_ids), params, request_id=request_id)
        clipped = eng.demand.clip(req.prompt_len, req.max_tokens)
        if clipped is None:
            raise ValueError(f"the prompt ({req.prompt_len} tokens) does not fit this decode engine's arena")
        why = fit_max_tokens(req, clipped, eng.max_model_len)  # as LLMEngine.enqueue
        if why is not None:
            raise ValueError(why)
        if not held.reserve(eng.scheduler, req, req.prompt_len):
            return None
        if eng.tokenizer is not None:
            req.detok = IncrementalDetokenizer(eng.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
        eng._requests[req.request_id] = req
        return req

    def install(self, request_id: str, env: Envelopes) -> Request:
        """Write `env` into the reserved request's pages and start decoding it (its first
        output token is the sender's).  A plan that differs raises ValueError saying how."""
        eng = self.engine
        req = self.held[request_id]
        if env.fingerprint != self.fingerprint:
            raise ValueError(plan_mismatch(env.fingerprint, self.fingerprint))
        plan = TransferPlan.of(eng.plan, req.prompt_len)
        if env.plan != plan:
            raise ValueError(f"transfer plans differ: sender {env.plan}, receiver {plan}")
        self._check_arrays(env, plan)  # before any write: each write donates the arena
        self._apply_moves()
        # The runner takes each new arena at once, so it never holds a donated (deleted) buffer.
        for name, (first, end) in plan.pages.items():
            phys = eng.allocator.translate_pages(np.asarray(req.pages[first:end], np.int32), name)
            eng.runner.arena = write_envelopes(eng.runner.arena, phys, env.pages[name], name)
        if plan.state_slots:
            phys = eng.allocator.translate_slots(np.asarray(req.slots[:plan.state_slots], np.int32))
            eng.runner.arena = write_envelopes(eng.runner.arena, phys, env.state, eng.plan.state.name)
        held.activate(eng.scheduler, req, plan.computed)
        eng._append(req, env.first_token)
        if req.finished:
            eng._requests.pop(req.request_id, None)
        return req

    def _check_arrays(self, env: Envelopes, plan: TransferPlan) -> None:
        """Raise ValueError unless `env` holds exactly the arrays `plan` moves, uint16 and shaped
        [pages, rows_per_page, row_words], and a first token of the vocabulary.  A truncated or
        corrupt payload is refused here, before the first write: numpy would broadcast a single
        page over all of them, and a failure between two writes would leave a donated arena."""
        eng = self.engine
        words = eng.runner.arena.row_words
        want = {name: (end - first, eng.plan[name].rows_per_page, words) for name, (first, end) in plan.pages.items()}
        if set(env.pages) != set(want):
            raise ValueError(f"page envelopes of sub-pools {sorted(env.pages)}, the transfer plan moves {sorted(want)}")
        arrays = [(name, env.pages[name], shape) for name, shape in want.items()]
        if plan.state_slots:
            arrays.append((eng.plan.state.name, env.state,
                           (plan.state_slots, eng.plan.state.rows_per_page, words)))
        elif env.state is not None:
            raise ValueError("page envelopes carry a state slot, the transfer plan moves none")
        for name, a, shape in arrays:
            if not isinstance(a, np.ndarray) or a.dtype != np.uint16 or a.shape != shape:
                got = ("nothing" if a is None
                       else f"{getattr(a, 'dtype', type(a).__name__)}{list(getattr(a, 'shape', ()))}")
                raise ValueError(f"page envelopes of {name}: {got}, the transfer plan moves uint16{list(shape)}")
        vocab = eng.model.config.vocab_size
        if not 0 <= int(env.first_token) < vocab:
            raise ValueError(f"the first token {env.first_token} is out of the vocabulary [0, {vocab})")

    def release(self, request_id: str) -> None:
        """Free a held request's memory (prefill: after the ack; decode: a cancelled reservation).
        A reservation never installed ends aborted."""
        req = self.held.get(request_id)
        if req is None:
            return
        held.release(self.engine.scheduler, req)
        self.engine._requests.pop(request_id, None)
        if not req.finished:
            req.mark_finished(RequestStatus.FINISHED_ABORTED, error="the page transfer was cancelled")

    def _apply_moves(self) -> None:
        eng = self.engine
        eng.runner.apply_moves(eng.allocator.take_moves())
