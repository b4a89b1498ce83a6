"""Plain PyTorch: a context manager (or start/stop) around a custom training loop.

Step boundaries come from the optimizer's step hooks, forward (and through it,
backward) from module hooks, gradient communication from a DDP communication hook, data
wait from ``prof.loader(...)`` when the loop uses it.

>>> import torch, dtprofile
>>> model = torch.nn.Linear(4, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(12)]
>>> with dtprofile.profile(model, opt, warmup_steps=2) as prof:
...     for x, y in prof.loader(data):
...         loss = torch.nn.functional.mse_loss(model(x), y)
...         loss.backward()
...         opt.step(); opt.zero_grad()
>>> prof.report().to_dict()["steps_profiled"]
10
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import sys
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import torch

from .. import console
from ..capture.data_wait import timed_loader
from ..capture.pipeline import stage_modules
from ..engine import Engine, stop_engines_on
from ..options import Options, options_from_kwargs, options_signature
from ..sinks.tensorboard import sink_factory
from ..summary import SUMMARY_NAME, Report

__all__ = ["Profile", "profile"]

T = TypeVar("T")


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class Profile:
    """A profiling session for a custom loop; see :func:`profile`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        options: Options,
    ) -> None:
        self.model = model
        self.optimizers = _optimizers(optimizer)
        self.optimizer = self.optimizers[0]  # the one whose steps end the training steps
        self.options = options
        self._engine: Engine | None = None
        self._report: Report | None = None
        self._uses_loader = False
        self._loader: Any = None
        self.more_modules: list[torch.nn.Module] = []

    # The with-statement and torch.profiler-style start()/stop().
    def __enter__(self) -> Profile:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is None:
            self.stop()
        else:  # the loop raised: stop without waiting out the gather timeout for stuck peers
            self._stop(complete=False, failed=True)
        return False

    def start(self) -> Profile:
        """Attach the hooks and begin measuring."""
        if self._engine is not None and self._engine.active:
            raise RuntimeError("dtprofile.profile(...) is already started; call stop() first")
        self._report = None
        stop_engines_on([self.model, *self.more_modules, *self.optimizers])  # one left running (an interrupted cell)
        _warn_if_logdir_holds_a_run(self.options.logdir)
        engine = Engine(
            self.options,
            device=_device_of(self.model),
            sink_factory=sink_factory(logdir=self.options.logdir),
            framework=_framework_of(self.optimizers),
            comm_hint=_comm_hint(),
        )
        try:
            engine.attach_module(self.model)
            for module in self.more_modules:  # (a pipeline schedule's other stages on this rank)
                engine.attach_module(module)
            for optimizer in self.optimizers:
                engine.attach_optimizer(optimizer)
            engine.start()
        except BaseException:  # (a Ctrl-C while the sink imports TensorBoard): leave no hook behind
            if engine.active:
                engine.stop(complete=False, failed=True)
            else:
                engine.detach()
            raise
        if self._uses_loader:
            engine.data.use_loader()
        if self._loader is not None:  # prof.loader(...) called before start()
            engine.note_loader(self._loader)
        self._engine = engine
        # A script that never calls stop() still leaves its summary behind (one exit hook,
        # registered at the first start: it runs before what the script registered earlier).
        if not _stop_at_exit.registered:  # type: ignore[attr-defined]  # (a function attribute)
            atexit.register(_stop_at_exit)
            _stop_at_exit.registered = True  # type: ignore[attr-defined]
        _STARTED.add(self)
        return self

    def stop(self, complete: bool = True) -> Report:
        """Detach every hook, gather the final figures and write the outputs (rank 0)."""
        return self._stop(complete=complete, failed=False)

    def _stop(self, complete: bool, failed: bool) -> Report:
        if self._engine is None:
            raise RuntimeError("dtprofile.profile(...).stop() called before start()")
        if self._report is None or self._engine.active:
            self._report = self._engine.stop(complete=complete, failed=failed)
        return self._report

    def loader(self, iterable: Iterable[T]) -> Iterable[T]:
        """Iterate ``iterable``, timing each ``next()`` as data wait.

        Optional: without it, data wait is the gap between a step's end and the next
        forward, and the report says which it is. What comes back behaves like what it
        wraps: a DataLoader (or any re-iterable object) stays re-iterable, one pass per
        ``for`` loop (an epoch), with its ``len()`` and attributes (``sampler``,
        ``dataset``, ``batch_size``); an iterator or generator stays one-shot.

        Args:
            iterable: the batches: a DataLoader, a list, a generator.

        Returns:
            An iterable that yields the same batches in the same order.

        Example:
            >>> loader = prof.loader(train_loader)  # doctest: +SKIP
            >>> for epoch in range(3):  # doctest: +SKIP
            ...     for x, y in loader: ...
        """
        if not hasattr(iterable, "__iter__") and not hasattr(iterable, "__getitem__"):
            raise TypeError(
                f"loader needs an iterable of batches (a DataLoader, a list, a generator), "
                f"got {type(iterable).__name__}"
            )
        self._uses_loader = True
        self._loader = iterable
        if self._engine is not None:
            self._engine.data.use_loader()
            self._engine.note_loader(iterable)
        # (a call into C, not a Python function: it runs on every fetch)
        return timed_loader(iterable, functools.partial(getattr, self, "_engine"))

    @contextlib.contextmanager
    def communication(self, nbytes: int | None = None) -> Iterator[None]:
        """Time gradient communication the loop runs itself, instead of DDP.

        For loops that reduce gradients by hand (``dist.all_reduce`` on each gradient, a
        parameter server, Horovod-style fusion). ``nbytes``: bytes this block sends per
        rank, e.g. ``sum(p.grad.nbytes for p in params)``; None leaves ``grad_bytes``
        unknown. The block's time is ``comm_total``; what of it lies after backward is
        ``comm_exposed``. On CUDA the end mark is recorded on the current stream, so
        reductions that run asynchronously must be waited for inside the block::

            loss.backward()
            with prof.communication(nbytes=grad_bytes):
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
            optimizer.step()
        """
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise ValueError(f"communication(nbytes): expected a byte count >= 0 or None, got {nbytes!r}")
        engine = self._engine
        interval = engine.comm.manual_start(nbytes) if engine is not None and engine.active else None
        try:
            yield
        finally:
            if interval is not None and engine is not None:  # (an interval comes from an engine)
                engine.comm.end(interval)

    def report(self) -> Report:
        """The final report after stop(); while running, the figures so far."""
        if self._report is not None:
            return self._report
        if self._engine is None:
            raise RuntimeError("dtprofile.profile(...).report() called before start()")
        return Report(self._engine.summary(final=False, complete=False))


