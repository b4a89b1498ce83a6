"""Compatibility path: re-exports dtprofile.sinks.plots."""

from __future__ import annotations

from .sinks.plots import (  # noqa: F401
    BREAKDOWN_PARTS,
    available,
    breakdown_figure,
    figure_to_array,
    render_breakdown,
    render_speedup,
    speedup_figure,
)

__all__ = [
    "available",
    "speedup_figure",
    "breakdown_figure",
    "figure_to_array",
    "render_speedup",
    "render_breakdown",
    "BREAKDOWN_PARTS",
]
