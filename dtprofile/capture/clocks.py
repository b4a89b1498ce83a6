"""Clocks: where a phase boundary gets its timestamp.

A *mark* is an opaque timestamp taken by a clock. The engine only ever asks a clock
three things: take a mark now, is this mark's time known yet, and how many
milliseconds lie between two known marks. Two clocks implement that:

- :class:`HostClock` (CPU runs): a mark is ``time.perf_counter()``; always known.
- :class:`CudaEventClock` (GPU runs): a mark is a ``torch.cuda.Event`` recorded on the
  current stream. Its time is known once ``query()`` says the device got there; the
  engine keeps the step pending until then, so reading it back never blocks and the
  profiler adds no synchronisation to a training step.

Tests drive the engine through :class:`FakeEventClock`, whose marks complete only when
the test says so: the same lazy read-back logic as CUDA, on a machine with no GPU.

>>> clock = HostClock()
>>> a = clock.mark(); b = clock.mark()
>>> clock.ready(b) and clock.elapsed_ms(a, b) >= 0.0
True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Clock", "HostClock", "CudaEventClock", "FakeEventClock", "LazyScalar", "make_clock", "mark_reader"]

# Events are recycled to avoid an allocation per mark; the pool is capped so memory
# stays bounded even if the engine drops a burst of pending steps.
_EVENT_POOL_MAX = 512


class Clock(Protocol):
    kind: str

    def mark(self) -> Any: ...

    def ready(self, mark: Any) -> bool: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def release(self, mark: Any) -> None: ...


class HostClock:
    """Wall-clock marks from ``time.perf_counter`` (seconds, float)."""

    kind = "perf_counter"

    # The C function itself, not a method calling it: a mark is taken several times a
    # step, and a Python frame costs more than the timestamp.
    mark = staticmethod(time.perf_counter)

    def ready(self, mark: float) -> bool:
        return True

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def release(self, mark: float) -> None:
        pass


class CudaEventClock:
    """Device-timeline marks: CUDA events recorded on the current stream.

    ``mark()`` enqueues an event and returns at once. ``ready()`` is ``Event.query()``,
    which never waits. ``elapsed_ms`` is only called on completed events, so
    ``cudaEventElapsedTime`` does not block either.
    """

    kind = "cuda_event"

    def __init__(self) -> None:
        self._pool: list[torch.cuda.Event] = []

    def mark(self) -> torch.cuda.Event:
        try:  # marks come from several threads (gloo's callbacks): check-then-pop can race
            event = self._pool.pop()
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return bool(mark.query())

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))

    def release(self, mark: torch.cuda.Event) -> None:
        if len(self._pool) < _EVENT_POOL_MAX:
            self._pool.append(mark)


class FakeEvent:
    """A stand-in for a CUDA event: a device time that is known only once completed."""

    __slots__ = ("time_ms", "done")

    def __init__(self, time_ms: float) -> None:
        self.time_ms = time_ms
        self.done = False


class FakeEventClock:
    """The CPU twin of :class:`CudaEventClock` for tests.

    The device timeline is ``now_ms`` (advance it with :meth:`advance`); every mark is
    pending until :meth:`complete_all` (the device caught up) is called. Reading a
    pending mark raises, as ``elapsed_time`` on an unfinished CUDA event would; so do
    releasing a mark twice and asking about a released one (with CudaEventClock's pool,
    its event may be recording another mark by then).
    """

    kind = "cuda_event"

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.marks: list[FakeEvent] = []
        self.released = 0
        self.released_marks: list[FakeEvent] = []  # tests only: grows with the run
        self._released_ids: set[int] = set()

    def advance(self, ms: float) -> None:
        self.now_ms += ms

    def mark(self) -> FakeEvent:
        event = FakeEvent(self.now_ms)
        self.marks.append(event)
        return event

    def ready(self, mark: FakeEvent) -> bool:
        self._check_held(mark)
        return mark.done

    def elapsed_ms(self, start: FakeEvent, end: FakeEvent) -> float:
        self._check_held(start)
        self._check_held(end)
        if not (start.done and end.done):
            raise RuntimeError("elapsed_ms on an event that has not completed (would synchronise)")
        return end.time_ms - start.time_ms

    def release(self, mark: FakeEvent) -> None:
        if id(mark) in self._released_ids:
            raise RuntimeError("mark released twice: two later marks would share one event")
        self.released += 1
        self.released_marks.append(mark)  # (kept: their ids stay theirs)
        self._released_ids.add(id(mark))

    def _check_held(self, mark: FakeEvent) -> None:
        """A released event may already be recording another mark (CudaEventClock's pool)."""
        if id(mark) in self._released_ids:
            raise RuntimeError("a mark read after it was released: its event may hold another mark by now")

    def complete_all(self) -> None:
        for event in self.marks:
            event.done = True
        self.marks.clear()


class LazyScalar:
    """A 0-dim tensor's value, read without blocking the device.

    On the CPU the value is read at once. On CUDA it is copied into pinned host memory
    with ``non_blocking=True`` and an event is recorded behind the copy; ``value()``
    returns ``None`` until that event completes.
    """

    __slots__ = ("_host", "_event", "_value")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._value: float | None = None
        self._event = None
        self._host = None
        if tensor.device.type == "cuda":
            self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor.detach(), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._value = float(tensor)

    def value(self) -> float | None:
        if self._value is None and self._event is not None and self._event.query():
            self._value = float(self._host)  # type: ignore[arg-type]
        return self._value


def make_clock(device: torch.device) -> Clock:
    """The clock for a model on ``device``: CUDA events on GPUs, perf_counter elsewhere."""
    if device.type == "cuda":
        return CudaEventClock()
    return HostClock()


def mark_reader(clock: Clock, start: Any) -> Callable[[Any], float]:
    """Milliseconds from ``start`` to a mark, each mark read once: on a device clock each
    reading is a driver call."""
    known: dict[int, float] = {id(start): 0.0}

    def read(mark: Any) -> float:
        ms = known.get(id(mark))
        if ms is None:
            ms = known[id(mark)] = clock.elapsed_ms(start, mark)
        return ms

    return read
