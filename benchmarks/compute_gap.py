"""What a pause between steps costs a CPU's compute, with no profiler and no communication.

A synchronised DDP step waits for its all-reduce; the next forward starts after that
pause. A step under ``no_sync()``, or a one-process run, starts its forward right after
the last optimizer step. On a CPU that difference alone changes the compute: the
weights the last step left in the caches are gone after a pause (other work on the
machine, a neighbour on a shared host, the kernel's own). This script measures it on
the cluster bench's models (``benchmarks/cluster_train.py``), one process, one thread:
the same steps back to back, after a sleep (the process idles, as while waiting on the
network) and after a busy loop (the core stays busy with other work), in interleaved
rounds.

It is the ground truth behind two figures of the cluster bench with real CPU compute:
T_C (measured in the synchronised steps, which follow a pause) against a no-sync step
(back to back), and the projected one-node step against a one-node run (back to back).
Run from the repository root::

    python benchmarks/compute_gap.py [--quick] [--pause-ms 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, machine, table  # noqa: E402
from cluster_train import make_model  # noqa: E402

MODES = ("back to back", "after a sleep", "after a busy loop")
PHASES = ("forward", "backward", "optimizer", "step")


def _pause(mode: str, seconds: float) -> None:
    if mode == "after a sleep":
        time.sleep(seconds)
    elif mode == "after a busy loop":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def _segment(
    model: nn.Module, opt: torch.optim.Optimizer, batch: tuple, mode: str, steps: int, pause_s: float
) -> list[tuple[float, ...]]:
    """``steps`` training steps, each after ``mode``'s pause: (forward, backward,
    optimizer, step) in ms, the pause left out."""
    x, y = batch
    out = []
    for _ in range(steps):
        _pause(mode, pause_s)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        out.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t3 - t0) * 1e3))
    return out


def measure(model_name: str, rounds: int, steps: int, skip: int, pause_ms: float, batch_size: int = 8) -> dict:
    """Median phases per mode: {mode: {phase: ms}}."""
    torch.manual_seed(0)
    model, features, classes = make_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(batch_size, features, generator=g), torch.randint(0, classes, (batch_size,), generator=g))
    times: dict[str, list] = {m: [] for m in MODES}
    for r in range(rounds):
        k = r % len(MODES)
        for mode in MODES[k:] + MODES[:k]:
            times[mode].extend(_segment(model, opt, batch, mode, steps, pause_ms / 1e3)[skip:])
    return {m: {p: statistics.median(v[i] for v in times[m]) for i, p in enumerate(PHASES)} for m in MODES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    ap.add_argument(
        "--pause-ms",
        type=float,
        default=40.0,
        help="the pause before each step in ms (default 40: a synchronised step's wait on a slow link)",
    )
    ap.add_argument("--models", default="comm_heavy,medium", help="cluster_train.py models (default comm_heavy,medium)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON, not a table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rounds, steps, skip = (1, 6, 2) if args.quick else (4, 30, 5)
    results = {name: measure(name, rounds, steps, skip, args.pause_ms) for name in args.models.split(",")}
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(describe_machine(machine()))
    rows = []
    for name, by_mode in results.items():
        base = by_mode[MODES[0]]
        for mode in MODES:
            ms = by_mode[mode]
            rows.append([name, mode] + [f"{ms[p]:.2f}" for p in PHASES] + [f"{ms['step'] / base['step']:.3f}"])
    print(
        table(
            [
                "model",
                "before each step",
                "forward ms",
                "backward ms",
                "optimizer ms",
                "step ms",
                "step vs back to back",
            ],
            rows,
            title=f"One process, one thread, no profiler; pause {args.pause_ms:g} ms, left out of the step",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
