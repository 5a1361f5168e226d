"""Progress: a rich progress bar of finished requests, or nothing when switched off."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def progress_bar(total: int, label: str, enabled: bool = True):
    """Yields `advance(n, **fields)`; with enabled=False, output not to a terminal (logs of a GPU
    call) or without rich it does nothing.  The bar is transient: it leaves the terminal clean
    for the tables printed after."""
    if not enabled or not sys.stdout.isatty():
        yield lambda n=1, **kw: None
        return
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # rich is a dependency, but the GPU machine may run from a bare checkout
        yield lambda n=1, **kw: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[note]}"), transient=True) as bar:
        task = bar.add_task(label, total=total, note="")
        yield lambda n=1, **kw: bar.update(task, advance=n, **kw)


__all__ = ["progress_bar"]
