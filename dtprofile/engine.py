"""The measurement engine: framework events in, per-step records and summaries out.

Integrations (plain PyTorch, Lightning) only translate their framework's events into
the calls below; the engine owns the clock, the pending steps, the windows, the
cross-rank gather and the sinks. Its hooks, all attached with :meth:`Engine.attach_*`:

- module forward pre/post hooks: forward time per micro-batch; the post hook also
  registers a gradient hook on the output, which marks the start of backward and
  queues an autograd-engine callback that marks its end (autograd runs queued
  callbacks when the graph is done, before DDP's own finalisation waits for the
  reductions, so that mark is the end of backward *compute*);
- optimizer step pre/post hooks: the optimizer phase, and the step boundary;
- the DDP communication hook (:class:`dtprofile.comm.TimedHook`): bucket ready and
  reduction done;
- for a sharded model (FSDP2, ``fully_shard``), FSDP's own all-gather and
  reduce-scatter objects, its wait for each all-gather and (HSDP, ``replicate``) its
  all-reduce across replicas (:mod:`dtprofile.fsdp`).

Every hook body runs under a guard: an internal error warns once, disables that part
of the profiler, and never reaches the training loop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import sys
import weakref
from collections import deque
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from . import console
from .background import BackgroundSink
from .comm import TimedHook, find_timed_hook, timed_buffer_sync
from .gather import RankGather
from .options import Options
from .scaler import watch_scalers
from .recorder import FIELDS, REPLICA_ALL_REDUCE, SHARDED_KINDS, CommInterval, PendingStep, Window
from . import __version__
from .report import SCHEMA, Report, build_summary, rank_row
from .timing import Clock, LazyScalar, make_clock

__all__ = ["Engine", "Part"]

log = logging.getLogger(__name__)

# The final summary averages the last RUN_WINDOW steps (bounded memory).
RUN_WINDOW = 2048
PROBE_WINDOW = 64
# Steps whose device timestamps are still unknown; beyond this the oldest are dropped
# (it only happens if the device never catches up, e.g. a hung kernel).
MAX_PENDING = 256
# Gradient-noise samples: every Nth synchronising step (a norm of each bucket).
GNS_EVERY = 10
# A sharded model's samples kept for the gathers: two, so that a rank whose device lags
# a step behind at one gather still matches the others at the next.
SHARD_SAMPLE_SLOTS = 2
_MAX_OUTPUT_TENSORS = 32
# Inferred skipped updates, each followed by a real step, this many times in a row: the
# loop's own structure (backward, zero_grad, backward, step), not a loss scaler.
SKIP_ALTERNATION_LIMIT = 3
# How long stop() waits for the background sink to write the intervals still pending.
SINK_STOP_TIMEOUT_S = 30.0


class Part:
    """A piece of the profiler that an internal error can switch off on its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.enabled = True
        self.error: str | None = None

    def fail(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            self.error = f"{type(exc).__name__}: {exc}"
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            if missing:
                why = f": it needs {missing!r}, which is not installed: pip install {missing.split('.')[0]}"
            elif isinstance(exc, OSError) and exc.errno is not None:  # a full disk, a deleted logdir
                why = f": {self.error}"
            else:
                why = f" after an internal error ({self.error})"
            console.warn(f"dtprofile: {self.name} disabled{why}; training continues", stacklevel=2)
            log.debug("dtprofile %s failure", self.name, exc_info=exc)


#: Passes (forward, backward) and collectives one step records at most: a loop that
#: never steps the optimizer (inference with gradients on) would otherwise grow the open
#: step without bound. Accumulation over 1024 micro-batches stays inside it.
MAX_PASSES_PER_STEP = 1024
MAX_COLLECTIVES_PER_STEP = 16 * MAX_PASSES_PER_STEP
#: Consecutive optimizer steps with no forward of the profiled model before a warning
#: (one such step is a profile started between forward and step).
FORWARDLESS_STEPS_TO_WARN = 3

#: Seconds the final gather of a run that ended by an exception waits for the other ranks.
FAILED_RUN_GATHER_TIMEOUT_S = 3.0
#: Under DDP's join(), how long a rank's final gather waits for the others (who may need
#: this rank's join to go on) before it reports its own figures.
UNEVEN_GATHER_WAIT_S = 3.0
_JOIN_ENDED = "_dtprofile_join_ended"  # set on a DDP join hook once its join() block has ended

#: Updating steps remembered for the run's typical micro-batches and all-reducing passes.
RECENT_STEP_SHAPES = 64


def _most_common(values: deque[int]) -> int | None:
    """The most frequent value (the larger on a tie); None when there is none.

    >>> _most_common(deque([4, 4, 4, 2]))
    4
    """
    if not values:
        return None
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: (counts[v], v))


def _guard(part_name: str) -> Callable:
    """Run the method only while its part is enabled; turn its errors into ``Part.fail``."""

    def wrap(fn: Callable) -> Callable:
        def guarded(self: "Engine", *args: Any, **kwargs: Any) -> Any:
            part = self.parts[part_name]
            if not part.enabled or not self.active or self._suspended:
                return None
            try:
                return fn(self, *args, **kwargs)
            except Exception as exc:
                part.fail(exc)
                return None

        guarded.__name__ = fn.__name__
        guarded.__doc__ = fn.__doc__
        return guarded

    return wrap


def _iter_tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors in a module's inputs or outputs: in tuples, lists, dicts (Hugging
    Face's ``ModelOutput`` is one) and dataclasses, four levels deep."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter_tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item, depth + 1)
    elif depth < 4 and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _iter_tensors(getattr(obj, f.name, None), depth + 1)


def _watched_outputs(output: Any) -> list[torch.Tensor]:
    """The outputs whose gradients mark backward's start: those that require grad, at most
    :data:`_MAX_OUTPUT_TENSORS`, half from each end (the loss's input is usually first or last)."""
    tensors = [t for t in _iter_tensors(output) if t.requires_grad]
    half = _MAX_OUTPUT_TENSORS // 2
    return tensors if len(tensors) <= _MAX_OUTPUT_TENSORS else tensors[:half] + tensors[-half:]


# Engines measuring now. A new profile of a model or optimizer that one of them still
# watches takes over from it (a notebook cell that started it was interrupted before stop()).
_RUNNING: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def stop_engines_on(objects: Iterable[Any]) -> None:
    """Stop every running engine that watches one of ``objects`` (modules, optimizers):
    its run is reported incomplete, its hooks are removed."""
    ids = {id(o) for o in objects if o is not None}
    for engine in list(_RUNNING):
        watched = [*engine._modules, *engine._optimizers]
        if engine.active and any(id(o) in ids for o in watched):
            console.warn("dtprofile: a profiler started earlier on this model or optimizer is still running "
                         "(its loop was interrupted before stop()?); stopping it, its run reported incomplete, "
                         "and profiling with the new one", stacklevel=3)
            try:
                engine.stop(complete=False, failed=True)
            except Exception as exc:
                log.debug("dtprofile: stopping the earlier profiler failed: %r", exc)
                engine.detach()
                engine.active = False


def _inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a dtprofile hook becomes in a copied or saved module: nothing at all."""
    return None


def _inert() -> Callable[..., None]:
    return _inert_hook


class _ModuleHook:
    """A hook dtprofile puts on the user's module: it runs ``fn``, and in a copy of the
    module (``copy.deepcopy``: an EMA model, a teacher) or a pickled one
    (``torch.save(model)``) it becomes :func:`_inert_hook`, so the copy is not profiled
    and the save does not fail on a local function."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _inert_hook

    def __reduce__(self) -> tuple:
        return (_inert, ())


_EagerModuleHook: type | None = None


def _module_hook(fn: Callable) -> _ModuleHook:
    """:class:`_ModuleHook` of ``fn``, its call kept out of compiled graphs as :func:`_eager` does."""
    global _EagerModuleHook
    if "torch._dynamo" not in sys.modules:
        return _ModuleHook(fn)
    if _EagerModuleHook is None:
        _EagerModuleHook = type("_EagerModuleHook", (_ModuleHook,),
                                {"__slots__": (), "__call__": torch.compiler.disable(_ModuleHook.__call__)})
    return _EagerModuleHook(fn)


def _eager(hook: Callable) -> Callable:
    """``hook``, kept out of ``torch.compile``'d graphs.

    A module compiled in place (``model.compile()``), or a compiled wrapper around the
    profiled module, runs its hooks inside the traced frame: TorchDynamo would trace
    into them and break the graph on the clock call, with a warning. A disabled
    function is run eagerly instead (~0.4 us a call). At the edges of the compiled
    frame that splits nothing; a profiled module called in the middle of a compiled
    function or parent module splits that graph at its hooks (docs/custom-loops.md
    says to profile the compiled parent instead). Without ``torch._dynamo`` loaded nothing is
    compiled, and importing it would cost a second.
    """
    if "torch._dynamo" not in sys.modules:
        return hook
    return torch.compiler.disable(hook)


