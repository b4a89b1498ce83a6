"""The step tracker: open, close and drain training steps; what is left out of them.

A step opens where the last one closed. Its marks (forward, backward, optimizer,
communication, data wait, spans left out) are added by the hooks while it runs; when
the step-bounding optimizer's step ends (or a skip is detected) it closes, waits in
``pending`` until every mark's time is known (CUDA events complete later), and is then
turned into a :class:`~dtprofile.capture.records.StepRecord` and added to the windows.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, cast

import numpy as np

from ..options import BACKWARD_TIMING_AUTO, BACKWARD_TIMING_EVERY_AUTO, Options
from .clocks import Clock
from .lane import DeviceRow, SteadyLane
from .parts import Parts, guarded
from .records import PendingStep
from .rows import simple_rows

# (the schedules, here too: their names were this module's first)
from .schedule import (
    BACKWARD_TIMING_FIRST,
    BUCKET_TIMING_FIRST,
    PROBE_EVERY_AUTO,
    PROBE_FIRST,
    auto_backward_every,
    next_timed_backward,
    probes,
    times_backward,
    times_buckets,
)
from .windows import Window

__all__ = [
    "StepTracker",
    "RUN_WINDOW",
    "PROBE_WINDOW",
    "MAX_PENDING",
    "MAX_PASSES_PER_STEP",
    "MAX_COLLECTIVES_PER_STEP",
    "RECENT_STEP_SHAPES",
    "STEP_SIZE_MIN_SHARE",
    "BUCKET_TIMING_FIRST",
    "BACKWARD_TIMING_FIRST",
    "PROBE_FIRST",
    "ROWS_BATCH",
    "PROBE_EVERY_AUTO",
    "auto_backward_every",
    "next_timed_backward",
    "probes",
    "times_backward",
    "times_buckets",
]

# The final summary averages the last RUN_WINDOW steps (bounded memory).
RUN_WINDOW = 2048
PROBE_WINDOW = 64
# Steps whose device timestamps are still unknown; beyond this the oldest are dropped
# (it only happens if the device never catches up, e.g. a hung kernel).
MAX_PENDING = 256
#: Passes (forward, backward) and collectives one step records at most: a loop that
#: never steps the optimizer (inference with gradients on) would otherwise grow the open
#: step without bound. Accumulation over 1024 micro-batches stays inside it.
MAX_PASSES_PER_STEP = 1024
MAX_COLLECTIVES_PER_STEP = 16 * MAX_PASSES_PER_STEP
#: Updating steps remembered for the run's typical micro-batches and all-reducing passes.
RECENT_STEP_SHAPES = 64
#: A micro-batch count is one of the run's step sizes when this share of the steps has it.
STEP_SIZE_MIN_SHARE = 0.1
#: Drained steps held as rows of raw marks before their figures are computed and added to
#: the windows together (at most this many; a reader on the training thread flushes them
#: first). numpy's arithmetic costs about as much for 10 rows as for 100: inside a
#: training loop a batch this size costs about 1.5 us a row, one of 50 rows about 4.
ROWS_BATCH = 256


def most_common(values: Collection[int]) -> int | None:
    """The most frequent value (the larger on a tie); None when there is none.

    >>> most_common(deque([4, 4, 4, 2]))
    4
    """
    if not values:
        return None
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: (counts[v], v))


def micro_batches(step: PendingStep) -> int:
    """The step's micro-batches: the batches fetched in it through the profiled loader;
    without one, its forward passes, where a closure's evaluations inside
    ``optimizer.step`` (LBFGS: several of one batch) count as one. (A batch may take
    several forwards: SAM's two passes, a GAN's discriminator on real and fake, two views.)"""
    if step.fetches:
        return step.fetches
    return len(step.forward) - max(0, step.forwards_in_update - 1)


def sizes_seen(counts: dict[int, int]) -> list[int] | None:
    """The micro-batch counts of the run's steps when there were several (Lightning's
    GradientAccumulationScheduler), each held by at least :data:`STEP_SIZE_MIN_SHARE` of
    the steps (not an epoch's last, partial accumulation); else None."""
    total = sum(counts.values())
    sizes = sorted(c for c, n in counts.items() if n >= 2 and n >= STEP_SIZE_MIN_SHARE * total)
    return sizes if len(sizes) > 1 else None


def _training_passes(step: PendingStep) -> int:
    return len(step.forward) + len(step.backward)


class StepTracker:
    """The open step, the closed steps still pending, the windows and the step counts.

    Args:
        options: the run's options (warm-up, log interval, probes).
        clock: where marks come from.
        parts: the profiler's parts (the guard reads them).

    The owner connects what happens around a step: ``can_probe`` (whether the next
    step may hold its reductions), ``on_closed(step)`` (a step closed), ``on_drained(step)``
    (its record was made: the noise sample), ``on_steady_state()`` (warm-up ended),
    ``before_drain()``, ``on_interval()`` (a log interval is due: the callee flushes the
    rows into the windows, or sets the interval aside) and ``on_pause()`` (training pauses:
    a loader's pass starts, or work that is not training).
    """

    def __init__(self, options: Options, clock: Clock, parts: Parts) -> None:
        self.options = options
        self.clock = clock
        self.parts = parts
        # An interval longer than the run window keeps its last RUN_WINDOW steps (bounded).
        self.interval = Window(min(options.every_n_steps, RUN_WINDOW))
        self.run = Window(RUN_WINDOW)
        self.probes = Window(PROBE_WINDOW)
        self.alone = Window(PROBE_WINDOW)  # probes whose passes ran one rank at a time
        # Closed steps whose marks are not all known yet (the lane's are DeviceRows), oldest first.
        self.pending: deque[PendingStep | DeviceRow] = deque()
        self._rows: list[tuple[float, ...]] = []  # drained steps' raw marks, not yet in the windows
        # A log interval nobody summarised when it ended (set_interval_aside): its window,
        # kept for a summary later, and where its rows and the open interval's start in _rows.
        self.aside: Window | None = None
        self._aside_from = self._interval_from = 0
        self._thread = threading.get_ident()
        self._current: PendingStep | None = None
        # Holds the watched parameter once a backward has reached it in the open step:
        # the hook that stays on it is this deque's append (Engine._watch_backward), so a
        # backward runs no Python of ours for it. Emptied as each step opens (start_step,
        # the lane's close).
        self.backward_reached: deque[Any] = deque(maxlen=1)
        self._backward_seen_held = False  # the open step's, while held (hold_backward_seen)
        # backward_timing_every="auto": (steps seen, host time in seconds) as each of the
        # steps it is chosen from opened, then the choice (auto_backward_every).
        self._auto_marks: list[tuple[int, float]] = []
        self._auto_every: int | None = None
        self.lane = SteadyLane(self)
        self.data_wait_source = "gap"
        self.steps_seen = 0
        self.steps_finalized = 0
        self.steps_dropped = 0
        self.steps_skipped_update = 0  # after warm-up; see UpdateTracker.end_step_without_update
        self.steps_without_backward = 0  # after warm-up
        self.steps_with_eval_forwards = 0  # after warm-up: steps whose model ran in eval mode (left out)
        self.halves_pending = 0  # pending steps found to be halves of one step: not recorded
        self.probing = False
        self.excluding = 0  # depth of exclude_start() calls not yet ended
        self.excluded_at = -1  # training passes of the step when the last excluded span ended
        # The run's micro-batches and all-reducing passes per step: the most common over the
        # recent updating steps (the last one may be an epoch's partial accumulation).
        self.micro_batches_last = 0
        self.micro_batches_recent: deque[int] = deque(maxlen=RECENT_STEP_SHAPES)
        self.micro_batches_seen: dict[int, int] = {}  # count -> steady steps with it (a few counts)
        self.sync_passes_recent: deque[int] = deque(maxlen=RECENT_STEP_SHAPES)
        self.can_probe: Callable[[], bool] = lambda: False
        self.on_closed: Callable[[PendingStep], None] = lambda step: None
        self.on_drained: Callable[[PendingStep], None] = lambda step: None
        self.on_steady_state: Callable[[], None] = lambda: None
        self.before_drain: Callable[[], None] = lambda: None
        self.on_interval: Callable[[], None] = lambda: None
        self.on_pause: Callable[[], None] = lambda: None

    @property
    def current(self) -> PendingStep:
        """The open step. While the steady lane holds it (:mod:`.lane`), reading it turns
        the lane's marks into this step first."""
        if self.lane.open:
            self.lane.leave()
        # None only before the first step opens (start_step), before any hook reads it.
        return cast(PendingStep, self._current)

    @current.setter
    def current(self, step: PendingStep | None) -> None:
        self._current = step

    @property
    def open_record(self) -> PendingStep | None:
        """The open step's record as it is, without leaving the steady lane: None while
        the lane holds the step (no record yet; its communication, DDP's broadcast of
        the buffers, must end before the lane closes the step)."""
        return self._current

    def leave_lane(self) -> None:
        """The open step leaves the steady lane, if it is there (see :attr:`current`)."""
        if self.lane.open:
            self.lane.leave()

    @property
    def backward_seen(self) -> bool:
        """A backward reached the watched parameter in the open step: on a step whose
        backward is not timed, what tells a skipped update from a second forward."""
        return bool(self.backward_reached)

    def hold_backward_seen(self) -> None:
        """The backward passes the hook sees from now until :meth:`release_backward_seen`
        are not the open step's (a framework's trial steps, run while suspended)."""
        self._backward_seen_held = self.backward_seen

    def release_backward_seen(self) -> None:
        """Back to what :meth:`hold_backward_seen` found."""
        self.backward_reached.clear()
        if self._backward_seen_held:
            self.backward_reached.append(True)

    @property
    def backward_every(self) -> int:
        """Without a process group, every this many steps time backward (see
        :func:`times_backward`): ``backward_timing_every`` (``"auto"``: as chosen so far,
        :meth:`_note_step_time`), and at least once per log interval, so that each
        interval has a backward figure."""
        every = self.options.backward_timing_every
        if every == BACKWARD_TIMING_AUTO:
            every = self._auto_every or BACKWARD_TIMING_EVERY_AUTO
        return min(every, self.options.every_n_steps)

    def _note_step_time(self) -> None:
        """``backward_timing_every="auto"``: the host time as a step opens, until the first
        :data:`BACKWARD_TIMING_FIRST` steps after warm-up (all of which time their passes)
        have run; then the choice, :func:`auto_backward_every` of their median step, for
        good. (Called as each of them opens: the general path's :meth:`open_step` and
        the lane's schedule, :meth:`next_timed_backward`.) A median, so that a pause among
        them (an evaluation, an epoch's end, a suspended span) does not count as steps."""
        if (
            self._auto_every is not None
            or self.options.backward_timing_every != BACKWARD_TIMING_AUTO
            or self.steps_seen < self.options.warmup_steps
        ):
            return
        marks = self._auto_marks
        if marks and marks[-1][0] == self.steps_seen:
            return  # (asked twice as one step opens)
        marks.append((self.steps_seen, time.perf_counter()))
        if self.steps_seen - marks[0][0] >= BACKWARD_TIMING_FIRST:
            step_s = [(t1 - t0) / (n1 - n0) for (n0, t0), (n1, t1) in zip(marks, marks[1:], strict=False)]
            self._auto_every = auto_backward_every(float(np.median(step_s)))
            marks.clear()

    def next_timed_backward(self) -> int:
        """The first step from the open one on that times its backward."""
        self._note_step_time()
        return next_timed_backward(self.steps_seen, self.options.warmup_steps, self.backward_every)

    @property
    def warmed_up(self) -> bool:
        """The steps seen so far are past the warm-up."""
        return self.steps_seen >= self.options.warmup_steps

    # ------------------------------------------------------------------ open and close
    def start_step(self, start_mark: Any) -> None:
        """A new step opens at ``start_mark``, no backward seen in it yet. (The lane's
        leave() only rebuilds the open step: :meth:`open_step`.)"""
        self.open_step(start_mark)
        self.backward_reached.clear()

    def open_step(self, start_mark: Any) -> None:
        index, options = self.steps_seen, self.options
        warmup = options.warmup_steps
        step = self._current = PendingStep(start=start_mark, index=index)
        step.probe = self.probing = probes(index, warmup, options.probe_every) and self.can_probe()
        step.times_buckets = self.probing or times_buckets(index, warmup, options.bucket_timing_every)
        self._note_step_time()
        step.times_backward = times_backward(index, warmup, self.backward_every)

    def close_step(
        self, end_mark: Any, skipped: bool = False, counted_as_skip: bool = True, ends_now: bool = True
    ) -> None:
        """Close the current step at ``end_mark`` and open the next there.

        ``ends_now``: ``end_mark`` was taken just now, so the profiler's own work from it
        on (closing, draining, an interval's gather and summary) is left out of the next
        step; else only an interval's work is. On a GPU that leaves out only what the
        device idled for it.
        """
        step = self.current
        step.end = end_mark
        step.skipped = skipped
        warmed_up = self.warmed_up
        if skipped and counted_as_skip and warmed_up:
            self.steps_skipped_update += 1
        # Passes whose end never came (a pass raised) cannot be timed: their marks go back.
        if step.backward:  # (none on a step whose backward is not timed)
            step.backward = self.timed_only(step.backward)
        step.forward = self.timed_only(step.forward)
        if step.outside_update:
            step.outside_update = self.timed_only(step.outside_update)
        if step.no_grad_forward is not None:
            self.drop_no_grad_forward(step)  # not a reentrant checkpoint's forward after all
        if step.excluded and step.excluded[-1][1] is None:  # an evaluation forward raised
            self.clock.release(step.excluded.pop()[0])
            self.excluding = 0
        self.micro_batches_last = count = micro_batches(step)
        if step.eval_forwards and warmed_up:
            self.steps_with_eval_forwards += 1
        if not skipped and warmed_up:
            self.note_micro_batches(count)
            if step.comm and any(c.reduces_gradients for c in step.comm):  # every start of the step has run by now
                self.sync_passes_recent.append(len({c.pass_index for c in step.comm if c.reduces_gradients}))
        self.on_closed(step)
        self.pending.append(step)
        self.steps_seen += 1
        if self.steps_seen == self.options.warmup_steps:
            self.on_steady_state()
        self.start_step(end_mark)
        own_work_from = end_mark if ends_now else None
        try:
            self.drain(flush=False)
            if self.steps_seen % self.options.every_n_steps == 0:
                if own_work_from is None:
                    own_work_from = self.clock.mark()
                self.on_interval()
        finally:
            if own_work_from is not None:
                # Its own span: an evaluation pass right after it is not merged into it.
                self.current.excluded.append([own_work_from, self.clock.mark()])
                self.excluded_at = -1
        self.lane.try_open()

    def note_micro_batches(self, count: int) -> None:
        """An updating step after warm-up had ``count`` micro-batches (the run's typical
        count and the counts seen)."""
        self.micro_batches_recent.append(count)
        seen = self.micro_batches_seen
        if count in seen:
            seen[count] += 1
        elif len(seen) < 32:  # (a few counts: an accumulation schedule's)
            seen[count] = 1

    def close_without_backward(self, end_mark: Any) -> None:
        """A batch the training code skipped before backward: out of the averages, counted
        in ``steps_without_backward``."""
        self.close_step(end_mark, skipped=True, counted_as_skip=False)
        if self.steps_seen > self.options.warmup_steps:
            self.steps_without_backward += 1

    def drain(self, flush: bool = True) -> None:
        """Turn every step whose marks are all known into a record, oldest first.

        ``flush``: the rows go into the windows now too, for a reader of the windows;
        each step's close drains without, and the rows go in by the batch.

        Steps of the common shape are kept as rows of raw marks
        (:meth:`~dtprofile.capture.records.PendingStep.raw_marks`; a device clock's
        events are read into seconds there), whose figures are computed together when
        they go into the windows (:meth:`flush`); every other step's record goes in at
        once, after them.
        """
        self.before_drain()
        device = None if self.clock.kind == "perf_counter" else self.clock
        while self.pending:
            step = self.pending[0]
            if type(step) is DeviceRow:  # (the lane's steps on a device clock)
                if not self._read_device_row(step):
                    break
                continue
            if not step.ready(self.clock):
                break
            self.pending.popleft()
            self.steps_finalized += 1
            if (
                not (self.halves_pending or step.skipped or step.probe or step.alone or step.irregular)
                and self.steps_finalized > self.options.warmup_steps
            ):
                row = step.raw_marks(self.data_wait_source == "loader", device)
                if row is not None:  # (no sampled interval: nothing for on_drained to sample)
                    self.add_row(row)
                    if device is not None:  # only events go back to a pool
                        step.release(device)
                    continue
            self._add(step)
        if flush:
            self.flush()
        self._drop_beyond_max_pending()

    def drain_device_rows(self) -> None:
        """The steady lane's steps on a device clock at the front of ``pending`` whose
        events the device has passed, as rows: :meth:`drain` at a lane step's close.
        The step just closed is left for the next close (the device is still running
        it: a query that would fail), so that while the device is behind a close costs
        one query."""
        pending = self.pending
        while len(pending) > 1 and type(pending[0]) is DeviceRow and self._read_device_row(pending[0]):
            pass
        if pending and type(pending[0]) is not DeviceRow:  # the general path's steps first (after a leave)
            self.drain(flush=False)
            return
        self._drop_beyond_max_pending()

    def _drop_beyond_max_pending(self) -> None:
        """The oldest pending steps beyond :data:`MAX_PENDING`, dropped (a device that
        never catches up): their marks go back, they count in ``steps_dropped``."""
        while len(self.pending) > MAX_PENDING:
            self.pending.popleft().release(self.clock)
            self.steps_dropped += 1

    def _read_device_row(self, step: DeviceRow) -> bool:
        """``step``, first in ``pending``, read into a row of raw marks (False: not yet)."""
        row = step.read(self.clock)
        if row is None:
            return False
        self.pending.popleft()
        self.steps_finalized += 1
        if self.halves_pending:  # (taken back: a part of a step, not recorded)
            self.halves_pending -= 1
        else:
            self.add_row(row)
        step.release(self.clock)
        return True

    def add_row(self, row: tuple[float, ...]) -> None:
        """A drained step's row of raw marks; the rows go into the windows by the batch
        (:data:`ROWS_BATCH`), or when a reader flushes them."""
        self._rows.append(row)
        if len(self._rows) >= ROWS_BATCH:
            self.flush()

    def _add(self, step: PendingStep) -> None:
        """One drained step's record into its window (counted in ``steps_finalized``)."""
        record = step.to_record(self.clock, self.data_wait_source)
        self.on_drained(step)
        if self.clock.kind != "perf_counter":  # only events go back to a pool
            step.release(self.clock)
        if self.halves_pending:
            self.halves_pending -= 1
            return
        if self.steps_finalized <= self.options.warmup_steps:
            return
        if step.skipped or step.irregular:
            return  # did a step's work and updated nothing, or a pass no step is like: not a step to model
        if step.alone:
            self.alone.add(record)
        elif record.probe:
            self.probes.add(record)
        else:
            self.flush()  # the rows before it first
            values = record.values()
            self.interval.add_values(values)
            self.run.add_values(values)

    def on_own_thread(self) -> bool:
        """Whether the caller runs on the thread that made this tracker (the training
        thread), the only one that may :meth:`flush` while steps go on."""
        return threading.get_ident() == self._thread

    def flush(self) -> None:
        """The steps drained as rows of marks into the windows (before the training thread
        reads them: a log interval, a summary)."""
        if self._rows:
            held, self._rows = self._rows, []
            aside_from, interval_from = self._aside_from, self._interval_from
            self._aside_from = self._interval_from = 0
            rows = simple_rows(np.array(held, dtype=float))
            self.run.add_rows(rows)
            if self.aside is not None and interval_from > aside_from:
                self.aside.add_rows(rows[aside_from:interval_from])
            if interval_from < len(rows):
                self.interval.add_rows(rows[interval_from:])

    def set_interval_aside(self) -> None:
        """End the log interval without computing its figures: its window goes aside
        whole (with its rows still held as marks) for a summary later
        (:meth:`take_interval_aside`), the one set aside before it is dropped, and the next
        interval starts empty. The run's window gets every row all the same."""
        self._aside_from, self._interval_from = self._interval_from, len(self._rows)
        dropped, self.aside = self.aside, self.interval
        self.interval = dropped if dropped is not None else Window(self.aside.capacity)
        self.interval.clear()

    def take_interval_aside(self) -> Window | None:
        """The interval set aside last, with all its steps (None if none, or once an
        interval after it was logged: :meth:`drop_interval_aside`)."""
        self.flush()
        aside, self.aside = self.aside, None
        return aside

    def drop_interval_aside(self) -> None:
        """No interval set aside is wanted any more (a later one is logged): its rows
        still held go into the run's window only."""
        self.aside = None

    def take_back(self, splits: int) -> None:
        """The last ``splits`` step closes were parts of steps, not steps (a loop that
        zeroes the gradients between two backward passes of one step): count them once,
        and keep their parts out of the averages and the warm-up."""
        self.steps_seen -= splits
        self.steps_finalized -= splits
        self.current.index = self.steps_seen
        self.halves_pending = len(self.pending)
        self._rows = []
        self.aside = None
        self._aside_from = self._interval_from = 0
        for window in (self.interval, self.run, self.probes, self.alone):
            window.clear()
        self.micro_batches_recent.clear()  # the halves' shapes
        self.micro_batches_seen.clear()
        self.sync_passes_recent.clear()
        # (the step time backward_timing_every="auto" took may have been of halves)
        self._auto_marks.clear()
        self._auto_every = None

    # ------------------------------------------------------------------ marks
    def timed_only(self, spans: list[Any]) -> list[Any]:
        """``spans`` whose every mark was taken; the others' marks go back to the clock."""
        for span in spans:
            if None in span:
                break
        else:
            return spans  # (the common case: no new list)
        kept = []
        for span in spans:
            if None in span:
                for mark in span:
                    if mark is not None:
                        self.clock.release(mark)
            else:
                kept.append(span)
        return kept

    def drop_no_grad_forward(self, step: PendingStep) -> None:
        for mark in step.no_grad_forward or ():
            if mark is not None:
                self.clock.release(mark)
        step.no_grad_forward = None

    def open_span(self, spans: list[Any]) -> list[Any]:
        """A ``[start, end]`` span starting now, appended to ``spans``; end it with
        :meth:`close_span`."""
        span = [self.clock.mark(), None]
        spans.append(span)
        return span

    def close_span(self, span: list[Any], part_name: str) -> None:
        """End ``span`` now (unguarded: the start was taken, so the end must be, or the
        step would wait for it); an error disables ``part_name``."""
        try:
            span[1] = self.clock.mark()
        except Exception as exc:
            self.parts[part_name].fail(exc)

    # ------------------------------------------------------------------ left out of the step
    @guarded("timing")
    def exclude_start(self) -> None:
        """Work that is not training starts now (an evaluation pass): left out of the step.

        Calls nest; the span ends with the matching :meth:`exclude_end`.
        """
        self.excluding += 1
        if self.excluding > 1:
            return
        step = self.current
        last = step.excluded[-1] if step.excluded else None
        if (
            last is not None
            and last[1] is not None
            and self.excluded_at == _training_passes(step)
            and not step.backward_untimed
        ):  # (an untimed backward may have run in between)
            # Evaluation forwards with no training in between are one evaluation pass:
            # the host work between them (its loader, its metrics) is part of it.
            self.clock.release(last[1])
            last[1] = None
        else:
            step.excluded.append([self.clock.mark(), None])
        self.on_pause()  # (inside the span just opened: left out of the step)

    @guarded("timing")
    def exclude_end(self) -> None:
        """The work started by :meth:`exclude_start` ends now."""
        if not self.excluding:
            return
        self.excluding -= 1
        step = self.current
        if self.excluding == 0 and step.excluded and step.excluded[-1][1] is None:
            step.excluded[-1][1] = self.clock.mark()
            self.excluded_at = _training_passes(step)

    @guarded("timing")
    def loop_starts(self) -> None:
        """The loop begins a pass over its loader (an epoch, a notebook cell's loop): the
        open step has run no training pass yet, so the time since the last step ended
        was spent outside the loop (an epoch's end, a pause between cells) and is left
        out of the step."""
        self.on_pause()
        step = self.current
        if step.forward or step.fetches or step.no_grad_start is not None or step.start is None or self.excluding:
            return  # (fetched already: a second loader of the same loop, zip(prof.loader(a), prof.loader(b)))
        step.excluded.append([step.start, self.clock.mark()])
        self.excluded_at = -1
        step.data_wait_s = step.data_transfer_s = 0.0
