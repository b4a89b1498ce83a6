"""Log intervals and the run's summary: the cross-rank gather, the summary, the sink.

Every ``every_n_steps`` the step tracker calls :meth:`Intervals.log`. On the training
thread it does only what must happen there: with several ranks, this rank's window
averages go into a non-blocking gather through the job's store (every rank launches
every interval's, in order; rank 0 reads them all, and the other ranks the rows they use:
:mod:`dtprofile.gather`); then a copy of what the summary needs (the window's steps or the gathered
vectors, the engine's moving figures: :class:`~dtprofile.runinfo.RunState`) goes to a
:class:`~dtprofile.sinks.background.BackgroundWorker`. The worker averages, builds the
summary and hands it to the sink, at a small share of wall time: intervals that come
while it rests are coalesced, the newest wins. With one rank, an interval that would
only wait out the rest until the next one replaced it is not even copied: its steps'
figures go into the run's window in a later batch, and its own window is set aside in
case the run stops or pauses before the next one (then :meth:`Intervals.finish` or
:meth:`Intervals.hand_over_aside` hands it over).
Each summary the worker finishes is published (``on_interval``,
:meth:`Intervals.latest`) on the training thread, at the next step close
(:meth:`Intervals.publish`).

At stop, :meth:`Intervals.summary` waits (bounded) for the final gather and builds the
run's summary on the calling thread; :meth:`Intervals.finish` lets the worker finish the
interval pending at once (bounded), then writes the summary file and closes the sink.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from . import __version__, console
from ._torch_internals import join_block_open
from .analysis.advice import json_safe
from .analysis.pipeline_plan import step_timeline
from .analysis.uncertainty import BLOCKS, PROBE_SAMPLES
from .capture.parts import guarded
from .capture.windows import FIELDS, Window, averages, block_averages
from .gather import RankGather, pack, shard_samples_of, unpack
from .run_history import HISTORY_NAME, append_run
from .runinfo import RunState, run_metadata
from .sinks.background import BackgroundWorker
from .summary import build_summary, rank_row
from .summary_file import SCHEMA, SUMMARY_NAME, reserve_summary_space, write_summary_with_reserve

__all__ = ["Intervals", "SINK_STOP_TIMEOUT_S", "FAILED_RUN_GATHER_TIMEOUT_S", "UNEVEN_GATHER_WAIT_S"]

log = logging.getLogger(__name__)

# How long stop() waits for the worker to summarise and write the interval still pending.
SINK_STOP_TIMEOUT_S = 30.0
#: Seconds the final gather of a run that ended by an exception waits for the other ranks.
FAILED_RUN_GATHER_TIMEOUT_S = 3.0
#: Under DDP's join(), how long a rank's final gather waits for the others (who may need
#: this rank's join to go on) before it reports its own figures.
UNEVEN_GATHER_WAIT_S = 3.0
#: The stages whose timelines rank 0 reads for the summary's picture of one step, at most.
MAX_TIMELINE_STAGES = 64
# The rank note that carries a pipeline stage's sampled step timelines.
PIPELINE_TIMELINES = "pipeline_timelines"


def _local_row(
    rank: int,
    steps: np.ndarray,
    probes: np.ndarray,
    alone: np.ndarray,
    collectives: dict[str, float | None] | None = None,
    pipeline_stage: int | None = None,
    pipeline_wait: float | None = None,
) -> dict[str, Any]:
    """This rank's row for the summary from its steps, probe steps and probe steps whose
    passes ran alone (``Window.rows``, oldest first), with its blocks of steps and its
    latest probe steps for the intervals (:mod:`dtprofile.analysis.uncertainty`), its
    mesh's collectives per step (:meth:`~dtprofile.capture.mesh_comm.MeshComm.row_values`)
    and its first pipeline stage and its waits for the pipeline's neighbours."""
    samples = [
        dict(zip(FIELDS, (None if np.isnan(v) else float(v) for v in row), strict=False))
        for row in probes[-PROBE_SAMPLES:]
    ]
    return rank_row(
        rank,
        len(steps),
        averages(steps),
        len(probes),
        averages(probes),
        len(alone),
        averages(alone) if len(alone) else {},
        blocks=block_averages(steps, BLOCKS),
        probe_samples=samples,
        collectives=collectives,
        pipeline_stage=pipeline_stage,
        pipeline_wait=pipeline_wait,
    )


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass
class _Interval:
    """One log interval as the training thread hands it to the worker: copies only."""

    step: int  # the log step it is logged at
    state: dict[str, Any]  # RunState.take(): the engine's moving figures at the interval
    vectors: list[list[float]] | None  # the ranks' gathered vectors; None: this rank's steps below
    window: np.ndarray | None  # this rank's interval steps (Window.rows), averaged on the worker
    probes: np.ndarray | None  # and its probe steps
    alone: np.ndarray | None  # and its probe steps whose passes ran alone
    to_sink: bool  # rank 0 writes it (its step is past the last written)


