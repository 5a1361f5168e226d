"""Compile-only memory probe of whole-model steps: do a step's temporaries grow with the arena?

    PYTHONPATH=$PWD python3 benchmarks/gpu_memory_probe.py                    # GPU, ~2 min
    PYTHONPATH=$PWD python3 benchmarks/gpu_memory_probe.py --small            # CPU, tiny shapes

Nothing is allocated: the weights and the arena are ShapeDtypeStructs, every step is only lowered
and compiled (arena donated, default kernels: Pallas on the GPU).  Per (family, step, arena size):
`memory_analysis()` (temp, argument, output, alias bytes); the arena-shaped instructions of the
optimized HLO by opcode (a `copy` or a fusion of arena shape is a whole-arena pass); and the
largest values of XLA's buffer assignment (from an XLA dump in a scratch directory).  The first
thing to read is `temp(larger arena) - temp(smaller arena)`: anything but ~0 means the arena, or a
view of it, is materialised.

XLA's rematerialization pass logs its own estimate ("Peak memory usage of module", and the
"Can't reduce memory use below ..." warning) on stderr; this script turns that log on
(TF_CPP_VMODULE=hlo_rematerialization=1) so it lands next to the rows it belongs to.
JSON rows go to $OUT/gpu_memory_probe.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="umem_xla_dump_")
# Before jax is imported: XLA reads these once.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_module_re=jit_forward").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "hlo_rematerialization=1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from umem_jax.arena import Arena  # noqa: E402
from umem_jax.core.batch import Batch  # noqa: E402
from umem_jax.memory import plan as make_plan  # noqa: E402
from umem_jax.memory import size_arena
from umem_jax.models.registry import build_random  # noqa: E402
from umem_jax.pallas_kernels._compat import silence_triton_deprecation  # noqa: E402
from umem_jax.pallas_kernels.paged_prefill import PREFILL_ENV  # noqa: E402

GIB = 2**30
FAMILIES = {"nemotronh": "nemotronh-8b-like", "qwen35": "qwen3.5-4b-like", "gemma3": "gemma3-4b-like"}
ROWS: list[dict] = []


def _config(fam: str, small: bool):
    from bench_models import FAMILIES as SHAPES  # the benchmark's configs (benchmarks/ is on sys.path)
    cfg = SHAPES[fam]["full"]("bfloat16")
    return SHAPES[fam]["tiny"](cfg) if small else cfg


def _abstract_batch(plan, B: int, T: int, width: int) -> Batch:
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    return Batch(i32(B, T), i32(B), i32(B), {sp.name: i32(B, width) for sp in plan.token_pools}, i32(B))


def _newest_buffer_assignment(before: set[str]) -> str | None:
    files = set(glob.glob(os.path.join(DUMP, "*buffer-assignment.txt")))
    new = sorted(files - before, key=os.path.getmtime)
    return new[-1] if new else None


def top_temp_values(path: str, n: int) -> list[tuple[int, str, str]]:
    """(bytes, value name, shape) of the n largest values placed in the temp allocation(s)."""
    vals, in_temp = [], False
    with open(path) as f:
        for line in f:
            m = re.match(r"allocation \d+: size (\d+)(.*)", line)
            if m:
                in_temp = "temp" in m.group(2)
                continue
            if in_temp:
                v = re.search(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)", line)
                if v:
                    vals.append((int(v.group(2)), v.group(1), v.group(3)))
    return sorted(vals, reverse=True)[:n]


def arena_ops(hlo: str, arena_shape: tuple[int, int]) -> dict[str, int]:
    """Opcode -> count of ENTRY instructions whose result (or a tuple element of it) is arena-shaped."""
    pat = re.compile(rf"\b(u16|bf16)\[{arena_shape[0]},{arena_shape[1]}\]")
    inst = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")
    out: dict[str, int] = {}
    entry = hlo[hlo.find("\nENTRY"):]
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        m = inst.match(line)
        if m and pat.search(m.group(1)):
            out[m.group(2)] = out.get(m.group(2), 0) + 1
    return out


REMAT_LINES = re.compile(r"Peak memory usage of module|Can't reduce memory use|with memory limit of|"
                         r"Adjusted memory limit")


class StderrLines:
    """Collects what native code writes to fd 2 (XLA's C++ log) while the block runs, and echoes it."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        self.file = tempfile.TemporaryFile(mode="w+b")
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.lines = self.file.read().decode(errors="replace").splitlines()
        self.file.close()


def probe(fam: str, kind: str, B: int, T: int, arena_gib: float, a, arena_dtype: str = "uint16",
          prefill_backend: str = "auto") -> dict:
    cfg = _config(fam, a.small)
    model = build_random(cfg, cfg.dtype, abstract=True)
    plan = make_plan(model.decls(), page_size=16)
    rows = size_arena(plan, int(arena_gib * GIB)).num_rows
    arena = Arena.abstract(plan, rows, dtype=arena_dtype)
    width = -(-max(T, a.ctx) // 16)
    batch = _abstract_batch(plan, B, T, width)
    before = set(glob.glob(os.path.join(DUMP, "*buffer-assignment.txt")))
    print(f"--- {FAMILIES[fam]} {kind} B={B} T={T} arena {arena_gib:g} GiB {arena.data.shape} {arena_dtype}"
          f"{' prefill kernel ' + prefill_backend if kind == 'prefill' else ''}", flush=True)
    t0 = time.time()
    with StderrLines() as log:
        compiled = jax.jit(model.forward_fn(), donate_argnums=1).lower(model.params, arena, batch).compile()
    remat = [ln for ln in log.lines if REMAT_LINES.search(ln)]
    ma = compiled.memory_analysis()
    hlo = compiled.as_text()
    ops = arena_ops(hlo, arena.data.shape)
    row = dict(family=FAMILIES[fam], kind=kind, B=B, T=T, arena_gib=arena_gib, arena_dtype=arena_dtype,
               prefill_backend=prefill_backend if kind == "prefill" else None, arena_bytes=arena.nbytes,
               remat_log=remat,
               compile_s=time.time() - t0, temp_bytes=ma.temp_size_in_bytes, argument_bytes=ma.argument_size_in_bytes,
               output_bytes=ma.output_size_in_bytes, alias_bytes=ma.alias_size_in_bytes, arena_shaped_ops=ops,
               copies_of_arena=ops.get("copy", 0) + ops.get("copy-start", 0))
    ba = _newest_buffer_assignment(before)
    if ba:
        row["top_temp_values"] = [dict(bytes=s, name=nm, shape=sh) for s, nm, sh in top_temp_values(ba, a.top)]
    print(f"    temp {row['temp_bytes'] / GIB:.3f} GiB  args {row['argument_bytes'] / GIB:.2f}  out "
          f"{row['output_bytes'] / GIB:.2f}  alias {row['alias_bytes'] / GIB:.2f}  compile {row['compile_s']:.0f} s",
          flush=True)
    print(f"    arena-shaped instructions: {ops}", flush=True)
    for ln in remat:
        print(f"    xla: {ln.strip()[-200:]}", flush=True)
    for v in row.get("top_temp_values", []):
        print(f"      {v['bytes'] / 2**20:10.1f} MiB  {v['name']:<40} {v['shape']}", flush=True)
    ROWS.append(row)
    _flush()
    return row


def _flush():
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_memory_probe.json"), "w") as f:
            json.dump(ROWS, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="nemotronh,qwen35,gemma3")
    ap.add_argument("--steps", default="prefill,decode", help="comma list of prefill (B=1, T=2048), decode (B=64)")
    ap.add_argument("--arena-gib", default="2,6", help="arena sizes to compare (GiB, abstract: nothing allocated)")
    ap.add_argument("--ctx", type=int, default=2048, help="context the page tables are sized for")
    ap.add_argument("--top", type=int, default=10, help="largest temp values to list")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--no-triton-prefill", dest="triton_prefill", action="store_false",
                    help="skip the prefill compile with the Triton attention prefill kernel")
    ap.add_argument("--no-bf16-arena", dest="bf16_arena", action="store_false",
                    help="skip the prefill compile over a bfloat16 arena")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; no new compile starts past it")
    a = ap.parse_args(argv)
    silence_triton_deprecation()
    if a.small:
        a.ctx = 128
    sizes = [float(x) for x in a.arena_gib.split(",")]
    shapes = {"prefill": (1, 128 if a.small else 2048), "decode": (8 if a.small else 64, 1)}
    deadline = time.time() + a.budget
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; XLA dump in {DUMP}", flush=True)
    for fam in a.families.split(","):
        for kind in a.steps.split(","):
            B, T = shapes[kind]
            # Decode only needs one size unless asked: its in-place chain is already measured.
            # Decode needs one size (its in-place chain is the known-good reference); prefill is
            # compiled at every size, then once more over a bf16 arena (no whole-arena view for
            # the attention prefill kernel; the state kernels view it as uint16 instead).
            # The attention prefill kernel is chosen at trace time ($UMEM_JAX_PREFILL, default
            # auto: Mosaic GPU where supported); the Triton one is what bench_models ran when XLA
            # warned, so the larger size is compiled with it too.
            todo = [(g, "uint16", None) for g in (sizes if kind == "prefill" else sizes[:1])]
            if kind == "prefill" and a.triton_prefill:
                todo.append((sizes[-1], "uint16", "triton"))
            if kind == "prefill" and a.bf16_arena:
                todo.append((sizes[-1], "bfloat16", None))
            for gib, dt, backend in todo:
                if time.time() > deadline:
                    print(f"--- {FAMILIES[fam]} {kind} {gib:g} GiB {dt} skipped: --budget reached", flush=True)
                    continue
                saved = os.environ.get(PREFILL_ENV)
                try:
                    if backend:
                        os.environ[PREFILL_ENV] = backend
                    probe(fam, kind, B, T, gib, a, dt, backend or saved or "auto")
                except Exception as e:  # noqa: BLE001 - report and go on: one GPU call
                    print(f"    FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
                finally:
                    if saved is None:
                        os.environ.pop(PREFILL_ENV, None)
                    else:
                        os.environ[PREFILL_ENV] = saved
    print("\n== temp growth with the arena (prefill) ==")
    for fam in a.families.split(","):
        rs = [r for r in ROWS if r["family"] == FAMILIES[fam] and r["kind"] == "prefill"
              and r["arena_dtype"] == "uint16" and r["prefill_backend"] != "triton"]
        if len(rs) >= 2:
            d = (rs[-1]["temp_bytes"] - rs[0]["temp_bytes"]) / (rs[-1]["arena_bytes"] - rs[0]["arena_bytes"])
            print(f"{FAMILIES[fam]:<20} temp {rs[0]['temp_bytes'] / GIB:.3f} -> {rs[-1]['temp_bytes'] / GIB:.3f} GiB "
                  f"for arena {rs[0]['arena_gib']:g} -> {rs[-1]['arena_gib']:g} GiB: {d:.2f} arena copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
