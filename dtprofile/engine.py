"""The measurement engine: a small facade over the capture parts, the gather and the sinks.

Integrations (plain PyTorch, Lightning) build one :class:`Engine` with the run's
:class:`~dtprofile.options.Options` and how their framework behaves, attach the model
and optimizers, and translate their framework's events into calls on its parts:

- ``engine.steps`` (:class:`~dtprofile.capture.steps.StepTracker`): the steps, what is
  left out of them (``exclude_start``/``exclude_end``, ``loop_starts``);
- ``engine.passes`` (:class:`~dtprofile.capture.passes.PassHooks`): forward and backward;
- ``engine.updates`` (:class:`~dtprofile.capture.updates.UpdateTracker`): where a step
  ends (the update, a skipped update, a batch's end);
- ``engine.data`` (:class:`~dtprofile.capture.data_wait.DataWait`): data wait;
- ``engine.cpu_time`` (:class:`~dtprofile.capture.cpu_time.CPUTime`): the loader's and the
  training's CPU time;
- ``engine.comm`` (:class:`~dtprofile.capture.comm.CommRecorder`): communication;
- ``engine.mesh`` (:class:`~dtprofile.capture.mesh_comm.MeshComm`): a DeviceMesh's
  collectives (DTensor models: tensor parallel, FSDP2 x TP), per mesh dimension.

The engine owns the lifecycle (start, stop, detach), fault isolation (its
:class:`~dtprofile.capture.parts.Parts`), and the log intervals
(:class:`~dtprofile.intervals.Intervals`): the cross-rank gather, and the summary and the
sink, which a background worker builds and writes.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import console
from ._torch_internals import CompileWatch, LeanHooks, _ModuleHook, compiled_module, driven_optimizer, watch_ddp_joins
from .capture.clocks import Clock, make_clock
from .capture.comm import CommRecorder
from .capture.cpu_time import CPUTime
from .capture.data_wait import DataWait
from .capture.mesh_comm import MeshComm
from .capture.parts import Part, Parts, Unhookable
from .capture.passes import LeanPreHook, PassHooks, TimedCall
from .capture.pipeline import PipelineComm
from .capture.scaler import watch_scalers
from .capture.steps import StepTracker
from .capture.updates import UpdateTracker
from .intervals import Intervals
from .noise import NoiseSampler
from .options import Options
from .runinfo import Telemetry
from .summary import Report

__all__ = ["Engine", "Part", "stop_engines_on"]

log = logging.getLogger(__name__)

# Engines measuring now. A new profile of a model or optimizer that one of them still
# watches takes over from it (a notebook cell that started it was interrupted before stop()).
_RUNNING: weakref.WeakSet[Engine] = weakref.WeakSet()


def stop_engines_on(objects: Iterable[Any]) -> None:
    """Stop every running engine that watches one of ``objects`` (modules, optimizers):
    its run is reported incomplete, its hooks are removed."""
    ids = {id(o) for o in objects if o is not None}
    for engine in list(_RUNNING):
        watched = [*engine.modules, *engine.updates.optimizers]
        if engine.active and any(id(o) in ids for o in watched):
            console.warn(
                "dtprofile: a profiler started earlier on this model or optimizer is still running "
                "(its loop was interrupted before stop()?); stopping it, its run reported incomplete, "
                "and profiling with the new one",
                stacklevel=3,
            )
            try:
                engine.stop(complete=False, failed=True)
            except Exception as exc:
                log.debug("dtprofile: stopping the earlier profiler failed: %r", exc)
                engine.detach()
                engine.active = False


class Engine:
    """Per-rank measurement of one profiled run.

    Args:
        options: the run's options.
        device: the model's device (CUDA events time a CUDA model, ``perf_counter`` others).
        clock: a clock to use instead (tests pass a
            :class:`~dtprofile.capture.clocks.FakeEventClock`).
        sink_factory: makes the sink that writes each interval (rank 0 only; called at
            start, its failure disables the sink part); None: no sink.
        framework: whose knobs the advice names: ``"torch"`` or ``"lightning"``.
        comm_hint: how this integration's users time communication outside DDP.
        steps_end_at_batch: a step per batch in which any optimizer stepped (several
            optimizers per batch), instead of one per primary-optimizer step.
        steps_need_backward: an optimizer step after forwards without backward is a
            skipped batch (loops that step anyway: Lightning's automatic optimization).
        backward_in_forward: the profiled module's call runs backward and the optimizer
            step itself (Lightning's manual optimization under DDP): probe steps then hold
            DDP's reductions in the hook instead of skipping them in forward.
        update_start_marked: the integration calls ``updates.update_starts()`` where the
            update begins, after the work the framework runs inside ``optimizer.step``
            before it (Lightning's closure): that work is not the update, and a backward
            in it need not be timed for the optimizer's figure.
        summarize_every_rank: build each interval's summary on every rank, not only where
            a sink writes it (integrations that publish the figures on each rank).
        on_interval: called with ``(summary, step)`` for each interval summarised, stop()'s
            last one too, on the training thread (at the step close after the background
            worker finished it, or in stop()); must not raise into training.
        global_step: the framework's step counter, for the x-axis of what is logged.

    Example:
        >>> import torch
        >>> from dtprofile.options import Options
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> engine = Engine(Options(warmup_steps=0))
        >>> engine.attach_module(model); engine.attach_optimizer(opt); engine.start()
        >>> for _ in range(3):
        ...     model(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()
        >>> engine.stop().to_dict()["steps_total"]
        3
    """

    def __init__(
        self,
        options: Options,
        *,
        device: torch.device | None = None,
        clock: Clock | None = None,
        sink_factory: Callable[[], Any] | None = None,
        framework: str = "torch",
        comm_hint: str | None = None,
        steps_end_at_batch: bool = False,
        steps_need_backward: bool = False,
        backward_in_forward: bool = False,
        update_start_marked: bool = False,
        summarize_every_rank: bool = False,
        on_interval: Callable[[dict[str, Any], int], None] | None = None,
        global_step: Callable[[], int] | None = None,
    ) -> None:
        self.options = options
        self.device = device or torch.device("cpu")
        self.clock = clock or make_clock(self.device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.backend = str(dist.get_backend()) if self.distributed else None
        self.framework = framework
        self.global_step = global_step
        self.parts = Parts()
        self.steps = StepTracker(options, self.clock, self.parts)
        self.data = DataWait(self.steps, self.parts)
        self.passes = PassHooks(self.steps, self.data, self.clock, self.parts)
        self.updates = UpdateTracker(self.steps, self.clock, self.parts)
        self.updates.steps_end_at_batch = steps_end_at_batch
        self.updates.steps_need_backward = steps_need_backward
        self.updates.update_start_marked = update_start_marked
        self.passes.updates = self.updates
        self.passes.synced_apart = self.distributed
        self.data.forward_open = lambda: self.passes.forward_open
        self.cpu_time = CPUTime(self.data)
        self.noise = NoiseSampler(self.steps, self.data, self.world_size, options.every_n_steps)
        self.comm = CommRecorder(
            self.steps, self.clock, self.parts, self.world_size, self.passes.in_training_pass, self.noise
        )
        self.comm.manual_hint = comm_hint
        self.comm.backward_in_forward = backward_in_forward
        self.comm.backward_compute_done = self.passes.backward_compute_done
        self.comm.backward_waited = self.passes.backward_waited
        # A model on a DeviceMesh (DTensor parameters): its collectives per dimension.
        self.mesh = MeshComm(self.steps, self.comm, self.clock, self.parts, self.passes)
        # A pipeline stage (torch.distributed.pipelining): its point-to-point waits.
        self.pipeline = PipelineComm(self.steps, self.clock, self.parts, self.comm)
        self.telemetry = Telemetry(self.device, options.telemetry_interval_s)
        lane = self.steps.lane
        lane.passes, lane.updates, lane.data = self.passes, self.updates, self.data
        lane.synced_ok, lane.comm_left = self.comm.lane_takes_synced_steps, self.comm.lane_comm_left
        self._wire_steps()
        self.intervals = Intervals(self, sink_factory, summarize_every_rank, on_interval)
        lane.unpublished, lane.publish = self.intervals.unpublished, self.intervals.publish
        self.modules: list[torch.nn.Module] = []
        self.report: Report | None = None
        self._handles: list[Any] = []
        # The per-step hooks run plain until TorchDynamo compiles something (see CompileWatch).
        self.compile_watch = CompileWatch()
        self._undo: list[Callable[[], Any]] = []  # what detach() puts back

    def _can_probe(self) -> bool:
        """Whether the next step may be a probe that holds DDP's reductions in the timed
        hook. (Without a hook, :class:`~dtprofile.capture.probe.NoSyncProbe` picks its probe
        steps itself.)"""
        return self.comm.holds_probes

    def _wire_steps(self) -> None:
        """What happens around a step, connected across the parts."""
        steps = self.steps
        steps.can_probe = self._can_probe
        steps.before_drain = self.comm.drop_unfinished
        noise_step_done, pipeline_step_drained = self.noise.step_done, self.pipeline.step_drained

        def drained(step: Any) -> None:
            noise_step_done(step)
            pipeline_step_drained(step)

        steps.on_drained = drained

        def steady_state() -> None:
            self.telemetry.steady_state()
            self.cpu_time.start()  # the workers' start-up and the first batches are not the loader's pace

        steps.on_steady_state = steady_state
        steps.on_interval = lambda: self.intervals.log()
        steps.on_pause = lambda: self.intervals.hand_over_aside()

        def closed(step: Any) -> None:
            self.passes.step_closed()
            self.comm.step_closed(step)
            self.mesh.step_closed(step)
            self.pipeline.step_closed(step)
            intervals = self.intervals
            if intervals.unpublished:  # a summary the worker finished: published here, on the training thread
                intervals.publish()

        steps.on_closed = closed

    # ------------------------------------------------------------------ lifecycle
    @property
    def active(self) -> bool:
        """Between start() and stop()."""
        return self.parts.active

    @active.setter
    def active(self, value: bool) -> None:
        self.parts.active = value

    def start(self) -> None:
        """Begin measuring: the start verdict on the store, the sink, the first step."""
        if self.active:
            raise RuntimeError("this dtprofile profiler is already running; call stop() first")
        self.intervals.start()
        gather = self.intervals.gather
        # Probes that reduce by hand add collectives: only where every rank profiles.
        self.comm.every_rank_started(
            self.world_size == 1 or (gather is not None and gather.started_together),
            gather.start_key if gather is not None else None,
        )
        self.telemetry.start()
        self.cpu_time.start()
        self._check_optimizer_params()
        self._undo.append(watch_scalers(self.updates))
        # The steady lane takes the common steps of a loop that steps one optimizer per
        # step (see capture/lane.py); under a process group, where the communication part
        # lets it (DDP's own all-reduce); on a device clock its steps wait for their
        # events in pending.
        lane = self.steps.lane
        lane.allowed = not self.updates.steps_end_at_batch
        lane.synced = self.passes.synced_apart
        lane.device = self.clock if self.clock.kind != "perf_counter" else None
        self.active = True
        _RUNNING.add(self)
        try:
            first = self.clock.mark()
        except Exception as exc:
            self.parts["timing"].fail(exc)
            first = None
        self.mesh.start()
        self.steps.start_step(first)

    def _check_optimizer_params(self) -> None:
        """Warn once when the step-bounding optimizer holds none of the model's parameters
        (made before ``fully_shard`` replaced them, or for another copy): its steps then
        update nothing this model uses."""
        opt = self.updates.primary
        if opt is None or not self.modules:
            return
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        model = {id(p) for m in self.modules if m is not None for p in m.parameters()}
        if held and model and not held & model:
            console.warn(
                "dtprofile: the optimizer holds none of the profiled model's parameters (was it made "
                "before fully_shard or DDP replaced or copied them?): its steps update nothing this "
                "model uses",
                stacklevel=4,
            )

    def stop(self, complete: bool = True, failed: bool = False) -> Report:
        """Detach every hook, gather the final figures, write the summary (rank 0).

        ``failed``: the loop raised; the final gather waits only
        :data:`~dtprofile.intervals.FAILED_RUN_GATHER_TIMEOUT_S` for the other ranks, which are likely stuck in
        the collective this rank left.
        """
        if not self.active:
            if self.report is None:
                self.report = Report(self.summary(final=True, complete=complete, failed=failed))
            return self.report
        _RUNNING.discard(self)
        self.detach()
        self.telemetry.stop()  # before the final drain synchronises: the GPU still busy
        try:
            if self.clock.kind == "cuda_event" and self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.synchronize(self.device)  # end of run only: never inside a step
            self.steps.drain()
        except Exception as exc:  # the steps still pending are lost, not the run's report
            self.parts["timing"].fail(exc)
        self.comm.warn_unmeasured(self.rank)
        summary = self.summary(final=True, complete=complete, failed=failed)
        self.active = False
        self.report = Report(summary)
        self.intervals.finish(summary)
        return self.report

    def detach(self) -> None:
        """Remove module/optimizer hooks; the comm hook falls back to pass-through."""
        self.steps.lane.unswitch()
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
        self.compile_watch.close()
        self.steps.backward_reached.clear()  # (it may hold a parameter of the model)
        while self._undo:
            self._undo.pop()()
        for remove in (self.comm.detach, self.mesh.remove, self.pipeline.remove):
            try:  # (each part's own: one that fails leaves the others to be removed)
                remove()
            except Exception as exc:
                log.debug("dtprofile: a part not detached: %r", exc)

    def suspend(self) -> None:
        """Training that is not this run's runs from now (Lightning's tuner running trial
        steps from a hook): every hook ignores it and its time is left out of the step."""
        if self.parts.suspended or not self.active:
            return
        self.steps.exclude_start()
        self.parts.suspended = True
        self.steps.hold_backward_seen()  # (the hook on the watched parameter runs on)

    @property
    def suspended(self) -> bool:
        """Between :meth:`suspend` and :meth:`resume`: nothing is measured."""
        return self.parts.suspended

    def resume(self) -> None:
        """The run's own training goes on (ends :meth:`suspend`)."""
        if not self.parts.suspended:
            return
        self.parts.suspended = False
        self.steps.exclude_end()
        self.steps.release_backward_seen()

    # ------------------------------------------------------------------ attach
    def attach_module(self, module: torch.nn.Module) -> None:
        """Time forward passes of ``module`` (and through them, backward)."""
        self.modules.append(module)
        if self.comm.model_kind is None:
            self.comm.model_kind = type(module).__name__
        from .capture.fsdp import is_fsdp

        # FSDP's root hooks gather parameters before forward and queue its final
        # backward callback: ours go first, so forward and backward include that work
        # and backward's compute ends before FSDP waits for the last reduce-scatters.
        sharded = is_fsdp(module)
        pre_hook, post_hook = _ModuleHook(self.passes.forward_pre_hook), _ModuleHook(self.passes.forward_post_hook)
        pre = module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=sharded)
        post = module.register_forward_hook(post_hook, prepend=sharded)
        self._handles += [pre, post]
        watch = self.compile_watch
        compiled = compiled_module(module)
        watch.add(pre, pre_hook, compiled)
        watch.add(post, post_hook, compiled)
        lean = self._lean_switch(module)
        if lean is not None:
            lean.add(pre, LeanPreHook(self.passes))
            lean.add(post, None)
        self._attach_parallel(module, sharded)

    def _lean_switch(self, module: torch.nn.Module) -> LeanHooks | None:
        """The lane's switch to lean hooks for ``module`` (capture/lane.py), or None: with
        more than one module timing forwards, no step is lean."""
        lane = self.steps.lane
        if len(self.modules) != 1:
            lane.unswitch()
            return None
        lane.switch = LeanHooks(module, self.compile_watch)
        self.compile_watch.on_compile.append(lane.unswitch)  # (before anything is traced)
        return lane.switch

    def _attach_parallel(self, module: torch.nn.Module, sharded: bool) -> None:
        """``module``'s gradient communication, when it is a DDP model or holds FSDP units;
        its DeviceMesh's collectives, when it holds DTensor parameters."""
        # torch.compile(ddp_model) hands back a wrapper around the DDP model.
        wrapped = getattr(module, "_orig_mod", module)
        ddp = False
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            ddp = True
            self.attach_ddp(wrapped)
            self.modules.append(wrapped.module)
        elif sharded:
            self.attach_fsdp(wrapped)
        self.attach_mesh(wrapped, ddp)
        if self.world_size >= 2:
            # (wrappers that wait for a schedule's first step: a program that only imports
            # pipelining keeps its fast path)
            self.pipeline.install()

    def attach_mesh(self, module: torch.nn.Module, ddp: bool = False) -> None:
        """Time the collectives of ``module``'s DeviceMesh, when it holds DTensor parameters
        (:class:`~dtprofile.capture.mesh_comm.MeshComm`): DTensor's in the step record,
        every one per mesh dimension. ``ddp``: DDP reduces its gradients (its source stays)."""
        if self.world_size < 2 or not self.mesh.attach(module, c10d=self.comm.fsdp is not None):
            return
        # Each step's waits and collectives go through the general path (the lane's rows
        # hold no span of them).
        self.steps.lane.enabled = False
        if self.comm.comm_source is None and not ddp and self.comm.fsdp is None:
            self.comm.comm_source = "dtensor"

    def attach_call(self, owner: Any, name: str, module: torch.nn.Module) -> None:
        """Time each call of ``owner.<name>`` as a forward pass of ``module`` (and through
        it, backward): for a framework that calls its model's step through a method
        rather than the module's call (Lightning's single-device
        ``strategy.training_step``). Undone at :meth:`detach`. See
        :class:`~dtprofile.capture.passes.TimedCall`.
        """
        self.modules.append(module)
        if self.comm.model_kind is None:
            self.comm.model_kind = type(module).__name__
        from .capture.fsdp import is_fsdp

        # The marks wrap the whole call: FSDP's hooks on the modules it calls come between.
        self._lean_switch(module)  # (no hook to switch: the timed call reads the lane's flag)
        self._undo.append(TimedCall(owner, name, module, self.passes).restore)
        self._attach_parallel(module, is_fsdp(module))

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The first optimizer attached marks step boundaries; others add optimizer time.

        A wrapper (Accelerate's ``AcceleratedOptimizer``) is unwrapped to the optimizer it
        drives. One whose step cannot be hooked is warned about once, and the steps go
        unmeasured (the ``timing`` part is disabled with the reason): never an error in
        the training program.
        """
        optimizer = driven_optimizer(optimizer)
        try:
            # (bound once: the compile watch finds each by identity)
            pre_hook, post_hook = self.updates.pre_hook, self.updates.post_hook
            pre = optimizer.register_step_pre_hook(pre_hook)
            try:
                post = optimizer.register_step_post_hook(post_hook)
            except Exception:
                pre.remove()
                raise
        except Exception as exc:
            self.parts["timing"].fail(
                Unhookable(
                    f"cannot hook the step of {type(optimizer).__name__} ({type(exc).__name__}: {exc}); "
                    "pass the torch.optim.Optimizer it wraps"
                )
            )
            return
        self.updates.attach(optimizer)
        self._handles += [pre, post]
        self.compile_watch.add(pre, pre_hook)
        self.compile_watch.add(post, post_hook)
        if self.updates.primary is optimizer and not self.distributed:
            self._watch_backward(optimizer)

    def _watch_backward(self, optimizer: torch.optim.Optimizer) -> None:
        """A hook that stays on the primary optimizer's first trainable parameter and
        notes each backward that reaches it: without a process group, backward is timed
        on a sample of the steps only (``backward_timing_every``), and on the others this
        is what tells a skipped update from a second forward. (Registered once: a hook on
        a parameter costs a step about 1 us, one on each step's output about 6.)"""
        params = (p for group in optimizer.param_groups for p in group["params"])
        param = next((p for p in params if isinstance(p, torch.Tensor) and p.requires_grad), None)
        register = getattr(param, "register_post_accumulate_grad_hook", None)
        if register is None:
            return
        try:
            hook = self.steps.backward_reached.append
            handle = register(hook)
            self._handles.append(handle)
            self.compile_watch.add(handle, hook)
        except Exception as exc:  # (skips on untimed steps then go unnoticed: no error for that)
            log.debug("dtprofile: no hook on a parameter to note backward passes: %r", exc)

    def attach_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Time ``ddp``'s gradient communication (see :meth:`CommRecorder.attach_ddp`)."""
        if self.comm.ddp is None:
            unwatch = watch_ddp_joins(ddp)
            if unwatch is not None:
                self._undo.append(unwatch)
        self.comm.attach_ddp(ddp)

    def attach_fsdp(self, module: torch.nn.Module) -> None:
        """Time the collectives of every ``fully_shard`` unit in ``module``."""
        self.comm.attach_fsdp(module)
        self.updates.sharded = self.comm.fsdp is not None

    def note_loader(self, loader: Any) -> None:
        """Remember what a DataLoader says about itself (see :meth:`DataWait.note_loader`)."""
        self.data.note_loader(loader)

    # ------------------------------------------------------------------ intervals and summaries
    def log_step(self) -> int:
        """The x-axis step of what is logged now: the framework's (``global_step``), else ours."""
        if self.global_step is not None:
            try:
                return int(self.global_step())
            except Exception:
                self.global_step = None
        return self.steps.steps_seen

    @property
    def gather(self) -> Any:
        """The cross-rank gather (None before start)."""
        return self.intervals.gather

    @property
    def sink(self) -> Any:
        """The sink each interval is handed to (rank 0; None without one)."""
        return self.intervals.sink

    @property
    def latest_summary_step(self) -> int | None:
        """The log step of :meth:`latest_summary`'s interval."""
        return self.intervals.latest_step

    def latest_summary(self) -> dict[str, Any] | None:
        """The newest summary: the latest log interval's that the background worker
        finished (published at the step close after it; with several ranks, the latest
        whose gather completed: its step is :attr:`latest_summary_step`), or the final one
        after stop()."""
        return self.intervals.latest()

    def latest_summary_with_step(self) -> tuple[dict[str, Any] | None, int | None]:
        """:meth:`latest_summary` and :attr:`latest_summary_step`, read together (from
        another thread, two reads could straddle a newer interval's)."""
        return self.intervals.latest_with_step()

    def summary(self, final: bool, complete: bool, failed: bool = False) -> dict[str, Any]:
        """The run's summary now: ``final`` gathers every rank's whole-run figures (at
        stop); otherwise this rank's figures so far. Never raises."""
        return self.intervals.summary(final, complete, failed)
