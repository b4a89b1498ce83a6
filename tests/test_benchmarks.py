"""The benchmark scripts run end to end (``--quick``) and print every row.

Only completion and the row labels are checked, never the timings: the machine the
tests run on is shared and small, and the figures belong in docs/benchmarks.md, not in asserts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, timeout_s: float) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=BENCH.parent,
    )
    assert proc.returncode == 0, (
        f"{script} --quick exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc.stdout


def _row(out: str, *cells: str) -> bool:
    """A Markdown table row whose first cells are ``cells`` (padding ignored)."""
    pattern = r"^\|\s*" + r"\s*\|\s*".join(re.escape(c) for c in cells) + r"\s*\|"
    return re.search(pattern, out, flags=re.MULTILINE) is not None


def test_overhead_quick_prints_every_row():
    out = _run("overhead.py", timeout_s=400)
    assert "machine: 2 cores" in out or "machine:" in out
    plain = ("none", "dtprofile", "torch.profiler schedule", "torch.profiler always-on")
    lightning = ("Lightning, no callback", "Lightning + DTProfileCallback", "Lightning + SimpleProfiler")
    for case in ("5ms", "50ms"):
        for setting in ("1 process", "2 processes (DDP)"):
            for profiler in plain:
                assert _row(out, setting, case, profiler), (setting, case, profiler, out)
        for profiler in ("none", "dtprofile"):
            for setting in ("2 processes (FSDP2)", "2 processes (HSDP)"):
                assert _row(out, setting, case, profiler), (setting, case, profiler, out)
        for profiler in lightning:
            assert _row(out, "Lightning, 1 process", case, profiler), (case, profiler, out)
    for profiler in (
        plain
        + lightning
        + ("dtprofile, CUDA-event path (CPU twin)", "empty hooks, no profiler", "timestamps only, no profiler")
    ):
        assert _row(out, profiler), (profiler, out)  # the memory table
    assert "RSS growth MB" in out
    for profiler in ("none", "dtprofile"):
        assert _row(out, "2 processes (DDP)", profiler), (profiler, out)  # a fast DDP step's cost
    assert "failed" not in out
    for setting in (
        "1 process",
        "2 processes (DDP)",
        "2 processes (FSDP2)",
        "2 processes (HSDP)",
        "Lightning, 1 process",
    ):
        for case in ("5ms", "50ms"):
            assert f"  {setting}, {case}: " in out  # the target lines
    # Left on for the whole run: each shape, 1 and 2 processes, against no comm hook at all.
    for shape in ("GPU-like", "small buckets"):
        for setting in ("1 process", "2 processes (DDP)"):
            for profiler in (
                "no profiler",
                "dtprofile",
                "dtprofile, bucket_timing_every=20",
                "dtprofile, bucket_timing_every=0",
                "allreduce_hook, no profiler",
                "bare batched hook, no profiler",
                "C++ allreduce hook, no profiler",
            ):
                assert _row(out, shape, setting, profiler), (shape, setting, profiler, out)
        for profiler in ("no profiler", "dtprofile", "dtprofile, bucket_timing_every=20"):
            assert _row(out, shape, "2 processes (DDP, find_unused_parameters=True)", profiler), (shape, profiler, out)
    assert "Target (dtprofile against no profiler): GPU-like <= 1.005, small buckets <= 1.05" in out


def test_the_timestamps_only_floor_marks_each_phase_of_a_step_in_order():
    """The memory table's floor row: each hook of a step takes one timestamp, in the
    step's order, and the optimizer's step moves them out (the list stays bounded);
    backward's start and end on every ``backward_every``-th step (by default every 50th,
    as dtprofile times them on steps this short)."""
    import torch
    from torch import nn

    sys.path.insert(0, str(BENCH))
    try:
        import overhead
    finally:
        sys.path.remove(str(BENCH))
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    marks: list[float] = []
    handles = overhead._empty_hooks(model, opt, marks, backward_every=5)
    batches = overhead._marked_batches([(torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))] * 12, marks)
    try:
        for i, (x, y) in enumerate(batches):
            assert len(marks) == 2 and marks[0] >= 0 and marks[1] >= 0  # the fetch's wall and CPU time
            nn.functional.cross_entropy(model(x), y).backward()
            # Forward's start and end, then (every 5th step) backward's start and end.
            assert len(marks) == (6 if i % 5 == 0 else 4) and marks[2:] == sorted(marks[2:])
            opt.step()
            assert marks == []  # the step's marks kept as a row
            opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()


def test_the_cuda_event_twin_takes_the_device_path_and_its_steady_lane(monkeypatch):
    """The memory table's CPU twin of the CUDA-event clock: dtprofile runs its device
    path (the steps' events read from pending), its steady lane included, and the
    figures come out; the clock of later profilers is the host's again."""
    import torch
    from torch import nn

    import dtprofile
    from dtprofile import engine

    sys.path.insert(0, str(BENCH))
    try:
        import overhead
    finally:
        sys.path.remove(str(BENCH))
    started = []
    profile = dtprofile.profile
    monkeypatch.setattr(dtprofile, "profile", lambda *a, **k: started.append(profile(*a, **k)) or started[-1])
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 8), torch.tensor([0, 1, 0, 1]))
    times = overhead._plain_segment(overhead.DEVICE_TWIN, model, opt, batch, 80, None)
    assert len(times) == 80
    prof = started[0]
    summary = prof.report().to_dict()
    assert summary["timing"] == "cuda_event" and summary["steps_profiled"] > 60, summary
    assert prof._engine.steps.lane.steps_taken > 60
    assert engine.make_clock(torch.device("cpu")).kind == "perf_counter"


