"""XLA's C++ log kept quiet while steps compile: two of its messages are false alarms here.

    with quiet_xla_alarms():          # warm-up, and a launch whose step shape is new
        step(...)                     # compiles; a failed compile still raises in Python
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def quiet_xla_alarms(enabled: bool = True):
    """XLA's C++ log at FATAL only while steps compile (warm-up, or a launch of a step shape not
    compiled yet); a failed compile still raises in Python.
    The level before ($TF_CPP_MIN_LOG_LEVEL, else 0) is restored after.  A no-op where jaxlib
    lacks the setter.  Two false alarms it keeps off the console:

    * CPU: "Very slow compile? ... file a bug", an ERROR log for any compile over 2 minutes of
      wall time, which a real model's step on two cores can take.
    * GPU: "Can't reduce memory use below X by rematerialization; only reduced to 3 x arena".
      XLA's rematerialization pass counts the donated arena three times (the parameter, the
      in-place kernels' aliased outputs, the module output), while buffer assignment places it
      once: a compiled step's temp bytes do not grow with the arena and its alias bytes equal it
      (benchmarks/RESULTS.md, session 8: bench_models --memory-probe), and a 90 GiB arena serves
      on a 141 GB H200.  The warning is harmless for memory."""
    try:
        from jaxlib import utils
        set_level = utils.absl_set_min_log_level
    except (ImportError, AttributeError):
        set_level = None
    if not enabled or set_level is None:
        yield
        return
    set_level(3)
    try:
        yield
    finally:
        set_level(int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") or 0))


__all__ = ["quiet_xla_alarms"]
