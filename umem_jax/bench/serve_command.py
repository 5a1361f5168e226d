"""`umem-jax bench serve`: the serving benchmark with `vllm bench serve`'s flags and result block,
against any OpenAI-compatible server (ours, vLLM's, SGLang's) over HTTP.

    umem-jax bench serve --base-url http://127.0.0.1:8000 --dataset-name random --num-prompts 200 \
        --random-input-len 1024 --random-output-len 128 --request-rate 8 --max-concurrency 32 \
        --goodput ttft:500 tpot:50 --ignore-eos --save-result
    umem-jax bench serve --dataset-name sharegpt --dataset-path ShareGPT_V3.json --tokenizer DIR
    umem-jax bench serve --dataset-name generated-shared-prefix --gsp-num-groups 8 --request-rate inf

One request first checks the endpoint (retried while the server warms up, not counted; it is
the first prompt, so a server with a prefix cache has that one cached, as under vLLM's); then
every prompt is sent at its arrival (--request-rate with --burstiness: gamma gaps, 1 = Poisson,
inf = all at once) under --max-concurrency, and the block of vLLM's figures is printed (see
serve_metrics.py).  --save-result writes the same figures as JSON (vLLM's keys; --save-detailed
adds per-request arrays).  When the server is a umem-jax one, its /metrics counters over the
run (retractions, preemptions, compactions, relocated bytes, prefix-cache hits) are printed
after the block and saved under "server_counters".
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

from . import datasets
from .serve_client import Api, initial_test, rate_label, run_requests
from .serve_metrics import METRICS, block, calculate, detailed, parse_goodput, parse_list, parse_percentiles

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "sglang": "/v1/completions",
            "openai-chat": "/v1/chat/completions"}
DEFAULT_VOCAB = 256  # random ids without a tokenizer: every vocabulary has these
SERVER_COUNTERS = {"retractions": "umem:num_retractions_total", "preemptions": "umem:num_preemptions_total",
                   "compactions": "umem:num_compactions_total", "relocated_bytes": "umem:relocated_bytes_total",
                   "evictions": "umem:num_evictions_total", "prefix_cache_queries": "umem:prefix_cache_queries_total",
                   "prefix_cache_hits": "umem:prefix_cache_hits_total"}


def add_arguments(p) -> None:
    p.add_argument("--backend", default="openai", choices=sorted(BACKENDS),
                   help="openai / vllm / sglang: streamed /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: --host, --port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="path of the API (default: the backend's)")
    p.add_argument("--model", default=None, help="served model name (default: the first of GET /v1/models)")
    datasets.add_arguments(p, default="random")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"random token ids are drawn below this (default: the tokenizer's, else {DEFAULT_VOCAB})")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help=f"of {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 25,50,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (every output runs to max_tokens)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request body")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                   help="retry the initial test request this long (0: once)")
    p.add_argument("--save-result", action="store_true", help="write the result JSON")
    p.add_argument("--save-detailed", action="store_true", help="with per-request arrays")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", "--no-progress", dest="progress", action="store_false",
                   help="no progress bar")


def _urls(args) -> tuple[str, str]:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or BACKENDS[args.backend]
    if base.endswith("/v1") and endpoint.startswith("/v1/"):  # a base URL given as the OpenAI client's
        base = base[:-3]
    return base, base + endpoint


def _served_model(base: str, headers: dict) -> str:
    import httpx

    try:
        data = httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"]
    except Exception as e:  # noqa: BLE001 -- any failure: the same advice
        raise ValueError(f"cannot list the models of {base} ({type(e).__name__}: {e}); give --model") from None
    if not data:
        raise ValueError(f"{base}/v1/models lists no model; give --model")
    return data[0]["id"]


def _server_counters(base: str, headers: dict) -> dict | None:
    """umem-jax's engine counters from /metrics (None: not a umem-jax server)."""
    import httpx

    try:
        from .http_driver import parse_metrics

        m = parse_metrics(httpx.get(base + "/metrics", headers=headers, timeout=10).text)
    except Exception:  # noqa: BLE001 -- no /metrics, another server's, or no prometheus-client: nothing to add
        return None
    if SERVER_COUNTERS["retractions"] not in m:
        return None
    return {k: m.get(name, 0.0) for k, name in SERVER_COUNTERS.items()}


