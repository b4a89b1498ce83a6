"""``dtprofile demo``: a small profiled DDP training run on the CPU.

A multilayer perceptron trained with DistributedDataParallel over gloo on 127.0.0.1
(one process per rank, one thread each), fed by a Dataset whose ``__getitem__`` sleeps:
a deliberate data-loading bottleneck (``DataLoader(num_workers=0)``) that dtprofile
should find and blame. The loop is profiled with the public API::

    with dtprofile.profile(model, optimizer, logdir=logdir, every_n_steps=...,
                           warmup_steps=...) as prof:
        for x, y in prof.loader(train_loader):
            loss = loss_fn(model(x), y); loss.backward()
            optimizer.step(); optimizer.zero_grad()
    report = prof.report()

Rank 0 prints progress and the report; TensorBoard logs and ``dtprofile_summary.json``
go to ``logdir``. Every process has a deadline: the parent terminates the ranks when one
fails or time runs out, and the process group has a timeout, so the demo never hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import socket
import sys
import time
import traceback
from typing import Any

__all__ = ["run", "check_logdir", "DemoConfig"]

DEFAULT_LOGDIR = os.path.join("runs", "dtprofile-demo")


class DemoConfig(dict[str, Any]):
    """Plain settings passed to each rank (a dict, so it pickles under spawn)."""


def _defaults(steps: int, every_n_steps: int | None, warmup_steps: int | None) -> DemoConfig:
    every = every_n_steps or max(5, steps // 4)
    warm = warmup_steps if warmup_steps is not None else min(5, max(1, steps // 10))
    return DemoConfig(
        steps=steps,
        every_n_steps=every,
        warmup_steps=warm,
        batch_size=16,  # samples per rank per step
        features=256,
        hidden=512,
        classes=10,
        sample_delay_s=0.001,  # the bottleneck: 1 ms per sample, ~16 ms per batch
        lr=0.05,
        seed=0,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_ifname() -> str | None:
    try:
        names = [n for _, n in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for cand in ("lo", "lo0"):
        if cand in names:
            return cand
    return None


def _say(rank: int, msg: str) -> None:
    if rank == 0:
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()


def _train(rank: int, world_size: int, port: int | None, logdir: str | None, cfg: dict[str, Any]) -> None:
    """One rank's training loop (also the whole run when world_size == 1)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils.data import DataLoader, Dataset, Sampler

    import dtprofile

    torch.set_num_threads(1)
    torch.manual_seed(cfg["seed"])
    distributed = world_size > 1
    if distributed:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )

    class SlowDataset(Dataset[Any]):
        """Synthetic classification data that takes its time: each sample sleeps."""

        def __init__(self, n: int) -> None:
            self.n = n
            g = torch.Generator().manual_seed(1234)
            self.w = torch.randn(cfg["features"], cfg["classes"], generator=g)

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            time.sleep(cfg["sample_delay_s"])  # decoding / augmentation stand-in
            g = torch.Generator().manual_seed(i)
            x = torch.randn(cfg["features"], generator=g)
            return x, int((x @ self.w).argmax())

    steps = cfg["steps"]
    bs = cfg["batch_size"]
    dataset = SlowDataset(steps * bs * world_size)
    sampler: Sampler[Any] | None = None
    if distributed:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(dataset, batch_size=bs, sampler=sampler, shuffle=sampler is None, num_workers=0, drop_last=True)

    model: nn.Module = nn.Sequential(
        nn.Linear(cfg["features"], cfg["hidden"]),
        nn.ReLU(),
        nn.Linear(cfg["hidden"], cfg["hidden"]),
        nn.ReLU(),
        nn.Linear(cfg["hidden"], cfg["classes"]),
    )
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    every = cfg["every_n_steps"]
    _say(
        rank,
        f"dtprofile demo: {world_size} rank(s) on the CPU, {steps} steps of "
        f"{bs} samples per rank, a dataset that sleeps "
        f"{cfg['sample_delay_s'] * 1e3:g} ms per sample (num_workers=0)",
    )
    t0 = time.perf_counter()
    step = 0
    with dtprofile.profile(
        model, optimizer, logdir=logdir, every_n_steps=every, warmup_steps=cfg["warmup_steps"]
    ) as prof:
        for x, y in prof.loader(loader):
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % every == 0 or step == steps:
                _say(rank, f"  step {step:>4}/{steps}  loss {loss.item():.3f}  {time.perf_counter() - t0:5.1f} s")
            if step >= steps:
                break
    report = prof.report()
    if rank == 0:
        _say(rank, "")
        _say(rank, str(report))
    if distributed:
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _rank_main(rank: int, world_size: int, port: int, logdir: str | None, cfg: dict[str, Any]) -> None:
    """Entry point of a spawned rank: one line on stderr and exit 1 on failure."""
    ifname = _loopback_ifname()
    if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        _train(rank, world_size, port, logdir, cfg)
    except BaseException as e:  # noqa: BLE001
        if os.environ.get("DTPROFILE_DEMO_TRACEBACK"):
            traceback.print_exc()
        sys.stderr.write(f"dtprofile demo: rank {rank} failed: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)


def _run_spawned(world_size: int, logdir: str | None, cfg: dict[str, Any], timeout_s: float) -> int:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world_size, port, logdir, cfg), name=f"dtprofile-demo-rank{r}", daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failed: list[tuple[int, int | None]] = []
    timed_out = False
    try:
        while any(p.is_alive() for p in procs):
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            for p in procs:
                p.join(timeout=0.1)
    except KeyboardInterrupt:
        timed_out = True
        raise
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = failed or [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0,)]
    if timed_out:
        sys.stderr.write(f"dtprofile demo: stopped after {timeout_s:g} s (--timeout)\n")
        return 1
    if failed:
        ranks = ", ".join(f"rank {r} (exit {c})" for r, c in failed)
        sys.stderr.write(f"dtprofile demo: failed: {ranks}\n")
        return 1
    return 0


