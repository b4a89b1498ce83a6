"""One recorder for every source of communication.

Four sources feed it, each through the same record path (:meth:`CommRecorder._record`)
and the same end mark:

- DDP's gradient buckets, from the timed communication hook (:mod:`.ddp`): a bucket
  handed over, its reduction done (:meth:`~CommRecorder.bucket_ready`,
  :meth:`~CommRecorder.bucket_done`);
- a sharded model's collectives (FSDP's all-gathers, reduce-scatters and all-reduces,
  :mod:`.fsdp`) and the compute stream's waits for them (:meth:`~CommRecorder.collective_start`,
  :meth:`~CommRecorder.wait_start`);
- collectives that hold the compute timeline throughout (DDP's buffer broadcast before
  forward, :meth:`~CommRecorder.blocking_start`);
- communication the loop runs itself (``prof.communication()``,
  :meth:`~CommRecorder.manual_start`).

It also knows how the model communicates (``ddp_config``, ``fsdp_config``,
``comm_source``) and, when nothing could be timed, why (:meth:`~CommRecorder.unmeasured_reason`).
Which of DDP's ways of reducing is timed, and how, is :mod:`.ddp_attach`'s choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch

from .. import console
from .._torch_internals import in_backward
from .clocks import Clock
from .ddp import TimedHook, wire_bytes
from .ddp_attach import DDPAttachment
from .parts import Parts, guarded
from .records import BUFFER_BROADCAST, SHARDED_KINDS, CommInterval, PendingStep
from .steps import MAX_COLLECTIVES_PER_STEP, StepTracker

__all__ = ["CommRecorder", "collectives_per_step"]

log = logging.getLogger(__name__)


def collectives_per_step(comm: list[CommInterval], units: int, replicas: int) -> dict[str, Any]:
    """Counts and bytes of one sharded step's collectives (``run.fsdp`` in the summary)."""
    out: dict[str, Any] = {"units": units, "replicas": replicas}
    for kind in SHARDED_KINDS:
        mine = [c for c in comm if c.kind == kind]
        out[kind + "s"] = len(mine)
        out[kind + "_bytes"] = sum(c.nbytes or 0 for c in mine)
    return out


