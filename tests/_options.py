"""Test options read by conftest.py and by tests alike (a test cannot import `conftest`: with
conftest files in sub-packages, that name is whichever of them Python loaded last)."""

from __future__ import annotations

import os


def long_tests_enabled(config) -> bool:
    """`--long` or UMEM_LONG_TESTS=1: run the tests marked slow."""
    return bool(config.getoption("--long")) or os.environ.get("UMEM_LONG_TESTS", "") not in ("", "0")