def _compiled_module(module: Any) -> bool:
    """Whether ``module`` is compiled (``torch.compile(m)``'s wrapper, or ``m.compile()``)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


_OPTIMIZER_FILE = os.path.join("torch", "optim", "optimizer.py")


def _micro_batches(step: PendingStep) -> int:
    """The step's micro-batches: the batches fetched in it through the profiled loader;
    without one, its forward passes, where a closure's evaluations inside
    ``optimizer.step`` (LBFGS: several of one batch) count as one. (A batch may take
    several forwards: SAM's two passes, a GAN's discriminator on real and fake, two views.)"""
    if step.fetches:
        return step.fetches
    return len(step.forward) - max(0, step.forwards_in_update - 1)


#: A micro-batch count is one of the run's step sizes when this share of the steps has it.
STEP_SIZE_MIN_SHARE = 0.1


def _sizes_seen(counts: dict[int, int]) -> list[int] | None:
    """The micro-batch counts of the run's steps when there were several (Lightning's
    GradientAccumulationScheduler), each held by at least :data:`STEP_SIZE_MIN_SHARE` of
    the steps (not an epoch's last, partial accumulation); else None."""
    total = sum(counts.values())
    sizes = sorted(c for c, n in counts.items() if n >= 2 and n >= STEP_SIZE_MIN_SHARE * total)
    return sizes if len(sizes) > 1 else None


def _optimizer_steps_running() -> int | None:
    """How many ``Optimizer.step`` calls this thread is inside (None: cannot tell).

    Counts torch's step wrapper (the one that runs the step hooks) on the stack; only
    asked when the hooks say a step is already running, to tell nesting from a step that
    raised.
    """
    frame, count = sys._getframe(1), 0
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename.endswith(_OPTIMIZER_FILE):
            count += 1
        frame = frame.f_back
    return count or None


def _in_backward() -> bool:
    """True on a thread that is running an autograd backward pass."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _queue_autograd_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class Engine:
    """Per-rank measurement state for one profiled run.

    ``clock`` defaults to CUDA events for a CUDA model and ``perf_counter`` otherwise;
    tests pass a :class:`dtprofile.timing.FakeEventClock`.
    """

    def __init__(
        self,
        options: Options,
        *,
        device: torch.device | None = None,
        clock: Clock | None = None,
        writer: Any = None,
    ) -> None:
        self.options = options
        self.device = device or torch.device("cpu")
        self.clock = clock or make_clock(self.device)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.backend = str(dist.get_backend()) if self.distributed else None
        self.parts = {name: Part(name) for name in ("timing", "comm", "data", "gather", "sink", "summary")}
        self.active = False
        self.data_wait_source = "gap"
        self._writer = writer
        self.sink: Any = None
        self._sink_thread: BackgroundSink | None = None
        self.gather: RankGather | None = None

        # An interval longer than the run window keeps its last RUN_WINDOW steps (bounded).
        self.interval = Window(min(options.every_n_steps, RUN_WINDOW))
        self.run = Window(RUN_WINDOW)
        self.probes = Window(PROBE_WINDOW)
        self._pending: deque[PendingStep] = deque()
        self._current: PendingStep | None = None
        self.steps_seen = 0
        self.steps_finalized = 0
        self.steps_dropped = 0
        self.steps_skipped_update = 0  # after warm-up; see end_step_without_update
        # Skips inferred from zeroed gradients (plain loops). Armed by the first real update
        # (a loop whose optimizer never fires its step hooks is not skipping); switched off
        # when they alternate with real steps, which is a loop that zeroes the gradients
        # between two backward passes of one step, not a loss scaler.
        self._infer_skips = True
        self._updates_seen = 0
        # For each step in a row that had inferred skips: was each of them counted.
        self._inferred_run: list[list[bool]] = []
        self._inferred_since_update: list[bool] = []
        self._halves_pending = 0  # pending steps found to be halves of one step: not recorded
        # A step per batch in which any optimizer stepped (set by integrations whose loop
        # steps several optimizers per batch), instead of one per primary-optimizer step.
        self.steps_end_at_batch = False
        self._updated_in_batch = False
        self.framework = "torch"  # whose knobs the advice names: "torch" or "lightning"
        self.latest_summary_step: int | None = None  # the log step of latest_summary()'s interval
        self._last_logged_step = -1
        # The framework's step counter, for the x-axis of what is logged (Lightning's global_step).
        self.global_step: Callable[[], int] | None = None
        self.probing = False
        self._forward_open = False  # between a training forward's pre and post hooks
        self._dropped_pass = False  # the open forward was not recorded (MAX_PASSES_PER_STEP)
        self._full_warned = False
        self._excluding = 0  # depth of exclude_start() calls not yet ended
        self._suspended = False  # between suspend() and resume(): every hook does nothing
        self._ddp: Any = None  # the DDP model whose communication is timed
        self._unwatch_joins: Callable[[], Any] | None = None
        self._undo: list[Callable[[], Any]] = []  # what detach() puts back
        self._backward_unseen_warned = False
        self._steps_without_forward = 0  # consecutive; -1 once warned
        self._step_wrappers_counted: bool | None = None
        self._excluded_at = -1  # training passes of the step when the last excluded span ended

        self._handles: list[Any] = []
        self._modules: list[torch.nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._primary_optimizer: torch.optim.Optimizer | None = None
        self._updates_by_optimizer: dict[int, int] = {}  # id(optimizer) -> completed step() calls
        self._opt_start: Any = None
        self._opt_depth = 0
        self._timed_hook: TimedHook | None = None
        self._fsdp: Any = None  # dtprofile.fsdp.FSDPInstrumentation while attached
        self.fsdp_config: dict | None = None  # collectives per step of a sharded model
        self.comm_source: str | None = None
        self._untimed_hook = False  # DDP with a hook of the user's that dtprofile cannot time
        self._hook_taken = False  # DDP's timed hook already serves another running profiler
        self._fsdp_unsupported: str | None = None  # why a sharded model's collectives cannot be timed
        self._model_kind: str | None = None  # the profiled module's class (for messages)
        self._comm_warned = False
        # How the integration's users time communication outside DDP (plain loops only).
        self.manual_comm_hint: str | None = None
        self.ddp_config: dict | None = None  # how the DDP model was built (advice reads it)
        self.batch_size: int | None = None
        self.num_workers: int | None = None
        self._micro_batches_last = 0
        # The run's micro-batches and all-reducing passes per step: the most common over the
        # recent updating steps (the last one may be an epoch's partial accumulation).
        self._micro_batches_recent: deque[int] = deque(maxlen=RECENT_STEP_SHAPES)
        self._micro_batches_seen: dict[int, int] = {}  # count -> steady steps with it (a few counts)
        self._sync_passes_recent: deque[int] = deque(maxlen=RECENT_STEP_SHAPES)
        self.steps_without_backward = 0  # after warm-up; see end_step_without_update
        self.steps_with_eval_forwards = 0  # after warm-up: steps whose model ran in eval mode (left out)
        # An optimizer step after forwards without backward is a skipped batch (set by
        # integrations whose loops step anyway: Lightning's automatic optimization).
        self.steps_need_backward = False
        self.gns = None
        self._shard_samples: deque[tuple[float, float, float]] = deque(maxlen=SHARD_SAMPLE_SLOTS)
        self._shard_samples_used = -1.0  # the last sampled step already in the noise scale
        self._shard_copies = 1  # ranks holding each gradient shard (HSDP: the replicas)
        # The last sampled reduce-scatter: (output's data_ptr, scale or None, interval), for
        # the HSDP all-reduce of that output across replicas.
        self._scattered: tuple[int, float | None, CommInterval] | None = None
        self.report: Report | None = None
        self._last_summary: dict | None = None
        self._summary_reserve: str | None = None  # disk space held for the final summary (rank 0)
        self._telemetry: Any = None  # dtprofile.nvml.TelemetrySampler while running
        self._telemetry_reason = "not started"
        self._hardware: dict | None = None
        # Build the interval summary on every rank, not only where a sink writes it
        # (integrations that publish the figures on each rank, e.g. Lightning's metrics).
        self.summarize_every_rank = False
        # Called with (summary, step) for each interval summarised, stop()'s last ones too
        # (Lightning hands them to its other loggers). Must not raise into training.
        self.on_interval: Callable[[dict, int], None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin measuring: the side group for the gather, the sink, the first step."""
        if self.active:
            raise RuntimeError("this dtprofile profiler is already running; call stop() first")
        from .model import GradientNoiseScale

        self.gns = GradientNoiseScale()
        self.gather = RankGather(self.options.gather_timeout_s)
        self.parts["gather"].enabled = self.gather.enabled or self.world_size == 1
        if self.rank == 0 and (self._writer is not None or self.options.logdir is not None):
            try:
                from .tensorboard import TensorBoardSink

                # Images (matplotlib, ~0.2 s each) are drawn once, at the end of the run.
                self.sink = TensorBoardSink(writer=self._writer, logdir=self.options.logdir, image_every=None)
                self.sink.prepare()
                self._sink_thread = BackgroundSink(self.sink, on_error=self.parts["sink"].fail)
            except Exception as exc:
                self.parts["sink"].fail(exc)
        if self.rank == 0 and self.options.logdir is not None:
            from .report import reserve_summary_space

            self._summary_reserve = reserve_summary_space(self.options.logdir)
        self._start_telemetry()
        self._check_optimizer_params()
        self._undo.append(watch_scalers(self))
        self.active = True
        _RUNNING.add(self)
        try:
            first = self.clock.mark()
        except Exception as exc:
            self.parts["timing"].fail(exc)
            first = None
        self._open_step(first)

    def _check_optimizer_params(self) -> None:
        """Warn once when the step-bounding optimizer holds none of the model's parameters
        (made before ``fully_shard`` replaced them, or for another copy): its steps then
        update nothing this model uses."""
        opt = self._primary_optimizer
        if opt is None or not self._modules:
            return
        held = {id(p) for group in opt.param_groups for p in group["params"]}
        model = {id(p) for m in self._modules if m is not None for p in m.parameters()}
        if held and model and not held & model:
            console.warn("dtprofile: the optimizer holds none of the profiled model's parameters (was it made "
                         "before fully_shard or DDP replaced or copied them?): its steps update nothing this "
                         "model uses", stacklevel=4)

    def _start_telemetry(self) -> None:
        """Peak-memory reset, hardware discovery and the NVML sampler (never raises)."""
        from .hardware import discover_hardware
        from .nvml import start_sampler

        try:
            if self.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats(self.device)  # host-side counters: no sync
        except Exception:
            pass
        try:
            self._hardware = discover_hardware(self.device)
        except Exception as exc:
            self._hardware = {"error": f"{type(exc).__name__}: {exc}"}
        interval_s = self.options.telemetry_interval_s
        if interval_s == 0:
            self._telemetry, reason = None, "turned off (telemetry_interval_s=0)"
        else:
            self._telemetry, reason = start_sampler(self.device, interval_s=interval_s)
        self._telemetry_reason = reason or "stopped"

    def _steady_state_begins(self) -> None:
        """Telemetry covers the steady state, like the steps. (The peak memory is not reset
        again here: the loop's own ``max_memory_allocated()`` would change under it.)"""
        if self._telemetry is not None:
            self._telemetry.reset()

    def _stop_telemetry(self) -> None:
        if self._telemetry is not None:
            try:
                self._telemetry.stop()
            except Exception:
                pass

    def stop(self, complete: bool = True, failed: bool = False) -> Report:
        """Detach every hook, gather the final figures, write the summary (rank 0).

        ``failed``: the loop raised; the final gather waits only
        :data:`FAILED_RUN_GATHER_TIMEOUT_S` for the other ranks, which are likely stuck in
        the collective this rank left.
        """
        if not self.active:
            if self.report is None:
                self.report = Report(self._summary(final=True, complete=complete, failed=failed))
            return self.report
        _RUNNING.discard(self)
        self.detach()
        self._stop_telemetry()  # before the final drain synchronises: the GPU still busy
        try:
            self._drain(force_wait=True)
        except Exception as exc:  # the steps still pending are lost, not the run's report
            self.parts["timing"].fail(exc)
        self._warn_comm_unmeasured()
        summary = self._summary(final=True, complete=complete, failed=failed)
        self.active = False
        self.report = Report(summary)
        if self.rank == 0:
            self._write_outputs(summary)
        return self.report

    def detach(self) -> None:
        """Remove module/optimizer hooks; the comm hook falls back to pass-through."""
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
        if self._unwatch_joins is not None:
            self._unwatch_joins()
            self._unwatch_joins = None
        while self._undo:
            self._undo.pop()()
        if self._timed_hook is not None:
            self._timed_hook.engine = None
            self._timed_hook._held.clear()
        if self._fsdp is not None:
            try:
                self._fsdp.remove()
            except Exception as exc:
                log.debug("dtprofile: FSDP instrumentation not removed: %r", exc)

    # ------------------------------------------------------------------ attach
    def attach_module(self, module: torch.nn.Module) -> None:
        """Time forward passes of ``module`` (and through them, backward)."""
        self._modules.append(module)
        if self._model_kind is None:
            self._model_kind = type(module).__name__
        from .fsdp import is_fsdp

        # FSDP's root hooks gather parameters before forward and queue its final
        # backward callback: ours go first, so forward and backward include that work
        # and backward's compute ends before FSDP waits for the last reduce-scatters.
        sharded = is_fsdp(module)
        self._handles.append(module.register_forward_pre_hook(
            _module_hook(self._forward_pre_hook), with_kwargs=True, prepend=sharded))
        self._handles.append(module.register_forward_hook(_module_hook(self._forward_post_hook),
                                                          prepend=sharded))
        # torch.compile(ddp_model) hands back a wrapper around the DDP model.
        wrapped = getattr(module, "_orig_mod", module)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            self.attach_ddp(wrapped)
            self._modules.append(wrapped.module)
        elif sharded:
            self.attach_fsdp(wrapped)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The first optimizer attached marks step boundaries; others add optimizer time."""
        self._optimizers.append(optimizer)
        if self._primary_optimizer is None:
            self._primary_optimizer = optimizer
        self._handles.append(optimizer.register_step_pre_hook(_eager(self._optimizer_pre_hook)))
        self._handles.append(optimizer.register_step_post_hook(_eager(self._optimizer_post_hook)))

    def attach_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Time gradient communication with a :class:`TimedHook` on ``ddp``.

        Re-uses a TimedHook already registered (by the user through ``timed_hook`` or by
        an earlier profiler); registers one when the model has no hook; otherwise warns
        once and leaves communication unmeasured.
        """
        if self._timed_hook is not None:
            return
        self._ddp = ddp
        self._watch_joins(ddp)
        self.ddp_config = {
            "gradient_as_bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False)),
            # DDP keeps int(bucket_cap_mb * 2**20) bytes: 0.01 comes back as 0.0099993.
            "bucket_cap_mb": round(getattr(ddp, "bucket_bytes_cap", 0) / 2**20, 4) or None,
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "static_graph": bool(getattr(ddp, "static_graph", False)),
            "compiled_inside": _compiled_module(getattr(ddp, "module", None)),
        }
        try:
            hook, other = find_timed_hook(ddp)
            if hook is None and other:
                self._untimed_hook = True
                console.warn(
                    "dtprofile: this DDP model already has a communication hook, so gradient communication "
                    "is reported as unmeasured (null). Wrap your hook to time it: "
                    "model.register_comm_hook(state, dtprofile.timed_hook(your_hook))",
                    stacklevel=3,
                )
                return
            if hook is not None and hook.engine is not self and getattr(hook.engine, "active", False):
                self._taken_by_another()  # the hook times for one profiler: the one that has it
                return
            if hook is None:
                hook = TimedHook()
                ddp.register_comm_hook(None, hook)
            hook.engine = self
            self._timed_hook = hook
            self._time_buffer_sync(ddp)
            self.comm_source = "user" if hook.user_supplied else "dtprofile"
            self.ddp_config["comm_hook"] = hook.hook_name
            self.ddp_config["compressed_16bit"] = hook.wire_itemsize == 2
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def _time_buffer_sync(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Time DDP's buffer broadcast before each forward (see :func:`timed_buffer_sync`)."""
        if not callable(getattr(ddp, "_sync_buffers", None)) or "_sync_buffers" in vars(ddp):
            return  # another torch, or another profiler's
        if getattr(ddp, "broadcast_buffers", True) and getattr(ddp, "modules_buffers", None):
            self.ddp_config["buffer_broadcast_bytes"] = sum(b.numel() * b.element_size() for b in ddp.modules_buffers)
        else:
            self.ddp_config["buffer_broadcast_bytes"] = 0
        timed = _eager(timed_buffer_sync(ddp, self))
        ddp._sync_buffers = timed
        self._undo.append(lambda: vars(ddp).get("_sync_buffers") is timed and vars(ddp).pop("_sync_buffers"))

    def _taken_by_another(self) -> None:
        self._hook_taken = True
        console.warn("dtprofile: another profiler is already timing this model's communication; "
                     "this one reports it as unmeasured (null)", stacklevel=4)

    def attach_fsdp(self, module: torch.nn.Module) -> None:
        """Time the all-gathers and reduce-scatters of every ``fully_shard`` unit in ``module``."""
        if self._fsdp is not None or self.world_size < 2:
            return
        from .fsdp import TimedByAnother, instrument

        try:
            self._fsdp = instrument(module, self)
            self._shard_copies = self._fsdp.replicas
            if self._fsdp.units:
                self.comm_source = "fsdp"
        except NotImplementedError as exc:  # an FSDP2 without comm objects: say so, do not fail
            self._fsdp_unsupported = str(exc)
        except TimedByAnother:
            self._taken_by_another()
        except Exception as exc:
            self.parts["comm"].fail(exc)

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

    # ------------------------------------------------------------------ steps
    def _open_step(self, start_mark: Any) -> None:
        self._current = PendingStep(start=start_mark, index=self.steps_seen)
        n = self.options.probe_every
        # Step numbers are the same on every rank, so all ranks probe the same step.
        post_warmup = self.steps_seen - self.options.warmup_steps
        # Only DDP's timed hook can hold the reductions (FSDP's and the loop's cannot).
        self.probing = bool(n and self._timed_hook is not None and post_warmup >= 0 and post_warmup % n == 0)
        self._current.probe = self.probing

    @_guard("data")
    def add_data_wait(self, seconds: float, transfer: bool = False) -> None:
        """Host time blocked waiting for the next batch (counted in the current step).

        ``transfer``: the time went into the batch's transfer to the device (Lightning's
        batch transfer hooks), which the step waits for like a fetch; it is also reported
        on its own (``data_transfer``), since more loader workers do not shorten it.
        A fetch inside the forward (Lightning's ``training_step(self, dataloader_iter)``)
        is data wait, not forward: it is taken out of that forward's time.
        """
        step = self._current
        step.data_wait_s += seconds
        if transfer:
            step.data_transfer_s += seconds
        else:
            step.fetches += 1
        if self._forward_open:
            step.data_wait_in_forward_s += seconds
        elif step.no_grad_start is not None and not step.forward:
            # A no-grad pass, then a fetch: that pass was not this step's start (a metric
            # pass after the last step); the step's compute starts after the fetch.
            self.clock.release(step.no_grad_start)
            step.no_grad_start = None
        self._drop_no_grad_forward(step)  # the forward of a checkpoint comes after its fetch

    @_guard("timing")
    def exclude_start(self) -> None:
        """Work that is not training starts now (an evaluation pass): left out of the step.

        Calls nest; the span ends with the matching :meth:`exclude_end`.
        """
        self._excluding += 1
        if self._excluding > 1:
            return
        step = self._current
        last = step.excluded[-1] if step.excluded else None
        if last is not None and last[1] is not None and self._excluded_at == self._training_passes(step):
            # Evaluation forwards with no training in between are one evaluation pass:
            # the host work between them (its loader, its metrics) is part of it.
            self.clock.release(last[1])
            last[1] = None
        else:
            step.excluded.append([self.clock.mark(), None])

    @_guard("timing")
    def loop_starts(self) -> None:
        """The loop begins a pass over its loader (an epoch, a notebook cell's loop): the
        open step has run no training pass yet, so the time since the last step ended
        was spent outside the loop (an epoch's end, a pause between cells) and is left
        out of the step."""
        step = self._current
        if (step.forward or step.fetches or step.no_grad_start is not None or step.start is None
                or self._excluding):
            return  # (fetched already: a second loader of the same loop, zip(prof.loader(a), prof.loader(b)))
        step.excluded.append([step.start, self.clock.mark()])
        self._excluded_at = -1
        step.data_wait_s = step.data_transfer_s = 0.0

    def suspend(self) -> None:
        """Training that is not this run's runs from now (Lightning's tuner running trial
        steps from a hook): every hook ignores it and its time is left out of the step."""
        if self._suspended or not self.active:
            return
        self.exclude_start()
        self._suspended = True

    @property
    def suspended(self) -> bool:
        """Between :meth:`suspend` and :meth:`resume`: nothing is measured."""
        return self._suspended

    def resume(self) -> None:
        """The run's own training goes on (ends :meth:`suspend`)."""
        if not self._suspended:
            return
        self._suspended = False
        self.exclude_end()

    @_guard("timing")
    def exclude_end(self) -> None:
        """The work started by :meth:`exclude_start` ends now."""
        if not self._excluding:
            return
        self._excluding -= 1
        step = self._current
        if self._excluding == 0 and step.excluded and step.excluded[-1][1] is None:
            step.excluded[-1][1] = self.clock.mark()
            self._excluded_at = self._training_passes(step)

    @staticmethod
    def _training_passes(step: PendingStep) -> int:
        return len(step.forward) + len(step.backward)

    @_guard("timing")
    def _forward_pre_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if _in_backward():
            # Activation checkpointing of the whole model recomputes its forward inside
            # backward: that is backward's time, not another forward.
            if torch.is_grad_enabled():
                self._recompute_in_backward()
            return
        if not torch.is_grad_enabled():
            if not getattr(module, "training", True):
                # Evaluation inside the loop (model.eval(), no grad) is not part of a training
                # step. A no-grad forward in train mode (reentrant checkpointing, a rollout)
                # is, and stays in the step: the wait for data ends where it starts.
                if not self._excluding:  # (inside Lightning's validation loop: evaluation for sure)
                    self._current.eval_forwards += 1
                self.exclude_start()
            else:
                self._no_grad_forward_starts()
            return
        step = self._current
        in_update = self._opt_depth > 0
        if (self._infer_skips and self._updates_seen and step.backward
                and step.backward[-1][2] is not None and self._last_pass_reduced(step)
                and self._grads_cleared()):
            # A backward finished, no optimizer step followed, and the gradients were
            # zeroed: the last iteration updated nothing (GradScaler found inf/NaN) ...
            if in_update:  # (a step that raised may have left its depth behind)
                self._settle_opt_depth()
                in_update = self._opt_depth > 0
            # ... unless this is a closure's forward inside optimizer.step (LBFGS, SAM): it
            # re-evaluates the batch of a step still open, and zeroes the gradients itself.
            if not in_update:
                self._end_skipped_at_sync(step)
        if self.batch_size is None:
            for tensor in _iter_tensors((args, kwargs)):
                if tensor.dim() > 0:
                    self.batch_size = int(tensor.shape[0])
                    break
        if len(self._current.forward) >= MAX_PASSES_PER_STEP:
            self._step_full()
            return
        self._current.forward.append([self.clock.mark(), None])
        self._current.forwards_in_update += in_update
        self._forward_open = True

    @_guard("timing")
    def _forward_post_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if _in_backward():  # a recompute (and under checkpoint's early stop it never ends)
            return
        if not torch.is_grad_enabled():
            if not getattr(module, "training", True):
                self.exclude_end()
            elif self._current.no_grad_forward is not None and self._current.no_grad_forward[1] is None:
                self._current.no_grad_forward[1] = self.clock.mark()
            return
        if not self._current.forward or self._dropped_pass:
            self._dropped_pass = False
            return
        self._forward_open = False
        pair = self._current.forward[-1]
        if pair[1] is None:
            pair[1] = self.clock.mark()
        tensors = _watched_outputs(output)
        if len(tensors) == 1:  # the common case, and the cheaper hook
            tensors[0].register_hook(self._backward_started)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_started, mode="any")

    def _no_grad_forward_starts(self) -> None:
        """A no-grad forward in train mode (reentrant checkpointing's first pass, a
        rollout): compute, so the step's gap ends at the first; kept as a candidate
        forward until its recompute, if any, shows up in backward (marks of its own,
        released when the next one starts, a fetch comes, or the step closes)."""
        step = self._current
        if not step.forward and step.no_grad_start is None:
            step.no_grad_start = self.clock.mark()
        self._drop_no_grad_forward(step)
        step.no_grad_forward = [self.clock.mark(), None]

    def _drop_no_grad_forward(self, step: PendingStep) -> None:
        for mark in step.no_grad_forward or ():
            if mark is not None:
                self.clock.release(mark)
        step.no_grad_forward = None

    def _timed_only(self, spans: list) -> list:
        """``spans`` whose every mark was taken; the others' marks go back to the clock."""
        kept = []
        for span in spans:
            if None in span:
                for mark in span:
                    if mark is not None:
                        self.clock.release(mark)
            else:
                kept.append(span)
        return kept

    def _recompute_in_backward(self) -> None:
        """Reentrant checkpointing of the whole model: its output came from an autograd
        Function, so no hook saw backward start. It has started by now; and the no-grad
        pass before it was this micro-batch's forward."""
        step = self._current
        if step.backward and step.backward[-1][1] is None:
            return  # a backward already open (non-reentrant: the outputs' hook saw it)
        span = step.no_grad_forward
        if span is not None and span[1] is not None and len(step.forward) < MAX_PASSES_PER_STEP:
            step.forward.append(span)
            step.no_grad_forward = None
        self._backward_started(None)

    def _step_full(self) -> None:
        """This step holds :data:`MAX_PASSES_PER_STEP` passes: the next is not recorded."""
        self._dropped_pass = True
        if not self._full_warned:
            self._full_warned = True
            console.warn(f"dtprofile: {MAX_PASSES_PER_STEP} forward passes with gradients and no optimizer step; "
                         "further passes of this step are not timed (inference? run it under torch.no_grad() "
                         "or torch.inference_mode())", stacklevel=4)

    @_guard("timing")
    def _backward_started(self, grad: Any) -> None:
        if len(self._current.backward) >= MAX_PASSES_PER_STEP:
            return
        self._current.backward.append([self.clock.mark(), None, None])
        _queue_autograd_callback(self._backward_finished)

    @_guard("timing")
    def _backward_finished(self) -> None:
        """End of backward compute: autograd's graph is done; DDP has not waited yet.

        Queued at backward start, this runs before DDP's finalisation (queued when the
        last bucket became ready). It queues one more callback, which runs after DDP's:
        that one marks the moment the reductions are waited for and copied back.
        """
        self._current.backward[-1][1] = self.clock.mark()
        _queue_autograd_callback(self._backward_synced)

    @_guard("timing")
    def _backward_synced(self) -> None:
        step = self._current
        step.backward[-1][2] = self.clock.mark()
        step.data_wait_at_sync_s = step.data_wait_s
        step.fetches_at_sync = step.fetches
        step.data_transfer_at_sync_s = step.data_transfer_s

    def _last_pass_reduced(self, step: PendingStep) -> bool:
        """Whether the last backward pass reduced gradients, as an update's pass does.

        Asked of sharded models only: FSDP2 holds the gradients of a pass that did not
        reduce (accumulation under ``set_requires_gradient_sync(False)``) outside the
        sharded ``.grad``, which then looks cleared, as after a skipped update.
        """
        return self._fsdp is None or step.reduced_pass == len(step.backward)

    def _grads_cleared(self) -> bool:
        """True when no parameter of the primary optimizer holds a gradient.

        Only asked after a backward in the same step; between accumulated micro-batches
        the first parameter already has one, so this returns at once.
        """
        optimizer = self._primary_optimizer
        if optimizer is None:
            return False
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    return False
        return True

    def _end_skipped_at_sync(self, step: PendingStep) -> None:
        """Close ``step`` as skipped where its last backward synced; the rest is the next step's."""
        carry_s = step.data_wait_s - step.data_wait_at_sync_s
        carry_transfer_s = step.data_transfer_s - step.data_transfer_at_sync_s
        carry_fetches = step.fetches - step.fetches_at_sync
        step.data_wait_s -= carry_s
        step.data_transfer_s -= carry_transfer_s
        step.fetches -= carry_fetches
        if self._opt_start is not None:
            self.clock.release(self._opt_start)
            self._opt_start = None
        counted_before = self.steps_skipped_update
        self._close_step(step.backward[-1][2], skipped=True, ends_now=False)
        self._current.data_wait_s += carry_s
        self._current.data_transfer_s += carry_transfer_s
        self._current.fetches += carry_fetches
        self._inferred_since_update.append(self.steps_skipped_update > counted_before)

    def _note_update(self) -> None:
        """A real optimizer step closed: arm skip inference; stop it on an alternating pattern."""
        self._updates_seen += 1
        inferred, self._inferred_since_update = self._inferred_since_update, []
        if not inferred:
            self._inferred_run.clear()
            return
        self._inferred_run.append(inferred)
        if len(self._inferred_run) >= SKIP_ALTERNATION_LIMIT:
            # Each of those steps was counted as several (skipped parts and a stepped one):
            # count them once, and keep their parts out of the averages and the warm-up.
            self._infer_skips = False
            splits = sum(len(step) for step in self._inferred_run)
            self.steps_skipped_update -= sum(sum(step) for step in self._inferred_run)
            self.steps_seen -= splits
            self.steps_finalized -= splits
            self._current.index = self.steps_seen
            self._halves_pending = len(self._pending)
            for window in (self.interval, self.run, self.probes):
                window.clear()
            self._micro_batches_recent.clear()  # the halves' shapes
            self._micro_batches_seen.clear()
            self._sync_passes_recent.clear()
            log.info("dtprofile: every step zeroes the gradients between two backward passes; "
                     "not counting those as skipped updates")

    @_guard("timing")
    def end_step_without_update(self) -> None:
        """End the current step now although no optimizer step ran.

        For frameworks that know an update was skipped (Lightning: the optimizer step was
        due but ``torch.amp.GradScaler`` found inf/NaN gradients and did not call
        ``optimizer.step()``). The step counts in ``steps_total`` and
        ``steps_skipped_update`` but not in the averages: it did all the work of a step
        and updated nothing. Plain loops need not call it: a forward that finds the
        gradients zeroed after an un-stepped backward ends the skipped step itself.

        A step with no backward at all is a batch the training code chose to skip
        (Lightning: ``training_step`` returned None): it counts in
        ``steps_without_backward`` instead, and stays out of the averages as well.
        """
        if self._opt_start is not None:
            self.clock.release(self._opt_start)
            self._opt_start = None
        self._opt_depth = 0
        if not self._ran_backward():
            self._close_without_backward(self.clock.mark())
        else:
            self._close_step(self.clock.mark(), skipped=True)

    def optimizer_updates(self, optimizer: Any) -> int | None:
        """Completed ``step()`` calls of ``optimizer`` while profiling; None: not one of
        this profiler's optimizers (or not measuring)."""
        if not self.active or not any(o is optimizer for o in self._optimizers):
            return None
        return self._updates_by_optimizer.get(id(optimizer), 0)

    @_guard("timing")
    def scaler_stepped(self, optimizer: Any, updated: bool) -> None:
        """A loss scaler's ``step(optimizer)`` returned (see :mod:`dtprofile.scaler`).

        From the first one on, the scaler says which updates it skipped, and the
        gradients' state is no longer read for that. ``updated`` False: the scaler found
        inf/NaN gradients and skipped the primary optimizer's update, so the step ends
        here, counted in ``steps_skipped_update``. (With :attr:`steps_end_at_batch`
        the batch's end decides, in :meth:`end_batch`.)
        """
        if optimizer is not self._primary_optimizer:
            return
        self._infer_skips = False
        if updated or self.steps_end_at_batch or self._opt_depth > 0:
            return  # (inside a running step: a scaler stepped from an optimizer's own step)
        self.end_step_without_update()

    @_guard("timing")
    def announce_backward(self) -> None:
        """The framework is about to run a backward in this step (Lightning's
        ``on_before_backward``): the step is not a skipped batch even if no hook on the
        forward's outputs sees that backward (a ``backward()`` override on another loss)."""
        self._current.backward_announced = True

    def _ran_backward(self) -> bool:
        return bool(self._current.backward) or self._current.backward_announced

    def _close_without_backward(self, end_mark: Any) -> None:
        """A batch the training code skipped before backward: out of the averages, counted
        in ``steps_without_backward``."""
        self._close_step(end_mark, skipped=True, counted_as_skip=False)
        if self.steps_seen > self.options.warmup_steps:
            self.steps_without_backward += 1

    @_guard("timing")
    def end_batch(self) -> None:
        """A training batch ended (with :attr:`steps_end_at_batch`): if any optimizer
        stepped in it, the step ends now; a batch that stepped none is a micro-batch of
        the next step, or, when an update was announced and did not run, a skipped update.

        For loops whose step is a batch of several optimizers' steps (Lightning's manual
        optimization: a GAN's generator and discriminator).
        """
        if self._updated_in_batch:
            self._updated_in_batch = False
            if self._opt_start is not None:
                self.clock.release(self._opt_start)
                self._opt_start = None
            self._close_step(self.clock.mark())
        elif self.update_pending:
            self.end_step_without_update()

    def log_step(self) -> int:
        """The x-axis step of what is logged now: the framework's (:attr:`global_step`), else ours."""
        if self.global_step is not None:
            try:
                return int(self.global_step())
            except Exception:
                self.global_step = None
        return self.steps_seen

    @property
    def update_pending(self) -> bool:
        """An optimizer step was announced (:meth:`mark_optimizer_start`) but has not run."""
        return self._opt_start is not None and self._opt_depth == 0

    @_guard("timing")
    def end_forward(self, output: Any) -> None:
        """End the open forward pass now; gradients of ``output`` mark backward's start.

        For loops whose module call also contains backward and the optimizer step
        (Lightning's manual optimization): call it just before backward.
        """
        self._forward_post_hook(None, (), output)

    @_guard("timing")
    def mark_optimizer_start(self) -> None:
        """The optimizer's update begins now, unless ``optimizer.step`` is already running.

        For frameworks that run the closure (forward and backward) before calling
        ``optimizer.step`` (Lightning's mixed precision): call it after the closure. Inside
        a running step the step's own start holds: its passes and the spans marked with
        :meth:`outside_update_start` are taken out of it.
        """
        if self._opt_depth > 0:
            return
        if self._opt_start is not None:
            self.clock.release(self._opt_start)
        self._opt_start = self.clock.mark()

    @_guard("timing")
    def outside_update_start(self) -> list | None:
        """Work that is not the update begins now, between the closure and the update
        (Lightning's ``on_before_optimizer_step`` hooks and gradient clipping): other
        compute, not optimizer. End it with :meth:`outside_update_end`."""
        return self._open_span(self._current.outside_update)

    def outside_update_end(self, span: list) -> None:
        self._close_span(span, "timing")

    def _open_span(self, spans: list) -> list:
        """A ``[start, end]`` span starting now, appended to ``spans``; end it with
        :meth:`_close_span`."""
        span = [self.clock.mark(), None]
        spans.append(span)
        return span

    def _close_span(self, span: list, part_name: str) -> None:
        """End ``span`` now (unguarded: the start was taken, so the end must be, or the
        step would wait for it); an error disables ``part_name``."""
        try:
            span[1] = self.clock.mark()
        except Exception as exc:
            self.parts[part_name].fail(exc)

    def _settle_opt_depth(self, inside: int = 0) -> None:
        """Drop optimizer steps that raised after their pre hook (the loop caught it, e.g.
        an OOM): their post hook never came, so their depth and start mark are stale.
        ``inside``: step wrappers on the stack that are not among them (the caller's own)."""
        if not self._opt_depth:
            return
        running = _optimizer_steps_running()
        if running is None and inside == 0 and self._step_wrappers_counted:
            running = 0
        if running is not None and running - inside < self._opt_depth:
            self._opt_depth = max(0, running - inside)
            if self._opt_depth == 0 and self._opt_start is not None:
                self.clock.release(self._opt_start)
                self._opt_start = None

    @_guard("timing")
    def _optimizer_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # A subclass whose step() calls super().step() runs the hooks twice, nested:
        # only the outermost pair is the optimizer step.
        if self._step_wrappers_counted is None:  # whether this torch's step wrapper can be found
            self._step_wrappers_counted = _optimizer_steps_running() is not None
        self._settle_opt_depth(inside=1)
        self._opt_depth += 1
        # Keep a start already announced by mark_optimizer_start (Lightning's mixed
        # precision unscales and checks the gradients between the two).
        if self._opt_depth == 1 and self._opt_start is None:
            self._opt_start = self.clock.mark()

    @_guard("timing")
    def _optimizer_post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._opt_depth = max(0, self._opt_depth - 1)
        if self._opt_depth:
            return
        key = id(optimizer)
        self._updates_by_optimizer[key] = self._updates_by_optimizer.get(key, 0) + 1
        pair = (self._opt_start, self.clock.mark())
        self._opt_start = None
        if pair[0] is None:
            return
        if self.steps_end_at_batch or optimizer is not self._primary_optimizer:
            self._current.extra_optimizer.append(pair)
            self._updated_in_batch = True
            return
        self._current.optimizer = pair
        self._note_forward_seen(bool(self._current.forward))
        if self._current.forward and not self._ran_backward():
            if self.steps_need_backward:
                # Lightning in full precision still steps the optimizer after
                # training_step returned None: a skipped batch, not a step's work.
                self._close_without_backward(pair[1])
                return
            if len(self._current.forward) < MAX_PASSES_PER_STEP:  # (a full step's later passes go unrecorded)
                self._warn_backward_unseen()
        self._close_step(pair[1])
        self._note_update()

    def _note_forward_seen(self, seen: bool) -> None:
        """Warn once when the profiled model's forward has not run in 3 steps in a row: the
        loop calls another module (a copy, an EMA model, the unwrapped one under DDP), so
        forward and backward read 0 and all compute lands in 'other'."""
        if self._steps_without_forward < 0:
            return
        self._steps_without_forward = 0 if seen else self._steps_without_forward + 1
        if self._steps_without_forward >= FORWARDLESS_STEPS_TO_WARN:
            self._steps_without_forward = -1
            console.warn("dtprofile: the profiled model's forward has not run in the last "
                         f"{FORWARDLESS_STEPS_TO_WARN} optimizer steps, so forward and backward read 0 and "
                         "their time counts as 'other' compute: pass dtprofile.profile() the module your "
                         "loop calls (the DDP/FSDP wrapper or the compiled module, not a copy)", stacklevel=4)

    def _warn_backward_unseen(self) -> None:
        """A step with a forward and an update, but no backward through the forward's
        outputs: the loss came from tensors dtprofile cannot follow."""
        if self._backward_unseen_warned:
            return
        self._backward_unseen_warned = True
        console.warn("dtprofile: the model's forward ran but no backward pass reached its outputs, so backward "
                     "is counted with 'other' compute; dtprofile follows the tensors a forward returns in "
                     "tuples, lists, dicts and dataclasses: return the loss's input in one of them", stacklevel=4)

    def _close_step(self, end_mark: Any, skipped: bool = False, counted_as_skip: bool = True,
                    ends_now: bool = True) -> None:
        """Close the current step at ``end_mark`` and open the next there.

        ``ends_now``: ``end_mark`` was taken just now, so the profiler's own work from it
        on (closing, draining, an interval's gather and summary) is left out of the next
        step; else only an interval's work is. On a GPU that leaves out only what the
        device idled for it.
        """
        step = self._current
        step.end = end_mark
        step.skipped = skipped
        if skipped and counted_as_skip and self.steps_seen >= self.options.warmup_steps:
            self.steps_skipped_update += 1
        # Passes whose end never came (a pass raised) cannot be timed: their marks go back.
        step.backward = self._timed_only(step.backward)
        step.forward = self._timed_only(step.forward)
        step.outside_update = self._timed_only(step.outside_update)
        self._drop_no_grad_forward(step)  # not a reentrant checkpoint's forward after all
        if step.excluded and step.excluded[-1][1] is None:  # an evaluation forward raised
            self.clock.release(step.excluded.pop()[0])
            self._excluding = 0
        self._micro_batches_last = _micro_batches(step)
        if step.eval_forwards and self.steps_seen >= self.options.warmup_steps:
            self.steps_with_eval_forwards += 1
        self._forward_open = self._dropped_pass = False  # a forward that raised never closed
        if not skipped and self.steps_seen >= self.options.warmup_steps:
            self._micro_batches_recent.append(self._micro_batches_last)
            seen = self._micro_batches_seen
            if self._micro_batches_last in seen or len(seen) < 32:
                seen[self._micro_batches_last] = seen.get(self._micro_batches_last, 0) + 1
            if any(c.reduces_gradients for c in step.comm):  # every start of the step has run by now
                self._sync_passes_recent.append(len({c.pass_index for c in step.comm if c.reduces_gradients}))
        if self._fsdp is not None and any(c.sharded for c in step.comm):
            self.fsdp_config = _collectives_per_step(step.comm, self._fsdp.units, self._shard_copies)
            self.fsdp_config["api"] = self._fsdp.api
        self._pending.append(step)
        self.steps_seen += 1
        if self.steps_seen == self.options.warmup_steps:
            self._steady_state_begins()
        self._open_step(end_mark)
        own_work_from = end_mark if ends_now else None
        try:
            self._drain()
            if self.steps_seen % self.options.every_n_steps == 0:
                if own_work_from is None:
                    own_work_from = self.clock.mark()
                self._log_interval()
        finally:
            if own_work_from is not None:
                # Its own span: an evaluation pass right after it is not merged into it.
                self._current.excluded.append([own_work_from, self.clock.mark()])
                self._excluded_at = -1

    def _drain(self, force_wait: bool = False) -> None:
        """Turn every step whose marks are all known into a record, oldest first."""
        if not self.parts["comm"].enabled:
            self._drop_unfinished_comm()
        if force_wait and self.clock.kind == "cuda_event" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)  # end of run only: never inside a step
        while self._pending and self._pending[0].ready(self.clock):
            step = self._pending.popleft()
            record = step.to_record(self.clock, self.data_wait_source)
            try:
                self._sample_gradient_noise(step)
            except Exception as exc:  # an estimate, never worth losing the timings for
                self.gns = None
                log.debug("dtprofile: gradient noise estimate dropped: %r", exc)
            if self.clock.kind != "perf_counter":  # only events go back to a pool
                step.release(self.clock)
            self.steps_finalized += 1
            if self._halves_pending:
                self._halves_pending -= 1
                continue
            if self.steps_finalized <= self.options.warmup_steps:
                continue
            if step.skipped:
                continue  # did a step's work and updated nothing: not a step to model
            if record.probe:
                self.probes.add(record)
            else:
                values = record.values()
                self.interval.add_values(values)
                self.run.add_values(values)
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft().release(self.clock)
            self.steps_dropped += 1

    def _drop_unfinished_comm(self) -> None:
        """After the comm part failed, a reduction's end may never be marked: the steps
        waiting for one lose their communication figures instead of blocking the rest."""
        for step in (*self._pending, self._current):
            if step is not None and (any(c.end is None for c in step.comm)
                                     or any(end is None for _, end in step.comm_waits)):
                step.comm = []
                step.comm_waits = []
                step.comm_measured = False

    # ------------------------------------------------------------------ comm
    @_guard("comm")
    def comm_start(self, bucket: Any, wire_itemsize: int | None = None) -> CommInterval | None:
        """Called by the timed hook when a bucket is handed over (gradients ready).

        ``wire_itemsize``: bytes an element takes on the wire when the hook compresses.
        """
        buffer = bucket.buffer()
        itemsize = min(wire_itemsize or buffer.element_size(), buffer.element_size())
        step = self._current
        if len(step.comm) >= MAX_COLLECTIVES_PER_STEP:
            return None
        interval = CommInterval(start=self.clock.mark(), nbytes=buffer.numel() * itemsize,
                                pass_index=len(step.backward))
        step.comm_measured = True
        step.comm.append(interval)
        if self._sampling_noise():
            interval.local_sq = LazyScalar(torch.linalg.vector_norm(buffer.detach(), dtype=torch.float32) ** 2)
        return interval

    @_guard("comm")
    def collective_start(self, kind: str, nbytes: int, reduce: tuple | None = None) -> CommInterval | None:
        """A sharded model's collective (``kind``: one of ``SHARDED_KINDS``) starts now.

        Collectives outside a training step's forward or backward (evaluation under
        ``no_grad``) are not the step's communication and are not recorded.
        ``reduce``: a gradient reduction's ``(input, output, op, group)``, for the
        gradient noise sample on sampled steps.
        """
        if not self._in_training_pass() or len(self._current.comm) >= MAX_COLLECTIVES_PER_STEP:
            return None
        step = self._current
        interval = CommInterval(start=self.clock.mark(), nbytes=nbytes, bucket=False, kind=kind,
                                pass_index=len(step.backward))
        step.comm_measured = True
        step.comm.append(interval)
        if interval.reduces_gradients:
            step.reduced_pass = interval.pass_index
        if reduce is not None and self._sampling_sharded_noise():
            self._sample_shard_input(interval, *reduce)
        return interval

    def _sample_shard_input(self, interval: CommInterval, inp: torch.Tensor, out: torch.Tensor, op: Any,
                            group: Any) -> None:
        """|g|^2 of this rank's full gradient now; its reduced shard's when the call returns.

        FSDP reduces with AVG (the shard is the mean gradient's) or with SUM after
        dividing the input by a factor (the shard over the group size is the mean's, on
        the same scale as the input: the factor cancels in the noise scale). Other
        reductions (a custom divide factor) are not sampled.

        HSDP all-reduces each reduce-scatter's output across replicas: the sample then
        pairs the reduce-scatter's input with the all-reduce's output (its scale is both
        reductions'). Without sharding the all-reduce's input is the full gradient.
        """
        scale = _mean_scale(op, group)
        if interval.kind == REPLICA_ALL_REDUCE:
            scattered, self._scattered = self._scattered, None
            if scattered is not None and scattered[0] == inp.data_ptr():
                rs_scale, rs = scattered[1], scattered[2]
                local_sq, rs.local_sq, rs.global_sq = rs.local_sq, None, None  # not the mean's shard yet
                if scale is not None and rs_scale is not None and local_sq is not None:
                    interval.local_sq = local_sq
                    interval.reduced = (out, scale * rs_scale)
                return
        elif interval.kind == "reduce_scatter":
            self._scattered = (out.data_ptr(), scale, interval)
        if scale is None:
            return
        interval.local_sq = LazyScalar(torch.linalg.vector_norm(inp.detach(), dtype=torch.float32) ** 2)
        interval.reduced = (out, scale)

    def _in_training_pass(self) -> bool:
        """Inside a profiled forward that records gradients, or inside backward.

        FSDP gathers under ``no_grad`` even in a training forward, so grad mode alone
        cannot tell a training step from evaluation.
        """
        return self._forward_open or _in_backward()

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
                if interval.reduced is not None:
                    out, scale = interval.reduced
                    interval.reduced = None
                    interval.global_sq = LazyScalar(
                        (torch.linalg.vector_norm(out.detach(), dtype=torch.float32) * scale) ** 2)
                return
            interval.reduced = None  # an asynchronous reduce-scatter is not sampled
            future = work.get_future()
        except Exception as exc:
            self.parts["comm"].fail(exc)
            return

        def done(fut: torch.futures.Future) -> None:
            try:
                interval.end = self.clock.mark()
            except Exception as exc:
                self.parts["comm"].fail(exc)

        future.then(done)

    @_guard("comm")
    def wait_start(self) -> list | None:
        """The compute timeline starts waiting for communication (FSDP's all-gather)."""
        if not self._in_training_pass():
            return None
        return self._open_span(self._current.comm_waits)

    def wait_end(self, span: list) -> None:
        self._close_span(span, "comm")

    @_guard("comm")
    def blocking_comm_start(self, kind: str, nbytes: int) -> CommInterval | None:
        """A collective that holds the compute timeline throughout starts now (DDP's
        buffer broadcast in a training forward); exposed in full, not a gradient's."""
        step = self._current
        if not self._in_training_pass() or len(step.comm) >= MAX_COLLECTIVES_PER_STEP:
            return None
        interval = CommInterval(start=self.clock.mark(), nbytes=nbytes, bucket=False, kind=kind,
                                blocking=True, pass_index=len(step.backward))
        step.comm_measured = True
        step.comm.append(interval)
        return interval

    def blocking_comm_end(self, interval: CommInterval) -> None:
        try:
            interval.end = self.clock.mark()
        except Exception as exc:
            self.parts["comm"].fail(exc)

    @_guard("comm")
    def manual_comm_start(self, nbytes: int | None) -> CommInterval | None:
        """Communication the loop does itself starts now (``Profile.communication``)."""
        if len(self._current.comm) >= MAX_COLLECTIVES_PER_STEP:
            return None
        interval = CommInterval(start=self.clock.mark(), nbytes=nbytes, bucket=False)
        step = self._current
        step.comm_measured = True
        step.comm.append(interval)
        if self.comm_source is None:
            self.comm_source = "manual"
        return interval

    def manual_comm_end(self, interval: CommInterval) -> None:
        try:
            interval.end = self.clock.mark()
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def comm_restart(self, interval: CommInterval) -> None:
        """A held bucket's reduction starts now (probe steps)."""
        try:
            interval.start = self.clock.mark()
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def comm_end(self, interval: CommInterval, future: torch.futures.Future) -> None:
        """Runs in the reduction's ``then`` callback (gloo: its worker thread)."""
        try:
            interval.end = self.clock.mark()
            if interval.local_sq is None:
                return
            try:
                reduced = future.value()
            except Exception:
                # The reduction itself failed (a peer's process died): the training's error,
                # which DDP raises in the loop; not this profiler's, and no sample.
                interval.local_sq = None
                return
            if isinstance(reduced, (list, tuple)):
                reduced = reduced[0]
            interval.global_sq = LazyScalar(torch.linalg.vector_norm(reduced.detach(), dtype=torch.float32) ** 2)
        except Exception as exc:
            self.parts["comm"].fail(exc)

    def _sampling_noise(self) -> bool:
        return (
            self.world_size > 1
            and self.batch_size is not None
            and len(self._current.forward) == 1  # accumulated buckets are not one batch's gradient
            and self.steps_seen % GNS_EVERY == 0
        )

    def _sampling_sharded_noise(self) -> bool:
        """FSDP: one sampled step per log interval (the combine rides on its gather)."""
        return (self.batch_size is not None
                and len(self._current.forward) == 1
                and self.steps_seen % self.options.every_n_steps == 0)

    def _sample_gradient_noise(self, step: PendingStep) -> None:
        if not step.comm or self.gns is None or step.skipped or len(step.backward) != 1:
            return
        if any(c.sharded for c in step.comm):
            self._keep_shard_sample(step)
            return
        buckets = [c for c in step.comm if c.bucket]  # (not DDP's buffer broadcast)
        local = [c.local_sq for c in buckets]
        reduced = [c.global_sq for c in buckets]
        if not buckets or any(x is None for x in local + reduced):
            return
        local_values = [x.value() for x in local]
        reduced_values = [x.value() for x in reduced]
        if any(v is None for v in local_values + reduced_values):
            return
        # The default hook averages, so the reduced buffer is the mean gradient over
        # world_size * batch_size samples; the local buffer is this rank's mean.
        self.gns.update(sum(local_values), sum(reduced_values), self.batch_size, self.batch_size * self.world_size)

    def _keep_shard_sample(self, step: PendingStep) -> None:
        """A sharded step's noise sample, kept until every rank's shard is gathered.

        This rank knows its full gradient's |g|^2 but only its shard of the mean
        gradient; the shards' squares add up to the mean's only across ranks, so the
        sample rides in the next gathers (:meth:`_combine_shard_samples`).
        """
        sampled = [c for c in step.comm if c.local_sq is not None]
        if not sampled or any(c.global_sq is None for c in sampled):
            return
        local = [c.local_sq.value() for c in sampled]
        shard = [c.global_sq.value() for c in sampled]
        if any(v is None for v in local + shard):
            return
        self._shard_samples.append((float(step.index), sum(local), sum(shard)))

    def _shard_sample_vector(self) -> list[float]:
        nan = float("nan")
        slots = list(self._shard_samples) + [(nan, nan, nan)] * (SHARD_SAMPLE_SLOTS - len(self._shard_samples))
        return [v for slot in slots for v in slot]

    def _combine_shard_samples(self, vectors: list[list[float]] | None) -> None:
        """Update the noise scale with every sampled step that all ranks' vectors carry."""
        if not vectors or len(vectors) != self.world_size or self.gns is None or self.batch_size is None:
            return
        offset = len(_VECTOR_KEYS) - 3 * SHARD_SAMPLE_SLOTS
        per_rank = []
        for vec in vectors:
            slots = vec[offset:]
            per_rank.append({slots[i]: (slots[i + 1], slots[i + 2]) for i in range(0, len(slots), 3)
                             if not math.isnan(slots[i])})
        common = sorted(set.intersection(*(set(r) for r in per_rank)))
        for index in common:
            if index <= self._shard_samples_used:
                continue
            local = [r[index][0] for r in per_rank]
            shard = [r[index][1] for r in per_rank]
            if any(math.isnan(v) for v in local + shard):
                continue
            # The mean gradient's |G|^2 is the sum of its shards' (each held by every
            # replica: HSDP counts it once per replica); each rank's local gradient is
            # one batch's: their mean is the small-batch estimate.
            self.gns.update(sum(local) / len(local), sum(shard) / self._shard_copies, self.batch_size,
                            self.batch_size * self.world_size)
            self._shard_samples_used = index

    # ------------------------------------------------------------------ summaries
    def _local_vector(self, window: Window) -> list[float]:
        row = rank_row(self.rank, len(window), window.averages(), len(self.probes), self.probes.averages())
        return ([float("nan") if row[k] is None else float(row[k]) for k in _STEP_KEYS] + self._telemetry_vector()
                + self._shard_sample_vector())

    def _telemetry_vector(self) -> list[float]:
        from .nvml import RANK_KEYS, rank_vector

        try:
            return rank_vector(self._telemetry.summary() if self._telemetry is not None else None)
        except Exception:
            return [float("nan")] * len(RANK_KEYS)

    def _rows(self, vectors: list[list[float]] | None, window: Window) -> list[dict]:
        if not vectors:
            return [rank_row(self.rank, len(window), window.averages(), len(self.probes), self.probes.averages())]
        rows = []
        for vec in vectors:
            row = {k: (None if math.isnan(v) else v) for k, v in zip(_VECTOR_KEYS, vec)}
            row["rank"] = int(row["rank"])
            row["steps"] = int(row["steps"] or 0)
            rows.append(row)
        return rows

    @_guard("gather")
    def _gather_launch(self, vector: list[float], step: int) -> bool:
        return self.gather.launch(vector, tag=step)

    @_guard("gather")
    def _gather_finish(self, vector: list[float], failed: bool = False) -> list[list[float]] | None:
        if failed:
            # Its peers are likely stuck in the collective this rank left: the exception
            # should not wait out gather_timeout_s, nor the gather hold the process's exit.
            return self.gather.finish(vector, FAILED_RUN_GATHER_TIMEOUT_S)
        if self._uneven_inputs():
            # Stopped inside DDP's join(), the others go on only once this rank's join
            # shadows their all-reduces: do not keep them waiting; one of their interval
            # gathers takes this rank's final figures.
            return self.gather.finish(vector, UNEVEN_GATHER_WAIT_S, linger=True)
        return self.gather.finish(vector)

    def _uneven_inputs(self) -> bool:
        """This rank stops inside a ``join()`` of the DDP model: its ``Join`` is alive.

        The join config stays enabled after the ``with`` block ends, so it does not tell;
        the ``Join`` object, whose hook holds the model, lives only as long as the block
        (looked up once per run, and only when the config says a join was made).
        """
        config = getattr(self._ddp, "_join_config", None) if self._ddp is not None else None
        if not getattr(config, "enable", False):
            return False
        import gc

        # A Join made while profiling says when its block ended (_watch_joins); one made
        # before (the profile inside it) is taken as still open.
        return any(type(o).__name__ == "_DDPJoinHook" and not getattr(o, _JOIN_ENDED, False)
                   for o in gc.get_referrers(self._ddp))

    def _watch_joins(self, ddp: Any) -> None:
        """Mark the join hooks of every ``ddp.join()`` made from now on once the block ends
        (their post-hook runs when every rank has joined)."""
        make_hook = getattr(ddp, "join_hook", None)
        if make_hook is None:
            return

        def join_hook(**kwargs: Any) -> Any:
            hook = make_hook(**kwargs)
            post_hook = hook.post_hook

            def marked_post_hook(is_last_joiner: bool) -> None:
                setattr(hook, _JOIN_ENDED, True)
                return post_hook(is_last_joiner)

            hook.post_hook = marked_post_hook
            return hook

        ddp.join_hook = join_hook
        self._unwatch_joins = lambda: ddp.__dict__.pop("join_hook", None)

    def _log_interval(self) -> None:
        """Log this interval: at once with one rank; with several, once its gather completes
        (at a later interval or at the end), under this interval's step."""
        self._warn_comm_unmeasured()
        step = self.log_step()
        vector = self._local_vector(self.interval) if self.world_size > 1 else None
        launched = vector is not None and self._gather_launch(vector, step)
        self._log_gathered()
        if not launched:  # one rank, or no more gathers: what stands now
            vectors = self.gather.current(vector) if vector is not None and self.gather is not None else None
            self._log_rows(self._rows(vectors, self.interval), step)
        self.interval.clear()

    def _log_gathered(self) -> None:
        """Log every interval whose cross-rank gather has completed, under its own step."""
        if self.gather is None:
            return
        for step, vectors in self.gather.take_completed():
            self._combine_shard_samples(vectors)
            self._log_rows(self._rows(vectors, self.interval), step)

    def _log_rows(self, rows: list[dict], step: int) -> None:
        has_sink = self.rank == 0 and self.sink is not None and self.parts["sink"].enabled
        if has_sink or self.summarize_every_rank:
            summary = self._build(rows, complete=True)
            if summary is not None:
                self._last_summary, self.latest_summary_step = summary, step
                if self.on_interval is not None:
                    try:
                        self.on_interval(summary, step)
                    except Exception as exc:
                        log.debug("dtprofile: on_interval failed: %s", exc)
                if has_sink and self._sink_thread is not None and step > self._last_logged_step:
                    # Steps only grow (a take-back of split steps lowers steps_seen).
                    self._last_logged_step = step
                    self._sink_thread.submit(summary, step)

    def latest_summary(self) -> dict | None:
        """The last summary built: the latest log interval's (with several ranks, the latest
        whose gather completed: its step is :attr:`latest_summary_step`), or the final one
        after stop()."""
        return self._last_summary

    def _summary(self, final: bool, complete: bool, failed: bool = False) -> dict:
        try:
            vectors = None
            if self.world_size > 1 and final and self.gather is not None:
                vectors = self._gather_finish(self._local_vector(self.run), failed)
                self._log_gathered()  # intervals whose gathers completed on the way
                if vectors and len(vectors) != self.world_size:
                    vectors = None
                self._combine_shard_samples(vectors)
            rows = self._rows(vectors, self.run)
        except Exception as exc:  # never into the training loop, which may be unwinding already
            self.parts["summary"].fail(exc)
            summary = self._error_summary(exc, complete)
        else:
            summary = self._build(rows, complete=complete)
            if summary is None:  # analysis failed: the bare measurement still stands
                try:
                    summary = build_summary(rows, self._meta(rows), self.options, complete=complete, analyze=False)
                except Exception as exc:
                    summary = self._error_summary(exc, complete)
        self._last_summary = summary
        return summary

    def _error_summary(self, exc: BaseException, complete: bool) -> dict:
        """What a summary can say when building it failed: the counts and the error."""
        return {
            "schema": SCHEMA,
            "dtprofile_version": __version__,
            "complete": complete,
            "world_size": self.world_size,
            "steps_total": self.steps_seen,
            "error": f"summary unavailable after an internal error: {type(exc).__name__}: {exc}",
        }

    def _build(self, rows: list[dict], complete: bool) -> dict | None:
        part = self.parts["summary"]
        if part.enabled:
            try:
                return build_summary(rows, self._meta(rows), self.options, complete=complete)
            except Exception as exc:
                part.fail(exc)
        return None

    def _sink_call(self, method: str, *args: Any) -> None:
        part = self.parts["sink"]
        if not part.enabled or self.sink is None:
            return
        try:
            getattr(self.sink, method)(*args)
        except Exception as exc:
            part.fail(exc)

    def _write_outputs(self, summary: dict) -> None:
        # The summary file first: it is quick, and the images after it take a while (a
        # Ctrl-C then still leaves the run's figures behind).
        if self.options.logdir is not None:
            try:
                from .report import write_summary_with_reserve

                reserve, self._summary_reserve = self._summary_reserve, None
                write_summary_with_reserve(summary, os.path.join(self.options.logdir, "dtprofile_summary.json"),
                                           reserve)
            except Exception as exc:
                console.warn(f"dtprofile: could not write the summary: {exc}", stacklevel=3)
        if self._sink_thread is not None and not self._sink_thread.stop(SINK_STOP_TIMEOUT_S):
            console.warn("dtprofile: the TensorBoard writer did not finish in time; the last interval may be "
                         "missing", stacklevel=3)
        self._sink_call("close", summary, self.log_step())

    def _meta(self, rows: list[dict] | None = None) -> dict:
        """Everything the summary says about the run besides the step averages."""
        from .hardware import describe_device, memory_info, model_class, model_sizes

        sizes = model_sizes(self._modules, self._optimizers)
        device_name, device_kind = describe_device(self.device)
        return {
            "device": device_kind,
            "device_name": device_name,
            "backend": self.backend,
            "world_size": self.world_size,
            "steps_total": self.steps_seen,
            "steps_skipped_update": self.steps_skipped_update,
            "steps_without_backward": self.steps_without_backward,
            "steps_with_eval_forwards": self.steps_with_eval_forwards,
            "data_wait_source": self.data_wait_source,
            "comm_source": self.comm_source if not self._comm_unmeasured() else None,
            "comm_unmeasured": self.comm_unmeasured_reason(),
            "timing": self.clock.kind,
            "parts_disabled": {n: p.error for n, p in self.parts.items() if p.error},
            "run": {
                "framework": self.framework,
                "model_class": model_class(self._modules[0]) if self._modules else None,
                "optimizer": _optimizer_info(self._primary_optimizer),
                "batch_size": self.batch_size,
                "micro_batches": _most_common(self._micro_batches_recent) or self._micro_batches_last or 1,
                "micro_batches_seen": _sizes_seen(self._micro_batches_seen),
                "sync_passes": _most_common(self._sync_passes_recent),
                "num_workers": self.num_workers,
                "cpus_per_rank": _cpus_per_rank(self.world_size),
                "torch_threads": torch.get_num_threads(),
                **sizes,
                "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if device_kind == "cuda" else None,
                "memory": memory_info(self.device, sizes),
                "gradient_noise": self.gns.to_dict() if self.gns is not None and self.gns.value is not None else None,
                "ddp": self.ddp_config,
                "fsdp": self.fsdp_config,
                "hardware": dict(self._hardware or {}),
                "telemetry": self._telemetry_summary(rows),
            },
        }

    def _telemetry_summary(self, rows: list[dict] | None) -> dict:
        """This rank's NVML medians, plus every rank's key figures when they were gathered."""
        from .nvml import RANK_KEYS, rank_entry, unavailable

        if self._telemetry is None:
            return unavailable(self._telemetry_reason)
        try:
            out = self._telemetry.summary(rank=self.rank)
            entries = []
            for row in rows or []:
                entry = rank_entry(int(row["rank"]), {k: row.get("telemetry_" + k) for k in RANK_KEYS})
                if entry is not None:
                    entries.append(entry)
            out["ranks_source"] = "gather" if entries else "local"
            if not entries:  # not gathered (one rank, or the gather failed): this rank only
                local = [None if math.isnan(v) else v for v in self._telemetry_vector()]
                entries = [e for e in [rank_entry(self.rank, dict(zip(RANK_KEYS, local)))] if e is not None]
            out["ranks"] = entries
            return out
        except Exception as exc:
            return unavailable(f"telemetry summary failed: {type(exc).__name__}: {exc}")

    def _comm_unmeasured(self) -> bool:
        return self.comm_unmeasured_reason() is not None

    def comm_unmeasured_reason(self) -> str | None:
        """Why gradient communication has no figures in this run (None: it has, or one rank)."""
        if self.world_size == 1:
            return None
        if not self.parts["comm"].enabled:
            return f"disabled after an internal error ({self.parts['comm'].error})"
        if self.comm_source == "fsdp" and self.fsdp_config is None and self.steps_seen > 0:
            return (f"{self._fsdp.api if self._fsdp is not None else 'FSDP'} ran steps without a "
                    "collective dtprofile could time (its gradient reduction is a custom all-reduce "
                    "hook, or this torch's FSDP internals are not the ones dtprofile wraps)")
        if self._timed_hook is not None or self.comm_source in ("manual", "fsdp"):
            return None
        if self._fsdp_unsupported is not None:
            return self._fsdp_unsupported
        if self._untimed_hook:
            return ("the DDP model has a communication hook dtprofile cannot time "
                    "(register it wrapped: dtprofile.timed_hook(hook))")
        if self._hook_taken:
            return "another dtprofile profiler was timing this model's communication (one per model)"
        return (f"the profiled model ({self._model_kind or 'unknown'}) is not DistributedDataParallel: "
                "dtprofile times DDP's gradient all-reduce and FSDP's collectives (fully_shard, "
                "FullyShardedDataParallel); DeepSpeed is not measured"
                + (f"; {self.manual_comm_hint}" if self.manual_comm_hint else ""))

    def _warn_comm_unmeasured(self) -> None:
        """Once per run, on rank 0, when there are ranks but no communication figures."""
        if self._comm_warned or self.rank != 0 or self._untimed_hook or self._hook_taken:  # warned at attach
            return
        reason = self.comm_unmeasured_reason()
        if reason is not None and self.parts["comm"].enabled:
            self._comm_warned = True
            console.warn(f"dtprofile: gradient communication is not measured: {reason}. "
                         "R_O counts data wait only and the projection models the all-reduce from the "
                         "parameter sizes.", stacklevel=4)


