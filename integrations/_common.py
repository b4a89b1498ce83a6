"""What the framework callbacks share (Lightning's and the Transformers Trainer's).

A callback holds one :class:`~dtprofile.engine.Engine` per run (``self._engine``), the
run's :class:`~dtprofile.Report` once it stopped (``self._report``) and whether the
steps are paused (``self._paused``). This mixin gives them the engine's lifecycle as a
callback sees it; each framework's callback adds where its hooks attach. Only the
engine's public calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import console
from ..engine import Engine
from ..options import Options
from ..summary import Report


class EngineCallback:
    """Mixed into a framework's callback class (before the framework's own base)."""

    #: The framework, as the warning of an internal error names it ("Lightning").
    _FRAMEWORK = ""
    #: What :meth:`_current_report` raises before the first run started.
    _NOT_STARTED = ""

    _options: Options
    _engine: Engine | None
    _report: Report | None
    _paused: bool

    # ------------------------------------------------------------------ public
    @property
    def options(self) -> Options:
        """The options this run uses (those the framework decides, once training starts)."""
        return self._engine.options if self._engine is not None else self._options

    @property
    def engine(self) -> Engine | None:
        """The measurement engine of the current (or last) run on this process."""
        return self._engine

    # ------------------------------------------------------------------ internals
    def _current_report(self) -> Report:
        """The last run's report once it stopped; while it runs, the figures so far."""
        engine = self._engine
        if self._report is not None:
            return self._report
        if engine is not None and engine.active:
            return Report(engine.summary(final=False, complete=False))
        if engine is not None and engine.report is not None:
            return engine.report
        raise RuntimeError(self._NOT_STARTED)

    def _pause(self) -> None:
        """Training stops for a while (evaluation, an epoch's end): left out of the step."""
        engine = self._engine
        if engine is not None and engine.active and not self._paused:
            self._paused = True
            engine.steps.exclude_start()

    def _resume(self) -> None:
        """Training goes on (ends :meth:`_pause`); not while the engine is suspended
        (Lightning's tuner runs its trial steps so: their fetches come through the same
        profiler as the run's)."""
        engine = self._engine
        if self._paused and engine is not None and engine.active and not engine.suspended:
            self._paused = False
            engine.steps.exclude_end()

    def _stop_run(self, complete: bool, failed: bool = False, then: Callable[[Report], Any] | None = None) -> None:
        """Stop the run that is measuring (else nothing) and keep its report; ``then``
        receives it. An error abandons the run (:meth:`_abandon`)."""
        engine = self._engine
        if engine is None or not engine.active:
            return
        try:
            self._resume()
            self._restore()
            self._report = engine.stop(complete=complete, failed=failed)
            if then is not None:
                then(self._report)
        except Exception as exc:
            self._abandon(exc)

    def _restore(self) -> None:
        """Put back what the callback patched in the framework for the run."""

    def _abandon(self, exc: BaseException) -> None:
        """An internal error: the run stops being measured (its hooks removed), training
        goes on."""
        console.warn(
            f"dtprofile: the {self._FRAMEWORK} callback stopped after an internal error "
            f"({type(exc).__name__}: {exc}); training continues",
            stacklevel=3,
        )
        self._restore()
        engine = self._engine
        if engine is not None:
            try:
                engine.detach()  # (also the hooks of a start that failed half-way)
                engine.active = False
            except Exception:
                pass
