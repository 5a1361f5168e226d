"""The figures of `umem-jax bench serve` from its RequestOutputs: vLLM's metric set, printed in
the block `vllm bench serve` prints, and the JSON of its --save-result (same keys).

    m = calculate(outputs, duration, peak, percentile_metrics=("ttft", "tpot", "itl", "e2el"),
                  percentiles=(99,), goodput={"ttft": 500.0})
    print(block(m, max_concurrency=None, request_rate=math.inf))

Per successful request: TTFT, TPOT = (latency - TTFT) / (output tokens - 1) (requests of one
token have none), every inter-token gap (ITL), and E2EL = the latency.  Latencies in ms; mean,
median, std and each asked percentile per metric (None over no values).  Goodput: requests per
second that met every SLO given (ttft / tpot / e2el, ms).  Peak output throughput: the most
output tokens in one 1 s bin of chunk arrival times (a chunk's share: its request's tokens over
its chunks, exact when a server sends one token a chunk).
"""

from __future__ import annotations

import math

import numpy as np

METRICS = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (ms); a clear error otherwise."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: give KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if out[key] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return out


def parse_list(text: str, allowed=None, what: str = "") -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if allowed is not None and t not in allowed]
    if bad or not items:
        raise ValueError(f"{what} {text!r}: a comma list of {', '.join(allowed)}")
    return items


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(t) for t in parse_list(text, None, "--metric-percentiles")]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: a comma list of numbers in (0, 100]") from None
    if any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles {text!r}: each in (0, 100]")
    return ps


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, xs: list[float], percentiles) -> dict:
    a = np.asarray(xs, float) * 1e3
    none = not a.size
    out = {f"mean_{name}_ms": None if none else float(a.mean()),
           f"median_{name}_ms": None if none else float(np.median(a)),
           f"std_{name}_ms": None if none else float(a.std())}
    for p in percentiles:
        out[f"p{_pword(p)}_{name}_ms"] = None if none else float(np.percentile(a, p))
    return out


def _peak_output_rate(outputs) -> float:
    bins: dict[int, float] = {}
    for o in outputs:
        if o.success and o.chunk_times:
            share = o.output_tokens / len(o.chunk_times)
            for t in o.chunk_times:
                bins[int(t)] = bins.get(int(t), 0.0) + share
    return max(bins.values(), default=0.0)


def calculate(outputs, duration: float, peak_concurrency: int, *, percentile_metrics=("ttft", "tpot", "itl", "e2el"),
              percentiles=(99.0,), goodput: dict[str, float] | None = None) -> dict:
    """The run's figures (keys as vLLM's result JSON)."""
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itls = [g for o in ok for g in o.itl]
    e2els = [o.latency for o in ok]
    total_in, total_out = sum(o.prompt_len for o in ok), sum(o.output_tokens for o in ok)
    m = {"duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
         "total_token_throughput": (total_in + total_out) / duration,
         "max_output_tokens_per_s": _peak_output_rate(ok), "max_concurrent_requests": peak_concurrency,
         "request_goodput": None, "percentile_metrics": list(percentile_metrics),
         "percentiles": [float(p) for p in percentiles]}
    if goodput:
        slo = {"ttft": lambda o: o.ttft, "e2el": lambda o: o.latency,
               "tpot": lambda o: (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0}
        good = sum(all(slo[k](o) * 1e3 <= v for k, v in goodput.items()) for o in ok)
        m["request_goodput"] = good / duration
        m["goodput_slo_ms"] = dict(goodput)
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m.update(_stats(name, xs, percentiles))
    sources = sorted({o.output_tokens_source for o in ok})
    m["output_tokens_source"] = ",".join(sources) if sources else None
    return m


def _num(v, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def block(m: dict, *, max_concurrency: int | None, request_rate: float, width: int = 50) -> str:
    """The result block, line for line as `vllm bench serve` prints it (plus the E2EL section
    when asked, and "n/a" where a metric had no values)."""
    row = lambda label, v: f"{label:<40} {v:<10}"
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="="),
             row("Successful requests:", m["completed"]), row("Failed requests:", m["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:.2f}"
    lines += [row("Request rate configured (RPS):", rate),
              row("Benchmark duration (s):", f"{m['duration']:.2f}"),
              row("Total input tokens:", m["total_input_tokens"]),
              row("Total generated tokens:", m["total_output_tokens"]),
              row("Request throughput (req/s):", f"{m['request_throughput']:.2f}")]
    if m.get("request_goodput") is not None:
        lines.append(row("Request goodput (req/s):", f"{m['request_goodput']:.2f}"))
    lines += [row("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
              row("Peak output token throughput (tok/s):", f"{m['max_output_tokens_per_s']:.2f}"),
              row("Peak concurrent requests:", m["max_concurrent_requests"]),
              row("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")]
    for key in m["percentile_metrics"]:
        header, name = METRICS[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=width, c="-"))
        lines.append(row(f"Mean {name} (ms):", _num(m[f"mean_{key}_ms"], ".2f")))
        lines.append(row(f"Median {name} (ms):", _num(m[f"median_{key}_ms"], ".2f")))
        for p in m["percentiles"]:
            lines.append(row(f"P{_pword(p)} {name} (ms):", _num(m[f"p{_pword(p)}_{key}_ms"], ".2f")))
    lines.append("=" * width)
    return "\n".join(lines)


def detailed(outputs) -> dict:
    """Per-request arrays of vLLM's --save-detailed."""
    return {"input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_tokens for o in outputs],
            "ttfts": [o.ttft if o.success else None for o in outputs], "itls": [o.itl for o in outputs],
            "start_times": [o.start for o in outputs], "generated_texts": [o.generated_text for o in outputs],
            "errors": [o.error for o in outputs]}


__all__ = ["GOODPUT_KEYS", "METRICS", "block", "calculate", "detailed", "parse_goodput", "parse_list",
           "parse_percentiles"]
