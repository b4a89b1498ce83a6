"""The measured step split by how each part scales, and its refined projection.

The paper's bound (:func:`dtprofile.analysis.perf_model.alpha`) keeps all overhead fixed.
The refined model here lets each part of the step scale as it does: forward and backward
with the per-device batch, the optimizer step and unattributed host time not at all, the
data wait per process, and communication that backward can hide only up to backward's
length. :func:`phases_from_summary` reads the split from a summary;
:func:`project_phases` projects it to other device counts.

All times are ms per optimizer step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._values import finite, get
from .checks import check_gpus
from .summary_readers import world_size

__all__ = [
    "DEFAULT_SCALING",
    "SCALING_MODES",
    "StepPhases",
    "phases_from_summary",
    "project_phases",
    "step_parts_ms",
]

#: Scaling modes (docs/measured.md). Weak: per-device batch fixed (usual DDP practice).
SCALING_MODES = ("weak", "strong")
DEFAULT_SCALING = "weak"


@dataclass(frozen=True)
class StepPhases:
    """One optimizer step at the measured device count, split by how each part scales.

    Attributes:
        scalable_ms: Forward + backward: scales with the per-device batch.
        backward_ms: Backward, which bounds how much communication can hide.
        optimizer_ms: The optimizer step: does not scale (every replica repeats it).
        other_ms: Unattributed host time (zero_grad, logging, Python): does not scale.
        data_wait_ms: Per process; scales with the per-device batch when
            ``data_wait_scales``.
        hideable_ms: The communication measured hidden under backward.
        measured_gpus: The ranks the split was measured on.
        interference_ms: What communication's work beside backward added to the step at
            the measured count (probe steps: ``comm_interference``); none on one device.
        alone_ratio: The factor on forward and backward on one device, which has the
            host to itself: the one that makes its compute the summary's
            ``probe.compute_alone_ms`` (probe steps that ran one rank at a time).
        fixed_comm_ms: Communication every step waits for that more replicas do not
            change (a tensor-parallel group's activations): exposed, and scaling with
            the per-device batch as the activations do.
    """

    scalable_ms: float
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    other_ms: float = 0.0
    data_wait_ms: float = 0.0
    hideable_ms: float = 0.0
    measured_gpus: float = 1.0
    interference_ms: float = 0.0
    alone_ratio: float = 1.0
    fixed_comm_ms: float = 0.0


def _batch_factor(gpus: float, measured_gpus: float, scaling: str) -> float:
    """Per-device batch at G' relative to the measured one: 1 (weak), G/G' (strong)."""
    return 1.0 if scaling == "weak" else measured_gpus / gpus


def step_parts_ms(
    phases: StepPhases, batch_factor: float, comm_ms: float, data_wait_scales: bool = True, interference_ms: float = 0.0
) -> dict[str, float]:
    """The refined step (ms) when the per-device batch is ``batch_factor`` x the measured one.

    ``step = k (F + B) + D' + optimizer + other + max(0, comm - min(hideable, k B)) + I + k X``
    with ``D' = k D`` when ``data_wait_scales`` else ``D``, and ``X`` the fixed
    communication (``fixed_comm_ms``: a tensor-parallel group's). Communication that backward
    cannot hide is exposed; backward shrinking with the batch hides less. ``I``: the
    slowdown communication's work causes beside backward, counted as exposed.

    Args:
        phases: The measured step split.
        batch_factor: k, the per-device batch over the measured one.
        comm_ms: Communication per step (ms); NaN when unknown (then exposed is NaN).
        data_wait_scales: Whether the data wait grows with the per-device batch.
        interference_ms: ``I`` at this device count (0 on one device).

    Returns:
        ``{"step", "compute", "data_wait", "comm_exposed", "hideable"}`` in ms.

    Example:
        >>> step_parts_ms(StepPhases(60.0, 40.0, 5.0, 0.0, 2.0, 10.0), 1.0, 30.0)["step"]
        87.0
    """
    k = batch_factor
    data = phases.data_wait_ms * (k if data_wait_scales else 1.0)
    compute = k * phases.scalable_ms + phases.optimizer_ms + phases.other_ms
    hideable = min(phases.hideable_ms, k * phases.backward_ms)
    exposed = comm_ms if math.isnan(comm_ms) else max(0.0, comm_ms - hideable) + interference_ms
    exposed += k * phases.fixed_comm_ms
    return {
        "step": compute + data + exposed,
        "compute": compute,
        "data_wait": data,
        "comm_exposed": exposed,
        "hideable": hideable,
    }


def project_phases(
    phases: StepPhases,
    gpus: Sequence[float],
    comm_ms: Callable[[float], float],
    scaling: str = DEFAULT_SCALING,
    data_wait_scales: bool = True,
) -> dict[str, Any]:
    """Refined step time, speedup and efficiency at each device count in ``gpus``.

    Per-device batch factor k = 1 (weak) or G_measured / G (strong); the step is
    :func:`step_parts_ms`. Weak scaling: throughput speedup ``G step(1) / step(G)``;
    strong: ``step(1) / step(G)``; efficiency = speedup / G.

    Under the paper's assumptions (strong scaling, measured on one device, no optimizer
    or other serial part, constant overhead: ``data_wait_scales=False`` and constant
    ``comm_ms``) this is exactly ``G * alpha(R_O, G)`` (see the example).

    Args:
        phases: The measured step split.
        gpus: The device counts to project to (each >= 1).
        comm_ms: The communication time (ms) at G devices (a cost model; 0 at G = 1 for
            all-reduce).
        scaling: ``"weak"`` (per-device batch fixed) or ``"strong"`` (global batch fixed).
        data_wait_scales: Whether the data wait grows with the per-device batch.

    Returns:
        Lists aligned with ``gpus``: ``step_ms``, ``speedup``, ``efficiency``,
        ``compute_ms``, ``data_wait_ms``, ``comm_ms``, ``comm_exposed_ms``,
        ``hideable_ms``; and ``reference_step_ms``, the step at one device.

    Example:
        >>> from dtprofile.analysis.perf_model import projected_speedup
        >>> p = project_phases(StepPhases(80.0, data_wait_ms=20.0), [1, 4], lambda g: 0.0,
        ...                    "strong", data_wait_scales=False)
        >>> p["speedup"][1], projected_speedup(20 / 80, 4)
        (2.5, 2.5)
    """
    if scaling not in SCALING_MODES:
        raise ValueError(f"scaling must be one of {SCALING_MODES}, got {scaling!r}")
    measured = phases.measured_gpus

    alone = phases
    if measured > 1.0 and phases.alone_ratio < 1.0:
        # One device has the host to itself: its passes run as the probes that took turns.
        alone = dataclasses.replace(
            phases,
            scalable_ms=phases.scalable_ms * phases.alone_ratio,
            backward_ms=phases.backward_ms * phases.alone_ratio,
        )

    def at(g: float) -> dict[str, float]:
        comm = float(comm_ms(g))
        parts = step_parts_ms(
            alone if g <= 1.0 else phases,
            _batch_factor(g, measured, scaling),
            comm,
            data_wait_scales,
            _interference_at(phases, g),
        )
        parts["comm"] = comm
        return parts

    reference = at(1.0)["step"]
    out: dict[str, Any] = {  # a list per figure, and reference_step_ms
        k: []
        for k in (
            "step_ms",
            "speedup",
            "efficiency",
            "compute_ms",
            "data_wait_ms",
            "comm_ms",
            "comm_exposed_ms",
            "hideable_ms",
        )
    }
    for g in gpus:
        g = check_gpus(g)
        parts = at(g)
        step = parts["step"]
        if step > 0:
            speedup = (g * reference / step) if scaling == "weak" else reference / step
        else:
            speedup = None
        out["step_ms"].append(step)
        out["speedup"].append(speedup)
        out["efficiency"].append(None if speedup is None else speedup / g)
        out["compute_ms"].append(parts["compute"])
        out["data_wait_ms"].append(parts["data_wait"])
        out["comm_ms"].append(parts["comm"])
        out["comm_exposed_ms"].append(parts["comm_exposed"])
        out["hideable_ms"].append(parts["hideable"])
    out["reference_step_ms"] = reference
    return out


def _interference_at(phases: StepPhases, gpus: float) -> float:
    """The interference at ``gpus`` devices: none on one; with more, scaled as a ring's
    traffic per device, (G - 1) / G against the measured count's."""
    measured = phases.measured_gpus
    if gpus <= 1.0 or measured <= 1.0 or phases.interference_ms <= 0.0:
        return 0.0
    return phases.interference_ms * ((gpus - 1.0) / gpus) / ((measured - 1.0) / measured)


def phases_from_summary(summary: Mapping[str, Any]) -> StepPhases | None:
    """The measured step split for the projection, from ``summary["per_step_ms"]``.

    Missing phases count as 0, except forward and backward: without them all of compute
    minus the optimizer scales. Hidden communication = comm_total - comm_exposed, bounded
    by backward. ``other_ms`` is what the phases leave of compute (host time that does
    not scale).

    Args:
        summary: A run summary.

    Returns:
        The split, or None when no step time was measured.

    Example:
        >>> phases_from_summary({"per_step_ms": {"step": 10.0, "compute": 8.0}}).scalable_ms
        8.0
    """
    per_step = get(summary, "per_step_ms") or {}
    step = finite(get(per_step, "step"))
    data = finite(get(per_step, "data_wait")) or 0.0
    exposed = finite(get(per_step, "comm_exposed"))
    total = finite(get(per_step, "comm_total"))
    compute = finite(get(per_step, "compute"))
    if compute is None:
        if step is None:
            return None
        compute = step - data - (exposed or 0.0)
    compute = max(0.0, compute)
    optimizer = finite(get(per_step, "optimizer")) or 0.0
    forward, backward = finite(get(per_step, "forward")), finite(get(per_step, "backward"))
    # Probe steps measured compute alone: what communication's work added to the ordinary
    # steps' backward is taken out of it (and modelled apart, for more than one device).
    interference = max(0.0, finite(get(per_step, "comm_interference")) or 0.0)
    if backward is not None:
        backward = max(0.0, backward - interference)
    if forward is not None and backward is not None:
        scalable = forward + backward
        other = max(0.0, compute - scalable - optimizer)
    else:
        scalable = max(0.0, compute - optimizer)
        backward = scalable if backward is None else backward
        other = 0.0
    hidden = 0.0
    if total is not None and exposed is not None:
        # Hidden now = comm_total - comm_exposed; bounded by backward, which it overlaps.
        hidden = min(max(0.0, total - exposed), backward)
    # Unmeasured communication (world_size 1, or comm_source null): nothing is known to
    # hide, so all modelled communication counts as exposed (the conservative bound).
    return StepPhases(
        scalable_ms=scalable,
        backward_ms=backward,
        optimizer_ms=optimizer,
        other_ms=other,
        data_wait_ms=data,
        hideable_ms=hidden,
        measured_gpus=float(world_size(summary)),
        interference_ms=interference,
        alone_ratio=_alone_ratio(get(summary, "probe") or {}, compute, scalable),
    )


def _alone_ratio(probe: Mapping[str, Any], compute_ms: float, scalable_ms: float) -> float:
    """The factor on forward + backward that makes one device's compute the summary's
    ``compute_alone_ms`` (one definition of it): the probes' passes, not the average
    step's, are what ran alone, so the factor comes from what running alone saved."""
    slowdown = finite(get(probe, "sharing_slowdown"))
    if slowdown is None or slowdown <= 0:
        return 1.0
    alone = finite(get(probe, "compute_alone_ms"))
    if alone is None or scalable_ms <= 0:
        return 1.0 / (1.0 + slowdown)
    return min(1.0, max(0.0, 1.0 - (compute_ms - alone) / scalable_ms))
