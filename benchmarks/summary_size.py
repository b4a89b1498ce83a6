"""What the summary, the report, the scalars and the tab cost at many ranks.

    python benchmarks/summary_size.py            # 64, 256, 1024 and 4096 ranks
    python benchmarks/summary_size.py --quick    # 64 and 256 (the test suite runs this)

Synthetic ranks' rows (40 ms of compute, 3 ms of exposed communication and 2 ms of data
wait a step, 2% of noise, 32 steps cut into 8 blocks, 8 ranks a host, each rank's host
named as rank 0 reads them at stop, one node 20% slower) go
through the same code path as a real run's rows on rank 0 at stop: ``build_summary``
with its intervals, the terminal report, the Markdown, the TensorBoard scalars and the
tab's run view. Printed per rank count: each one's time, the summary's JSON size, the
report's lines, the Markdown's size, the scalars written per log interval, and the
ranks the tab draws a bar for; and whether the slow node was named, by its host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from _common import describe_machine, machine, table  # noqa: E402

from dtprofile.capture.windows import FIELDS, averages, block_averages  # noqa: E402
from dtprofile.dashboard.views import run_view  # noqa: E402
from dtprofile.options import Options  # noqa: E402
from dtprofile.render.markdown import advice_markdown  # noqa: E402
from dtprofile.render.terminal import format_report  # noqa: E402
from dtprofile.sinks.tags import scalars_from_summary  # noqa: E402
from dtprofile.summary import build_summary, rank_row  # noqa: E402

PER_NODE = 8
STEPS = 32


def host_of(rank: int) -> str:
    """The synthetic rank's host (a long name, as clusters' are: the summary's size counts it)."""
    return f"gpu-node-{rank // PER_NODE:04d}.cluster.example.com"


def rows_for(world: int, slow_node: int, hosts: bool = True) -> list[dict]:
    """``world`` ranks' rows, each with its host (``hosts``, as rank 0 reads them at stop)."""
    rng = np.random.default_rng(world)
    rows = []
    for rank in range(world):
        slow = 1.2 if rank // PER_NODE == slow_node else 1.0
        compute = 40.0 * slow * np.exp(rng.normal(0, 0.02, STEPS))
        t = np.full((STEPS, len(FIELDS)), np.nan)
        for name, values in dict(
            step=compute + 5.0,
            compute=compute,
            comm_exposed=np.full(STEPS, 3.0),
            comm_total=np.full(STEPS, 8.0),
            data_wait=np.full(STEPS, 2.0),
            overhead=np.full(STEPS, 5.0),
            forward=compute / 3,
            backward=2 * compute / 3,
            optimizer=np.zeros(STEPS),
            comm_buffers=np.zeros(STEPS),
            grad_bytes=np.full(STEPS, 50e6),
        ).items():
            t[:, FIELDS.index(name)] = values
        rows.append(rank_row(rank, STEPS, averages(t), 0, {}, blocks=block_averages(t, 8)))
        if hosts:
            rows[-1]["host"] = host_of(rank)
    return rows


def measure(world: int) -> list:
    slow_node = world // PER_NODE // 2
    rows = rows_for(world, slow_node)
    meta = {
        "world_size": world,
        "device": "cuda",
        "device_name": "synthetic",
        "backend": "nccl",
        "steps_total": STEPS,
        "data_wait_source": "loader",
        "comm_source": "dtprofile",
        "timing": "cuda_event",
        "run": {"batch_size": 16, "micro_batches": 1, "ranks_per_host": PER_NODE},
    }
    t0 = time.perf_counter()
    summary = build_summary(rows, meta, Options())
    t_summary = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = format_report(summary)
    t_report = time.perf_counter() - t0
    markdown = advice_markdown(summary)
    tags = scalars_from_summary(summary)
    text = json.dumps(dict(summary, schema="dtprofile.summary/1", complete=True))
    with tempfile.TemporaryDirectory() as logdir:
        os.mkdir(os.path.join(logdir, "run"))
        with open(os.path.join(logdir, "run", "dtprofile_summary.json"), "w") as f:
            f.write(text)
        t0 = time.perf_counter()
        view = run_view(logdir, "run")
        t_tab = time.perf_counter() - t0
    straggler = next((f for f in summary["advice"] if f["id"] == "straggler"), None)
    node = straggler["evidence"].get("node") or {} if straggler is not None else {}
    named = node.get("node") == slow_node and node.get("host") == host_of(slow_node * PER_NODE)
    return [
        world,
        f"{t_summary:.2f}",
        summary["uncertainty"]["ranks_drawn"],
        f"{len(text) / 1e3:.0f}",
        f"{t_report * 1e3:.1f}",
        len(report.splitlines()),
        f"{len(markdown) / 1e3:.1f}",
        len(tags),
        f"{t_tab:.2f}",
        len(view["step"]["ranks"]),
        "yes" if named else "no",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 and 256 ranks only")
    ap.add_argument("--ranks", default=None, help="comma-separated rank counts (default 64,256,1024,4096)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in (args.ranks or ("64,256" if args.quick else "64,256,1024,4096")).split(",")]
    print(describe_machine(machine()))
    rows = [measure(n) for n in counts]
    print(
        table(
            [
                "ranks",
                "summary s",
                "ranks drawn",
                "JSON kB",
                "report ms",
                "report lines",
                "Markdown kB",
                "scalars",
                "tab s",
                "tab bars",
                "slow node named",
            ],
            rows,
            title="The summary and what reads it, on rank 0 at stop",
        )
    )
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
