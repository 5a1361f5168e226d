"""A subject script's other modes: a flag that hands the rest of the command line to another
module's main, which parses its own options (`bench_models --breakdown --help`); and the
environment a variant of one run is traced under (the kernels read their switches then)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys


def hand_over(argv, modes: dict[str, str]) -> int | None:
    """If argv (default sys.argv[1:]) holds one of `modes` (flag -> module of this package), run
    that module's main on argv without the flag and return its status; else None."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, module in modes.items():
        if flag in argv:
            argv.remove(flag)
            return importlib.import_module(f"{__package__}.{module}").main(argv)
    return None


@contextlib.contextmanager
def environment(env: dict):
    """os.environ with `env` set, restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
