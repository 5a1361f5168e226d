"""Plots of a benchmark report (matplotlib, Agg): per workload, the arena's bands over time for
every configuration, and output throughput over time.

    python -m umem_jax.bench.plots OUT/results.json [DIR]     # re-draw from the JSON

<workload>_memory.png      one panel per configuration: stacked held bytes of each sub-pool,
                           then holes, the free gap and the sink (the stack is the whole arena)
<workload>_throughput.png  output tokens/s over time (sliding window), one line per configuration
Dashed vertical lines mark the workload's phase starts.
"""

from __future__ import annotations

import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

from .results import shortfall

DPI = 100
_SINK = ("sink", "sink", "#636363")  # drawn first: it is the arena's lowest bytes
_EXTRA = (("holes", "holes", "#bdbdbd"), ("free", "free gap", "#fff3b0"))


def _runs_by_workload(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in report["runs"]:
        if r.get("timeline") and r["timeline"].get("t"):
            out.setdefault(r["summary"]["workload"], []).append(r)
    return out


def _phases(report: dict, workload: str) -> list[tuple[str, float]]:
    for w in report.get("workloads", []):
        if w["name"] == workload:
            return [tuple(p) for p in w.get("phases", [])]
    return []


def _unit(nbytes: float) -> tuple[str, float]:
    return ("GiB", 2**30) if nbytes >= 2**30 else ("MiB", 2**20) if nbytes >= 2**20 else ("KiB", 2**10)


def memory_figure(runs: list[dict], path: str, *, title: str, phases=()) -> str:
    """Stacked bytes by band over time, one panel per run."""
    n = len(runs)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.7 * rows), sharex=True, sharey=True, squeeze=False,
                             dpi=DPI)
    total = max(r["summary"].get("arena_bytes") or 1 for r in runs)
    uname, scale = _unit(total)
    bands = runs[0]["timeline"]["bands"]
    colors = plt.get_cmap("tab10").colors
    end = max(max(r["timeline"]["t"][-1] for r in runs), 1e-3)
    parts = [_SINK] + [(f"band:{b}", b, colors[i % 10]) for i, b in enumerate(bands)] + list(_EXTRA)
    for ax, r in zip(axes.flat, runs):
        tl, s = r["timeline"], r["summary"]
        t = np.asarray(tl["t"])
        ax.stackplot(t, *[np.asarray(tl[k]) / scale for k, _, _ in parts], labels=[lab for _, lab, _ in parts],
                     colors=[c for _, _, c in parts], step="post", edgecolor="none")
        for _, start in phases:
            ax.axvline(start, color="k", ls="--", lw=0.6)
        ax.set_title(run_title(s), fontsize=9)
        ax.set_xlim(0, end)
        ax.set_ylim(0, total / scale)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
    for ax in axes.flat[n:]:
        ax.axis("off")
    axes[0][0].set_ylabel(f"arena {uname}", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)
    return path


def run_title(summary: dict) -> str:
    """A panel's title: the configuration and its tok/s, marked where the run served less than
    its trace (aborted, clipped, truncated): that tok/s counts less work."""
    tok, short = summary.get("out_tok_per_s"), shortfall(summary)
    title = f"{summary['config']}: {tok:.0f} tok/s" if tok is not None else summary["config"]
    return title + (f"\n({short})" if short else "")


def _rate(t: np.ndarray, tokens: np.ndarray, window: float) -> np.ndarray:
    """Tokens per second over the trailing `window` seconds at each sample."""
    j = np.searchsorted(t, t - window, side="left")
    dt = t - t[j]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(dt > 0, (tokens - tokens[j]) / np.where(dt > 0, dt, 1), 0.0)


def throughput_figure(runs: list[dict], path: str, *, title: str, phases=()) -> str:
    """Output tokens/s over time, one line per run."""
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=DPI)
    end = max(r["timeline"]["t"][-1] for r in runs)
    window = max(end / 30, 1e-3)
    for r in runs:
        tl = r["timeline"]
        t, tok = np.asarray(tl["t"], float), np.asarray(tl["out_tokens"], float)
        style = {"lw": 2.0, "color": "k"} if r["summary"]["mode"] == "unified" else {"lw": 1.0, "alpha": 0.8}
        short = shortfall(r["summary"])
        ax.plot(t, _rate(t, tok, window), label=r["summary"]["config"] + (f" ({short})" if short else ""), **style)
    for _, start in phases:
        ax.axvline(start, color="k", ls="--", lw=0.6)
    ax.set_xlabel("s", fontsize=8)
    ax.set_ylabel(f"output tok/s ({window:.2g} s window)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, frameon=False, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_report(report: dict, out_dir: str) -> list[str]:
    """Both figures for every workload of `report` (run_benchmark's dict or its JSON) -> paths."""
    os.makedirs(out_dir, exist_ok=True)
    model = report.get("meta", {}).get("model", "")
    files = []
    for wl, runs in _runs_by_workload(report).items():
        ph = _phases(report, wl)
        head = f"{model} {wl}".strip()
        files.append(memory_figure(runs, os.path.join(out_dir, f"{wl}_memory.png"),
                                   title=f"{head}: arena bytes by band", phases=ph))
        files.append(throughput_figure(runs, os.path.join(out_dir, f"{wl}_throughput.png"),
                                       title=f"{head}: output throughput", phases=ph))
    return files


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m umem_jax.bench.plots RESULTS.json [OUT_DIR]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        report = json.load(f)
    for p in plot_report(report, argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(argv[0]))):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["memory_figure", "plot_report", "run_title", "throughput_figure"]
