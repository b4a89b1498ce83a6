"""A plain DDP training loop profiled with dtprofile, launched as users launch it.

For tests/test_launch.py::

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT ddp_loop.py OUTDIR
    python ddp_loop.py OUTDIR --spawn       # the ranks from torch.multiprocessing.spawn

Every rank (gloo, CPU, one thread) trains a small model with the README's context manager,
ends as a careful user does (``dist.barrier()``, then ``dist.destroy_process_group()``: a
gloo group left to interpreter teardown can abort a rank with "terminate called without
an active exception", pytorch PR #179291), and writes ``OUTDIR/rank<R>.json``: its rank,
its status ("finished") and figures from its own final report. Then the interpreter ends
as it does for a user: no ``os._exit``. With ``--spawn`` the launching process also writes
``OUTDIR/spawn.json``, every rank's exit code as ``multiprocessing`` saw it.

``--release``: before the profiler starts and after it stops (twice: two runs, one after
the other), the rank records its Python threads, its native threads (``/proc/self/task``)
and its open descriptors (``/proc/self/fd`` and where each points), for the test that
``stop()`` gives back what it opened. ``--no-profile`` trains the same loop without
dtprofile, and ``--ending bare`` leaves the process group to interpreter teardown (no
barrier, no ``destroy_process_group``): both only for measuring torch's own teardown.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

STEPS = 24


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as fh:
            return fh.read().strip()
    except OSError:  # it ended meanwhile
        return "?"


def _snapshot() -> dict:
    """This process's threads and descriptors now."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
    return {
        "threads": sorted(f"{t.name}:{t.ident}" for t in threading.enumerate()),
        "tasks": sorted(f"{tid}:{_comm(tid)}" for tid in os.listdir("/proc/self/task")),
        "fds": fds,
    }


def _settled(before: dict, wait_s: float = 3.0) -> dict:
    """A snapshot once no native thread is left beyond ``before``'s, or after ``wait_s``.

    A thread that ``join()`` has seen end may still be an OS thread for a moment (the
    TensorBoard writer's, joined as the writer closes at stop); one that was never told
    to end stays past the wait, and the test sees it.
    """
    deadline = time.monotonic() + wait_s
    while True:
        now = _snapshot()
        if set(now["tasks"]) <= set(before["tasks"]) or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader,
    profiled: bool,
    logdir: str | None,
    during: list | None = None,
) -> dict | None:
    """The user's loop: the README's context manager around it (``profiled``), or bare.
    ``during``: a snapshot taken two steps before the end, appended to it."""
    import dtprofile

    if not profiled:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return None
    with dtprofile.profile(
        model, optimizer, logdir=logdir, every_n_steps=8, warmup_steps=2, gather_timeout_s=60.0
    ) as prof:
        for step, (x, y) in enumerate(prof.loader(loader)):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if during is not None and step == len(loader) - 2:  # the log intervals behind it
                during.append(_snapshot())
    return prof.report().to_dict()


def rank_main(outdir: str, steps: int, profiled: bool, ending: str, release: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 8 * world, 32), torch.randint(0, 4, (steps * 8 * world,)))
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    record: dict = {"rank": rank, "world_size": world, "pid": os.getpid()}
    logdir = os.path.join(outdir, "logs")
    if release:
        # One step first, without dtprofile: what torch makes lazily at a first step is not
        # dtprofile's. Then two profiled runs, each with a snapshot near its end and one after stop.
        _train(model, optimizer, [next(iter(loader))], profiled=False, logdir=None)
        record["before"] = before = _snapshot()
        runs = []
        for run in range(2):
            during: list = []
            summary = _train(model, optimizer, loader, profiled, os.path.join(logdir, f"run{run}"), during)
            runs.append({"during": during[0], "after": _settled(before), "steps_total": summary["steps_total"]})
        record["runs"] = runs
    else:
        summary = _train(model, optimizer, loader, profiled, logdir)
    if summary is not None:
        record["summary"] = {
            "steps_total": summary["steps_total"],
            "world_size": summary["world_size"],
            "comm_source": summary["comm_source"],
            "step_ms": summary["per_step_ms"]["step"],
            "ranks_steps": [r["steps"] for r in summary["ranks"]],
        }
    if ending == "careful":  # what a careful user does: every rank done, then the group gone
        dist.barrier()
        dist.destroy_process_group()
    record["status"] = "finished"
    path = os.path.join(outdir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(record, fh)
    os.replace(path + ".tmp", path)


def _spawned(rank: int, world: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    rank_main(*args)


def spawn(args: tuple, world: int = 2, timeout_s: float = 90.0) -> int:
    """``torch.multiprocessing.spawn`` the ranks; every rank's exit code to spawn.json."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.spawn(_spawned, args=(world, port, args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    for p in context.processes:  # each one's exit code, not only the first failure's
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in context.processes]
    with open(os.path.join(args[0], "spawn.json"), "w") as fh:
        json.dump({"exitcodes": codes}, fh)
    for p in context.processes:
        if p.is_alive():
            p.kill()
    context.join(timeout=5)  # as mp.spawn(join=True) does: raises on a rank that failed
    return 0 if codes == [0] * world else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--spawn", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--ending", choices=("careful", "bare"), default="careful")
    parser.add_argument("--release", action="store_true")
    a = parser.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    args = (a.outdir, a.steps, not a.no_profile, a.ending, a.release)
    if a.spawn:
        return spawn(args)
    rank_main(*args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
