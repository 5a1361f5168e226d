"""The parts of bench_disagg: the servers it starts (processes, each with its share of the GPU
memory), the files they read (a random-weight model's config.json, a word-per-id tokenizer),
the streaming client that times each request, and the summaries of a pass.

Nothing here imports JAX: the benchmark's own process must never take GPU memory (a JAX backend
would preallocate 75% of the card before the servers start).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SERVED = "bench"  # --served-model-name of every engine

# config.json of the random-weight presets `serve DIR --load-format dummy` builds (registry.SHAPES
# holds the same shapes as ModelConfigs; tests/bench/test_bench_disagg.py checks they agree).
PRESETS = {
    "qwen3.5-4b-like": {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "dtype": "bfloat16"},
}
BUILTIN_VOCAB = {"tiny": 320, "tiny-attention": 320}


# ------------------------------------------------------------------------------ files


def model_files(model: str, work: Path) -> tuple[list[str], int]:
    """The serve arguments for `model` (a preset name, a built-in name, or a directory with a
    config.json) and its vocabulary size.  A preset becomes work/model/config.json, served with
    random weights (--load-format dummy); a directory is served with random weights too."""
    if model in BUILTIN_VOCAB:
        return [model], BUILTIN_VOCAB[model]
    if model in PRESETS:
        d = work / "model"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(PRESETS[model], indent=1))
        model = str(d)
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    return [model, "--load-format", "dummy"], int(vocab)


def word_tokenizer(vocab_size: int, where: Path) -> Path:
    """A tokenizer.json where id i is the word "w<i>": every generated token decodes to text of
    its own, so both servers stream one chunk per token (a model without a tokenizer streams no
    text until the end), and equal texts mean equal token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    where.mkdir(parents=True, exist_ok=True)
    tok.save(str(where / "tokenizer.json"))
    return where


def prompts(rng: np.random.Generator, lengths: list[int], per_length: int, vocab: int) -> list[list[int]]:
    """per_length random prompts of each length, interleaved (L1, L2, L3, L1, ...) so every stretch
    of a pass mixes the lengths; ids from 4 up (clear of the usual special ids)."""
    return [rng.integers(4, vocab, n).tolist() for _ in range(per_length) for n in lengths]


# ------------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(mem_fraction: float | None, cpu_only: bool = False) -> dict:
    """The environment of one server.  mem_fraction: its share of the GPU's memory.  XLA's
    allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the card at the first device
    use; two engines at 0.75 each cannot start.  So each gets its share as that fraction, and
    PREALLOCATE=false makes it take memory as it allocates (weights, the arena, step buffers)
    instead of all of its share at once, which leaves the unused part of a share to the others."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.3f}"
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if cpu_only:  # the router needs no device
        env["JAX_PLATFORMS"] = "cpu"
    return env


class Server:
    """One `umem-jax ...` process on a free port, its output in out/<name>.log."""

    def __init__(self, name: str, args: list[str], env: dict, out: Path):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "umem_jax.cli", *args, "--port", str(self.port)]
        self.env, self.log_path = env, out / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.t0 = self.ready_s = None

    def start(self) -> Server:
        self.t0 = time.monotonic()
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            log.write(" ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        return self

    async def wait(self, client, deadline: float) -> float:
        """Seconds from start to GET /health 200 (warm); raises with the log's tail if it dies or
        the deadline (time.monotonic()) passes."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if (await client.get(f"{self.url}/health", timeout=5)).status_code == 200:
                    self.ready_s = time.monotonic() - self.t0
                    return self.ready_s
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready in time:\n{self.tail()}")
            await asyncio.sleep(0.5)

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts the engine down), SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