def _counters_line(c: dict) -> str:
    hit = c["prefix_cache_hits"] / c["prefix_cache_queries"] if c["prefix_cache_queries"] else None
    return (f"umem-jax server over the run: {c['retractions']:.0f} retractions, {c['preemptions']:.0f} preemptions, "
            f"{c['compactions']:.0f} compactions ({c['relocated_bytes'] / 2**20:.1f} MiB relocated), "
            f"{c['evictions']:.0f} evictions, prefix-cache hit rate "
            f"{'n/a' if hit is None else f'{hit:.1%}'}")


def _result_path(args, model: str) -> str:
    name = args.result_filename
    if name is None:
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = (f"{args.backend}-{rate_label(args.request_rate)}qps{conc}-{model.split('/')[-1]}-"
                f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    return os.path.join(args.result_dir, name) if args.result_dir else name


def main(args) -> int:
    metrics_asked = parse_list(args.percentile_metrics, tuple(METRICS), "--percentile-metrics")
    percentiles, goodput = parse_percentiles(args.metric_percentiles), parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    base, url = _urls(args)
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
    tokenizer = datasets.ClientTokenizer(args.tokenizer) if args.tokenizer else None
    vocab = args.vocab_size or (tokenizer.vocab_size if tokenizer is not None else DEFAULT_VOCAB)
    samples = datasets.sample(args, tokenizer, vocab)
    offsets = datasets.arrivals(len(samples), args.request_rate, args.burstiness, args.seed)
    model = args.model or _served_model(base, headers)
    api = Api(url, model, chat=args.backend == "openai-chat", ignore_eos=args.ignore_eos,
              temperature=args.temperature, extra_body=extra, headers=headers, tokenizer=tokenizer)
    print(f"{args.dataset_name}: {len(samples)} prompts, {sum(s.prompt_len for s in samples)} input tokens, "
          f"{sum(s.output_len for s in samples)} output tokens asked; {url}, model {model}")
    print("Starting initial single prompt test run...", flush=True)
    test = asyncio.run(initial_test(api, samples[0], args.ready_check_timeout_sec,
                                    say=lambda line: print(line, flush=True)))
    if not test.success:
        raise ValueError(f"initial test run failed: make sure the benchmark arguments are right. Error: {test.error}")
    print(f"Initial test run completed. Starting main benchmark run (request rate {rate_label(args.request_rate)}, "
          f"burstiness {args.burstiness:g}, max concurrency {args.max_concurrency})...", flush=True)
    before = _server_counters(base, headers)
    outputs, duration, peak = asyncio.run(run_requests(api, samples, offsets, max_concurrency=args.max_concurrency,
                                                       progress=args.progress))
    after = _server_counters(base, headers) if before is not None else None
    m = calculate(outputs, duration, peak, percentile_metrics=metrics_asked, percentiles=percentiles,
                  goodput=goodput)
    print(block(m, max_concurrency=args.max_concurrency, request_rate=args.request_rate))
    counters = {k: after[k] - before[k] for k in after} if after is not None else None
    if counters is not None:
        print(_counters_line(counters))
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"{len(errors)} failed; first error: {errors[0]}")
    if args.save_result or args.save_detailed:
        result = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "endpoint": url[len(base):],
                  "base_url": base, "model_id": model, "tokenizer_id": args.tokenizer,
                  "dataset_name": args.dataset_name, "num_prompts": len(samples),
                  "request_rate": rate_label(args.request_rate) if math.isinf(args.request_rate) else args.request_rate,
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
                  "ignore_eos": args.ignore_eos, **m, "server_counters": counters}
        if args.save_detailed:
            result.update(detailed(outputs))
        path = _result_path(args, model)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"result written to {path}")
    return 0 if m["completed"] else 1


__all__ = ["BACKENDS", "add_arguments", "main"]
