"""PyTorch Lightning: a callback that profiles ``trainer.fit`` with the dtprofile engine.

One line attaches it::

    trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[dtprofile.DTProfileCallback()])
    trainer.fit(model)

or none at all: with the environment variable ``DTPROFILE=1`` the Trainer loads it
through the ``pytorch_lightning.callbacks_factory`` / ``lightning.pytorch.callbacks_factory``
entry point (options from ``DTPROFILE_*`` variables, see :func:`options_from_env`).

The callback is glue: the measurement is :class:`dtprofile.engine.Engine`, the same as
``dtprofile.profile``. What it connects, at ``on_train_start`` (after the strategy has
wrapped the model in DDP and after the sanity check, on every rank at the same point):

- the strategy's model (``trainer.strategy.model``; under DDP the DDP wrapper, whose
  forward runs ``training_step``) gets the engine's module hooks: forward, and through
  its output's gradients, backward. When the strategy calls ``training_step`` directly
  (single device), each call is timed as a forward pass of the LightningModule
  (``Engine.attach_call``);
- the DDP model gets the timed communication hook (or re-uses the user's
  ``dtprofile.timed_hook(...)``; another hook leaves communication unmeasured);
- every optimizer in ``trainer.optimizers``: the first marks step boundaries. Lightning
  runs the closure (forward, backward) inside ``optimizer.step``, then the precision
  plugin's ``_after_closure`` (the ``on_before_optimizer_step`` hooks, gradient
  clipping): the optimizer phase starts where ``_after_closure`` returns (what the two
  hold beyond forward and backward is other compute);
- data wait: Lightning's own fetch of each training batch and its transfer to the
  device, timed by instance patches on the training epoch loop's ``_on_before_fetch`` /
  ``_on_after_fetch`` (what its data fetcher calls around each ``next()``) and the
  strategy's ``batch_to_device``, restored after. A Lightning without them has its
  Trainer's profiler actions ``[_TrainingEpochLoop].train_dataloader_next`` and
  ``[Strategy]<Name>.batch_to_device`` timed instead (``trainer.profiler``'s
  ``start``/``stop`` wrapped for the run; whichever profiler the user chose still
  receives every call).

Outputs (rank 0 writes, every rank measures): the Trainer's TensorBoard logger (its
``SummaryWriter``, tags under ``dtprofile/``) and ``dtprofile_summary.json`` in the
logger's ``log_dir``; without a TensorBoard logger both go to
``<default_root_dir>/dtprofile_logs``; with ``logdir=...`` given, both go there. After each log
interval, ``trainer.callback_metrics`` holds ``dtprofile/R_O``, ``dtprofile/alpha_at_target``
and ``dtprofile/recommended_gpus`` (see :meth:`DTProfileCallback.headline`).
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from typing import Any, TypeGuard

import torch

from ..analysis.summary_readers import headline_metrics
from ..engine import Engine
from ..options import Options, env_parser, env_variables, options_from_env, options_from_kwargs, options_signature
from ..sinks.tensorboard import sink_factory
from ..summary import Report, load_summary
from ._common import EngineCallback
from ._lightning_patches import _FetchHooks, _FetchTimer, _NestedRunGuard, _reopen, _tensorboard_logger, _UpdateStarts

__all__ = ["DTProfileCallback", "callbacks_factory", "options_from_env"]

log = logging.getLogger(__name__)

METRIC_KEYS = ("dtprofile/R_O", "dtprofile/alpha_at_target", "dtprofile/recommended_gpus")
_DEFAULT_EVERY_N_STEPS = 50
_MIN_DERIVED_EVERY_N_STEPS = 5  # when every_n_steps follows the Trainer's log_every_n_steps


def _import_lightning() -> Any:
    """The ``pytorch_lightning`` package, or the unified ``lightning.pytorch``."""
    try:
        import pytorch_lightning as pl

        return pl
    except ImportError:
        pass
    try:
        import lightning.pytorch as pl

        return pl
    except ImportError:
        raise ImportError(
            "dtprofile.DTProfileCallback needs PyTorch Lightning: pip install 'dtprofile[lightning]' "
            "(or pip install pytorch-lightning)"
        ) from None


_pl = _import_lightning()

# Paths a spawned rank 0 may leave for the launching process (ddp_spawn); removed at exit.
_HANDOFFS: set[str] = set()


@atexit.register
def _remove_handoffs() -> None:
    for path in list(_HANDOFFS):
        try:
            os.remove(path)
        except OSError:
            pass


# Batch hooks the Trainer dispatches that this callback has no use for.
_UNUSED_BATCH_HOOKS = ("on_after_backward", "on_before_zero_grad")
# Batch hooks a fit may not need, by its precision plugin and optimization (see _start),
# or once they have nothing left to do in it (on_train_batch_start).
_PER_FIT_HOOKS = ("on_before_optimizer_step", "on_train_batch_end", "on_train_batch_start")


def _owner(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name``."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _is_lightnings(cls: type | None) -> TypeGuard[type]:
    """Whether ``cls`` is a class of Lightning's own (either package name)."""
    return cls is not None and cls.__module__.split(".")[0] in ("pytorch_lightning", "lightning")


