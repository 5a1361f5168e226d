"""Sweep: one workload through the unified arena and the static split at several ratios, side by side.

    model = load_bench_model("qwen3.5-4b-like")
    report = run_benchmark(model, [make("shifting")], engine_kwargs=dict(arena_bytes=4 << 30, ...),
                           out_dir="out")       # -> rows, ratios; writes results.json and PNGs

Every configuration runs in the same process on the same Model object, with the same arena
bytes and the same engine flags; only the memory mode and SGLang's two ratios change:
  swa_full_tokens_ratio     window tokens / full-attention tokens (models with windows)
  mamba_full_memory_ratio   state bytes / full-attention KV bytes (models with state)
The static settings always include SGLang's defaults (0.8, 0.9) and span KV-rich to
state/window-rich splits.  The ratios printed last, with their goals:
  unified / static-defaults output tok/s      goal >= 1.5x on the shifting trace
  static-defaults / unified retractions       goal >= 2x (unified retracts at most half as often)
  unified / best static output tok/s          goal >= 0.97x on each fixed mix (best: the fastest
                                               static setting that served every request in full)
"""

from __future__ import annotations

import gc
import json
import math
import os
import time

from ..core.sampling_params import SamplingParams
from .driver import SGLANG_DEFAULTS, MemoryConfig, build_engine, capacity, run, warm_up
from .results import RunResult, ratio, shortfall
from .workload import Workload

# Static settings swept by default, from SGLang's defaults to KV-rich and to state/window-rich
# splits.  A pair is used jointly on a model with windows and state; otherwise only its
# applicable half (so each model gets 5 distinct settings).
DEFAULT_RATIOS = (SGLANG_DEFAULTS, (0.1, 0.2), (0.25, 0.5), (0.5, 2.0), (1.0, 4.0))
FIXED_MIXES = ("state-heavy", "kv-heavy", "mixed")
GOALS = {"unified_vs_default": 1.5, "retractions_default_vs_unified": 2.0, "unified_vs_best_static": 0.97}


def load_bench_model(name: str, dtype: str = "bfloat16", seed: int = 0):
    """A Model by name: a random-weight realistic shape (registry.random_shape_names()), or
    anything loader.load_model takes (a built-in name like "tiny", a directory, a .gguf); with its
    projections fused once here, as every engine of the sweep would (they then share it)."""
    from ..models.registry import build_random, random_shape_names

    if name in random_shape_names():
        return build_random(name, dtype, seed=seed).fuse_projections()
    from ..models.loader import load_model

    return load_model(name).fuse_projections()


def static_configs(plan, ratios=None) -> list[MemoryConfig]:
    """The static settings for `plan`: `ratios` is None (DEFAULT_RATIOS), a list of (swa, mamba)
    pairs, or text "0.8:0.9,0.1:0.2" (a bare number sets the one ratio the model has).  Ratios the
    model has no memory for become None; duplicates are dropped; "none" gives no static setting."""
    if isinstance(ratios, str) and ratios.strip().lower() == "none":
        return []
    has_swa, has_state = bool(plan.windows), plan.state is not None
    pairs = DEFAULT_RATIOS if ratios is None else (_parse(ratios, has_swa, has_state) if isinstance(ratios, str)
                                                   else ratios)
    out = []
    for swa, mamba in pairs:
        m = MemoryConfig("static", swa if has_swa else None, mamba if has_state else None)
        if m not in out:
            out.append(m)
    return out


def _parse(text: str, has_swa: bool, has_state: bool) -> list[tuple]:
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        if ":" in item:
            a, b = item.split(":", 1)
            pairs.append((float(a) if a not in ("", "-") else None, float(b) if b not in ("", "-") else None))
        elif has_swa and has_state:
            raise ValueError(f"static ratio {item!r}: this model has windows and state, give swa:mamba")
        else:
            pairs.append((float(item), None) if has_swa else (None, float(item)))
    if not pairs:
        raise ValueError(f"no static ratios in {text!r}")
    return pairs


# ------------------------------------------------------------------------------ one workload


