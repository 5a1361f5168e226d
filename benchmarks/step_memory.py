"""Compile-only memory probe of whole-model steps: do a step's temporaries grow with the arena?

    python3 -m benchmarks.bench_models --memory-probe            # GPU, ~2 min
    python3 -m benchmarks.bench_models --memory-probe --small    # CPU, tiny shapes

Nothing is allocated: the weights and the arena are ShapeDtypeStructs, every step is only lowered
and compiled (arena donated, default kernels: Pallas on the GPU).  Per (family, step, arena size):
`memory_analysis()` (temp, argument, output, alias bytes); the arena-shaped instructions of the
optimized HLO by opcode (a `copy` or a fusion of arena shape is a whole-arena pass); and the
largest values of XLA's buffer assignment (from an XLA dump in a scratch directory).  The first
thing to read is `temp(larger arena) - temp(smaller arena)`: anything but ~0 means the arena, or a
view of it, is materialised.

XLA's rematerialization pass logs its own estimate ("Peak memory usage of module", and the
"Can't reduce memory use below ..." warning) on stderr; this probe turns that log on
(TF_CPP_VMODULE=hlo_rematerialization=1) so it lands next to the rows it belongs to.
JSON rows go to $OUT/step_memory.json (or --json).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from umem_jax.arena import Arena
from umem_jax.core.batch import Batch
from umem_jax.memory import plan as make_plan
from umem_jax.memory import size_arena
from umem_jax.models.registry import build_random
from umem_jax.pallas_kernels._compat import silence_triton_deprecation
from umem_jax.pallas_kernels.paged_prefill import PREFILL_ENV

from .families import FAMILIES, family_config
from .modes import environment
from .report import RowLog, json_path

GIB = 2**30
REMAT_LINES = re.compile(r"Peak memory usage of module|Can't reduce memory use|with memory limit of|"
                         r"Adjusted memory limit")


def configure_xla_logging() -> str:
    """Dump the step's HLO and buffer assignment, and log the rematerialization pass -> the dump
    directory.  XLA reads these when the backend starts, so this runs before any computation."""
    dump = tempfile.mkdtemp(prefix="umem_xla_dump_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=jit_forward").strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
    os.environ.setdefault("TF_CPP_VMODULE", "hlo_rematerialization=1")
    return dump


def _abstract_batch(plan, B: int, T: int, width: int) -> Batch:
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    return Batch(i32(B, T), i32(B), i32(B), {sp.name: i32(B, width) for sp in plan.token_pools}, i32(B))


def _newest_buffer_assignment(dump: str, before: set[str]) -> str | None:
    files = set(glob.glob(os.path.join(dump, "*buffer-assignment.txt")))
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


class StderrLines:
    """Collects what native code writes to fd 2 (XLA's C++ log) while the block runs."""

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


def probe(fam: str, kind: str, B: int, T: int, arena_gib: float, a, arena_dtype: str, prefill_backend: str,
          dump: str) -> dict:
    """Compile one step at one arena size -> its row (temp bytes, arena-shaped instructions, ...)."""
    name = FAMILIES[fam]["name"]
    cfg = family_config(fam, a.small)
    model = build_random(cfg, cfg.dtype, abstract=True)
    plan = make_plan(model.decls(), page_size=16)
    rows = size_arena(plan, int(arena_gib * GIB)).num_rows
    arena = Arena.abstract(plan, rows, dtype=arena_dtype)
    batch = _abstract_batch(plan, B, T, -(-max(T, a.ctx) // 16))
    before = set(glob.glob(os.path.join(dump, "*buffer-assignment.txt")))
    print(f"--- {name} {kind} B={B} T={T} arena {arena_gib:g} GiB {arena.data.shape} {arena_dtype}"
          f"{' prefill kernel ' + prefill_backend if kind == 'prefill' else ''}", flush=True)
    t0 = time.time()
    with StderrLines() as log:
        compiled = jax.jit(model.forward_fn(), donate_argnums=1).lower(model.params, arena, batch).compile()
    ma = compiled.memory_analysis()
    ops = arena_ops(compiled.as_text(), arena.data.shape)
    row = dict(family=name, kind=kind, B=B, T=T, arena_gib=arena_gib, arena_dtype=arena_dtype,
               prefill_backend=prefill_backend if kind == "prefill" else None, arena_bytes=arena.nbytes,
               remat_log=[ln for ln in log.lines if REMAT_LINES.search(ln)],
               compile_s=time.time() - t0, temp_bytes=ma.temp_size_in_bytes, argument_bytes=ma.argument_size_in_bytes,
               output_bytes=ma.output_size_in_bytes, alias_bytes=ma.alias_size_in_bytes, arena_shaped_ops=ops,
               copies_of_arena=ops.get("copy", 0) + ops.get("copy-start", 0))
    ba = _newest_buffer_assignment(dump, before)
    if ba:
        row["top_temp_values"] = [dict(bytes=s, name=nm, shape=sh) for s, nm, sh in top_temp_values(ba, a.top)]
    print(f"    temp {row['temp_bytes'] / GIB:.3f} GiB  args {row['argument_bytes'] / GIB:.2f}  out "
          f"{row['output_bytes'] / GIB:.2f}  alias {row['alias_bytes'] / GIB:.2f}  compile {row['compile_s']:.0f} s",
          flush=True)
    print(f"    arena-shaped instructions: {ops}", flush=True)
    for ln in row["remat_log"]:
        print(f"    xla: {ln.strip()[-200:]}", flush=True)
    for v in row.get("top_temp_values", []):
        print(f"      {v['bytes'] / 2**20:10.1f} MiB  {v['name']:<40} {v['shape']}", flush=True)
    return row


def compiles(kind: str, sizes: list[float], a) -> list[tuple[float, str, str | None]]:
    """(arena GiB, arena dtype, prefill backend) to compile for one step kind.

    Decode needs one size (its in-place chain is the known-good reference); prefill is compiled at
    every size, then at the larger size with the Triton attention prefill kernel (the kernel is
    chosen at trace time from $UMEM_JAX_PREFILL) and once more over a bf16 arena (no whole-arena
    view for the attention prefill kernel; the state kernels view it as uint16 instead)."""
    todo = [(g, "uint16", None) for g in (sizes if kind == "prefill" else sizes[:1])]
    if kind == "prefill" and a.triton_prefill:
        todo.append((sizes[-1], "uint16", "triton"))
    if kind == "prefill" and a.bf16_arena:
        todo.append((sizes[-1], "bfloat16", None))
    return todo


def probe_with_backend(fam, kind, B, T, gib, a, dtype, backend, dump, log: RowLog) -> None:
    label = backend or os.environ.get(PREFILL_ENV) or "auto"
    try:
        with environment({PREFILL_ENV: backend} if backend else {}):
            log.add(probe(fam, kind, B, T, gib, a, dtype, label, dump))
    except Exception as e:  # noqa: BLE001 - report and go on: one GPU call
        print(f"    FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)


def print_growth(families: list[str], rows: list[dict]) -> None:
    print("\n== temp growth with the arena (prefill) ==")
    for fam in families:
        name = FAMILIES[fam]["name"]
        rs = [r for r in rows if r["family"] == name and r["kind"] == "prefill"
              and r["arena_dtype"] == "uint16" and r["prefill_backend"] != "triton"]
        if len(rs) >= 2:
            d = (rs[-1]["temp_bytes"] - rs[0]["temp_bytes"]) / (rs[-1]["arena_bytes"] - rs[0]["arena_bytes"])
            print(f"{name:<20} temp {rs[0]['temp_bytes'] / GIB:.3f} -> {rs[-1]['temp_bytes'] / GIB:.3f} GiB "
                  f"for arena {rs[0]['arena_gib']:g} -> {rs[-1]['arena_gib']:g} GiB: {d:.2f} arena copies")


def parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_models --memory-probe",
                                 description=__doc__.split("\n")[0])
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
    ap.add_argument("--json", default=None, help="rows here (default $OUT/step_memory.json if $OUT is set)")
    a = ap.parse_args(argv)
    if a.small:
        a.ctx = 128
    return a


def main(argv=None) -> int:
    a = parse(argv)
    dump = configure_xla_logging()
    silence_triton_deprecation()
    sizes = [float(x) for x in a.arena_gib.split(",")]
    shapes = {"prefill": (1, 128 if a.small else 2048), "decode": (8 if a.small else 64, 1)}
    deadline = time.time() + a.budget
    families = a.families.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; XLA dump in {dump}", flush=True)
    log = RowLog(json_path(a.json, "step_memory"), jax=jax.__version__, device=jax.devices()[0].device_kind)
    for fam in families:
        for kind in a.steps.split(","):
            B, T = shapes[kind]
            for gib, dtype, backend in compiles(kind, sizes, a):
                if time.time() > deadline:
                    print(f"--- {FAMILIES[fam]['name']} {kind} {gib:g} GiB {dtype} skipped: --budget reached",
                          flush=True)
                    continue
                probe_with_backend(fam, kind, B, T, gib, a, dtype, backend, dump, log)
    print_growth(families, log.rows)
    return 0
