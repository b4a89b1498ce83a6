"""benchmarks/pipeline.py runs end to end (``--quick``): its three tables, every row, no row
failed.

Only completion and the tables' shape are checked, never the timings: the machine the
tests run on is shared and small, and the figures belong in docs/benchmarks.md.
"""

from __future__ import annotations

import re

import pytest
from test_benchmarks import _run

pytestmark = pytest.mark.slow

#: The quick mode's profiled runs: GPipe on 2 stages, 1F1B on 4, equal and unequal, m=4.
RUNS = ("p=2 GPipe equal, m=4", "p=2 GPipe unequal, m=4", "p=4 1F1B equal, m=4", "p=4 1F1B unequal, m=4")
#: Table 2's rows: (profiled run, what-if); the finding's own m' (a row of its own, where it
#: suggests one: the count it picks depends on the host work measured) is matched apart.
WHAT_IFS = (
    ("p=2 GPipe equal, m=4", "-> 2m=8"),
    ("p=2 GPipe unequal, m=4", "-> balanced (projection.balanced_step_ms)"),
    ("p=4 1F1B equal, m=4", "-> 2m=8"),
    ("p=4 1F1B equal, m=4", "-> p'=2 (step_ms_by_stages)"),
    ("p=4 1F1B unequal, m=4", "-> balanced (projection.balanced_step_ms)"),
)
ADVICE = re.compile(r"^-> m'=(8|16|32) \(pipeline_bubble's n_microbatches\)$")


def _rows(out: str, title: str) -> list[list[str]]:
    """The body rows of the table under the line starting with ``title``, as cells."""
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(title))
    rows, seen_table = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen_table = True
            if not line.startswith("|-"):
                rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif seen_table:
            break
    return rows[1:]  # (the header)


def test_pipeline_quick_prints_its_tables():
    out = _run("pipeline.py", timeout_s=240)
    bubble = _rows(out, "1a. The bubble")
    assert [r[0] for r in bubble] == list(RUNS), out
    for row in bubble:
        assert len(row) == 9 and "failed" not in row, (row, out)
        assert 0.0 < float(row[1]) < 1.0 and 0.0 < float(row[2]) < 1.0, row
        assert re.match(r"^[+-]\d+\.\d%$", row[3]), row
        assert row[8] == "yes", row  # (bubble_fraction_theory is (p-1)/(m+p-1))
    stages = _rows(out, "1b. Each stage's waits")
    assert [r[0] for r in stages] == list(RUNS), out
    for row in stages:
        assert len(row) == 11 and "failed" not in row, (row, out)
        p = int(row[0][2])
        for cell in row[1:3] + row[4:7] + row[8:10]:
            assert len(cell.split(" / ")) == p, (cell, row)
    assert out.count("comm_source 'pipeline'") == len(RUNS), out
    what_ifs = _rows(out, "2. dtprofile's predictions")
    advice = [r for r in what_ifs if ADVICE.match(r[1])]
    assert [(r[0], r[1]) for r in what_ifs if r not in advice] == list(WHAT_IFS), out
    assert {r[0] for r in advice} <= {"p=2 GPipe equal, m=4", "p=4 1F1B equal, m=4"}, out
    for row in what_ifs:
        assert len(row) == 7 and "failed" not in row, (row, out)
        assert re.match(r"^\d+\.\d ms$", row[2]) and re.match(r"^\d+\.\d ms$", row[3]), row
        assert re.match(r"^[+-]\d+\.\d%$", row[4]), row
    assert "FAILED" not in out
