"""Compatibility path: re-exports dtprofile.analysis.compare."""

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