async def compiles(client, url: str) -> float | None:
    """umem:num_compilations_total of an engine's /metrics (step shapes compiled so far)."""
    try:
        text = (await client.get(f"{url}/metrics", timeout=10)).text
    except Exception:  # noqa: BLE001 - reported as unknown
        return None
    m = re.search(r"^umem:num_compilations_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


# ------------------------------------------------------------------------------ the client


async def stream_one(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed, greedy completion -> {prompt_len, ttft_s, e2e_s, gaps_s, n_out, text, error}.
    Times are perf_counter seconds from the send; a chunk with text is a token arrival (the word
    tokenizer gives every token its text), and n_out counts the words."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0, stamps, parts, err = time.perf_counter(), [], [], None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                err = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        err = str(chunk["error"].get("message"))
                        break
                    text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                    if text:
                        stamps.append(time.perf_counter())
                        parts.append(text)
    except Exception as e:  # noqa: BLE001 - one request's failure is reported, the pass goes on
        err = f"{type(e).__name__}: {e}"
    text = "".join(parts)
    return {"prompt_len": len(prompt), "ttft_s": stamps[0] - t0 if stamps else None,
            "e2e_s": time.perf_counter() - t0, "gaps_s": np.diff(stamps).tolist(), "n_out": len(text.split()),
            "text": text, "error": err if err or stamps else "no tokens streamed"}


async def run_pass(client, url: str, batch: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """Every prompt of `batch`, at most `concurrency` in flight, in order -> summary() of them."""
    gate = asyncio.Semaphore(concurrency)

    async def one(p):
        async with gate:
            return await stream_one(client, url, p, max_tokens)

    t0 = time.perf_counter()
    recs = await asyncio.gather(*[one(p) for p in batch])
    return summary(recs, time.perf_counter() - t0)


def _ms(xs: list[float]) -> dict:
    """{median, p99, n} in milliseconds of seconds `xs` (None without samples)."""
    if not xs:
        return {"median": None, "p99": None, "n": 0}
    a = np.asarray(xs) * 1e3
    return {"median": float(np.median(a)), "p99": float(np.percentile(a, 99)), "n": len(xs)}


def summary(recs: list[dict], wall_s: float) -> dict:
    """A pass's figures: TTFT, ITL (every gap between streamed tokens), TPOT ((e2e - ttft) /
    (tokens - 1) per request), output tokens per second of the pass's wall time, TTFT by prompt
    length; the outputs in order (for the equality check) and the errors."""
    ok = [r for r in recs if r["error"] is None]
    by_len = {}
    for r in ok:
        by_len.setdefault(r["prompt_len"], []).append(r["ttft_s"])
    tokens = sum(r["n_out"] for r in ok)
    return {"requests": len(recs), "failed": len(recs) - len(ok), "wall_s": wall_s,
            "output_tokens": tokens, "output_tok_s": tokens / wall_s if wall_s > 0 else None,
            "ttft_ms": _ms([r["ttft_s"] for r in ok]), "itl_ms": _ms([g for r in ok for g in r["gaps_s"]]),
            "tpot_ms": _ms([(r["e2e_s"] - r["ttft_s"]) / (r["n_out"] - 1) for r in ok if r["n_out"] > 1]),
            "ttft_ms_by_len": {str(k): _ms(v)["median"] for k, v in sorted(by_len.items())},
            "outputs": [r["text"] for r in recs], "errors": [r["error"] for r in recs if r["error"]][:10]}


# ------------------------------------------------------------------------------ transfers


def join_transfers(sent: list[dict], received: list[dict], seen: set[str]) -> list[dict]:
    """The prefill side's sends (GET /disagg/transfers) not in `seen`, each with its decode side's
    timings and the derived ones: http_s = send_s - the decode side's unpack, wait and install (the
    bytes on the wire, both ends' HTTP work, the ack); GB/s of the send and of the whole path."""
    recv = {r["transfer_id"]: r for r in received}
    out = []
    for s in sent:
        if s["transfer_id"] in seen or not s.get("ok"):
            continue
        d = recv.get(s["transfer_id"], {})
        rec = {**s, **{k: d.get(k) for k in ("body_s", "unpack_s", "install_wait_s", "install_s")}}
        handled = sum(d.get(k) or 0.0 for k in ("unpack_s", "install_wait_s", "install_s"))
        rec["http_s"] = s["send_s"] - handled if d else None
        path_s = s["export_s"] + s["pack_s"] + s["send_s"]
        rec["send_gbps"] = s["bytes"] / s["send_s"] / 1e9 if s["send_s"] > 0 else None
        rec["path_gbps"] = s["bytes"] / path_s / 1e9 if path_s > 0 else None
        out.append(rec)
    return out


TRANSFER_FIELDS = ("export_wait_s", "export_s", "pack_s", "http_s", "body_s", "unpack_s", "install_wait_s",
                   "install_s", "send_s")


def transfer_summary(recs: list[dict]) -> list[dict]:
    """Medians per prompt length: bytes, each part of the path in ms, GB/s."""
    rows = []
    for n in sorted({r["tokens"] for r in recs}):
        rs = [r for r in recs if r["tokens"] == n]
        med = lambda k, rs=rs: float(np.median(v)) if (v := [r[k] for r in rs if r.get(k) is not None]) else None
        row = {"tokens": n, "transfers": len(rs), "bytes": med("bytes")}
        row.update({k[:-2] + "_ms": (None if med(k) is None else med(k) * 1e3) for k in TRANSFER_FIELDS})
        row.update(send_gbps=med("send_gbps"), path_gbps=med("path_gbps"))
        rows.append(row)
    return rows


__all__ = ["PRESETS", "SERVED", "Server", "child_env", "compiles", "free_port", "join_transfers", "model_files",
           "prompts", "run_pass", "stream_one", "summary", "transfer_summary", "word_tokenizer"]