def sweep(model, workload: Workload, *, engine_kwargs: dict, statics: list[MemoryConfig], deadline: float | None = None,
          max_run_s: float | None = None, progress: bool = True, log=print) -> list[RunResult]:
    """Unified, then every static setting, each on a fresh engine (same arena bytes and flags)
    -> one RunResult per configuration.  deadline (time.monotonic()): configurations that would
    start after it are skipped, and each run is capped to end before it."""
    prompts = workload.prompts(model.config.vocab_size)
    results = []
    for mem in [MemoryConfig()] + list(statics):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 5.0:
            results.append(RunResult(workload.name, mem.label, mem.mode, mem.swa_full_tokens_ratio,
                                     mem.mamba_full_memory_ratio, status="skipped", error="time budget spent"))
            log(f"  {mem.label:<18} skipped: time budget spent")
            continue
        try:
            engine = build_engine(model, mem, **engine_kwargs)
        except ValueError as e:  # e.g. a ratio leaving a sub-pool no page
            results.append(RunResult(workload.name, mem.label, mem.mode, mem.swa_full_tokens_ratio,
                                     mem.mamba_full_memory_ratio, status="failed", error=str(e)))
            log(f"  {mem.label:<18} failed: {e}")
            continue
        holds = {k: capacity(engine, i, o) for k, (i, o) in _shapes(workload).items()}
        warm = warm_up(engine, log=log)
        warm["rehearsal_s"] = rehearse(engine, workload, prompts)
        cap = max_run_s
        if deadline is not None:
            cap = min(cap if cap is not None else math.inf, deadline - time.monotonic() - 2.0)
        r = run(engine, workload, prompts, memory=mem, max_run_s=cap, progress=progress)
        r.warmup, r.counters["capacity"] = warm, holds
        s = r.summary()
        fits = ", ".join(f"{n} {k}" for k, n in holds.items())
        short = shortfall(s)
        log(f"  {mem.label:<18} {s['status']:<9} {s['out_tok_per_s']:9.1f} tok/s  {s['req_per_s']:7.2f} req/s  "
            f"peak {s['peak_running']:>3} running  {s['retractions']:>4} retractions  holds {fits} at once  "
            f"(warm-up {warm['seconds']:.1f} s, {warm['compiles']} compilations)" + (f"  [{short}]" if short else ""))
        results.append(r)
        del engine
        gc.collect()
    return results


def rehearse(engine, workload: Workload, prompts: list[list[int]], max_tokens: int = 4) -> float:
    """An untimed rehearsal on a warmed engine -> its seconds: the longest request of each kind
    in the trace (its own prompt, a few output tokens) at once, so whatever the run's path does
    the first time (a shape warm-up missed, host-side caches, relocation) happens before the
    clock starts, in every configuration alike; then the prefix cache is emptied.  A request
    the configuration cannot hold is refused here as it will be in the run."""
    t0 = time.perf_counter()
    longest: dict[str, int] = {}
    for i, r in enumerate(workload.requests):
        j = longest.get(r.kind)
        if j is None or r.input_len > workload.requests[j].input_len:
            longest[r.kind] = i
    for kind, i in longest.items():
        n = max(1, min(max_tokens, workload.requests[i].output_len))
        try:
            engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                               request_id=f"umem-bench-rehearsal-{kind}")
        except ValueError:
            continue
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    return time.perf_counter() - t0


def _shapes(workload: Workload) -> dict[str, tuple[int, int]]:
    """The longest (input, output) of each kind of request in the trace."""
    out: dict[str, tuple[int, int]] = {}
    for r in workload.requests:
        i, o = out.get(r.kind, (0, 0))
        out[r.kind] = (max(i, r.input_len), max(o, r.output_len))
    return out


