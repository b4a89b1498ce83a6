"""The steady lane: a loop's common step, taken as a handful of timestamps.

After warm-up most steps of a loop have one shape: batches fetched through the profiled
loader, one training forward (in a plain loop, or inside ``optimizer.step(closure)``
where the framework marks the update's start after it, as Lightning does), one
backward, one update of the step-bounding optimizer. With no process group, nothing
waits for gradients after backward, and backward's start and end are marked on a sample
of the steps only (``backward_timing_every``). Under DDP reducing with its own
all-reduce (no communication hook: the default), each step also marks when backward's
reductions were waited for, and notes the bytes its forward will reduce and DDP's
broadcast of the buffers in the forward, if it makes one (``synced``). While such steps
run, the hooks write their marks here, not into a
:class:`~dtprofile.capture.records.PendingStep`, and the update's end appends the step's
row of raw marks (:data:`~dtprofile.capture.rows.RAW_COLUMNS`, the row
:meth:`PendingStep.raw_marks` gives the same step) for the batched arithmetic of
:func:`~dtprofile.capture.rows.simple_rows`. A step costs its hooks a few attribute
writes each, not a record's building. On a device clock the marks are CUDA events: the
step's row waits as a :class:`DeviceRow` in the step tracker's ``pending``, behind any
general step closed before it, until the device has passed its events, and each later
close reads the rows that are done.

A step that does not time its passes (forward and backward are timed on the same sample
of the steps) needs only the forward's start, and only to see that it is the step's one
training forward: on such a step the module has a lean pre-hook and no post-hook
(``switch``, a :class:`~dtprofile._torch_internals.LeanHooks`; a timed call, Lightning's,
reads ``lean`` and calls the lean pre-hook itself), which saves most of what the
forward hooks cost a step. The lean pre-hook sends every other forward to the general
one, which leaves the lane first; leaving puts the full hooks back, and so does a fetch
after the forward (another micro-batch, or an update that never came), before it
counts. (Such a step cannot tell a fetch inside its forward from one after it: it
counts as a fetch after the forward, which on the host clock gives the same data wait,
and on a device clock a data wait capped by the device's idle before the forward,
where the full hooks would count it as forward.)

Nothing else has to know: whatever else touches the open step reads
:attr:`StepTracker.current <dtprofile.capture.steps.StepTracker.current>`, and that read
first turns the lane's partial step into the ``PendingStep`` the general hooks would
have built by then (:meth:`SteadyLane.leave`); the general path takes the step from
there, and the lane opens again at a later step's close when every condition holds.
The hooks take the lane only for exactly the moves the general path would make
without branching; any other move (an evaluation forward, a second forward, a
communication block other than DDP's own reduction and its broadcast of the buffers, a
skipped update) reads ``current`` and so leaves the lane first.
"""

from __future__ import annotations

from typing import Any, final

from .._torch_internals import LeanHooks
from .clocks import Clock
from .rows import _NO_BUFFERS, _NO_SPANS

__all__ = ["SteadyLane", "DeviceRow"]

NAN = float("nan")


