"""Log intervals and the run's summary: the cross-rank gather, the summary, the sink.

Every ``every_n_steps`` the step tracker calls :meth:`Intervals.log`: this rank's window
averages go into a non-blocking all-gather, and each interval is summarised and handed
to the sink (on a thread of its own) once its gather completes. At stop,
:meth:`Intervals.summary` waits (bounded) for the final gather and builds the run's
summary; :meth:`Intervals.write` writes it, the summary file first.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable

from . import __version__, console
from ._torch_internals import join_block_open
from .sinks.background import BackgroundSink
from .capture.parts import guarded
from .capture.records import Window
from .gather import RankGather, pack, shard_samples_of, unpack
from .summary import (SCHEMA, SUMMARY_NAME, build_summary, rank_row, reserve_summary_space,
                      write_summary_with_reserve)
from .runinfo import run_metadata

__all__ = ["Intervals", "SINK_STOP_TIMEOUT_S", "FAILED_RUN_GATHER_TIMEOUT_S", "UNEVEN_GATHER_WAIT_S"]

log = logging.getLogger(__name__)

# How long stop() waits for the background sink to write the intervals still pending.
SINK_STOP_TIMEOUT_S = 30.0
#: Seconds the final gather of a run that ended by an exception waits for the other ranks.
FAILED_RUN_GATHER_TIMEOUT_S = 3.0
#: Under DDP's join(), how long a rank's final gather waits for the others (who may need
#: this rank's join to go on) before it reports its own figures.
UNEVEN_GATHER_WAIT_S = 3.0


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Intervals:
    """The engine's log intervals and summaries.

    Args:
        engine: the :class:`~dtprofile.engine.Engine` whose parts are summarised.
        sink_factory: makes the sink (rank 0; see the engine).
        summarize_every_rank: build each interval's summary on every rank.
        on_interval: called with ``(summary, step)`` for each interval summarised.
    """

    def __init__(self, engine: Any, sink_factory: Callable[[], Any] | None, summarize_every_rank: bool,
                 on_interval: Callable[[dict, int], None] | None) -> None:
        self.engine = engine
        self.parts = engine.parts
        self.summarize_every_rank = summarize_every_rank
        self.on_interval = on_interval
        self.gather: RankGather | None = None
        self.sink: Any = None
        self.latest_step: int | None = None  # the log step of latest()'s interval
        self._sink_factory = sink_factory
        self._sink_thread: BackgroundSink | None = None
        self._summary_reserve: str | None = None  # disk space held for the final summary (rank 0)
        self._last_summary: dict | None = None
        self._last_logged_step = -1

    def start(self) -> None:
        """The side group for the gather; on rank 0 the sink and the summary's disk space."""
        engine = self.engine
        self.gather = RankGather(engine.options.gather_timeout_s)
        self.parts["gather"].enabled = self.gather.enabled or engine.world_size == 1
        if engine.rank != 0:
            return
        if self._sink_factory is not None:
            try:
                self.sink = self._sink_factory()
                self.sink.prepare()
                self._sink_thread = BackgroundSink(self.sink, on_error=self.parts["sink"].fail)
            except Exception as exc:
                self.parts["sink"].fail(exc)
        if engine.options.logdir is not None:
            self._summary_reserve = reserve_summary_space(engine.options.logdir)
            if self._summary_reserve is not None:
                # A run that never writes its summary (abandoned, or its engine dropped)
                # gives the space back all the same, at the latest when the process exits.
                weakref.finalize(self, _remove_quietly, self._summary_reserve)

    def latest(self) -> dict | None:
        """The last summary built: the latest interval's, or the final one after stop()."""
        return self._last_summary

    # ------------------------------------------------------------------ each interval
    def _rank_vector(self, window: Window) -> list[float]:
        engine = self.engine
        probes = engine.steps.probes
        row = rank_row(engine.rank, len(window), window.averages(), len(probes), probes.averages())
        return pack(row, engine.telemetry.vector(), engine.noise.shard_vector())

    def _rows(self, vectors: list[list[float]] | None, window: Window) -> list[dict]:
        if not vectors:
            probes = self.engine.steps.probes
            return [rank_row(self.engine.rank, len(window), window.averages(), len(probes), probes.averages())]
        return unpack(vectors)

    @guarded("gather")
    def _gather_launch(self, vector: list[float], step: int) -> bool:
        return self.gather.launch(vector, tag=step)

    @guarded("gather")
    def _gather_finish(self, vector: list[float], failed: bool = False) -> list[list[float]] | None:
        if failed:
            # Its peers are likely stuck in the collective this rank left: the exception
            # should not wait out gather_timeout_s, nor the gather hold the process's exit.
            return self.gather.finish(vector, FAILED_RUN_GATHER_TIMEOUT_S)
        ddp = self.engine.comm.ddp
        if ddp is not None and join_block_open(ddp):
            # Stopped inside DDP's join() (uneven inputs), the others go on only once this
            # rank's join shadows their all-reduces: do not keep them waiting; one of their
            # interval gathers takes this rank's final figures.
            return self.gather.finish(vector, UNEVEN_GATHER_WAIT_S, linger=True)
        return self.gather.finish(vector)

    def log(self) -> None:
        """Log this interval: at once with one rank; with several, once its gather completes
        (at a later interval or at the end), under this interval's step."""
        engine = self.engine
        engine.comm.warn_unmeasured(engine.rank)
        step = engine.log_step()
        interval = engine.steps.interval
        vector = self._rank_vector(interval) if engine.world_size > 1 else None
        launched = vector is not None and self._gather_launch(vector, step)
        self._log_gathered()
        if not launched:  # one rank, or no more gathers: what stands now
            vectors = self.gather.current(vector) if vector is not None and self.gather is not None else None
            self._log_rows(self._rows(vectors, interval), step)
        interval.clear()

    def _log_gathered(self) -> None:
        """Log every interval whose cross-rank gather has completed, under its own step."""
        if self.gather is None:
            return
        for step, vectors in self.gather.take_completed():
            self.engine.noise.combine(shard_samples_of(vectors))
            self._log_rows(self._rows(vectors, self.engine.steps.interval), step)

    def _log_rows(self, rows: list[dict], step: int) -> None:
        has_sink = self.engine.rank == 0 and self.sink is not None and self.parts["sink"].enabled
        if not (has_sink or self.summarize_every_rank):
            return
        summary = self._build(rows, complete=True)
        if summary is None:
            return
        self._last_summary, self.latest_step = summary, step
        if self.on_interval is not None:
            try:
                self.on_interval(summary, step)
            except Exception as exc:
                log.debug("dtprofile: on_interval failed: %s", exc)
        if has_sink and self._sink_thread is not None and step > self._last_logged_step:
            # Steps only grow (a take-back of split steps lowers steps_seen).
            self._last_logged_step = step
            self._sink_thread.submit(summary, step)

    # ------------------------------------------------------------------ the run's summary
    def summary(self, final: bool, complete: bool, failed: bool = False) -> dict:
        """The run's summary now: ``final`` gathers every rank's whole-run figures (at
        stop); otherwise this rank's figures so far. Never raises."""
        engine = self.engine
        run = engine.steps.run
        try:
            vectors = None
            if engine.world_size > 1 and final and self.gather is not None:
                vectors = self._gather_finish(self._rank_vector(run), failed)
                self._log_gathered()  # intervals whose gathers completed on the way
                if vectors and len(vectors) != engine.world_size:
                    vectors = None
                engine.noise.combine(shard_samples_of(vectors))
            rows = self._rows(vectors, run)
        except Exception as exc:  # never into the training loop, which may be unwinding already
            self.parts["summary"].fail(exc)
            summary = self._error_summary(exc, complete)
        else:
            summary = self._build(rows, complete=complete)
            if summary is None:  # analysis failed: the bare measurement still stands
                try:
                    summary = build_summary(rows, run_metadata(engine, rows), engine.options, complete=complete,
                                            analyze=False)
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
            "world_size": self.engine.world_size,
            "steps_total": self.engine.steps.steps_seen,
            "error": f"summary unavailable after an internal error: {type(exc).__name__}: {exc}",
        }

    def _build(self, rows: list[dict], complete: bool) -> dict | None:
        part = self.parts["summary"]
        if part.enabled:
            try:
                return build_summary(rows, run_metadata(self.engine, rows), self.engine.options, complete=complete)
            except Exception as exc:
                part.fail(exc)
        return None

    def write(self, summary: dict) -> None:
        """The final outputs (rank 0): the summary file first (it is quick, and the images
        after it take a while: a Ctrl-C then still leaves the run's figures behind)."""
        logdir = self.engine.options.logdir
        if logdir is not None:
            try:
                reserve, self._summary_reserve = self._summary_reserve, None
                write_summary_with_reserve(summary, os.path.join(logdir, SUMMARY_NAME), reserve)
            except Exception as exc:
                console.warn(f"dtprofile: could not write the summary: {exc}", stacklevel=4)
        if self._sink_thread is not None and not self._sink_thread.stop(SINK_STOP_TIMEOUT_S):
            console.warn("dtprofile: the TensorBoard writer did not finish in time; the last interval may be "
                         "missing", stacklevel=4)
        part = self.parts["sink"]
        if part.enabled and self.sink is not None:
            try:
                self.sink.close(summary, self.engine.log_step())
            except Exception as exc:
                part.fail(exc)
