"""bench_speculative's parts: the HARNESS proposer, the capture of a step's arguments, and the
replay that times one jitted step on the device.

The harness is a test harness, not a draft: random weights accept nothing, so the end-to-end
runs propose the target's own greedy continuation (recorded by the run without speculation) and
corrupt each draft position independently with probability 1 - a (seeded).  The greedy verify
keeps a draft exactly when it is the target's token, so draft j of a step is kept with
probability a^j and a step accepts a(1 - a^k)/(1 - a) drafts on average.

    h = Harness(k, vocab, a=0.8, seed=0)
    h.expected[rid] = np.array(prompt + continuation)   # per request id, before its run
    h.install(speculator)     # method "draft": Speculator.propose -> drafts picked on the device
                              # from a window of 2k tokens, one device_put (steps still overlap)
    h.install_mtp(speculator) # method "mtp": each decode step's next drafts replaced on the device
    h.after_step(engine)      # method "mtp": after each step, the drafts a prefill left on the host
                              # (Request.drafts) replaced by the harness's

    with capture(module_or_object, "jit_verify", B, store):    # the first call with B live rows
        ...run...                                               # store["args"], store["kw"]
    t = replay(runner, fn, store, iters=20, trials=3)          # ms per call, arena threaded through
"""

from __future__ import annotations

import contextlib
import functools
import time

from pathlib import Path

import numpy as np

LABEL = ("HARNESS proposer (a test harness, not a draft model): the target's own greedy continuation from the run "
         "without speculation, each draft position kept with probability a and otherwise replaced by another token "
         "(independent, seeded)")


class Harness:
    """Drafts of the target's greedy continuation with per-position acceptance `a` (module doc).
    seconds / calls: the host time of proposing (device_put included for method "draft")."""

    def __init__(self, k: int, vocab: int, a: float, seed: int = 0):
        self.k, self.vocab, self.a = k, vocab, float(a)
        self.reseed(seed)
        self.expected: dict[str, np.ndarray] = {}  # request id -> prompt + greedy continuation
        self.seconds, self.calls = 0.0, 0

    def reseed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self._u = self._off = np.zeros(0)
        self._at = 0

    def corrupt(self, drafts: np.ndarray) -> np.ndarray:
        """Each entry kept with probability a, else another token (never the right one).  The
        draws come from a pool refilled 4096 at a time (a Generator call per step costs ~10 us)."""
        n = drafts.size
        if self._at + n > len(self._u):
            m = max(n, 4096)
            self._u, self._off, self._at = self.rng.random(m), self.rng.integers(1, self.vocab, m), 0
        u = self._u[self._at:self._at + n].reshape(drafts.shape)
        off = self._off[self._at:self._at + n].reshape(drafts.shape)
        self._at += n
        return np.where(u >= self.a, (drafts + off) % self.vocab, drafts).astype(np.int32)

    def install(self, speculator) -> None:
        """Method "draft": replace the draft's k+1 passes by the harness (as
        tests/engine/test_speculative_state._oracle does); the drafts go to the device in one
        device_put.  Row i's pending token sits at position row.start on the host, plus what the
        step still in flight accepted (steps overlap: runner/shift.py), so the
        harness sends the 2k tokens after row.start and the device picks the k after the shift."""
        import jax.numpy as jnp

        from umem_jax.runner.shift import pending_shift

        k = self.k

        def propose(batch, lay, meta, prev, spec_lens):
            t0 = time.perf_counter()
            win = np.zeros((lay.B, 2 * k), np.int32)
            for i, row in enumerate(batch.rows):
                nxt = self.expected[row.req.request_id][row.start + 1:row.start + 1 + 2 * k]
                win[i, :len(nxt)] = nxt
            out = _pick(jnp.asarray(self.corrupt(win)), pending_shift(meta, prev, layout=lay), k)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return out, None

        propose.on_device = True  # it shifts each row as the step does: the engine may overlap steps
        speculator.propose = propose

    def install_mtp(self, speculator) -> None:
        """Method "mtp": every decode step's next drafts (its output's columns k+2..2k+1, which the
        step after it reads on the device when steps overlap, and Request.drafts once read back)
        replaced by the harness's, on the device: row i's new pending token sits at row.start +
        shift + m + 1 (shift: what the step before accepted, m: what this one accepted), so the
        harness sends the 3k+1 tokens after row.start and the device picks k of them.  The head's
        verify, catch-up and chained passes still run (their cost is measured); after_step hands
        over the drafts a prefill leaves on the host."""
        import jax.numpy as jnp

        from umem_jax.runner.shift import pending_shift

        k, real = self.k, speculator._decode_mtp

        def decode(batch, lay, meta, prev, counts):
            shift = pending_shift(meta, prev, layout=lay)
            launched = real(batch, lay, meta, prev, counts)
            t0 = time.perf_counter()
            win = np.zeros((lay.B, 3 * k + 1), np.int32)
            for i, row in enumerate(batch.rows):
                nxt = self.expected[row.req.request_id][row.start + 1:row.start + 2 + 3 * k]
                win[i, :len(nxt)] = nxt
            out = _with_drafts(launched.tokens, jnp.asarray(self.corrupt(win)), shift, k)
            for key, (nxt, old) in list(speculator._outputs.items()):  # what the next step reads
                if old is launched.tokens:
                    speculator._outputs[key] = (nxt, out)
            launched.tokens = out
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return launched

        speculator._decode_mtp = decode

    def after_step(self, engine) -> None:
        """Method "mtp": the head's drafts ride on the host (Request.drafts); replace every
        decoding request's with the harness's.  The MTP step still runs the head's catch-up and
        chained passes (their cost is measured); only what they proposed is replaced."""
        t0 = time.perf_counter()
        for req in engine.scheduler.running:
            if req.drafts is None or not req.decode_ready:
                continue
            c = req.num_computed  # the pending token's position
            req.drafts = self.corrupt(self.expected[req.request_id][c + 1:c + 1 + self.k]).tolist()
        self.seconds += time.perf_counter() - t0
        self.calls += 1


