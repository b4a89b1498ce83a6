"""Data wait: the time a step waits for its next batch, measured in one place.

Two sources, and the summary's ``data_wait_source`` says which a run used:

- ``"loader"``: the loop iterates ``prof.loader(...)`` (:func:`timed_loader`), or a
  framework reports its fetches (Lightning's fetcher and batch transfer): the host time
  blocked in ``next()`` (:meth:`DataWait.add`);
- ``"gap"``: otherwise, the time from a step's end to the next forward (or to a no-grad
  forward in train mode, whichever comes first), computed from the step's marks when
  its record is made (:meth:`dtprofile.capture.records.PendingStep.to_record`).

On CUDA the data wait is the device's gap, capped by the host's wait in loader mode
(the record does that too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

from .handoff import HandoffProbe
from .parts import Parts, guarded
from .records import PendingStep
from .steps import StepTracker
from .tensors import sample_shapes, tensor_bytes

__all__ = ["DataWait", "FETCH_CPU_EVERY", "cpu_clock_if_sampled", "cpu_since", "timed_loader"]

FETCH_CPU_EVERY = 8
"""One fetch in this many also reads this thread's CPU clock (``time.thread_time``, a
system call that costs several ``perf_counter`` reads), and stands for the others in the
loader's CPU time. The first fetch of a ``prof.loader`` pass, which also starts the
loader (its worker processes, its sampler), always reads it and counts as itself."""


def cpu_clock_if_sampled(fetched: int) -> float | None:
    """This thread's CPU clock as fetch number ``fetched`` (from 0) starts, when it is
    one of those that read it (:data:`FETCH_CPU_EVERY`); else None."""
    return time.thread_time() if fetched % FETCH_CPU_EVERY == 0 else None


def cpu_since(c0: float | None) -> float | None:
    """This thread's CPU seconds since ``c0`` (:func:`cpu_clock_if_sampled`), or None."""
    return None if c0 is None else time.thread_time() - c0


log = logging.getLogger(__name__)

T = TypeVar("T")


