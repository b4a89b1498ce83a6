"""Deprecated compatibility path (warns when imported): re-exports dtprofile.analysis.compare."""

from __future__ import annotations

from ._deprecated import moved as _moved_to

_moved_to("dtprofile.compare", "dtprofile.analysis.compare")

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
