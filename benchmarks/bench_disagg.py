"""Prefill/decode disaggregation on one GPU (issue 19): the router over a prefill and a decode worker
against one engine with the same total memory, on the same workload, in one run.

    # the GPU (one device call, ~5-8 min; carry .whl: FastAPI, uvicorn, pydantic are not on the image)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \\
    PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_disagg --out $OUT/disagg 2>&1 | tee $OUT/bench_disagg.log
    # the CPU (tiny model, ~1 min)
    JAX_PLATFORMS=cpu python3 -m benchmarks.bench_disagg --small --out /tmp/bench_disagg

.whl holds the wheels for Python 3.12 x86-64 the GPU image lacks (fastapi, starlette, uvicorn,
pydantic, pydantic-core, annotated-types, typing-inspection, opentelemetry-api (fastapi imports
it), typing-extensions (pydantic-core wants >= 4.14.1), annotated-doc); it is git-ignored through
.git/info/exclude and made with `pip download` (benchmarks/RESULTS.md, "Disaggregation").

What runs, as processes of this machine (logs in --out):
  prefill  `umem-jax serve MODEL --disaggregation-mode prefill`   arena W, memory share f_w
  decode   `umem-jax serve MODEL --disaggregation-mode decode`    arena W, memory share f_w
  router   `umem-jax router --prefill URL --decode URL`           no device (JAX_PLATFORMS=cpu)
  single   `umem-jax serve MODEL`                                 arena 2W, memory share f_s
Each engine gets its share as XLA_PYTHON_CLIENT_MEM_FRACTION with PREALLOCATE=false
(disagg_serve.child_env says why); the three engines fit at once (0.25 + 0.25 + 0.4 of 141 GB:
4B weights ~8 GB each, arenas 12/12/24 GiB), so they start and compile together, and the two
configurations are then measured one after the other while the other idles.  --sequential starts
the single engine only after the pair has stopped.  MODEL: a random-weight preset (config.json
written here, `--load-format dummy`: the same weights in every process, from --seed), served with
a word-per-id tokenizer so every token streams as a chunk of its own.

The workload, the same through both: random prompts of --lengths tokens, --max-tokens out,
greedy, ignore_eos, streamed; per --concurrency c, max(c, --min-per-length) prompts of each
length with at most c in flight.  Per c, first an untimed warm-up of the same shape with other
prompts (step shapes compile on first use), then the timed pass; one during which an engine
compiled runs again with new prompts (both rows are kept; compilations are reported).  Every
prompt is new to the engine (no prefix-cache hits).  ITL is per streamed chunk, as vLLM's and
SGLang's benchmarks count it: tokens that arrive in bursts show a low median and a high p99;
TPOT, (end - first token) / (tokens - 1) per request, is the steady rate.

Reported: the greedy outputs through the router against the single engine's (equal, or loud);
TTFT, ITL and TPOT (median, p99), output tok/s; the page-envelope transfers per prompt length:
bytes, the parts of the path (export: on the prefill worker's engine thread, pending page moves,
the gather and the device-to-host read, which waits for a step still in flight; pack: np.savez,
or with the shm transport the copy into a shared-memory segment; HTTP: the POST until the ack less
the decode side's unpack (shm: attach and copy out), wait for its engine thread and install call;
install: the host call, whose device copies may end inside the next step) and GB/s
of the send and of the whole path.  Written to --out: results.json (after every pass) and
each process's log; the tables are printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .disagg_serve import (SERVED, Server, child_env, compiles, join_transfers, model_files, prompts, run_pass,
                           transfer_summary, word_tokenizer)
from .report import RowLog, fmt, format_table

SMALL = dict(model="tiny", lengths="16,40,100", max_tokens=12, concurrency="1,4", min_per_length=1, page_size=4,
             max_num_batched_tokens=64, worker_arena_gib=0.5 / 1024, time_budget_s=600.0, start_timeout_s=400.0)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_disagg", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-4b-like", help="a random-weight preset, a built-in name (tiny) "
                    "or a directory with a config.json (served with random weights)")
    ap.add_argument("--lengths", default="512,2048,8192", help="prompt lengths, tokens")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--concurrency", default="1,16", help="requests in flight, one timed pass each")
    ap.add_argument("--min-per-length", type=int, default=3, help="prompts of each length per pass, at least")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--worker-arena-gib", type=float, default=12.0, help="each worker's arena; the single engine "
                    "gets both (the same total)")
    ap.add_argument("--worker-mem-fraction", type=float, default=0.25, help="each worker's share of the GPU memory")
    ap.add_argument("--single-mem-fraction", type=float, default=0.40, help="the single engine's share")
    ap.add_argument("--sequential", action="store_true", help="start the single engine after the pair stopped")
    ap.add_argument("--time-budget-s", type=float, default=450.0, help="no pass starts after this, from the start "
                    "(the device call's limit is 600 s)")
    ap.add_argument("--start-timeout-s", type=float, default=300.0, help="for every server to become ready")
    ap.add_argument("--transfer-timeout", type=float, default=600.0, help="the router's transfer deadline (the "
                    "warm-up compiles on the prefill worker while reservations wait)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", default="auto", choices=("auto", "http", "shm"),
                    help="the prefill worker's --disaggregation-transfer-backend (auto: shm on this host)")
    ap.add_argument("--out", default=None, help="default: $OUT/bench_disagg, else ./bench_disagg_out")
    ap.add_argument("--small", action="store_true", help="CPU smoke: the tiny model, short prompts, c = 1 and 4")
    args = ap.parse_args(argv)
    if args.small:
        for k, v in SMALL.items():
            setattr(args, k, v)
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]
    ps = args.page_size
    args.max_model_len = -(-(max(args.lengths) + args.max_tokens) // ps) * ps
    args.max_num_seqs = max(args.concurrency)
    return args


@dataclasses.dataclass
class Config:
    """One way of serving: the URL the client talks to and the engines behind it."""

    name: str
    url: str
    engines: dict[str, Server]
    servers: list[Server]  # what to start, in order
    seen: set = dataclasses.field(default_factory=set)  # transfer ids of earlier passes


def make_configs(args, model_args: list[str], tok: Path, out: Path) -> dict[str, Config]:
    """The prefill and decode workers with the router in front, and the single engine."""
    arena = int(args.worker_arena_gib * 2**30)
    # --warmup-shapes 0: a 4B model's step compiles in 10-15 s on the H200, one at a time even from
    # threads, so the 40 decode shapes of these buckets alone would take minutes at start; the
    # warm-up passes compile the shapes each engine really runs (~10-20)
    common = ["--max-num-seqs", args.max_num_seqs, "--max-num-batched-tokens", args.max_num_batched_tokens,
              "--page-size", args.page_size, "--max-model-len", args.max_model_len, "--seed", args.seed,
              "--served-model-name", SERVED, "--tokenizer", tok, "--warmup-shapes", 0, "--warmup-sampling", "greedy"]
    common = [str(x) for x in common]
    worker = lambda mode: ["serve", *model_args, "--disaggregation-mode", mode, "--arena-bytes", str(arena), *common]
    p = Server("prefill", worker("prefill") + ["--disaggregation-transfer-backend", args.transport],
               child_env(args.worker_mem_fraction), out)
    d = Server("decode", worker("decode"), child_env(args.worker_mem_fraction), out)
    r = Server("router", ["router", "--prefill", p.url, "--decode", d.url, "--transfer-timeout",
                          str(args.transfer_timeout)], child_env(None, cpu_only=True), out)
    s = Server("single", ["serve", *model_args, "--arena-bytes", str(2 * arena), *common],
               child_env(args.single_mem_fraction), out)
    return {"router": Config("router", r.url, {"prefill": p, "decode": d}, [p, d, r]),
            "single": Config("single", s.url, {"single": s}, [s])}


async def start(client, configs: list[Config], args, log: RowLog) -> None:
    servers = [s for c in configs for s in c.servers]
    for s in servers:
        s.start()
    deadline = time.monotonic() + args.start_timeout_s
    ready = await asyncio.gather(*[s.wait(client, deadline) for s in servers])
    for s, t in zip(servers, ready):
        log.meta.setdefault("ready_s", {})[s.name] = t
        print(f"{s.name}: ready in {t:.1f} s ({s.url})", flush=True)
    log.flush()


async def one_pass(client, conf: Config, name: str, c: int, batch, args, log: RowLog) -> dict:
    """Run `batch` through `conf` at concurrency c; its row: the pass's figures, the step shapes its
    engines compiled meanwhile and (router) its transfers."""
    before = {k: await compiles(client, s.url) for k, s in conf.engines.items()}
    res = await run_pass(client, conf.url, batch, args.max_tokens, c)
    after = {k: await compiles(client, s.url) for k, s in conf.engines.items()}
    res["compiles"] = {k: None if before[k] is None or after[k] is None else after[k] - before[k] for k in before}
    row = {"kind": "pass", "config": conf.name, "pass": name, "concurrency": c, **res}
    if "prefill" in conf.engines:
        sent = (await client.get(f"{conf.engines['prefill'].url}/disagg/transfers")).json()["transfers"]
        got = (await client.get(f"{conf.engines['decode'].url}/disagg/transfers")).json()["transfers"]
        recs = join_transfers(sent, got, conf.seen)
        conf.seen.update(r["transfer_id"] for r in sent)
        row["transfers"] = transfer_summary(recs)
    log.add(row)
    ttft, itl = res["ttft_ms"], res["itl_ms"]
    print(f"  {conf.name:6s} {name:10s} c={c:<3d} {res['requests']} requests ({res['failed']} failed) in "
          f"{res['wall_s']:.1f} s: TTFT {fmt(ttft['median'], '.1f')} / {fmt(ttft['p99'], '.1f')} ms, ITL "
          f"{fmt(itl['median'], '.2f')} / {fmt(itl['p99'], '.2f')} ms, {fmt(res['output_tok_s'], '.1f')} tok/s, "
          f"compiled {res['compiles']}", flush=True)
    for e in res["errors"][:3]:
        print(f"    error: {e}", flush=True)
    return row


async def measure(client, group: list[Config], plan, args, log: RowLog, t0: float) -> None:
    """Per concurrency, lowest first (its figures arrive early): an untimed warm-up through every
    configuration of `group` at once, then the timed pass, one configuration at a time; a timed pass
    during which an engine compiled a step shape runs once more with its spare prompts ("-again").
    No pass starts after the time budget."""
    def late(name, conf):
        if time.monotonic() - t0 <= args.time_budget_s:
            return False
        log.add({"kind": "pass", "config": conf.name, "pass": name, "status": "skipped: time budget"})
        print(f"  {conf.name} {name}: skipped (time budget)", flush=True)
        return True

    async def warm(conf, c, batch):
        if not late(f"warmup-c{c}", conf):
            await one_pass(client, conf, f"warmup-c{c}", c, batch, args, log)

    for c, sets in plan:
        await asyncio.gather(*[warm(conf, c, sets["warmup"]) for conf in group])
        for conf in group:
            if late(f"c{c}", conf):
                continue
            row = await one_pass(client, conf, f"c{c}", c, sets["timed"], args, log)
            if any(row["compiles"].values()) and not late(f"c{c}-again", conf):
                await one_pass(client, conf, f"c{c}-again", c, sets["again"], args, log)


def passes(args, vocab: int) -> list[tuple[int, dict]]:
    """Per concurrency c: the prompts of its warm-up, its timed pass and the spare ones of a second
    timed pass, each max(c, --min-per-length) of every length, the same through both configurations."""
    rng = np.random.default_rng(args.seed)
    n = lambda c: max(c, args.min_per_length)
    return [(c, {k: prompts(rng, args.lengths, n(c), vocab) for k in ("warmup", "timed", "again")})
            for c in args.concurrency]


def correctness(rows: list[dict]) -> dict:
    """Per pass run through both: how many outputs are equal; mismatches printed loudly."""
    got = {(r["config"], r["pass"]): r for r in rows if r.get("kind") == "pass" and "outputs" in r}
    out = {}
    for (conf, name), r in got.items():
        s = got.get(("single", name))
        if conf != "router" or s is None:
            continue
        bad = [i for i, (a, b) in enumerate(zip(r["outputs"], s["outputs"])) if a != b]
        out[name] = {"equal": len(r["outputs"]) - len(bad), "of": len(r["outputs"]), "mismatches": bad,
                     "concurrency": r["concurrency"]}
        for i in bad[:5]:
            print(f"!! MISMATCH {name} request {i}: router {r['outputs'][i][:80]!r} != single "
                  f"{s['outputs'][i][:80]!r}", flush=True)
        if bad and r["concurrency"] > 1:
            print(f"!! {name}: {len(bad)} of {len(r['outputs'])} outputs differ; the two configurations batch "
                  "differently at c > 1 (in bf16 that can flip a greedy argmax): compare with c=1", flush=True)
    return out


async def finish(client, configs: dict[str, Config], log: RowLog) -> None:
    """The router's counters and the workers' idle leak checks, into the results."""
    conf = configs["router"]
    try:
        log.meta["router_stats"] = (await client.get(f"{conf.url}/router/stats")).json()
        log.meta["idle_check"] = {k: (await client.post(f"{s.url}/disagg/check", json={})).json()
                                  for k, s in conf.engines.items()}
    except Exception as e:  # noqa: BLE001 - the pair was stopped (--sequential) or died: say so
        log.meta["idle_check"] = f"not reached: {type(e).__name__} {e}"


def tables(rows: list[dict], check: dict) -> str:
    """The serving table (each timed pass of each configuration), the transfers, TTFT by length."""
    timed = [r for r in rows if r.get("kind") == "pass" and "ttft_ms" in r and not r["pass"].startswith("warmup")]
    head = ["pass", "config", "requests", "TTFT med ms", "TTFT p99 ms", "ITL med ms", "ITL p99 ms", "TPOT med ms",
            "out tok/s", "compiled in pass", "outputs equal"]
    body = []
    for r in timed:
        eq = check.get(r["pass"], {})
        body.append([r["pass"], r["config"], f"{r['requests'] - r['failed']}/{r['requests']}",
                     fmt(r["ttft_ms"]["median"], ".1f"), fmt(r["ttft_ms"]["p99"], ".1f"),
                     fmt(r["itl_ms"]["median"], ".2f"), fmt(r["itl_ms"]["p99"], ".2f"),
                     fmt(r["tpot_ms"]["median"], ".2f"), fmt(r["output_tok_s"], ".1f"),
                     int(sum(v or 0 for v in r["compiles"].values())),
                     f"{eq['equal']}/{eq['of']}" if eq and r["config"] == "router" else ""])
    return "\n".join(["serving (TTFT: send to first token; ITL: gaps between streamed tokens; ms)",
                      format_table(head, body, left=2), "", _transfer_table(timed), "", _ttft_table(timed)])


def _transfer_table(timed: list[dict]) -> str:
    head = ["pass", "tokens", "MB", "export ms", "pack ms", "HTTP ms", "unpack ms", "wait ms", "install ms",
            "send GB/s", "path GB/s"]
    body = [[r["pass"], t["tokens"], fmt(t["bytes"] and t["bytes"] / 1e6, ".3f"), fmt(t["export_ms"], ".1f"),
             fmt(t["pack_ms"], ".1f"), fmt(t["http_ms"], ".1f"), fmt(t["unpack_ms"], ".1f"),
             fmt(t["install_wait_ms"], ".1f"), fmt(t["install_ms"], ".1f"), fmt(t["send_gbps"], ".2f"),
             fmt(t["path_gbps"], ".2f")] for r in timed for t in r.get("transfers", [])]
    return ("page-envelope transfers (medians per prompt length; send = HTTP + unpack + wait + install)\n"
            + format_table(head, body, left=1))


def _ttft_table(timed: list[dict]) -> str:
    single = {r["pass"]: r["ttft_ms_by_len"] for r in timed if r["config"] == "single"}
    body = []
    for r in timed:
        for n, t in r["ttft_ms_by_len"].items() if r["config"] == "router" and r["pass"] in single else ():
            s = single[r["pass"]].get(n)
            body.append([r["pass"], n, fmt(t, ".1f"), fmt(s, ".1f"), fmt(None if s is None else t - s, "+.1f")])
    head = ["pass", "tokens", "router", "single", "router - single"]
    return "median TTFT by prompt length (ms)\n" + format_table(head, body, left=1)


def _meta(args) -> dict:
    """When, where and with what: date, command, commit, jax, the device (nvidia-smi), settings."""
    from importlib import metadata

    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=Path(__file__).parent).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    try:
        jax_version = metadata.version("jax")  # not imported: this process must not take GPU memory
    except metadata.PackageNotFoundError:
        jax_version = None
    command = " ".join(["python3 -m benchmarks.bench_disagg", *sys.argv[1:]])
    return {"bench": "bench_disagg", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command,
            "commit": run(["git", "rev-parse", "HEAD"]).strip() or None, "jax": jax_version,
            "device": run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]).strip() or "cpu",
            "settings": {k: v for k, v in vars(args).items() if k != "out"}}


async def amain(args, out: Path, log: RowLog) -> int:
    import httpx

    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench_disagg_"))  # the model's config.json, the tokenizer
    model_args, vocab = model_files(args.model, work)
    configs = make_configs(args, model_args, word_tokenizer(vocab, work / "tokenizer"), out)
    groups = [[configs["router"]], [configs["single"]]] if args.sequential else [list(configs.values())]
    plan = passes(args, vocab)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits) as client:
            for group in groups:
                await start(client, group, args, log)
                await measure(client, group, plan, args, log, t0)
                if args.sequential and group[0].name == "router":
                    await finish(client, configs, log)
                    for s in group[0].servers[::-1]:
                        s.stop()
            if not args.sequential:
                await finish(client, configs, log)
    finally:
        for conf in configs.values():
            for s in conf.servers[::-1]:
                s.stop()
        shutil.rmtree(work, ignore_errors=True)
    check = correctness(log.rows)
    log.meta.update(correctness=check, outputs_equal=bool(check) and all(not v["mismatches"] for v in check.values()))
    log.flush()
    print("\n" + tables(log.rows, check), flush=True)
    failed = sum(r.get("failed", 0) for r in log.rows if r.get("kind") == "pass")
    counts = ", ".join(f"{k} {v['equal']}/{v['of']}" for k, v in check.items())
    print(f"\noutputs equal: {log.meta['outputs_equal']} ({counts}); failed requests: {failed}; router "
          f"{log.meta.get('router_stats')}; {time.monotonic() - t0:.0f} s in all; {out}", flush=True)
    # failing: a failed request, or an output differing where both sides ran the same step shapes (c=1)
    strict = all(not v["mismatches"] for v in check.values() if v["concurrency"] == 1)
    return 0 if check and strict and failed == 0 else 1


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out or (os.path.join(os.environ["OUT"], "bench_disagg") if os.environ.get("OUT")
                            else "bench_disagg_out"))
    out.mkdir(parents=True, exist_ok=True)
    log = RowLog(str(out / "results.json"), **_meta(args))
    print(f"== bench_disagg: {args.model}, prompts {args.lengths} x {args.max_tokens} out, concurrency "
          f"{args.concurrency}, worker arenas {args.worker_arena_gib:g} GiB; {log.meta['device']}", flush=True)
    try:
        return asyncio.run(amain(args, out, log))
    except RuntimeError as e:  # a server did not start: its log's tail says why
        log.meta["error"] = str(e)
        log.flush()
        print(f"bench_disagg: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
