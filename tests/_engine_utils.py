"""Shared pieces of the engine tests: one tiny model per session, a dense greedy oracle, and
the engine settings every engine test uses (ONE arena shape and one bucket per dimension, so
the whole suite compiles the serving step twice: a decode and a prefill shape)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

ARENA = 150 << 10  # tight enough for the tiny model to retract with four long requests
SETTINGS = dict(arena_bytes=ARENA, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, max_model_len=1024,
                batch_buckets=(4,), token_buckets=(32,), page_buckets=(256,))
DENSE_LEN = 256

_compiles = []


def noisy_copy(model, scale: float):
    """`model` with Gaussian noise of `scale` times each weight matrix's std added (seeded): a
    draft the model accepts some of (speculation tests' partial acceptance)."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if x.ndim > 1 else x
             for x, k in zip(leaves, keys)]
    return dataclasses.replace(model, params=jax.tree.unflatten(treedef, noisy))


@functools.lru_cache(maxsize=None)
def tiny():
    from umem_jax.models.loader import load_model

    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: _compiles.append(event) if event.endswith("backend_compile_duration") else None)
    return load_model("tiny")


def compile_count() -> int:
    """XLA compilations in this process so far (every jit, not only the engine's)."""
    return len(_compiles)


def compiled_steps(caplog, run) -> list[str]:
    """run() with JAX's compile log on -> the names of the jitted functions it compiled, the
    allocator's page moves left out (a small jit of its own, compiled per move count)."""
    import logging
    import re

    old = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            outs = run()
    finally:
        jax.config.update("jax_log_compiles", old)
    pattern = re.compile(r"Compiling (?:jit\()?([\w.<>]+)")
    names = [m.group(1) for r in caplog.records if (m := pattern.match(r.getMessage()))]
    assert outs is not None
    return [n for n in names if n != "move_pages"]


def llm(**overrides):
    from umem_jax import LLM

    return LLM(tiny(), **{**SETTINGS, **overrides})


_dense_memo: dict = {}


def dense_greedy(prompts, n: int) -> list[list[int]]:
    """Greedy continuation by the cache-free forward (model.dense_logits), one padded shape."""
    m = tiny()
    key = (tuple(tuple(p) for p in prompts), n)
    if key in _dense_memo:
        return _dense_memo[key]
    toks = np.zeros((4, DENSE_LEN), np.int32)
    out = []
    for s in range(0, len(prompts), 4):
        group = [list(p) for p in prompts[s:s + 4]]
        lens = [len(p) for p in group]
        toks[:] = 0
        for i, p in enumerate(group):
            toks[i, :len(p)] = p
        res = [[] for _ in group]
        for _ in range(n):
            logits = np.asarray(m.dense_logits(m.params, jnp.asarray(toks)))
            for i in range(len(group)):
                t = int(logits[i, lens[i] - 1].argmax())
                res[i].append(t)
                toks[i, lens[i]] = t
                lens[i] += 1
        out += res
    _dense_memo[key] = out
    return out


def prompts(*lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, n).tolist() for n in lengths]


def assert_idle_clean(llm_obj):
    """The engine ran its idle checks and the arena holds nothing but the prefix cache."""
    e = llm_obj.llm_engine
    assert not e.has_unfinished_requests()
    e.check_idle()  # raises on any invariant, leak or refcount off (cache-held pages count as held)
    assert e.num_idle_checks > 0
    st = e.stats()
    assert st["held"] == {k: st["prefix_cache"]["held"].get(k, 0) for k in st["held"]}


@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling arrays for a batch of B rows, built row by row from SamplingParams
    (padding rows are greedy): the reference the runner's packed sampling words and the
    sampler tests are checked against."""

    temperature: np.ndarray  # [B] f32
    top_k: np.ndarray  # [B] i32, 0 = off
    top_p: np.ndarray  # [B] f32
    min_p: np.ndarray  # [B] f32
    seed: np.ndarray  # [B] i32
    step: np.ndarray  # [B] i32, the output position, folded into the key
    repetition_penalty: np.ndarray  # [B] f32
    presence_penalty: np.ndarray  # [B] f32
    frequency_penalty: np.ndarray  # [B] f32

    @classmethod
    def build(cls, params: list, seeds: list[int], steps: list[int], size: int) -> "SamplingBatch":
        pad = size - len(params)
        ps = list(params) + [None] * pad

        def col(f, default, dtype):
            return np.array([f(p) if p is not None else default for p in ps], dtype)

        return cls(
            temperature=col(lambda p: p.temperature, 0.0, np.float32),
            top_k=col(lambda p: max(p.top_k, 0), 0, np.int32),
            top_p=col(lambda p: p.top_p, 1.0, np.float32),
            min_p=col(lambda p: p.min_p, 0.0, np.float32),
            seed=np.array(list(seeds) + [0] * pad, np.int32),
            step=np.array(list(steps) + [0] * pad, np.int32),
            repetition_penalty=col(lambda p: p.repetition_penalty, 1.0, np.float32),
            presence_penalty=col(lambda p: p.presence_penalty, 0.0, np.float32),
            frequency_penalty=col(lambda p: p.frequency_penalty, 0.0, np.float32),
        )

    def arrays(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def mode(self) -> str:
        from umem_jax.runner.sampler import sampling_mode

        return sampling_mode(self.temperature, self.top_k, self.top_p, self.min_p)


def fail_step_when(monkeypatch, runner, fails, exc: Exception) -> None:
    """Make the runner's jitted step raise `exc` for every batch `fails(batch)` picks, after the
    batch was packed (where a tracing or dispatch error would strike); other batches run."""
    seen, pack, step = {}, runner._pack, runner._step

    def spy(batch, *a):
        seen["batch"] = batch
        return pack(batch, *a)

    def failing(*a, **kw):
        if fails(seen["batch"]):
            raise exc
        return step(*a, **kw)

    monkeypatch.setattr(runner, "_pack", spy)
    monkeypatch.setattr(runner, "_step", failing)
