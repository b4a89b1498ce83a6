"""Loader advice that holds when followed: profile a data-bound run, apply the advice, re-run.

Two datasets whose batches take the same time to load: one waits (a sleep, as storage
or a remote service does), one computes (a busy loop on the CPU, as decoding and
augmentation do). Each starts with the main process loading (``num_workers=0``).
dtprofile measures the loader's CPU time per batch, recommends ``num_workers`` and
predicts the step with it (``recommendations.num_workers_step_ms``); the run is then
repeated with that many workers and its step measured. Compute is a fixed CPU busy
loop in the training process (one thread), so the machine's cores are shared the way
a real run shares them.

A table of predicted against measured step per dataset is printed (and ``--json``
prints it as JSON). Run from the repository root::

    python benchmarks/loader_advice.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, machine, rel_err, table  # noqa: E402

import dtprofile  # noqa: E402

LOAD_MS = 24.0  # a batch's time to load, on both datasets
COMPUTE_MS = 10.0  # the training step's own work, a CPU busy loop
TARGET_REL_ERR = 0.10


def _spin(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


class LoadTime(Dataset):
    """Batches (of one item) that take LOAD_MS to load: waiting ("io") or computing ("cpu")."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n = kind, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "io":
            time.sleep(LOAD_MS / 1e3)
        else:
            _spin(LOAD_MS)
        return torch.full((16,), float(i % 7)), torch.tensor(i % 2)


def train(kind: str, workers: int, steps: int) -> tuple[dict, float]:
    """``steps`` steps under dtprofile; the summary and the median measured step (ms)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(LoadTime(kind, steps + 8), batch_size=None, num_workers=workers,
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    times = []
    with dtprofile.profile(model, opt, warmup_steps=5, every_n_steps=10_000) as prof:
        last = time.perf_counter()
        for i, (x, y) in enumerate(prof.loader(loader)):
            _spin(COMPUTE_MS)
            nn.functional.cross_entropy(model(x.unsqueeze(0)), y.unsqueeze(0)).backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            times.append((now - last) * 1e3)
            last = now
            if i + 1 == steps:
                break
    return prof.report().to_dict(), statistics.median(times[5:])


def run(steps: int) -> list[dict]:
    rows = []
    for kind in ("io", "cpu"):
        summary, step0 = train(kind, 0, steps)
        rec = summary["recommendations"]
        workers, predicted = rec["num_workers"], rec["num_workers_step_ms"]
        loader = summary["run"]["cpu_time"] or {}
        after = None
        if workers:
            _, after = train(kind, int(workers), steps)
        rows.append({"dataset": kind, "step_ms_before": step0, "loader_kind": rec["loader_kind"],
                     "loader_cpu_share": rec["loader_cpu_share"], "fetch_cpu_ms": loader.get("fetch_cpu_ms"),
                     "training_cpu_cores": loader.get("training_cpu_cores"),
                     "cpus_per_rank": summary["run"]["cpus_per_rank"], "num_workers": workers,
                     "predicted_step_ms": predicted, "measured_step_ms": after,
                     "rel_err": rel_err(predicted, after)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about 20 s)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # More workers than cores is the point for the waiting loader: not a mistake here.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    rows = run(60 if args.quick else 150)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(describe_machine(machine()))
    print(table(["dataset", "before ms", "kind (CPU share)", "advice", "predicted ms", "measured ms", "error"],
                [[r["dataset"], f"{r['step_ms_before']:.1f}",
                  f"{r['loader_kind']} ({r['loader_cpu_share']:.2f})" if r["loader_cpu_share"] is not None
                  else str(r["loader_kind"]),
                  f"num_workers={r['num_workers']}", f"{r['predicted_step_ms']:.1f}" if r["predicted_step_ms"] else "n/a",
                  f"{r['measured_step_ms']:.1f}" if r["measured_step_ms"] else "n/a",
                  f"{r['rel_err']:+.1%}" if r["rel_err"] is not None else "n/a"] for r in rows],
                title=f"Loader advice followed: {LOAD_MS:.0f} ms to load a batch, {COMPUTE_MS:.0f} ms of compute"))
    ok = all(r["rel_err"] is not None and abs(r["rel_err"]) <= TARGET_REL_ERR for r in rows)
    print(f"\nTarget: predicted within {TARGET_REL_ERR:.0%} of measured: {'met' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
