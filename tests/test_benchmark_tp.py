"""benchmarks/tensor_parallel.py runs end to end (``--quick``): both tables, every row,
no row failed.

Only completion and the tables' shape are checked, never the timings: the machine the
tests run on is shared and small, and the figures belong in docs/benchmarks.md.
"""

from __future__ import annotations

import re

import pytest
from test_benchmarks import _row, _run

pytestmark = pytest.mark.slow

ROWS_1 = (
    "TP collectives per step",
    "TP bytes per step (MB)",
    "TP comm total (launch to end of wait)",
    "TP comm waited (exposed)",
    "of it launched in forward",
    "of it launched in backward",
    "TP comm total vs the link alone",
    "exposed comm (per_step_ms.comm_exposed)",
    "forward compute",
    "forward compute vs plain layers",
    "backward compute",
    "backward compute vs plain layers",
    "optimizer",
    "step",
)
ROWS_2 = (
    "tp=2, 1 replica -> tp=1, 1 device",
    "tp=2, 1 replica -> 2 replicas",
    "tp=2, 1 replica -> 2 replicas, --bandwidth loopback",
    "dp=2 x tp=2 -> 1 replica",
)


def _cells(out: str, label: str) -> list[str]:
    line = next(x for x in out.splitlines() if re.match(r"^\|\s*" + re.escape(label) + r"\s*\|", x))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_tensor_parallel_quick_prints_both_tables():
    out = _run("tensor_parallel.py", timeout_s=240)
    assert "1. TP communication and compute per step" in out
    assert "2. The projection's what-if against a measured run" in out
    for label in ROWS_1 + ROWS_2:
        assert _row(out, label), (label, out)
        cells = _cells(out, label)
        assert len(cells) == 5, (label, cells)
        assert "failed" not in cells[1:3], (label, cells)
    # Table 1: dtprofile found the 2 all-reduces of a step, with their bytes.
    assert _cells(out, "TP collectives per step")[1:3] == ["2.0", "2.0"], out
    for label in ROWS_2:
        assert re.match(r"^[+-]\d+\.\d%$", _cells(out, label)[3]), (label, out)
    assert "comm_source 'dtensor'" in out
    assert "('tp', 2, 'tp')" in out and "('dp', 2, 'fsdp')" in out
    assert "axis 'replicas'" in out
    assert "FAILED" not in out
