"""Start-up progress: what a starting engine is doing, on stderr, while /health is still 503.

    with startup.reporting(StartupReport()):      # the CLI installs one; without it all is silent
        engine = LLMEngine(cfg)                   # phases: the GGUF assembled / converted (once),
                                                  # weights loaded, the engine built
        engine.warmup(8)                          # a bar of step shapes compiled, elapsed and ETA

On a terminal: a rich spinner per phase and a progress bar with elapsed and remaining time;
otherwise (logs, pipes, tests): one plain line when a phase starts and ends, and one per group
of step shapes compiled, with the ETA from the mean time per shape so far.
"""

from __future__ import annotations

import contextlib
import sys
import time

_current: list = [None]  # the installed report (None: silent)


@contextlib.contextmanager
def reporting(report):
    """Install `report` for the calls inside (phases and compilations report to it)."""
    prev, _current[0] = _current[0], report
    try:
        yield report
    finally:
        _current[0] = prev


def install(report):
    """Install `report` for the rest of the process (the CLI's serve: warm-up runs on the engine
    thread, after the start) -> report."""
    _current[0] = report
    return report


def current():
    return _current[0]


@contextlib.contextmanager
def phase(what: str):
    """One start-up phase ("loading weights ...")."""
    r = _current[0]
    if r is None:
        yield
        return
    with r.phase(what):
        yield


@contextlib.contextmanager
def compiling(total: int, what: str = "compiling step shapes"):
    """Yields advance(n, note): n more of `total` step shapes compiled; note names the last."""
    r = _current[0]
    if r is None or total <= 0:
        yield lambda n=1, note="": None
        return
    with r.compiling(total, what) as advance:
        yield advance


def _eta(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


class StartupReport:
    """Prints start-up progress to `stream` (stderr): rich when it is a terminal (live=None
    decides), plain lines otherwise."""

    def __init__(self, stream=None, live: bool | None = None, prefix: str = "umem-jax: "):
        self._stream = stream  # None: whatever sys.stderr is when a line is printed (pytest swaps it)
        self.live = self.stream.isatty() if live is None else live
        self.prefix = prefix
        self.t0 = time.perf_counter()
        self._console, self._busy = None, False
        if self.live:
            try:
                from rich.console import Console

                self._console = Console(file=self.stream)
            except ImportError:  # rich is a dependency; a bare checkout may lack it
                self.live = False

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stderr

    def line(self, text: str) -> None:
        print(f"{self.prefix}{text}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, what: str):
        t = time.perf_counter()
        if self.live and not self._busy:  # rich shows one live display at a time: inner ones print lines
            self._busy = True
            try:
                with self._console.status(what):
                    yield
            finally:
                self._busy = False
        else:
            self.line(f"{what} ...")
            yield
        self.line(f"{what}: done in {time.perf_counter() - t:.1f} s")

    @contextlib.contextmanager
    def compiling(self, total: int, what: str):
        t = time.perf_counter()
        if self.live and not self._busy:
            import rich.progress as rp

            cols = (rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                    rp.TimeElapsedColumn(), rp.TextColumn("ETA"), rp.TimeRemainingColumn(),
                    rp.TextColumn("{task.fields[note]}"))
            with rp.Progress(*cols, console=self._console) as bar:
                task = bar.add_task(what, total=total, note="")
                yield lambda n=1, note="": bar.update(task, advance=n, note=note)
        else:
            done = [0]

            def advance(n: int = 1, note: str = "") -> None:
                done[0] += n
                spent = time.perf_counter() - t
                eta = spent / done[0] * (total - done[0])
                self.line(f"{what}: {done[0]}/{total} in {_eta(spent)}, ETA {_eta(eta)}"
                          + (f" ({note})" if note else ""))

            self.line(f"{what}: 0/{total} ...")
            yield advance
        self.line(f"{what}: done in {time.perf_counter() - t:.1f} s")

    def ready(self, what: str) -> None:
        """The last line: serving, and how long the whole start took."""
        self.line(f"{what} (start-up took {_eta(time.perf_counter() - self.t0)})")


def announce_when_ready(report: StartupReport, server_engine, what: str, give_up_s: float = 60.0) -> None:
    """report.ready(what) once `server_engine` (an AsyncLLMEngine) is warm, from a daemon thread;
    nothing if it failed first, or if its engine thread is not running `give_up_s` after this."""
    import threading

    def wait() -> None:
        t0 = time.monotonic()
        while not server_engine.wait_ready(0.5):
            if server_engine.error is not None or (server_engine._thread is None
                                                   and time.monotonic() - t0 > give_up_s):
                return
        report.ready(what)

    threading.Thread(target=wait, daemon=True, name="umem-startup").start()


__all__ = ["StartupReport", "announce_when_ready", "compiling", "current", "install", "phase", "reporting"]
