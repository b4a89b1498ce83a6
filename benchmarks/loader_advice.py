"""Loader advice that holds when followed: profile a data-bound run, apply the advice, re-run.

Datasets whose batches wait (a sleep, as storage or a remote service does), compute (a
busy loop on the CPU, as decoding and augmentation do), or do half of each. The default
run takes two of them, each starting with the main process loading
(``num_workers=0``): 24 ms to load a batch beside 10 ms of training compute. The full
run adds other load and compute times, batches of several samples, and runs that
start with workers already. dtprofile measures the loader's CPU time per batch,
recommends ``num_workers`` and predicts the step with it
(``recommendations.num_workers_step_ms``); the run is then repeated with that many
workers and its step measured: the mean over the steps after warm-up, the pace the run
trains at (with several workers, batches arrive in bursts and a median step says
little). Compute is a fixed CPU busy loop in the training process (one thread), so the
machine's cores are shared the way a real run shares them.

A table of predicted against measured step per case is printed (and ``--json`` prints
it as JSON). Run from the repository root::

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
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, machine, rel_err, table  # noqa: E402

import dtprofile  # noqa: E402

TARGET_REL_ERR = 0.10
WARMUP_STEPS = 5


@dataclass(frozen=True)
class Case:
    """One dataset and loop: what a batch costs to load, and the loop's own work."""

    kind: str  # "io" (waits), "cpu" (computes), "mixed" (half each)
    load_ms: float  # a batch's time to load (its samples' together)
    compute_ms: float  # the training step's own CPU work
    batch_size: int = 1
    workers_before: int = 0
    sample_shape: tuple[int, ...] = (16,)  # each sample's input tensor (float32)

    @property
    def name(self) -> str:
        name = f"{self.kind} {self.load_ms:g}/{self.compute_ms:g} ms"
        if self.batch_size > 1:
            name += f", batch {self.batch_size}"
        if self.sample_shape != (16,):
            name += " of " + "x".join(map(str, self.sample_shape))
        return name + (f", {self.workers_before} workers" if self.workers_before else "")


QUICK_CASES = (Case("io", 24.0, 10.0), Case("cpu", 24.0, 10.0))
FULL_CASES = QUICK_CASES + (
    Case("io", 50.0, 5.0),
    Case("io", 12.0, 20.0, batch_size=8),
    Case("io", 80.0, 10.0, batch_size=4, workers_before=2),
    Case("cpu", 40.0, 10.0),
    Case("cpu", 15.0, 20.0, batch_size=8),
    Case("cpu", 30.0, 5.0, batch_size=4, workers_before=2),
    Case("mixed", 40.0, 10.0, batch_size=4),
    # Images: each batch is 19 MB that a worker copies into shared memory to hand it over.
    Case("io", 60.0, 20.0, batch_size=32, sample_shape=(3, 224, 224)),
    Case("cpu", 40.0, 10.0, batch_size=32, sample_shape=(3, 224, 224)),
)


def _spin(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


class LoadTime(Dataset):
    """Samples that take ``load_ms / batch_size`` each to load: waiting, computing or both."""

    def __init__(self, case: Case, n: int) -> None:
        self.kind, self.sample_ms, self.n = case.kind, case.load_ms / case.batch_size, n
        self.shape = case.sample_shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "io":
            time.sleep(self.sample_ms / 1e3)
        elif self.kind == "cpu":
            _spin(self.sample_ms)
        else:
            time.sleep(self.sample_ms / 2e3)
            _spin(self.sample_ms / 2)
        return torch.full(self.shape, float(i % 7)), torch.tensor(i % 2)


def train(case: Case, workers: int, steps: int) -> tuple[dict, float]:
    """``steps`` steps under dtprofile; the summary and the measured step (ms, the mean
    after warm-up)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(
        LoadTime(case, (steps + 8) * case.batch_size),
        batch_size=case.batch_size,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )
    times = []
    with dtprofile.profile(model, opt, warmup_steps=WARMUP_STEPS, every_n_steps=10_000) as prof:
        last = time.perf_counter()
        for i, (x, y) in enumerate(prof.loader(loader)):
            _spin(case.compute_ms)
            nn.functional.cross_entropy(model(x.flatten(1)[:, :16]), y).backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            times.append((now - last) * 1e3)
            last = now
            if i + 1 == steps:
                break
    return prof.report().to_dict(), statistics.fmean(times[WARMUP_STEPS:])


def run(cases: tuple[Case, ...], steps: int) -> list[dict]:
    rows = []
    for case in cases:
        summary, step0 = train(case, case.workers_before, steps)
        rec = summary["recommendations"]
        workers, predicted = rec["num_workers"], rec["num_workers_step_ms"]
        loader = summary["run"]["cpu_time"] or {}
        after = None
        if workers is not None:  # (the same count when no change is worth making: re-run it too)
            _, after = train(case, int(workers), steps)
        rows.append(
            {
                "dataset": case.name,
                "kind": case.kind,
                "workers_before": case.workers_before,
                "step_ms_before": step0,
                "loader_kind": rec["loader_kind"],
                "loader_cpu_share": rec["loader_cpu_share"],
                "fetch_cpu_ms": loader.get("fetch_cpu_ms"),
                "training_cpu_cores": loader.get("training_cpu_cores"),
                "cpus_per_rank": summary["run"]["cpus_per_rank"],
                "num_workers": workers,
                "predicted_step_ms": predicted,
                "measured_step_ms": after,
                "rel_err": rel_err(predicted, after),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the two default datasets, fewer steps (about 20 s)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # More workers than cores is the point for the waiting loader: not a mistake here.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    rows = run(QUICK_CASES if args.quick else FULL_CASES, 60 if args.quick else 150)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(describe_machine(machine()))
    print(
        table(
            ["dataset", "before ms", "kind (CPU share)", "advice", "predicted ms", "measured ms", "error"],
            [
                [
                    r["dataset"],
                    f"{r['step_ms_before']:.1f}",
                    f"{r['loader_kind']} ({r['loader_cpu_share']:.2f})"
                    if r["loader_cpu_share"] is not None
                    else str(r["loader_kind"]),
                    f"num_workers={r['num_workers']}"
                    + (" (as now)" if r["num_workers"] == r["workers_before"] else ""),
                    f"{r['predicted_step_ms']:.1f}" if r["predicted_step_ms"] else "n/a",
                    f"{r['measured_step_ms']:.1f}" if r["measured_step_ms"] else "n/a",
                    f"{r['rel_err']:+.1%}" if r["rel_err"] is not None else "n/a",
                ]
                for r in rows
            ],
            title="Loader advice followed: load / compute ms per batch; predicted against measured step",
        )
    )
    ok = all(r["rel_err"] is not None and abs(r["rel_err"]) <= TARGET_REL_ERR for r in rows)
    print(f"\nTarget: predicted within {TARGET_REL_ERR:.0%} of measured: {'met' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
