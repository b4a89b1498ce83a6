"""The Lightning internals :class:`~dtprofile.integrations.lightning.DTProfileCallback` needs
beyond the Callback API: the batch fetch and transfer timed (instance patches on the
training epoch loop and the strategy, or the Trainer's profiler), and instance patches
on the precision plugin and the fit loop. Each degrades (times nothing, patches
nothing) when the Lightning it meets is not the one it knows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .._patching import MISSING, InstancePatch
from ..capture.data_wait import cpu_clock_if_sampled, cpu_since
from ..engine import Engine

FETCH_ACTION_SUFFIX = ".train_dataloader_next"  # "[_TrainingEpochLoop].train_dataloader_next"
TRANSFER_ACTION_SUFFIX = ".batch_to_device"  # "[Strategy]DDPStrategy.batch_to_device"
BEFORE_TRANSFER_SUFFIX = ".on_before_batch_transfer"  # "[LightningModule]Net.on_before_batch_transfer"

# What a profiler action is to the fetch timer.
_OTHER, _FETCH, _TRANSFER, _BEFORE_TRANSFER = range(4)
_MAX_ACTION_NAMES = 4096


def _does_nothing(profiler: Any) -> bool:
    """Whether ``profiler`` is Lightning's ``PassThroughProfiler`` as it comes (its
    ``start`` and ``stop`` do nothing)."""
    cls = type(profiler)
    return (
        cls.__name__ == "PassThroughProfiler"
        and not {"start", "stop"} & set(vars(profiler))
        and getattr(cls.start, "__qualname__", None) == "PassThroughProfiler.start"
        and getattr(cls.stop, "__qualname__", None) == "PassThroughProfiler.stop"
    )


class _FetchTimer:
    """Wraps a Lightning profiler's ``start``/``stop`` to time the training batch fetch.

    The Trainer brackets ``next(data_fetcher)`` with ``profiler.start/stop(
    "[_TrainingEpochLoop].train_dataloader_next")``, then runs ``on_before_batch_transfer``
    and the transfer to the device under ``profiler.profile("[Strategy]<Name>.batch_to_device")``
    (``transfer_batch_to_device``, ``on_after_batch_transfer``). The fetch is data wait;
    so is the span from its end to the transfer's end (the batch is not ready before),
    which is added as transfer time. A transfer counts only right after a training fetch
    (the evaluation loops use the same transfer action). ``on_fetch`` runs as a training
    fetch starts.
    """

    def __init__(
        self,
        profiler: Any,
        add_wait: Callable[[float, bool, float | None], None],
        on_fetch: Callable[[], None] | None = None,
    ) -> None:
        self.profiler = profiler
        self.add_wait: Callable[[float, bool, float | None], None] | None = add_wait
        self.on_fetch = on_fetch
        self._saved = {name: profiler.__dict__.get(name, MISSING) for name in ("start", "stop")}
        # Lightning's default profiler does nothing: its calls are left out, which pays
        # for this wrapper's own on every action.
        idle = _does_nothing(profiler)
        self._inner_start = None if idle else profiler.start
        self._inner_stop = None if idle else profiler.stop
        self._open: dict[str, float] = {}
        self._kinds: dict[str, int] = {}  # action name -> _FETCH, _TRANSFER, ...
        self._fetch_end: float | None = None  # when the last training fetch ended, until its transfer
        self._fetch_cpu: float | None = None  # this thread's CPU time as the open fetch started, if read
        self.fetches = 0
        profiler.start = self.start
        profiler.stop = self.stop

    def start(self, action_name: str) -> None:
        # The Trainer starts a few dozen actions per batch, from a fixed set of names, most
        # of them nothing to the fetch timer: those pass through after one lookup.
        try:
            if self._kinds.get(action_name) != _OTHER or self._fetch_end is not None:
                self._started(action_name)
        except Exception:  # never break the Trainer's profiler calls
            pass
        if self._inner_start is not None:
            self._inner_start(action_name)

    def _started(self, action_name: str) -> None:
        if self.add_wait is None:
            return
        kind = self._kinds.get(action_name)
        if kind is None:
            kind = self._kind_of(action_name)  # each name's kind is worked out once
        if kind == _FETCH:
            if self.on_fetch is not None:
                self.on_fetch()
            self._fetch_cpu = cpu_clock_if_sampled(self.fetches)
            self._open[action_name] = time.perf_counter()
        elif kind == _TRANSFER and self._fetch_end is not None:
            self._open[action_name] = self._fetch_end
        elif kind != _BEFORE_TRANSFER:
            self._fetch_end = None  # anything else first: no transfer of this batch follows

    def _kind_of(self, action_name: Any) -> int:
        if not isinstance(action_name, str):
            return _OTHER
        if action_name.endswith(FETCH_ACTION_SUFFIX):
            kind = _FETCH
        elif action_name.endswith(TRANSFER_ACTION_SUFFIX):
            kind = _TRANSFER
        elif action_name.endswith(BEFORE_TRANSFER_SUFFIX):
            kind = _BEFORE_TRANSFER
        else:
            kind = _OTHER
        if len(self._kinds) < _MAX_ACTION_NAMES:  # bounded, whatever names a profiler invents
            self._kinds[action_name] = kind
        return kind

    def batch_started(self) -> None:
        """A training batch started: a transfer from now on is not its own."""
        self._fetch_end = None

    def stop(self, action_name: str) -> None:
        if self._open:  # (a fetch or a transfer is being timed: rarely)
            self._stopped(action_name)
        if self._inner_stop is not None:
            self._inner_stop(action_name)

    def _stopped(self, action_name: str) -> None:
        try:
            t0 = self._open.pop(action_name, None)
            if t0 is not None and self.add_wait is not None:
                now = time.perf_counter()
                fetch = action_name.endswith(FETCH_ACTION_SUFFIX)
                self.add_wait(now - t0, not fetch, cpu_since(self._fetch_cpu) if fetch else None)
                self._fetch_end = now if fetch else None
                self.fetches += fetch
        except Exception:  # never break the Trainer's profiler calls
            pass

    def restore(self) -> None:
        self.add_wait = None  # pass-through from now on, whatever happens below
        for name, bound in (("start", self.start), ("stop", self.stop)):
            if self.profiler.__dict__.get(name) != bound:
                continue  # someone wrapped it after us: leave their wrapper in place
            saved = self._saved[name]
            # Past wrappers that are pass-through already (another callback's, restored
            # while ours was on top): they would otherwise stay for good.
            while isinstance(getattr(saved, "__self__", None), _FetchTimer) and saved.__self__.add_wait is None:
                saved = saved.__self__._saved[name]
            if saved is MISSING:
                delattr(self.profiler, name)
            else:
                setattr(self.profiler, name, saved)


class _FetchHooks:
    """Times the training batch fetch and transfer with three instance patches.

    The training epoch loop's data fetcher calls the loop's ``_on_before_fetch`` and
    ``_on_after_fetch`` around each ``next()`` (they start and stop the Trainer's
    ``train_dataloader_next`` action), and the loop hands each batch to the strategy's
    ``batch_to_device``. Patching those three costs three calls per batch, where wrapping
    the Trainer's profiler (:class:`_FetchTimer`, for a Lightning without them) passes
    every one of its few dozen actions per batch through dtprofile's code.

    What is timed is the same: the fetch is data wait, and so is the span from its end
    to the transfer's end (``on_before_batch_transfer``, the transfer, and
    ``on_after_batch_transfer``: the batch is not ready before), added as transfer time.
    A transfer counts only after a training fetch and before :meth:`batch_started`
    (the evaluation loops use the same ``batch_to_device``).

    Args:
        epoch_loop: the Trainer's ``fit_loop.epoch_loop``.
        strategy: the Trainer's strategy.
        add_wait: takes (seconds, whether it was a transfer, the fetch's CPU seconds or None).
        on_fetch: runs as a training fetch starts.
    """

    def __init__(
        self,
        epoch_loop: Any,
        strategy: Any,
        add_wait: Callable[[float, bool, float | None], None],
        on_fetch: Callable[[], None] | None = None,
    ) -> None:
        self.add_wait: Callable[[float, bool, float | None], None] | None = add_wait
        self.on_fetch = on_fetch
        self._fetch_start: float | None = None
        self._fetch_cpu: float | None = None  # this thread's CPU time as the open fetch started, if read
        self._fetch_end: float | None = None  # when the last training fetch ended, until its transfer
        self.fetches = 0
        self._patches = [
            _Around(epoch_loop, "_on_before_fetch", self._fetch_starts),
            _Around(epoch_loop, "_on_after_fetch", self._fetch_ends),
        ]
        try:
            self._patches.append(_Around(strategy, "batch_to_device", after=self._transferred))
        except Exception:
            self.restore()
            raise
        # The loop hands its methods to the fetcher as each epoch starts: a fetcher that
        # already holds them (an epoch under way) gets the patched ones now.
        fetcher = getattr(getattr(getattr(epoch_loop, "trainer", None), "fit_loop", None), "_data_fetcher", None)
        for patch, key in zip(self._patches, ("_start_profiler", "_stop_profiler"), strict=False):
            if fetcher is not None and getattr(fetcher, key, None) == patch._inner:
                setattr(fetcher, key, patch.call)

    @classmethod
    def attach(
        cls,
        trainer: Any,
        add_wait: Callable[[float, bool, float | None], None],
        on_fetch: Callable[[], None] | None = None,
    ) -> _FetchHooks | None:
        """The hooks on ``trainer``, or None when its loop or strategy lacks the methods
        (another Lightning: then wrap its profiler instead)."""
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        strategy = getattr(trainer, "strategy", None)
        if not all(
            callable(getattr(obj, name, None))
            for obj, name in ((loop, "_on_before_fetch"), (loop, "_on_after_fetch"), (strategy, "batch_to_device"))
        ):
            return None
        return cls(loop, strategy, add_wait, on_fetch)

    def batch_started(self) -> None:
        """A training batch started: a transfer from now on is not its own."""
        self._fetch_end = None

    def _fetch_starts(self) -> None:
        if self.add_wait is None:
            return
        if self.on_fetch is not None:
            self.on_fetch()
        self._fetch_end = None
        self._fetch_cpu = cpu_clock_if_sampled(self.fetches)
        self._fetch_start = time.perf_counter()

    def _fetch_ends(self) -> None:
        t0, self._fetch_start = self._fetch_start, None
        if t0 is None or self.add_wait is None:
            return
        now = time.perf_counter()
        self.add_wait(now - t0, False, cpu_since(self._fetch_cpu))
        self._fetch_end = now
        self.fetches += 1

    def _transferred(self) -> None:
        t0, self._fetch_end = self._fetch_end, None
        if t0 is not None and self.add_wait is not None:
            self.add_wait(time.perf_counter() - t0, True, None)

    def restore(self) -> None:
        self.add_wait = None  # pass-through from now on, whatever happens below
        for patch in reversed(self._patches):
            patch.restore()


class _Around(InstancePatch):
    """Runs ``before`` and ``after`` around one object's method. Their errors are
    swallowed (never the Trainer's problem); the method's own pass through."""

    def __init__(
        self, obj: Any, name: str, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None
    ) -> None:
        self.before, self.after = before, after
        super().__init__(obj, name, self.call)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            try:
                self.before()
            except Exception:
                pass
        result = self._inner(*args, **kwargs)
        if self.after is not None:
            try:
                self.after()
            except Exception:
                pass
        return result

    def restore(self) -> None:
        self.before = self.after = None
        super().restore()


class _EnginePatch(InstancePatch):
    """A patch that calls into the engine: it drops the engine when restored, and passes
    through without one."""

    engine: Engine | None

    def restore(self) -> None:
        self.engine = None  # pass-through from now on, should a reference remain
        super().restore()


class _UpdateStarts(_EnginePatch):
    """Marks the update's start where the precision plugin's ``_after_closure`` returns.

    ``_wrap_closure`` runs the closure (``training_step``, ``zero_grad``, backward and
    its hooks) inside ``optimizer.step``, then ``_after_closure``: the
    ``on_before_optimizer_step`` hooks (the module's after the callbacks') and gradient
    clipping; the update follows. Mixed precision runs the closure and
    ``_after_closure`` before the step. Either way the update starts where
    ``_after_closure`` returns, and what came before it is forward, backward and other
    compute. Without the method (another Lightning) the closure counts as optimizer.
    """

    def __init__(self, plugin: Any, engine: Engine) -> None:
        self.engine: Engine | None = engine
        super().__init__(plugin, "_after_closure", self.call)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner(*args, **kwargs)
        engine = self.engine
        if engine is not None:  # (does nothing unless the engine is measuring)
            engine.updates.update_starts()
        return result


class _NestedRunGuard(_EnginePatch):
    """Suspends the engine while the fit loop runs inside itself.

    Lightning's tuner callbacks (``BatchSizeFinder``, ``LearningRateFinder``, used mid-fit
    from ``on_train_epoch_start``) run trial steps by calling ``fit_loop.run()`` from a
    hook, with the Trainer's callbacks swapped out and the model restored afterwards:
    those steps are not the run's. The wrapper is an instance attribute, set while the
    outer ``run`` is already executing, so every call through it is a nested one.
    """

    def __init__(self, loop: Any, engine: Engine) -> None:
        self.engine: Engine | None = engine
        super().__init__(loop, "run", self.run)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is None:
            return self._inner(*args, **kwargs)
        engine.suspend()
        try:
            return self._inner(*args, **kwargs)
        finally:
            engine.resume()


def _reopen(writer: Any) -> None:
    """Open ``writer``'s event file now, on this thread. A fit after another finds it
    closed; the first ``add_*`` reopens it, and when Lightning's thread and dtprofile's
    writer thread do so at once, each gets an event file of its own."""
    try:
        writer._get_file_writer()  # torch's SummaryWriter: reopens a closed writer
    except Exception:
        pass


def _tensorboard_logger(trainer: Any) -> Any:
    for logger in getattr(trainer, "loggers", None) or []:
        if any(cls.__name__ == "TensorBoardLogger" for cls in type(logger).__mro__):
            return logger
    return None
