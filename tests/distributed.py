"""Run a function on N local gloo ranks, with free ports and a hard timeout.

Every multi-process test goes through :func:`run_ranks`, the benchmarks' launcher
(benchmarks/_common.py): it never hangs (the processes are killed at the deadline and
the test fails with their output) and never uses a fixed port.
"""

from __future__ import annotations

import os
import sys

# benchmarks/ on sys.path: spawned ranks inherit it and import the launcher by name.
_BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from _common import free_port  # noqa: E402
from _common import launch as run_ranks

__all__ = ["free_port", "run_ranks"]