def check_logdir(logdir: str) -> str:
    """Check, before anything starts, that the demo can write its logs to ``logdir``.

    As :func:`dtprofile.profile` checks it: a file at that path would otherwise surface as
    a bare FileExistsError from ``os.makedirs``.

    Args:
        logdir: The directory (it need not exist yet).

    Returns:
        ``logdir``.

    Raises:
        ValueError: ``logdir`` is not a directory; the message names it.

    Example:
        >>> check_logdir("runs")
        'runs'
    """
    from .options import _logdir

    return _logdir(logdir)


def run(
    logdir: str | None = DEFAULT_LOGDIR,
    world_size: int = 2,
    steps: int = 120,
    every_n_steps: int | None = None,
    warmup_steps: int | None = None,
    timeout_s: float = 300.0,
) -> int:
    """Run the demo: train, print rank 0's progress and report, point at the dashboard.

    Args:
        logdir: Where the TensorBoard logs and the summary go; ``""`` or None writes no
            files.
        world_size: Processes (ranks); 1 trains in this process without DDP.
        steps: Optimizer steps to train.
        every_n_steps: The log interval in steps (default: about a quarter of ``steps``).
        warmup_steps: Steps skipped before measuring (default 5, fewer for short runs).
        timeout_s: With several ranks, the ranks are stopped after this long.

    Returns:
        The exit status: 0 on success, 1 when a rank failed or time ran out.

    Raises:
        ValueError: ``world_size`` or ``steps`` below 1, or a ``logdir`` that is not a
            directory.

    Example:
        ``dtprofile.demo.run(logdir="", world_size=1, steps=20)`` trains 20 steps in this
        process and prints the report (about a second).
    """
    if world_size < 1 or steps < 1:
        raise ValueError("world_size and steps must be >= 1")
    cfg = dict(_defaults(steps, every_n_steps, warmup_steps))
    logdir = os.path.abspath(check_logdir(logdir)) if logdir else None  # "" or None: no files
    if logdir:
        os.makedirs(logdir, exist_ok=True)
    if world_size == 1:
        import torch

        threads = torch.get_num_threads()
        try:
            _train(0, 1, None, logdir, cfg)
        except Exception as e:  # noqa: BLE001
            if os.environ.get("DTPROFILE_DEMO_TRACEBACK"):
                traceback.print_exc()
            sys.stderr.write(f"dtprofile demo: failed: {type(e).__name__}: {e}\n")
            return 1
        finally:
            torch.set_num_threads(threads)  # in-process: leave the caller's setting
        status = 0
    else:
        status = _run_spawned(world_size, logdir, cfg, timeout_s)
    if status == 0 and logdir:
        shown = os.path.relpath(logdir) if not os.path.relpath(logdir).startswith("..") else logdir
        if any(name.startswith("events.out.tfevents") for _, _, files in os.walk(logdir) for name in files):
            sys.stdout.write(f"\nOpen the dashboard: tensorboard --logdir {shlex.quote(shown)}\n")
        else:  # the sink was disabled (it warned why)
            sys.stdout.write(
                f"\nNo TensorBoard event file was written; the report again: dtprofile report {shlex.quote(shown)}\n"
            )
        sys.stdout.flush()
    return status


if __name__ == "__main__":  # pragma: no cover - `python -m dtprofile.demo`
    # The same as `python -m dtprofile demo ...`: the command line owns the demo's
    # options. It is run as a program, not imported: this module stays below the CLI.
    import runpy

    sys.argv[1:1] = ["demo"]
    runpy.run_module("dtprofile", run_name="__main__", alter_sys=True)
