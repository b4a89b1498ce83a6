"""Work off the training thread, at a small share of wall time.

Summarising a log interval (the averages, the analysis) and writing it to TensorBoard
(scalars, Markdown, now and then images) take from half a millisecond to a fifth of a
second; on the training thread that would be a stall every ``every_n_steps``. Beside it,
on a fast loop, they would still take the GIL from it often enough to slow every step.

:class:`BackgroundWorker` runs each job on one daemon thread, and after a job that took
``d`` seconds rests ``d * (1 / max_share - 1)``: it never takes more than
:data:`MAX_SHARE` of wall time. A job submitted while one waits replaces it (the
latest figures are what matter, and memory holds at most one pending job); the
replaced ones are counted (``coalesced``). :meth:`~BackgroundWorker.flush` and
:meth:`~BackgroundWorker.stop` run what is pending at once, whatever the rest.

>>> seen = []
>>> worker = BackgroundWorker(seen.append, on_error=print)
>>> worker.submit(50)
>>> worker.stop(timeout_s=5.0)
True
>>> seen
[50]

:class:`BackgroundSink` is the same thread for a sink's ``log(summary, step)`` alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["BackgroundSink", "BackgroundWorker", "MAX_SHARE"]

#: The largest share of wall time the worker's jobs take: after a job of ``d`` seconds
#: it rests ``d * (1 / MAX_SHARE - 1)`` (a 3 ms summary and write, then 297 ms), so on a
#: fast loop it takes the GIL from the training thread that little. ``d`` is wall time:
#: waiting for the GIL counts, so a busier training thread gets longer rests. With 3 ms
#: jobs, intervals 300 ms or more apart (50 steps of 6 ms) are each summarised.
MAX_SHARE = 0.01

_NOTHING = object()  # no job pending (a job may be any object, None too)
# A rest is waited in slices of at most this (a long one is no error, and any clock may
# be given: each slice looks at it again).
_LONGEST_WAIT_S = 60.0


class BackgroundWorker:
    """Calls ``work(job)`` on a daemon thread for the newest job submitted, at most
    ``max_share`` of wall time.

    Args:
        work: Runs one job (on the worker's thread). An exception from it ends the
            worker: ``on_error`` gets it, later jobs are dropped.
        on_error: Called with that exception, on the worker's thread.
        max_share: The largest share of wall time the jobs take (0 < share <= 1);
            None: :data:`MAX_SHARE` as it is when the worker is made.
        name: The thread's name.
        clock: Seconds, monotonic (tests pass a fake one: the rests follow it).
    """

    def __init__(
        self,
        work: Callable[[Any], None],
        on_error: Callable[[BaseException], None],
        *,
        max_share: float | None = None,
        name: str = "dtprofile-worker",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        share = MAX_SHARE if max_share is None else max_share
        if not 0.0 < share <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {share!r}")
        self._work = work
        self._on_error = on_error
        self._rest_per_busy_s = 1.0 / share - 1.0  # seconds of rest per second of work
        self._name = name
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: Any = _NOTHING
        self._busy = False
        self._idle = False  # waiting for a job, the rest over
        self._hurry = 0  # flush() calls waiting: what is pending runs without the rest
        self._stopping = False
        self._failed = False
        self._rest_until = float("-inf")  # the clock's time the next job may start at
        self._thread: threading.Thread | None = None
        self.coalesced = 0  # jobs replaced by a newer one before they ran
        self.done = 0  # jobs run

    def submit(self, job: Any) -> None:
        """Queue ``job``; returns at once. A job still waiting is replaced (and counted
        in ``coalesced``).

        Args:
            job: Handed to ``work`` as it is.
        """
        with self._cond:
            if self._failed or self._stopping:
                return
            if self._pending is not _NOTHING:
                self.coalesced += 1
            self._pending = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._idle or self._clock() >= self._rest_until:
                # Not while it rests: it wakes at the rest's end by itself, and waking it for
                # each interval would cost the training thread a thread switch every time.
                self._cond.notify_all()

    def rest_left_s(self) -> float:
        """Seconds before a job submitted now could start: what is left of the rest after
        the last job (0 while a job runs: its rest is not known yet, or before the first)."""
        if self._busy or self._thread is None:
            return 0.0
        return max(0.0, self._rest_until - self._clock())

    def _next_job(self) -> Any:
        """The pending job once the rest is over (at once when flushing or stopping);
        _NOTHING when stopping with nothing pending."""
        with self._cond:
            while True:
                if self._pending is _NOTHING and self._stopping:
                    return _NOTHING
                wait_s = 0.0 if (self._hurry or self._stopping) else self._rest_until - self._clock()
                if wait_s > 0.0:  # resting, a job pending or not: submit() does not wake it
                    self._cond.wait(min(wait_s, _LONGEST_WAIT_S))
                elif self._pending is _NOTHING:
                    self._idle = True  # only submit() ends this wait
                    try:
                        self._cond.wait()
                    finally:
                        self._idle = False
                else:
                    job, self._pending = self._pending, _NOTHING
                    self._busy = True
                    return job

    def _run(self) -> None:
        while True:
            job = self._next_job()
            if job is _NOTHING:
                return
            started = self._clock()
            try:
                self._work(job)
            except Exception as exc:  # the worker ends; training goes on
                with self._cond:
                    self._failed = True
                    self._pending = _NOTHING
                self._on_error(exc)
            finally:
                ended = self._clock()
                with self._cond:
                    self._busy = False
                    self.done += 1
                    self._rest_until = ended + (ended - started) * self._rest_per_busy_s
                    self._cond.notify_all()
            if self._failed:
                return

    def flush(self, timeout_s: float) -> bool:
        """Run what is pending now (not after the rest) and wait until it is done.

        Args:
            timeout_s: The longest wait, in seconds.

        Returns:
            False when the time ran out first.
        """
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._pending is _NOTHING and not self._busy, timeout=timeout_s)
            finally:
                self._hurry -= 1

    def stop(self, timeout_s: float) -> bool:
        """Run what is pending, then end the thread.

        Args:
            timeout_s: The longest wait for each of the two, in seconds.

        Returns:
            False when the time ran out first (the thread is a daemon: it ends with the
            process).
        """
        done = self.flush(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            done = done and not self._thread.is_alive()
        return done


class BackgroundSink(BackgroundWorker):
    """Calls ``sink.log(summary, step)`` on a daemon thread, newest-wins, at most
    :data:`MAX_SHARE` of wall time (a :class:`BackgroundWorker` whose job is the write).

    Args:
        sink: Has ``log(summary, step)``.
        on_error: Called with the exception that ended the writes (the sink failed).
        max_share: As for :class:`BackgroundWorker`.

    >>> class Printer:
    ...     def __init__(self): self.seen = []
    ...     def log(self, summary, step): self.seen.append(step)
    >>> sink = Printer(); bg = BackgroundSink(sink, on_error=print)
    >>> bg.submit({}, 50)
    >>> bg.stop(timeout_s=5.0)
    True
    >>> sink.seen
    [50]
    """

    def __init__(self, sink: Any, on_error: Callable[[BaseException], None], *, max_share: float | None = None) -> None:
        super().__init__(lambda item: sink.log(*item), on_error, max_share=max_share, name="dtprofile-sink")

    def submit(self, summary: dict[str, Any], step: int) -> None:  # type: ignore[override]
        """Queue an interval for writing; returns at once.

        Args:
            summary: The interval's summary, handed to ``sink.log`` as it is.
            step: The global optimizer step it is logged at.
        """
        super().submit((summary, step))

    @property
    def replaced(self) -> int:
        """Intervals superseded before they were written."""
        return self.coalesced
