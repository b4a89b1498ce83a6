"""The bounded windows that summarise a rank's steps: ring buffers of their figures.

A window holds the last ``capacity`` steps as rows of :data:`FIELDS` values (each
:class:`~dtprofile.capture.records.StepRecord`'s, or rows computed in batches by
:func:`~dtprofile.capture.rows.simple_rows`), so memory is the same after ten steps
or ten million; :func:`averages` turns its rows into the figures a summary reports.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

__all__ = ["FIELDS", "TIME_FIELDS", "TRIM_FRACTION", "Window", "averages", "block_averages", "trim_count"]


class HasValues(Protocol):
    """What a window takes a step from: its values in :data:`FIELDS` order (a
    :class:`~dtprofile.capture.records.StepRecord`; this module does not import records,
    which builds on it)."""

    def values(self) -> list[float]: ...


# The per-step quantities (docs/measured.md), in the order windows store them.
FIELDS: tuple[str, ...] = (
    "step",
    "data_wait",
    "forward",
    "backward",
    "optimizer",
    "comm_total",
    "comm_exposed",
    "compute",
    "overhead",
    "data_transfer",  # of data_wait, the batch's transfer to the device (Lightning's hooks)
    "comm_buffers",  # of comm_exposed (and comm_total), DDP's buffer broadcast before forward
    "grad_bytes",
)
TIME_FIELDS: tuple[str, ...] = FIELDS[:-1]


#: Share of the steps dropped at each end before averaging (at least one each with three
#: or more steps): rare spikes (a checkpoint, a collection) stay out, while a pattern that
#: repeats, such as a loader's workers handing over batches in pairs (slow, fast, slow,
#: ...), is averaged as the run experienced it. A median would report one half of it.
TRIM_FRACTION = 0.05


def trim_count(n: int) -> int:
    """How many of ``n`` steps are left out at each end before averaging.

    With three or four steps one (the average is the middle one's or two's); with 40, two.

    >>> [trim_count(n) for n in (2, 3, 19, 40, 1000)]
    [0, 1, 1, 2, 50]
    """
    return max(1, int(n * TRIM_FRACTION)) if n >= 3 else 0


class Window:
    """A fixed-capacity ring buffer of step records; averages over what it holds.

    >>> w = Window(capacity=3)
    >>> for ms in (10.0, 20.0, 30.0, 40.0):
    ...     w.add_values([ms] + [0.0] * (len(FIELDS) - 1))
    >>> len(w), w.averages()["step"]
    (3, 30.0)
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self._data = np.full((capacity, len(FIELDS)), np.nan)
        self._capacity = capacity
        self._count = 0
        self._next = 0

    def __len__(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return self._capacity

    def add(self, record: HasValues) -> None:
        """Add one step record (a :class:`~dtprofile.capture.records.StepRecord`)."""
        self.add_values(record.values())

    def add_values(self, values: list[float]) -> None:
        """Add one step given as its values in :data:`FIELDS` order."""
        self._data[self._next] = values
        self._next = (self._next + 1) % self._capacity
        self._count = min(self._count + 1, self._capacity)

    def add_rows(self, rows: np.ndarray) -> None:
        """Add steps given as rows of :data:`FIELDS` values, oldest first (past the
        capacity, the newest are kept).

        >>> w = Window(capacity=3)
        >>> w.add_rows(np.arange(5 * len(FIELDS), dtype=float).reshape(5, -1))
        >>> len(w), w.rows()[:, 0].tolist()
        (3, [24.0, 36.0, 48.0])
        """
        rows = rows[-self._capacity :]
        n = len(rows)
        first = min(n, self._capacity - self._next)
        self._data[self._next : self._next + first] = rows[:first]
        self._data[: n - first] = rows[first:]
        self._next = (self._next + n) % self._capacity
        self._count = min(self._count + n, self._capacity)

    def clear(self) -> None:
        self._count = 0
        self._next = 0

    def rows(self) -> np.ndarray:
        """A copy of the held steps, oldest first, one row of :data:`FIELDS` values each: what
        :func:`averages` reads, for another thread to average while this window goes on
        filling (a copy of a few kilobytes, not the averaging's tens of microseconds)."""
        if self._count == self._capacity:  # (oldest first: the ring's next slot holds the oldest)
            return np.roll(self._data, -self._next, axis=0)
        held: np.ndarray = self._data[: self._count].copy()  # (numpy's stubs type copy() from 3.11 on)
        return held

    def averages(self) -> dict[str, float | None]:
        """Each field over the held steps; ``None`` where never measured (:func:`averages`).

        >>> from dtprofile.capture.records import StepRecord
        >>> w = Window(capacity=8)
        >>> for data, comm in ((1.0, 9.0), (9.0, 1.0), (5.0, 5.0)):
        ...     w.add(StepRecord(20.0 + data + comm, data, 0, 0, 0, comm, comm, 20.0, data + comm, 0))
        >>> a = w.averages()
        >>> a["overhead"] == a["data_wait"] + a["comm_exposed"], a["step"] == a["compute"] + a["overhead"]
        (True, True)
        """
        return averages(self._data if self._count == self._capacity else self._data[: self._count])


def averages(rows: np.ndarray) -> dict[str, float | None]:
    """Each field over ``rows`` (steps, one row of :data:`FIELDS` values each, as
    :meth:`Window.rows` copies them); ``None`` where never measured.

    Times average the same steps: the :data:`TRIM_FRACTION` fastest and slowest by
    step time are left out (:func:`trim_count`), so the
    averages add up as each step does (step = compute + overhead, overhead = data
    wait + exposed communication). ``grad_bytes`` (a size, the same for most steps)
    is the median. ``step_all`` is the mean over every step, the trimmed ones too.

    >>> averages(np.array([[10.0] * len(FIELDS)]))["step"]
    10.0
    """
    n = len(rows)
    if n == 0:
        return {name: None for name in FIELDS}
    k = trim_count(n)
    # A stable sort: of equal steps, the same ones are kept whatever the other columns.
    kept = rows[np.argsort(rows[:, FIELDS.index("step")], kind="stable")[k : n - k]]
    out: dict[str, float | None] = {}
    for i, name in enumerate(FIELDS):
        column = (rows if name == "grad_bytes" else kept)[:, i]
        column = column[~np.isnan(column)]
        if not column.size:
            out[name] = None
        elif name == "grad_bytes":
            out[name] = float(np.median(column))
        else:
            out[name] = float(column.mean())
    # Every step, the trimmed ones too: what the run spent per step in all.
    steps = rows[:, FIELDS.index("step")]
    steps = steps[~np.isnan(steps)]
    out["step_all"] = float(steps.mean()) if steps.size else None
    _passes_from_timed(rows, out)
    _comm_total_from_timed(rows, out)
    return out


def block_averages(rows: np.ndarray, blocks: int) -> list[dict[str, float | None]]:
    """``rows`` (oldest first) cut into ``blocks`` runs of consecutive steps, each
    averaged as :func:`averages` averages the whole; fewer blocks where there are fewer
    than two steps a block, none below four steps.

    >>> [b["step"] for b in block_averages(np.arange(8.0).repeat(len(FIELDS)).reshape(8, -1), 4)]
    [0.5, 2.5, 4.5, 6.5]
    """
    count = min(blocks, len(rows) // 2)
    if count < 2:
        return []
    return [averages(part) for part in np.array_split(rows, count)]


def _passes_from_timed(rows: np.ndarray, out: dict[str, Any]) -> None:
    """``forward`` and ``backward`` where only a sample of the steps timed them
    (``backward_timed_steps``; without a process group: ``backward_timing_every``): the
    mean over all of them, the trimmed ones too, since timing makes a step a little
    slower and the trim would leave out the timed ones first."""
    for name in ("forward", "backward"):
        values = rows[:, FIELDS.index(name)]
        timed = np.isfinite(values)
        if name == "backward":
            out["backward_timed_steps"] = int(timed.sum())
        if timed.any() and not timed.all():
            out[name] = float(values[timed].mean())


def _comm_total_from_timed(rows: np.ndarray, out: dict[str, Any]) -> None:
    """``comm_total`` where only some steps timed every bucket (``comm_timed_steps``).

    The exposed wait is measured on every step, the hidden part of communication
    (total - exposed) only on the timed ones: the total is the exposed average plus
    their hidden average, so that it never falls below the exposed one. All timed
    steps count, the trimmed ones too (they are few, and timing makes them slower).
    """
    total = rows[:, FIELDS.index("comm_total")]
    exposed = rows[:, FIELDS.index("comm_exposed")]
    timed = ~np.isnan(total)
    out["comm_timed_steps"] = int(timed.sum())
    if out["comm_exposed"] is None or timed.all() or not timed.any():
        return
    hidden = total[timed] - np.nan_to_num(exposed[timed])
    out["comm_total"] = out["comm_exposed"] + max(0.0, float(hidden.mean()))
