"""What a benchmark leaves behind: its rows as JSON (rewritten after every row) and its tables.

    log = RowLog(json_path(args.json, "bench_kernels"), jax=jax.__version__, device=...)
    log.add(dict(name="decode", us=275.0))          # the JSON on disk now holds this row
    print(format_table(["name", "us"], [["decode", "275.0"]]))

A run on the GPU is one call with a time limit; writing the file after every row means a run cut
short still leaves every number it measured.
"""

from __future__ import annotations

import json
import os


def json_path(explicit: str | None, name: str) -> str | None:
    """--json if given, else $OUT/<name>.json when $OUT is set (the device machine's output folder)."""
    if explicit:
        return str(explicit)
    return os.path.join(os.environ["OUT"], f"{name}.json") if os.environ.get("OUT") else None


class RowLog:
    """Rows of one run, with the run's metadata, written to `path` as {**meta, "rows": [...]}."""

    def __init__(self, path: str | None, **meta):
        self.path, self.meta, self.rows = path, dict(meta), []

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.flush()
        return row

    def flush(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(dict(self.meta, rows=self.rows), f, indent=1, default=str)


def fmt(x, spec: str) -> str:
    """format(x, spec), or "-" for a missing number."""
    return "-" if x is None else format(x, spec)


def format_table(header: list[str], rows: list[list], *, left: int = 1) -> str:
    """Columns padded to their widest cell, two spaces apart; the first `left` columns are
    left-aligned (names), the rest right-aligned (numbers)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in cells)


__all__ = ["RowLog", "fmt", "format_table", "json_path"]