def test_fidelity_quick_prints_every_row():
    out = _run("fidelity.py", timeout_s=300)
    for label in (
        "data wait (prof.loader)",
        "data wait (gap, no prof.loader)",
        "exposed comm, wait-based",
        "exposed comm, probe-based (probe_every=4)",
        "comm total vs DDP avg_backward_comm_time",
        "comm total vs torch.profiler gloo:all_reduce union",
        "comm total vs torch.profiler gloo:all_reduce sum",
        "comm total from probe steps vs DDP avg_backward_comm_time",
        "projected 1-process step (sync run)",
        "projected 1-process step (probe run)",
        "advice: speedup from num_workers",
        "advice: data wait after applying it",
        "compute T_C, wait-based (sync run)",
        "compute T_C, probe-based (probe_every=4)",
    ):
        assert _row(out, label), (label, out)
    assert "rel. error" in out
    assert "A compute-bound run" in out and _row(out, "conv, batch 32, 16 steps"), out


def test_loader_advice_quick_prints_both_datasets():
    out = _run("loader_advice.py", timeout_s=240)
    for dataset in ("io 24/10 ms", "cpu 24/10 ms"):
        assert _row(out, dataset), (dataset, out)
    assert "Target: predicted within 10% of measured: " in out


def test_compute_gap_quick_prints_every_model_and_pause():
    out = _run("compute_gap.py", timeout_s=120)
    for model in ("comm_heavy", "medium"):
        for mode in ("back to back", "after a sleep", "after a busy loop"):
            assert _row(out, model, mode), (model, mode, out)


def test_probe_checks_quick_prints_the_table_with_finite_figures():
    out = _run("probe_checks.py", timeout_s=180)
    assert "machine:" in out
    for shape in ("GPU-like", "small buckets", "comm-heavy MLP"):
        match = re.search(r"^\|\s*" + re.escape(shape) + r"\s*\|(.*)\|\s*$", out, flags=re.MULTILINE)
        assert match, (shape, out)
        cells = [c.strip() for c in match.group(1).split("|")]
        # gradients MB, probe steps (+ alone), ordinary ms, probe ms, any_flag ms (calls), same_value ms,
        # fingerprint ms, sum ms, % of probe step, share of a run
        assert len(cells) == 10, (shape, cells)
        probes = re.fullmatch(r"(\d+) \(\+(\d+)\)", cells[1])
        assert probes and int(probes.group(1)) >= 1, (shape, cells)
        numbers = [
            cells[0],
            *cells[2:4],
            cells[4].split(" ")[0],
            *cells[5:8],
            cells[8].rstrip("%"),
            cells[9].rstrip("%"),
        ]
        for cell in numbers:
            value = float(cell)  # ("n/a" fails here)
            assert value == value and abs(value) != float("inf") and value >= 0, (shape, cell, cells)
        for call in (
            "any_flag: plain pass? (shape)",
            "same_value (the fingerprints compared)",
            "_fingerprint (float32 sums, to the host)",
        ):
            assert _row(out, shape, call), (shape, call, out)
    assert "PROBES STOPPED" not in out


def test_repeatability_quick_prints_the_run_and_summary_tables():
    """The tables' shape, and each run pooling the condition's earlier runs (whether the
    verdicts agree depends on the machine)."""
    out = _run("repeatability.py", timeout_s=240)
    assert "machine:" in out
    for condition in ("Quiet", "Loaded"):
        assert re.search(rf"^{condition}, pooled \(", out, flags=re.MULTILINE), (condition, out)
    header = re.search(r"^\|\s*run\s*\|.*$", out, flags=re.MULTILINE)
    assert header, out
    for column in ("step ms [range]", "R_O [range]", "verdict", "gpus", "gpus_range"):
        assert column in header.group(0), (column, header.group(0))
    for run in ("1", "2"):
        # run, step, R_O, comm_fraction, efficiency, verdict, other findings, gpus, gpus_range, pooled, wall, load
        rows = re.findall(r"^\|\s*" + run + r"\s*\|(.*)\|\s*$", out, flags=re.MULTILINE)
        assert len(rows) == 2, (run, out)  # one a condition
        for row in rows:
            cells = [c.strip() for c in row.split("|")]
            assert len(cells) == 11 and cells[0] != "failed", (run, cells)
            assert cells[8] == str(int(run) - 1), cells  # the earlier runs of the condition pooled
            assert re.fullmatch(r"[0-9.]+ \[[0-9.]+, [0-9.]+\]", cells[0]), cells  # the step with its range
            assert re.fullmatch(r"[a-z_]+( \([a-z]+\))?", cells[4]), cells  # the verdict's id
            assert re.fullmatch(r"\d+", cells[6]) and re.fullmatch(r"\[\d+, \d+\]", cells[7]), cells
    for condition in ("quiet pooled", "loaded pooled", "both pooled"):
        assert _row(out, condition), (condition, out)
    assert "gpus_range overlap" in out and "intersection" in out
    assert "0 failed" in out
