"""Hugging Face Transformers: a ``TrainerCallback`` that profiles ``trainer.train()``.

One line attaches it::

    trainer = Trainer(model=model, args=args, train_dataset=train,
                      callbacks=[dtprofile.DTProfileTrainerCallback()])
    trainer.train()

The callback is glue: the measurement is :class:`dtprofile.engine.Engine`, the same as
``dtprofile.profile``. What it connects, at ``on_train_begin`` (after the Trainer has
prepared the model, the optimizer and the loader through Accelerate; every rank at the
same point):

- the model the Trainer trains, ``trainer.model_wrapped``: under several processes the
  DDP wrapper, whose communication hook times the gradient all-reduce. Callback events
  receive only the unwrapped model, so the callback finds its Trainer on the call stack
  (the frame that called the event); without it, the unwrapped model is profiled and the
  communication is reported unmeasured;
- the optimizer: Accelerate's ``AcceleratedOptimizer`` is unwrapped to the torch
  optimizer it drives, whose ``step`` runs once per update. The micro-batches of
  ``gradient_accumulation_steps`` are one step; an fp16 update the loss scaler skips is
  counted as skipped;
- data wait: each micro-batch's ``next()`` inside ``Trainer.get_batch_samples`` (the
  Trainer fetches an update's micro-batches together, before the first forward);
- logging, evaluation and checkpoint saves inside ``train()`` run between
  ``on_step_end`` and the next fetch: that span is left out of the steps, as Lightning's
  validation is.

Outputs (rank 0 writes, every rank measures): TensorBoard events (tags under
``dtprofile/``) and ``dtprofile_summary.json`` in the Trainer's own TensorBoard directory,
beside its events: the ``TensorBoardCallback``'s, else ``$TENSORBOARD_LOGGING_DIR``, else
``args.logging_dir`` (Transformers 4), else ``<output_dir>/runs/<time>_<host>``; with
``logdir=...`` given, there. Each ``on_log`` gets the headline figures
(``dtprofile/R_O``, ``dtprofile/alpha_at_target``, ``dtprofile/recommended_gpus``, see
:func:`dtprofile.analysis.summary_readers.headline_metrics`) added to ``logs``; the
callback moves itself first in the Trainer's list, so every other reporter (TensorBoard,
W&B, MLflow, the console) receives them.

Transformers has no way to add a callback from the environment: the one line above is
the way to attach it (``DTPROFILE=1`` is Lightning's).
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any, cast

from ..analysis.summary_readers import headline_metrics
from ..capture.data_wait import FETCH_CPU_EVERY, cpu_clock_if_sampled, cpu_since
from ..capture.parts import Unhookable
from ..engine import Engine
from ..options import options_from_kwargs, options_signature
from ..sinks.tensorboard import sink_factory
from ..summary import Report
from ._common import EngineCallback

try:
    import transformers as _transformers
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:
    raise ImportError(
        "dtprofile.DTProfileTrainerCallback needs Hugging Face Transformers: "
        "pip install 'dtprofile[transformers]' (or pip install transformers)"
    ) from None

__all__ = ["DTProfileTrainerCallback"]

log = logging.getLogger(__name__)

# How far up the stack an event's Trainer is: Trainer -> CallbackHandler.on_x -> call_event -> the callback.
_TRAINER_FRAMES = 8


class DTProfileTrainerCallback(EngineCallback, _TrainerCallback):
    """Profile ``trainer.train()``: compute, gradient communication and data wait per step.

    Same options as :func:`dtprofile.profile` (see :class:`dtprofile.options.Options`), all
    keyword-only. ``logdir`` overrides where the TensorBoard events and
    ``dtprofile_summary.json`` go (default: the Trainer's TensorBoard directory).

    Example::

        cb = dtprofile.DTProfileTrainerCallback()
        trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[cb])
        trainer.train()
        if trainer.is_world_process_zero():
            print(cb.report())
    """

    _FRAMEWORK = "Transformers"
    _NOT_STARTED = "DTProfileTrainerCallback.report() called before trainer.train() started"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self._options = options_from_kwargs("DTProfileTrainerCallback()", options)  # errors name the option
        self._engine: Engine | None = None
        self._report: Report | None = None
        self._fetches: _FetchTimer | None = None
        self._paused = False
        self._logdir: str | None = None
        self._published: dict[str, Any] | None = None  # the summary whose headline went into the logs last

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(every_n_steps={self._options.every_n_steps}, "
            f"warmup_steps={self._options.warmup_steps})"
        )

    # ------------------------------------------------------------------ public
    @property
    def logdir(self) -> str | None:
        """Where rank 0 writes the events and the summary (None before training, other ranks)."""
        return self._logdir

    def report(self) -> Report:
        """The :class:`dtprofile.Report` after ``train()``; during it, the figures so far.

        Raises:
            RuntimeError: before ``train()`` started.
        """
        return self._current_report()

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._engine is not None and self._engine.active:
            self._stop_run(complete=False)
        self._report = None
        self._published = None
        trainer = _calling_trainer()
        try:
            self._start(trainer, args, state, kwargs)
        except Exception as exc:
            self._abandon(exc)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._resume()  # (the fetch resumed already, where it is timed)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Logging, evaluation and saving come next, until the next update's fetch.
        self._pause()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._pause()  # the epoch's evaluation and saves (after a fetch that found no batch)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        engine = self._engine
        if engine is None or not isinstance(logs, dict) or not _training_logs(logs):
            return  # (an evaluation's metrics: the headline belongs with the training figures)
        try:
            summary = engine.latest_summary()
            if summary is not None and summary is not self._published:
                self._published = summary  # each interval's figures once, at the first log after it
                logs.update(headline_metrics(summary))
        except Exception as exc:  # never into training
            log.debug("dtprofile: headline not logged: %r", exc)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_run(complete=True)

    # ------------------------------------------------------------------ internals
    def _start(self, trainer: Any, args: Any, state: Any, kwargs: dict[str, Any]) -> None:
        model = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        model = model if model is not None else kwargs.get("model")
        optimizer = kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to on_train_begin")
        rank0 = bool(getattr(state, "is_world_process_zero", True))
        logdir = cast("str | None", self._options.logdir)  # (a str once the options are built)
        if logdir is None and rank0:
            logdir = _trainer_logdir(trainer, args)
            trial = getattr(state, "trial_name", None)
            if getattr(state, "is_hyper_param_search", False) and trial and os.path.basename(logdir) != trial:
                logdir = os.path.join(logdir, str(trial))  # each trial's run its own, as TensorBoard's are
        options = dataclasses.replace(self._options, logdir=logdir)
        self._logdir = logdir if rank0 else None
        engine = Engine(
            options,
            device=getattr(args, "device", None),
            sink_factory=sink_factory(logdir=options.logdir),
            framework="transformers",  # the advice names TrainingArguments
            comm_hint=None
            if trainer is not None
            else ("the callback found no Trainer on the call stack, so it profiled the unwrapped model, not DDP's"),
            global_step=lambda: state.global_step,  # TensorBoard's x-axis is the Trainer's
        )
        self._engine = engine  # (from here, _abandon removes what was attached)
        engine.attach_module(model)
        engine.attach_optimizer(optimizer)
        loader = kwargs.get("train_dataloader")
        if loader is not None:
            engine.note_loader(loader)
        if trainer is not None and callable(getattr(trainer, "get_batch_samples", None)):
            self._fetches = _FetchTimer(trainer, lambda: self._engine, on_fetch=self._resume, on_empty=self._pause)
            engine.data.use_loader()
        else:  # the fetch happens inside the span left out of the steps: no gap stands in for it
            engine.parts["data"].fail(
                Unhookable(
                    "data wait unmeasured: the callback times the Trainer's get_batch_samples (Transformers >= 4.46)"
                    + ("" if trainer is not None else ", and it found no Trainer on the call stack")
                )
            )
        if trainer is not None:
            _first_in_line(trainer, self)
        engine.start()  # every rank, same point: the ranks meet on the store to start together
        _STARTED.add(self)
        # What comes before the first fetch (eval_on_start) is not a step.
        self._paused = False
        self._pause()

    def _restore(self) -> None:
        if self._fetches is not None:
            try:
                self._fetches.restore()
            except Exception as exc:
                log.debug("dtprofile: restoring the Trainer's fetch failed: %r", exc)
            self._fetches = None


DTProfileTrainerCallback.__init__.__signature__ = options_signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
)


def _training_logs(logs: dict[str, Any]) -> bool:
    """The Trainer's training figures (``loss``, ``learning_rate``, the final ``train_*``),
    not an evaluation's (whatever its ``metric_key_prefix``)."""
    return "loss" in logs or "learning_rate" in logs or any(str(k).startswith("train_") for k in logs)