def _lightnings_own(cls: type, name: str) -> bool:
    """Whether ``cls`` has ``name`` from Lightning's ``Callback`` (no subclass overrides it)."""
    return _is_lightnings(_owner(cls, name))


def _defined_by(cls: type, name: str, definer: type) -> bool:
    """Whether ``cls`` has ``name`` from ``definer`` (no subclass overrides it)."""
    return _owner(cls, name) is definer


def _runs_closure_inside_step(plugin: Any) -> bool:
    """Whether the precision plugin steps the optimizer as Lightning's base ``Precision``
    does: ``optimizer.step(closure)``, the closure and ``_after_closure`` inside it, with
    no loss scaler that may leave the update out after they ran."""
    owner = _owner(type(plugin), "optimizer_step")
    return _is_lightnings(owner) and owner.__name__ == "Precision"


class _DTProfileLogic(EngineCallback):
    """The callback's behaviour; mixed into a Lightning ``Callback`` below."""

    _FRAMEWORK = "Lightning"
    _NOT_STARTED = "DTProfileCallback.report() called before trainer.fit(...) started training"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        every_n_steps = options.pop("every_n_steps", None)  # None: the Trainer's log_every_n_steps
        kwargs = dict(options, every_n_steps=_DEFAULT_EVERY_N_STEPS if every_n_steps is None else every_n_steps)
        self._options = options_from_kwargs("DTProfileCallback()", kwargs)  # validates now: errors name the option
        self._every_n_steps = None if every_n_steps is None else self._options.every_n_steps
        self._from_env = False
        self._disabled = False
        self._engine: Engine | None = None
        self._report: Report | None = None
        self._fetch_timer: _FetchHooks | _FetchTimer | None = None
        self._nested_runs: _NestedRunGuard | None = None
        self._update_starts: _UpdateStarts | None = None
        self._paused = False  # between _pause() and _resume()
        self._published: dict[str, Any] | None = None
        self._creator_pid = os.getpid()
        self._handoff = os.path.join(tempfile.gettempdir(), f"dtprofile-handoff-{os.getpid()}-{uuid.uuid4().hex}.json")
        _HANDOFFS.add(self._handoff)
        # The Trainer skips a callback's hook that is not callable; each one it calls costs
        # a batch a profiler context and a call (about 2.5 us). A subclass's own stays.
        for name in _UNUSED_BATCH_HOOKS:
            if _lightnings_own(type(self), name):
                setattr(self, name, None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every_n_steps={self._every_n_steps}, warmup_steps={self._options.warmup_steps})"

    # ------------------------------------------------------------------ public
    def report(self) -> Report:
        """The Report after ``fit``; during fit, the figures so far.

        With ``ddp_spawn`` the fit runs in child processes: the launching process gets
        rank 0's final report (handed over through a temporary file).
        """
        # A hand-off file is always the newest fit's (reading removes it): with ddp_spawn
        # the callback reused in a second Trainer gets that fit's report, not the first's.
        if self._engine is None and os.path.exists(self._handoff):
            try:
                self._report = Report(load_summary(self._handoff))
                return self._report
            finally:
                _remove_quietly(self._handoff)
        return self._current_report()

    @staticmethod
    def headline(summary: dict[str, Any] | None) -> dict[str, float]:
        """The figures published in ``trainer.callback_metrics`` (see :func:`headline_metrics`)."""
        return headline_metrics(summary)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        same = [cb for cb in trainer.callbacks if isinstance(cb, _DTProfileLogic)]
        if self._from_env and len(same) > 1:
            # DTPROFILE=1 with a callback already in the code: the user's one wins.
            chosen = next((cb for cb in same if not cb._from_env), same[0])
            if chosen is not self:
                self._disabled = True
                log.info("dtprofile: DTPROFILE=1 ignored; the Trainer already has a DTProfileCallback")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._disabled:
            return
        if self._engine is not None and self._engine.active:
            self._stop(trainer, complete=False)
        self._report = None
        self._published = None
        try:
            self._start(trainer, pl_module)
        except Exception as exc:
            self._abandon(exc)

    # The per-batch hooks below call only engine methods that do nothing unless it is
    # measuring: no check of their own (each is a call on every batch).
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        engine = self._engine
        if engine is None:
            return
        engine.updates.announce_backward()  # not a batch skipped by returning None
        if engine.updates.steps_end_at_batch:
            # Manual optimization: training_step holds forward, backward and the step;
            # forward ends where backward begins.
            engine.passes.end_forward(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # (None on the instance during a fit whose precision plugin marks the update: _start.)
        engine = self._engine
        if engine is not None:
            engine.updates.mark_optimizer_start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # (None on the instance during an automatic-optimization fit in full precision: _start.)
        engine = self._engine
        if engine is not None:
            if engine.updates.steps_end_at_batch:
                engine.updates.end_batch()  # manual optimization: the batch is the step
            elif engine.updates.update_pending:
                # on_before_optimizer_step came but optimizer.step() never ran: mixed
                # precision's GradScaler skipped the update (inf/NaN gradients).
                engine.updates.end_step_without_update()
        # (Each interval's summary is published as the engine hands it over: on_interval.)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = self._engine
        if engine is not None and engine.data.batch_bytes is None:
            engine.data.note_batch(batch)  # (what a loader worker would copy to hand it over)
        if self._fetch_timer is not None:
            self._fetch_timer.batch_started()
        if self._paused:
            self._resume()  # (after the fetch, which resumes first; not with dataloader_iter)
        elif (
            engine is not None
            and engine.data.batch_bytes is not None
            and isinstance(self._fetch_timer, _FetchHooks)
            and type(getattr(trainer.fit_loop, "_data_fetcher", None)).__name__ != "_DataLoaderIterDataFetcher"
            and _defined_by(type(self), "on_train_batch_start", _DTProfileLogic)
        ):
            # Nothing left for this hook to do in this fit: each batch's transfer follows
            # its fetch, which resumes a paused run. Each hook the Trainer calls costs a
            # batch a profiler context and a call. (A subclass's own stays.)
            self.on_train_batch_start = None  # type: ignore[method-assign, assignment]  # (Lightning skips None)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._resume()
        engine = self._engine
        if engine is not None and engine.active and trainer.current_epoch > 0:
            loader = getattr(trainer, "train_dataloader", None)
            if loader is not None:  # reload_dataloaders_every_n_epochs may bring another
                engine.note_loader(loader)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # The epoch's end is not a training step: the module's on_train_epoch_end and
        # checkpoints saved at the epoch's end stay out, until the next epoch starts.
        self._pause()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._pause()  # validation inside fit is not a training step

    # No on_validation_end: Lightning runs ModelCheckpoint's (a save on the validation
    # metric) after every other callback's, so validation is left out until training
    # resumes (the next fetch, batch or epoch).

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop(trainer, complete=True)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop(trainer, complete=False)  # only does something when on_train_end never came

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop(trainer, complete=False)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        engine = self._engine
        if engine is not None and engine.active and engine.gather is not None:
            # The other ranks may never reach a final gather (they may be gone, or stuck in
            # a collective this rank will not join): report from the figures gathered so
            # far instead of waiting gather_timeout_s before Lightning can clean up.
            engine.gather.abandon()
        self._stop(trainer, complete=False)

    # No state_dict: nothing to checkpoint, and a stateless callback may appear twice
    # (DTPROFILE=1 plus one in the code) without Lightning's duplicate-state error.

    # ------------------------------------------------------------------ internals
    def _resolve_options(self, trainer: Any) -> tuple[Options, Any]:
        every = self._every_n_steps
        if every is None:
            every = getattr(trainer, "log_every_n_steps", None)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                every = _DEFAULT_EVERY_N_STEPS
            # Each interval gathers, summarises and writes: every step or two would slow
            # the training it measures (log_every_n_steps=1 is common for loss curves).
            every = max(every, _MIN_DERIVED_EVERY_N_STEPS)
        logdir, writer = self._options.logdir, None
        if getattr(trainer, "fast_dev_run", False):
            # Lightning suppresses logging and checkpointing in a fast_dev_run: no files
            # either (the report is still there).
            logdir = None
        elif logdir is None and trainer.is_global_zero:
            tb = _tensorboard_logger(trainer)
            if tb is not None:
                writer = tb.experiment  # a SummaryWriter on rank 0
                logdir = tb.log_dir
                _reopen(writer)
            else:
                logdir = os.path.join(trainer.default_root_dir, "dtprofile_logs")
        # Ranks other than 0 write nothing, so they need no directory (and must not ask the
        # logger for its version: that may create directories).
        return dataclasses.replace(self._options, every_n_steps=every, logdir=logdir), writer

    def _start(self, trainer: Any, pl_module: Any) -> None:
        self._class_hooks()  # decided anew for this fit (a last one may not have restored)
        options, writer = self._resolve_options(trainer)
        strategy = trainer.strategy
        plugin = getattr(strategy, "precision_plugin", None)
        marks_update = callable(getattr(plugin, "_after_closure", None))
        engine = Engine(
            options,
            device=strategy.root_device,
            sink_factory=sink_factory(writer, options.logdir),
            framework="lightning",  # the advice names the Trainer's and strategy's arguments
            summarize_every_rank=True,
            # Every interval to the other loggers at its own step, those stop() logs as well.
            on_interval=lambda summary, step: self._publish(trainer, summary, step),
            global_step=lambda: _logger_step(trainer),  # TensorBoard's x-axis is Lightning's
            # Manual optimization may step several optimizers per batch (a GAN): a step is a
            # batch in which any of them stepped.
            steps_end_at_batch=not pl_module.automatic_optimization,
            steps_need_backward=pl_module.automatic_optimization,
            # Manual optimization: training_step (backward, step) runs inside DDP's forward.
            backward_in_forward=not pl_module.automatic_optimization,
            # The closure (forward, backward, clipping) runs inside optimizer.step: the
            # update starts where the precision plugin's _after_closure returns.
            update_start_marked=marks_update,
        )
        self._engine = engine  # (from here, _abandon removes what was attached)
        model = strategy.model
        if model is not None and model is not pl_module:
            engine.attach_module(model)  # DDP (and its communication hook) or another wrapper
        else:
            # Lightning calls training_step directly rather than through the module.
            engine.attach_call(strategy, "training_step", pl_module)
        _check_strategy_hook(strategy, engine)
        for optimizer in trainer.optimizers:
            engine.attach_optimizer(optimizer)
        loader = getattr(trainer, "train_dataloader", None)
        if loader is not None:
            engine.note_loader(loader)
        self._paused = False
        # (The engine's own add: it does nothing unless the engine is measuring.)
        self._fetch_timer = _FetchHooks.attach(trainer, engine.data.add, on_fetch=self._resume) or _FetchTimer(
            trainer.profiler, engine.data.add, on_fetch=self._resume
        )
        self._nested_runs = _NestedRunGuard(trainer.fit_loop, engine)
        if marks_update:
            self._update_starts = _UpdateStarts(plugin, engine)
            if _defined_by(type(self), "on_before_optimizer_step", _DTProfileLogic):
                # The update's start is marked where _after_closure returns, after this
                # hook: it would add nothing but its dispatch to every batch.
                self.on_before_optimizer_step = None  # type: ignore[method-assign, assignment]  # (as above)
            if (
                pl_module.automatic_optimization
                and _runs_closure_inside_step(plugin)
                and _defined_by(type(self), "on_train_batch_end", _DTProfileLogic)
            ):
                # Every update announced runs inside optimizer.step, which closes the step:
                # the batch's end has nothing left to close.
                self.on_train_batch_end = None  # type: ignore[method-assign, assignment]  # (as above)
        engine.data.use_loader()
        engine.start()  # every rank, same point: the ranks meet on the store to start together

    def _pause(self) -> None:
        """Training stops for a while (validation, an epoch's end): left out of the step."""
        if self._fetch_timer is not None:
            self._fetch_timer.batch_started()  # (a transfer while paused is not training's)
        super()._pause()

    def _publish(self, trainer: Any, summary: dict[str, Any] | None, step: int | None = None) -> None:
        """``summary`` into callback_metrics and the other loggers, at ``step`` (its own
        interval's: with several ranks an interval is summarised once its gather completes;
        None: now)."""
        if summary is None or summary is self._published:
            return
        self._published = summary
        headline = self.headline(summary)
        try:
            metrics = trainer.callback_metrics
            for key, value in headline.items():
                metrics[key] = torch.tensor(value)
        except Exception as exc:  # never into training
            log.debug("dtprofile: could not set callback_metrics: %s", exc)
        if trainer.is_global_zero:
            _log_to_other_loggers(trainer, summary, headline, _logger_step(trainer) if step is None else step)

    def _stop(self, trainer: Any, complete: bool) -> None:
        self._stop_run(complete, then=lambda report: self._stopped(trainer, report))

    def _stopped(self, trainer: Any, report: Report) -> None:
        self._publish(trainer, report.to_dict())
        engine = self._engine
        if engine is not None and engine.rank == 0 and os.getpid() != self._creator_pid:
            # A spawned rank 0 (ddp_spawn): leave the report for the launching process.
            _write_json(report.to_dict(), self._handoff)

    def _restore(self) -> None:
        for part in (self._fetch_timer, self._nested_runs, self._update_starts):
            if part is not None:
                try:
                    part.restore()
                except Exception as exc:
                    log.debug("dtprofile: restoring %s failed: %s", type(part).__name__, exc)
        self._fetch_timer = None
        self._nested_runs = None
        self._update_starts = None
        self._class_hooks()  # for the next fit

    def _class_hooks(self) -> None:
        """The per-fit hooks (:data:`_PER_FIT_HOOKS`) back to the class's."""
        for name in _PER_FIT_HOOKS:
            self.__dict__.pop(name, None)


def _log_to_other_loggers(trainer: Any, summary: dict[str, Any], headline: dict[str, float], step: int) -> None:
    """The TensorBoard scalars (same tags) to every logger that is not TensorBoard's.

    TensorBoard gets them, and the advice text, from the engine's sink; a CSV, W&B or
    MLflow logger gets the numbers through ``log_metrics`` at the interval's step, the
    one TensorBoard has them at.
    """
    others = [
        lg
        for lg in getattr(trainer, "loggers", None) or []
        if not any(c.__name__ == "TensorBoardLogger" for c in type(lg).__mro__)
    ]
    if not others:
        return
    try:
        from ..sinks.tags import scalars_from_summary

        values = {**scalars_from_summary(summary), **headline}
        for logger in others:
            logger.log_metrics(values, step=step)
    except Exception as exc:  # never into training
        log.debug("dtprofile: could not log to %s: %s", others, exc)


def _check_strategy_hook(strategy: Any, engine: Engine) -> None:
    hook = getattr(strategy, "_ddp_comm_hook", None)
    if hook is not None and engine.comm.comm_source == "dtprofile" and strategy.root_device.type != "cuda":
        # Lightning registers DDPStrategy(ddp_comm_hook=...) on CUDA only.
        log.info(
            "dtprofile: Lightning did not register ddp_comm_hook=%r on %s (it does so on CUDA only); "
            "timing DDP's default all-reduce",
            getattr(hook, "__qualname__", hook),
            strategy.root_device.type,
        )


def _logger_step(trainer: Any) -> int:
    """The step Lightning's loggers use: batches that stepped (global_step counts every
    optimizer's steps, twice per batch for a GAN)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return step if isinstance(step, int) and not isinstance(step, bool) else int(trainer.global_step)


def _write_json(data: dict[str, Any], path: str) -> None:
    from ..summary import write_summary

    write_summary(data, path)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
    _HANDOFFS.discard(path)


# Either package's Callback, chosen at import (mypy sees Any).
_Callback: Any = _pl.Callback


class DTProfileCallback(_DTProfileLogic, _Callback):
    """Profile ``trainer.fit``: compute, gradient communication and data wait per step.

    Same options as :func:`dtprofile.profile` (see :class:`dtprofile.options.Options`),
    all keyword-only; ``every_n_steps`` defaults to the Trainer's ``log_every_n_steps`` (at least 5).
    ``logdir`` overrides where the TensorBoard events and ``dtprofile_summary.json`` go
    (default: the Trainer's TensorBoard logger and its ``log_dir``, else
    ``<default_root_dir>/dtprofile_logs``). After ``fit``, :meth:`report` returns the
    :class:`dtprofile.Report`::

        cb = dtprofile.DTProfileCallback()
        trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[cb])
        trainer.fit(model)
        if trainer.is_global_zero:
            print(cb.report())
    """


# The keywords are the options' (every_n_steps: None takes the Trainer's log_every_n_steps).
_DTProfileLogic.__init__.__signature__ = options_signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)], every_n_steps=None
)

_unified_class: type | None = None


def _callback_class_for(group: str | None) -> type:
    """The callback class whose base the Trainer of ``group`` accepts."""
    global _unified_class
    if not group or not group.startswith("lightning.pytorch"):
        return DTProfileCallback
    try:
        import lightning.pytorch as lpl
    except ImportError:
        return DTProfileCallback
    if issubclass(DTProfileCallback, lpl.Callback):
        return DTProfileCallback
    if _unified_class is None:
        _unified_class = type(
            "DTProfileCallback", (_DTProfileLogic, lpl.Callback), {"__doc__": DTProfileCallback.__doc__}
        )
        _unified_class.__qualname__ = "_UnifiedDTProfileCallback"  # picklable by this name
        globals()["_UnifiedDTProfileCallback"] = _unified_class
    return _unified_class


# ---------------------------------------------------------------------- zero-code attach
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


#: Environment variable -> (option, its parser), derived from :class:`dtprofile.options.Options`.
ENV_OPTIONS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    var: (name, env_parser(name)) for var, name in env_variables().items()
}


def callbacks_factory() -> list[Any]:
    """Entry point for Lightning's ``callbacks_factory`` groups: zero-code attach.

    With ``DTPROFILE=1`` (or true/yes/on) returns ``[DTProfileCallback(**options_from_env())]``,
    otherwise ``[]``. A callback added this way steps aside when the Trainer already has
    one from the code.
    """
    flag = os.environ.get("DTPROFILE", "").strip().lower()
    if flag in _FALSE:
        return []
    if flag not in _TRUE:
        raise ValueError(
            f"DTPROFILE must be one of {_TRUE} (profile) or {tuple(v for v in _FALSE if v)} "
            f"(do not), got {os.environ.get('DTPROFILE')!r}"
        )
    group = None
    try:  # which Trainer is asking: lightning.pytorch or pytorch_lightning
        group = sys._getframe(1).f_locals.get("group")
    except Exception:
        pass
    cls = _callback_class_for(group if isinstance(group, str) else None)
    callback = cls(**options_from_env())
    callback._from_env = True
    return [callback]
