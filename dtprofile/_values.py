"""Reading numbers out of summaries: one definition, used by every stage after capture.

A summary is JSON: a figure may be missing, ``null``, a bool, NaN or infinite (a run
that measured nothing). Every reader treats all of those as "not measured" (None).

>>> finite(3), finite(True), finite(float("nan")), finite("x")
(3.0, None, None, None)
>>> parse_finite("2.5"), parse_finite(True), parse_finite("inf")
(2.5, None, None)
>>> get({"a": 1}, "a"), get(None, "a")
(1, None)
>>> median([3.0, None, 1.0, 2.0])
2.0
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from numbers import Real
from typing import Any

__all__ = ["finite", "get", "is_number", "median", "parse_finite"]


def is_number(value: Any) -> bool:
    """A real number that is not a bool (``True`` is not a measurement)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, null, bool, nan, inf, not a number)."""
    if not is_number(value):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def parse_finite(value: Any) -> float | None:
    """``value`` as a finite float where ``float()`` takes it, numeric text included; None
    for None, a bool, nan, inf and what ``float()`` refuses.

    What the renderers and the TensorBoard sink show: a hand-edited summary's ``"95"``
    is displayed as the number it says, where :func:`finite` would call it not measured.
    """
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def get(mapping: Any, key: str) -> Any:
    """``mapping[key]`` when ``mapping`` is a mapping that has it, else None."""
    return mapping.get(key) if isinstance(mapping, Mapping) else None


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    kept = [v for v in values if v is not None]
    return float(statistics.median(kept)) if kept else None
