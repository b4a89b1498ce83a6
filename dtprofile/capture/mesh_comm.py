"""A DeviceMesh's communication in the profiled run: the engine's part for DTensor models.

When the profiled model holds DTensor parameters (``parallelize_module``'s tensor
parallelism, FSDP2's shards), :class:`MeshComm` finds their mesh at attach
(:func:`~dtprofile.capture.mesh.find_mesh`) and installs a
:class:`~dtprofile.capture.collectives.CollectiveTimer` on it, whose phase is the
engine's own pass state. Two things come of it:

- **the step record**: the timer tells this part (its listener) of each functional
  collective, DTensor's, as it launches and as the caller waits for it. Each becomes a
  :data:`~dtprofile.capture.records.MESH_COLLECTIVE` interval of the open step (launch to
  the end of its last wait: communication's total) and each wait a ``comm_waits`` span:
  exposed communication, taken out of the forward, backward or update it lies in, so
  that activation communication is never counted as compute. ``torch.distributed``
  calls (FSDP2's) are FSDP's instrumentation's to record, not this part's.
- **per mesh dimension**: each step's counters (per dimension, kind and phase: count,
  bytes, total and waited ms) over the run's last :data:`~dtprofile.capture.steps.RUN_WINDOW`
  steady steps, averaged as the step figures are (the steps slowest and fastest on the
  host's clock left out, :func:`~dtprofile.capture.windows.trim_count`), which the
  rank's row carries under the flat keys :data:`~dtprofile.mesh_keys.COLL_KEYS`
  (:mod:`dtprofile.mesh_keys`); the summary's ``comm_by_dim`` is their medians over
  the ranks (:func:`dtprofile.analysis.mesh_comm.comm_by_dim`).

On the hot path: the timer's own Python call per collective and per wait, and four
small calls here, each a clock mark; no synchronisation. Spans and intervals are
bounded per step (:data:`~dtprofile.capture.steps.MAX_COLLECTIVES_PER_STEP`). An
internal error warns once and disables the timer (collectives pass straight through);
:meth:`MeshComm.remove` puts back everything it patched.

>>> slot_of({"dims": [{"label": "dp"}, {"label": "tp"}]}, "tp")
'd1'
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import numpy as np
import torch

from .._torch_internals import in_backward
from ..mesh_keys import COLL_FIELDS, COLL_KEYS, KINDS, MAX_MESH_SLOTS, PHASES, coll_key
from .clocks import Clock
from .collectives import CollectiveTimer
from .mesh import MeshInfo, find_mesh
from .parts import Parts
from .records import MESH_COLLECTIVE, CommInterval
from .steps import MAX_COLLECTIVES_PER_STEP, RUN_WINDOW, StepTracker
from .windows import trim_count

__all__ = ["MeshComm", "slot_of"]

log = logging.getLogger(__name__)


def slot_of(mesh: dict[str, Any] | MeshInfo | None, label: str) -> str:
    """The row slot of the timer's group ``label`` ("d<i>" for the mesh's i-th
    dimension, below :data:`MAX_MESH_SLOTS`; else "other")."""
    dims = mesh.dims if isinstance(mesh, MeshInfo) else (mesh or {}).get("dims") or []
    for i, d in enumerate(dims[:MAX_MESH_SLOTS]):
        if (d.label if not isinstance(d, dict) else d.get("label")) == label:
            return f"d{i}"
    return "other"


class MeshComm:
    """The engine's part for a model on a DeviceMesh (see the module's docstring).

    Args:
        steps: the step tracker (the open step, warm-up).
        comm: the communication recorder (its part, the run's ``comm_source``).
        clock: the run's clock (the step's marks; the timer gets its own of the kind).
        parts: the profiler's parts.
        passes: the pass hooks, whose state gives each collective's phase.
    """

    def __init__(self, steps: StepTracker, comm: Any, clock: Clock, parts: Parts, passes: Any) -> None:
        self.steps = steps
        self.comm = comm
        self.clock = clock
        self.parts = parts
        self.passes = passes
        self.info: MeshInfo | None = None
        self.timer: CollectiveTimer | None = None
        self._comm_part = parts["comm"]
        self._mark = clock.mark
        # The open step's intervals and wait span whose end may not come (a collective
        # never waited for in the step, a wait that raised): closed at the step's close.
        self._open: list[CommInterval] = []
        self._span: list[Any] | None = None
        # The run's last RUN_WINDOW steady steps, a row each (a ring): the host's time of
        # the step (ms), then per (slot, kind, phase) its column's four counters.
        self._columns: dict[tuple[str, str, str], int] = {}
        self._steps = np.zeros((0, 1))
        self._closed_at = time.perf_counter()
        self._cached: tuple[int, dict[str, float | None] | None] = (-1, None)
        self.steps_counted = 0
        self._slots: dict[str, str] = {}
        # Device clocks: (the timer's step index, counted) of closed steps not yet read.
        self._held: collections.deque[tuple[int, float | None]] = collections.deque(maxlen=64)

    # ------------------------------------------------------------------ attach
    @property
    def attached(self) -> bool:
        """A mesh was found and its timer is in place."""
        return self.timer is not None and self.timer.installed

    def attach(self, module: torch.nn.Module, c10d: bool) -> bool:
        """Find ``module``'s mesh and install the timer (once per run); False when the model
        holds no DTensor parameter, or timing could not start (warned once).

        ``c10d``: also time ``torch.distributed``'s collectives on the mesh's groups
        (FSDP2's): in the per-dimension figures only, not the step record.
        """
        if self.timer is not None:
            return False
        try:
            info = find_mesh(module)
        except Exception as exc:  # (never into the training program: the mesh goes unseen)
            log.debug("dtprofile: no mesh read from the model: %r", exc)
            return False
        if info is None:
            return False
        timer_clock = type(self.clock)() if self.clock.kind != "perf_counter" else self.clock
        timer = CollectiveTimer(info, clock=timer_clock, phase_of=self._phase, c10d=c10d, listener=self)
        if not timer.install():
            return False
        self.info, self.timer = info, timer
        self._slots = {d.label: slot_of(info, d.label) for d in info.dims}
        return True

    def mesh_dict(self) -> dict[str, Any] | None:
        """The mesh as the summary's ``mesh`` holds it (None: no mesh)."""
        info = self.info
        if info is None:
            return None
        out = info.to_dict()
        for d in out["dims"]:
            d["slot"] = slot_of(info, d["label"])
        out["timer"] = None if self.timer is None or self.timer.enabled else self.timer.error
        return out

    def start(self) -> None:
        """Profiling starts: the first step's collectives count from now."""
        if self.timer is not None:
            self.timer.begin_step()

    def remove(self) -> None:
        """Put back every packet, function and hook the timer patched (safe to call twice)."""
        timer = self.timer
        if timer is not None:
            try:
                timer.remove()
            except Exception as exc:
                log.debug("dtprofile: collective timer not removed: %r", exc)

    # ------------------------------------------------------------------ the timer's listener
    def _phase(self) -> str:
        """The engine's pass state: backward inside autograd's, forward inside the
        profiled model's training forward (a ``Redistribute`` runs under ``no_grad``
        there), else by grad mode ("other": the update, evaluation)."""
        if in_backward():
            return "backward"
        if self.passes.forward_open:
            return "forward"
        return "forward" if torch.is_grad_enabled() else "other"

    def launched(self, nbytes: int) -> CommInterval | None:
        """A DTensor collective launches: an interval of the open step (None: not
        measuring, work left out of the step, or past the step's limit)."""
        if not self.parts.measuring or not self._comm_part.enabled or self.steps.excluding:
            return None
        step = self.steps.current
        if len(step.comm) >= MAX_COLLECTIVES_PER_STEP:
            return None
        interval = CommInterval(
            start=self._mark(), nbytes=nbytes, bucket=False, kind=MESH_COLLECTIVE, pass_index=len(step.backward)
        )
        step.comm_measured = True
        step.comm.append(interval)
        self._open.append(interval)
        return interval

    def wait_began(self) -> list[Any] | None:
        """The caller waits for one of the step's collectives from now: a span of the
        step's ``comm_waits`` (exposed communication)."""
        waits = self.steps.current.comm_waits
        if len(waits) >= MAX_COLLECTIVES_PER_STEP:
            return None
        span = self._span = [self._mark(), None]
        waits.append(span)
        return span

    def wait_ended(self, span: list[Any]) -> None:
        span[1] = self._mark()

    def completed(self, token: CommInterval, span: list[Any]) -> None:
        token.end = span[1]  # (one mark for both: the step gives each of its marks back once)

    # ------------------------------------------------------------------ steps
    def step_closed(self, step: Any) -> None:
        """A step closed: its open intervals and span end (never the step's wait), its
        counters are read (a device clock's later), and the next step's count from now."""
        timer = self.timer
        if timer is None:
            return
        for interval in self._open:
            if interval.end is None:  # never waited for in the step: no time of its own
                interval.end = interval.start
        self._open.clear()
        span, self._span = self._span, None
        if span is not None and span[1] is None:
            span[1] = span[0]
        try:
            now = time.perf_counter()
            step_ms, self._closed_at = (now - self._closed_at) * 1e3, now
            counted = not step.skipped and step.index >= self.steps.options.warmup_steps
            figures = timer.end_step()
            if figures is not None:
                self._add(figures, step_ms if counted else None)
            elif timer.enabled and timer.installed and timer.clock.kind != "perf_counter":
                self._held.append((timer.step_index, step_ms if counted else None))
            if self._held:
                self._read_held(timer)
            timer.begin_step()
        except Exception as exc:
            timer._fail(exc)

    def _read_held(self, timer: CollectiveTimer) -> None:
        """A device clock's closed steps whose marks the device passed."""
        for figures in timer.poll():
            while self._held and self._held[0][0] < figures["step"]:
                self._held.popleft()  # (dropped by the timer: never read)
            if self._held and self._held[0][0] == figures["step"]:
                self._add(figures, self._held.popleft()[1])

    def _add(self, figures: dict[str, Any], step_ms: float | None) -> None:
        """One step's counters into the ring (``step_ms``: the host's time of the step;
        None: not a steady step, left out)."""
        if step_ms is None:
            return
        columns = self._columns
        entries = [
            ((self._slots.get(label, "other"), kind, phase), c)
            for label, kinds in figures["by_dim"].items()
            for kind, phases in kinds.items()
            for phase, c in phases.items()
        ]
        for key, _ in entries:
            if key not in columns:
                columns[key] = 1 + len(COLL_FIELDS) * len(columns)
        width = 1 + len(COLL_FIELDS) * len(columns)
        if self._steps.shape[1] < width or not len(self._steps):
            grown = np.zeros((RUN_WINDOW, width))  # (a new kind of collective: rare)
            grown[: len(self._steps), : self._steps.shape[1]] = self._steps
            self._steps = grown
        row = self._steps[self.steps_counted % RUN_WINDOW]
        row[:] = 0.0
        row[0] = step_ms
        for key, c in entries:
            at = columns[key]
            row[at : at + 4] += (c["count"], c["bytes"], c["total_ms"], c["waited_ms"])  # ("other": groups share it)
        self.steps_counted += 1

    def row_values(self) -> dict[str, float | None] | None:
        """The per-step means over the run's steady steps so far (the last
        :data:`RUN_WINDOW`, trimmed as the step figures are), under :data:`~dtprofile.mesh_keys.COLL_KEYS`
        (0.0 where none ran; None: no mesh or no step counted yet)."""
        counted = self.steps_counted
        if self.info is None or not counted:
            return None
        if self._cached[0] == counted:
            return dict(self._cached[1] or {})
        rows = self._steps[: min(counted, RUN_WINDOW)]
        n, k = len(rows), trim_count(len(rows))
        kept = rows[np.argsort(rows[:, 0], kind="stable")[k : n - k]]
        means = kept.mean(axis=0)
        out: dict[str, float | None] = dict.fromkeys(COLL_KEYS, 0.0)
        for (slot, kind, phase), at in list(self._columns.items()):
            if kind in KINDS and phase in PHASES:
                for i, field in enumerate(COLL_FIELDS):
                    out[coll_key(slot, kind, phase, field)] = float(means[at + i])
        self._cached = (counted, out)
        return dict(out)
