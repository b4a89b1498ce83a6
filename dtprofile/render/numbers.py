"""Numbers as the reports show them.

>>> fmt(95.0), fmt(0.8391), fmt(12), fmt(None), fmt_pct(0.3368)
('95.0', '0.839', '12', '-', '33.7%')
>>> fmt_compact(0.34567), fmt_compact(32.0), g_label(8.0), g_label(2.5)
('0.3457', '32', '8', '2.5')
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

from .._values import parse_finite

__all__ = ["fmt", "fmt_pct", "fmt_compact", "g_label", "tag_part"]


def fmt(x: Any, digits: int = 3) -> str:
    """A number for people: ``digits`` significant digits, no exponent for ordinary sizes.

    Args:
        x: A number, numeric text, None, or anything else (shown as ``str(x)``).
        digits: Significant digits; integers and numbers of more digits are shown whole.

    Returns:
        The text; ``-`` for None and for a number that is not finite.

    Example:
        >>> fmt(0.00012345), fmt(1234.5), fmt(float("nan")), fmt("n/a")
        ('0.000123', '1234', '-', 'n/a')
    """
    v = parse_finite(x)
    if v is None:
        return "-" if x is None or isinstance(x, (int, float)) else str(x)
    if v == 0:
        return "0"
    if isinstance(x, numbers.Integral):
        return str(int(v))
    if abs(v) >= 10 ** (digits - 1):
        return f"{v:.0f}"
    if abs(v) < 1e-3:
        return f"{v:.{digits}g}"
    mag = int(math.floor(math.log10(abs(v))))
    decimals = max(0, digits - 1 - mag)
    return f"{v:.{decimals}f}"


def fmt_pct(x: Any) -> str:
    """A fraction as a percentage with one decimal.

    Args:
        x: A fraction (0.25 for 25%), or None.

    Returns:
        ``"25.0%"``; ``-`` when ``x`` is not a finite number.

    Example:
        >>> fmt_pct(0.25), fmt_pct(None)
        ('25.0%', '-')
    """
    v = parse_finite(x)
    return "-" if v is None else f"{100.0 * v:.1f}%"


def fmt_compact(x: Any) -> str:
    """A number as evidence shows it: integers whole, others to 4 significant digits.

    Args:
        x: A number, or anything else (shown as ``str(x)``).

    Returns:
        The text.

    Example:
        >>> fmt_compact(1597480.0), fmt_compact(0.73341), fmt_compact(None)
        ('1597480', '0.7334', 'None')
    """
    v = parse_finite(x)
    if v is None:
        return str(x)
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4g}"


def tag_part(name: Any) -> str:
    """A name made safe for a TensorBoard tag component: letters, digits and ``_ . -``.

    Args:
        name: Anything; its ``str()`` is used.

    Returns:
        The name with every run of other characters replaced by ``_`` (``x`` when
        nothing is left).

    Example:
        >>> tag_part("mem used (MB)"), tag_part("%%")
        ('mem_used_MB', 'x')
    """
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", str(name)).strip("_") or "x"


def g_label(g: Any) -> str:
    """A GPU count as a label (in a table and in a tag): whole counts without ``.0``.

    Args:
        g: A GPU count (a number or numeric text), or anything else.

    Returns:
        ``"8"`` for 8 or 8.0, ``"2.5"`` for 2.5; other values through :func:`tag_part`.

    Example:
        >>> g_label(16), g_label("4"), g_label("n/a")
        ('16', '4', 'n_a')
    """
    v = parse_finite(g)
    if v is None:
        return tag_part(g)
    return str(int(v)) if v == int(v) else tag_part(f"{v:g}")
