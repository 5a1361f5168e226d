"""Workload benchmark: synthetic traces through the engine, unified arena vs the static split.

    workload.py     request traces (state-heavy, kv-heavy, mixed, shifting)
    driver.py       one trace through one offline engine, timed (warm-up first)
    http_driver.py  one trace against a running server over HTTP
    results.py      per-request records, the memory timeline, the summary row
    sweep.py        unified + static settings side by side, the table, the goals' ratios
    plots.py        band bytes and throughput over time (matplotlib)
    progress.py     the progress bar (rich)
    command.py      `umem-jax bench`
"""
