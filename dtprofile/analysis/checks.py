"""Argument checks shared by the analysis' functions: one message for a bad number.

A function of the performance model refuses what it cannot compute with (a negative
byte count, zero devices, NaN) with a one-line ValueError that names the argument and
what it accepts, rather than returning a number that means nothing.
"""

from __future__ import annotations

import math
from typing import Any

from .._values import is_number

__all__ = ["REL_EPS", "ceil_ignoring_noise", "check_gpus", "check_number", "parse_gpu_list"]

#: Float slack for ceil() and comparisons of quantities that are exact in real arithmetic.
REL_EPS = 1e-9


def check_number(
    value: Any, name: str, *, minimum: float = 0.0, strict: bool = False, allow_inf: bool = False
) -> float:
    """``value`` as a float, or a ValueError naming ``name`` and the accepted values.

    Args:
        value: The argument to check (a bool is not a number).
        name: The argument's name, for the message.
        minimum: Smallest accepted value.
        strict: Refuse ``minimum`` itself.
        allow_inf: Accept +inf (a link with no limit).

    Returns:
        The value as a float.

    Example:
        >>> check_number(2, "gpus", minimum=1.0)
        2.0
    """
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    accepted = f"a finite number {bound}" if not allow_inf else f"a number {bound}"
    if not is_number(value):
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ValueError(f"{name} must be {accepted}, got {number!r}")
    if number < minimum or (strict and number == minimum):
        raise ValueError(f"{name} must be {accepted}, got {number!r}")
    return number


def check_gpus(gpus: Any, name: str = "gpus") -> float:
    """A device count: a finite number >= 1, as a float (see :func:`check_number`).

    Args:
        gpus: The argument to check.
        name: The argument's name, for the message.

    Returns:
        The count as a float.
    """
    return check_number(gpus, name, minimum=1.0)


def ceil_ignoring_noise(x: float) -> int:
    """ceil() that ignores float noise: 3.0000000000004 -> 3.

    Args:
        x: A quantity that is exact in real arithmetic.

    Returns:
        The smallest integer >= x, ignoring a relative excess of :data:`REL_EPS`.

    Example:
        >>> ceil_ignoring_noise(3.0000000000004), ceil_ignoring_noise(3.01)
        (3, 4)
    """
    return math.ceil(x - REL_EPS * max(1.0, abs(x)))


def parse_gpu_list(text: str) -> list[int]:
    """GPU counts a person typed (``--gpus``, the tab's what-if): sorted, duplicates dropped.

    Raises:
        ValueError: not positive whole numbers separated by commas.

    Example:
        >>> parse_gpu_list("16, 8,8")
        [8, 16]
    """
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        gpus = sorted({int(t) for t in items})
    except ValueError:
        gpus = []
    if not gpus or gpus[0] < 1:
        raise ValueError(f"invalid GPU list {text!r}: expected positive integers like 8,16,64")
    return gpus
