"""Run a function on N local gloo ranks, with free ports and a hard timeout.

Every multi-process test goes through :func:`run_ranks`: it never hangs (the processes
are killed at the deadline and the test fails with their exit codes) and never uses a
fixed port.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, cfg: dict, outdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    result: Any
    try:
        if world > 1:
            from datetime import timedelta

            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        result = {"ok": fn(rank, world, cfg)}
    except BaseException as exc:  # report it to the parent instead of dying silently
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        if world > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh, default=str)


def run_ranks(fn: Callable, world: int = 2, cfg: dict | None = None, timeout_s: float = 240.0,
              allow_missing: bool = False) -> list[Any]:
    """Run ``fn(rank, world, cfg)`` on ``world`` processes; their return values, by rank.

    ``allow_missing``: a rank that exits without a result gives ``None`` instead of an error.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, cfg or {}, outdir), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        import time

        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
        if alive:
            raise TimeoutError(f"{len(alive)} of {world} ranks still running after {timeout_s:.0f} s; killed")
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if not os.path.exists(path):
                if allow_missing:
                    results.append(None)
                    continue
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            with open(path) as fh:
                res = json.load(fh)
            if "error" in res:
                raise RuntimeError(f"rank {r} failed: {res['error']}\n{res['traceback']}")
            results.append(res["ok"])
        return results
