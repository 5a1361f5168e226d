"""A new user's first hour, timed: README's steps in fresh processes, each one's wall time and
peak resident memory, the server's start-up and its resident memory after 40 requests, and
what ~/.cache/umem_jax holds afterwards.

    python3 scripts/readme_walk.py              # with the compile cache as it is
    python3 scripts/readme_walk.py --cold       # ~/.cache/umem_jax moved aside first (restored after)

Steps (README order): `umem-jax demo`, the Python example, `umem-jax generate`, `umem-jax serve`
with the official openai client (40 completions), `umem-jax bench --small`.  Peak RSS is each
process's maximum resident set (GNU time's %M); the server's is read from /proc while it runs
(VmRSS now, VmHWM its peak).  A table comes last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path(os.environ.get("UMEM_JAX_CACHE", Path.home() / ".cache" / "umem_jax"))
PY_EXAMPLE = """
from umem_jax import LLM, SamplingParams
llm = LLM(model="gemma3-270m")
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
print(repr(out[0].outputs[0].text), llm.llm_engine.stats()["bands"])
"""


def run(name: str, cmd: list[str], rows: list, timeout: float = 1800) -> str:
    """One step in a fresh process -> its output; a row (name, seconds, peak MiB, rc).  The peak
    resident set is GNU time's %M for that process alone."""
    with tempfile.NamedTemporaryFile("r") as peak:
        t = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", peak.name, *cmd], capture_output=True, text=True,
                           timeout=timeout)
        secs = time.perf_counter() - t
        kib = peak.read().strip().splitlines()
    rows.append((name, secs, int(kib[-1]) / 1024 if kib and kib[-1].isdigit() else None, p.returncode))
    print(f"--- {name}: rc {p.returncode} in {secs:.1f} s\n{p.stdout[-1500:]}{p.stderr[-1500:]}", flush=True)
    return p.stdout


def _status(pid: int) -> dict:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) / 1024
    return out


def serve(rows: list, n: int = 40) -> None:
    """`umem-jax serve` on a free port: seconds to /health 200, then n completions through the
    official openai client, then the server's resident memory."""
    import httpx
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile()
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "umem_jax.cli", "serve", "gemma3-270m", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"serve exited {proc.returncode}: {log.read()[-3000:].decode()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        ready = time.perf_counter() - t
        at_ready = _status(proc.pid)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY")
        t = time.perf_counter()
        texts = [client.completions.create(model="gemma3-270m", prompt=f"Fact {i}: the capital of France is",
                                           max_tokens=16, temperature=0).choices[0].text for i in range(n)]
        secs = time.perf_counter() - t
        after = _status(proc.pid)
        print(f"--- serve: ready in {ready:.1f} s ({at_ready}); {n} completions in {secs:.1f} s; e.g. {texts[0]!r}; "
              f"{after}", flush=True)
        rows.append(("serve: start to /health 200", ready, at_ready.get("VmRSS"), 0))
        rows.append((f"serve: {n} completions (RSS after; peak {after.get('VmHWM', 0):.0f} MiB)", secs,
                     after.get("VmRSS"), 0))
    finally:
        proc.terminate()
        proc.wait(60)
        log.seek(0)
        print("--- serve's log (last lines):\n" + log.read()[-2000:].decode(), flush=True)


def _du_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20 if path.exists() else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="move ~/.cache/umem_jax aside first (restored at the end)")
    ap.add_argument("--out", default=None, help="bench --small's output folder (default: a temporary one)")
    a = ap.parse_args()
    aside = None
    if a.cold and CACHE.exists():
        aside = CACHE.with_name(CACHE.name + ".walk-aside")
        CACHE.rename(aside)
    rows: list = []
    exe = [sys.executable, "-m", "umem_jax.cli"]
    try:
        run("umem-jax demo" + (" (cold)" if a.cold else ""), exe + ["demo"], rows)
        run("Python example (LLM.generate)", [sys.executable, "-c", PY_EXAMPLE], rows)
        run("umem-jax generate --prompt ...", exe + ["generate", "--prompt", "The capital of France is"], rows)
        serve(rows)
        out = a.out or tempfile.mkdtemp(prefix="walk_bench_")
        run("umem-jax bench --small", exe + ["bench", "--small", "--out", out], rows)
        cache = _du_mib(CACHE)
    finally:
        if aside is not None:
            shutil.rmtree(CACHE, ignore_errors=True)
            aside.rename(CACHE)
    print(f"\n== README walk ({'cold' if a.cold else 'warm'} cache; {os.cpu_count()} cores)")
    print(f"{'step':<62} {'seconds':>8} {'RSS MiB':>8} {'rc':>3}")
    for name, secs, mib, rc in rows:
        print(f"{name:<62} {secs:>8.1f} {'' if mib is None else f'{mib:.0f}':>8} {rc:>3}")
    print(f"~/.cache/umem_jax after the walk: {cache:.0f} MiB")
    return 0 if all(r[3] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