@functools.cache
def _jitted():
    """The harness's two device helpers, jitted once (jax is imported on first use):
    pick(win [B, 2k], shift [B], k) -> drafts [B, k], row b's window from shift[b] on;
    with_drafts(out [max_batch, 2k+3], win [B, 3k+1], shift [B], k) -> an MTP step's output with
    row b's next drafts (columns k+2..2k+1) from its window at shift[b] + m[b] + 1 (m: column 0)."""
    import jax
    import jax.numpy as jnp

    take = lambda w, at, k: jnp.take_along_axis(w, at[:, None] + jnp.arange(k)[None, :], axis=1)

    def with_drafts(out, win, shift, k):
        B = win.shape[0]
        return out.at[:B, k + 2:2 * k + 2].set(take(win, shift + out[:B, 0] + 1, k))

    return jax.jit(take, static_argnums=2), jax.jit(with_drafts, static_argnums=3)


def _pick(win, shift, k: int):
    return _jitted()[0](win, shift, k)


def _with_drafts(out, win, shift, k: int):
    return _jitted()[1](out, win, shift, k)


def expected_accepted(a: float, k: int) -> float:
    """Mean drafts accepted per step when draft j is kept with probability a^j."""
    return float(sum(a ** j for j in range(1, k + 1)))


def live_rows(layout, meta) -> int:
    """Rows of a packed step that compute something (q_len > 0)."""
    a, b, _ = layout.spans["q_lens"]
    return int((np.asarray(meta)[a:b] > 0).sum())


@contextlib.contextmanager
def capture(owner, name: str, B: int, store: dict, meta_at: int):
    """While inside, `owner.name` (a jitted step: module global or instance attribute) records
    the arguments of its first decode-shaped call (T=1 layout) with B live rows into store
    ("args": positional, the arena replaced by None; "kw": keywords), then restored."""
    real = getattr(owner, name)

    def wrapper(*args, **kw):
        lay = kw["layout"]
        if "args" not in store and lay.T == 1 and lay.B >= B and live_rows(lay, args[meta_at]) == B:
            store["args"] = tuple(None if _is_arena(x) else (x.copy() if isinstance(x, np.ndarray) else x)
                                  for x in args)
            store["kw"] = dict(kw)
        return real(*args, **kw)

    had = name in vars(owner)  # a module global or an instance attribute (else a method of the class)
    setattr(owner, name, wrapper)
    try:
        yield store
    finally:
        if had:
            setattr(owner, name, real)
        else:
            delattr(owner, name)


def _is_arena(x) -> bool:
    from umem_jax.arena import Arena

    return isinstance(x, Arena)


def replay(runner, fn, store: dict, *, iters: int, trials: int, replace: dict | None = None,
           profile_dir: str | None = None) -> dict:
    """Time fn(*store["args"], **store["kw"]) with the runner's arena threaded through (donated,
    as the engine threads it), `iters` calls back to back per trial, synchronised once per trial
    (benchmarks.timing.time_calls) -> {"ms": median ms per call, "best_ms", "first_s": the first
    call (compiles if the shape is new), "compiles": XLA compilations inside the timed trials}.

    Run it with the engine idle: the captured page tables and state slots are free by then, so
    rewriting them each call touches no live request.  replace: {argument index: value}."""
    from umem_jax.bench.driver import compile_count

    from .timing import time_calls

    args = list(store["args"])
    for i, v in (replace or {}).items():
        args[i] = v
    at = args.index(None)
    kw = store["kw"]

    def call():
        args[at] = runner.arena  # donated: the step's output arena replaces it
        out = fn(*args, **kw)
        runner.arena = next(x for x in out if _is_arena(x))
        return out[0]

    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(call())  # compiles a new shape here, outside the trials
    first_s = time.perf_counter() - t0
    c0 = compile_count()
    t = time_calls(call, iters=iters, trials=trials)
    out = {"ms": t.median * 1e3, "best_ms": t.best * 1e3, "first_s": first_s, "compiles": compile_count() - c0}
    if profile_dir:  # a few more calls under the JAX profiler (TensorBoard / Perfetto trace), after the timing
        out["profile"] = _profile(call, profile_dir)
    return out


def _profile(call, path: str) -> list[str]:
    """3 calls under jax.profiler.trace; the files it writes (nested under plugins/profile/<run>)
    copied flat to `path`.<name> beside it (the device machine returns files <= 2 folders deep)."""
    import shutil

    import jax

    with jax.profiler.trace(path, create_perfetto_trace=True):
        for _ in range(3):
            jax.block_until_ready(call())
    flat = []
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            dst = Path(f"{path}.{f.name}")
            shutil.copyfile(f, dst)
            flat.append(str(dst))
    shutil.rmtree(path, ignore_errors=True)
    return flat


__all__ = ["LABEL", "Harness", "capture", "expected_accepted", "live_rows", "replay"]
