"""HTTP driver: a workload against an already-running server (`umem-jax serve`), through OpenAI's
/v1/completions with token-id prompts, streamed (httpx, asyncio).

    result = run_http("http://127.0.0.1:8000", workload, workload.prompts(vocab_size))

Each request is sent at its arrival time (greedy, ignore_eos, max_tokens = output_len,
stream_options.include_usage) and timed on the client: TTFT at the first streamed chunk, the
end at the last, the token count from the usage chunk.  The server streams a chunk only when
text appears, so for a model without a tokenizer the first chunk is the last and TTFT equals the
end-to-end time.  The timeline and the engine counters come from GET /metrics, scraped every
`interval_s` (per-band held bytes, live / holes / free / sink bytes, running / waiting, generated
tokens, retractions, relocated bytes).
"""

from __future__ import annotations

import asyncio
import json
import time

from .progress import progress_bar
from .results import RequestRecord, RunResult, Timeline
from .workload import Workload

_COUNTERS = {"num_retractions": "umem:num_retractions_total", "num_preemptions": "umem:num_preemptions_total",
             "num_moved_pages": "umem:num_moved_pages_total", "relocated_bytes": "umem:relocated_bytes_total",
             "num_evictions": "umem:num_evictions_total", "compiles": "umem:num_compilations_total",
             "generation_tokens": "umem:generation_tokens_total"}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name[:band or :part]: value} for the series the benchmark reads."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created", "_sum", "_count")):
                continue
            key = s.name
            for label in ("band", "part"):
                if label in s.labels:
                    key += ":" + s.labels[label]
            out[key] = s.value
    return out


def _usage(m: dict) -> dict:
    bands = {k.split(":", 2)[2]: v for k, v in m.items() if k.startswith("umem:arena_band_held_bytes:")}
    return {"live_bytes": m.get("umem:arena_bytes:live", 0), "hole_bytes": m.get("umem:arena_bytes:holes", 0),
            "free_bytes": m.get("umem:arena_bytes:free", 0), "sink_bytes": m.get("umem:arena_bytes:sink", 0),
            "evictable_bytes": m.get("umem:arena_evictable_bytes", 0), "held_bytes": bands}


async def _request(client, url: str, model: str | None, rec: RequestRecord, prompt: list[int], t0: float,
                   done) -> None:
    """Send one request at its arrival time and fill `rec` from the stream."""
    arrival = t0 + rec.arrival_s
    await asyncio.sleep(max(0.0, arrival - time.time()))
    body = {"prompt": prompt, "max_tokens": rec.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    first = last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.finish_reason, rec.error = "abort", f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.finish_reason, rec.error = "abort", str(chunk["error"].get("message"))
                    continue
                now = time.time()
                for ch in chunk.get("choices") or ():
                    first = now if first is None else first
                    last = now
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
                if chunk.get("usage"):
                    rec.tokens = int(chunk["usage"]["completion_tokens"])
    except Exception as e:  # connection refused / reset: the request is lost, the run goes on
        rec.finish_reason, rec.error = "abort", f"{type(e).__name__}: {e}"
    finally:
        done()
    if first is not None:
        rec.ttft_s, rec.e2e_s = first - arrival, last - arrival
        if rec.tokens > 1:
            rec.tpot_s = (last - first) / (rec.tokens - 1)


async def _drive(url, workload, prompts, model, recs, tl: Timeline | None, interval_s, advance):
    import httpx

    t0 = time.time()
    stop = asyncio.Event()
    finished = [0]

    def done():
        finished[0] += 1
        advance(1)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None)) as client:
        base = parse_metrics((await client.get(url + "/metrics")).text)
        if tl is None:
            tl = Timeline(sorted(k.split(":", 2)[2] for k in base if k.startswith("umem:arena_band_held_bytes:")))

        async def scrape():
            while not stop.is_set():
                m = parse_metrics((await client.get(url + "/metrics")).text)
                gen = m.get(_COUNTERS["generation_tokens"], 0) - base.get(_COUNTERS["generation_tokens"], 0)
                tl.add(time.time() - t0, gen, m.get("umem:num_requests_running", 0),
                       m.get("umem:num_requests_waiting", 0), _usage(m))
                try:
                    await asyncio.wait_for(stop.wait(), interval_s)
                except asyncio.TimeoutError:
                    pass
            return m

        poller = asyncio.create_task(scrape())
        await asyncio.gather(*(_request(client, url, model, rec, p, t0, done) for rec, p in zip(recs, prompts)))
        end = time.time()
        stop.set()
        last = await poller
    counters = {k: last.get(name, 0) - base.get(name, 0) for k, name in _COUNTERS.items()}
    return tl, end - t0, counters, int(base.get("umem:arena_total_bytes", 0))


def run_http(url: str, workload: Workload, prompts: list[list[int]], *, model: str | None = None,
             interval_s: float = 0.25, progress: bool = True) -> RunResult:
    """Drive `workload` against the server at `url` -> RunResult (mode "server"; counters are
    deltas of the server's /metrics over the run)."""
    url = url.rstrip("/")
    recs = [RequestRecord(r.arrival_s, r.input_len, r.output_len, r.kind) for r in workload.requests]
    with progress_bar(len(recs), f"{workload.name} via {url}", progress) as advance:
        tl, dur, counters, arena = asyncio.run(_drive(url, workload, prompts, model, recs, None, interval_s, advance))
    return RunResult(workload.name, "server", "server", requests=recs, timeline=tl, duration_s=dur, arena_bytes=arena,
                     counters=counters)


__all__ = ["parse_metrics", "run_http"]
