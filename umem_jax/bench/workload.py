"""Workload: a synthetic request trace -- when each request arrives and how long it is.

    wl = shifting(n_short=48, n_long=4, phases=4, phase_s=1.0)
    wl.requests[0]            # TraceRequest(arrival_s=0.0, input_len=512, output_len=128, kind='short')
    prompts = wl.prompts(vocab_size=262144)      # random token ids, seeded: one list per request

Four shapes of traffic, each aimed at one side of the memory split:
  state_heavy  many short requests (512 in / 128 out): concurrency binds, so per-request state
               slots and window KV are what runs out
  kv_heavy     few long requests (32K in / 256 out): full-attention KV is what runs out
  mixed        both kinds, shuffled together
  shifting     phases alternating short-heavy and long-heavy (at least 3 shifts): a fixed split
               is wrong for every other phase

Arrivals: all of a phase at its start (rate=None), or Poisson at `rate` requests/s from it; the
shifting trace can also spread each phase's requests over the phase (Poisson at n / phase_s),
so load is sustained through every phase instead of arriving as one burst per phase.
Requests run with ignore_eos and max_tokens = output_len, so every output length is exact.
A dataset of `bench serve` (datasets.py) becomes a workload too (`from_samples`): its requests
and its own token-id prompts, which `prompts()` then returns.
`make(name, scale=...)` shrinks lengths and counts from the defaults (scale 0.02 gives a CPU
smoke trace of a few dozen tokens per request).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

WORKLOADS = ("state-heavy", "kv-heavy", "mixed", "shifting")
MIN_INPUT, MIN_OUTPUT = 4, 2  # a TPOT needs at least two output tokens


class TraceRequest(NamedTuple):
    arrival_s: float  # seconds after the start of the run
    input_len: int  # prompt tokens
    output_len: int  # output tokens (exact: ignore_eos)
    kind: str  # "short" | "long": which class of request, for reports


@dataclasses.dataclass(frozen=True)
class Shape:
    """One class of request: prompt and output lengths in tokens."""

    input_len: int
    output_len: int

    def scaled(self, scale: float, max_len: int | None = None) -> "Shape":
        """Lengths times `scale` (at least MIN_INPUT / MIN_OUTPUT), the prompt cut so
        input + output <= max_len when given."""
        out = max(MIN_OUTPUT, round(self.output_len * scale))
        inp = max(MIN_INPUT, round(self.input_len * scale))
        if max_len is not None:
            inp = min(inp, max_len - out)
            if inp < MIN_INPUT:
                raise ValueError(f"max_len={max_len} leaves no room for a {out}-token output")
        return Shape(inp, out)


SHORT = Shape(512, 128)
LONG = Shape(32768, 256)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named trace: requests sorted by arrival, and the phases (kind, start_s) that made it."""

    name: str
    requests: tuple[TraceRequest, ...]
    phases: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    token_prompts: tuple[tuple[int, ...], ...] | None = None  # a dataset's own prompts (from_samples)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_input_tokens(self) -> int:
        return sum(r.input_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_len(self) -> int:
        """Longest request, prompt + output, in tokens (what max_model_len must hold)."""
        return max(r.input_len + r.output_len for r in self.requests)

    def prompts(self, vocab_size: int, *, low: int = 4) -> list[list[int]]:
        """Random prompt token ids in [low, vocab_size), one list per request, from a numpy RNG
        seeded by the workload's seed (the same trace always gets the same prompts).  Ids below
        `low` are skipped: they are the special tokens (pad, bos, eos) of most vocabularies."""
        if self.token_prompts is not None:  # a dataset's prompts: ids as drawn, checked against the vocabulary
            top = max((max(p) for p in self.token_prompts if p), default=0)
            if top >= vocab_size:
                raise ValueError(f"{self.name}: prompt token id {top} is outside the vocabulary ({vocab_size})")
            return [list(p) for p in self.token_prompts]
        if vocab_size <= low:
            raise ValueError(f"vocab_size {vocab_size} leaves no ids above {low}")
        rng = np.random.default_rng([self.seed, 1])
        return [rng.integers(low, vocab_size, r.input_len).tolist() for r in self.requests]

    def describe(self) -> str:
        kinds = {}
        for r in self.requests:
            n, i, o = kinds.get(r.kind, (0, 0, 0))
            kinds[r.kind] = (n + 1, i + r.input_len, o + r.output_len)
        parts = [f"{n} {k} (mean {i / n:.0f} in / {o / n:.0f} out)" for k, (n, i, o) in kinds.items()]
        last = self.requests[-1].arrival_s if self.requests else 0.0
        return f"{self.name}: {len(self)} requests, {', '.join(parts)}, arrivals over {last:.2f} s"

    def to_dict(self) -> dict:
        return {"name": self.name, "seed": self.seed, "phases": [list(p) for p in self.phases],
                "requests": [list(r) for r in self.requests]}


# ------------------------------------------------------------------------------ pieces


def _lengths(rng, shape: Shape, n: int, jitter: float) -> list[tuple[int, int]]:
    """n (input, output) pairs around `shape`, each uniform in [(1 - jitter) L, (1 + jitter) L]."""
    if jitter <= 0:
        return [(shape.input_len, shape.output_len)] * n
    lo, hi = 1.0 - jitter, 1.0 + jitter
    ins = np.maximum(MIN_INPUT, np.round(shape.input_len * rng.uniform(lo, hi, n))).astype(int)
    outs = np.maximum(MIN_OUTPUT, np.round(shape.output_len * rng.uniform(lo, hi, n))).astype(int)
    return list(zip(ins.tolist(), outs.tolist()))


def _arrivals(rng, n: int, start: float, rate: float | None) -> list[float]:
    """n arrival times from `start`: all at once (rate None), or a Poisson process of `rate`/s."""
    if rate is None:
        return [float(start)] * n
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    return (start + np.cumsum(rng.exponential(1.0 / rate, n))).tolist()


def _phase(rng, kinds: list[tuple[str, Shape]], start: float, rate: float | None, jitter: float) -> list[TraceRequest]:
    """One phase: the (kind, shape) list in the given order, arriving from `start`."""
    times = _arrivals(rng, len(kinds), start, rate)
    out = []
    for (kind, shape), t in zip(kinds, times):
        (i, o), = _lengths(rng, shape, 1, jitter)
        out.append(TraceRequest(t, i, o, kind))
    return out


def _workload(name: str, reqs: list[TraceRequest], phases, seed: int) -> Workload:
    reqs = sorted(reqs, key=lambda r: r.arrival_s)  # stable: same-time requests keep their order
    return Workload(name, tuple(reqs), tuple(phases), seed)


# ------------------------------------------------------------------------------ generators


def state_heavy(n: int = 128, *, short: Shape = SHORT, rate: float | None = None, jitter: float = 0.0,
                seed: int = 0) -> Workload:
    """n short requests: wants more concurrent requests than the arena holds."""
    rng = np.random.default_rng(seed)
    return _workload("state-heavy", _phase(rng, [("short", short)] * n, 0.0, rate, jitter), [("short", 0.0)], seed)


def kv_heavy(n: int = 8, *, long: Shape = LONG, rate: float | None = None, jitter: float = 0.0,
             seed: int = 0) -> Workload:
    """n long requests: full-attention KV binds."""
    rng = np.random.default_rng(seed)
    return _workload("kv-heavy", _phase(rng, [("long", long)] * n, 0.0, rate, jitter), [("long", 0.0)], seed)


def mixed(n_short: int = 64, n_long: int = 4, *, short: Shape = SHORT, long: Shape = LONG,
          rate: float | None = None, jitter: float = 0.0, seed: int = 0) -> Workload:
    """Short and long requests in one shuffled stream."""
    rng = np.random.default_rng(seed)
    kinds = [("short", short)] * n_short + [("long", long)] * n_long
    order = rng.permutation(len(kinds))
    return _workload("mixed", _phase(rng, [kinds[i] for i in order], 0.0, rate, jitter), [("mixed", 0.0)], seed)


def shifting(n_short: int = 48, n_long: int = 4, *, phases: int = 4, phase_s: float = 1.0, short: Shape = SHORT,
             long: Shape = LONG, rate: float | None = None, spread: bool = False, jitter: float = 0.0,
             seed: int = 0) -> Workload:
    """`phases` phases alternating short-heavy (n_short short requests) and long-heavy (n_long
    long ones), starting short; phase k arrives from k * phase_s.  At least 4 phases (3 shifts).
    spread: each phase's n requests arrive as a Poisson process of n / phase_s per second from its
    start (sustained load; `rate` must then be None)."""
    if phases < 4:
        raise ValueError(f"a shifting trace needs at least 4 phases (3 shifts), got {phases}")
    if spread and rate is not None:
        raise ValueError("spread sets each phase's rate (n / phase_s): give rate or spread, not both")
    if spread and phase_s <= 0:
        raise ValueError(f"spread needs phase_s > 0, got {phase_s}")
    rng = np.random.default_rng(seed)
    reqs, marks = [], []
    for k in range(phases):
        kind, shape, n = ("short", short, n_short) if k % 2 == 0 else ("long", long, n_long)
        start = k * phase_s
        marks.append((kind, start))
        reqs += _phase(rng, [(kind, shape)] * n, start, n / phase_s if spread else rate, jitter)
    return _workload("shifting", reqs, marks, seed)


def make(name: str, *, scale: float = 1.0, count_scale: float | None = None, max_len: int | None = None,
         short: Shape = SHORT, long: Shape = LONG, rate: float | None = None, phase_s: float = 1.0,
         spread: bool = False, jitter: float = 0.0, seed: int = 0, **counts) -> Workload:
    """A named workload ("state-heavy", "kv-heavy", "mixed", "shifting"; "_" works for "-") with
    lengths times `scale` and request counts times `count_scale` (default: `scale`, at least one
    request of each kind), prompts cut so input + output <= max_len (jitter included).  `counts`
    overrides the generator's counts (n, n_short, n_long, phases) before scaling; `spread` spreads
    the shifting trace's arrivals over each phase (see `shifting`)."""
    key = name.replace("_", "-")
    gens = {"state-heavy": state_heavy, "kv-heavy": kv_heavy, "mixed": mixed, "shifting": shifting}
    if key not in gens:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    gen = gens[key]
    cs = scale if count_scale is None else count_scale
    defaults = {k: v.default for k, v in _params(gen).items() if k in ("n", "n_short", "n_long")}
    kw = {k: max(1, round(counts.get(k, v) * cs)) for k, v in defaults.items()}
    if "phases" in counts and key == "shifting":
        kw["phases"] = counts["phases"]
    unknown = set(counts) - set(defaults) - {"phases"}
    if unknown:
        raise ValueError(f"{key} takes no counts {sorted(unknown)}")
    cut = None if max_len is None else int(max_len / (1.0 + max(jitter, 0.0))) - 2  # jittered and rounded: inside
    shapes = {"short": short.scaled(scale, cut), "long": long.scaled(scale, cut)}
    if spread and key != "shifting":
        raise ValueError(f"spread applies to the shifting trace's phases, not to {key}")
    extra = {"phase_s": phase_s, "spread": spread} if key == "shifting" else {}
    return gen(**kw, **{k: v for k, v in shapes.items() if k in _params(gen)}, rate=rate, jitter=jitter, seed=seed,
               **extra)


def from_samples(name: str, samples, offsets: list[float], seed: int = 0, max_len: int | None = None) -> Workload:
    """A workload of a dataset's requests (datasets.sample, token-id prompts) sent at `offsets`
    (datasets.arrivals); max_len: refuse a request longer than that, prompt + output."""
    if max_len is not None:
        long = [s for s in samples if len(s.prompt) + s.output_len > max_len]
        if long:
            raise ValueError(f"{name}: {len(long)} requests are longer than max_model_len={max_len} (prompt + "
                             f"output, e.g. {len(long[0].prompt)} + {long[0].output_len}): shorten them")
    order = sorted(range(len(samples)), key=lambda i: offsets[i])
    reqs = tuple(TraceRequest(float(offsets[i]), len(samples[i].prompt), samples[i].output_len, samples[i].kind)
                 for i in order)
    return Workload(name, reqs, ((name, 0.0),), seed, tuple(tuple(samples[i].prompt) for i in order))


def _params(fn) -> dict:
    import inspect

    return dict(inspect.signature(fn).parameters)


def make_all(names=WORKLOADS, **kw) -> list[Workload]:
    """make() for each name ("all" expands to every workload); `spread` goes to the shifting one."""
    names = [names] if isinstance(names, str) else list(names)
    if "all" in names:
        names = list(WORKLOADS)
    spread = kw.pop("spread", False)  # only the shifting trace has phases to spread over
    return [make(n, **kw, **({"spread": spread} if n.replace("_", "-") == "shifting" else {})) for n in names]


__all__ = ["LONG", "SHORT", "WORKLOADS", "Shape", "TraceRequest", "Workload", "from_samples", "kv_heavy", "make",
           "make_all", "mixed", "shifting", "state_heavy"]
