"""How much CPU the loader spends per batch: loading that computes, or loading that waits.

More DataLoader workers hide a fetch that waits on storage or the network even beyond
the CPU cores, since a waiting worker needs no core; a fetch that decodes or augments
needs a core per worker. What tells them apart is the CPU time a batch costs against
the time it takes to load:

- the main process loads (``num_workers=0``): the training thread's CPU time during
  ``next()`` (``time.thread_time``), measured with each fetch by
  :class:`~dtprofile.capture.data_wait.DataWait`;
- worker processes load (those of the DataLoader iterators ``prof.loader`` walks, else
  this process's daemon children): their CPU time, read between log intervals from
  ``/proc/<pid>/stat`` for the live workers and ``getrusage(RUSAGE_CHILDREN)`` for the
  workers that ended (a DataLoader without ``persistent_workers`` starts new ones each
  epoch), divided by the batches fetched meanwhile.

The training process's own CPU use (its CPU time less the fetches', per second of wall
time) says how many cores the training leaves to the workers. The training thread's CPU
time per step, against the step's compute time, says whether that thread had a core
to itself while it computed on the CPU (ranks sharing a host compete for them).

Nothing here runs per step: :meth:`CPUTime.sample` is called with each log interval
handed to the summary's worker, and at the end of the run.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import time
import weakref
from dataclasses import dataclass
from typing import Any

from .data_wait import DataWait

__all__ = ["CPUTime", "worker_processes", "process_cpu_s"]

log = logging.getLogger(__name__)

try:
    _TICKS_PER_S = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):  # not a POSIX system
    _TICKS_PER_S = 100.0


def worker_processes(iterators: Any = ()) -> list[Any]:
    """The live DataLoader worker processes: those of ``iterators`` (DataLoader
    iterators the loop was seen to use), else this process's daemon children (DataLoader
    workers are daemons; a process's own target is gone once it has started, so it cannot
    tell them apart further)."""
    seen = [w for it in iterators for w in (getattr(it, "_workers", None) or ())]
    if seen:
        return [w for w in seen if w.is_alive()]
    return [p for p in multiprocessing.active_children() if p.daemon]


def process_cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` so far (None: not readable here).

    Example:
        >>> process_cpu_s(os.getpid()) is None or process_cpu_s(os.getpid()) >= 0.0
        True
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: fields are counted after its ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime (fields 14, 15)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class _Baseline:
    """The clocks and totals when counting started (:meth:`CPUTime.start`)."""

    wall_s: float
    process_cpu_s: float
    children_cpu_s: float
    fetch_wall_s: float
    fetch_cpu_s: float
    fetches: int
    fetch_cpu_samples: int
    pass_start_cpu_s: float
    pass_starts: int
    thread_cpu_s: float
    steps: int


class CPUTime:
    """The loader's and the training's CPU time since :meth:`start`: the loader's in the
    main process and in its worker processes, the training process's and its thread's.

    Args:
        data: the data wait (its fetch totals, and the step tracker's step count).
    """

    def __init__(self, data: DataWait) -> None:
        self.data = data
        self._base: _Baseline | None = None
        self._live_base: dict[int, float] = {}  # pid -> CPU seconds at start (workers alive then)
        self._readable = True
        self._iterators: weakref.WeakSet[Any] = weakref.WeakSet()  # the DataLoader iterators seen

    def watch(self, iterator: Any) -> None:
        """The loop iterates ``iterator`` (its ``_workers``, if any, are the loader's)."""
        if getattr(iterator, "_workers", None) is not None:
            try:
                self._iterators.add(iterator)
            except TypeError:  # not weakly referenceable: the daemon children stand in
                pass

    def start(self) -> None:
        """Totals count from now."""
        try:
            data = self.data
            self._base = _Baseline(
                time.perf_counter(),
                time.process_time(),
                _children_cpu_s(),
                data.fetch_wall_s,
                data.fetch_cpu_s,
                data.fetch_count,
                data.fetch_cpu_samples,
                data.pass_start_cpu_s,
                data.pass_starts,
                time.thread_time(),
                data.steps.steps_seen,
            )
            self._live_base = {}
            for proc in worker_processes(list(self._iterators)):
                cpu = process_cpu_s(proc.pid)
                if cpu is not None:
                    self._live_base[proc.pid] = cpu
        except Exception as exc:  # never the run's problem: the CPU times go unmeasured
            log.debug("dtprofile: CPU time not sampled: %r", exc)
            self._base = None

    def sample(self) -> dict[str, Any] | None:
        """The figures since :meth:`start` (the summary's ``run.cpu_time``); None before it.

        Returns:
            ``fetches`` (timed ``next()`` calls), ``fetch_ms`` and ``fetch_cpu_ms`` (per
            fetch: the time blocked and the training thread's CPU time in it, the latter
            from the fetches that read the CPU clock: one in
            :data:`~dtprofile.capture.data_wait.FETCH_CPU_EVERY`, and each pass's
            first),
            ``workers_alive``, ``worker_cpu_ms_per_batch`` (the workers' CPU time per
            fetch; None when no worker CPU could be read), ``training_cpu_cores`` (the
            training process's CPU seconds per second, its fetches left out),
            ``training_thread_cpu_ms_per_step`` (the training thread's CPU time per
            step, its fetches left out). Called on the training thread.
        """
        if self._base is None:
            return None
        try:
            return self._sample(self._base)
        except Exception as exc:
            log.debug("dtprofile: CPU time not sampled: %r", exc)
            return None

    def _fetch_cpu_s(self, base: _Baseline, fetches: int) -> float | None:
        """This thread's CPU time in the ``fetches`` since ``base``: the passes' first
        fetches as read, the others at the sampled fetches' rate (since ``base``, else
        the run's); None when no fetch was sampled at all."""
        data = self.data
        starts = data.pass_starts - base.pass_starts
        samples = data.fetch_cpu_samples - base.fetch_cpu_samples
        if samples:
            rate_s = (data.fetch_cpu_s - base.fetch_cpu_s) / samples
        elif data.fetch_cpu_samples:  # (a baseline a few fetches ago)
            rate_s = data.fetch_cpu_s / data.fetch_cpu_samples
        elif fetches > starts:
            return None
        else:
            rate_s = 0.0
        return data.pass_start_cpu_s - base.pass_start_cpu_s + rate_s * (fetches - starts)

    def _sample(self, base: _Baseline) -> dict[str, Any]:
        data = self.data
        wall_s = time.perf_counter() - base.wall_s
        fetches = data.fetch_count - base.fetches
        fetch_cpu_s = self._fetch_cpu_s(base, fetches)
        workers = worker_processes(list(self._iterators))
        live_s = 0.0
        for proc in workers:
            cpu = process_cpu_s(proc.pid)
            if cpu is None:
                self._readable = False
                continue
            live_s += cpu - self._live_base.get(proc.pid, 0.0)
        ended_s = _children_cpu_s() - base.children_cpu_s  # workers that ended (and were joined)
        worker_s = live_s + ended_s
        seen_workers = bool(workers) or ended_s > 0.0
        per_fetch = 1e3 / fetches if fetches else None
        known = fetch_cpu_s is not None  # (else the fetches' CPU time cannot be left out)
        loading_s = fetch_cpu_s or 0.0
        training_s = max(0.0, time.process_time() - base.process_cpu_s - loading_s)
        steps = data.steps.steps_seen - base.steps
        thread_s = max(0.0, time.thread_time() - base.thread_cpu_s - loading_s)
        return {
            "fetches": fetches,
            "fetch_ms": (data.fetch_wall_s - base.fetch_wall_s) * per_fetch if per_fetch else None,
            "fetch_cpu_ms": fetch_cpu_s * per_fetch if per_fetch and fetch_cpu_s is not None else None,
            "workers_alive": len(workers),
            "worker_cpu_ms_per_batch": (
                worker_s * per_fetch if per_fetch and seen_workers and self._readable else None
            ),
            "training_cpu_cores": training_s / wall_s if known and wall_s > 0 else None,
            "training_thread_cpu_ms_per_step": thread_s * 1e3 / steps if known and steps > 0 else None,
        }