class SteadyLane:
    """The open step's marks while the lane is open (see the module's docstring).

    Args:
        steps: the step tracker whose open step the lane holds.

    The owner sets ``passes``, ``updates`` and ``data`` (whose state the conditions
    read), ``unpublished`` and ``publish`` (what a close does for the log intervals) and
    ``allowed`` at start: steps that end at the step-bounding optimizer's update (not at a
    framework's batch end); ``device``, the clock where its marks are events (None: the
    host clock); and ``synced``, steps under a process group, with ``synced_ok``, which
    says whether the communication part lets the lane close the open step and take the
    next (DDP with its own all-reduce, the only communication the lane records, and no
    probe step next).
    ``enabled`` False keeps the lane shut (every step takes the general path).

    The attributes the data wait and the backward hooks write carry a
    ``PendingStep``'s names, so those hooks write to either (``b2``, ``reduced_bytes``
    and ``buffers``, under a process group, are the lane's own).
    """

    enabled = True

    # Never set on a lane step (a move that would set them leaves the lane first).
    no_grad_start = None
    no_grad_forward = None

    def __init__(self, steps: Any) -> None:
        self.steps = steps
        self.passes: Any = None
        self.updates: Any = None
        self.data: Any = None
        # Summaries finished on the worker, published on the training thread at a close
        # (set by the owner: Intervals.unpublished and Intervals.publish).
        self.unpublished: Any = ()
        self.publish: Any = lambda: None
        self.allowed = False
        # A device clock (its marks are events), or None for the host clock.
        self.device: Any = None
        # Under a process group: each step marks when backward's reductions were waited for
        # (b2), and holds the bytes DDP's own all-reduce reduces (set by the owner, as
        # synced_ok: CommRecorder.lane_takes_synced_steps).
        self.synced = False
        self.synced_ok: Any = lambda: False
        # (set by the owner: CommRecorder.lane_comm_left) the broadcast of the buffers and the
        # bytes reduced of a step that leaves the lane, as its general path records them
        self.comm_left: Any = None
        self.open = False
        # Set by the owner where one module's forward passes can be timed lean (see the
        # module's docstring); ``lean``: they are, in the open step.
        self.switch: LeanHooks | None = None
        self.lean = False
        self.until = 0  # the next step that times its backward
        self.times_backward = False  # the open step times its backward
        self.steps_taken = 0  # steps that closed in the lane
        self.lean_steps = 0  # of them, those with the lean forward hooks
        self._reset(None, [None, None])

    def _reset(self, start: Any, own: list[Any]) -> None:
        """A new step in the lane, opening at ``start``; ``own``: the profiler's own work
        from ``start`` on, left out of the step (``[start, end]``; the end set last)."""
        self.start = start
        self.own = own
        # forward's start and end, backward's (a step that times it), when its reductions
        # were waited for (synced), and (data wait, fetches, transfer) at the sync: the
        # forward's end, a timed backward's, or the reductions' wait's (synced)
        self.f0 = self.f1 = self.b0 = self.b1 = self.b2 = self.at_sync = None
        self.reduced_bytes: int | None = None  # synced: the bytes DDP reduces after this step's forward
        self.buffers: Any = None  # synced: DDP's broadcast of the buffers in the forward (a CommInterval)
        self.data_wait_s = self.data_wait_in_forward_s = self.data_transfer_s = 0.0
        self.fetches = 0
        self.forwards_in_update = 0  # 1: the forward ran inside optimizer.step (a closure)
        self.backward_announced = False

    # ------------------------------------------------------------------ open and leave
    def try_open(self) -> None:
        """After a step closed on the general path: take the next step into the lane when
        it is of the common shape so far, and the conditions the lane's hooks take for
        granted hold."""
        steps = self.steps
        step = steps._current
        if not (self.allowed and self.enabled and step is not None and steps.warmed_up):
            return
        # (The step is as open_step made it, with the profiler's own span from its start:
        # this runs at the end of the close that opened it.)
        # (On a device clock closed steps wait in pending for their events, and the
        # lane's rows queue behind them there.)
        if (
            step.probe
            or (steps.pending and self.device is None)
            or steps.halves_pending
            or steps.excluding
            or len(step.excluded) > 1
            or (step.excluded and step.excluded[0][0] is not step.start)
        ):
            return
        if not (self.passes.settled() and self.updates.settled()) or self.data.batch_size is None:
            return
        if self.synced and not self.synced_ok():
            return
        self.until = steps.next_timed_backward()
        self.times_backward = step.times_backward or self.synced  # (synced: every step times it)
        own = step.excluded[0] if step.excluded else [step.start, step.start]
        self._reset(step.start, own)
        steps._current = None
        self.open = True
        self._lean(not self.times_backward)

    def unswitch(self) -> None:
        """The full hooks back, for good (they are being removed, something compiles, or
        more than one module's forwards are timed)."""
        self._lean(False)
        self.switch = None

    def _lean(self, on: bool) -> None:
        """The hooks lean (``on``) or full for the open step."""
        switch = self.switch
        if switch is None or on == self.lean:
            return
        if on:
            self.lean = switch.lean()
        else:
            self.lean = False
            switch.full()

    def leave(self) -> None:
        """Shut the lane: the open step becomes the ``PendingStep`` the general hooks would
        have built from the same moves (``StepTracker.current`` then)."""
        self.open = False
        if self.lean:
            self._lean(False)
            if self.f0 is not None and self.at_sync is None:
                # The forward ran with no post-hook: it has ended (a fetch after it, a
                # reader of the step; a reader inside it sees the post-hook end it).
                # Its data wait so far is the step's before the sync, as at its end.
                self.f1 = self.f0
                self.at_sync = (self.data_wait_s, self.fetches, self.data_transfer_s)
        steps = self.steps
        steps.open_step(self.start)  # (its flags by the schedule, as at the close)
        step = steps._current
        step.excluded.append(self.own)
        if self.f0 is not None:
            step.forward.append([self.f0, self.f1])
            step.forwards_in_update = self.forwards_in_update
        if self.b0 is not None:
            step.backward.append([self.b0, self.b1, self.b2 if self.synced else self.b1])
        elif self.at_sync is not None:  # the forward ended: its backward goes untimed
            step.backward_untimed = True
        if self.buffers is not None or self.reduced_bytes is not None:
            self.comm_left(self.buffers, self.reduced_bytes)
        if self.at_sync is not None:
            step.data_wait_at_sync_s, step.fetches_at_sync, step.data_transfer_at_sync_s = self.at_sync
        step.data_wait_s = self.data_wait_s
        step.data_wait_in_forward_s = self.data_wait_in_forward_s
        step.data_transfer_s = self.data_transfer_s
        step.fetches = self.fetches
        step.backward_announced = self.backward_announced

    # ------------------------------------------------------------------ close
    def close(self, update_start: float, end: float) -> bool:
        """The step-bounding optimizer's update ran from ``update_start`` to ``end``: close
        the lane's step there, as ``StepTracker.close_step`` closes a step of this shape.

        Returns False (nothing done) when the step had no ended forward, or no ended
        backward where it times one, and under a process group when the reductions were
        not waited for yet, DDP's broadcast of the buffers has not ended or came without
        a reduction (a step under ``no_sync()``: its figures are not a row's), or the
        communication part must see the close (``synced_ok``): the general path closes it.
        """
        f0, f1 = self.f0, self.f1
        if self.times_backward:
            b0, b1, timed = self.b0, self.b1, 1.0
            if f1 is None or b1 is None:  # (backward's start is marked only after the forward's end)
                return False
            b2 = b1
            if self.synced:
                b2 = self.b2
                # (not yet waited for, a broadcast that never ended or reduced nothing, or
                # the communication part must see this close: its general path does)
                buffers = self.buffers
                if (
                    b2 is None
                    or (buffers is not None and (buffers.end is None or self.reduced_bytes is None))
                    or not self.synced_ok()
                ):
                    return False
        else:  # untimed passes: empty spans at the forward's end (as in raw_marks)
            if f1 is None:
                if f0 is None or not self.lean:
                    return False
                f1 = f0  # (a lean step's forward: its start only)
                self.lean_steps += 1
            b0 = b1 = b2 = f1
            timed = 0.0
        steps = self.steps
        from_loader = 1.0 if steps.data_wait_source == "loader" else 0.0
        # DDP's own all-reduce: the bytes (as the general path's untimed interval holds them)
        reduced, grad_bytes = (0.0, NAN) if self.reduced_bytes is None else (1.0, float(self.reduced_bytes))
        buffers = self.buffers
        if self.device is None:
            # One tuple built once a step (the hot path): raw_marks' order.
            # fmt: off
            steps.add_row(
                (self.own[1], f0, f1, b0, b1, b2, update_start, end, end, self.data_wait_s,
                 self.data_wait_in_forward_s, self.data_transfer_s, from_loader, reduced, grad_bytes, 0.0, timed)
                + ((buffers.start, buffers.end) if buffers is not None else _NO_BUFFERS)
                + _NO_SPANS
            )
            # fmt: on
            steps.steps_finalized += 1
        else:  # events: read once the device has passed them, in order with the general path's steps
            if buffers is not None:  # (synced)
                marks = (self.start, self.own[1], f0, buffers.start, buffers.end, f1, b0, b1, b2, update_start, end)
            elif self.synced:
                marks = (self.start, self.own[1], f0, f1, b0, b1, b2, update_start, end)
            elif timed:
                marks = (self.start, self.own[1], f0, f1, b0, b1, update_start, end)
            elif f1 is f0:  # (a lean step's forward: its start only)
                marks = (self.start, self.own[1], f0, update_start, end)
            else:
                marks = (self.start, self.own[1], f0, f1, update_start, end)
            waits = (self.data_wait_s, self.data_wait_in_forward_s, self.data_transfer_s)
            steps.pending.append(DeviceRow(marks, (*waits, from_loader, reduced, grad_bytes, 1.0, timed)))
        steps.micro_batches_last = count = self.fetches or 1
        steps.note_micro_batches(count)
        if reduced:  # (one backward pass reduced its gradients)
            steps.sync_passes_recent.append(1)
        steps.steps_seen = index = steps.steps_seen + 1
        self.steps_taken += 1
        if index > self.until:
            self.until = steps.next_timed_backward()
        self.times_backward = times = index == self.until or self.synced
        own = [end, None]
        self._reset(end, own)  # the next step opens where this one closed
        if self.lean is times and self.switch is not None:  # (lean exactly on the steps that do not time)
            self._lean(not times)
        steps.backward_reached.clear()
        if self.device is not None:
            # (with the next step open: a reader of it while draining leaves the lane
            # with that step, not the one just closed)
            steps.drain_device_rows()
        if not (self.unpublished or index % steps.options.every_n_steps == 0):
            own[1] = steps.clock.mark()
            return True
        try:
            if self.unpublished:  # what the general close's on_closed does for a step of this shape
                self.publish()
            if index % steps.options.every_n_steps == 0:
                steps.on_interval()
        finally:
            # (set in the step that holds it whether or not the lane is still open)
            own[1] = steps.clock.mark()
        return True


