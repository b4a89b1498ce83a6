"""Per-step records: a step's marks, and the figures they give.

One optimizer step leaves a :class:`PendingStep`: the marks taken at its phase
boundaries (by whatever clock the run uses) plus the host-measured data wait. Once every
mark's time is known the step becomes a :class:`StepRecord` of milliseconds (or, for a
step of the common shape, a row of raw marks that :func:`~dtprofile.capture.rows.simple_rows`
turns into figures with others) and goes into the :mod:`~dtprofile.capture.windows` ring buffers; nothing
else about it is kept.

>>> from dtprofile.capture.clocks import HostClock
>>> clock = HostClock()
>>> step = PendingStep(start=0.0)
>>> step.forward.append((0.001, 0.011)); step.backward.append((0.012, 0.032, 0.032))
>>> step.optimizer = (0.033, 0.035); step.end = 0.040
>>> record = step.to_record(clock, data_wait_from="loader")
>>> round(record.step, 3), round(record.compute, 3)
(40.0, 40.0)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, cast

from .clocks import Clock, mark_reader

# The rows' and the windows' names stay importable from here.
from .rows import _NO_BUFFERS, _NO_SPANS, RAW_COLUMNS, ROW_SPANS, simple_rows
from .windows import FIELDS, TIME_FIELDS, TRIM_FRACTION, Window, averages, trim_count

__all__ = [
    "BUFFER_BROADCAST",
    "MESH_COLLECTIVE",
    "FIELDS",
    "RAW_COLUMNS",
    "ROW_SPANS",
    "TIME_FIELDS",
    "TRIM_FRACTION",
    "CommInterval",
    "PendingStep",
    "StepRecord",
    "Window",
    "averages",
    "simple_rows",
    "trim_count",
    "union_length",
]

NAN = float("nan")
# Collectives of a sharded (FSDP2) step; see dtprofile.capture.fsdp. The all-reduce across
# replicas is HSDP's (and FSDP's replicate's).
REPLICA_ALL_REDUCE = "replica_all_reduce"
SHARDED_KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", REPLICA_ALL_REDUCE)
# DDP's broadcast of the module's buffers (BatchNorm's running statistics) from rank 0
# before each forward: communication, but not of gradients (no part of grad_bytes).
BUFFER_BROADCAST = "buffer_broadcast"
#: A collective on a DeviceMesh's process group that the step's forward, backward or
#: update waits for (tensor parallelism's activations: DTensor's functional collectives,
#: :mod:`.mesh_comm`): its span runs from the launch to the end of its last wait, and
#: what is exposed is its waits (the step's ``comm_waits``), never a gradient's bytes.
MESH_COLLECTIVE = "mesh_collective"
#: A probe step's own work around its all-reduce by hand (the copies into and out of the
#: chunks, the gradient-noise norms): exposed, since the step waits for it, but not
#: communication (the chunks' collectives are timed apart).
PROBE_HOST = "probe_host"
# A ring all-gather or reduce-scatter of N bytes moves half what an all-reduce of N
# moves: its all-reduce equivalent is N / 2.
_ALL_REDUCE_SHARE = {"all_gather": 0.5, "reduce_scatter": 0.5}


@dataclass
class CommInterval:
    """One bucket's all-reduce: handed over at ``start``, reduced at ``end``.

    ``bucket`` is False for communication the loop times itself
    (``Profile.communication``); its start is not a moment backward produced gradients,
    and ``nbytes`` may be unknown (None). ``kind`` tells a DDP bucket or a manual block
    (``"all_reduce"``) from a sharded model's collectives (``"all_gather"``,
    ``"reduce_scatter"``, ``"replica_all_reduce"``) and DDP's ``"buffer_broadcast"``;
    ``blocking`` marks one that held
    the training thread for its whole span (exposed in full).
    """

    start: Any
    nbytes: int | None
    end: Any = None
    bucket: bool = True
    kind: str = "all_reduce"
    blocking: bool = False
    pass_index: int = 0  # which backward pass of the step handed the bucket over
    # False: a DDP bucket whose reduction was waited for in a batch at backward's end (its
    # start and end are the step's start: only its size and pass count).
    timed: bool = True
    local_sq: Any = None  # |g|^2 of this rank's bucket (sampled steps, LazyScalar)
    global_sq: Any = None  # |g|^2 of the reduced bucket (sharded: of this rank's shard)
    reduced: Any = None  # sharded, sampled: (output tensor, scale) until the call returns

    @property
    def sharded(self) -> bool:
        return self.kind in SHARDED_KINDS

    @property
    def reduces_gradients(self) -> bool:
        """A DDP bucket or a sharded gradient reduction: one per backward pass that syncs."""
        return self.bucket or self.kind in ("reduce_scatter", REPLICA_ALL_REDUCE)

    @property
    def all_reduce_bytes(self) -> float:
        """The bytes of the all-reduce that moves the same traffic (``grad_bytes``)."""
        return (self.nbytes or 0) * _ALL_REDUCE_SHARE.get(self.kind, 1.0)


@dataclass(slots=True)
class PendingStep:
    """The marks of one optimizer step, waiting for their times to be known.

    Lists collect one entry per micro-batch (gradient accumulation runs several
    forward/backward passes per optimizer step): ``forward`` holds ``[start, end]``,
    ``backward`` holds ``[start, compute_end, synced]`` where *synced* is after DDP
    waited for the reductions.
    """

    start: Any
    data_wait_s: float = 0.0
    data_wait_in_forward_s: float = 0.0  # of data_wait_s, what was waited inside a forward
    data_transfer_s: float = 0.0  # of data_wait_s, the batch's transfer to the device
    index: int = 0  # the step's number in the run (warm-up included)
    forward: list[Any] = field(default_factory=list)
    forwards_in_update: int = 0  # of forward, those a closure ran inside optimizer.step
    backward: list[Any] = field(default_factory=list)
    optimizer: tuple[Any, ...] | None = None
    extra_optimizer: list[Any] = field(default_factory=list)
    # [start, end] spans inside an optimizer step that are not the update (Lightning's
    # on_before_optimizer_step hooks and gradient clipping): other compute.
    outside_update: list[Any] = field(default_factory=list)
    comm: list[Any] = field(default_factory=list)
    # [start, end] spans in which the compute timeline waited for communication
    # (FSDP's wait for an all-gather): exposed communication wherever they lie.
    comm_waits: list[Any] = field(default_factory=list)
    # [start, end] spans of work that is not training (evaluation forwards under no_grad,
    # Lightning's validation loop): left out of the step and of the gap before forward.
    excluded: list[Any] = field(default_factory=list)
    # Start of a no-grad forward in train mode before the first training forward (the
    # first pass of reentrant checkpointing, a rollout): compute, so the gap ends there.
    no_grad_start: Any = None
    # [start, end] of the last no-grad forward in train mode: the forward of reentrant
    # checkpointing once its recompute shows up inside backward, else nothing.
    no_grad_forward: list[Any] | None = None
    eval_forwards: int = 0  # forwards of the profiled model in eval mode under no_grad (left out)
    end: Any = None
    probe: bool = False
    reduced_by_hand: bool = False  # a probe's gradients were all-reduced by hand (NoSyncProbe)
    alone: bool = False  # a probe whose passes ran while the other ranks waited their turn
    # A probe's window that was not a plain pass (NoSyncProbe): reduced after backward, so
    # neither an ordinary step nor a probe; left out of the figures.
    irregular: bool = False
    # DDP: each bucket's reduction is timed (else only the wait after backward is).
    times_buckets: bool = True
    # Backward's start and end are timed on this step (without a process group, on a
    # sample of the steps: backward_timing_every); else its forward's outputs got no
    # hook, and ``backward_untimed`` is set: a backward is taken to have run.
    times_backward: bool = True
    backward_untimed: bool = False
    comm_measured: bool = False
    reduced_pass: int = 0  # the last backward pass (1-based) that started a gradient reduction (sharded)
    # Ended without an optimizer update (e.g. GradScaler skipped it): kept out of the averages.
    skipped: bool = False
    # The framework said a backward runs in this step (Lightning's on_before_backward),
    # whether or not a hook on the forward's outputs saw it.
    backward_announced: bool = False
    # Data wait counted when the last backward finished; what comes after it is the next
    # iteration's fetch (moved there when the step turns out to have been skipped).
    data_wait_at_sync_s: float = 0.0
    fetches: int = 0  # batches the loop fetched through the profiled loader in this step
    fetches_at_sync: int = 0  # of them, those fetched when the last backward finished
    data_transfer_at_sync_s: float = 0.0  # of it, the batch transfer's

    def marks(self) -> Iterable[Any]:
        yield self.start
        for pair in self.forward:
            yield from pair
        for pair in self.backward:
            yield from pair
        if self.optimizer is not None:
            yield from self.optimizer
        for pair in self.extra_optimizer:
            yield from pair
        for pair in self.outside_update:
            yield from pair
        for interval in self.comm:
            yield interval.start
            yield interval.end
        for pair in self.comm_waits:
            yield from pair
        for pair in self.excluded:
            yield from pair
        if self.no_grad_start is not None:
            yield self.no_grad_start
        if self.no_grad_forward is not None:
            yield from self.no_grad_forward
        yield self.end

    def ready(self, clock: Clock) -> bool:
        """True once every mark has a known time (comm ends arrive from other threads)."""
        if self.start is None or self.end is None:
            return False
        if self.comm and any(c.end is None for c in self.comm):
            return False
        if self.comm_waits and any(end is None for _, end in self.comm_waits):
            return False
        if clock.kind == "perf_counter":  # host marks are known when taken
            return True
        # Each query is a driver call. The end is the step's last mark on the training
        # stream: while the device is behind, it is the one query; then each event once.
        if not clock.ready(self.end):
            return False
        seen = {id(self.end)}
        for mark in self.marks():
            if mark is None:
                return False
            if id(mark) not in seen:
                seen.add(id(mark))
                if not clock.ready(mark):
                    return False
        return True

    def release(self, clock: Clock) -> None:
        """Give this step's marks back to the clock's pool, each once.

        ``end`` is kept: it is the next step's ``start`` and goes back with that step
        (steps finish in order). The optimizer's end mark is ``end`` itself.
        """
        seen = {id(self.end)}
        for m in self.marks():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                clock.release(m)

    def _simple_shape(self) -> bool:
        """One forward, one backward, an update, at most the profiler's own span at the
        start, and no communication but DDP's reduction waited for after backward (the
        wait is timed, not the buckets), after its broadcast of the buffers in the
        forward if it made one: the common step (Lightning's and DDP's too), whose
        figures :func:`simple_rows` computes from :meth:`raw_marks` once its marks are in
        order."""
        passes = 0 if self.backward_untimed else 1  # (an untimed backward left no marks)
        if (
            len(self.forward) != 1
            or len(self.backward) != passes
            or self.optimizer is None
            or self.extra_optimizer
            or self.comm_waits
            or self.no_grad_start is not None
            or len(self.excluded) > 1
            or len(self.outside_update) > ROW_SPANS
        ):
            return False
        if self.comm_measured or self.comm:
            comm = self.comm
            if len(comm) == 2 and _buffers_broadcast(comm[0]):
                comm = comm[1:]
            if len(comm) != 1 or not _waited_after_backward(comm[0]):
                return False
        return not self.excluded or self.excluded[0][0] == self.start

    def raw_marks(self, from_loader: bool, clock: Clock | None = None) -> tuple[float, ...] | None:
        """A step of the common shape (one forward, then one backward, timed or not, one
        update, no communication but DDP's own all-reduce waited for after backward and
        its broadcast of the buffers in the forward) as one row of :data:`RAW_COLUMNS`
        numbers, for :func:`simple_rows` to turn into its figures with many others at
        once; None for any other step (its record comes from :meth:`to_record`).

        Args:
            from_loader: the data wait is the loader's (else the gap before forward).
            clock: a device clock, whose events are read here, each once (only once
                :meth:`ready`), as seconds from the step's start; None: host marks,
                which are seconds already.
        """
        if not self._simple_shape():
            return None
        own_end = self.excluded[0][1] if self.excluded else self.start
        ((f0, f1),) = self.forward
        # An untimed backward: an empty span at the forward's end (its figure is NaN).
        ((b0, b1, b2),) = self.backward or ((f1, f1, f1),)
        o0, o1 = cast("tuple[Any, Any]", self.optimizer)  # (a simple shape has an update)
        end = self.end
        spans = self.outside_update
        buffers = (self.comm[0].start, self.comm[0].end) if len(self.comm) == 2 else None
        if clock is not None:
            read = mark_reader(clock, self.start)
            marks = (own_end, f0, f1, b0, b1, b2, o0, o1, end)
            own_end, f0, f1, b0, b1, b2, o0, o1, end = (read(m) / 1e3 for m in marks)
            spans = [[read(a) / 1e3, read(b) / 1e3] for a, b in spans]
            if buffers is not None:
                buffers = (read(buffers[0]) / 1e3, read(buffers[1]) / 1e3)
        if not (f1 <= b0 <= b2 and own_end <= f0):
            return None
        if buffers is not None and not (f0 <= buffers[0] <= buffers[1] <= f1):
            return None  # (the broadcast is taken out of the forward it lies in)
        if self.comm:  # the bytes DDP reduced (unknown: NaN, as in to_record); else no communication
            reduction = self.comm[-1]
            grad_bytes = NAN if reduction.nbytes is None else float(reduction.all_reduce_bytes)
            reduced = 1.0
        else:
            grad_bytes, reduced = NAN, 0.0
        row = (
            own_end,
            f0,
            f1,
            b0,
            b1,
            b2,
            o0,
            o1,
            end,
            self.data_wait_s,
            self.data_wait_in_forward_s,
            self.data_transfer_s,
            1.0 if from_loader else 0.0,
            reduced,
            grad_bytes,
            0.0 if clock is None else 1.0,
            0.0 if self.backward_untimed else 1.0,
        ) + (buffers or _NO_BUFFERS)
        if not spans:
            return row + _NO_SPANS
        return row + tuple(chain.from_iterable(spans)) + _NO_SPANS[2 * len(spans) :]

    def to_record(self, clock: Clock, data_wait_from: str) -> StepRecord:
        """Milliseconds for every quantity; only call once :meth:`ready` is true."""

        rel = mark_reader(clock, self.start)
        excluded = [(rel(a), rel(b)) for a, b in self.excluded]
        step_ms = rel(self.end) - union_length(excluded)
        forward_ms = sum(rel(b) - rel(a) for a, b in self.forward)
        # A fetch inside a forward is data wait, not forward (bounded by the forward's span).
        # Host time only: on a device timeline the forward holds just what the device idled.
        in_forward_ms = min(self.data_wait_in_forward_s * 1e3, forward_ms) if clock.kind != "cuda_event" else 0.0
        forward_ms -= in_forward_ms
        backward_ms = sum(rel(compute_end) - rel(start) for start, compute_end, _ in self.backward)
        # Both passes are timed on a sample of the steps where nothing waits for
        # gradients (backward_timing_every): their figures are NaN on the others.
        passes_untimed = self.backward_untimed and not self.backward
        if passes_untimed:
            backward_ms = NAN
        # A closure's passes inside ``optimizer.step(closure)`` (LBFGS, SAM) are forward and
        # backward, not the update, nor is the work a framework runs between them and the
        # update: the optimizer is what is left of its span.
        passes = [(rel(a), rel(b)) for a, b in self.forward]
        passes += [(rel(start), rel(synced)) for start, _, synced in self.backward]
        passes += [(rel(a), rel(b)) for a, b in self.outside_update]
        updates = [(rel(a), rel(b)) for a, b in ([self.optimizer] if self.optimizer else []) + self.extra_optimizer]
        # Waits for communication inside the update (DTensor's reduction of Partial
        # gradients as the optimizer reads them) are exposed communication, not the update.
        waits = [(rel(a), rel(b)) for a, b in self.comm_waits]
        optimizer_ms = sum(b - a - _overlap_ms((a, b), passes + waits) for a, b in updates)

        # From the previous step's end to this step's first forward (device timeline on GPUs).
        gap_ms = 0.0
        starts = [rel(self.forward[0][0])] if self.forward else []
        if self.no_grad_start is not None:
            starts.append(rel(self.no_grad_start))
        if starts:
            first = min(starts)
            # (a pipeline stage's wait for its first activation: exposed communication, not data)
            gap_ms = max(0.0, first - _overlap_ms((0.0, first), excluded + waits))
        if data_wait_from == "loader":
            data_wait_ms = (self.data_wait_s - self.data_wait_in_forward_s) * 1e3
            if clock.kind == "cuda_event":
                # The host may block in next() while the GPU still runs the last step's
                # kernels: the wait costs only the time the device stood idle for it.
                data_wait_ms = min(data_wait_ms, gap_ms)
            data_wait_ms += in_forward_ms
            data_transfer_ms = min(self.data_transfer_s * 1e3, data_wait_ms)
        else:
            data_wait_ms = gap_ms
            data_transfer_ms = NAN  # the gap holds any transfer: not told apart

        if self.comm_measured:
            spans = [(rel(c.start), rel(c.end)) for c in self.comm]
            comm_total_ms = union_length(spans)
            if spans and any(c.sharded for c in self.comm):
                exposed = self._sharded_exposed_spans(rel, spans)
                comm_exposed_ms = union_length(exposed)
                # The waits include FSDP's copy-out of the gathered parameters: part of
                # what communication costs, so part of its total as well.
                comm_total_ms = union_length(spans + exposed)
                # FSDP waits inside forward and backward: the phases are their compute.
                forward_ms -= sum(_overlap_ms((rel(a), rel(b)), exposed) for a, b in self.forward)
                backward_ms -= sum(_overlap_ms((rel(a), rel(b)), exposed) for a, b, _ in self.backward)
            elif spans or waits:
                # Blocking calls (DDP's buffer broadcast before forward) are exposed in
                # full; DDP's buckets past their pass's compute; reductions the loop runs
                # itself past the last backward; a mesh's collectives (tensor parallel)
                # where the step waited for them.
                exposed = [
                    span for c, span in zip(self.comm, spans, strict=False) if c.blocking and c.kind != PROBE_HOST
                ]
                buckets = [(c, span) for c, span in zip(self.comm, spans, strict=False) if c.bucket]
                if buckets:
                    exposed += self._ddp_exposed_spans(rel, buckets)
                after = rel(self.backward[-1][1]) if self.backward else 0.0
                exposed += [
                    (max(a, after), b)
                    for c, (a, b) in zip(self.comm, spans, strict=False)
                    if not (c.bucket or c.blocking or c.kind == MESH_COLLECTIVE) and b > after
                ]
                host = [span for c, span in zip(self.comm, spans, strict=False) if c.kind == PROBE_HOST]
                comm_exposed_ms = union_length(exposed + waits + host)
                wire = [span for c, span in zip(self.comm, spans, strict=False) if c.kind != PROBE_HOST]
                comm_total_ms = union_length(wire + exposed + waits)  # so it holds what the step waited for
                blocking = [span for c, span in zip(self.comm, spans, strict=False) if c.blocking]
                forward_ms -= sum(_overlap_ms((rel(a), rel(b)), blocking + waits) for a, b in self.forward)
                if waits:  # (activations' communication inside the passes is not their compute)
                    backward_ms -= sum(_overlap_ms((rel(a), rel(b)), waits) for a, b, _ in self.backward)
            else:
                comm_exposed_ms = 0.0
            if not all(c.timed for c in self.comm):
                # Buckets reduced in a batch have no spans of their own: the exposed wait
                # is exact, the total is measured on the steps that time every bucket.
                comm_total_ms = NAN
            comm_buffers_ms = union_length(
                [span for c, span in zip(self.comm, spans, strict=False) if c.kind == BUFFER_BROADCAST]
            )
            gradients = [c for c in self.comm if c.kind not in (BUFFER_BROADCAST, PROBE_HOST, MESH_COLLECTIVE)]
            sizes = [c.nbytes for c in gradients]
            grad_bytes = NAN if None in sizes else float(sum(c.all_reduce_bytes for c in gradients))
            if not gradients and any(c.kind == MESH_COLLECTIVE for c in self.comm):
                grad_bytes = NAN  # a mesh's activations only: no gradient was reduced by a timed collective
        else:
            comm_total_ms = comm_exposed_ms = comm_buffers_ms = grad_bytes = NAN

        overhead_ms = data_wait_ms + (0.0 if math.isnan(comm_exposed_ms) else comm_exposed_ms)
        return StepRecord(
            step=step_ms,
            data_wait=data_wait_ms,
            forward=NAN if passes_untimed else forward_ms,
            backward=backward_ms,
            optimizer=optimizer_ms,
            comm_total=comm_total_ms,
            comm_exposed=comm_exposed_ms,
            compute=step_ms - overhead_ms,
            overhead=overhead_ms,
            grad_bytes=grad_bytes,
            data_transfer=data_transfer_ms,
            comm_buffers=comm_buffers_ms,
            probe=self.probe,
        )

    def _ddp_exposed_spans(
        self, rel: Any, buckets: list[tuple[CommInterval, tuple[float, float]]]
    ) -> list[tuple[float, float]]:
        """DDP's exposed communication: per backward pass that reduced, what ran past its
        compute.

        A pass's compute ends when its last bucket is ready or autograd finishes,
        whichever is later; its communication ends when the last of its buckets is reduced
        or DDP's finalisation (wait, copy back into ``.grad``) is done. Accumulation
        without ``no_sync()`` reduces in every pass, and each pass waits for its own.
        """
        by_pass: dict[int, list[tuple[float, float]]] = {}
        last = len(self.backward)
        for c, span in buckets:
            # A pass not recorded (past MAX_PASSES_PER_STEP): the last recorded one's.
            by_pass.setdefault(c.pass_index if 1 <= c.pass_index <= last else last, []).append(span)
        exposed = []
        for index, pass_spans in by_pass.items():
            compute_end = max(s for s, _ in pass_spans)
            comm_end = max(e for _, e in pass_spans)
            if 1 <= index <= len(self.backward):
                _, bwd_compute_end, bwd_synced = self.backward[index - 1]
                compute_end = max(compute_end, rel(bwd_compute_end))
                comm_end = max(comm_end, rel(bwd_synced))
            if comm_end > compute_end:
                exposed.append((compute_end, comm_end))
        return exposed

    def _sharded_exposed_spans(self, rel: Any, spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """Exposed communication of a sharded step: what the compute timeline waited for.

        The union of the collectives that blocked the training thread (a host clock
        and no ``async_op``), the waits for an all-gather, and the communication still
        running after backward compute ended (the last reduce-scatters, up to the end
        of FSDP's final backward callback).
        """
        exposed = [span for span, c in zip(spans, self.comm, strict=False) if c.blocking]
        exposed += [(rel(a), rel(b)) for a, b in self.comm_waits]
        if self.backward:
            _, compute_end, synced = self.backward[-1]
            after = rel(compute_end)
            tail_end = max([rel(synced)] + [e for s, e in spans if s < rel(synced)])
            if tail_end > after:
                exposed.append((after, tail_end))
        return exposed


@dataclass
class StepRecord:
    """One optimizer step on one rank, in milliseconds (``grad_bytes`` in bytes).

    ``nan`` marks a quantity that was not measured (e.g. communication without the
    timed hook); summaries turn it into ``null``, never into zero.
    """

    step: float
    data_wait: float
    forward: float
    backward: float
    optimizer: float
    comm_total: float
    comm_exposed: float
    compute: float
    overhead: float
    grad_bytes: float
    data_transfer: float = 0.0  # of data_wait
    comm_buffers: float = 0.0  # of comm_exposed
    probe: bool = False

    def values(self) -> list[float]:
        return [getattr(self, name) for name in FIELDS]


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping ``(start, end)`` intervals.

    >>> union_length([(0, 2), (1, 3), (5, 6)])
    4
    """
    total: float = 0
    cur_start: float = 0.0  # (read only once cur_end is set, with it)
    cur_end: float | None = None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _overlap_ms(span: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    """How much of ``span`` the union of ``spans`` covers."""
    a, b = span
    return union_length([(max(a, s), min(b, e)) for s, e in spans if min(b, e) > max(a, s)])


def _buffers_broadcast(interval: CommInterval) -> bool:
    """DDP's broadcast of the buffers before a forward: timed, blocking, exposed in full."""
    return (
        interval.kind == BUFFER_BROADCAST
        and interval.blocking
        and interval.timed
        and not interval.bucket
        and interval.pass_index == 0
    )


def _waited_after_backward(interval: CommInterval) -> bool:
    """DDP's reduction of the one backward pass, untimed (DDP's own all-reduce without a
    hook, or dtprofile's hook on a step that waits for its buckets in a batch): one
    interval that holds the bytes; the wait after backward is what is timed."""
    return (
        interval.bucket
        and not interval.timed
        and not interval.blocking
        and interval.kind == "all_reduce"
        and interval.pass_index == 1
        and interval.local_sq is None
        and interval.global_sq is None
    )
