"""The training script ``benchmarks/cluster.py`` launches with torchrun on each node.

One DDP process per node (CPU, gloo), profiled with ``dtprofile.profile``. In order:

1. ``--reference-steps N`` (optional): N steps under ``ddp.no_sync()``, timed by wall
   clock without the profiler: the step without gradient communication, the truth that
   dtprofile's T_C is checked against.
2. The profiled run: ``--steps`` synchronised steps (``--no-sync``: unsynchronised)
   under ``dtprofile.profile(..., logdir=--logdir, warmup_steps=--warmup)``; the
   summary lands in ``<logdir>/dtprofile_summary.json`` (written by rank 0).
3. ``--paused-reference-steps N`` (optional, with ``--reference-steps``): N more steps
   under ``no_sync()``, each pausing after backward as long as the profiled steps waited
   for their all-reduce (their median step less the no-sync step's), the pause left out
   of the time. On a CPU, compute after a pause is slower than back to back
   (``benchmarks/compute_gap.py``): this is the synchronised steps' compute without
   their communication, the truth for T_C of those steps.
4. ``--raw-mb M`` (optional): a plain ``dist.all_reduce`` of M MB, timed, as an
   independent measurement of the link's bus bandwidth.

Each rank writes ``<out>/rank<R>.json`` with its wall-clock step times and the
reference figures. ``--slow-rank R --slow-ms MS`` makes rank R sleep MS before every
backward (a straggler). ``--device-ms F,B`` emulates an accelerator: the model's layers
with F and B milliseconds a step slept in forward and backward (``_common.Emulated``).
Runs under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, ... set) or, for a quick check, as a
plain single process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def make_model(kind: str) -> tuple[nn.Module, int, int]:
    """(model, input features, classes)."""
    if kind == "comm_heavy":  # ~50 MB of fp32 gradients, little compute per sample
        return nn.Sequential(nn.Linear(1024, 6144), nn.ReLU(), nn.Linear(6144, 1024)), 1024, 1024
    if kind == "medium":  # ~12.6 MB of gradients
        return nn.Sequential(nn.Linear(1024, 1536), nn.ReLU(), nn.Linear(1536, 1024)), 1024, 1024
    if kind == "small":
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), 32, 10
    raise ValueError(f"--model must be comm_heavy, medium or small, got {kind!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="comm_heavy", help="comm_heavy (default), medium, small")
    p.add_argument("--batch", type=int, default=8, help="per-rank batch size (default 8)")
    p.add_argument("--steps", type=int, default=10, help="profiled optimizer steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="dtprofile warmup_steps (default 2)")
    p.add_argument(
        "--every", type=int, default=0, help="dtprofile every_n_steps (default 0: none before the final gather)"
    )
    p.add_argument(
        "--reference-steps", type=int, default=0, help="no_sync steps timed before the profiled run (default 0: none)"
    )
    p.add_argument(
        "--paused-reference-steps",
        type=int,
        default=0,
        help="no_sync steps timed after the profiled run, each pausing after backward as "
        "long as the profiled steps waited (default 0: none)",
    )
    p.add_argument("--no-sync", action="store_true", help="profile with ddp.no_sync() on every step (no communication)")
    p.add_argument("--slow-rank", type=int, default=None, help="rank that sleeps before backward")
    p.add_argument("--slow-ms", type=float, default=0.0, help="how long it sleeps (ms)")
    p.add_argument(
        "--raw-mb",
        type=float,
        default=0.0,
        help="after the run, time a plain all_reduce of this many MB (default 0: no)",
    )
    p.add_argument(
        "--device-ms",
        default=None,
        help="F,B: an emulated accelerator, F ms slept in forward and B ms in backward "
        "per step while the CPU idles (default: real CPU compute only)",
    )
    p.add_argument("--options", default=None, help="more dtprofile.profile options, as JSON")
    p.add_argument(
        "--link-bandwidth",
        type=float,
        default=None,
        help="the shaped link's rate in bytes/s, given to dtprofile as link_bandwidth",
    )
    p.add_argument("--logdir", default=None, help="dtprofile logdir (summary + TensorBoard)")
    p.add_argument("--out", default=None, help="directory for rank<R>.json results")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout in seconds (default 120)")
    return p.parse_args(argv)


def _median_ms(times: list[float], skip: int) -> float | None:
    kept = times[skip:] if len(times) > skip else times
    return statistics.median(kept) * 1e3 if kept else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        rank = dist.get_rank()
    import dtprofile

    torch.manual_seed(0)
    model, features, classes = make_model(args.model)
    if args.device_ms:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _common import Emulated

        forward_ms, backward_ms = (float(v) for v in args.device_ms.split(","))
        model = Emulated(model, forward_ms, backward_ms)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [
        (torch.randn(args.batch, features, generator=g), torch.randint(0, classes, (args.batch,), generator=g))
        for _ in range(4)
    ]
    slow_s = args.slow_ms / 1e3 if args.slow_rank == rank else 0.0

    def one_step(
        x: torch.Tensor, y: torch.Tensor, sync: bool, phases: list | None = None, pause_s: float = 0.0
    ) -> float:
        """One step; its time in seconds, less ``pause_s`` slept after backward (where a
        synchronised step waits for its all-reduce)."""
        clock = time.perf_counter
        ctx = ddp.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
        t0 = clock()
        with ctx:
            loss = nn.functional.cross_entropy(ddp(x), y)
            t1 = clock()
            if slow_s:
                time.sleep(slow_s)  # a straggler: slow compute before backward
            loss.backward()
        t2 = clock()
        if pause_s:
            time.sleep(pause_s)
        t_opt = clock()
        opt.step()
        opt.zero_grad()
        end = clock()
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, end - t_opt))
        return end - t0 - (t_opt - t2)

    result: dict = {
        "rank": rank,
        "world_size": world,
        "model": args.model,
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "reference_step_ms": None,
        "paused_reference_step_ms": None,
        "step_ms": None,
        "raw_allreduce": None,
    }

    # 1. The step without communication, no profiler: T_C's ground truth.
    if args.reference_steps > 0:
        times: list[float] = []
        phases: list[tuple] = []
        for i in range(args.reference_steps + args.warmup):
            t0 = time.perf_counter()
            one_step(*batches[i % len(batches)], sync=False, phases=phases)
            times.append(time.perf_counter() - t0)
        result["reference_step_ms"] = _median_ms(times, args.warmup)
        result["reference_phases_ms"] = {
            name: _median_ms([p[j] for p in phases], args.warmup)
            for j, name in enumerate(("forward", "backward", "optimizer"))
        }
        result["reference_steps_ms"] = [t * 1e3 for t in times]
        if world > 1:
            dist.barrier()

    # 2. The profiled run.
    every = args.every if args.every > 0 else args.steps + 1
    walls: list[float] = []
    data = [batches[i % len(batches)] for i in range(args.steps)]
    options = json.loads(args.options) if args.options else {}
    with dtprofile.profile(
        ddp,
        opt,
        logdir=args.logdir,
        warmup_steps=args.warmup,
        every_n_steps=every,
        gather_timeout_s=args.timeout,
        link_bandwidth=args.link_bandwidth,
        **options,
    ) as prof:
        t_last = time.perf_counter()
        for x, y in prof.loader(data):
            one_step(x, y, sync=not args.no_sync)
            now = time.perf_counter()
            walls.append(now - t_last)
            t_last = now
    result["step_ms"] = _median_ms(walls, args.warmup)
    result["steps_ms"] = [t * 1e3 for t in walls]
    summary = prof.report().to_dict()
    result["summary_per_step_ms"] = summary.get("per_step_ms")

    # 3. The no-sync step again, each pausing as long as the profiled steps waited.
    if args.paused_reference_steps > 0 and result["reference_step_ms"] and result["step_ms"]:
        pause_s = max(0.0, result["step_ms"] - result["reference_step_ms"]) / 1e3
        if world > 1:  # one pause for all ranks (rank 0's), so that they stay in step
            pause = torch.tensor([pause_s], dtype=torch.float64)
            dist.broadcast(pause, 0)
            pause_s = float(pause.item())
        times, phases = [], []
        for i in range(args.paused_reference_steps + args.warmup):
            times.append(one_step(*batches[i % len(batches)], sync=False, phases=phases, pause_s=pause_s))
        result["paused_reference_step_ms"] = _median_ms(times, args.warmup)
        result["paused_reference_phases_ms"] = {
            name: _median_ms([p[j] for p in phases], args.warmup)
            for j, name in enumerate(("forward", "backward", "optimizer"))
        }
        result["pause_ms"] = pause_s * 1e3

    # 4. An independent bandwidth measurement: a plain all-reduce, best of three (a
    #    transfer slowed by the host's other work now and then is not the link's rate).
    if world > 1 and args.raw_mb > 0:
        n = int(args.raw_mb * 1e6 / 4)
        buf = torch.ones(n)
        best = None
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        algbw = n * 4 / best
        result["raw_allreduce"] = {
            "bytes": n * 4,
            "seconds": best,
            "algbw_Bps": algbw,
            "busbw_Bps": algbw * 2 * (world - 1) / world,
        }

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"rank{rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        os.replace(path + ".tmp", path)
    if world > 1:
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: gloo's worker threads outlive
    # destroy_process_group(), and one still releasing a tensor Python made (the last
    # collective's) needs the GIL; during teardown that ends the thread inside C++ code,
    # which aborts the process ("terminate called without an active exception").
    os._exit(code)