class DataWait:
    """Fetch times into the open step, and what the loader says about itself.

    Args:
        steps: the step tracker (its open step takes the waits).
        parts: the profiler's parts (the guard reads them).
    """

    def __init__(self, steps: StepTracker, parts: Parts) -> None:
        self.steps = steps
        self.parts = parts
        self._part = parts["data"]
        self.batch_size: int | None = None  # the loader's, else the first forward's
        self.num_workers: int | None = None
        # A batch's bytes (a pass's first through prof.loader, or the first of Lightning or
        # the Trainer): what a worker process would copy into shared memory to hand it over
        # (None: not seen).
        self.batch_bytes: int | None = None
        # Whether later batches, sampled, differ from that one in a shape past the batch
        # dimension (variable-length sequences; not a ragged last batch): None until one
        # was compared.
        self.sample_shapes_vary: bool | None = None
        self._sample_shapes: tuple[Any, ...] | None = None
        # What a worker's hand-over of such a batch would cost this machine (measured once,
        # by the first summary that needs it: run.shm_copy_ms, run.shm_release_ms).
        self.handoff = HandoffProbe()
        self.forward_open: Callable[[], bool] = lambda: False  # set by the owner (the pass hooks)
        # Run totals of the fetches (not the transfers), for the loader's CPU share
        # (:mod:`dtprofile.capture.cpu_time`): the fetches and the host time blocked in
        # them; this thread's CPU time (the main process's own loading when num_workers
        # is 0) in the sampled fetches, and how many; in the fetches that started a pass,
        # and how many.
        self.fetch_wall_s = 0.0
        self.fetch_count = 0
        self.fetch_cpu_s = 0.0
        self.fetch_cpu_samples = 0
        self.pass_start_cpu_s = 0.0
        self.pass_starts = 0

    @property
    def source(self) -> str:
        """``"loader"`` or ``"gap"`` (see the module's docstring)."""
        return self.steps.data_wait_source

    def use_loader(self) -> None:
        """The loop's fetches are timed: data wait is the time blocked in ``next()``."""
        self.steps.data_wait_source = "loader"

    def add(
        self, seconds: float, transfer: bool = False, cpu_seconds: float | None = None, starts_pass: bool = False
    ) -> None:
        """Host time blocked waiting for the next batch (counted in the current step).

        ``cpu_seconds``: this thread's CPU time during that wait (``time.thread_time``),
        when the caller read it (on one fetch in :data:`FETCH_CPU_EVERY`, which stands
        for the others). ``starts_pass``: the fetch also started the loader's pass (its
        CPU time counts as itself, not as a sample of the fetches).

        ``transfer``: the time went into the batch's transfer to the device (Lightning's
        batch transfer hooks), which the step waits for like a fetch; it is also reported
        on its own (``data_transfer``), since more loader workers do not shorten it.
        A fetch inside the forward (Lightning's ``training_step(self, dataloader_iter)``)
        is data wait, not forward: it is taken out of that forward's time.

        Runs on every fetch: it checks its part and turns its errors into ``Part.fail``
        itself, as ``@guarded`` would, without the guard's call.
        """
        if not (self.parts.measuring and self._part.enabled):
            return
        try:
            steps = self.steps
            lane = steps.lane
            if lane.lean and lane.f0 is not None:
                # A fetch after a lean step's forward (another micro-batch, or an update that
                # never came): the general path takes the step before it counts.
                lane.leave()
            step = lane if lane.open else steps.current  # (the lane's step takes the same figures)
            step.data_wait_s += seconds
            if transfer:
                step.data_transfer_s += seconds
            else:
                step.fetches += 1
                self.fetch_wall_s += seconds
                self.fetch_count += 1
                if starts_pass:
                    self.pass_start_cpu_s += cpu_seconds or 0.0
                    self.pass_starts += 1
                elif cpu_seconds is not None:
                    self.fetch_cpu_s += cpu_seconds
                    self.fetch_cpu_samples += 1
            if step is lane and lane.f0 is None:
                return  # (the lane's common fetch, before its forward: nothing more to note)
            if self.forward_open():
                step.data_wait_in_forward_s += seconds
            elif step.no_grad_start is not None and not cast(PendingStep, step).forward:  # (a lane's is None)
                # A no-grad pass, then a fetch: that pass was not this step's start (a metric
                # pass after the last step); the step's compute starts after the fetch.
                steps.clock.release(step.no_grad_start)
                step.no_grad_start = None
            if step.no_grad_forward is not None:
                steps.drop_no_grad_forward(step)  # the forward of a checkpoint comes after its fetch
        except Exception as exc:
            self._part.fail(exc)

    @guarded("data")
    def note_batch(self, batch: Any) -> None:
        """A batch's bytes (:attr:`batch_bytes`)."""
        try:
            self.batch_bytes = tensor_bytes(batch)
            self._sample_shapes = sample_shapes(batch)
        except Exception:  # (a tensor subclass without storage: the figure stays unknown)
            self.batch_bytes = None

    @guarded("data")
    def compare_batch(self, batch: Any) -> None:
        """A later batch (sampled): whether a sample's shape differs from the first batch's
        (:attr:`sample_shapes_vary`), which tells length bucketing from fixed shapes."""
        if self._sample_shapes is None or self.sample_shapes_vary:
            return
        try:
            shapes = sample_shapes(batch)
        except Exception:  # (as note_batch)
            return
        self.sample_shapes_vary = shapes != self._sample_shapes

    def note_loader(self, loader: Any) -> None:
        """Remember what a DataLoader says about itself (workers, batch size).

        Several loaders (a dict or list of them, Lightning's ``CombinedLoader``): the
        first one's figures.
        """
        try:
            iterables = getattr(loader, "iterables", loader)  # CombinedLoader
            if isinstance(iterables, dict):
                iterables = list(iterables.values())
            if isinstance(iterables, (list, tuple)):
                if iterables:
                    self.note_loader(iterables[0])
                return
            workers = getattr(loader, "num_workers", None)
            batch = getattr(loader, "batch_size", None)
        except Exception as exc:  # a loader's property that raises is not the run's problem
            log.debug("dtprofile: could not read the loader's settings: %r", exc)
            return
        if isinstance(workers, int) and not isinstance(workers, bool):
            self.num_workers = workers
        if isinstance(batch, int) and not isinstance(batch, bool):
            self.batch_size = batch  # the loader says; a reloaded one may say another


