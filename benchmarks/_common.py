"""Helpers shared by ``benchmarks/overhead.py`` and ``benchmarks/fidelity.py``.

- :func:`launch`: run ``fn(rank, world, cfg)`` on ``world`` local processes (gloo on
  127.0.0.1, a free port, ``torch.set_num_threads(1)`` per process, forked by a server
  that imported torch once) with a hard deadline: at the deadline the processes are
  killed and :class:`TimeoutError` is raised, so a benchmark never hangs.
- the models and datasets both scripts train, and small statistics/table helpers.

Only the Python standard library, torch and numpy: the benchmarks need nothing that
the library does not already depend on (pytorch-lightning only for the Lightning rows).
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

# --------------------------------------------------------------------------- launcher


def free_port() -> int:
    """A TCP port the OS says is free on 127.0.0.1 (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, cfg: dict, outdir: str, env: dict[str, str]) -> None:
    import torch.distributed as dist

    # The launcher's environment as it is now (a forkserver's child has the server's,
    # from when it started).
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
    )
    # The child's own output (Lightning's banners, the profilers' C++ log lines) goes to a
    # log file; the parent shows its tail only if the child fails.
    log_fd = os.open(os.path.join(outdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    torch.set_num_threads(1)
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
    tmp = os.path.join(outdir, f"rank{rank}.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(result, fh, default=str)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.json"))
    if cfg.get("hard_exit"):
        os._exit(0)  # skip interpreter teardown (e.g. an unfinalised profiler trace)


#: What the fork server imports once, before its first fork: torch (about 1.5 s a process
#: on 2 cores), torch._dynamo (which the first DDP model of a process imports: 0.6-1.5 s),
#: FSDP's modules (DTensor and what it pulls in: 1.5-3 s more for every FSDP run) and
#: dtprofile (0.3-0.6 s). None of them reads the environment on import or starts a
#: thread; one that fails to import is imported by the rank that needs it.
FORKSERVER_PRELOAD = ["torch", "torch.nn", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "dtprofile"]


def _context() -> Any:
    """Fresh processes that start without importing torch each time: a fork server that
    imported it once forks them (:data:`FORKSERVER_PRELOAD`), or spawn where there is no
    fork server. Neither inherits the caller's threads or state."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # (before the server's first start)
    return ctx


def launch(
    fn: Callable, world: int = 2, cfg: dict | None = None, timeout_s: float = 240.0, allow_missing: bool = False
) -> list[Any]:
    """Run ``fn(rank, world, cfg)`` on ``world`` processes; their return values, by rank.

    ``fn`` must be importable (a module-level function). Raises TimeoutError when a rank
    is still running after ``timeout_s`` (all are killed), RuntimeError when one failed.
    ``allow_missing``: a rank that exits without a result gives ``None`` instead.
    The test suite launches its multi-process tests through this too.
    """
    ctx = _context()
    port = free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="dtprofile-bench-") as outdir:
        # Not daemonic: a rank may start DataLoader workers. Every exit path below kills
        # whatever is still running, so nothing outlives the call.
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, cfg or {}, outdir, env)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout_s
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
        finally:
            alive = [p for p in procs if p.is_alive()]
            for p in alive:
                p.kill()
                p.join(5)
        if alive:
            raise TimeoutError(
                f"{len(alive)} of {world} processes still running after {timeout_s:.0f} s; killed{_log_tail(outdir, 0)}"
            )
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if not os.path.exists(path):
                if allow_missing:
                    results.append(None)
                    continue
                raise RuntimeError(
                    f"rank {r} died without a result (exit code {procs[r].exitcode}){_log_tail(outdir, r)}"
                )
            with open(path) as fh:
                res = json.load(fh)
            if "error" in res:
                raise RuntimeError(f"rank {r} failed: {res['error']}\n{res['traceback']}{_log_tail(outdir, r)}")
            results.append(res["ok"])
        return results


def _log_tail(outdir: str, rank: int, lines: int = 20) -> str:
    try:
        with open(os.path.join(outdir, f"rank{rank}.log"), errors="replace") as fh:
            tail = fh.read().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n--- rank %d output (tail) ---\n%s" % (rank, "\n".join(tail)) if tail else ""


# --------------------------------------------------------------------------- models and data

# Step sizes on one core (torch.set_num_threads(1)), calibrated on the idle 2-core Xeon
# of docs/benchmarks.md's table: "5ms" ~ 5 ms and "50ms" ~ 50 ms per plain training step.
CASES: dict[str, dict] = {
    "5ms": dict(width=512, depth=3, inp=512, batch=128),
    "50ms": dict(width=1024, depth=4, inp=512, batch=272),
}
CLASSES = 10


def mlp(width: int, depth: int, inp: int, classes: int = CLASSES, **_: Any) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inp, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class DeviceTime(torch.autograd.Function):
    """Sleeps ``forward_s`` in forward and ``backward_s`` in backward: a device's time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        if forward_s:
            time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.backward_s:
            time.sleep(ctx.backward_s)
        return grad, None, None


class Emulated(nn.Module):
    """An accelerator emulated on the CPU: ``net``'s layers (an ``nn.Sequential``) with a
    device's time slept after each linear layer, ``forward_ms`` and ``backward_ms`` a step
    in all (after, so that backward passes through every one: the input needs no
    gradient). The host idles meanwhile, as beside a GPU, so co-located ranks do not
    compete for the CPU; gradients become ready one layer at a time during backward, and
    their all-reduce is real."""

    def __init__(self, net: nn.Sequential, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.net = net
        linears = max(1, sum(isinstance(m, nn.Linear) for m in self.net))
        self.forward_s = forward_ms / 1e3 / linears
        self.backward_s = backward_ms / 1e3 / linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
            if isinstance(layer, nn.Linear) and (self.forward_s or self.backward_s):
                x = DeviceTime.apply(x, self.forward_s, self.backward_s)
        return x


def comm_heavy() -> nn.Module:
    """~50 MB of fp32 gradients and little compute per sample (the tests' comm_heavy)."""
    return nn.Sequential(nn.Linear(1024, 6144), nn.ReLU(), nn.Linear(6144, 1024))


def fixed_batch(case: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(case["batch"], case["inp"], generator=g),
        torch.randint(0, case.get("classes", CLASSES), (case["batch"],), generator=g),
    )


class SleepyBatches(torch.utils.data.Dataset):
    """Synthetic samples; loading each batch costs ``sleep_ms`` (one sleep per batch).

    The sleep happens on the batch's first sample, so with ``shuffle=False`` and
    ``batch_size=batch`` every batch pays exactly one ``time.sleep(sleep_ms)``; the
    time actually slept is what ``time.sleep`` overshoots by (well under 1%).
    """

    def __init__(self, n: int, shape: Sequence[int], classes: int, sleep_ms: float, batch: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, *shape, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.sleep_s = sleep_ms / 1e3
        self.batch = batch

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.sleep_s and i % self.batch == 0:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


# --------------------------------------------------------------------------- measurements


def rss_mb() -> float:
    """Resident set size of this process, MB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


DDP_KEYS = (
    "avg_forward_compute_time",
    "avg_backward_compute_time",
    "avg_backward_comm_time",
    "avg_backward_compute_comm_overlap_time",
)


def ddp_steady_medians(avgs: list, skip: int) -> dict:
    """Per-iteration DDP timings (ns) recovered from its running averages; median after ``skip``.

    DDP keeps ``avg_*`` as running means over ``iteration`` recorded iterations (sample
    rate 1), so iteration n's own value is ``avg_n * n - avg_(n-1) * (n-1)``; only pairs
    of consecutive recorded iterations are used.
    """
    out = {}
    for key in DDP_KEYS:
        values, prev_n, prev_avg = [], None, None
        for n, d in avgs:
            avg = d.get(key)
            if avg is not None and prev_avg is not None and n == prev_n + 1 and n > skip:
                values.append(avg * n - prev_avg * prev_n)
            if avg is not None:
                prev_n, prev_avg = n, avg
        out[key] = statistics.median(values) if values else None
    return out


def union_ms(spans: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping (start, end) intervals."""
    from dtprofile.capture.records import union_length

    return float(union_length(list(spans)))


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(statistics.median(vals)) if vals else None


def rel_err(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / abs(reference)


# --------------------------------------------------------------------------- output


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {"cpu": cpu, "cores": cores, "torch": torch.__version__, "python": platform.python_version(), "load": load}


def describe_machine(m: dict | None = None) -> str:
    m = m or machine()
    load = ", ".join(f"{x:.2f}" for x in m["load"])
    return f"machine: {m['cores']} cores, {m['cpu']}; torch {m['torch']}, Python {m['python']}; load average {load}"


def fmt(value: Any, spec: str = ".2f", none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    if isinstance(value, str):
        return value
    return format(value, spec)


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A Markdown table (it reads fine on a terminal and pastes into docs/benchmarks.md)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + " |"  # noqa: E731
    out = [] if title is None else [f"\n{title}\n"]
    out.append(line(cells[0]))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)


class Deadline:
    """The remaining time of an overall budget, for a per-launch timeout."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        return max(5.0, min(cap, self.end - time.monotonic()))
