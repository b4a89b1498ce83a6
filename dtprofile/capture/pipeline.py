"""Pipeline parallelism in the profiled run: the engine's part for ``torch.distributed.pipelining``.

A pipeline stage's step is its schedule's ``step()``: the stage runs each microbatch's
forward and backward, and between them waits for its neighbours, for the activation it
receives in forward and the gradient it receives in backward. Those waits are the
pipeline's overhead: the bubble at the start and the end of the schedule, and any stage
waiting on a slower neighbour. dtprofile's pass hooks on the stage's module time the
microbatches' forwards and backwards as they do any model's; this part times the waits.

How the schedules communicate (torch 2.13): every schedule launches its point-to-point
operations through ``schedules._batch_p2p(ops, desc)`` (``desc``: "fwd_recv", "fwd_send",
"bwd_recv", "bwd_send"; ``_sorted_batch_p2p`` calls it) and waits for them through
``schedules._wait_batch_p2p(works)``, both looked up by name in their module at call
time. :class:`PipelineComm` replaces the two module attributes by timed wrappers (and
each schedule class's ``step`` by one that reads the schedule once: its class, stage
count, this rank's stages and the microbatch count), and puts all of them back at
:meth:`PipelineComm.remove`:

- each launch becomes a :data:`~dtprofile.capture.records.MESH_COLLECTIVE` interval of the
  open step (launch to the end of its wait), its bytes the operations' tensors';
- each wait a ``comm_waits`` span of the step: exposed communication, taken out of the
  passes and the data wait it lies in (a stage's first receive falls before its first
  forward, where a plain loop's data wait would be);
- per step, the receive and send waits and their bytes, averaged over the steady steps:
  :meth:`PipelineComm.figures` (this rank's; the summary's ``pipeline``);
- every :data:`TIMELINE_EVERY`-th steady step, once its marks are known, its timeline:
  each forward, backward, receive wait, send wait and the update, in the order they ran,
  from the step's start (:meth:`PipelineComm.timelines`, the latest :data:`TIMELINES_KEPT`;
  the same step numbers on every stage, so that the stages' pictures line up).

On the hot path: two Python calls and a clock mark per batch of operations and per wait;
no synchronisation. An internal error warns once and the wrappers pass straight through.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .clocks import mark_reader
from .parts import Parts
from .records import MESH_COLLECTIVE, CommInterval
from .steps import MAX_COLLECTIVES_PER_STEP, StepTracker

__all__ = [
    "MAX_TIMELINE_EVENTS",
    "TIMELINES_KEPT",
    "TIMELINE_EVERY",
    "PipelineComm",
    "pipeline_group_ranks",
    "schedule_info",
    "stage_modules",
]

log = logging.getLogger(__name__)

_SCHEDULES = "torch.distributed.pipelining.schedules"
#: Launches whose wait has not come yet, at most (a schedule waits for each batch it launches).
_MAX_PENDING = 4096
#: A step's timeline is kept every this many steps (by the step's number: the same steps on every stage).
TIMELINE_EVERY = 4
#: The latest timelines kept (the representative one is chosen among them across the stages).
TIMELINES_KEPT = 4
#: Events a timeline holds at most (its first ones: a schedule of hundreds of microbatches).
MAX_TIMELINE_EVENTS = 512
# Steps whose waits are remembered until the step drains (a device clock lags a few).
_MAX_STEPS_WAITING = 64


def _schedules_module() -> Any:
    """``torch.distributed.pipelining.schedules`` when the program imported it, else None
    (a program without pipelines never pays for its import)."""
    return sys.modules.get(_SCHEDULES)


def schedule_info(schedule: Any) -> dict[str, Any] | None:
    """A schedule's class, stage count, this rank's stage indices and microbatch count
    (None: not a pipelining schedule).

    Example:
        >>> schedule_info(object()) is None
        True
    """
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [stage] if stage is not None else None
    microbatches = getattr(schedule, "_n_microbatches", None)
    if not stages or microbatches is None:
        return None
    return {
        "schedule": type(schedule).__name__,
        "stages": int(getattr(stages[0], "num_stages", 0) or 0) or None,
        "stage_indices": [int(getattr(s, "stage_index", -1)) for s in stages],
        "microbatches": int(microbatches),
        "group_size": int(getattr(stages[0], "group_size", 0) or 0) or None,
    }


def pipeline_group_ranks(schedule: Any) -> list[int] | None:
    """The global ranks of this rank's pipeline, in their group's order (stage i on the
    i-th for GPipe and 1F1B; an interleaved schedule's stage i on the (i mod p)-th); None
    when not known (no process group initialised)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    group = getattr(stages[0], "group", None)
    if group is None:  # (the stage's default: every rank of the job)
        return list(range(dist.get_world_size()))
    return [int(r) for r in dist.get_process_group_ranks(group)]


def _group_ranks_or_none(schedule: Any) -> list[int] | None:
    """:func:`pipeline_group_ranks`, None where it fails (only the timeline's choice of
    ranks depends on it: not a reason to stop timing the pipeline)."""
    try:
        return pipeline_group_ranks(schedule)
    except Exception as exc:
        log.debug("dtprofile: the pipeline's ranks not known: %r", exc)
        return None


def stage_modules(schedule: Any) -> list[torch.nn.Module] | None:
    """The modules a schedule's stages on this rank run (``stage.submod``); None when
    ``schedule`` is not a pipelining schedule."""
    if schedule_info(schedule) is None:
        return None
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return [s.submod for s in stages if isinstance(getattr(s, "submod", None), torch.nn.Module)]


def _irecv() -> Any:
    """``torch.distributed.irecv`` (what a receiving ``P2POp`` holds as its ``op``)."""
    import torch.distributed as dist

    return dist.irecv


def _nbytes(ops: Any) -> int:
    total = 0
    for op in ops or ():
        tensor = getattr(op, "tensor", None)
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


class PipelineComm:
    """The engine's part for a pipeline stage (see the module's docstring).

    Args:
        steps: the step tracker (the open step, warm-up).
        clock: the run's clock (the step's marks).
        parts: the profiler's parts.
        comm: the communication recorder (the run's ``comm_source``: "pipeline" for a
            stage that neither DDP nor FSDP reduces).
    """

    def __init__(self, steps: StepTracker, clock: Any, parts: Parts, comm: Any) -> None:
        self.steps = steps
        self.comm = comm
        self.parts = parts
        self.clock = clock
        self._mark = clock.mark
        self._comm_part = parts["comm"]
        self.info: dict[str, Any] | None = None
        self.group_ranks: list[int] | None = None  # this rank's pipeline's ranks (global)
        self.installed = False
        self.enabled = True
        self._undo: list[Callable[[], None]] = []
        # id(work) -> ("recv" | "send", its interval) of launches not yet waited for.
        self._pending: dict[int, tuple[str, CommInterval | None]] = {}
        self._step_recv_ms = self._step_send_ms = self._step_bytes = 0.0
        self._counted = 0
        self._sums = {"recv_wait_ms": 0.0, "send_wait_ms": 0.0, "bytes": 0.0}
        # step number -> its waits' spans, each with its kind ("recv" or "send"): read once the
        # step's marks are known (on the step's clock: a device's timeline on a GPU, where
        # the host does not wait for NCCL's point-to-point operations).
        self._waits: dict[int, list[tuple[str, Any]]] = {}
        self._drained_wait_ms = 0.0
        self._drained_steps = 0
        self._timelines: deque[dict[str, Any]] = deque(maxlen=TIMELINES_KEPT)

    # ------------------------------------------------------------------ install
    def install(self) -> bool:
        """Wrap the schedules' launch, wait and ``step`` (once); False when the program has
        not imported ``torch.distributed.pipelining`` or the wrapping failed (warned)."""
        module = _schedules_module()
        if self.installed or module is None:
            return False
        if getattr(getattr(module, "_wait_batch_p2p", None), "_dtprofile_pipeline", False):
            return False  # (another profiler's wrappers are in place: one at a time)
        try:
            self._wrap(module, "_batch_p2p", self._timed_launch)
            self._wrap(module, "_wait_batch_p2p", self._timed_wait)
            for name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
                cls = getattr(module, name, None)
                if cls is not None and "step" in vars(cls):
                    self._wrap(cls, "step", self._timed_step)
        except Exception as exc:  # (a torch whose schedules differ: the pipeline goes unseen)
            self.remove()
            warnings.warn(f"dtprofile: pipeline communication not measured: {exc!r}", RuntimeWarning, stacklevel=3)
            return False
        self.installed = True
        return True

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        wrapper = make(original)
        wrapper._dtprofile_pipeline = True  # (the guard against wrapping twice)
        setattr(owner, name, wrapper)

        def put_back() -> None:
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)

        self._undo.append(put_back)

    def remove(self) -> None:
        """Put back everything wrapped (safe to call twice)."""
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:
                log.debug("dtprofile: pipeline wrapper not removed: %r", exc)
        self.installed = False

    def _fail(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            warnings.warn(
                f"dtprofile: pipeline communication timing disabled after an internal error: {exc!r}",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------ the wrappers
    def _timed_step(self, original: Any) -> Any:
        part = self

        def step(schedule: Any, *args: Any, **kwargs: Any) -> Any:
            if part.info is None and part.enabled:
                try:
                    part.info = schedule_info(schedule)
                    if part.info is not None:
                        # A pipeline runs: its waits are spans of the step, which the general
                        # path records (the lane opens only after warm-up: shut before it does).
                        part.steps.lane.enabled = False
                        if part.comm.comm_source is None and part.comm.fsdp is None:
                            part.comm.comm_source = "pipeline"
                        part.group_ranks = _group_ranks_or_none(schedule)
                except Exception as exc:
                    part._fail(exc)
            return original(schedule, *args, **kwargs)

        return step

    def _measuring(self) -> bool:
        return (
            self.enabled
            and self.info is not None
            and not self.steps.lane.open
            and self.parts.measuring
            and self._comm_part.enabled
            and not self.steps.excluding
        )

    def _timed_launch(self, original: Any) -> Any:
        part = self

        def _batch_p2p(p2p_ops: Any, desc: str | None = None) -> Any:
            works = original(p2p_ops, desc=desc)
            if part._measuring():
                try:
                    part._launched(works, p2p_ops, desc or "")
                except Exception as exc:
                    part._fail(exc)
            return works

        return _batch_p2p

    def _launched(self, works: Any, ops: Any, desc: str) -> None:
        if not works or len(self._pending) >= _MAX_PENDING:
            return
        step = self.steps.current
        interval = None
        if len(step.comm) < MAX_COLLECTIVES_PER_STEP:
            interval = CommInterval(
                start=self._mark(),
                nbytes=_nbytes(ops),
                bucket=False,
                kind=MESH_COLLECTIVE,
                pass_index=len(step.backward),
            )
            step.comm_measured = True
            step.comm.append(interval)
        self._step_bytes += _nbytes(ops)
        # A batch that receives is waited for as a receive (waiting on a neighbour's data),
        # whatever its desc says (1F1B's "fwd_send_bwd_recv"; the runtime's batches have none).
        receives = any(getattr(op, "op", None) is _irecv() for op in ops or ())
        for work in works:
            self._pending[id(work)] = ("recv" if receives else "send", interval)

    def _timed_wait(self, original: Any) -> Any:
        part = self

        def _wait_batch_p2p(work: Any) -> Any:
            if not part._measuring() or not work:
                return original(work)
            try:
                span = part._wait_began()
            except Exception as exc:
                part._fail(exc)
                return original(work)
            try:
                return original(work)
            finally:
                try:
                    part._wait_ended(span, work)
                except Exception as exc:
                    part._fail(exc)

        return _wait_batch_p2p

    def _wait_began(self) -> tuple[list[Any] | None, float]:
        """The wait's span in the step's ``comm_waits`` (None past the step's limit), and the
        host's time it began (the per-step split into receive and send waits)."""
        began = time.perf_counter()
        waits = self.steps.current.comm_waits
        if len(waits) >= MAX_COLLECTIVES_PER_STEP:
            return None, began
        span = [self._mark(), None]
        waits.append(span)
        return span, began

    def _wait_ended(self, began: tuple[list[Any] | None, float], works: Any) -> None:
        span, host_start = began
        waited_ms = (time.perf_counter() - host_start) * 1e3
        launched = [self._pending.pop(id(w), None) for w in works]
        desc = next((entry[0] for entry in launched if entry is not None), "")
        if desc == "send":
            self._step_send_ms += waited_ms
        else:
            self._step_recv_ms += waited_ms
        if span is None:
            return
        self._waits.setdefault(self.steps.current.index, []).append((desc or "recv", span))
        end = span[1] = self._mark()
        for entry in launched:
            if entry is not None and entry[1] is not None and entry[1].end is None:
                entry[1].end = end  # (one mark for all: the step gives each mark back once)

    # ------------------------------------------------------------------ steps
    def step_closed(self, step: Any) -> None:
        """A step closed: launches never waited for end where they began; the step's waits
        count when it is a steady one."""
        if self.info is None:  # (no schedule has stepped: nothing of this part's in the step)
            return
        for interval in step.comm:
            if interval.kind == MESH_COLLECTIVE and interval.end is None:
                interval.end = interval.start
        self._pending.clear()
        counted = not step.skipped and step.index >= self.steps.options.warmup_steps
        if counted:
            self._sums["recv_wait_ms"] += self._step_recv_ms
            self._sums["send_wait_ms"] += self._step_send_ms
            self._sums["bytes"] += self._step_bytes
            self._counted += 1
        self._step_recv_ms = self._step_send_ms = self._step_bytes = 0.0

    def step_drained(self, step: Any) -> None:
        """A step's marks are known: its waits for the neighbours on the step's clock (a
        steady step's count in :meth:`wait_ms`), and every :data:`TIMELINE_EVERY`-th steady
        step's timeline."""
        if self.info is None:  # (no schedule has stepped: every drained step of any other run)
            return
        waits = self._waits.pop(step.index, None)
        while len(self._waits) > _MAX_STEPS_WAITING:  # (steps that never drained: dropped)
            self._waits.pop(next(iter(self._waits)))
        if not self.enabled or step.skipped or step.index < self.steps.options.warmup_steps:
            return
        try:
            rel = mark_reader(self.clock, step.start)
            self._drained_wait_ms += sum(rel(span[1]) - rel(span[0]) for _, span in waits or ())
            self._drained_steps += 1
            if step.index % TIMELINE_EVERY == 0:
                sends = {id(span) for kind, span in waits or () if kind == "send"}
                self._timelines.append(self._timeline(step, sends, rel))
        except Exception as exc:
            self._fail(exc)

    def wait_ms(self) -> float | None:
        """What a steady step waited for the neighbours, on the step's clock (the mean over
        the steps drained so far; None: none yet): the bubble, apart from any other
        communication the step waited for (data parallel across pipelines)."""
        return self._drained_wait_ms / self._drained_steps if self._drained_steps else None

    def _timeline(self, step: Any, send_ids: set[int], rel: Callable[[Any], float]) -> dict[str, Any]:
        """The step's events from its start, in ms, in the order they began: ``[kind,
        start, end]`` with kind F (a forward), B (a backward), R (a receive wait), S (a
        send wait) or U (the update)."""
        events: list[tuple[str, float, float]] = [("F", rel(a), rel(b)) for a, b in step.forward]
        events += [("B", rel(a), rel(b)) for a, b, _ in step.backward]
        events += [("S" if id(span) in send_ids else "R", rel(span[0]), rel(span[1])) for span in step.comm_waits]
        if step.optimizer is not None:
            events.append(("U", rel(step.optimizer[0]), rel(step.optimizer[1])))
        events.sort(key=lambda e: e[1])
        return {
            "step": step.index,
            "step_ms": round(rel(step.end), 3),
            "events": [[kind, round(a, 3), round(b, 3)] for kind, a, b in events[:MAX_TIMELINE_EVENTS]],
        }

    def timelines(self) -> list[dict[str, Any]]:
        """The latest sampled steps' timelines (``step``, ``step_ms``, ``events``), oldest first."""
        return list(self._timelines)

    def shows_timeline(self, rank: int, most: int) -> bool:
        """Whether ``rank``'s timeline is one the summary shows: a rank of rank 0's pipeline
        (with data parallel across pipelines, the others' stages run alike), among its
        first ``most`` ranks (rank 0 reads those, and only those post theirs)."""
        ranks = self.group_ranks
        if ranks is None:
            return rank < most
        return 0 in ranks and rank in ranks and ranks.index(rank) < most

    def stage_index(self) -> int | None:
        """The first pipeline stage this rank runs (None: no schedule has stepped)."""
        indices = [i for i in (self.info or {}).get("stage_indices", []) if i >= 0]
        return min(indices) if indices else None

    def figures(self) -> dict[str, Any] | None:
        """This rank's schedule and its per-step waits and bytes over the steady steps so
        far (the summary's ``pipeline``, before the analysis adds to it); None: no
        pipeline seen."""
        if self.info is None:
            return None
        n = self._counted
        means = {k: (v / n if n else None) for k, v in self._sums.items()}
        waits = [means["recv_wait_ms"], means["send_wait_ms"]]
        return {
            **self.info,
            "steps_counted": n,
            **means,
            "wait_ms": None if None in waits else sum(w for w in waits if w is not None),
        }