@final  # (never subclassed: the drain tells it by ``type(step) is DeviceRow``)
class DeviceRow:
    """A lane step's row on a device clock: its events, waiting in
    :attr:`StepTracker.pending <dtprofile.capture.steps.StepTracker.pending>` (in order
    with the general path's steps) until the device has passed them, then read into the
    row of raw marks the host clock's lane step adds at once.

    Args:
        marks: the step's start (the last step's end), the end of the profiler's own
            work after it, forward's start (then DDP's broadcast of the buffers' start
            and end, if it made one) and end, backward's start and end (and when its
            reductions were waited for, under a process group), the update's start, and
            the step's end; a step that does not time its passes has no backward's
            marks, and the forward's start alone where the lean hooks took it.
        host: the row's columns after its marks up to the broadcast's (host figures:
            the data wait, the flags).
    """

    __slots__ = ("marks", "host")

    # What the general path's drain and communication ask a pending step: a lane step is
    # none of these, and its communication (the broadcast of the buffers) has ended.
    skipped = probe = alone = False
    comm: tuple[Any, ...] = ()
    comm_waits: tuple[Any, ...] = ()

    def __init__(self, marks: tuple[Any, ...], host: tuple[Any, ...]) -> None:
        self.marks = marks
        self.host = host

    def read(self, clock: Clock) -> tuple[float, ...] | None:
        """The row of raw marks (seconds from the step's start), or None while the device
        has not passed every event (asked again later; nothing waits)."""
        marks = self.marks
        start, end = marks[0], marks[-1]
        if not clock.ready(end):  # while the device is behind, the one query
            return None
        # Then each event once: all are done by now unless one was recorded on another
        # stream. (The start, the last step's end, was recorded before them on the
        # training stream; the end of the profiler's own work is the start on the lane's
        # first step.)
        ready = clock.ready
        for mark in marks[1:-1]:
            if mark is not start and not ready(mark):
                return None
        elapsed = clock.elapsed_ms
        seconds = [0.0 if mark is start else elapsed(start, mark) / 1e3 for mark in marks[1:]]
        if len(seconds) == 10:  # (synced, with DDP's broadcast of the buffers in the forward)
            own_end, f0, s0, s1, f1, b0, b1, b2, o0, end_s = seconds
            return (own_end, f0, f1, b0, b1, b2, o0, end_s, end_s) + self.host + (s0, s1) + _NO_SPANS
        if len(seconds) == 8:  # (synced: the reductions' wait after backward as well)
            own_end, f0, f1, b0, b1, b2, o0, end_s = seconds
            return (own_end, f0, f1, b0, b1, b2, o0, end_s, end_s) + self.host + _NO_BUFFERS + _NO_SPANS
        # Untimed passes: an empty backward at the forward's end (as in the host's row).
        if len(seconds) == 7:
            own_end, f0, f1, b0, b1, o0, end_s = seconds
        elif len(seconds) == 5:
            own_end, f0, f1, o0, end_s = seconds
            b0 = b1 = f1
        else:  # (a lean step's forward: its start only)
            own_end, f0, o0, end_s = seconds
            f1 = b0 = b1 = f0
        return (own_end, f0, f1, b0, b1, b1, o0, end_s, end_s) + self.host + _NO_BUFFERS + _NO_SPANS

    def release(self, clock: Clock) -> None:
        """The events back to the clock's pool, each once; the end is the next step's
        start and goes back with that step (as :meth:`PendingStep.release`)."""
        marks = self.marks
        start = marks[0]
        clock.release(start)
        for mark in marks[1:-1]:
            if mark is not start:
                clock.release(mark)
