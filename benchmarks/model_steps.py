"""One whole-model step outside the engine: its pages, its batch, its donated arena and its bytes.

    pager = Pager(plan, num_rows)                  # a ChainAllocator handing out pages as the engine does
    reqs = [pager.new() for _ in range(B)]
    for r in reqs:
        pager.extend(r, ctx - 1, ctx)              # one decode token at position ctx - 1
    batch = pager.batch(reqs, tokens, [1] * B, [ctx] * B, width)
    run = Stepper(model.jit_forward(), model.params, arena)
    logits = run(batch)                            # run.arena: the newest arena
    cost = step_costs(cfg, plan, params, param_bytes, B=B, T=1, start=ctx - 1)

Bytes a step must move at least (the roofline's numerator):
  weights  every parameter once (tied embeddings once, as the LM head; an untied input embedding
           counts only the B*T rows gathered); of an MoE block's routed experts only those the
           step's B*T tokens choose: the distinct experts each block's router really picked for the
           step's batch (`routed_experts`: one untimed forward with the choices sent to the host),
           or, where they were not counted, E * (1 - (1 - k/E)^(B*T)), the expected number under
           uniform routing (random weights and tokens route unevenly: fewer are touched)
  KV       per attention layer: read the K/V of every position the step's queries see (full: all
           kv_len; window w: from the first query's position - w + 1; the step's own new tokens
           included: the layer writes them first, then reads them back), written: the new tokens'
  state    per state layer and row: its tensors written, and read unless the row starts from zero
Not counted: activations, the fp32 logits, page tables.  FLOPs: the matmuls (2 per parameter and
token, embeddings apart) and attention (4 * heads * head_dim per visible (query, key) pair).
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np

from umem_jax.core.batch import make_batch
from umem_jax.memory import ChainAllocator
from umem_jax.models.moe import Router

PLAIN_ROUTER = Router.__call__  # what routers_replaced puts back


class ArenaFull(RuntimeError):
    pass


class Pager:
    """Pages and slots for one step's requests through a ChainAllocator, as the engine takes them.

    A request holds a list of token page ids (virtual) and one state slot.  Before a step writes
    positions [start, end): pages up to `end` exist; a page gets a window page only if a query at
    a position >= start can see it (the earlier ones are born tombstoned, or released now).
    """

    def __init__(self, plan, num_rows: int):
        self.plan, self.page_size = plan, plan.page_size
        self.alloc = ChainAllocator(plan, num_rows)

    def new(self) -> dict:
        slot = -1
        if self.plan.state is not None:
            got = self.alloc.alloc_state_slots(1)
            if got is None:
                raise ArenaFull(f"no state slot: {self.alloc.last_shortfall}")
            slot = int(got[0])
        return dict(pages=[], slot=slot, wfirst={sp.name: 0 for sp in self.plan.windows})

    def extend(self, req: dict, start: int, end: int) -> None:
        page_size, pages = self.page_size, req["pages"]
        first = {sp.name: max(0, start - sp.window + 1) // page_size for sp in self.plan.windows}
        old = len(pages)
        for name, f in first.items():  # window pages no query from `start` on can see
            lo, hi = req["wfirst"][name], min(f, old)
            if hi > lo:
                self.alloc.release_window_pages(np.asarray(pages[lo:hi], np.int32), name)
                req["wfirst"][name] = hi
        need = -(-end // page_size) - old
        if need <= 0:
            return
        dead = {name: min(need, max(0, f - old)) for name, f in first.items()}
        vids = self.alloc.alloc_token_pages(need, window_pages={n: need - d for n, d in dead.items()} or None)
        if vids is None:
            raise ArenaFull(str(self.alloc.last_shortfall))
        for name, d in dead.items():
            if d:
                req["wfirst"][name] = old + d
        pages.extend(int(v) for v in vids)

    def batch(self, reqs, tokens, q_lens, kv_lens, width: int):
        vids = np.full((len(reqs), width), -1, np.int64)
        for b, r in enumerate(reqs):
            vids[b, :len(r["pages"])] = r["pages"]
        tables = {sp.name: self.alloc.translate_pages(vids, sp.name, width) for sp in self.plan.token_pools}
        slots = None
        if self.plan.state is not None:
            slots = self.alloc.translate_slots(np.array([r["slot"] for r in reqs], np.int64))
        return make_batch(tokens, q_lens, kv_lens, tables, slots)


def decode_batch(pager: Pager, B: int, ctx: int, vocab_size: int, width: int, seed: int):
    """B requests decoding their token at position ctx - 1 (pages for the whole context)."""
    reqs = [pager.new() for _ in range(B)]
    for r in reqs:
        pager.extend(r, ctx - 1, ctx)
    toks = np.random.default_rng(seed).integers(1, vocab_size, size=(B, 1))
    return pager.batch(reqs, toks, [1] * B, [ctx] * B, width)


class Stepper:
    """Holds the newest arena and runs the donated step on it."""

    def __init__(self, step, params, arena):
        """step: a Model.jit_forward(); it is called with the params' flat leaves (see there)."""
        import jax

        self.step, self.params, self.arena = step, jax.tree.leaves(params), arena

    def __call__(self, batch):
        logits, self.arena = self.step(self.params, self.arena, batch)
        return logits

    def advance(self, batch):
        """A step whose logits are dropped at once -> the arena's data (to wait on).  Timed loops
        use this: a loop that keeps the last logits alive while the next step allocates moves the
        step's buffers every call, and XLA then re-records the step's CUDA graph before each
        launch (~4 us of host time a kernel; bench_issue.py), more than the engine pays: its B = 1
        ITL equals its device step (RESULTS.md, session 22)."""
        logits, self.arena = self.step(self.params, self.arena, batch)
        del logits
        return self.arena.data


