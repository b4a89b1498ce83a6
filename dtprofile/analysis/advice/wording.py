"""How the findings write numbers and names: percentages, gains, link speeds, counts.

Example:
    >>> percent(0.1234), gain_text(100.0, 80.0), round_up(0.1484), count_text(2.0)
    ('12.3%', 'step 100.0 -> 80.0 ms (1.25x throughput)', '0.15', '2')
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..._values import finite, get
from .thresholds import STANDARD_LINK_Gbps

__all__ = [
    "borderline_severity",
    "job_words",
    "noise_words",
    "count_text",
    "fsdp_collectives",
    "gain_text",
    "gpus_text",
    "measured_gain",
    "percent",
    "round_up",
    "standard_link",
]

#: ``run.fsdp``'s per-step counts and the collectives they count, in words.
_FSDP_COLLECTIVES = (
    ("all_gathers", "all-gathers"),
    ("reduce_scatters", "reduce-scatters"),
    ("replica_all_reduces", "all-reduces across replicas"),
)


def percent(x: float) -> str:
    """A share as a percentage with one decimal.

    Args:
        x: The share (1.0 is all).

    Returns:
        The text, e.g. '12.3%' for 0.1234.
    """
    return f"{100.0 * x:.1f}%"


def gain_text(step_ms: float, new_step_ms: float, samples_factor: float = 1.0) -> str | None:
    """'step A -> B ms (Nx throughput)', or None when either step is not positive.

    Args:
        step_ms: The step now.
        new_step_ms: The step after the change.
        samples_factor: Samples per new step over samples per step now.

    Returns:
        The phrase; throughput counts ``samples_factor`` x the samples.
    """
    if new_step_ms <= 0 or step_ms <= 0:
        return None
    speed = samples_factor * step_ms / new_step_ms
    return f"step {step_ms:.1f} -> {new_step_ms:.1f} ms ({speed:.2f}x throughput)"


def measured_gain(
    measured_step_ms: float | None, modelled_now_ms: float, modelled_new_ms: float, samples_factor: float = 1.0
) -> str | None:
    """The performance model's change of the step, applied to the measured step.

    The performance model rebuilds the step from its parts and can differ from the median measured
    (probe steps' interference, medians of parts that do not add up), and the gain starts
    from the step the report shows.

    Args:
        measured_step_ms: The step measured; None: the modelled one stands in.
        modelled_now_ms: The performance model's step now.
        modelled_new_ms: Its step after the change.
        samples_factor: Samples per new step over samples per step now.

    Returns:
        The phrase of :func:`gain_text`, or None.
    """
    if measured_step_ms is None:
        return gain_text(modelled_now_ms, modelled_new_ms, samples_factor)
    return gain_text(measured_step_ms, measured_step_ms + modelled_new_ms - modelled_now_ms, samples_factor)


def standard_link(gbps: float) -> str:
    """The slowest common link speed that carries a need, in words.

    Args:
        gbps: The bandwidth needed, in Gbit/s.

    Returns:
        One of :data:`STANDARD_LINK_Gbps` as text ('25 Gbit/s'), or the need itself
        rounded when none is fast enough.
    """
    for speed in STANDARD_LINK_Gbps:
        if speed >= gbps:
            return f"{speed:g} Gbit/s"
    return f"{gbps:.0f} Gbit/s"


def gpus_text(n: Any) -> str:
    """A device count in words: '1 GPU', '8 GPUs'.

    Args:
        n: The count.

    Returns:
        The text.
    """
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def round_up(value: float, digits: int = 2) -> str:
    """``value`` rounded up to ``digits`` significant figures: a bound that still holds
    once rounded.

    Args:
        value: The bound.
        digits: Significant figures kept.

    Returns:
        The text: 0.1484 -> '0.15', 3.304 -> '3.4', 17.2 -> '18'.
    """
    if value <= 0 or not math.isfinite(value):
        return f"{value:g}"
    scale = 10 ** (math.floor(math.log10(value)) - digits + 1)
    return f"{math.ceil(round(value / scale, 9)) * scale:.{max(0, -math.floor(math.log10(scale)))}f}"


def count_text(value: float | None) -> str:
    """A count as a person writes it.

    Args:
        value: The count, or None.

    Returns:
        '2', not '2.0' ('1.5' stays '1.5'); 'unknown' for None.
    """
    if value is None:
        return "unknown"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def fsdp_collectives(fsdp: Mapping[str, Any] | None) -> str:
    """The collectives a sharded step issued, in words.

    Args:
        fsdp: The summary's ``run.fsdp`` (per-step counts of each collective).

    Returns:
        A phrase naming those with a count above 0; all-gathers and reduce-scatters when
        the counts are unknown.

    Example:
        >>> fsdp_collectives({"all_gathers": 9, "reduce_scatters": 5, "replica_all_reduces": 0})
        "FSDP's all-gathers and reduce-scatters"
        >>> fsdp_collectives({"all_gathers": 0, "reduce_scatters": 0, "replica_all_reduces": 5})
        "FSDP's all-reduces across replicas"
    """
    names = [name for key, name in _FSDP_COLLECTIVES if (finite(get(fsdp, key)) or 0) > 0]
    names = names or [name for _, name in _FSDP_COLLECTIVES[:2]]  # counts unknown: the usual pair
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return "FSDP's " + listed


def noise_words(r: Any) -> str:
    """A finding raised only because its interval reaches the threshold, in words."""
    return ", reached within the noise of this job's runs" if r.pooled else ", reached within this run's noise"


def job_words(r: Any, ratio: str) -> str:
    """Where runs of the job were pooled, the share the verdict read: their interval's middle."""
    span = r.span(ratio) if r.pooled else None
    middle = r.decided(ratio, None) if span is not None else None
    return f"; {percent(middle)} in the middle of the job's runs" if middle is not None else ""


def borderline_severity(r: Any) -> str:
    """A finding raised within the noise: ``low`` for a run alone; ``info`` where earlier runs
    were pooled, so that it never displaces the verdict the job's runs share."""
    return "info" if r.pooled else "low"
