"""Deprecated location of the run-to-run comparison: use :mod:`dtprofile.analysis.compare`.

This module re-exports every name it offered, for one release.
"""

from __future__ import annotations

from .analysis.compare import (
    COMPARED_RATIOS,
    COMPARED_TIMES,
    MEANING_CHANGES,
    SAME_JOB_MAX_GRAD_BYTES_RATIO,
    SAME_JOB_MAX_PARAM_CHANGE,
    compare_summaries,
    job_differences,
)

__all__ = ["compare_summaries", "job_differences", "COMPARED_TIMES", "COMPARED_RATIOS"]