# ---------------------------------------------------------------- prof.loader(...)
def _timed_iter(iterable: Iterable[T], engine_of: Callable[[], Any]) -> Iterator[T]:
    """``iterable``'s batches, each ``next()`` timed into the engine running then."""
    clock, cpu_clock = time.perf_counter, time.thread_time
    engine = engine_of()
    if engine is not None and engine.active:
        engine.steps.loop_starts()  # what came before this pass (an epoch's end, a pause) is not a step's
    c0: float | None
    c0, t0 = cpu_clock(), clock()
    iterator = iter(iterable)  # (starting a DataLoader's workers: the first batch's wait)
    if engine is not None and engine.active:
        engine.cpu_time.watch(iterator)  # its worker processes, for their CPU time
    fetched = 0
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        engine = engine_of()
        if engine is not None:  # (add() does nothing unless it is measuring)
            wait_s = clock() - t0
            data = engine.data
            # (cpu_since and cpu_clock_if_sampled below, inline: this runs on every fetch)
            data.add(wait_s, False, None if c0 is None else cpu_clock() - c0, fetched == 0)
            if fetched == 0 or data.batch_bytes is None:  # (profiling may start mid-pass)
                data.note_batch(batch)
            elif fetched % FETCH_CPU_EVERY == 1 and not data.sample_shapes_vary:  # (sampled)
                data.compare_batch(batch)
        yield batch
        # (the pass's start, read above, stands apart: the sampled ones count from fetch 1)
        c0 = cpu_clock() if fetched % FETCH_CPU_EVERY == 0 else None
        fetched += 1
        t0 = clock()


def _is_iterator(obj: Any) -> bool:
    """Whether ``obj`` is its own iterator (a generator, ``iter(x)``): it yields one pass."""
    try:
        return hasattr(obj, "__next__") and iter(obj) is obj
    except Exception:
        return False


def _has_len(obj: Any) -> bool:
    try:
        len(obj)
    except Exception:  # (an IterableDataset's loader raises TypeError)
        return False
    return True


class _TimedLoader:
    """A re-iterable object, timed: each ``iter()`` is a new timed pass over the wrapped
    object (an epoch), and every attribute is the wrapped object's
    (``loader.sampler.set_epoch(epoch)`` works as without dtprofile)."""

    def __init__(self, iterable: Any, engine_of: Callable[[], Any]) -> None:
        self._dtprofile_wrapped = iterable
        self._dtprofile_engine_of = engine_of
        self._dtprofile_pass: Iterator[Any] | None = None  # the pass next() walks

    def __iter__(self) -> Iterator[Any]:
        return _timed_iter(self._dtprofile_wrapped, self._dtprofile_engine_of)

    def __next__(self) -> Any:
        """The next batch of a pass of its own (``batch = next(loader)`` in a step-based
        loop); once it ends (StopIteration), the next call starts a new pass."""
        if self._dtprofile_pass is None:
            self._dtprofile_pass = iter(self)
        try:
            return next(self._dtprofile_pass)
        except StopIteration:
            self._dtprofile_pass = None
            raise

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_dtprofile_"):  # (not set yet: copy/pickle ask before __init__)
            raise AttributeError(name)
        return getattr(self._dtprofile_wrapped, name)

    def __repr__(self) -> str:
        return f"dtprofile.loader({self._dtprofile_wrapped!r})"


class _TimedSizedLoader(_TimedLoader):
    """:class:`_TimedLoader` of an object with a ``len()``: the same length."""

    def __len__(self) -> int:
        return len(self._dtprofile_wrapped)


def timed_loader(iterable: Iterable[T], engine_of: Callable[[], Any]) -> Iterable[T]:
    """``iterable``, each ``next()`` timed as data wait of the engine ``engine_of()``
    returns at that moment (None, or not running: not timed).

    What comes back behaves like what it wraps: a re-iterable object (a DataLoader, a
    list) stays re-iterable, one timed pass per ``iter()``, with its ``len()`` and
    attributes (and ``next()`` walks a pass of its own); an iterator or generator stays a
    one-shot generator.

    Example:
        >>> loader = timed_loader([1, 2, 3], lambda: None)
        >>> len(loader), list(loader), list(loader)
        (3, [1, 2, 3], [1, 2, 3])
    """
    if _is_iterator(iterable):
        return _timed_iter(iterable, engine_of)
    if _has_len(iterable):
        return _TimedSizedLoader(iterable, engine_of)
    return _TimedLoader(iterable, engine_of)