class CommRecorder:
    """Communication intervals into the open step, from every source.

    A one-rank DDP model gets no communication hook; ``time_one_rank`` (class attribute)
    gives it one all the same, so that the hook's code can be checked on a machine with
    a single GPU (benchmarks/gpu_check.py). How a DDP model is timed is its
    :class:`~dtprofile.capture.ddp_attach.DDPAttachment`'s choice (``ddp_attachment``).

    Args:
        steps: the step tracker.
        clock: where marks come from.
        parts: the profiler's parts (the guard reads them).
        world_size: ranks in the run.
        in_training_pass: whether a training forward or a backward runs now.
        noise: the gradient-noise sampler (:class:`dtprofile.noise.NoiseSampler`).
    """

    time_one_rank = False

    def __init__(
        self,
        steps: StepTracker,
        clock: Clock,
        parts: Parts,
        world_size: int,
        in_training_pass: Callable[[], bool],
        noise: Any,
    ) -> None:
        self.steps = steps
        self.clock = clock
        self.parts = parts
        self.world_size = world_size
        self.in_training_pass = in_training_pass
        self.noise = noise
        self.comm_source: str | None = None
        self.ddp: Any = None  # the DDP model whose communication is timed
        self.ddp_config: dict[str, Any] | None = None  # how the DDP model was built (advice reads it)
        self.fsdp: Any = None  # dtprofile.capture.fsdp.FSDPInstrumentation while attached
        self.fsdp_config: dict[str, Any] | None = None  # collectives per step of a sharded model
        self.model_kind: str | None = None  # the profiled module's class (for messages)
        # How the integration's users time communication outside DDP (plain loops only).
        self.manual_hint: str | None = None
        self._hook_taken = False  # the model's communication is timed by another running profiler
        self._fsdp_unsupported: str | None = None  # why a sharded model's collectives cannot be timed
        # The profiled module's call runs backward itself (set by the owner): no NoSyncProbe.
        self.backward_in_forward = False
        # Marks the open backward pass's compute as ended (set by the owner: the pass hooks).
        self.backward_compute_done: Callable[[], None] = lambda: None
        # Moves the open backward pass's sync mark to now, if it has one (the same owner).
        self.backward_waited: Callable[[], None] = lambda: None
        self._warned = False
        self.ddp_attachment = DDPAttachment(self)

    @property
    def active(self) -> bool:
        """Measuring now (another profiler asks before it takes over a hook)."""
        return self.parts.active

    @property
    def probing(self) -> bool:
        """This step holds its reductions until backward ends (``probe_every``)."""
        return self.steps.probing

    @property
    def holds_probes(self) -> bool:
        """Probe steps hold DDP's reductions in the timed hook (where no
        :class:`~dtprofile.capture.probe.NoSyncProbe` makes its own probe steps)."""
        return self.ddp_attachment.holds_probes

    def every_rank_started(self, every_rank: bool, start_key: str | None = None) -> None:
        """The profiler started, on every rank or not (one verdict for all ranks, made under
        the store key ``start_key``)."""
        self.ddp_attachment.every_rank_started(every_rank, start_key)

    # ------------------------------------------------------------------ attach
    def attach_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Time ``ddp``'s gradient communication (:meth:`DDPAttachment.attach`)."""
        self.ddp_attachment.attach(ddp)

    def lost_probes_by_hand(self) -> None:
        """Probe steps cannot reduce by hand on this model after all: the hook takes over
        (:meth:`DDPAttachment.lost_probes_by_hand`)."""
        self.ddp_attachment.lost_probes_by_hand()

    def warn_untimed_hook(self) -> None:
        """The DDP model has a hook of the user's that dtprofile cannot time (only the wait
        after backward is): said once."""
        console.warn(
            "dtprofile: this DDP model already has a communication hook, so only the wait for gradient "
            "communication after backward is measured (comm_exposed), not its total, overlap or bandwidth. "
            "Wrap your hook to time it all: model.register_comm_hook(state, dtprofile.timed_hook(your_hook))",
            stacklevel=6,
        )

    def taken_by_another(self, stacklevel: int = 6) -> None:
        """Another running profiler times this model's communication: this one says so once
        and reports it unmeasured."""
        self._hook_taken = True
        console.warn(
            "dtprofile: another profiler is already timing this model's communication; "
            "this one reports it as unmeasured (null)",
            stacklevel=stacklevel,
        )

    def attach_fsdp(self, module: torch.nn.Module) -> None:
        """Time the all-gathers and reduce-scatters of every ``fully_shard`` unit in ``module``."""
        if self.fsdp is not None or self.world_size < 2:
            return
        from .fsdp import TimedByAnother, instrument

        try:
            self.fsdp = instrument(module, self)
            self.noise.shard_copies = self.fsdp.replicas
            if self.fsdp.units:
                self.comm_source = "fsdp"
        except NotImplementedError as exc:  # an FSDP2 without comm objects: say so, do not fail
            self._fsdp_unsupported = str(exc)
        except TimedByAnother:
            self.taken_by_another(stacklevel=5)
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def detach(self) -> None:
        """Put back what was patched; DDP's hook passes straight through from now on."""
        self.ddp_attachment.detach()
        if self.fsdp is not None:
            try:
                self.fsdp.remove()
            except Exception as exc:
                log.debug("dtprofile: FSDP instrumentation not removed: %r", exc)

    def step_closed(self, step: Any) -> None:
        """A step closed: DDP's probe steps settled (:meth:`DDPAttachment.step_closed`); a
        sharded step's collectives per step, for ``run.fsdp``."""
        self.ddp_attachment.step_closed(step)
        if self.fsdp is not None and any(c.sharded for c in step.comm):
            self.fsdp_config = collectives_per_step(step.comm, self.fsdp.units, self.noise.shard_copies)
            self.fsdp_config["api"] = self.fsdp.api

    # ------------------------------------------------------------------ the record path
    def _record(
        self,
        nbytes: int | None,
        *,
        kind: str = "all_reduce",
        bucket: bool = False,
        blocking: bool = False,
        timed: bool = True,
    ) -> CommInterval | None:
        """One interval starting now in the open step (None past the step's limit).

        ``timed`` False: no marks of its own (a batched step's bucket): its start and end
        are the step's start, so it adds no event and no span.
        """
        step = self.steps.current
        if len(step.comm) >= MAX_COLLECTIVES_PER_STEP:
            return None
        start = self.clock.mark() if timed else step.start
        interval = CommInterval(
            start=start,
            end=None if timed else start,
            nbytes=nbytes,
            bucket=bucket,
            kind=kind,
            blocking=blocking,
            pass_index=len(step.backward),
            timed=timed,
        )
        step.comm_measured = True
        step.comm.append(interval)
        return interval

    def untimed_reduction(self, nbytes: int) -> None:
        """DDP reduces ``nbytes`` in the backward of the training forward that just ended,
        with its own all-reduce (no hook: the wait after backward is timed instead): an
        interval of the open step without marks of its own, or, in the steady lane, the
        lane step's bytes (the interval only if the step leaves the lane)."""
        lane = self.steps.lane
        if lane.open and lane.synced and lane.reduced_bytes is None:
            lane.reduced_bytes = nbytes
            return
        self._reduction_after_forward(nbytes)

    def lane_comm_left(self, buffers: CommInterval | None, nbytes: int | None) -> None:
        """The open step just left the steady lane: the intervals its general path would
        have recorded in its forward, DDP's broadcast of the buffers (``buffers``, from
        :meth:`blocking_start`) and the reduction :meth:`untimed_reduction` noted
        (``nbytes``), for the step's first backward pass (the lane's forward is its first)."""
        if buffers is not None:
            step = self.steps.current
            step.comm.append(buffers)
            step.comm_measured = True
        if nbytes is not None:
            self._reduction_after_forward(nbytes, passes_before=0)

    def _reduction_after_forward(self, nbytes: int, passes_before: int | None = None) -> None:
        """The open step's untimed interval of DDP's reduction of ``nbytes``, in the
        backward of the forward that came after ``passes_before`` backward passes (None:
        as many as the step holds now)."""
        interval = self._record(nbytes, bucket=True, timed=False)
        if interval is not None:
            before = interval.pass_index if passes_before is None else passes_before
            interval.pass_index = before + 1  # the backward this forward's reduction belongs to

    def lane_takes_synced_steps(self) -> bool:
        """Whether the steady lane may close the open step and take the next under a
        process group: no sharded model, and nothing for this part to do at the close
        (:meth:`DDPAttachment.lane_takes_steps`)."""
        return self.fsdp is None and self.ddp_attachment.lane_takes_steps()

    def end(self, interval: CommInterval) -> None:
        """The interval's communication is done now (unguarded: its start was taken, so its
        end must be, or the step would wait for it; an error disables communication)."""
        try:
            interval.end = self.clock.mark()
        except Exception as exc:
            self.parts["comm"].fail(exc)

    # ------------------------------------------------------------------ DDP
    @guarded("comm")
    def bucket_ready(self, bucket: Any, wire_itemsize: int | None = None) -> CommInterval | None:
        """A DDP bucket is handed to the hook (its gradients are ready).

        ``wire_itemsize``: bytes an element takes on the wire when the hook compresses.
        """
        buffer = bucket.buffer()
        interval = self._record(wire_bytes(buffer, wire_itemsize), bucket=True)
        if interval is not None and self.noise.sampling_buckets():
            self.noise.sample_bucket(interval, buffer)
        return interval

    def batches_buckets(self) -> bool:
        """Whether this bucket's reduction is waited for in a batch at backward's end (the
        step does not time its buckets) rather than timed on its own.

        Only inside a backward pass whose end the pass hooks will mark: their callback,
        queued at its start, runs before the batch completes and DDP finalises. A bucket
        handed over later (DDP reducing inside its own finalisation: a static graph's
        first step) is timed on its own.
        """
        step = self.steps.current
        return (
            step is not None
            and not step.times_buckets
            and self.parts.measuring
            and self.parts["timing"].enabled
            and self.parts["comm"].enabled
            and not cast(TimedHook, self.ddp_attachment.timed_hook).reduces_in_finalize  # (only asked with a hook)
            and bool(step.backward)
            and step.backward[-1][1] is None
            and in_backward()
        )

    @guarded("comm")
    def bucket_untimed(
        self, bucket: Any, wire_itemsize: int | None = None, joined: CommInterval | None = None
    ) -> CommInterval | None:
        """A DDP bucket of a batched step: its size and pass, no marks of its own (its start
        and end are the step's start, so it adds no event).

        ``joined``: the pass's interval so far; the bucket's bytes are added to it, unless
        the step samples each bucket's gradient norm (an interval per bucket then).
        """
        buffer = bucket.buffer()
        nbytes = wire_bytes(buffer, wire_itemsize)
        sampling = self.noise.sampling_buckets()
        if joined is not None and not sampling:
            joined.nbytes = cast(int, joined.nbytes) + nbytes  # (a batch's interval counts bytes)
            return joined
        interval = self._record(nbytes, bucket=True, timed=False)
        if interval is not None and sampling:
            self.noise.sample_bucket(interval, buffer)
        return interval

    def restart(self, interval: CommInterval) -> None:
        """A held bucket's reduction starts now (probe steps)."""
        try:
            interval.start = self.clock.mark()
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def bucket_done(self, interval: CommInterval, future: torch.futures.Future[Any]) -> None:
        """Runs in the reduction's ``then`` callback (gloo: its worker thread)."""
        self.end(interval)
        if interval.local_sq is None:
            return
        try:
            reduced = future.value()
        except Exception:
            # The reduction itself failed (a peer's process died): the training's error,
            # which DDP raises in the loop; not this profiler's, and no sample.
            interval.local_sq = None
            return
        self.bucket_reduced(interval, reduced)

    def bucket_reduced(self, interval: CommInterval, reduced: Any) -> None:
        """A sampled bucket's reduced value (the gradient-noise sample); never raises."""
        try:
            self.noise.sample_reduced(interval, reduced)
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def probe_reduced(
        self, interval: CommInterval, local_sq: list[torch.Tensor], reduced_sq: list[torch.Tensor], local_scale: float
    ) -> None:
        """A probe step's gradient chunks' |g|^2, before and after their all-reduce by hand
        (``local_scale``: 1 / the group's size, which divided them before the sum): the
        gradient-noise sample; never raises."""
        try:
            self.noise.sample_by_hand(interval, local_sq, reduced_sq, local_scale)
        except Exception as exc:
            self.parts["comm"].fail(exc)

    @guarded("comm")
    def blocking_start(self, kind: str, nbytes: int) -> CommInterval | None:
        """A collective that holds the compute timeline throughout starts now (DDP's
        buffer broadcast in a training forward); exposed in full, not a gradient's."""
        if not self.in_training_pass():
            return None
        lane = self.steps.lane
        if (
            lane.open
            and lane.synced
            and kind == BUFFER_BROADCAST
            and lane.f0 is not None
            and lane.f1 is None
            and lane.buffers is None
            and lane.reduced_bytes is None
        ):
            # The lane's step (its forward's, before DDP's reduction is noted): an interval
            # of its own, in the step's record only if the step leaves the lane.
            lane.buffers = CommInterval(start=self.clock.mark(), nbytes=nbytes, bucket=False, kind=kind, blocking=True)
            return lane.buffers
        return self._record(nbytes, kind=kind, blocking=True)

    # ------------------------------------------------------------------ FSDP
    @guarded("comm")
    def collective_start(self, kind: str, nbytes: int, reduce: tuple[Any, ...] | None = None) -> CommInterval | None:
        """A sharded model's collective (``kind``: one of ``SHARDED_KINDS``) starts now.

        Collectives outside a training step's forward or backward (evaluation under
        ``no_grad``) are not the step's communication and are not recorded.
        ``reduce``: a gradient reduction's ``(input, output, op, group)``, for the
        gradient noise sample on sampled steps.
        """
        if not self.in_training_pass():
            return None
        interval = self._record(nbytes, kind=kind)
        if interval is None:
            return None
        if interval.reduces_gradients:
            self.steps.current.reduced_pass = interval.pass_index
        if reduce is not None and self.noise.sampling_shards():
            self.noise.sample_shard_input(interval, *reduce)
        return interval

    def collective_end(self, interval: CommInterval, work: Any, failed: bool = False) -> None:
        """Mark the end: now if the call ran synchronously, else when ``work`` completes.

        ``failed``: the call raised; its end is marked so the step is not left waiting.

        A synchronous call on a host clock held the training thread throughout (gloo);
        on CUDA the mark is recorded on FSDP's communication stream after the
        collective, and the compute stream's wait is timed apart (:meth:`wait_start`).
        """
        try:
            if failed:
                interval.reduced = None
            if work is None:
                interval.end = self.clock.mark()
                interval.blocking = self.clock.kind == "perf_counter"
                self.noise.sample_shard_output(interval)
                return
            interval.reduced = None  # an asynchronous reduce-scatter is not sampled
            future = work.get_future()
        except Exception as exc:
            self.parts["comm"].fail(exc)
            return
        future.then(lambda fut: self.end(interval))

    @guarded("comm")
    def wait_start(self) -> list[Any] | None:
        """The compute timeline starts waiting for communication (FSDP's all-gather)."""
        if not self.in_training_pass():
            return None
        return self.steps.open_span(self.steps.current.comm_waits)

    def wait_end(self, span: list[Any]) -> None:
        self.steps.close_span(span, "comm")

    # ------------------------------------------------------------------ the loop's own
    @guarded("comm")
    def manual_start(self, nbytes: int | None) -> CommInterval | None:
        """Communication the loop does itself starts now (``Profile.communication``)."""
        interval = self._record(nbytes)
        if interval is not None and self.comm_source is None:
            self.comm_source = "manual"
        return interval

    # ------------------------------------------------------------------ unmeasured
    def drop_unfinished(self) -> None:
        """After the comm part failed, a reduction's end may never be marked: the steps
        waiting for one lose their communication figures instead of blocking the rest."""
        if self.parts["comm"].enabled:
            return
        for step in (*self.steps.pending, self.steps.open_record):
            if step is not None and (
                any(c.end is None for c in step.comm) or any(end is None for _, end in step.comm_waits)
            ):
                step.comm = []
                step.comm_waits = []
                cast(PendingStep, step).comm_measured = False  # (never a DeviceRow: its comm is empty)

    def unmeasured(self) -> bool:
        return self.unmeasured_reason() is not None

    def unmeasured_reason(self) -> str | None:
        """Why a distributed run has no communication figures (None: it has them, or one rank)."""
        return _unmeasured_reason(self)

    def warn_unmeasured(self, rank: int) -> None:
        """Once per run, on rank 0, when there are ranks but no communication figures."""
        if self._warned or rank != 0 or self.ddp_attachment.untimed_hook or self._hook_taken:  # warned at attach
            return
        reason = self.unmeasured_reason()
        if reason is not None and self.parts["comm"].enabled:
            self._warned = True
            console.warn(
                f"dtprofile: gradient communication is not measured: {reason}. "
                "R_O counts data wait only and the projection models the all-reduce from the "
                "parameter sizes.",
                stacklevel=5,
            )