def _calling_trainer() -> Any:
    """The ``Trainer`` whose callback event is running, found on the call stack; else None."""
    frame: FrameType | None
    try:
        frame = sys._getframe(2)
    except ValueError:
        return None
    for _ in range(_TRAINER_FRAMES):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


def _trainer_logdir(trainer: Any, args: Any) -> str:
    """Where the Trainer's TensorBoard events go (see the module's docstring)."""
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None) or []
    for callback in callbacks:
        if type(callback).__name__ == "TensorBoardCallback":
            writer = getattr(callback, "tb_writer", None)
            for path in (
                getattr(writer, "log_dir", None),
                getattr(writer, "logdir", None),
                getattr(callback, "logging_dir", None),
            ):
                if isinstance(path, str) and path:
                    return path
    env = os.environ.get("TENSORBOARD_LOGGING_DIR")
    if env:
        return os.path.expanduser(env)
    older = getattr(args, "logging_dir", None)  # Transformers 4's TrainingArguments
    if isinstance(older, str) and older:
        return older
    try:  # the TensorBoardCallback's default: runs/<time>_<host> under output_dir
        from transformers.integrations.integration_utils import default_logdir
    except ImportError:  # Transformers 4
        from transformers.training_args import default_logdir
    return os.path.join(getattr(args, "output_dir", None) or ".", default_logdir())


