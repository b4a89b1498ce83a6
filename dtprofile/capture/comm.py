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
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from .. import console
from ..options import BUCKET_TIMING_AUTO
from .._torch_internals import compiled_module, ddp_reduces_plainly, eager, in_backward, patch_ddp_buffer_sync
from .clocks import Clock
from .ddp import NoSyncProbe, TimedHook, find_timed_hook, timed_buffer_sync
from .parts import Parts, guarded
from .records import SHARDED_KINDS, CommInterval
from .steps import MAX_COLLECTIVES_PER_STEP, StepTracker

__all__ = ["CommRecorder", "collectives_per_step"]

log = logging.getLogger(__name__)


def collectives_per_step(comm: list[CommInterval], units: int, replicas: int) -> dict:
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
    a single GPU (benchmarks/gpu_check.py).

    Args:
        steps: the step tracker.
        clock: where marks come from.
        parts: the profiler's parts (the guard reads them).
        world_size: ranks in the run.
        in_training_pass: whether a training forward or a backward runs now.
        noise: the gradient-noise sampler (:class:`dtprofile.noise.NoiseSampler`).
    """

    time_one_rank = False

    def __init__(self, steps: StepTracker, clock: Clock, parts: Parts, world_size: int,
                 in_training_pass: Callable[[], bool], noise: Any) -> None:
        self.steps = steps
        self.clock = clock
        self.parts = parts
        self.world_size = world_size
        self.in_training_pass = in_training_pass
        self.noise = noise
        self.comm_source: str | None = None
        self.ddp: Any = None  # the DDP model whose communication is timed
        self.ddp_config: dict | None = None  # how the DDP model was built (advice reads it)
        self.fsdp: Any = None  # dtprofile.capture.fsdp.FSDPInstrumentation while attached
        self.fsdp_config: dict | None = None  # collectives per step of a sharded model
        self.model_kind: str | None = None  # the profiled module's class (for messages)
        # How the integration's users time communication outside DDP (plain loops only).
        self.manual_hint: str | None = None
        self._timed_hook: TimedHook | None = None
        self._untimed_hook = False  # DDP with a hook of the user's that dtprofile cannot time
        self._hook_taken = False  # DDP's timed hook already serves another running profiler
        self._fsdp_unsupported: str | None = None  # why a sharded model's collectives cannot be timed
        self._ddp_grad_bytes = 0  # no hook: the bytes each syncing backward reduces
        # No hook: the probe steps' all-reduce by hand times communication alone.
        self._probe_by_hand: NoSyncProbe | None = None
        self._switch_to_hook = False  # register dtprofile's hook at the next step's close
        self._syncing_passes: list = []  # no hook: the forward hook that counts syncing passes
        # The profiled module's call runs backward itself (set by the owner): no NoSyncProbe.
        self.backward_in_forward = False
        # Marks the open backward pass's compute as ended (set by the owner: the pass hooks).
        self.backward_compute_done: Callable[[], None] = lambda: None
        self._warned = False
        self._undo: list[Callable[[], Any]] = []

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
        :class:`NoSyncProbe` makes its own probe steps)."""
        return self._timed_hook is not None and self._probe_by_hand is None

    def every_rank_started(self, every_rank: bool) -> None:
        """The profiler started, on every rank or not (one verdict for all ranks). Probes
        that reduce by hand need every rank; without them, dtprofile's hook times the
        buckets (a hook on some ranks only makes the same collectives)."""
        if self._probe_by_hand is not None:
            self._probe_by_hand.start(every_rank)
            if not every_rank:
                self.lost_probes_by_hand()

    # ------------------------------------------------------------------ attach
    def attach_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Time gradient communication with a :class:`TimedHook` on ``ddp`` (with two ranks or more).

        Where probe steps can skip DDP's reduction (:meth:`_hook_free`), registers no hook
        at all. Else re-uses a TimedHook already registered (by the user through
        ``timed_hook`` or by an earlier profiler), or registers one when the model has no
        hook; a hook of the user's that dtprofile cannot time gets one warning, and
        communication is reported unmeasured.
        """
        if self._timed_hook is not None:
            return
        self.ddp = ddp
        self.ddp_config = {
            "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
            # DDP keeps int(bucket_cap_mb * 2**20) bytes: 0.01 comes back as 0.0099993.
            "bucket_cap_mb": round(getattr(ddp, "bucket_bytes_cap", 0) / 2**20, 4) or None,
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "static_graph": bool(getattr(ddp, "static_graph", False)),
            "compiled_inside": compiled_module(getattr(ddp, "module", None)),
        }
        if self.world_size < 2 and not self.time_one_rank:
            return  # a one-rank all-reduce moves nothing: no hook, and nothing it would cost
        try:
            hook, other = find_timed_hook(ddp)
            if hook is None and not other and self._hook_free(ddp):
                self._attach_without_hook(ddp)
                return
            if hook is None and other:
                self._untimed_hook = True
                console.warn(
                    "dtprofile: this DDP model already has a communication hook, so gradient communication "
                    "is reported as unmeasured (null). Wrap your hook to time it: "
                    "model.register_comm_hook(state, dtprofile.timed_hook(your_hook))",
                    stacklevel=4,
                )
                return
            if hook is not None and hook.recorder is not self and getattr(hook.recorder, "active", False):
                self._taken_by_another()  # the hook times for one profiler: the one that has it
                return
            _time_buffer_sync(self, ddp)
            self._attach_hook(ddp, hook)
            if self._timed_hook._default and self._can_skip_sync(ddp):
                self._probe_by_hand = NoSyncProbe(ddp, self, self.steps.options)
                self._undo.append(self._probe_by_hand.remove)
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def _attach_hook(self, ddp: torch.nn.parallel.DistributedDataParallel, hook: TimedHook | None) -> None:
        """Time through ``hook``, or a :class:`TimedHook` registered now (None)."""
        if hook is None:
            hook = TimedHook()
            # The model's own group (allreduce_hook with no state would reduce over WORLD).
            ddp.register_comm_hook(getattr(ddp, "process_group", None), hook)
        hook.reduces_in_finalize = bool(getattr(ddp, "static_graph", False)
                                        or getattr(ddp, "_delay_all_reduce_all_params", False))
        hook.recorder = self
        self._timed_hook = hook
        self.comm_source = "user" if hook.user_supplied else "dtprofile"
        self.ddp_config["comm_hook"] = hook.hook_name
        self.ddp_config["compressed_16bit"] = hook.wire_itemsize == 2

    def _attach_without_hook(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """DDP keeps its own all-reduce (:meth:`_hook_free`); probe steps reduce by hand
        unless ``bucket_timing_every`` is 0."""
        owner = _HOOK_FREE_OWNERS.get(ddp)
        if owner is not None and owner is not self and owner.active:
            self._taken_by_another()
            return
        _time_buffer_sync(self, ddp)
        self._count_syncing_passes(ddp)
        if self.steps.options.bucket_timing_every == BUCKET_TIMING_AUTO:
            # Communication alone, on the probe steps: the all-reduce by hand after backward.
            # As DDP's own reducer scales a gradient it copies into its bucket: by the
            # reciprocal of the group's size (one that is a view of the bucket it divides).
            self._probe_by_hand = NoSyncProbe(ddp, self, self.steps.options,
                                              scale_by_reciprocal=not getattr(ddp, "gradient_as_bucket_view", False))
            self._undo.append(self._probe_by_hand.remove)
            self.comm_source = "ddp_probe"
        _HOOK_FREE_OWNERS[ddp] = self
        self._undo.append(lambda: _release_owner(ddp, self))

    def _hook_free(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Whether DDP keeps its own C++ all-reduce (no hook): ``bucket_timing_every`` 0,
        or ``"auto"`` where probe steps can reduce by hand (:class:`NoSyncProbe`) and so
        time communication alone.

        A Python hook costs every bucket a call into Python and, on the CPU, a pass of its
        own to divide the bucket (DDP divides while it copies gradients in): with many
        small buckets that is a fifth of a short step. Without one, only the wait after
        backward is timed on ordinary steps, which needs no call per bucket.
        """
        options = self.steps.options
        if options.bucket_timing_every == 0:
            return True
        return (options.bucket_timing_every == BUCKET_TIMING_AUTO and options.probe_every != 0
                and self._can_skip_sync(ddp))

    def _can_skip_sync(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Whether probe steps may run DDP's passes as under ``no_sync()`` and reduce by hand
        (:class:`NoSyncProbe`): DDP reduces the plain way, outside a compiled forward, and
        backward runs after the forward, not inside it."""
        return ddp_reduces_plainly(ddp) and not self.ddp_config["compiled_inside"] and not self.backward_in_forward

    def lost_probes_by_hand(self) -> None:
        """Probe steps cannot skip DDP's reduction on this model after all (a backward ran
        inside DDP's forward, the forward is compiled and the probe's hooks were traced
        away, or a join() began): from the next step on, probe steps hold the reductions
        in dtprofile's hook, registered then if there is none, which also times the buckets."""
        if self._probe_by_hand is not None:
            self._probe_by_hand.disabled = True
            self._probe_by_hand = None
            # At the step's close, when no backward is under way.
            self._switch_to_hook = self._timed_hook is None

    def _use_hook_now(self) -> None:
        self._switch_to_hook = False
        try:
            while self._syncing_passes:
                self._syncing_passes.pop().remove()
            self._attach_hook(self.ddp, None)
            log.debug("dtprofile: DDP's buckets are timed through dtprofile's hook from step %d on",
                      self.steps.steps_seen)
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def _count_syncing_passes(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """No hook (:meth:`_hook_free`): DDP reduces with its own C++ all-reduce.

        After each of DDP's training forwards that will reduce in backward (outside
        ``no_sync()``) the step gets one untimed interval holding every gradient's bytes,
        so that the pass hooks' wait after that backward counts as exposed communication.
        """
        self._ddp_grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
        handle = ddp.register_forward_hook(self._ddp_forward_done)
        self._syncing_passes.append(handle)
        self._undo.append(handle.remove)
        self.comm_source = "ddp_exposed"
        self.ddp_config["comm_hook"] = None

    @guarded("comm")
    def _ddp_forward_done(self, module: Any, args: Any, output: Any) -> None:
        if not (torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True)
                and not self.steps.excluding):
            return
        interval = self._record(self._ddp_grad_bytes, bucket=True, timed=False)
        if interval is not None:
            interval.pass_index += 1  # the backward this forward's reduction belongs to

    def _taken_by_another(self) -> None:
        self._hook_taken = True
        console.warn("dtprofile: another profiler is already timing this model's communication; "
                     "this one reports it as unmeasured (null)", stacklevel=5)

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
            self._taken_by_another()
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def detach(self) -> None:
        """Put back what was patched; DDP's hook passes straight through from now on."""
        while self._undo:
            self._undo.pop()()
        if self._timed_hook is not None:
            self._timed_hook.recorder = None
            self._timed_hook.release_held()
        if self.fsdp is not None:
            try:
                self.fsdp.remove()
            except Exception as exc:
                log.debug("dtprofile: FSDP instrumentation not removed: %r", exc)

    def step_closed(self, step: Any) -> None:
        """A step closed: a probe that reduced nothing by hand is an ordinary step (and
        the hook takes over); a sharded step's collectives per step, for ``run.fsdp``."""
        by_hand = self._probe_by_hand
        if by_hand is not None or self._switch_to_hook:
            step.probe = step.reduced_by_hand  # the probe steps NoSyncProbe chose and made
        if by_hand is not None and by_hand.compiled:
            self.lost_probes_by_hand()
        if self._switch_to_hook:
            self._use_hook_now()
        if self.fsdp is not None and any(c.sharded for c in step.comm):
            self.fsdp_config = collectives_per_step(step.comm, self.fsdp.units, self.noise.shard_copies)
            self.fsdp_config["api"] = self.fsdp.api

    # ------------------------------------------------------------------ the record path
    def _record(self, nbytes: int | None, *, kind: str = "all_reduce", bucket: bool = False,
                blocking: bool = False, timed: bool = True) -> CommInterval | None:
        """One interval starting now in the open step (None past the step's limit).

        ``timed`` False: no marks of its own (a batched step's bucket): its start and end
        are the step's start, so it adds no event and no span.
        """
        step = self.steps.current
        if len(step.comm) >= MAX_COLLECTIVES_PER_STEP:
            return None
        start = self.clock.mark() if timed else step.start
        interval = CommInterval(start=start, end=None if timed else start, nbytes=nbytes, bucket=bucket, kind=kind,
                                blocking=blocking, pass_index=len(step.backward), timed=timed)
        step.comm_measured = True
        step.comm.append(interval)
        return interval

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
        interval = self._record(_wire_bytes(buffer, wire_itemsize), bucket=True)
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
        return (step is not None and not step.times_buckets and self.parts.measuring
                and self.parts["timing"].enabled and self.parts["comm"].enabled
                and not self._timed_hook.reduces_in_finalize
                and bool(step.backward) and step.backward[-1][1] is None and in_backward())

    @guarded("comm")
    def bucket_untimed(self, bucket: Any, wire_itemsize: int | None = None,
                       joined: CommInterval | None = None) -> CommInterval | None:
        """A DDP bucket of a batched step: its size and pass, no marks of its own (its start
        and end are the step's start, so it adds no event).

        ``joined``: the pass's interval so far; the bucket's bytes are added to it, unless
        the step samples each bucket's gradient norm (an interval per bucket then).
        """
        buffer = bucket.buffer()
        nbytes = _wire_bytes(buffer, wire_itemsize)
        sampling = self.noise.sampling_buckets()
        if joined is not None and not sampling:
            joined.nbytes += nbytes
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

    def bucket_done(self, interval: CommInterval, future: torch.futures.Future) -> None:
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

    def probe_reduced(self, interval: CommInterval, local_sq: list[torch.Tensor],
                      reduced_sq: list[torch.Tensor], local_scale: float) -> None:
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
        return self._record(nbytes, kind=kind, blocking=True)

    # ------------------------------------------------------------------ FSDP
    @guarded("comm")
    def collective_start(self, kind: str, nbytes: int, reduce: tuple | None = None) -> CommInterval | None:
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
    def wait_start(self) -> list | None:
        """The compute timeline starts waiting for communication (FSDP's all-gather)."""
        if not self.in_training_pass():
            return None
        return self.steps.open_span(self.steps.current.comm_waits)

    def wait_end(self, span: list) -> None:
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
        for step in (*self.steps.pending, self.steps.current):
            if step is not None and (any(c.end is None for c in step.comm)
                                     or any(end is None for _, end in step.comm_waits)):
                step.comm = []
                step.comm_waits = []
                step.comm_measured = False

    def unmeasured(self) -> bool:
        return self.unmeasured_reason() is not None

    def unmeasured_reason(self) -> str | None:
        """Why a distributed run has no communication figures (None: it has them, or one rank)."""
        return _unmeasured_reason(self)

    def warn_unmeasured(self, rank: int) -> None:
        """Once per run, on rank 0, when there are ranks but no communication figures."""
        if self._warned or rank != 0 or self._untimed_hook or self._hook_taken:  # warned at attach
            return
        reason = self.unmeasured_reason()
        if reason is not None and self.parts["comm"].enabled:
            self._warned = True
            console.warn(f"dtprofile: gradient communication is not measured: {reason}. "
                         "R_O counts data wait only and the projection models the all-reduce from the "
                         "parameter sizes.", stacklevel=5)