class Intervals:
    """The engine's log intervals and summaries.

    Args:
        engine: the :class:`~dtprofile.engine.Engine` whose parts are summarised.
        sink_factory: makes the sink (rank 0; see the engine).
        summarize_every_rank: build each interval's summary on every rank.
        on_interval: called with ``(summary, step)`` for each interval summarised, on the
            training thread.
    """

    def __init__(
        self,
        engine: Any,
        sink_factory: Callable[[], Any] | None,
        summarize_every_rank: bool,
        on_interval: Callable[[dict[str, Any], int], None] | None,
    ) -> None:
        self.engine = engine
        self.parts = engine.parts
        self.summarize_every_rank = summarize_every_rank
        self.on_interval = on_interval
        self.gather: RankGather | None = None
        self.sink: Any = None
        # Summaries the worker finished, for publish() on the training thread. Between two
        # step closes (and at stop) it finishes at most the job it runs and the one pending.
        self.unpublished: deque[tuple[dict[str, Any], int]] = deque(maxlen=2)
        self._sink_factory = sink_factory
        self._worker: BackgroundWorker | None = None
        self._run_state = RunState(engine)
        self._summary_reserve: str | None = None  # disk space held for the final summary (rank 0)
        self._latest: tuple[dict[str, Any] | None, int | None] = (None, None)  # one tuple: read whole from any thread
        self._final = False  # the run's summary is latest(): the worker's no longer replace it
        self._last_logged_step = -1
        self._last_log_s = float("-inf")  # time.monotonic() at the last interval
        # The interval set aside (one rank): its log step and the steps seen at its end.
        self._aside_step: int | None = None
        self._aside_steps_total = 0
        self._hosts: dict[int, str] = {}  # rank 0, at the final summary: each rank's host

    def start(self) -> None:
        """The gather (through the job's store); on rank 0 the sink and the summary's disk
        space; the worker where intervals are summarised."""
        engine = self.engine
        # Ranks that summarise every interval read its gathered rows, and so do the ranks of a
        # sharded model (each combines every interval's gradient-noise shards, as rank 0 does);
        # otherwise rank 0 alone.
        share = self.summarize_every_rank or engine.comm.fsdp is not None
        self.gather = RankGather(engine.options.gather_timeout_s, share_rows=share)
        # Which ranks share a node: rank 0 reads every rank's host at the final summary
        # (rank_spread's nodes; LOCAL_WORLD_SIZE alone says how many, not which).
        self.gather.post_note("host", socket.gethostname())
        self.parts["gather"].enabled = self.gather.enabled or engine.world_size == 1
        if engine.rank == 0:
            if self._sink_factory is not None:
                try:
                    self.sink = self._sink_factory()
                    self.sink.prepare()
                except Exception as exc:
                    self.parts["sink"].fail(exc)
            if engine.options.logdir is not None:
                self._summary_reserve = reserve_summary_space(engine.options.logdir)
                if self._summary_reserve is not None:
                    # A run that never writes its summary (abandoned, or its engine dropped)
                    # gives the space back all the same, at the latest when the process exits.
                    weakref.finalize(self, _remove_quietly, self._summary_reserve)
        if self._has_sink() or self.summarize_every_rank:
            self._worker = BackgroundWorker(
                self._summarize, on_error=self.parts["summary"].fail, name="dtprofile-intervals"
            )

    def _has_sink(self) -> bool:
        return self.engine.rank == 0 and self.sink is not None and self.parts["sink"].enabled

    def _summarised(self) -> bool:
        """Whether an interval handed over now would be summarised (by the worker, for the
        sink or for every rank)."""
        return (
            self._worker is not None
            and self.parts["summary"].enabled
            and (self._has_sink() or self.summarize_every_rank)
        )

    def latest(self) -> dict[str, Any] | None:
        """The newest summary: the latest interval's the worker finished (published at the
        step close after it), or the run's, from :meth:`summary`."""
        return self._latest[0]

    @property
    def latest_step(self) -> int | None:
        """The log step of :meth:`latest`'s summary."""
        return self._latest[1]

    def latest_with_step(self) -> tuple[dict[str, Any] | None, int | None]:
        """:meth:`latest` and :attr:`latest_step`, read together."""
        return self._latest

    # ------------------------------------------------------------------ each interval
    def _rank_vector(self, window: Window) -> list[float]:
        engine = self.engine
        row = self._this_rank(window)
        return pack(row, engine.telemetry.vector(), engine.noise.shard_vector())

    def _rows(self, vectors: list[list[float]] | None, window: Window) -> list[dict[str, Any]]:
        if not vectors:
            return [self._this_rank(window)]
        rows = unpack(vectors)
        for row in rows:
            if row["rank"] in self._hosts:
                row["host"] = self._hosts[row["rank"]]
        return rows

    def _read_hosts(self, vectors: list[list[float]] | None) -> None:
        """Rank 0, holding the ranks' final vectors: each rank's host (its note, in the
        store by then), for the rows; none where the gather did not complete."""
        self._hosts = {}
        if vectors and self.engine.rank == 0 and self.gather is not None:
            notes = self.gather.read_notes("host", range(len(vectors)))
            self._hosts = {r: h for r, h in notes.items() if isinstance(h, str) and h}

    def _add_pipeline_timeline(self, summary: dict[str, Any], rows: list[dict[str, Any]] | None) -> None:
        """Rank 0, at the final summary of a pipeline: one step's timeline across the
        stages (``pipeline.timeline``), read from the ranks of rank 0's pipeline (the only
        ones that post theirs), at most :data:`MAX_TIMELINE_STAGES` of them."""
        pipe, engine = summary.get("pipeline"), self.engine
        if not isinstance(pipe, dict) or engine.rank != 0:
            return
        try:
            pipe["timeline"] = json_safe(self._pipeline_timeline(rows))  # (the summary file takes no NaN)
        except Exception as exc:  # (the summary stands without its picture)
            console.warn(f"dtprofile: the pipeline's timeline is left out after an internal error: {exc!r}")

    def _pipeline_timeline(self, rows: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        engine = self.engine
        if rows is None or self.gather is None:  # (one rank, or no gather: this rank's own)
            own = engine.pipeline.stage_index()
            stages = [(own if own is not None else 0, engine.rank, engine.pipeline.timelines())]
        else:
            # Rank 0's own pipeline, a rank a pipeline rank (the stage each reported, else its place).
            stage_of: dict[int, Any] = {row["rank"]: row.get("pipeline_stage") for row in rows}
            group = (engine.pipeline.group_ranks or [row["rank"] for row in rows])[:MAX_TIMELINE_STAGES]
            notes = self.gather.read_notes(PIPELINE_TIMELINES, group)
            stages = [
                (int(stage) if (stage := stage_of.get(rank)) is not None else i, rank, notes.get(rank) or [])
                for i, rank in enumerate(group)
            ]
        return step_timeline(stages)

    def _this_rank(self, window: Window) -> dict[str, Any]:
        engine = self.engine
        steps = engine.steps
        return _local_row(
            engine.rank,
            window.rows(),
            steps.probes.rows(),
            steps.alone.rows(),
            engine.mesh.row_values(),
            engine.pipeline.stage_index(),
            engine.pipeline.wait_ms(),
        )

    @guarded("gather")
    def _gather_launch(self, vector: list[float], step: int) -> bool:
        return cast(RankGather, self.gather).launch(vector, tag=step)  # (called with a gather)

    @guarded("gather")
    def _gather_finish(self, vector: list[float], failed: bool = False) -> list[list[float]] | None:
        gather = cast(RankGather, self.gather)  # (called with a gather)
        if failed:
            # Its peers are likely stuck in the collective this rank left: the exception
            # should not wait out gather_timeout_s, nor the gather hold the process's exit.
            return gather.finish(vector, FAILED_RUN_GATHER_TIMEOUT_S)
        ddp = self.engine.comm.ddp
        if ddp is not None and join_block_open(ddp):
            # Stopped inside DDP's join() (uneven inputs), the others go on only once this
            # rank's join shadows their all-reduces: do not keep them waiting; one of their
            # interval gathers takes this rank's final figures.
            return gather.finish(vector, UNEVEN_GATHER_WAIT_S, linger=True)
        return gather.finish(vector)

    def log(self) -> None:
        """Log this interval: at once with one rank; with several, once its gather completes
        (at a later interval or at the end), under this interval's step. The training
        thread launches the gather and copies what the summary needs; the worker does the rest."""
        engine = self.engine
        engine.comm.warn_unmeasured(engine.rank)
        step = engine.log_step()
        steps = engine.steps
        if engine.world_size == 1 and self._summary_would_wait():
            steps.set_interval_aside()
            self._aside_step, self._aside_steps_total = step, steps.steps_seen
            return
        self._aside_step = None
        steps.drop_interval_aside()
        steps.flush()
        interval = steps.interval
        vector = self._rank_vector(interval) if engine.world_size > 1 else None
        launched = vector is not None and self._gather_launch(vector, step)
        self._log_gathered()
        if not launched:  # one rank, or no more gathers: what stands now
            vectors = self.gather.current(vector) if vector is not None and self.gather is not None else None
            self._submit(step, vectors, interval)
        interval.clear()

    def _summary_would_wait(self) -> bool:
        """Whether this interval would go unsummarised if handed over now: nothing
        summarises it, or the worker rests past the next interval's expected end (the
        time since the last one), so that interval's job would replace it first. Fast
        steps log many intervals during one rest, and copying each costs the step that
        ends it hundreds of microseconds."""
        now = time.monotonic()
        since_last_s, self._last_log_s = now - self._last_log_s, now
        # (_summarised(): there is a worker)
        return not self._summarised() or cast(BackgroundWorker, self._worker).rest_left_s() > since_last_s

    def hand_over_aside(self) -> None:
        """The interval set aside, if any, goes to the worker now (on the training thread,
        as training stops or pauses: a loader's pass starts, an evaluation): it would
        otherwise wait for the next interval, which would replace it."""
        if self._aside_step is None:
            return
        step, self._aside_step = self._aside_step, None
        try:
            aside = self.engine.steps.take_interval_aside()
        except Exception as exc:  # never into the training loop
            self.parts["summary"].fail(exc)
            return
        if aside is not None:
            self._submit(step, None, aside, steps_total=self._aside_steps_total)

    def _log_gathered(self) -> None:
        """Log every interval whose cross-rank gather has completed, under its own step."""
        if self.gather is None:
            return
        for step, vectors in self.gather.take_completed():
            self.engine.noise.combine(shard_samples_of(vectors))
            self._submit(cast(int, step), vectors, self.engine.steps.interval)  # (its tags are steps)

    def _submit(
        self, step: int, vectors: list[list[float]] | None, window: Window, steps_total: int | None = None
    ) -> None:
        """Hand an interval to the worker (newest wins): copies of the gathered vectors, or
        of this rank's steps, and of the engine's moving figures (those of now, but the
        step count ``steps_total`` where given: an interval handed over after its end)."""
        if not self._summarised():
            return
        worker = cast(BackgroundWorker, self._worker)  # (_summarised(): there is one)
        to_sink = self._has_sink() and step > self._last_logged_step
        if to_sink:  # steps only grow (a take-back of split steps lowers steps_seen)
            self._last_logged_step = step
        try:
            local = not vectors
            steps = self.engine.steps
            state = self._run_state.take()
            if steps_total is not None:
                state["steps_total"] = steps_total
            job = _Interval(
                step,
                state,
                vectors or None,
                window.rows() if local else None,
                steps.probes.rows() if local else None,
                steps.alone.rows() if local else None,
                to_sink,
            )
        except Exception as exc:  # never into the training loop
            self.parts["summary"].fail(exc)
            return
        worker.submit(job)

    def _summarize(self, job: _Interval) -> None:
        """One interval, on the worker's thread: its rows, its summary, then the sink."""
        part = self.parts["summary"]
        if not part.enabled:
            return
        try:
            if job.vectors:
                rows = unpack(job.vectors)
            else:
                # (without vectors the job holds this rank's steps)
                window, probes, alone = cast(
                    "tuple[np.ndarray, np.ndarray, np.ndarray]", (job.window, job.probes, job.alone)
                )
                rows = [_local_row(self.engine.rank, window, probes, alone, job.state.get("mesh_comm"))]
            # (no intervals: their replicates would compete with the training for the
            # interpreter every log interval; the final summary and a report hold them)
            summary = build_summary(
                rows, run_metadata(self.engine, rows, job.state), self.engine.options, complete=True, intervals=False
            )
        except Exception as exc:
            part.fail(exc)
            return
        self.unpublished.append((summary, job.step))
        sink = self.parts["sink"]
        if job.to_sink and sink.enabled:
            try:
                self.sink.log(summary, job.step)
            except Exception as exc:  # the sink part is switched off; summaries go on
                sink.fail(exc)

    def publish(self) -> None:
        """On the training thread (at a step close, and at stop): the summaries the worker
        finished become :meth:`latest`, and go to ``on_interval``, oldest first."""
        while self.unpublished:  # the worker only appends: this thread alone takes
            summary, step = self.unpublished.popleft()
            if not self._final:
                self._latest = (summary, step)
            if self.on_interval is not None:
                try:
                    self.on_interval(summary, step)
                except Exception as exc:
                    log.debug("dtprofile: on_interval failed: %s", exc)

    # ------------------------------------------------------------------ the run's summary
    def summary(self, final: bool, complete: bool, failed: bool = False) -> dict[str, Any]:
        """The run's summary now: ``final`` gathers every rank's whole-run figures (at
        stop); otherwise this rank's figures so far. Never raises."""
        engine = self.engine
        run = engine.steps.run
        summary: dict[str, Any] | None
        try:
            if final or engine.steps.on_own_thread():  # (another thread reads what is in the windows)
                engine.steps.flush()
            vectors = None
            if engine.world_size > 1 and final and self.gather is not None:
                timelines = engine.pipeline.timelines()
                if timelines and engine.pipeline.shows_timeline(engine.rank, MAX_TIMELINE_STAGES):  # (read by rank 0)
                    self.gather.post_note(PIPELINE_TIMELINES, timelines)  # (set before the final vector)
                vectors = self._gather_finish(self._rank_vector(run), failed)
                self._read_hosts(vectors)
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
            if final and summary is not None:
                self._add_pipeline_timeline(summary, rows if vectors else None)
            if summary is None:  # analysis failed: the bare measurement still stands
                try:
                    summary = build_summary(
                        rows, run_metadata(engine, rows), engine.options, complete=complete, analyze=False
                    )
                except Exception as exc:
                    summary = self._error_summary(exc, complete)
        self._final = self._final or final
        self._latest = (summary, engine.log_step())
        return summary

    def _error_summary(self, exc: BaseException, complete: bool) -> dict[str, Any]:
        """What a summary can say when building it failed: the counts and the error."""
        return {
            "schema": SCHEMA,
            "dtprofile_version": __version__,
            "complete": complete,
            "world_size": self.engine.world_size,
            "steps_total": self.engine.steps.steps_seen,
            "error": f"summary unavailable after an internal error: {type(exc).__name__}: {exc}",
        }

    def _build(self, rows: list[dict[str, Any]], complete: bool) -> dict[str, Any] | None:
        part = self.parts["summary"]
        if part.enabled:
            try:
                return build_summary(rows, run_metadata(self.engine, rows), self.engine.options, complete=complete)
            except Exception as exc:
                part.fail(exc)
        return None

    def finish(self, summary: dict[str, Any]) -> None:
        """At stop, after :meth:`summary`, on every rank: the interval set aside, if any, is
        handed over; the worker runs the interval still pending at once, not after its
        rest (waiting at most :data:`SINK_STOP_TIMEOUT_S`),
        and ends; its summaries are published. Then rank 0 writes the summary file, and
        closes the sink with the run's summary: the file before the images drawn at close
        (they take a while: a Ctrl-C then still leaves the run's figures behind)."""
        engine = self.engine
        self.hand_over_aside()  # the run's last interval, if not handed over when it ended
        worker, self._worker = self._worker, None
        if worker is not None:
            if not worker.stop(SINK_STOP_TIMEOUT_S):
                console.warn(
                    "dtprofile: the last log interval was not summarised and written in time; it may be missing",
                    stacklevel=4,
                )
            if worker.coalesced:
                log.debug(
                    "dtprofile: %d of %d log intervals coalesced into a later one (the worker's share of wall time)",
                    worker.coalesced,
                    worker.coalesced + worker.done,
                )
        self.publish()
        if engine.rank != 0:
            return
        logdir = engine.options.logdir
        if logdir is not None:
            try:
                reserve, self._summary_reserve = self._summary_reserve, None
                write_summary_with_reserve(summary, os.path.join(logdir, SUMMARY_NAME), reserve)
            except Exception as exc:
                console.warn(f"dtprofile: could not write the summary: {exc}", stacklevel=4)
            if summary.get("complete") and engine.options.pool_runs:
                try:  # (a later run of the same job pools this one's figures into its intervals)
                    append_run(logdir, summary)
                except Exception as exc:
                    console.warn(f"dtprofile: could not add this run to {HISTORY_NAME}: {exc}", stacklevel=4)
        part = self.parts["sink"]
        if part.enabled and self.sink is not None:
            try:
                self.sink.close(summary, engine.log_step())
            except Exception as exc:
                part.fail(exc)