def _warn_if_logdir_holds_a_run(logdir: str | os.PathLike[str] | None) -> None:
    """A logdir that holds an earlier run's summary (a notebook cell run again): TensorBoard
    draws both runs' event files as one run, and this run's summary replaces the other."""
    if logdir is None or console.rank_of_process() != 0:
        return
    if os.path.isfile(os.path.join(logdir, SUMMARY_NAME)):
        console.warn(
            f"dtprofile: {logdir} holds an earlier run: TensorBoard will draw both as one run and "
            "this run's summary replaces the other's; give each run a logdir of its own",
            stacklevel=4,
        )


# Profiles started in this process, held weakly: at exit, those still running are stopped.
_STARTED: weakref.WeakSet[Profile] = weakref.WeakSet()


def _stop_at_exit() -> None:
    for prof in list(_STARTED):
        if prof._engine is not None and prof._engine.active:
            try:
                prof.stop(complete=False)
            except Exception:
                pass


_stop_at_exit.registered = False  # type: ignore[attr-defined]  # (a function attribute)


def _comm_hint() -> str:
    """What the report says after "the profiled model is not DDP": with Accelerate loaded,
    the usual cause (the model profiled before ``prepare``, or CPU processes that each
    train alone) first."""
    hint = "a loop that reduces gradients itself can time it with prof.communication(nbytes)"
    if "accelerate" in sys.modules:
        hint = (
            "with Accelerate, profile the model accelerator.prepare returned (on machines without GPUs, "
            "Accelerator(cpu=True) makes the processes one DDP job); " + hint
        )
    return hint


def _framework_of(optimizers: Sequence[Any]) -> str:
    """``"accelerate"`` for objects prepared by Hugging Face Accelerate (the advice then
    names the Accelerator's settings and its launcher), else ``"torch"``."""
    prepared = any(type(o).__module__.split(".")[0] == "accelerate" for o in optimizers)
    return "accelerate" if prepared else "torch"


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list, checked: one optimizer, or a sequence of them."""
    many = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    bad = [o for o in many if not isinstance(o, torch.optim.Optimizer)]
    if not many or bad:
        got = type(bad[0]).__name__ if bad else "an empty sequence"
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or a list/tuple of them (the first ends "
            f"each training step), got {got}"
        )
    return list(dict.fromkeys(many))  # one optimizer passed twice is one


def profile(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], **options: Any
) -> Profile:
    """Profile a custom training loop: compute, gradient communication, data wait.

    Use it as a context manager, or call ``start()`` and ``stop()`` around a loop that is
    not one block.

    Args:
        model: a ``torch.nn.Module``, plain or wrapped in DistributedDataParallel (or FSDP);
            or a pipeline schedule (``torch.distributed.pipelining``: ``ScheduleGPipe``,
            ``Schedule1F1B``, ...), whose stages' modules on this rank are profiled.
        optimizer: any ``torch.optim.Optimizer``, or a list of them when the loop steps
            several (parameter groups split across optimizers, a GAN's two): the first
            one's step ends each training step, the others' steps add to its optimizer time.
        **options: keyword-only; every field of :class:`dtprofile.options.Options`
            (``logdir``, ``every_n_steps``, ``warmup_steps``, ``target_efficiency``,
            ``link_bandwidth``, ``link_bandwidth_per``, ``scaling``, ``project_gpus``,
            ``probe_every``, ``gather_timeout_s``, ``telemetry_interval_s``), documented there.

    Returns:
        The :class:`Profile`; ``prof.report()`` after the loop.

    Example::

        with dtprofile.profile(model, optimizer, logdir="runs/exp") as prof:
            for x, y in prof.loader(train_loader):
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step(); optimizer.zero_grad()
        print(prof.report())
    """
    stages = stage_modules(model)  # (a pipeline schedule: the modules of its stages on this rank)
    if stages:
        prof = Profile(stages[0], optimizer, options_from_kwargs("profile()", options))
        prof.more_modules = stages[1:]
        return prof
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "model must be a torch.nn.Module (plain or DistributedDataParallel) or a pipeline schedule "
            f"(torch.distributed.pipelining), got {type(model).__name__}"
        )
    _optimizers(optimizer)
    return Profile(model, optimizer, options_from_kwargs("profile()", options))


profile.__signature__ = options_signature(  # type: ignore[attr-defined]  # (inspect reads it; not declared)
    [
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="torch.nn.Module"),
        inspect.Parameter(
            "optimizer",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            annotation="torch.optim.Optimizer | Sequence[torch.optim.Optimizer]",
        ),
    ]
)
