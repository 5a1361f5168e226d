"""Workload benchmark: synthetic traces through the engine, unified arena vs the static split;
and `bench serve`, the serving benchmark of vLLM's conventions against any OpenAI-compatible server.

    workload.py     request traces (state-heavy, kv-heavy, mixed, shifting)
    driver.py       one trace through one offline engine, timed (warm-up first)
    http_driver.py  one trace against a running server over HTTP
    results.py      per-request records, the memory timeline, the summary row
    sweep.py        unified + static settings side by side, the table, the goals' ratios
    plots.py        band bytes and throughput over time (matplotlib)
    progress.py     the progress bar (rich)
    command.py      `umem-jax bench`
    datasets.py     bench serve's datasets: random, random-ids, generated-shared-prefix, sharegpt; arrivals
    serve_client.py bench serve's streamed OpenAI requests on an arrival schedule (httpx, asyncio)
    serve_metrics.py  bench serve's figures, vLLM's result block and JSON
    serve_command.py  `umem-jax bench serve` (any OpenAI-compatible server)
"""