def param_counts(params) -> dict:
    """Parameters and their bytes; expert_* the routed experts' share (stacked `experts.*` leaves)."""
    import jax

    flat = jax.tree_util.tree_leaves_with_path(params)
    is_expert = lambda path: any(getattr(k, "key", getattr(k, "name", None)) == "experts" for k in path)
    nbytes = lambda x: x.size * x.dtype.itemsize  # arrays and ShapeDtypeStructs alike
    experts = [x for path, x in flat if is_expert(path)]
    leaves = [x for _, x in flat]
    return dict(params=sum(x.size for x in leaves), param_bytes=sum(map(nbytes, leaves)),
                expert_params=sum(x.size for x in experts), expert_bytes=sum(map(nbytes, experts)))


def routed_experts(model, arena, batch, **kernel_kw):
    """The distinct experts every MoE block's router picks for `batch`'s valid tokens -> (counts
    [blocks] in layer order, the newest arena).  One forward traced afresh, untimed, under a
    RouterRecorder; the arena is donated and written as the timed step writes it (the same K/V,
    state rows)."""
    import jax

    recorder = RouterRecorder()
    with recorder.recording() as seen:
        logits, arena = model.jit_forward(**kernel_kw)(model.params, arena, batch)
        jax.block_until_ready(logits)
    ok = np.asarray(batch.valid()).reshape(-1)  # a router sees its block's [B * T] tokens, row-major
    return [int(np.unique(e[ok]).size) for e in seen], arena


class RouterRecorder:
    """Every MoE router traced inside `recording()` sends its choice (experts [N, k]) to the host
    by an ordered debug callback, in call order.  The callback is compiled into the trace and
    appends to the list current when the program runs, so a cached trace called again inside a
    later `recording()` reports to that one."""

    def __init__(self):
        self.seen: list = []

    def call(self, router, x, valid=None):
        import jax

        weights, experts = PLAIN_ROUTER(router, x, valid)
        routed = experts[..., :router.cfg.top_k]  # not the shared expert's slots that follow (MoE.fuse_projections)
        jax.debug.callback(lambda e: self.seen.append(np.asarray(e)), routed, ordered=True)
        return weights, experts

    @contextlib.contextmanager
    def recording(self):
        """-> the list this recording's choices go to (complete once the block has run)."""
        import jax

        self.seen = []
        with routers_replaced(self.call):
            yield self.seen
            jax.effects_barrier()


@contextlib.contextmanager
def routers_replaced(call):
    """Router.__call__ is `call(router, x, valid)` while traces are made (restored after).  A
    function is put on the class, so it binds to each router as a method would."""
    Router.__call__ = lambda router, x, valid=None: call(router, x, valid)
    try:
        yield
    finally:
        Router.__call__ = PLAIN_ROUTER


def experts_touched(cfg, tokens: int) -> float:
    """Expected fraction of an MoE block's experts that `tokens` tokens choose (uniform routing)."""
    moe = getattr(cfg, "moe", None)
    if moe is None:
        return 1.0
    return 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens


def step_costs(cfg, plan, param_count: int, param_bytes: int, *, B: int, T: int, start: int,
               expert_params: int = 0, expert_bytes: int = 0, routed: list[int] | None = None) -> dict:
    """Bytes the step must move at least (see the module doc) and its matmul + attention FLOPs.
    routed: the distinct experts each MoE block picked (routed_experts); None: uniform routing."""
    end = start + T
    wbytes = jnp.dtype(cfg.dtype).itemsize
    embed = cfg.vocab_size * cfg.hidden_size
    moe = getattr(cfg, "moe", None)
    touched = (float(np.mean(routed)) / moe.num_experts if routed and moe is not None
               else experts_touched(cfg, B * T))
    weights = param_bytes - expert_bytes + touched * expert_bytes
    # Each token runs k of E experts: the routed experts' FLOPs are k/E of their parameters'.
    active = param_count - expert_params + (expert_params * moe.top_k / moe.num_experts if moe else 0)
    if not cfg.tie_word_embeddings:  # the input table is gathered, not streamed
        weights += -embed * wbytes + B * T * cfg.hidden_size * wbytes
    kv_read = kv_write = 0
    attn_flops = 0.0
    pos = np.arange(start, end, dtype=np.int64)
    for sp in plan.token_pools:
        g = sp.geometry
        per_tok = (g.k_words + g.v_words) * 2 * len(sp.layers)
        w = sp.window
        lo = 0 if w is None else max(0, start - w + 1)
        kv_read += B * (end - lo) * per_tok
        kv_write += B * T * per_tok
        seen = (pos + 1) if w is None else np.minimum(pos + 1, w)
        attn_flops += 4.0 * B * int(seen.sum()) * cfg.num_heads * cfg.head_dim * len(sp.layers)
    state_read = state_write = 0
    if plan.state is not None:
        per_slot = plan.state.geometry.words * 2 * len(plan.state.layers)
        state_write = B * per_slot
        state_read = B * per_slot if start > 0 else 0
    heads = embed * (1 if cfg.tie_word_embeddings else 2)
    flops = 2.0 * B * T * (active - heads) + 2.0 * B * embed + attn_flops
    return dict(weight_bytes=weights, experts_touched=touched, kv_read_bytes=kv_read, kv_write_bytes=kv_write, state_read_bytes=state_read,
                state_write_bytes=state_write, total_bytes=weights + kv_read + kv_write + state_read + state_write,
                flops=flops)


def rel_err(a, b) -> float:
    """max|a - b| / max|b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


__all__ = ["ArenaFull", "Pager", "Stepper", "decode_batch", "experts_touched", "param_counts", "rel_err", "routed_experts",
           "step_costs"]
