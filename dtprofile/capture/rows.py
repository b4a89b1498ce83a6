"""Many steps' figures at once: rows of raw marks, in array arithmetic.

A step of the common shape (one forward, one backward, one update, no communication but
DDP's own all-reduce waited for after backward and its broadcast of the buffers in the
forward) is kept as one row of raw marks
(:meth:`~dtprofile.capture.records.PendingStep.raw_marks`) instead of a record of its
own; :func:`simple_rows` turns up to a batch of them into their figures together, with
:meth:`~dtprofile.capture.records.PendingStep.to_record`'s arithmetic for that shape.
"""

from __future__ import annotations

import numpy as np

from .windows import FIELDS

__all__ = ["RAW_COLUMNS", "ROW_SPANS", "simple_rows"]

NAN = float("nan")

#: Spans inside the update that are not the update (Lightning's closure and the hooks
#: after it) one row of :meth:`PendingStep.raw_marks` holds; a step with more is made
#: into a record on its own.
ROW_SPANS = 3
#: The columns of a row of raw marks (seconds), then ROW_SPANS (start, end) pairs.
#: ``reduced``: 1 where DDP reduced the gradients, waited for after backward (from
#: ``backward_end`` to ``backward_synced``), ``grad_bytes`` their bytes. ``device``: 1 for
#: a device timeline's step (its data-wait rules). ``backward_timed``: 0 for a step whose
#: passes were not timed (``backward_timing_every``; the forward and backward figures
#: are NaN). ``buffers_start`` and ``buffers_end``: DDP's broadcast of the buffers
#: inside the forward (blocking: exposed communication, not forward), or equal where
#: there was none.
RAW_COLUMNS: tuple[str, ...] = (
    "own_end",
    "forward_start",
    "forward_end",
    "backward_start",
    "backward_end",
    "backward_synced",
    "update_start",
    "update_end",
    "end",
    "data_wait_s",
    "data_wait_in_forward_s",
    "data_transfer_s",
    "from_loader",
    "reduced",
    "grad_bytes",
    "device",
    "backward_timed",
    "buffers_start",
    "buffers_end",
)
_NO_SPANS = (0.0,) * (2 * ROW_SPANS)  # empty spans: clipped to the update, they cover nothing
_NO_BUFFERS = (0.0, 0.0)  # no broadcast of the buffers


def simple_rows(raw: np.ndarray) -> np.ndarray:
    """The :data:`FIELDS` values, one row per step, of rows of
    :meth:`PendingStep.raw_marks`: :meth:`PendingStep.to_record`'s arithmetic for that
    shape of step, on all of them at once.

    >>> from dtprofile.capture.records import PendingStep
    >>> step = PendingStep(start=0.0)
    >>> step.forward.append((0.001, 0.011)); step.backward.append((0.012, 0.032, 0.032))
    >>> step.optimizer = (0.033, 0.035); step.end = 0.040
    >>> values = simple_rows(np.array([step.raw_marks(from_loader=False)]))[0]
    >>> [round(float(values[FIELDS.index(name)]), 3) for name in ("step", "forward", "backward", "optimizer")]
    [40.0, 10.0, 20.0, 2.0]
    """
    (
        own_end,
        f0,
        f1,
        b0,
        b1,
        b2,
        o0,
        o1,
        end,
        wait_s,
        in_forward_s,
        transfer_s,
        from_loader,
        reduced,
        grad_bytes,
        on_device,
        backward_timed,
        buffers_start,
        buffers_end,
    ) = raw[:, : len(RAW_COLUMNS)].T
    out = np.empty((len(raw), len(FIELDS)))
    column = {name: out[:, i] for i, name in enumerate(FIELDS)}
    # The update is what its span holds besides the passes (a closure's inside
    # optimizer.step) and the framework's work around them (Lightning's clipping):
    # the union of those spans clipped to the update, for each row.
    np.subtract(o1, o0, out=column["optimizer"])
    spans = raw[:, len(RAW_COLUMNS) :]
    if spans.any() or (f1 > o0).any() or (b2 > o0).any():  # (else the loop's update after its passes)
        starts = np.maximum(np.column_stack([f0, b0, spans[:, 0::2]]), o0[:, None])
        ends = np.maximum(np.minimum(np.column_stack([f1, b2, spans[:, 1::2]]), o1[:, None]), starts)
        order = np.argsort(starts, axis=1, kind="stable")
        starts = np.take_along_axis(starts, order, axis=1)
        ends = np.take_along_axis(ends, order, axis=1)
        reach = np.maximum.accumulate(ends, axis=1)  # the furthest end so far
        starts[:, 1:] = np.maximum(starts[:, 1:], reach[:, :-1])
        column["optimizer"] -= np.maximum(0.0, ends - starts).sum(axis=1)
    column["optimizer"] *= 1e3
    step_ms = column["step"]
    np.multiply(end - own_end, 1e3, out=step_ms)
    forward_ms = (f1 - f0) * 1e3
    device = on_device > 0
    # A fetch inside a forward is data wait, not forward; on a device timeline the
    # forward holds just what the device idled, so nothing comes out of it.
    in_forward_ms = np.where(device, 0.0, np.minimum(in_forward_s * 1e3, forward_ms))
    timed = backward_timed > 0  # (forward and backward are timed on the same steps)
    # DDP's broadcast of the buffers blocks inside the forward: communication, not forward.
    buffers_ms = (buffers_end - buffers_start) * 1e3
    column["forward"][:] = np.where(timed, forward_ms - in_forward_ms - buffers_ms, NAN)
    column["backward"][:] = np.where(timed, (b1 - b0) * 1e3, NAN)
    loader = from_loader > 0
    gap_ms = np.maximum(0.0, (f0 - own_end) * 1e3)
    loader_wait_ms = (wait_s - in_forward_s) * 1e3
    # The host may block in next() while the device still runs the last step's kernels:
    # on a device timeline the wait costs only what the device idled for it.
    loader_wait_ms = np.where(device, np.minimum(loader_wait_ms, gap_ms), loader_wait_ms) + in_forward_ms
    data_wait_ms = column["data_wait"]
    data_wait_ms[:] = np.where(loader, loader_wait_ms, gap_ms)
    column["data_transfer"][:] = np.where(loader, np.minimum(transfer_s * 1e3, data_wait_ms), NAN)
    # DDP's own all-reduce: what the step waited for it after backward is exposed, and
    # the broadcast of the buffers in full; the total is measured on the probe steps.
    ddp = reduced > 0
    column["comm_exposed"][:] = np.where(ddp, np.maximum(0.0, (b2 - b1) * 1e3) + buffers_ms, NAN)
    column["comm_buffers"][:] = np.where(ddp, buffers_ms, NAN)
    column["grad_bytes"][:] = grad_bytes
    column["comm_total"][:] = NAN
    np.add(data_wait_ms, np.where(ddp, column["comm_exposed"], 0.0), out=column["overhead"])
    np.subtract(step_ms, column["overhead"], out=column["compute"])
    return out