def _wire_bytes(buffer: torch.Tensor, wire_itemsize: int | None) -> int:
    """A bucket's bytes on the wire (``wire_itemsize``: a compressing hook's element size)."""
    return buffer.numel() * min(wire_itemsize or buffer.element_size(), buffer.element_size())


def _unmeasured_reason(recorder: CommRecorder) -> str | None:
    """See :meth:`CommRecorder.unmeasured_reason` (the recorder is read, never changed)."""
    if recorder.world_size < 2:
        return None
    if not recorder.parts["comm"].enabled:
        return f"disabled after an internal error ({recorder.parts['comm'].error})"
    if recorder.comm_source == "fsdp" and recorder.fsdp_config is None and recorder.steps.steps_seen > 0:
        return (f"{recorder.fsdp.api if recorder.fsdp is not None else 'FSDP'} ran steps without a "
                "collective dtprofile could time (its gradient reduction is a custom all-reduce "
                "hook, or this torch's FSDP internals are not the ones dtprofile wraps)")
    if recorder._timed_hook is not None or recorder.comm_source in ("manual", "fsdp", "ddp_exposed", "ddp_probe"):
        return None
    if recorder._fsdp_unsupported is not None:
        return recorder._fsdp_unsupported
    if recorder._untimed_hook:
        return ("the DDP model has a communication hook dtprofile cannot time "
                "(register it wrapped: dtprofile.timed_hook(hook))")
    if recorder._hook_taken:
        return "another dtprofile profiler was timing this model's communication (one per model)"
    return (f"the profiled model ({recorder.model_kind or 'unknown'}) is not DistributedDataParallel: "
            "dtprofile times DDP's gradient all-reduce and FSDP's collectives (fully_shard, "
            "FullyShardedDataParallel); DeepSpeed is not measured"
            + (f"; {recorder.manual_hint}" if recorder.manual_hint else ""))


#: The recorder that times each DDP model without a hook (one per model); nothing is
#: stored on the model itself.
_HOOK_FREE_OWNERS: "weakref.WeakKeyDictionary[Any, CommRecorder]" = weakref.WeakKeyDictionary()


def _release_owner(ddp: Any, recorder: CommRecorder) -> None:
    if _HOOK_FREE_OWNERS.get(ddp) is recorder:
        del _HOOK_FREE_OWNERS[ddp]


def _time_buffer_sync(recorder: CommRecorder, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Time DDP's buffer broadcast before each forward (see :func:`timed_buffer_sync`)."""
    undo = patch_ddp_buffer_sync(ddp, lambda original: eager(timed_buffer_sync(ddp, original, recorder)))
    if undo is None:
        return  # another torch, or another profiler's
    if getattr(ddp, "broadcast_buffers", True) and getattr(ddp, "modules_buffers", None):
        recorder.ddp_config["buffer_broadcast_bytes"] = sum(b.numel() * b.element_size() for b in ddp.modules_buffers)
    else:
        recorder.ddp_config["buffer_broadcast_bytes"] = 0
    recorder._undo.append(undo)