def _unmeasured_reason(recorder: CommRecorder) -> str | None:
    """See :meth:`CommRecorder.unmeasured_reason` (the recorder is read, never changed)."""
    if recorder.world_size < 2:
        return None
    if not recorder.parts["comm"].enabled:
        return f"disabled after an internal error ({recorder.parts['comm'].error})"
    if recorder.comm_source == "fsdp" and recorder.fsdp_config is None and recorder.steps.steps_seen > 0:
        return (
            f"{recorder.fsdp.api if recorder.fsdp is not None else 'FSDP'} ran steps without a "
            "collective dtprofile could time (its gradient reduction is a custom all-reduce "
            "hook, or this torch's FSDP internals are not the ones dtprofile wraps)"
        )
    if recorder.ddp_attachment.timed_hook is not None or recorder.comm_source in (
        "manual",
        "fsdp",
        "ddp_exposed",
        "ddp_probe",
        "dtensor",
        "pipeline",
    ):
        return None
    if recorder._fsdp_unsupported is not None:
        return recorder._fsdp_unsupported
    if recorder._hook_taken:
        return "another dtprofile profiler was timing this model's communication (one per model)"
    return (
        f"the profiled model ({recorder.model_kind or 'unknown'}) is not DistributedDataParallel: "
        "dtprofile times DDP's gradient all-reduce and FSDP's collectives (fully_shard, "
        "FullyShardedDataParallel); DeepSpeed is not measured"
        + (f"; {recorder.manual_hint}" if recorder.manual_hint else "")
    )