def compare(results: list[RunResult], no_verdict: str | None = None) -> dict:
    """The goals' ratios for one workload's results (None where a side is missing).
    no_verdict: why this run is no measurement to judge goals by (a CPU or --small run); the
    ratios are kept, each goal then reads "no verdict (<why>)"."""
    rows = {r.label: r.summary() for r in results}
    ok = lambda s: s.get("status") in ("ok", "truncated")
    uni = rows.get("unified") if ok(rows.get("unified", {})) else None
    default = next((rows[r.label] for r in results if MemoryConfig(r.mode, r.swa_full_tokens_ratio,
                                                                   r.mamba_full_memory_ratio).is_sglang_default
                    and ok(rows[r.label])), None)
    statics = [rows[r.label] for r in results if r.mode == "static" and ok(rows[r.label])]
    # A setting that aborted or shortened requests did less work than the trace asks: it is no
    # candidate for "best static" (its tokens/s would look better for serving less).
    served = [s for s in statics if not s["aborted"] and not s["clipped"] and s["status"] == "ok"]
    best = max(served or statics, key=lambda s: s["out_tok_per_s"], default=None)
    g = lambda s, k: s[k] if s is not None else None
    out = {"workload": results[0].workload if results else None,
           "static_default": g(default, "config"), "best_static": g(best, "config"),
           "best_static_served_all": bool(served),
           "unified_vs_default": ratio(g(uni, "out_tok_per_s"), g(default, "out_tok_per_s")),
           "unified_vs_best_static": ratio(g(uni, "out_tok_per_s"), g(best, "out_tok_per_s")),
           "retractions_default_vs_unified": ratio(g(default, "retractions"), g(uni, "retractions"))}
    wl = out["workload"]
    out["notes"] = [f"{s['config']} aborted {s['aborted']} and cut {s['clipped']} requests"
                    for s in ([uni] if uni else []) + ([default] if default else []) + ([best] if best else [])
                    if s["aborted"] or s["clipped"]]
    if best is not None and not served:
        out["notes"].append("no static setting served every request in full")
    out["goals"] = {
        "unified_vs_default": _verdict(out["unified_vs_default"], GOALS["unified_vs_default"])
        if wl == "shifting" else "n/a (goal is on the shifting trace)",
        "retractions_default_vs_unified": _verdict(out["retractions_default_vs_unified"],
                                                   GOALS["retractions_default_vs_unified"]),
        "unified_vs_best_static": _verdict(out["unified_vs_best_static"], GOALS["unified_vs_best_static"])
        if wl in FIXED_MIXES else "n/a (goal is on the fixed mixes)",
    }
    if no_verdict:
        out["goals"] = {k: v if v.startswith("n/a") else f"no verdict ({no_verdict})" for k, v in out["goals"].items()}
    return out


def verdict_blocker(small: bool = False) -> str | None:
    """Why goal verdicts would mislead here (None: a real measurement): a --small smoke preset,
    or a CPU backend (reference kernels, a shared host: its times say nothing of the GPU goals)."""
    import jax

    if small:
        return "--small smoke run, not a measurement"
    if jax.default_backend() == "cpu":
        return "CPU run, not a measurement"
    return None


def _verdict(x: float | None, goal: float) -> str:
    if x is None:
        return "not measured (neither side retracted)" if goal == GOALS["retractions_default_vs_unified"] else \
            "not measured"
    return f"{'met' if x >= goal else 'MISSED'} ({_fmt_ratio(x)} vs >= {goal:g}x)"


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}x")


# ------------------------------------------------------------------------------ report

_COLS = [("workload", "workload", "{}"), ("config", "config", "{}"), ("status", "status", "{}"),
         ("req/s", "req_per_s", "{:.2f}"), ("tok/s", "out_tok_per_s", "{:.1f}"),
         ("TTFT med", "ttft_ms_median", "{:.0f}"), ("TTFT p99", "ttft_ms_p99", "{:.0f}"),
         ("TPOT med", "tpot_ms_median", "{:.1f}"), ("TPOT p99", "tpot_ms_p99", "{:.1f}"),
         ("peak run", "peak_running", "{}"), ("retract", "retractions", "{}"), ("aborts", "aborted", "{}"),
         ("clipped", "clipped", "{}"), ("reloc MiB", "relocated_mib", "{:.1f}"), ("util", "utilization", "{:.2f}"),
         ("util mem", "utilization_memory_bound", "{:.2f}")]