_STEP_KEYS: tuple[str, ...] = (
    "rank",
    "steps",
    *FIELDS,
    "probe_steps",
    "probe_step",
    "probe_compute",
    "probe_comm",
    "step_all",
)
# Each rank's NVML figures ride along in the same gather (dtprofile.nvml.RANK_KEYS), and
# so do a sharded model's last gradient-noise samples (step, local |g|^2, shard |G|^2).
_VECTOR_KEYS: tuple[str, ...] = _STEP_KEYS + tuple("telemetry_" + k for k in (
    "gpu_util_percent", "sm_clock_mhz", "sm_clock_ratio", "power_w", "temperature_c", "throttle_mask")) + tuple(
    f"shard_sample_{i}_{k}" for i in range(SHARD_SAMPLE_SLOTS) for k in ("step", "local_sq", "shard_sq"))


def _mean_scale(op: Any, group: Any) -> float | None:
    """What scales a reduction's output to the mean's: AVG 1, SUM 1/size, others None."""
    if op == dist.ReduceOp.AVG:
        return 1.0
    if op == dist.ReduceOp.SUM:
        return 1.0 / group.size()
    return None


def _collectives_per_step(comm: list[CommInterval], units: int, replicas: int) -> dict:
    """Counts and bytes of one sharded step's collectives (``run.fsdp`` in the summary)."""
    out: dict[str, Any] = {"units": units, "replicas": replicas}
    for kind in SHARDED_KINDS:
        mine = [c for c in comm if c.kind == kind]
        out[kind + "s"] = len(mine)
        out[kind + "_bytes"] = sum(c.nbytes or 0 for c in mine)
    return out


def _optimizer_info(optimizer: Any) -> dict | None:
    """The step-bounding optimizer's class and whether it takes ``fused=`` / ``foreach=``
    (the advice names the user's own optimizer, not another)."""
    if optimizer is None:
        return None
    import inspect

    inner = getattr(optimizer, "optim", None)
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer" and isinstance(inner, torch.optim.Optimizer):
        # ZeRO steps this rank's shard with a local optimizer: that one is fused or not.
        return {**(_optimizer_info(inner) or {}), "zero": True}
    cls = type(optimizer)
    module = cls.__module__
    # torch.optim.sgd.SGD is spelled torch.optim.SGD by its users.
    name = f"torch.optim.{cls.__qualname__}" if module.startswith("torch.optim.") else f"{module}.{cls.__qualname__}"
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    defaults = getattr(optimizer, "defaults", {}) or {}
    return {"class": name, "fused": "fused" in params, "foreach": "foreach" in params,
            "fused_on": bool(defaults.get("fused")), "foreach_on": bool(defaults.get("foreach"))}


def _cpus_per_rank(world_size: int) -> float:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size if world_size > 0 else 1))
    return cpus / max(1, local)
