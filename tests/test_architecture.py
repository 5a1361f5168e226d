"""The package's shape: imports form a DAG that only points down the layer order, and files and
functions stay small enough to read.

The layer order (docs/architecture.md draws it): the applications on top, then
api -> engine -> scheduler -> runner -> models -> arena, and under them the host-side memory
policy, the kernels, the tp mesh and the shared vocabulary (core), none of which import each
other.  Every import counts, including the ones inside functions: a lazy import that closes a
circle is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "umem_jax"

# Highest first; a module may import only modules of its own unit or of a unit further down.
LAYERS = ["__main__", "cli", "demo", "arena_demo", "bench", "disagg", "api", "engine", "scheduler", "runner", "models",
          "arena", "memory", "pallas_kernels", "parallel", "core"]
KERNELS = "pallas_kernels"  # kernel bodies are exempt from the size limits
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of umem_jax that `name` imports anywhere in its body (resolved to modules)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = base[:len(base) - (node.level - 1)]
                mod = ".".join(root + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _unit(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root (the lazy public facade)


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {None}
    assert units <= set(LAYERS), f"place these in LAYERS (and docs/architecture.md): {sorted(units - set(LAYERS))}"


def test_imports_point_down_the_layers():
    rank = {u: i for i, u in enumerate(LAYERS)}
    bad = []
    for mod, deps in _graph().items():
        u = _unit(mod)
        if u is None:
            continue
        for d in deps:
            v = _unit(d)
            if v is None:
                bad.append(f"{mod} -> {d} (the package root is the facade, not a layer)")
            elif v != u and rank[v] <= rank[u]:
                bad.append(f"{mod} -> {d} ({u} may not import {v})")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _sizes():
    for mod, path in _modules().items():
        if _unit(mod) == KERNELS:
            continue
        src = path.read_text()
        yield mod, path, src


@pytest.mark.parametrize("limit", [MAX_FILE_LINES])
def test_files_are_short(limit):
    long = [f"{m}: {src.count(chr(10))} lines" for m, _, src in _sizes() if src.count("\n") > limit]
    assert not long, f"split these along the architecture (> {limit} lines):\n" + "\n".join(long)


@pytest.mark.parametrize("limit", [MAX_FUNCTION_LINES])
def test_functions_are_short(limit):
    long = []
    for mod, _, src in _sizes():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{mod}.{node.name} (line {node.lineno}): {n} lines")
    assert not long, f"functions over {limit} lines:\n" + "\n".join(long)