def table(rows: list[dict]) -> str:
    """Fixed-width table of summary rows (latencies in ms)."""
    cells = [[h for h, _, _ in _COLS]]
    for r in rows:
        cells.append(["-" if r.get(k) is None else (f.format(r[k]) if not isinstance(r[k], str) else r[k])
                      for _, k, f in _COLS])
        short = shortfall(r)
        if short and short != r.get("status"):  # the status cell says what the run did not serve
            cells[-1][2] = f"{r.get('status')}: {short}"
    widths = [max(len(c[i]) for c in cells) for i in range(len(_COLS))]
    return "\n".join("  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def ratio_lines(comparisons: list[dict]) -> list[str]:
    out = []
    for c in comparisons:
        out.append(f"{c['workload']}: unified / static defaults ({c['static_default']}) tok/s "
                   f"{_fmt_ratio(c['unified_vs_default'])} [{c['goals']['unified_vs_default']}]; "
                   f"retractions static defaults / unified {_fmt_ratio(c['retractions_default_vs_unified'])} "
                   f"[{c['goals']['retractions_default_vs_unified']}]; unified / best static ({c['best_static']}) "
                   f"tok/s {_fmt_ratio(c['unified_vs_best_static'])} [{c['goals']['unified_vs_best_static']}]"
                   + "".join(f"; NOTE {n}" for n in dict.fromkeys(c.get("notes", ()))))
    return out


def run_benchmark(model, workloads: list[Workload], *, engine_kwargs: dict, statics=None, out_dir: str | None = None,
                  deadline: float | None = None, max_run_s: float | None = None, progress: bool = True,
                  meta: dict | None = None, log=print) -> dict:
    """sweep() every workload, write results.json (after each workload, so a cut-off run keeps
    what it measured) and the plots into out_dir, print the table and the ratios last
    -> {"meta", "rows", "comparisons", "runs", "files"}.  Goal verdicts only for a real
    measurement: with meta {"small": True} or on a CPU backend each goal reads "no verdict"."""
    import jax

    from ..memory import plan as make_plan

    kv = engine_kwargs.get("kv_cache_dtype", "auto")
    kv = kv if kv != "auto" else (model.config.dtype if model.config.dtype in ("float32", "bfloat16") else "bfloat16")
    p = make_plan(model.decls(kv), page_size=engine_kwargs.get("page_size", 16))
    statics = statics if statics and isinstance(statics[0], MemoryConfig) else static_configs(p, statics)
    no_verdict = verdict_blocker(bool((meta or {}).get("small")))
    report = {"meta": {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "engine": _jsonable(engine_kwargs),
                       "statics": [m.label for m in statics], **(meta or {})},
              "workloads": [], "rows": [], "comparisons": [], "runs": [], "files": []}
    report["meta"]["no_verdict"] = no_verdict
    for wl in workloads:
        log(f"{wl.describe()}")
        results = sweep(model, wl, engine_kwargs=engine_kwargs, statics=statics, deadline=deadline,
                        max_run_s=max_run_s, progress=progress, log=log)
        report["workloads"].append(wl.to_dict())
        report["rows"] += [r.summary() for r in results]
        report["comparisons"].append(compare(results, no_verdict))
        report["runs"] += [r.to_dict() for r in results]
        if out_dir:
            report["files"] = write_report(report, out_dir)
    if out_dir:
        report["files"] = write_report(report, out_dir, plots=True, log=log)
    log("")
    log(table(report["rows"]))
    for line in ratio_lines(report["comparisons"]):
        log(line)
    return report


def write_report(report: dict, out_dir: str, plots: bool = False, log=print) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    with open(path, "w") as f:
        json.dump({k: v for k, v in report.items() if k != "files"}, f)
    files = [path]
    if plots:
        try:
            from .plots import plot_report
        except ImportError as e:  # matplotlib missing (e.g. a bare GPU checkout): plot later from the JSON
            log(f"no plots ({e}); make them with: python -m umem_jax.bench.plots {path}")
            return files
        files += plot_report(report, out_dir)
    return files


def _jsonable(d: dict) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()
            if isinstance(v, (int, float, str, bool, tuple, list, type(None)))}


__all__ = ["DEFAULT_RATIOS", "GOALS", "compare", "load_bench_model", "ratio_lines", "rehearse", "run_benchmark",
           "static_configs", "sweep", "table", "verdict_blocker", "write_report"]