def _first_in_line(trainer: Any, callback: Any) -> None:
    """Move ``callback`` to the front of the Trainer's callbacks, so that the headline it
    adds in ``on_log`` reaches every other reporter. Moving an earlier position's
    callback to the front while the handler iterates the list shifts only the callbacks
    already called: none is skipped or called twice."""
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
    if isinstance(callbacks, list) and callback in callbacks and callbacks[0] is not callback:
        callbacks.remove(callback)
        callbacks.insert(0, callback)


class _FetchTimer:
    """``trainer.get_batch_samples`` with each ``next()`` of the epoch's iterator timed as
    data wait. An instance attribute over the method, removed by :meth:`restore`."""

    def __init__(self, trainer: Any, engine_of: Any, on_fetch: Any, on_empty: Any) -> None:
        self._trainer = trainer
        self._fetched = [0]  # the run's timed fetches, across the calls (which one reads the CPU clock)
        original = trainer.get_batch_samples

        def get_batch_samples(epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
            engine = engine_of()
            if engine is None or not engine.active:
                return original(epoch_iterator, *args, **kwargs)
            on_fetch()  # training goes on: what follows is the next update's
            result = original(_TimedFetches(epoch_iterator, engine, self._fetched), *args, **kwargs)
            if isinstance(result, tuple) and result and not result[0]:
                on_empty()  # the epoch ran out: its end (evaluation, saves) is not a step
            return result

        self._wrapper = get_batch_samples
        trainer.get_batch_samples = get_batch_samples

    def restore(self) -> None:
        if self._trainer.__dict__.get("get_batch_samples") is self._wrapper:
            del self._trainer.get_batch_samples


class _TimedFetches:
    """An iterator's ``next()`` calls, each timed into ``engine`` as data wait.
    ``fetched``: the count of timed fetches so far, shared by the calls of a run."""

    def __init__(self, iterator: Iterator[Any], engine: Engine, fetched: list[int]) -> None:
        self._iterator = iterator
        self._engine = engine
        self._fetched = fetched

    def __iter__(self) -> _TimedFetches:
        return self

    def __next__(self) -> Any:
        c0 = cpu_clock_if_sampled(self._fetched[0])
        t0 = time.perf_counter()
        batch = next(self._iterator)  # (StopIteration ends the epoch, as without us)
        self._fetched[0] += 1
        engine = self._engine
        if engine.active:
            wait_s = time.perf_counter() - t0
            engine.data.add(wait_s, False, cpu_since(c0))
            if engine.data.batch_bytes is None:  # (what a loader worker would copy: the loader advice's)
                engine.data.note_batch(batch)
            elif self._fetched[0] % FETCH_CPU_EVERY == 1 and not engine.data.sample_shapes_vary:
                engine.data.compare_batch(batch)  # (sampled: fixed shapes or lengths that vary)
        return batch


# Callbacks whose train() never reached on_train_end (it raised): stopped at exit, as a
# failed run (the other ranks may never reach the final gather, so it waits only briefly).
_STARTED: weakref.WeakSet[DTProfileTrainerCallback] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for callback in list(_STARTED):
        try:
            callback._stop_run(complete=False, failed=True)
        except Exception:
            pass
